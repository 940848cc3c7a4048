"""Models by name: the presets shipped as package data (``modeling/presets/*.json``,
each a Hugging Face ``config.json`` plus a ``_vcluster`` key with its name, source and
published parameter counts), read by :func:`~modeling.hf_config.from_hf_config` like any
user's file. Nothing is fetched at run time.

>>> load_model("llama-3.1-8b").hidden
4096
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import ConfigError
from .hf_config import METADATA_KEY, from_hf_config, read_hf_config
from .spec import ModelSpec

__all__ = ["preset_names", "load_model", "preset_info", "PresetInfo"]


def _folder():
    return resources.files("modeling") / "presets"


def preset_names() -> tuple[str, ...]:
    """Every shipped preset's name, sorted."""
    return tuple(sorted(p.name[:-5] for p in _folder().iterdir() if p.name.endswith(".json")))


@dataclass(frozen=True)
class PresetInfo:
    """What a preset file says of itself: ``source`` of the config, and the publisher's
    parameter counts (``published_active`` None for a dense model) with their
    ``convention`` and ``published_source``."""

    name: str
    source: str
    published_total: float
    published_active: float | None
    convention: str
    published_source: str
    note: str = ""


def _preset_path(name: str) -> Path:
    path = _folder() / f"{name}.json"
    if not path.is_file():
        raise ConfigError("model", name, ", ".join(preset_names()) + ", or a path to a "
                          "Hugging Face config.json", "no such preset")
    return Path(str(path))


def preset_info(name: str) -> PresetInfo:
    meta = read_hf_config(_preset_path(name))[METADATA_KEY]
    pub = meta["published_params"]
    return PresetInfo(name, meta["source"], float(pub["total"]),
                      None if pub.get("active") is None else float(pub["active"]),
                      pub.get("convention", ""), pub["source"], meta.get("note", ""))


def load_model(name_or_path) -> ModelSpec:
    """A preset by name (``"llama-3.1-70b"``), or a ``config.json`` (or its folder) by
    path: anything with a path separator or ending in ``.json`` is a path."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith(".json") \
            or Path(text).is_dir():
        return from_hf_config(text)
    return from_hf_config(_preset_path(text))
