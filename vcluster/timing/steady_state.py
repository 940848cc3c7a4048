"""A long pipelined step from three short ones: past its warm-up, a step is affine in its
micro-batches.

A training step of m micro-batches runs a warm-up, a steady state and a cool-down, then
what follows the last backward (the data-parallel reductions, the optimizer). In the
steady state every further round of u micro-batches — u = 1 for GPipe, 1F1B and the
zero-bubble schedule; u = p for interleaved 1F1B, whose micro-batches run in rounds of
the p pipeline ranks — adds the same ops to every rank in the same order, priced the same
by the replay, while the warm-up, the cool-down and the tail do not depend on m. So every
additive figure f of the replay — the step time; each rank's compute, communication,
exposed communication, bubble, idle time and end; each op kind's seconds — is, from some
m0 on, affine in m:

    f(m) = f(m3) + (m − m3) / u · (f(m3) − f(m2))        for m >= m0

:func:`extrapolated_result` takes the replays at three equally spaced m1 < m2 < m3 and
checks the premise on every figure — its second difference f(m3) − 2 f(m2) + f(m1)
within ``rel_tol`` of the step time — before it extrapolates; when one fails (a steady
state not reached by m1, or a period longer than u) it returns None and the caller
replays the whole step. Replayed whole and extrapolated, a step differs by rounding only
(tests/planner/test_steady_state.py sweeps schedules, stages, micro-batches, MoE, context
parallelism and ZeRO against the whole replay).
"""

from __future__ import annotations

from collections.abc import Sequence

from .results import OpStats, RankStats, SimulationResult

__all__ = ["REL_TOL", "NotAffine", "extrapolated", "extrapolated_result"]

#: the largest second difference accepted, as a share of the step time: a replay's
#: figures are affine to rounding (~1e-13 of the step) once its steady state is reached
REL_TOL = 1e-9

_RANK_FIELDS = ("compute_s", "comm_s", "exposed_comm_s", "bubble_s", "idle_s", "end_s")


class NotAffine(ValueError):
    """A figure's second difference exceeds the tolerance."""


def extrapolated(values: Sequence[float], spacing: int, periods: int, tol: float) -> float:
    """``values`` f(m1), f(m2), f(m3) at m2 − m1 = m3 − m2 = ``spacing``, extrapolated
    ``periods`` spacings past m3: f(m3) + periods · (f(m3) − f(m2)); :class:`NotAffine`
    when |f(m3) − 2 f(m2) + f(m1)| > ``tol``."""
    a, b, c = values
    if abs((c - b) - (b - a)) > tol:
        raise NotAffine(f"second difference {(c - b) - (b - a):.3g} > {tol:.3g}")
    return c + periods * (c - b)


def extrapolated_result(results: Sequence[SimulationResult], microbatches: Sequence[int],
                        m: int, rel_tol: float = REL_TOL) -> SimulationResult | None:
    """The replay of ``m`` micro-batches from ``results``, the replays of ``microbatches``
    (three, equally spaced, m1 < m2 < m3 <= m, m − m3 a multiple of the spacing) of the
    same step: every figure extrapolated (module docstring), timelines empty; None when a
    figure is not affine. ValueError on samples that do not describe one step."""
    ms = tuple(microbatches)
    if len(results) != 3 or len(ms) != 3:
        raise ValueError(f"extrapolated_result: three replays and their micro-batch counts, "
                         f"got {len(results)} replays and micro-batches {ms}")
    spacing = ms[1] - ms[0]
    if spacing < 1 or ms[2] - ms[1] != spacing or m < ms[2] or (m - ms[2]) % spacing:
        raise ValueError(f"extrapolated_result: micro-batches {ms} must be equally spaced "
                         f"and increasing, with m={m} at or past the last by a multiple of "
                         f"the spacing")
    if len({r.ranks for r in results}) != 1 or len({r.devices for r in results}) != 1:
        raise ValueError("extrapolated_result: the replays must trace the same ranks of the "
                         "same devices")
    periods = (m - ms[2]) // spacing
    tol = rel_tol * results[2].step_time_s

    def ext(values):
        return extrapolated(values, spacing, periods, tol)

    try:
        step = ext([r.step_time_s for r in results])
        stats = tuple(
            RankStats(rank, **{f: ext([getattr(r.stats[i], f) for r in results])
                               for f in _RANK_FIELDS})
            for i, rank in enumerate(results[0].ranks))
        kinds = [{o.op: o for o in r.op_stats} for r in results]
        if len({frozenset(k) for k in kinds}) != 1:
            return None
        ops = tuple(sorted((OpStats(op, ext([k[op].compute_s for k in kinds]),
                                    ext([k[op].comm_s for k in kinds]))
                            for op in kinds[0]),
                           key=lambda o: (-o.compute_s, -o.comm_s, o.op)))
        pool = None if results[0].pool_work_s is None else \
            ext([r.pool_work_s for r in results])
    except NotAffine:
        return None
    return SimulationResult(step_time_s=step, ranks=results[0].ranks, stats=stats,
                            timelines=tuple(() for _ in stats), devices=results[0].devices,
                            symmetric=results[0].symmetric, op_stats=ops, pool_work_s=pool)
