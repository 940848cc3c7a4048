"""Replay symbolic traces on a cost model: :func:`simulate_trace` (and schedules as traces).

    result = simulate_trace(traces, SimpleCostModel(...))   # one DeviceTrace per rank
    result.step_time_s, result.per_rank, result.summary()

The replay semantics (two streams per rank, collective matching, FIFO links, symmetric
mode, deadlock errors) are those of :mod:`vcluster.timing.replay`; the time accounting
(compute, comm, exposed communication, bubble, idle) is defined in
:mod:`vcluster.timing.results`. :func:`traces_from_schedule` turns a pipeline schedule
(:class:`pipelining.Schedule`, duck-typed: this engine layer does not import the plans
layer) into traces so that the replay can be checked against :func:`pipelining.simulate`.
"""

from __future__ import annotations

import gc
import math
import numbers
from contextlib import contextmanager
from operator import itemgetter
from typing import Mapping, Sequence

from vcluster.runtime.tracing.ops import (DeviceTrace, TraceCollective, TraceCompute,
                                          TraceRecv, TraceSend)

from .cost_model import CostModel
from .core_pool import as_core_pool
from .replay import Replay, ReplayDeadlock
from .results import OpStats, RankStats, SimulationResult
from mesh.arguments import as_int

__all__ = ["simulate_trace", "traces_from_schedule", "ReplayDeadlock"]

_START = itemgetter(2)                                     # Interval.start_s


def _normalise_traces(traces) -> dict[int, tuple]:
    if isinstance(traces, Mapping):
        items = list(traces.items())
    elif isinstance(traces, Sequence) and not isinstance(traces, (str, bytes)):
        items = [(getattr(t, "rank", None), t) for t in traces]
    else:
        raise TypeError(f"simulate_trace: traces must be a mapping rank -> DeviceTrace or a "
                        f"sequence of DeviceTrace, got {type(traces).__name__}")
    out: dict[int, tuple] = {}
    for key, trace in items:
        if not isinstance(trace, DeviceTrace):
            raise TypeError(f"simulate_trace: expected DeviceTrace values, got {trace!r:.80}")
        rank = as_int(trace.rank, "simulate_trace: DeviceTrace.rank", 0)
        if key != rank:
            raise ValueError(f"simulate_trace: traces[{key!r}] holds the trace of rank {rank}")
        if rank in out:
            raise ValueError(f"simulate_trace: two traces for rank {rank}")
        out[rank] = tuple(trace.ops)
    if not out:
        raise ValueError("simulate_trace: no traces given (need at least one DeviceTrace)")
    return dict(sorted(out.items()))


def _slowdowns(stragglers, traced, symmetric: bool) -> dict[int, float]:
    if stragglers is None:
        return {}
    if not isinstance(stragglers, Mapping):
        raise TypeError(f"simulate_trace: stragglers must be a mapping rank -> slowdown "
                        f"factor, got {stragglers!r}")
    out = {}
    for key, factor in stragglers.items():
        rank = as_int(key, "simulate_trace: a straggler", 0)
        if (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
                or not 0 < factor < math.inf):
            raise ValueError(f"simulate_trace: straggler rank {rank} needs a finite slowdown "
                             f"factor > 0 (compute times are multiplied by it), got {factor!r}")
        if rank not in traced:
            hint = ("a straggler breaks the symmetry: trace it explicitly (add its "
                    "DeviceTrace)" if symmetric else "give its DeviceTrace")
            raise ValueError(f"simulate_trace: straggler rank {rank} has no trace; {hint}; "
                             f"traced ranks are {sorted(traced)}")
        out[rank] = float(factor)
    return out


def _check_mirrors(ops: dict, costs, limit: int | None) -> None:
    """Symmetric mode on a cost model with a model per rank (``costs.rank_costs``: a
    cluster of several GPU kinds): an untraced member of a group mirrors its traced
    members, so it must run on the kind of one of them; ValueError naming the group, the
    rank and both kinds otherwise."""
    of = costs.rank_costs
    seen, seen_ids = set(), set()          # groups checked; the ids of those objects
    for rank, trace in ops.items():
        for op in trace:
            if op.__class__ is not TraceCollective or id(op.group) in seen_ids:
                continue
            group = op.group
            seen_ids.add(id(group))
            if group in seen:
                continue
            seen.add(group)
            traced = {id(of(r)): r for r in group if r in ops}
            for r in group:
                if r in ops or (limit is not None and not 0 <= r < limit):
                    continue
                if id(of(r)) not in traced:
                    kind = getattr(getattr(of(r), "hardware", None), "name", "?")
                    other = next(iter(traced.values()))
                    theirs = getattr(getattr(of(other), "hardware", None), "name", "?")
                    raise ValueError(
                        f"simulate_trace: symmetric mode would let untraced rank {r} "
                        f"({kind}) mirror traced rank {other} ({theirs}) of group {group}, "
                        f"a rank of one GPU kind in place of another; trace a rank of each "
                        f"kind in the group, or place the ranks so that mirrored peers share "
                        f"a kind")


@contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector during a replay (restored after, even on error).

    A replay allocates a few objects per op and frees almost none until the end, which
    makes the collector rescan the growing heap over and over (~40% of the run time).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate_trace(traces: Mapping[int, DeviceTrace] | Sequence[DeviceTrace],
                   costs: CostModel, mesh=None, symmetric: bool = False,
                   stragglers: Mapping[int, float] | None = None, *,
                   timeline: bool = True, core_pool=None, op_kind=None,
                   collective_kind=None) -> SimulationResult:
    """Replay ``traces`` on ``costs`` and return step time, per-rank accounting, timelines.

    ``mesh`` (optional, a :class:`mesh.Mesh`): every rank must lie in it and the result
    stands for ``mesh.size`` devices. ``symmetric``: untraced members of a group mirror its
    traced members (see :mod:`vcluster.timing.replay`); with every rank traced and identical
    devices the result equals the full replay. ``stragglers``: ``{rank: slowdown}``
    multiplies that rank's compute times (the rank must be traced). A cost model with
    ``rank_costs(rank)`` (:class:`~vcluster.timing.cluster_cost.ClusterCostModel`) prices
    each rank's compute on its own device; in symmetric mode an untraced member of a
    group must then run on the kind of one of its traced members. ``timeline=False``
    skips recording intervals (faster, less memory). ``core_pool`` (default None: every
    device has a core of its own): an int number of cores or a
    :class:`~vcluster.timing.core_pool.CorePoolSpec`; the devices' work then shares
    those cores (see "Core pool" in :mod:`vcluster.timing.replay`); not with ``symmetric``;
    a spec with ``placements`` is replayed once per placement and the replay at the
    weighted median step time returned (:mod:`vcluster.timing.core_queues`).
    ``op_kind`` (optional): a function from a compute op's name to its kind (``"attention"``,
    ``"mlp"``, ...) or None (the kind of the rank's previous compute op); the result's
    ``op_stats`` then give each kind's compute and charged communication time (see
    :mod:`vcluster.timing.results` for the attribution rule); not with ``core_pool``.
    ``collective_kind`` (optional, with ``op_kind``): a function from a
    :class:`~vcluster.runtime.tracing.ops.TraceCollective` to a kind of its own (the
    planner's "grad reduce (dp)") or None (the rule's: the previous compute op's kind).

    Raises :class:`ReplayDeadlock` when some ranks can never finish, ``ValueError`` /
    ``TypeError`` / :class:`~vcluster.runtime.errors.CollectiveMismatch` on bad traces.
    """
    ops = _normalise_traces(traces)
    if not isinstance(costs, CostModel):
        raise TypeError(f"simulate_trace: costs must implement CostModel (compute_time_s, "
                        f"collective_time_s, p2p_time_s), got {costs!r}")
    limit = None
    if mesh is not None:
        limit = as_int(getattr(mesh, "size", None), "simulate_trace: mesh.size", 0)
        bad = [r for r in ops if r >= limit]
        if bad:
            raise ValueError(f"simulate_trace: traced ranks {bad} are outside {mesh!r} "
                             f"(valid ranks 0..{limit - 1})")
    slowdown = _slowdowns(stragglers, ops, bool(symmetric))
    if symmetric and getattr(costs, "rank_costs", None) is not None:
        _check_mirrors(ops, costs, limit)
    pool = as_core_pool(core_pool)
    if pool is not None and symmetric:
        raise ValueError("simulate_trace: a core_pool needs every rank's trace (untraced "
                         "ranks would not load the shared cores); use symmetric=False")
    if op_kind is not None and not callable(op_kind):
        raise TypeError(f"simulate_trace: op_kind must be a function name -> kind, got "
                        f"{op_kind!r}")
    if op_kind is not None and pool is not None:
        raise ValueError("simulate_trace: op_kind (per-op accounting) is not available with a "
                         "core_pool; pass one or the other")
    if collective_kind is not None and (op_kind is None or not callable(collective_kind)):
        raise TypeError(f"simulate_trace: collective_kind must be a function collective -> "
                        f"kind, given with op_kind; got {collective_kind!r} (op_kind "
                        f"{op_kind!r})")
    kwargs = dict(symmetric=bool(symmetric), slowdown=slowdown, record=bool(timeline),
                  limit=limit, core_pool=pool, op_kind=op_kind, collective_kind=collective_kind)
    if pool is None or not pool.placements:
        return _replayed(Replay(ops, costs, **kwargs), limit, bool(symmetric))
    return _placed_median(ops, costs, pool, limit, kwargs)


def _replayed(replay: Replay, limit: int | None, symmetric: bool) -> SimulationResult:
    """Run ``replay`` (the garbage collector paused) and collect its result."""
    with _gc_paused():
        replay.run()
        return _result(replay, limit, symmetric)


def _placed_median(ops: dict, costs, pool, limit, kwargs) -> SimulationResult:
    """One replay per placement of ``pool``; the result at their weighted median step time
    (the first whose cumulative weight reaches half, in order of step time)."""
    ranks = len(pool.placements[0][0])
    bad = [r for r in ops if r >= ranks]
    if bad:
        raise ValueError(f"simulate_trace: core_pool placements cover ranks 0..{ranks - 1}, "
                         f"the traces have ranks {bad}")
    results = [(_replayed(Replay(ops, costs, placement=placement, **kwargs), limit, False),
                weight) for placement, weight in pool.placements]
    results.sort(key=lambda rw: rw[0].step_time_s)
    half, acc = sum(w for _, w in results) / 2, 0.0
    for result, weight in results:
        acc += weight
        if acc >= half:
            return result
    return results[-1][0]


def _result(replay: Replay, limit: int | None, symmetric: bool) -> SimulationResult:
    ops = replay.traces
    step = max(max(replay.end_s.values()), replay.last_s)
    ranks = tuple(ops)
    stats = tuple(
        RankStats(rank=r, compute_s=replay.compute_s[r], comm_s=replay.comm_s[r],
                  exposed_comm_s=replay.exposed_s[r],
                  bubble_s=replay.bubble_s[r] + (step - replay.end_s[r]),
                  idle_s=step - replay.compute_s[r], end_s=replay.end_s[r])
        for r in ranks)
    if replay.timelines is None:
        timelines = tuple(() for _ in ranks)
    else:
        timelines = tuple(tuple(sorted(replay.timelines[r], key=_START))
                          for r in ranks)
    return SimulationResult(step_time_s=step, ranks=ranks, stats=stats, timelines=timelines,
                            devices=limit if limit is not None else len(ranks),
                            symmetric=symmetric, op_stats=_op_stats(replay),
                            pool_work_s=None if replay.pool is None else replay.pool.busy_s)


def _op_stats(replay: Replay) -> tuple[OpStats, ...]:
    """Per kind, compute and charged communication time summed over the traced ranks."""
    if replay.kind_compute_s is None:
        return ()
    compute: dict[str, list] = {}
    comm: dict[str, list] = {}
    for r in replay.traces:
        for kind, d in replay.kind_compute_s[r].items():
            compute.setdefault(kind, []).append(d)
        for kind, d in replay.kind_comm_s[r].items():
            comm.setdefault(kind, []).append(d)
    rows = [OpStats(kind, math.fsum(compute.get(kind, ())), math.fsum(comm.get(kind, ())))
            for kind in {**compute, **comm}]
    return tuple(sorted(rows, key=lambda o: (-o.compute_s, -o.comm_s, o.op)))


def traces_from_schedule(schedule, cost_f: float, cost_b: float, cost_w: float,
                         nbytes: int = 0) -> tuple[DeviceTrace, ...]:
    """One :class:`DeviceTrace` per pipeline rank of ``schedule`` (a :class:`pipelining.Schedule`).

    Costs follow :mod:`pipelining.ideal_timing`: ``cost_*`` is one micro-batch through a rank's
    whole share, so a chunk action on a schedule of ``v`` virtual stages has
    ``flops = cost / v`` (``F``: cost_f, ``B``: cost_b, ``I``: cost_b - cost_w, ``W``:
    cost_w); replayed with ``flops_per_s = 1`` its duration is that cost. Stage ``s`` lives on
    rank ``s mod p``. ``F(s, j)`` receives its activation from stage ``s-1`` and sends its
    output to ``s+1``; ``B/I(s, j)`` receives the gradient from ``s+1`` and sends one to
    ``s-1``; each message carries ``nbytes`` with tag ``2 (s S' + j) + g`` (``s`` the sending
    stage, ``S'`` the micro-batch count, ``g`` 0 for activations, 1 for gradients).
    """
    p, v, m = schedule.ranks, schedule.virtual_stages, schedule.microbatches
    stages = p * v
    dur = {"F": cost_f / v, "B": cost_b / v, "I": (cost_b - cost_w) / v, "W": cost_w / v}
    tag = lambda s, j, g: 2 * (s * m + j) + g  # noqa: E731
    traces = []
    for r, actions in enumerate(schedule.actions):
        ops: list = []
        for a in actions:
            s, j, kind = a.stage, a.microbatch, a.kind.value
            compute = TraceCompute(str(a), dur[kind], 0)
            if kind == "F":
                src, dst, g = s - 1, s + 1, 0
            elif kind in ("B", "I"):
                src, dst, g = s + 1, s - 1, 1
            else:
                ops.append(compute)
                continue
            if 0 <= src < stages and src % p != r:
                ops.append(TraceRecv(src % p, nbytes, tag(src, j, g)))
            ops.append(compute)
            if 0 <= dst < stages and dst % p != r:
                ops.append(TraceSend(dst % p, nbytes, tag(s, j, g)))
        traces.append(DeviceTrace(r, tuple(ops)))
    return tuple(traces)
