"""The error raised when a schedule breaks a rule of :mod:`pipelining.validate`."""

from __future__ import annotations

__all__ = ["ScheduleError"]


class ScheduleError(ValueError):
    """A schedule breaks a rule.

    ``rule`` is the rule number (see :mod:`pipelining.validate`: R0 .. R4),
    ``rank`` the pipeline rank whose action list breaks it (``None`` when the
    rule is about the schedule as a whole) and ``actions`` the offending
    actions.  The message always names all three.
    """

    def __init__(self, message: str, *, rule: int | None = None, rank: int | None = None,
                 actions: tuple = ()) -> None:
        super().__init__(message)
        self.rule = rule
        self.rank = rank
        self.actions = tuple(actions)
