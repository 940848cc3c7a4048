"""Parsing and printing byte sizes: ``8B``, ``1KiB``, ``64MiB``, ``1GB``."""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10,
          "mib": 1 << 20, "gib": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r} is not a byte count; use e.g. 8B, 1KiB, 64MiB, 1GB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value) or value < 0:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"
