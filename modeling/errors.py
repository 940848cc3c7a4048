"""``ConfigError``: the one error a rule of the model layer raises.

A rule about a model or a parallel plan is written once, here in the model layer, and
raises ``ConfigError(field, value, allowed, reason)``. The front doors translate the
*field* into what their user typed — the CLI into a flag (``--zero``), the scenario loader
into a key path (``parallel.zero_stage``) — and keep no copy of the rule.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A value of ``field`` the rules refuse: ``allowed`` says what is accepted and
    ``reason`` why. A ``ValueError``, so callers that caught those keep working.

    >>> str(ConfigError("zero_stage", 3, "0 or 1 with pp > 1", "ZeRO-3 reduce-scatters ..."))
    'zero_stage=3: ZeRO-3 reduce-scatters ...; allowed: 0 or 1 with pp > 1'
    """

    def __init__(self, field: str, value, allowed: str, reason: str, *, owner: str = ""):
        self.field, self.value, self.allowed, self.reason = field, value, allowed, reason
        self.owner = owner
        super().__init__(self.describe())

    def describe(self, name: str | None = None) -> str:
        """The message with the field shown as ``name`` (a flag or key path; default the
        field itself, prefixed by the owner when there is one)."""
        shown = name or (f"{self.owner}: {self.field}" if self.owner else self.field)
        return f"{shown}={self.value!r}: {self.reason}; allowed: {self.allowed}"

    def __reduce__(self):
        return (_rebuild, (self.field, self.value, self.allowed, self.reason, self.owner))


def _rebuild(field, value, allowed, reason, owner):
    return ConfigError(field, value, allowed, reason, owner=owner)
