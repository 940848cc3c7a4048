"""Hardware presets, and user hardware from YAML.

Presets (``PRESET_NAMES``) are data: ``vcluster/timing/data/presets/<name>.yaml``, one
file per preset, every field written with its source::

    device:
      peak_tflops:
        bf16: {value: 2250, source: "NVIDIA DGX B200 datasheet: 72 PF FP8 ... "}

(``vcluster hardware show NAME`` prints each value beside its source; a preset may
start from another with ``base:``). ``load_hardware`` accepts a preset name, a YAML file
path or a dict, in the same shape, sources optional::

    base: a100-80gb-dgx          # optional: start from a preset, override what follows
    name: my-cluster
    network: {nics_per_node: 4}

A full description has the keys of ``hardware_to_dict(preset("a100-80gb-dgx"))``.
Validation is strict: an unknown key, a wrong type or a bad value raises ValueError
naming the key path (``hardware.network.nic.bandwidth_gbps``), the value and what is
allowed.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
from collections.abc import Mapping
from enum import Enum
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from .hardware import DeviceSpec, HardwareSpec, LinkSpec, NetworkSpec, NodeSpec

__all__ = ["PRESET_NAMES", "preset", "load_hardware", "hardware_from_dict",
           "hardware_to_dict", "read_data_csv", "preset_source_gaps"]

# The device FlashAttention-1-class speedups (DeviceSpec.flash_v1_speedup) are relative
# to: that preset's achieved rate is what such kernels run at, times the speedup.
FLASH_V1_REFERENCE_PRESET = "a100-80gb-dgx"

BYTES_PER_GB = 1e9  # datasheet GB are decimal
_DATA_PACKAGE = "vcluster.timing"
_PRESET_DIR = "presets"        # vcluster/timing/data/presets/<name>.yaml
# The presets, in the order `vcluster hardware list` shows them (each a file in
# data/presets/; tests/timing/test_hardware_presets.py keeps the two in step).
PRESET_NAMES = ("a100-40gb-dgx", "a100-80gb-dgx", "h100-dgx", "h200-dgx",
                "b200-dgx", "b300-dgx", "gb200-nvl72", "gb300-nvl72",
                "mi300x", "mi325x", "mi355x")
# fields whose text is itself a source, or a name: they need no source of their own
_SOURCE_FREE = ("name", "source", "device.name", "device.source", "node.source",
                "node.gpu_link.source", "node.host_link.source", "network.source",
                "network.nic.source")


def read_data_csv(filename: str) -> tuple[list[str], list[dict[str, str]]]:
    """(header comment lines without '#', rows as dicts) of ``vcluster/timing/data/<filename>``."""
    text = resources.files(_DATA_PACKAGE).joinpath("data", filename).read_text("utf-8")
    lines = text.splitlines()
    comments = [ln.lstrip("#").strip() for ln in lines if ln.startswith("#")]
    body = "\n".join(ln for ln in lines if ln.strip() and not ln.startswith("#"))
    return comments, list(csv.DictReader(io.StringIO(body)))


def preset(name: str) -> HardwareSpec:
    """The preset ``name`` (one of ``PRESET_NAMES``), read from
    ``vcluster/timing/data/presets/<name>.yaml``: every field written ``{value, source}``
    (:func:`hardware_from_dict`), so ``HardwareSpec.sources`` names where each value
    comes from."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown hardware preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    data = _preset_file(name)
    if data.get("name") != name:
        raise ValueError(f"data/presets/{name}.yaml: name must be {name!r}, "
                         f"got {data.get('name')!r}")
    return hardware_from_dict(data, path=f"preset {name}", origin=f"preset {name}")


@functools.lru_cache(maxsize=None)
def _preset_file(name: str) -> Mapping:
    """The parsed ``data/presets/<name>.yaml`` (read once per process: the files ship with
    the package; callers build new dicts from it and never change it)."""
    import yaml  # why: a core dependency; imported here so `import vcluster` stays light
    text = resources.files(_DATA_PACKAGE).joinpath(
        "data", _PRESET_DIR, f"{name}.yaml").read_text("utf-8")
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def preset_source_gaps(hardware: HardwareSpec) -> list[str]:
    """The field paths of ``hardware`` that have no source (the ones that need none —
    names and the components' own ``source`` texts — left out)."""
    return [path for path in _leaf_paths(hardware_to_dict(hardware))
            if path not in hardware.sources and path not in _SOURCE_FREE]


def _leaf_paths(data: Mapping, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and key not in _OPEN_MAPPINGS:
            out.extend(_leaf_paths(value, path + "."))
        elif isinstance(value, Mapping) and value:       # one source per dtype
            out.extend(f"{path}.{k}" for k in value)
        else:
            out.append(path)
    return out


# --- YAML / dict ----------------------------------------------------------------------
_NESTED = MappingProxyType({
    HardwareSpec: {"device": DeviceSpec, "node": NodeSpec, "network": NetworkSpec},
    NodeSpec: {"gpu_link": LinkSpec, "host_link": LinkSpec}, NetworkSpec: {"nic": LinkSpec}})


# mappings whose keys are data (dtypes), each entry a field of its own
_OPEN_MAPPINGS = ("peak_tflops", "gemm_max_efficiency_by_dtype",
                  "sustained_compute_ratio_by_dtype")


def hardware_to_dict(hardware: HardwareSpec) -> dict:
    """Plain nested dict (str, int, float) that ``hardware_from_dict`` turns back (the
    sources left out: ``HardwareSpec.sources``)."""
    def plain(obj):
        out = {}
        for f in dataclasses.fields(obj):
            if f.name == "sources":
                continue
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                v = plain(v)
            elif isinstance(v, Enum):
                v = v.value
            elif isinstance(v, Mapping):
                v = dict(v)
            elif isinstance(v, tuple) and all(dataclasses.is_dataclass(x) for x in v):
                v = [plain(x) for x in v]          # DeviceSpec.kernels
            out[f.name] = v
        return out
    return plain(hardware)


def hardware_from_dict(data: Mapping, path: str = "hardware",
                       origin: str | None = None) -> HardwareSpec:
    """Build and validate a HardwareSpec; ``base: <preset>`` starts from that preset.

    Any field may be written ``{value: V, source: "where V comes from"}`` instead of
    ``V``; the sources land in ``HardwareSpec.sources`` by field path. A field given
    without one is sourced to ``origin`` (default: ``path``); fields inherited from
    ``base`` keep the base's sources."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of keys, got {data!r}")
    data, sources = _split_sources(data, path)
    given = set(_leaf_paths(data)) - {"base"}
    origin = origin or path
    inherited: dict = {}
    if "base" in data:
        base = data.pop("base")
        if not isinstance(base, str) or base not in PRESET_NAMES:
            raise ValueError(f"{path}.base: must be one of {', '.join(PRESET_NAMES)}, "
                             f"got {base!r}")
        base_hw = preset(base)
        inherited = {k: v for k, v in base_hw.sources.items()
                     if k not in given and not any(k.startswith(g + ".") for g in given)}
        data = _merge(hardware_to_dict(base_hw), data, path)
    own = {p: sources.get(p, f"given in {origin}") for p in given
           if p not in _SOURCE_FREE}
    data["sources"] = {**inherited, **own}
    return _build(HardwareSpec, data, path)


_LEAF_KEYS = frozenset({"value", "source"})


def _split_sources(data: Mapping, path: str, prefix: str = "") -> tuple[dict, dict]:
    """(values, sources) of a description whose fields may be ``{value, source}``."""
    if "sources" in data and not prefix:
        raise ValueError(f"{path}.sources: unknown key 'sources'; write a field's source "
                         f"beside its value: {{value: ..., source: ...}}")
    values, sources = {}, {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if isinstance(value, Mapping) and "value" in value and set(value) <= _LEAF_KEYS:
            source = value.get("source")
            if source is not None and (not isinstance(source, str) or not source.strip()):
                raise ValueError(f"{path}.{where}.source: expected a non-empty text, "
                                 f"got {source!r}")
            values[key] = value["value"]
            if source is not None:                 # a mapping's source covers its fields
                inner = value["value"]
                for leaf in (_leaf_paths(inner, where + ".") if isinstance(inner, Mapping)
                             and inner else [where]):
                    sources[leaf] = source.strip()
        elif isinstance(value, Mapping):
            values[key], inner = _split_sources(value, path, where + ".")
            sources.update(inner)
        else:
            values[key] = value
    return values, sources


def _merge(base: dict, over: Mapping, path: str) -> dict:
    out = dict(base)
    for key, value in over.items():
        if key not in base:
            raise ValueError(f"{path}.{key}: unknown key {key!r}; allowed: {', '.join(base)}")
        if isinstance(base[key], dict):
            if not isinstance(value, Mapping):
                raise ValueError(f"{path}.{key}: expected a mapping, got {value!r}")
            out[key] = ({**base[key], **value}          # dtypes may be added
                        if key in _OPEN_MAPPINGS
                        else _merge(base[key], value, f"{path}.{key}"))
        else:
            out[key] = value
    return out


def _build(cls, data, path):
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    allowed = [n for n in fields if n != "sources"]    # sources: written beside each value
    for key in data:
        if key not in fields:
            raise ValueError(f"{path}.{key}: unknown key {key!r}; allowed: {', '.join(allowed)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{path}.{missing[0]}: missing; required keys: {', '.join(required)}")
    kwargs = {}
    for key, value in data.items():
        sub = _NESTED.get(cls, {}).get(key)
        kwargs[key] = (value if key == "sources" or (sub and value is None) else
                       _build(sub, value, f"{path}.{key}") if sub else _coerce(value))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # messages start with the field name
        raise ValueError(f"{path}.{exc}") from None


def _coerce(value):
    # PyYAML (YAML 1.1) reads "80e9" as a string: accept scientific notation as a number.
    if isinstance(value, str) and "e" in value.lower():
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    return value


def load_hardware(spec) -> HardwareSpec:
    """A HardwareSpec from a preset name, a YAML file path, a dict, or a HardwareSpec."""
    if isinstance(spec, HardwareSpec):
        return spec
    if isinstance(spec, Mapping):
        return hardware_from_dict(spec)
    if isinstance(spec, (str, Path)):
        if isinstance(spec, str) and spec in PRESET_NAMES:
            return preset(spec)
        path = Path(spec)
        if path.suffix.lower() in (".yaml", ".yml") or path.exists():
            if not path.is_file():
                raise ValueError(f"hardware file {str(path)!r} does not exist")
            import yaml  # lazy: only user files need it
            try:
                data = yaml.safe_load(path.read_text("utf-8"))
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML: {exc}") from None
            return hardware_from_dict(data, path=f"{path}: hardware")
        raise ValueError(f"unknown hardware {str(spec)!r}: not a preset "
                         f"({', '.join(PRESET_NAMES)}) nor a .yaml file")
    raise TypeError(f"hardware must be a preset name, a YAML path, a dict or a HardwareSpec, "
                    f"got {spec!r}")
