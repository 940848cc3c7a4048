"""``ScenarioError``: a scenario file (or a ``--set``) that is not valid.

Every error names the key path (``parallel.tp``, ``workload.sizes[2]``), the value found
and what is allowed, so the message alone says how to fix the file. The CLI maps it to
exit code 2 (nothing is run, nothing is written).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ScenarioError", "format_path"]


def format_path(parts) -> str:
    """``("workload", "sizes", 2)`` -> ``"workload.sizes[2]"`` (``"<root>"`` when empty)."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


class ScenarioError(ValueError):
    """``path`` (key path), ``value`` (what was given), ``allowed`` (what may be given),
    ``reason`` (the rule broken); ``file`` when known. A closed choice's enum member
    (:mod:`vcluster.scenario.choices`) is kept as its plain text, as the file spells it."""

    def __init__(self, path: str, value, allowed, reason: str = "", file: str | None = None):
        value = value.value if isinstance(value, Enum) else value
        self.path, self.value, self.allowed = path, value, allowed
        self.reason, self.file = reason, file
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.file}: " if self.file else ""
        why = f" {self.reason};" if self.reason else ""
        return f"{where}{self.path} = {self.value!r}:{why} allowed: {self.allowed}"

    def in_file(self, file: str) -> "ScenarioError":
        """The same error, naming ``file``."""
        return ScenarioError(self.path, self.value, self.allowed, self.reason, file)
