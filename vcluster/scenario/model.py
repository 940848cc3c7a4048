"""The scenario model: small frozen dataclasses built from a schema-valid document.

Defaults come from the schema (``default`` of each key), so the schema, the docs and the
model agree. Kind-specific keys (a matmul's ``m, k, n``, an MLP's ``schedule``) stay in
read-only mappings: ``scenario.workload.options["m"]``, ``scenario.parallel["schedule"]``.
Closed choices are enums (:mod:`.choices`): ``run.mode`` a :class:`~.choices.Mode`,
``cluster.array_module`` an :class:`~.choices.ArrayModule`, ``parallel["schedule"]`` a
:class:`~.choices.ScheduleName`, ``parallel["recompute"]`` a :class:`~.choices.Recompute`,
``parallel["algorithm"]`` an :class:`~.choices.Algorithm`, ``data_parallel.mode`` a
:class:`~.choices.DataParallelMode`; each is a ``str``.

:meth:`Scenario.from_document` trusts its document (the parser, :mod:`.load`, checked it);
nothing built from a :class:`Scenario` checks it again.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from . import schema as S
from .choices import Algorithm, ArrayModule, DataParallelMode, Mode, Recompute, ScheduleName
from .errors import ScenarioError

__all__ = ["Scenario", "ClusterSpec", "HardwareChoice", "WorkloadSpec", "RunSpec",
           "ReportSpec", "DataParallelSpec", "set_path", "get_path", "expand_sweep"]

_MISSING = object()

#: parallel keys whose values are closed choices, and their enums
_PARALLEL_CHOICES = MappingProxyType({"schedule": ScheduleName, "recompute": Recompute,
                                      "algorithm": Algorithm})


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


def _typed_parallel(parallel: Mapping) -> dict:
    """``parallel`` with its closed choices as enums (the values are already valid)."""
    return {k: _PARALLEL_CHOICES[k](v) if k in _PARALLEL_CHOICES and v is not None else v
            for k, v in parallel.items()}


def _defaults(properties: Mapping, given: Mapping) -> dict:
    out = {k: copy.deepcopy(p["default"]) for k, p in properties.items() if "default" in p}
    out.update(given)
    return out


@dataclass(frozen=True)
class ClusterSpec:
    """Mesh axes in order (``(("dp", 2), ("tp", 4))``; empty: built from ``parallel``),
    the declared device count (None: not declared) and the array module."""

    mesh: tuple[tuple[str, int], ...] = ()
    devices: int | None = None
    array_module: ArrayModule = ArrayModule.NUMPY


@dataclass(frozen=True)
class HardwareChoice:
    """Exactly one of ``name`` (preset or ``localhost``), ``file``, ``spec``; ``dtype``
    the datasheet peak that prices FLOPs; ``calibration`` a saved localhost spec.
    ``measured`` is not part of the document: ``vcluster run`` sets it to the
    :class:`~vcluster.scenario.hardware.LocalhostCalibrations` its points share."""

    name: str | None = "a100-80gb-dgx"
    file: str | None = None
    spec: Mapping | None = None
    dtype: str = "fp32"
    calibration: str | None = None
    measured: Any = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """What the report calls it: the preset, the file, or the inline spec's name."""
        if self.name:
            return self.name
        if self.file:
            return self.file
        return str((self.spec or {}).get("name", "inline hardware"))


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str
    dtype: str = "float64"
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)   # the kind's keys

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"WorkloadSpec({self.kind!r}, dtype={self.dtype!r}, seed={self.seed}, {opts})"


@dataclass(frozen=True)
class RunSpec:
    mode: Mode = Mode.EMULATE
    steps: int = 1
    check: bool = False
    tolerance: float | None = None     # None: by dtype (see tolerance_for)
    warmup: int = 1                    # untimed runs before the measured one (emulate)

    def tolerance_for(self, dtype: str) -> float:
        if self.tolerance is not None:
            return float(self.tolerance)
        return 1e-4 if dtype == "float32" else 1e-9


@dataclass(frozen=True)
class DataParallelSpec:
    """``data_parallel``: how a training workload's replicas combine their gradients.

    ``zero_stage`` is the ZeRO stage the program runs (0 unless ``mode`` is zero);
    ``servers`` the parameter servers (0 unless ``mode`` is ps) and ``staleness`` their
    bound (0: synchronous). ``DataParallelSpec()`` is DDP, today's behaviour."""

    mode: DataParallelMode = DataParallelMode.DDP
    zero_stage: int = 0
    servers: int = 0
    staleness: int = 0

    @classmethod
    def from_section(cls, section: Mapping) -> "DataParallelSpec":
        """From a schema-valid ``data_parallel`` mapping: the keys of its mode, with the
        schema's defaults (keys of other modes are the parser's errors, not read here)."""
        props = S.scenario_schema()["properties"]["data_parallel"]["properties"]
        given = _defaults(props, section)
        mode = DataParallelMode(given["mode"])
        if mode == DataParallelMode.ZERO:
            return cls(mode, zero_stage=int(given["zero_stage"]))
        if mode == DataParallelMode.PS:
            return cls(mode, servers=int(given["servers"]), staleness=int(given["staleness"]))
        return cls(mode)

    @property
    def label(self) -> str:
        """What ran, for reports: ``ddp``, ``zero-2``, ``ps (1 server, staleness 0)``."""
        if self.mode == DataParallelMode.ZERO:
            return f"zero-{self.zero_stage}"
        if self.mode == DataParallelMode.PS:
            s = "" if self.servers == 1 else "s"
            return f"ps ({self.servers} server{s}, staleness {self.staleness})"
        return "ddp"


@dataclass(frozen=True)
class ReportSpec:
    out: str | None = None
    formats: tuple[str, ...] | None = None      # None: every format


@dataclass(frozen=True, repr=False)
class Scenario:
    """A validated scenario. ``document`` is the plain mapping it was built from (after
    ``--set``); ``sweep`` the varied key paths and their values; ``base_dir`` the folder
    relative paths (hardware files) are read from.

    Made by the parser (:func:`~vcluster.scenario.load.load_scenario`), which checks each
    run once: ``mesh`` is the resolved :class:`mesh.Mesh`; with a sweep, ``points`` holds
    every point's ``({path: value}, Scenario)`` (each checked, without a sweep) and the
    other fields are those of the first point."""

    name: str
    description: str
    cluster: ClusterSpec
    hardware: HardwareChoice
    workload: WorkloadSpec
    parallel: Mapping[str, Any]
    run: RunSpec
    report: ReportSpec
    sweep: tuple[tuple[str, tuple], ...]
    document: Mapping[str, Any]
    base_dir: str = "."
    faults: tuple = ()                          # fault dicts (vcluster.scenario.resilience)
    checkpoint: Mapping[str, Any] = field(default_factory=dict)
    data_parallel: DataParallelSpec = DataParallelSpec()
    # the inference kind's serving engine and its settings, the schema's defaults filled in
    # (vcluster/scenario/workloads/inference.py; the section is refused for other kinds)
    engine: Mapping[str, Any] = field(default_factory=dict)
    mesh: Any = field(default=None, compare=False)       # the resolved Mesh (the parser's)
    points: tuple = field(default=(), compare=False)     # a sweep's parsed points

    def __repr__(self) -> str:
        mesh = "x".join(f"{a}={n}" for a, n in self.cluster.mesh) or "from parallel"
        sweep = f", sweep over {', '.join(p for p, _ in self.sweep)}" if self.sweep else ""
        return (f"Scenario({self.name!r}, {self.workload.kind}, mesh {mesh}, "
                f"mode={str(self.run.mode)!r}, steps={self.run.steps}{sweep})")

    @classmethod
    def from_document(cls, document: Mapping, name: str, base_dir: str = ".") -> "Scenario":
        """Build from a document that passed :func:`~vcluster.scenario.schema.check_document`."""
        doc = copy.deepcopy(dict(document))
        sections = S.scenario_schema()["properties"]
        cluster = doc.get("cluster", {})
        hw = doc.get("hardware", sections["hardware"]["default"])
        hw = {"name": hw} if isinstance(hw, str) else dict(hw)
        if not any(hw.get(k) for k in ("name", "file", "spec")):
            hw["name"] = sections["hardware"]["default"]
        wl = doc["workload"]
        kind = wl["kind"]
        options = _defaults(S._WORKLOAD[kind], {k: v for k, v in wl.items()
                                                if k not in ("kind", "dtype", "seed")})
        parallel = _typed_parallel(_defaults(S._PARALLEL[kind], doc.get("parallel", {})))
        run = _defaults(sections["run"]["properties"], doc.get("run", {}))
        report = doc.get("report", {})
        return cls(
            name=str(doc.get("name", name)), description=str(doc.get("description", "")),
            cluster=ClusterSpec(tuple((str(a), int(n)) for a, n in
                                      cluster.get("mesh", {}).items()),
                                cluster.get("devices"),
                                ArrayModule(cluster.get("array_module", "numpy"))),
            hardware=HardwareChoice(hw.get("name"), hw.get("file"),
                                    _frozen(hw["spec"]) if hw.get("spec") else None,
                                    hw.get("dtype", "fp32"), hw.get("calibration")),
            workload=WorkloadSpec(kind, wl.get("dtype", "float64"), int(wl.get("seed", 0)),
                                  _frozen(options)),
            parallel=_frozen(parallel),
            run=RunSpec(Mode(run["mode"]), int(run["steps"]), bool(run["check"]),
                        run.get("tolerance"), int(run.get("warmup", 1))),
            report=ReportSpec(report.get("out"),
                              tuple(report["formats"]) if "formats" in report else None),
            sweep=sweep_lists(doc.get("sweep", {})),
            document=_frozen(doc), base_dir=str(base_dir),
            faults=tuple(_frozen(f) for f in doc.get("faults", [])),
            checkpoint=_frozen(doc.get("checkpoint", {})),
            data_parallel=DataParallelSpec.from_section(doc.get("data_parallel", {})),
            engine=_frozen(_defaults(sections["engine"]["properties"], doc.get("engine", {}))))

    def point_documents(self) -> list[tuple[dict, dict]]:
        """:func:`expand_sweep` of this scenario's document."""
        return expand_sweep(self.document)


ZIP = "zip"   #: the sweep key whose lists advance together (one point per position)


def sweep_dimensions(sweep: Mapping) -> list[list[dict]]:
    """The sweep's dimensions, in the document's order: each a list of ``{path: value}``
    settings. A key path with a list is one dimension of one-key settings; ``zip`` (a
    mapping of key paths to lists of one length) is one dimension whose i-th setting
    takes the i-th value of every list. The points are the product of the dimensions."""
    dims = []
    for key, values in sweep.items():
        if key == ZIP:
            paths = list(values)
            dims.append([dict(zip(paths, row)) for row in zip(*values.values())])
        else:
            dims.append([{key: v} for v in values])
    return dims


def sweep_lists(sweep: Mapping) -> tuple[tuple[str, tuple], ...]:
    """``(path, values)`` of every swept key path, ``zip``'s paths in place."""
    return tuple((path, tuple(values)) for key, lists in sweep.items()
                 for path, values in (lists.items() if key == ZIP else ((key, lists),)))


def expand_sweep(document: Mapping) -> list[tuple[dict, dict]]:
    """Per sweep point (the product of :func:`sweep_dimensions`, the first slowest):
    ``({path: value}, the document with those values set and no sweep)``; one point
    without a sweep."""
    base = {k: v for k, v in copy.deepcopy(dict(document)).items() if k != "sweep"}
    sweep = dict(document.get("sweep") or {})
    if not sweep:
        return [({}, base)]
    out = []
    for settings in itertools.product(*sweep_dimensions(sweep)):
        values = {path: value for setting in settings for path, value in setting.items()}
        doc = copy.deepcopy(base)
        for path, value in values.items():
            set_path(doc, path, copy.deepcopy(value))
        out.append((values, doc))
    return out


def get_path(document: Mapping, path: str, default=_MISSING):
    node = document
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is _MISSING:
                raise KeyError(path)
            return default
        node = node[part]
    return node


def set_path(document: dict, path: str, value) -> None:
    """Set ``a.b.c`` in a nested dict, creating mappings on the way; a non-mapping on the
    way is replaced only at the last key (``hardware: a100`` then ``hardware.dtype``
    becomes ``{name: a100, dtype: ...}``)."""
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ScenarioError(path, value, "a dotted key path such as parallel.tp",
                            "not a key path")
    node = document
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and ".".join(parts[:i + 1]) == "hardware":
            child = node[part] = {"name": child}
        elif not isinstance(child, dict):
            raise ScenarioError(".".join(parts[:i + 1]), child,
                                "a mapping (to set a key under it)", f"cannot set {path}")
        node = child
    node[parts[-1]] = value
