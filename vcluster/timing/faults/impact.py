"""Plot-ready tables of fault impact: step time under stragglers and slow links, and
goodput of a long run under failures (closed form beside the SimPy Monte Carlo).

    simulate_with_faults(traces, costs, faults)      # SimulationResult of one step
    straggler_table(traces, costs, rank=1, slowdowns=[1, 1.5, 2, 4])
    goodput_table(step_time_s=1.2, checkpoint_s=30, restart_s=120,
                  mtbf_s=[3600, 6 * 3600], checkpoint_every=[50, 100, 200, 400])

Each table is a pandas DataFrame with one row per point and units in the column names.
"""

from __future__ import annotations

import math

from .goodput import (FailureModel, daly_interval_s, expected_goodput, segment_cv,
                      simulate_goodput, young_interval_s)
from .links import DegradedLinks, straggler_map

__all__ = ["simulate_with_faults", "straggler_table", "goodput_table",
           "MAX_FAILURES_PER_SEGMENT", "GOODPUT_REL_STDERR", "MAX_FAILURES_PER_POINT"]

MAX_FAILURES_PER_SEGMENT = 1000.0    # beyond this the goodput is < 0.1 %: not simulated
GOODPUT_REL_STDERR = 0.015           # a simulated point's target relative standard error
MIN_FAILURES_PER_POINT = 300        # enough failures for the mean's normal approximation
MAX_FAILURES_PER_POINT = 40_000      # cost caps of one point (well under a second of SimPy)
MIN_SEGMENTS = 50
MAX_SEGMENTS = 50_000


def simulate_with_faults(traces, costs, faults, **kwargs):
    """:func:`~vcluster.timing.engine.simulate_trace` with slow devices (stragglers) and
    degraded links (:class:`DegradedLinks`) from ``faults``; crash faults are the goodput
    model's business and are ignored here."""
    from vcluster.timing.engine import simulate_trace
    model = DegradedLinks.from_faults(costs, faults)
    return simulate_trace(traces, model if model.factors else costs,
                          stragglers=straggler_map(faults) or None, **kwargs)


def straggler_table(traces, costs, rank: int, slowdowns, **kwargs):
    """Step time with device ``rank`` slowed by each factor of ``slowdowns``.

    Columns: slowdown, step_time_s, step_time_ratio (to the fault-free step, slowdown 1,
    computed in the same call).
    """
    import pandas as pd
    base = simulate_with_faults(traces, costs, [], timeline=False, **kwargs).step_time_s
    rows = []
    for s in slowdowns:
        faults = [{"kind": "slow", "rank": rank, "slowdown": s}] if s != 1 else []
        t = simulate_with_faults(traces, costs, faults, timeline=False, **kwargs).step_time_s
        rows.append({"slowdown": float(s), "step_time_s": t, "step_time_ratio": t / base})
    return pd.DataFrame(rows)


def goodput_table(step_time_s: float, checkpoint_s: float, restart_s: float, mtbf_s,
                  checkpoint_every, segments: int | None = None, seed: int = 0):
    """Goodput for every (MTBF, checkpoint interval) pair: closed form and simulation.

    ``segments`` simulated per point (None: sized for a relative standard error of
    :data:`GOODPUT_REL_STDERR`, ``n = (segment_cv / 0.015)^2`` from the closed-form spread
    of a segment, and for at least 300 failures, between 50 and 50,000 segments and at
    most 40,000 failures, so that every point costs well under a second). Where a cap
    binds, the standard error exceeds the target; ``goodput_stderr`` says by how much.
    Points expecting more than
    :data:`MAX_FAILURES_PER_SEGMENT` failures per segment (goodput ~ 0) are not
    simulated: ``goodput_simulated`` and ``goodput_stderr`` are NaN there.

    Columns: mtbf_s, checkpoint_every, interval_s (K t), goodput_expected,
    goodput_simulated, goodput_stderr (the standard error the closed form predicts for a
    simulation of that many segments, ``goodput x segment_cv / sqrt(n)``),
    failures_simulated, young_interval_s, daly_interval_s.
    """
    import pandas as pd
    rows = []
    for i, mtbf in enumerate(mtbf_s):
        for j, every in enumerate(checkpoint_every):
            m = FailureModel(step_time_s, every, checkpoint_s, restart_s, mtbf)
            per_segment = math.expm1(m.segment_s / mtbf)     # expected failures
            expected, cv = expected_goodput(m), segment_cv(m)
            run = None
            if per_segment <= MAX_FAILURES_PER_SEGMENT:
                n = segments or _segments_for(cv, per_segment)
                run = simulate_goodput(m, n, seed=seed + 1000 * i + j)
            rows.append({"mtbf_s": float(mtbf), "checkpoint_every": int(every),
                         "interval_s": m.work_s, "goodput_expected": expected,
                         "goodput_simulated": run.goodput if run else math.nan,
                         "goodput_stderr": expected * cv / math.sqrt(run.segments)
                         if run else math.nan,
                         "failures_simulated": run.failures if run else 0,
                         "young_interval_s": young_interval_s(checkpoint_s, mtbf),
                         "daly_interval_s": daly_interval_s(checkpoint_s, mtbf)})
    return pd.DataFrame(rows)


def _segments_for(cv: float, failures_per_segment: float) -> int:
    """Segments for the target precision (``cv``: a segment's, :func:`segment_cv`) and at
    least :data:`MIN_FAILURES_PER_POINT` failures (with fewer, the lost time is too skewed
    for its mean to be near normal), within the segment and failure caps."""
    wanted = math.ceil((cv / GOODPUT_REL_STDERR) ** 2)
    if failures_per_segment > 0:
        wanted = max(wanted, math.ceil(MIN_FAILURES_PER_POINT / failures_per_segment))
        affordable = math.floor(MAX_FAILURES_PER_POINT / failures_per_segment)
    else:
        affordable = MAX_SEGMENTS
    return max(1, min(MAX_SEGMENTS, max(MIN_SEGMENTS, wanted), affordable))
