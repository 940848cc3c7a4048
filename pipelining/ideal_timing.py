"""Ideal timing of a schedule: per-rank timelines, makespan, bubbles; in-flight activations.

:func:`simulate` runs the in-order list scheduling of :mod:`pipelining._engine`
(zero communication latency; each rank runs its actions in list order, each
as soon as the rank is free and its dependencies have ended) with these costs:

    T_F = cost_f / v,   T_B = cost_b / v,   T_W = cost_w / v,   T_I = T_B - T_W,

``cost_*`` being the cost of one micro-batch through a rank's whole share of
the model and ``v`` the schedule's virtual stages (each chunk does ``1/v`` of
the work; Narayanan et al. SC21).  With ``p`` ranks, makespan ``T`` and
``busy_r`` the summed action time of rank ``r``:

    idle_r = T - busy_r,   bubble fraction = sum_r idle_r / (p T).

Arithmetic is exact (``fractions.Fraction``; float costs are taken at their
exact binary value) and converted to float at the end, so results equal the
correctly rounded closed forms of :mod:`pipelining.closed_form`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction

from ._engine import run_in_order
from .actions import Action, ActionKind
from .schedule import Schedule
from .validate import validate

__all__ = ["TimedAction", "SimulationResult", "simulate", "unit_timelines",
           "in_flight_profile", "peak_in_flight"]


@dataclass(frozen=True)
class TimedAction:
    """``action`` ran on its rank from ``start`` to ``end``."""

    action: Action
    start: float
    end: float

    def __str__(self) -> str:
        return f"{self.action}@[{self.start:g}, {self.end:g})"


@dataclass(frozen=True, repr=False)
class SimulationResult:
    """What :func:`simulate` returns; ``timelines[r]`` lists rank ``r``'s actions in run order."""

    schedule: Schedule
    cost_f: float
    cost_b: float
    cost_w: float
    timelines: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float

    @property
    def cost_i(self) -> float:
        """Input-gradient cost ``cost_b - cost_w``."""
        return self.cost_b - self.cost_w

    @property
    def bubble_time(self) -> float:
        """Summed idle time of all ranks."""
        return math.fsum(self.idle)

    @property
    def relative_bubble(self) -> float:
        """Bubble time over ideal compute time: ``sum idle / sum busy``."""
        return math.fsum(self.idle) / math.fsum(self.busy)

    def timing_of(self, action: Action) -> TimedAction:
        """The :class:`TimedAction` of ``action``."""
        for row in self.timelines:
            for t in row:
                if t.action == action:
                    return t
        raise ValueError(f"{self.schedule.name}: action {action} is not in the schedule")

    def __repr__(self) -> str:
        s = self.schedule
        return (f"SimulationResult(schedule={s.name!r}, ranks={s.ranks}, "
                f"microbatches={s.microbatches}, virtual_stages={s.virtual_stages}, "
                f"costs=(F={self.cost_f:g}, B={self.cost_b:g}, W={self.cost_w:g}), "
                f"makespan={self.makespan:g}, bubble_fraction={self.bubble_fraction:.4f})")


def _cost(value, what: str, who: str = "simulate") -> Fraction:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {what} must be a positive real number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{who}: {what} must be a positive finite number, got {value!r}")
    exact = Fraction(value)
    if exact <= 0:
        raise ValueError(f"{who}: {what} must be > 0, got {value!r}")
    return exact


def _durations(schedule: Schedule, cost_f, cost_b, cost_w):
    f, b, w = _cost(cost_f, "cost_f"), _cost(cost_b, "cost_b"), _cost(cost_w, "cost_w")
    if w >= b:
        raise ValueError(
            f"simulate: cost_w must be smaller than cost_b (B = I + W, so cost_i = cost_b - "
            f"cost_w must be > 0); got cost_b={cost_b!r}, cost_w={cost_w!r}")
    v = schedule.virtual_stages
    table = {ActionKind.F: f / v, ActionKind.B: b / v, ActionKind.I: (b - w) / v,
             ActionKind.W: w / v}
    return table, (f, b, w)


def simulate(schedule: Schedule, cost_f=1.0, cost_b=2.0, cost_w=1.0) -> SimulationResult:
    """Time ``schedule`` with full-stage costs F, B (= I + W) and W (see module doc).

    Validates the schedule first (:class:`ScheduleError` if it breaks a rule);
    costs must be positive with ``cost_w < cost_b``.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"simulate: expected a Schedule, got {schedule!r}")
    table, (f, b, w) = _durations(schedule, cost_f, cost_b, cost_w)
    validate(schedule)
    run = run_in_order(schedule.actions, schedule.stages, lambda a: table[a.kind])
    makespan = max((row[-1][2] for row in run.timelines if row), default=Fraction(0))
    busy = [sum((e - s for _, s, e in row), Fraction(0)) for row in run.timelines]
    idle = [makespan - x for x in busy]
    p = schedule.ranks
    fraction = sum(idle, Fraction(0)) / (p * makespan) if makespan else Fraction(0)
    timelines = tuple(tuple(TimedAction(a, float(s), float(e)) for a, s, e in row)
                      for row in run.timelines)
    return SimulationResult(schedule, float(f), float(b), float(w), timelines, float(makespan),
                            tuple(float(x) for x in busy), tuple(float(x) for x in idle),
                            float(fraction))


def unit_timelines(schedule: Schedule) -> tuple[tuple[tuple[Action, int], ...], ...]:
    """``(action, step)`` per rank when every action takes one step (validates first)."""
    validate(schedule)
    run = run_in_order(schedule.actions, schedule.stages, lambda a: Fraction(1))
    return tuple(tuple((a, int(s)) for a, s, _ in row) for row in run.timelines)


def in_flight_profile(schedule: Schedule, rank: int, check: bool = True) -> tuple[int, ...]:
    """Activation sets alive on ``rank`` after each of its actions, in list order.

    A (stage, micro-batch) is *in flight* from its ``F`` until it is fully
    backwarded (its ``B``, or its ``W``; an ``I`` alone does not free it).
    With ``v`` chunks per rank each set is ``1/v`` of a full stage's
    activations.  Depends only on the list order, not on costs. ``check=False``
    skips validating the schedule (for one already validated).
    """
    if check:
        validate(schedule)
    alive: set[tuple[int, int]] = set()
    out = []
    for a in schedule[rank]:
        if a.kind is ActionKind.F:
            alive.add((a.stage, a.microbatch))
        elif a.kind in (ActionKind.B, ActionKind.W):
            alive.discard((a.stage, a.microbatch))
        out.append(len(alive))
    return tuple(out)


def peak_in_flight(schedule: Schedule, rank: int, check: bool = True) -> int:
    """Most activation sets alive at once on ``rank`` (see :func:`in_flight_profile`).

    GPipe: ``m`` on every rank.  1F1B: ``min(m, p - r)`` on rank ``r``.  ZB-H1:
    ``min(m, p)`` on every rank (rank ``r`` trades ``r`` deferred W's for
    ``r`` fewer warm-up forwards).  So the first stage peaks at ``m`` under
    GPipe and at ``min(m, p)`` under 1F1B and ZB-H1.
    """
    return max(in_flight_profile(schedule, rank, check), default=0)
