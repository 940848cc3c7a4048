"""Closed-form pipeline bubbles (the formulas :func:`pipelining.simulate` reproduces).

``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank; ``T_F``, ``T_B``,
``T_W`` the costs of one micro-batch through a rank's whole share of the
model, ``T_I = T_B - T_W``.  Ideal compute per rank is ``m (T_F + T_B)``;
the bubble (idle) time per rank is

* GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021):
  ``(p-1)(T_F + T_B)``, so the bubble fraction is ``(p-1)/(m+p-1)`` whatever
  the costs;
* interleaved 1F1B (Narayanan et al. SC21): ``(p-1)(T_F + T_B)/v``, i.e.
  bubble / ideal compute ``= (p-1)/(v m)``; needs ``m mod p == 0``;
* ZB-H1 (Qi et al. 2023), for ``m >= p``: ``(p-1)(T_F + T_I - T_W)`` when
  ``T_W <= min(T_F, T_I)`` (the paper's regime, e.g. F=1, B=2, W=1), against
  ``(p-1)(T_F + T_B)`` for 1F1B.  In general this schedule's bubble is
  ``(p-1) max(T_F, T_I, T_F + T_I - T_W)``: a ``W`` longer than ``T_F`` or
  ``T_I`` no longer fits the gap it is deferred into, so the bubble stops
  shrinking at ``(p-1) max(T_F, T_I)`` (checked against :func:`simulate` in
  the tests over random costs).  No closed form is given for ``m < p``.

Bubble fraction = idle / (idle + ideal compute) = idle / makespan.
"""

from __future__ import annotations

from fractions import Fraction

from mesh.arguments import as_int

from .generators import SCHEDULE_NAMES
from .ideal_timing import _cost

__all__ = ["bubble_time_closed_form", "bubble_fraction_closed_form",
           "relative_bubble_closed_form"]


def _idle_and_compute(name, ranks, microbatches, virtual_stages, cost_f, cost_b, cost_w):
    """Exact (per-rank idle time, per-rank ideal compute time m (T_F + T_B))."""
    if not isinstance(name, str) or name.strip().lower() not in SCHEDULE_NAMES:
        raise ValueError(f"closed form: unknown schedule {name!r}; "
                         f"choose from {', '.join(SCHEDULE_NAMES)}")
    key = name.strip().lower()
    p = as_int(ranks, f"{key}: ranks p", 1)
    m = as_int(microbatches, f"{key}: microbatches m", 1)
    v = as_int(virtual_stages, f"{key}: virtual_stages v", 1)
    f, b, w = (_cost(c, n, "closed form") for c, n in
               ((cost_f, "cost_f"), (cost_b, "cost_b"), (cost_w, "cost_w")))
    if w >= b:
        raise ValueError(f"closed form: cost_w must be smaller than cost_b (B = I + W); "
                         f"got cost_b={cost_b!r}, cost_w={cost_w!r}")
    if key != "interleaved_1f1b" and v != 1:
        raise ValueError(f"closed form: {key} runs one stage per rank, so v must be 1, got {v}")
    compute = m * (f + b)
    if key in ("gpipe", "1f1b"):
        return (p - 1) * (f + b), compute
    if key == "interleaved_1f1b":
        if v > 1 and m % p:
            raise ValueError(f"closed form: interleaved_1f1b needs microbatches m={m} to be a "
                             f"multiple of ranks p={p} (m mod p = {m % p})")
        return (p - 1) * (f + b) / v, compute
    i = b - w
    if m < p:
        raise ValueError(f"closed form: the ZB-H1 bubble is known in closed form for m >= p; "
                         f"got m={m} < p={p} (use simulate for the exact timing)")
    return (p - 1) * max(f, i, f + i - w), compute


def bubble_time_closed_form(name: str, p: int, m: int, v: int = 1,
                            cost_f=1.0, cost_b=2.0, cost_w=1.0) -> float:
    """Idle time per rank (the same on every rank) by the closed form of ``name``."""
    idle, _ = _idle_and_compute(name, p, m, v, cost_f, cost_b, cost_w)
    return float(idle)


def relative_bubble_closed_form(name: str, p: int, m: int, v: int = 1,
                                cost_f=1.0, cost_b=2.0, cost_w=1.0) -> float:
    """Bubble time / ideal compute time, ``idle / (m (T_F + T_B))``."""
    idle, compute = _idle_and_compute(name, p, m, v, cost_f, cost_b, cost_w)
    return float(Fraction(idle) / compute)


def bubble_fraction_closed_form(name: str, p: int, m: int, v: int = 1,
                                cost_f=1.0, cost_b=2.0, cost_w=1.0) -> float:
    """Idle share of the makespan, ``idle / (idle + m (T_F + T_B))``.

    ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v m + p-1)`` for interleaved 1F1B.
    """
    idle, compute = _idle_and_compute(name, p, m, v, cost_f, cost_b, cost_w)
    return float(Fraction(idle) / (idle + compute))
