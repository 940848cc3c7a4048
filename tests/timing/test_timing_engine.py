"""The SimPy replay of traces (vcluster.timing.engine) against independent figures: alpha-beta
closed forms, pipelining.simulate, max(0, comm - overlap), hand-timed stragglers, the full
replay (for symmetric mode) and a max-plus reference written here for random programs."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import Mesh
from pipelining import make_schedule, simulate
from vcluster.runtime.errors import CollectiveMismatch
from vcluster.runtime.tracing.ops import (DeviceTrace, TraceCollective, TraceCompute, TraceRecv,
                                          TraceSend, TraceWait)
from vcluster.timing.cost_model import CostModel, SimpleCostModel, ZeroCostModel
from vcluster.timing.engine import ReplayDeadlock, simulate_trace, traces_from_schedule
from vcluster.timing.results import Stream

ALPHA_S, BW = 2e-6, 50e9                        # 2 us per step, 50 GB/s links
MODEL = SimpleCostModel(flops_per_s=1e12, bytes_per_s=1e12, alpha_s=ALPHA_S, link_bytes_per_s=BW)
UNIT = SimpleCostModel.compute_only(1.0)        # a compute op of f flops takes f seconds


def comp(seconds: float, name: str = "c") -> TraceCompute:
    return TraceCompute(name, seconds, 0)       # with UNIT: flops = seconds


def coll(name: str, group, nbytes: int = 0, handle=None, root: int = 0) -> TraceCollective:
    return TraceCollective(name, tuple(group), nbytes, 4, "ring", root, handle)


def traces(*rows) -> list[DeviceTrace]:
    return [DeviceTrace(r, tuple(ops)) for r, ops in enumerate(rows)]


def check_accounting(res) -> None:
    for s in res.stats:
        assert s.compute_s + s.exposed_comm_s + s.bubble_s == pytest.approx(res.step_time_s)
        assert s.idle_s == pytest.approx(res.step_time_s - s.compute_s)
        assert min(s.exposed_comm_s, s.bubble_s) >= -1e-12


# --------------------------------------------------------------------------- collectives
def ring_time_s(collective: str, p: int, nbytes: int) -> float:
    """nccl-tests convention: n = buffer size; busbw factors 2(p-1)/p and (p-1)/p."""
    if collective == "all_reduce":
        return 2 * (p - 1) * ALPHA_S + 2 * (p - 1) / p * nbytes / BW
    if collective == "all_gather":                      # trace records the local shard
        return (p - 1) * ALPHA_S + (p - 1) * nbytes / BW
    if collective in ("reduce_scatter", "all_to_all"):
        return (p - 1) * ALPHA_S + (p - 1) / p * nbytes / BW
    steps = math.ceil(math.log2(p))
    if collective in ("broadcast", "reduce"):
        return steps * (ALPHA_S + nbytes / BW)
    return steps * ALPHA_S                              # barrier


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter",
                                        "all_to_all", "broadcast", "reduce", "barrier"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_one_collective_alone_takes_its_alpha_beta_time(collective, p):
    n = 3 << 20
    res = simulate_trace(traces(*[[coll(collective, range(p), n)]] * p), MODEL)
    assert res.step_time_s == pytest.approx(ring_time_s(collective, p, n), rel=1e-12)
    for s in res.stats:
        assert s.comm_s == s.exposed_comm_s == pytest.approx(res.step_time_s)
        assert s.bubble_s == 0.0 and s.compute_s == 0.0
    assert res.compute_comm_ratio == 0.0


def test_concurrent_collectives_share_the_links():
    """Rank 0 runs blocking (0,1) beside async (0,2): both see 2 in flight, halving bandwidth.
    Async ones on two groups run side by side too (a communication stream per group, as a
    process group's NCCL communicator has), each seeing 2; two async ones on one group
    queue on that group's stream and each sees 1, and so do two on different groups under
    a cost model with one stream per rank (``comm_stream_per_group = False``: the
    emulator's devices, one communication thread each)."""
    seen = []

    class Recording(SimpleCostModel):
        def collective_time_s(self, op, concurrent=1):
            seen.append((op.group, concurrent))
            return super().collective_time_s(op, concurrent)

    model, n = Recording(1e12, 1e12, 0.0, BW), 1 << 20
    a01, a02 = coll("all_reduce", (0, 1), n, handle=1), coll("all_reduce", (0, 2), n, handle=2)
    rows = ([a01, a02, TraceWait(1), TraceWait(2)], [a01, TraceWait(1)], [a02, TraceWait(2)])
    res = simulate_trace(traces(*rows), model)
    assert sorted(seen) == [((0, 1), 2), ((0, 2), 2)] and res.step_time_s == 2 * n / BW
    seen.clear()
    again = coll("all_reduce", (0, 1), n, handle=3)
    rows = ([a01, again, TraceWait(1), TraceWait(3)], [a01, again, TraceWait(1), TraceWait(3)])
    res = simulate_trace(traces(*rows), model)
    assert seen == [((0, 1), 1), ((0, 1), 1)] and res.step_time_s == 2 * n / BW
    seen.clear()
    model.comm_stream_per_group = False       # one FIFO per rank, as an emulated device's
    rows = ([a01, a02, TraceWait(1), TraceWait(2)], [a01, TraceWait(1)], [a02, TraceWait(2)])
    res = simulate_trace(traces(*rows), model)
    assert sorted(seen) == [((0, 1), 1), ((0, 2), 1)] and res.step_time_s == 2 * n / BW
    seen.clear()
    model.comm_stream_per_group = True
    rows = ([a02, coll("all_reduce", (0, 1), n), TraceWait(2)], [coll("all_reduce", (0, 1), n)],
            [a02, TraceWait(2)])
    res = simulate_trace(traces(*rows), model)
    assert sorted(seen) == [((0, 1), 2), ((0, 2), 2)] and res.step_time_s == 2 * n / BW


# --------------------------------------------------------------------------- pipelines
PIPELINES = [("gpipe", p, m, None) for p, m in [(1, 3), (2, 1), (2, 4), (4, 2), (4, 4), (4, 8)]]
PIPELINES += [("1f1b", p, m, None) for p, m in [(2, 1), (3, 2), (4, 4), (4, 8), (3, 7)]]
PIPELINES += [("zero_bubble", p, m, None) for p, m in [(2, 2), (3, 1), (4, 4), (4, 6)]]
PIPELINES += [("interleaved_1f1b", p, m, v) for p, m, v in [(2, 2, 2), (2, 4, 2), (4, 4, 2),
                                                             (4, 8, 2), (4, 8, 4), (2, 4, 3)]]


@pytest.mark.parametrize("costs", [(1.0, 2.0, 1.0), (3.0, 5.0, 2.0)])
@pytest.mark.parametrize("name,p,m,v", PIPELINES)
def test_pipeline_schedules_replay_to_pipelining_simulate(name, p, m, v, costs):
    schedule = make_schedule(name, p, m, v)
    ref = simulate(schedule, *costs)
    res = simulate_trace(traces_from_schedule(schedule, *costs), UNIT)
    same = (lambda x: x) if v != 3 else (lambda x: pytest.approx(x, rel=1e-12))  # v=3 rounds
    assert (res.step_time_s, *res.idle_s.values()) == same((ref.makespan, *ref.idle))
    assert tuple(res.compute_s.values()) == same(ref.busy)
    for r, row in enumerate(ref.timelines):                  # every action at its time
        got = [iv for iv in res.timeline(r) if iv.stream is Stream.COMPUTE]
        assert [iv.op.name for iv in got] == [str(t.action) for t in row]
        want = [x for t in row for x in (t.start, t.end)]
        assert [x for iv in got for x in iv[2:4]] == same(want)
    check_accounting(res)


def test_pipeline_p2p_latency_adds_per_hop():
    """GPipe, p stages, m=1: 2(p-1) transfers on the critical path, each alpha + n/bw."""
    p, n = 4, 1 << 20
    model = SimpleCostModel(1.0, math.inf, ALPHA_S, BW)
    res = simulate_trace(traces_from_schedule(make_schedule("gpipe", p, 1), 1.0, 2.0, 1.0,
                                              nbytes=n), model)
    assert res.step_time_s == pytest.approx(p * 3.0 + 2 * (p - 1) * (ALPHA_S + n / BW))
    check_accounting(res)


# --------------------------------------------------------------------------- overlap
@pytest.mark.parametrize("overlap_s", [0.0, 0.5, 1.0, 1.5, 4.0])
def test_async_all_reduce_exposes_only_what_compute_does_not_hide(overlap_s):
    n, comm_s = 1 << 24, 1.0                     # 2(p-1)/p * n/bw = n/bw = 1 s with p = 2
    row = [comp(1.0), coll("all_reduce", (0, 1), n, handle=7), comp(overlap_s), TraceWait(7),
           comp(0.25)]
    res = simulate_trace(traces(row, row), SimpleCostModel(1.0, math.inf, 0.0, float(n)))
    for s in res.stats:
        assert s.exposed_comm_s == pytest.approx(max(0.0, comm_s - overlap_s))
        assert s.bubble_s == 0.0 and s.comm_s == comm_s
    assert res.step_time_s == pytest.approx(1.25 + max(comm_s, overlap_s))
    check_accounting(res)


def test_comm_stream_runs_one_collective_at_a_time_and_drains_at_the_end():
    model = SimpleCostModel(1.0, math.inf, 0.0, 1.0)            # all_reduce of 2 bytes, p=2: 2 s
    row = [coll("all_reduce", (0, 1), 2, handle=1), coll("all_reduce", (0, 1), 2, handle=2),
           TraceWait(2), coll("all_reduce", (0, 1), 2, handle=3), comp(1.0)]
    res = simulate_trace(traces(row, row), model)
    assert res.step_time_s == 6.0 and res.comm_s[0] == 6.0
    comm = [(iv.start_s, iv.end_s) for iv in res.timeline(0) if iv.stream is Stream.COMM]
    assert comm == [(0.0, 2.0), (2.0, 4.0), (4.0, 6.0)]
    assert res.exposed_comm_s[0] == 5.0                         # 4 s, then 1 s not hidden
    waits = [iv[:4] for iv in res.timeline(0) if iv.stream is Stream.WAIT]
    assert waits == [(2, TraceWait(2), 0.0, 4.0), (5, None, 5.0, 6.0)]


def test_sends_on_one_link_go_one_at_a_time():
    model = SimpleCostModel(1.0, math.inf, 0.5, 1.0)            # p2p: 0.5 + nbytes s
    rows = ([TraceSend(1, 2, 0), TraceSend(1, 1, 1), comp(1.0)],
            [comp(3.0), TraceRecv(0, 1, 1), TraceRecv(0, 2, 0), comp(1.0)])
    res = simulate_trace(traces(*rows), model)
    p2p = [(iv.start_s, iv.end_s) for iv in res.timeline(0) if iv.stream is Stream.P2P]
    assert p2p == [(0.0, 2.5), (2.5, 4.0)]
    assert res.step_time_s == 5.0                                # recv done at 4, then 1 s
    s1 = res.stats_of(1)
    assert (s1.exposed_comm_s, s1.bubble_s) == (1.0, 0.0)        # blocked 3..4, tag 1 on link
    assert res.comm_s[0] == res.comm_s[1] == 4.0


class _NicCosts:
    """Compute: f flops take f s; every collective 1 s; every transfer 1 s and occupies
    its receiver's NIC (a port, as ``HardwareCostModel.p2p_ports`` names them)."""

    def compute_time_s(self, op):
        return float(op.flops)

    def collective_time_s(self, op, concurrent=1):
        return 1.0

    def p2p_time_s(self, src, dst, nbytes):
        return 1.0

    def p2p_ports(self, src, dst):
        return (("nic_in", dst),)


def test_transfers_sharing_a_nic_queue_in_send_time_order():
    """Rank 0 sends at t = 5, after five blocking collectives that only it traces (each
    started at once, without an event: the rank runs ahead of the environment's clock);
    rank 1 sends at t = 2. Both transfers enter rank 2's NIC: rank 1's runs first, [2, 3],
    then rank 0's, [5, 6]. Claimed in the order the ranks ran instead, rank 1's would
    wait behind rank 0's until 6 and the step would end at 7."""
    rows = {0: [coll("all_reduce", (0, 3), 8) for _ in range(5)] + [TraceSend(2, 8, 0)],
            1: [comp(2.0), TraceSend(2, 8, 1)],
            2: [TraceRecv(0, 8, 0), TraceRecv(1, 8, 1)]}
    res = simulate_trace({r: DeviceTrace(r, tuple(ops)) for r, ops in rows.items()},
                         _NicCosts(), symmetric=True)
    p2p = {r: [(iv.start_s, iv.end_s) for iv in res.timeline(r) if iv.stream is Stream.P2P]
           for r in (0, 1)}
    assert p2p == {0: [(5.0, 6.0)], 1: [(2.0, 3.0)]}
    assert res.step_time_s == 6.0 and res.comm_s[0] == 6.0


# --------------------------------------------------------------------------- stragglers
def test_a_straggler_slows_everyone_waiting_on_it():
    model = SimpleCostModel(1.0, math.inf, 0.0, 1.0)            # all_reduce 2 bytes, p=3: 8/3 s
    row = [comp(1.0), coll("all_reduce", (0, 1, 2), 2), comp(1.0)]
    ar = 2 * 2 / 3 * 2 / 1.0
    base = simulate_trace(traces(row, row, row), model)
    assert base.step_time_s == pytest.approx(2.0 + ar)
    slow = simulate_trace(traces(row, row, row), model, stragglers={1: 3.0})
    assert slow.step_time_s == pytest.approx(3.0 + ar + 3.0)
    assert slow.bubble_s[0] == pytest.approx(2.0 + 2.0)         # waits 2 s, idle tail 2 s
    assert slow.bubble_s[1] == 0.0 and slow.compute_s[1] == 6.0
    assert all(e == pytest.approx(ar) for e in slow.exposed_comm_s.values())
    check_accounting(slow)


# --------------------------------------------------------------------------- symmetric
MESH = Mesh((2, 2, 2), ("pp", "dp", "tp"))


def stage_program(rank: int, microbatches: int = 3, nbytes: int = 1 << 20) -> DeviceTrace:
    """Forward/backward of one pp stage with TP all-reduces and an overlapped DP all-reduce."""
    idx = MESH.index(rank)
    s, tp, dp = idx["pp"], MESH.group("tp", rank), MESH.group("dp", rank)
    peer = MESH.group("pp", rank)[1 - s]
    ops: list = []
    for j in range(microbatches):
        ops += [TraceRecv(peer, nbytes, 2 * j)] if s == 1 else []
        ops += [TraceCompute("fwd", 4e9, 1 << 26), coll("all_reduce", tp, nbytes)]
        ops += [TraceSend(peer, nbytes, 2 * j)] if s == 0 else []
    for j in range(microbatches):
        ops += [TraceRecv(peer, nbytes, 2 * j + 1)] if s == 0 else []
        ops += [TraceCompute("bwd", 8e9, 1 << 26), coll("all_reduce", tp, nbytes)]
        ops += [TraceSend(peer, nbytes, 2 * j + 1)] if s == 1 else []
    ops += [coll("all_reduce", dp, 64 << 20, handle=0), TraceCompute("opt", 2e9, 1 << 27),
            coll("all_gather", tp, nbytes, handle=1), TraceWait(0), TraceWait(1)]
    return DeviceTrace(rank, tuple(ops))


def test_symmetric_replay_equals_the_full_replay():
    full = simulate_trace([stage_program(r) for r in range(8)], MODEL, mesh=MESH)
    reps = [MESH.rank({"pp": s, "dp": 0, "tp": 0}) for s in range(2)]
    sym = simulate_trace({r: stage_program(r) for r in reps}, MODEL, mesh=MESH, symmetric=True)
    assert sym.ranks == (0, 4) and sym.devices == full.devices == 8
    assert sym.step_time_s == full.step_time_s                    # exactly, not approximately
    for r in reps:
        assert sym.stats_of(r) == full.stats_of(r)
        assert sym.timeline(r) == full.timeline(r)
    assert full.compute_comm_ratio == pytest.approx(sym.compute_comm_ratio)
    check_accounting(full)
    # and the full replay really is symmetric: dp/tp peers match their representative
    for r in range(8):
        assert full.stats_of(r).end_s == full.stats_of(reps[MESH.index(r)["pp"]]).end_s


def test_symmetric_mode_needs_stragglers_traced():
    tr = {0: stage_program(0), 4: stage_program(4)}
    with pytest.raises(ValueError, match=r"straggler rank 1 has no trace.*breaks the symmetry"):
        simulate_trace(tr, MODEL, mesh=MESH, symmetric=True, stragglers={1: 2.0})
    with pytest.raises(ValueError, match="receives from rank 5, which has no trace; trace one "
                                         "representative per pipeline stage"):
        simulate_trace({**tr, 1: stage_program(1)}, MODEL, mesh=MESH, symmetric=True,
                       stragglers={1: 2.0})
    traced = simulate_trace({**tr, 1: stage_program(1), 5: stage_program(5)}, MODEL, mesh=MESH,
                            symmetric=True, stragglers={1: 2.0})
    base = simulate_trace(tr, MODEL, mesh=MESH, symmetric=True)
    assert traced.step_time_s > base.step_time_s


# --------------------------------------------------------------------------- deadlocks
A01, A02, A12 = (coll("all_reduce", g) for g in [(0, 1), (0, 2), (1, 2)])


@pytest.mark.parametrize("rows,stuck,says", [
    (([comp(1.0), TraceSend(1, 8, 1)], [TraceRecv(0, 8, 2)]), [1],
     "rank 1: op #0 TraceRecv(peer=0, nbytes=8, tag=2) waits for a send from rank 0 with tag 2 "
     "that never comes (rank 0 finished its trace without sending it)"),
    (([coll("all_reduce", (0, 1, 2)), comp(1.0)], [coll("all_reduce", (0, 1, 2))], []), [0, 1],
     "rank 0: op #0 waits in blocking all_reduce on group (0, 1, 2) (call #0 on that group): "
     "ranks [2] never call it (rank 2 finished its trace)"),
    (([A01, A02], [A12, A01], [A02, A12]), [0, 1, 2],                  # a cycle of three
     "rank 0: op #0 waits in blocking all_reduce on group (0, 1) (call #0 on that group): "
     "ranks [1] never call it (rank 1 is stuck itself at op #0)"),
    (([coll("all_reduce", (0, 1), handle=1), coll("all_reduce", (0, 1), handle=2), TraceWait(2)],
      []), [0],
     "it is queued on rank 0's communication stream behind an earlier collective"),
    (([coll("all_reduce", (0, 2), handle=1), coll("all_reduce", (0, 1), handle=2), TraceWait(2)],
      [coll("all_reduce", (0, 1), handle=2), TraceWait(2)], []), [0],   # another group's
     "rank 0: at the end of its trace, waits for un-waited asynchronous all_reduce on group "
     "(0, 2) (call #0 on that group): ranks [2] never call it (rank 2 finished its trace)"),
])
def test_deadlocks_name_every_stuck_rank_and_what_it_waits_for(rows, stuck, says):
    with pytest.raises(ReplayDeadlock) as err:
        simulate_trace(traces(*rows), ZeroCostModel())
    assert sorted(err.value.stuck) == stuck and says in str(err.value)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("rows,error,pattern", [
    (([TraceWait(3)],), ValueError, "no asynchronous collective with handle 3"),
    (([coll("all_reduce", (0,), handle=1), coll("all_reduce", (0,), handle=1)],), ValueError,
     "handle 1 is still outstanding"),
    (([coll("all_reduce", (1, 2))], [], []), ValueError, "not a member of group"),
    (([TraceSend(0, 1, 0)],), ValueError, "cannot send to itself"),
    (([TraceSend(1, 4, 0)], [TraceRecv(0, 8, 0)]), ValueError, "carries 4 bytes, not 8"),
    (([object()],), TypeError, "expected a trace op"),
    (([coll("all_reduce", (0, 0))],), ValueError, "lists a rank twice"),
    (([coll("all_reduce", (0, 5))],), ValueError,
     r"members \[5\] of group \(0, 5\) have no trace; pass every member's trace, or symmetric"),
    (([coll("all_reduce", (0, 1))], [coll("all_gather", (0, 1))]), CollectiveMismatch,
     r"call #0 on group \(0, 1\): rank 1 \(op #0\) calls all_gather"),
    (([TraceRecv(3, 0, 0)],), ValueError, "receives from rank 3, which has no trace"),
])
def test_bad_traces_raise_naming_the_op(rows, error, pattern):
    with pytest.raises(error, match=pattern):
        simulate_trace(traces(*rows), UNIT)


@pytest.mark.parametrize("args,kwargs,error,pattern", [
    (({1: DeviceTrace(0, ())}, UNIT), {}, ValueError, "holds the trace of rank 0"),
    (([DeviceTrace(0, ())] * 2, UNIT), {}, ValueError, "two traces for rank 0"),
    (([DeviceTrace(0, ())], object()), {}, TypeError, "must implement CostModel"),
    (([DeviceTrace(0, ())], UNIT), {"stragglers": {0: 0.0}}, ValueError, "slowdown factor > 0"),
    (([DeviceTrace(9, ())], UNIT), {"mesh": Mesh((2, 4), ("a", "b"))}, ValueError,
     r"outside Mesh.*valid ranks 0..7"),
    (([], UNIT), {}, ValueError, "no traces given"),
])
def test_bad_arguments_raise(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        simulate_trace(*args, **kwargs)
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        SimpleCostModel(1.0, 1.0, 0.0, 0.0)


# --------------------------------------------------------------------------- results
def test_results_table_summary_and_independence():
    rows = [stage_program(r) for r in range(8)]
    res = simulate_trace(rows, MODEL)
    assert list(res.per_rank.columns) == ["compute_s", "comm_s", "exposed_comm_s", "bubble_s",
                                          "idle_s", "end_s"]
    assert list(res.per_rank.index) == list(range(8)) and res.summary()["devices"] == 8
    assert res.summary()["compute_comm_ratio"] == res.compute_comm_ratio == pytest.approx(
        sum(res.compute_s.values()) / sum(res.comm_s.values()))
    assert len(res.timeline_frame()) == sum(len(t) for t in res.timelines)
    assert all([iv.start_s for iv in t] == sorted(iv.start_s for iv in t) for t in res.timelines)
    assert isinstance(MODEL, CostModel) and isinstance(ZeroCostModel(), CostModel)
    # two replays in one process do not interfere; no timeline changes nothing else
    other = simulate_trace(traces([comp(1.0)]), UNIT)
    again = simulate_trace(rows, MODEL, timeline=False)
    assert again.stats == res.stats and again.step_time_s == res.step_time_s
    assert other.step_time_s == 1.0 and all(t == () for t in again.timelines)


# --------------------------------------------------------------------------- random programs
class NoSharing(SimpleCostModel):
    def collective_time_s(self, op, concurrent=1):
        return super().collective_time_s(op, 1)


@st.composite
def programs(draw):
    """Steps in one global order every rank follows: (kind, ranks, size)."""
    p, steps, open_async = draw(st.integers(2, 4)), [], []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["compute", "coll", "async", "wait", "p2p"]))
        ranks = tuple(sorted(draw(st.sets(st.integers(0, p - 1), min_size=1, max_size=p))))
        if kind == "compute":
            steps.append((kind, ranks[:1], draw(st.integers(0, 4)) / 4))
        elif kind in ("coll", "async"):
            steps.append((kind, ranks, draw(st.integers(0, 1 << 12))))
            open_async += [len(steps) - 1] if kind == "async" else []
        elif kind == "wait" and open_async:
            steps.append((kind, open_async.pop(draw(st.integers(0, len(open_async) - 1))), 0))
        elif kind == "p2p":
            steps.append((kind, tuple(draw(st.permutations(range(p)))[:2]), 1000))
    return p, steps


def by_hand(p, steps, model):
    """The traces of a program and its step time by max-plus in the global order."""
    rows, clock, free, links, issued = [[] for _ in range(p)], [0.0] * p, {}, {}, {}
    for k, (kind, ranks, size) in enumerate(steps):
        if kind == "compute":
            rows[ranks[0]].append(comp(size))
            clock[ranks[0]] += size
        elif kind == "coll":
            end = max(clock[m] for m in ranks) + model.collective_time_s(
                coll("all_reduce", ranks, size))
            for m in ranks:
                rows[m].append(coll("all_reduce", ranks, size))
                clock[m] = end
        elif kind == "async":                      # a comm stream per rank and group, FIFO
            issued[k] = ranks, max(max(clock[m], free.get((m, ranks), 0.0)) for m in ranks) \
                + model.collective_time_s(coll("all_reduce", ranks, size))
            for m in ranks:
                rows[m].append(coll("all_reduce", ranks, size, handle=k))
                free[(m, ranks)] = issued[k][1]
        elif kind == "wait":
            group, end = issued.pop(ranks)
            for m in group:
                rows[m].append(TraceWait(ranks))
                clock[m] = max(clock[m], end)
        else:
            (a, b), start = ranks, max(clock[ranks[0]], links.get(ranks, 0.0))
            rows[a].append(TraceSend(b, size, k))
            rows[b].append(TraceRecv(a, size, k))
            links[ranks] = end = start + model.p2p_time_s(a, b, size)
            clock[b] = max(clock[b], end)
    for group, end in issued.values():             # un-waited: waited at the end
        clock = [max(c, end) if m in group else c for m, c in enumerate(clock)]
    return traces(*rows), max(clock + list(links.values()))


@settings(max_examples=150, deadline=None)
@given(programs())
def test_random_programs_match_a_max_plus_reference(program):
    model = NoSharing(1.0, math.inf, 1e-3, 1e6)
    rows, step_time_s = by_hand(*program, model)
    res = simulate_trace(rows, model)
    assert res.step_time_s == pytest.approx(step_time_s, abs=1e-12)
    check_accounting(res)


# --------------------------------------------------------------------------- performance
def test_replay_of_200k_ops_is_fast():
    """8 ranks x ~25k ops (compute, TP all-reduces, p2p, overlapped DP all-reduce)."""
    rows = [stage_program(r, microbatches=4200) for r in range(8)]
    assert sum(len(t) for t in rows) >= 200_000
    t0 = time.perf_counter()
    res = simulate_trace(rows, MODEL)
    elapsed = time.perf_counter() - t0                            # ~0.6 s on 2 cores
    assert elapsed < 5.0, f"replay of 200k ops took {elapsed:.2f} s"
    check_accounting(res)
