"""Reading a scenario: YAML -> ``--set`` overrides -> one parse -> a typed :class:`Scenario`.

The parse is the only validation a scenario gets. For each run (each sweep point, or the
document itself without a sweep) it checks the document against the schema once
(:func:`~.schema.check_document`), builds the typed model (enums for closed choices,
:mod:`.choices`) and checks the cross-field rules once (:func:`~.semantics.check_semantics`,
which resolves the mesh); a sweep's ``sweep`` section is checked on its own first. The
parsed points travel in the :class:`Scenario` (``scenario.points``), so
:func:`sweep_points`, ``build_workload`` and the runner take them as given: a bad point
fails before anything runs, and nothing is checked twice.

``--set key.path=value`` parses ``value`` as YAML (``--set parallel.tp=4``,
``--set run.check=true``, ``--set workload.sizes=[8,16,8]``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from types import MappingProxyType

from .errors import ScenarioError
from .model import ZIP, Scenario, expand_sweep, set_path, sweep_lists
from .schema import check_document, check_section
from .semantics import check_semantics

__all__ = ["load_scenario", "parse_override", "scenario_from_dict", "sweep_points",
           "parse_document"]

_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _yaml_load(text: str):
    """``yaml.safe_load`` that also reads ``1e-4`` as a number (YAML 1.2 floats; PyYAML's
    1.1 rules need a dot, ``1.0e-4``)."""
    import yaml  # lazy: keeps vcluster --help fast

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT,
                                 list("-+0123456789"))
    return yaml.load(text, Loader=Loader)


def parse_override(text: str) -> tuple[str, object]:
    """``"a.b=value"`` -> ``("a.b", yaml(value))``."""
    import yaml  # lazy: keeps vcluster --help fast
    key, sep, raw = str(text).partition("=")
    key = key.strip()
    if not sep or not key or not all(p.isidentifier() for p in key.split(".")):
        raise ScenarioError("--set", text, "KEY.PATH=VALUE, e.g. parallel.tp=4",
                            "not a key path and a value")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"--set {key}", raw, "a YAML value (number, text, true/false, "
                            "[list], {mapping})", f"not valid YAML: {exc}") from None
    return key, value


def _read(path: Path) -> dict:
    import yaml  # lazy: keeps vcluster --help fast
    if not path.is_file():
        raise ScenarioError("FILE", str(path), "an existing scenario YAML file", "no such file")
    try:
        document = _yaml_load(path.read_text("utf-8"))
    except yaml.YAMLError as exc:
        raise ScenarioError("<root>", str(path), "a YAML mapping", f"not valid YAML: {exc}") \
            from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ScenarioError("<root>", document, "a YAML mapping of sections "
                            "(workload, cluster, parallel, run, ...)", "not a mapping")
    return document


def _point_error(exc: ScenarioError, values: dict) -> ScenarioError:
    point = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return ScenarioError(exc.path, exc.value, exc.allowed,
                         f"{exc.reason} (sweep point {point})".strip())


def _swept(path: str, values: dict) -> bool:
    """Whether the error at ``path`` lies on (under, or above) a swept key path."""
    return any(path == p or path.startswith((p + ".", p + "[")) or p.startswith(path + ".")
               for p in values)


def _parse_run(document: dict, name: str, base_dir: str, values: dict) -> Scenario:
    """One run's document (no sweep) -> its checked Scenario: the schema once, the typed
    model, the cross-field rules once. Errors of a sweep point name the point (schema
    errors only when they lie on a swept key: the others are the file's own)."""
    try:
        check_document(document)
    except ScenarioError as exc:
        raise (_point_error(exc, values) if _swept(exc.path, values) else exc) from None
    point = Scenario.from_document(document, name, base_dir)
    try:
        mesh = check_semantics(point)
    except ScenarioError as exc:
        raise (_point_error(exc, values) if values else exc) from None
    return dataclasses.replace(point, mesh=mesh)


def parse_document(document: dict, name: str = "scenario", base_dir: str = ".") -> Scenario:
    """The parser: a plain document (overrides applied) -> a checked, typed
    :class:`Scenario` (see the module docstring). Each run is validated exactly once."""
    sweep = document.get("sweep") if isinstance(document, dict) else None
    if not sweep:
        return _parse_run(document, name, base_dir, {})
    check_section("sweep", sweep)
    zipped = sweep.get(ZIP)
    if zipped and len({len(v) for v in zipped.values()}) > 1:
        lengths = {p: len(v) for p, v in zipped.items()}
        raise ScenarioError("sweep.zip", lengths, "lists of one length (the i-th point "
                            "takes the i-th value of every list)", "lists differ in length")
    points = tuple((values, _parse_run(doc, name, base_dir, values))
                   for values, doc in expand_sweep(document))
    return dataclasses.replace(
        points[0][1], sweep=sweep_lists(sweep),
        document=MappingProxyType(copy.deepcopy(document)), points=points)


def sweep_points(scenario: Scenario) -> list[tuple[dict, Scenario]]:
    """``[({path: value}, the point's Scenario)]``; one point without a sweep. The points
    were checked by the parser: nothing is checked here."""
    return list(scenario.points) if scenario.points else [({}, scenario)]


def scenario_from_dict(document: dict, name: str = "scenario", overrides=(),
                       base_dir: str = ".") -> Scenario:
    """A validated :class:`Scenario` from a plain mapping (see :func:`load_scenario`)."""
    document = copy.deepcopy(document)
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        set_path(document, key, value)
    return parse_document(document, name, base_dir)


def load_scenario(path, overrides=()) -> Scenario:
    """Read, override, validate: a :class:`Scenario`, or :class:`ScenarioError` naming
    the file, the key path, the value and what is allowed."""
    path = Path(path)
    try:
        return scenario_from_dict(_read(path), path.stem, overrides,
                                  str(path.parent.resolve()))
    except ScenarioError as exc:
        raise exc.in_file(str(path)) from None
