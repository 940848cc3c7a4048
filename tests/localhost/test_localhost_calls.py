"""Per-call CPU of communication on ``localhost`` (vcluster.localhost.calls): the
lookup table interpolates as documented, and the cost model prices calls from it — the
measured CPU at CALL_BYTES less the bytes it moved there, plus the bytes of the call."""

from __future__ import annotations

import math
import time

import pytest

from tests.localhost_specs import spec
from tests.localhost.test_localhost import BUSY

from vcluster.runtime.layout import INLINE_BYTES
from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.runtime.traffic import collective_traffic
from vcluster.localhost.cost_model import LocalhostCostModel
from vcluster.localhost.calls import CALL_BYTES, CALLS, CallCpu, cluster_sizes

US = 1e-6
# back-to-back figures half the program ones of _rows() on 8 devices (groups 2, 4, 8)
HALF_B2B = dict(barrier_cpu_s=(100 * US, 200 * US, 400 * US),
                small_all_reduce_cpu_s=(100 * US, 200 * US, 400 * US),
                large_all_reduce_cpu_s=(100 * US, 200 * US, 400 * US), p2p_message_cpu_s=50 * US)


def _rows(scale=1.0):
    """Every call at 4 and 8 devices, groups 2 and 4 (8 devices also 8): a figure that
    grows with the group, x1.5 on the smaller cluster."""
    rows = []
    for d in (4, 8):
        for call in CALLS:
            groups = (2,) if call.startswith(("send", "recv")) else \
                tuple(g for g in (2, 4, 8) if g <= d)
            for g in groups:
                rows.append((d, call, g, scale * (1.5 if d == 4 else 1.0) * 100 * g * US))
    return tuple(rows)


def test_lookup_interpolates_devices_linearly_and_groups_log_log():
    calls = CallCpu(_rows())
    assert calls.seconds("barrier", 8, 4) == pytest.approx(400 * US)
    assert calls.seconds("barrier", 4, 2) == pytest.approx(300 * US)
    assert calls.seconds("barrier", 6, 2) == pytest.approx(250 * US)      # halfway 4 -> 8
    assert calls.seconds("barrier", 2, 2) == pytest.approx(300 * US)      # nearest: 4
    assert calls.seconds("barrier", 16, 2) == pytest.approx(200 * US)     # nearest: 8
    assert calls.seconds("barrier", 8, 16) == pytest.approx(1600 * US)    # y ~ group
    assert calls.seconds("all_gather", 8, 3) == pytest.approx(300 * US)   # log-log, exact
    assert calls.seconds("send", 8, 2) == pytest.approx(200 * US)


def test_rows_are_validated():
    with pytest.raises(ValueError, match="bad row"):
        CallCpu(_rows() + ((8, "broadcast", 2, 1e-4),))
    with pytest.raises(ValueError, match="bad row"):
        CallCpu(_rows() + ((4, "barrier", 8, 1e-4),))                     # group > devices
    with pytest.raises(ValueError, match="no rows for"):
        CallCpu(tuple(r for r in _rows() if r[1] != "recv"))
    with pytest.raises(ValueError, match="call_cpu_s"):
        spec(call_cpu_s=((8, "barrier", 2, -1.0),))


def test_cluster_sizes_span_one_device_per_core_to_all():
    assert cluster_sizes(8, 2) == (2, 4, 8)
    assert cluster_sizes(8, 8) == (2, 8)
    assert cluster_sizes(2, 16) == (2,)


def test_model_prices_calls_from_the_table():
    s = spec(call_cpu_s=_rows())
    model = LocalhostCostModel(s, 8, "float32")
    members = tuple(range(4))
    # barrier and inline calls: the measured figure itself
    assert model.collective_cpu_s(TraceCollective("barrier", members, 0, 1, "shm"), 0) \
        == pytest.approx(400 * US)
    small = TraceCollective("all_reduce", members, INLINE_BYTES, 4, "shm")
    assert model.collective_cpu_s(small, 1) == pytest.approx(400 * US)
    # a large call: measured at CALL_BYTES, less those bytes, plus its own
    n, big = 4, 1 << 20
    op = TraceCollective("all_gather", members, big, 4, "shm")

    def copied(nbytes):            # all_gather: a member reads every input, its own too
        return n * nbytes / s.channel_copy_bytes_per_s
    want = 400 * US - copied(CALL_BYTES) + copied(big)
    assert model.collective_cpu_s(op, 2) == pytest.approx(want)
    # broadcast is priced like all_gather, reduce like reduce_scatter
    bcast = TraceCollective("broadcast", members, big, 4, "shm")
    assert model.collective_cpu_s(bcast, 1) > 400 * US - copied(CALL_BYTES)
    # the smaller cluster pays its own, larger, figures
    assert LocalhostCostModel(s, 4, "float32").collective_cpu_s(small, 0) \
        == pytest.approx(600 * US)


def test_model_prices_messages_from_the_table():
    s = spec(call_cpu_s=_rows())
    model = LocalhostCostModel(s, 8, "float32")
    assert model.p2p_cpu_s(0, 1, 8) == pytest.approx((200 * US, 200 * US))
    assert model.p2p_cpu_s(0, 1, CALL_BYTES) == pytest.approx((200 * US, 200 * US))
    more = (1 << 20) - CALL_BYTES
    extra = more * s.busy_factor(s.memcpy_busy_speedup) / s.p2p_copy_bytes_per_s
    snd, rcv = model.p2p_cpu_s(0, 1, 1 << 20)
    assert (snd, rcv) == pytest.approx((200 * US + extra, 200 * US + extra))
    # a ring all_reduce is its messages, back to back inside the call
    members = tuple(range(4))
    op = TraceCollective("all_reduce", members, 1 << 20, 4, "ring")
    t = collective_traffic("all_reduce", "ring", members, 0, 1 << 20, 4)
    side = s.p2p_latency_s / 2
    want = (t.messages_sent + t.messages_received) * side + (t.bytes_sent + t.bytes_received) \
        * s.busy_factor(s.memcpy_busy_speedup) / s.p2p_copy_bytes_per_s
    assert model.collective_cpu_s(op, 0) == pytest.approx(want)
    assert math.isfinite(want) and want > 0


def test_busy_copy_rate_prices_message_bytes_when_measured():
    """With ``p2p_busy_copy_bytes_per_s`` a message side's bytes beyond CALL_BYTES cost
    that rate's CPU (one busy figure), in sends and in message algorithms alike."""
    rate = 6e9
    s = spec(call_cpu_s=_rows(), p2p_busy_copy_bytes_per_s=rate)
    model = LocalhostCostModel(s, 8, "float32")
    more = (1 << 20) - CALL_BYTES
    assert model.p2p_cpu_s(0, 1, 1 << 20) == pytest.approx((200 * US + more / rate,
                                                            200 * US + more / rate))
    members = tuple(range(4))
    op = TraceCollective("all_gather", members, 1 << 18, 4, "ring")
    t = collective_traffic("all_gather", "ring", members, 1, 1 << 18, 4)
    want = (t.messages_sent + t.messages_received) * s.p2p_latency_s / 2 \
        + (t.bytes_sent + t.bytes_received) / rate
    assert model.collective_cpu_s(op, 1) == pytest.approx(want)
    d = s.to_dict()
    del d["p2p_busy_copy_bytes_per_s"]                       # older specs still load
    assert type(s).from_dict(d) == spec(call_cpu_s=_rows())
    with pytest.raises(ValueError, match="p2p_busy_copy_bytes_per_s"):
        spec(p2p_busy_copy_bytes_per_s=0.0)


def test_without_the_table_the_older_pricing_stands():
    old, new = LocalhostCostModel(spec(), 8), LocalhostCostModel(spec(call_cpu_s=_rows()), 8)
    op = TraceCollective("barrier", tuple(range(8)), 0, 1, "shm")
    assert old.collective_cpu_s(op, 0) == pytest.approx(old.barrier_share_s(8))
    assert new.collective_cpu_s(op, 0) == pytest.approx(800 * US)


# --- the start of a run, cold and in-rhythm calls -----------------------------------------
def test_prepare_traces_adds_the_start_and_the_cold_calls():
    """Every rank first does W0 T(n)/n of work (n ranks at once take W0); before its first
    collective or receive (f - 1) times that call's program CPU at no more than
    CALL_BYTES; before every collective that follows other work its cold extra, none
    before one that follows another call on its group."""
    from vcluster.runtime.tracing.ops import DeviceTrace, TraceCompute, TraceRecv, TraceSend
    from vcluster.localhost.start import COLD_CALL, FIRST_CALL, RUN_START
    s = spec(call_cpu_s=_rows(), start_s=((4, 200 * US, 1.5), (8, 600 * US, 2.0)),
             **HALF_B2B)
    model = LocalhostCostModel(s, 8, "float32")
    big = TraceCollective("all_gather", (0, 1), 1 << 20, 4, "shm")
    bare = TraceCompute("host", 0.0, 0, host_s=1e-6, array_calls=0)
    traces = [DeviceTrace(0, (TraceCompute("a", 1.0, 8), big, bare, big)),
              DeviceTrace(1, (TraceCompute("a", 1.0, 8), TraceRecv(2, 8, 0), big, bare, big)),
              DeviceTrace(2, (TraceSend(1, 8, 0),))]
    out = model.prepare_traces(traces)
    names = [[getattr(op, "name", type(op).__name__) for op in t.ops] for t in out]
    assert names[0] == [RUN_START, "a", FIRST_CALL, COLD_CALL, "TraceCollective", "host",
                        "TraceCollective"]                 # the second call is in rhythm
    assert names[1] == [RUN_START, "a", FIRST_CALL, "TraceRecv", COLD_CALL,
                        "TraceCollective", "host", "TraceCollective"]
    assert names[2] == [RUN_START, "TraceSend"]             # sends do not synchronise
    t8 = s.core_pool.throughput_at(8)
    assert out[0].ops[0].seconds == pytest.approx(600 * US * t8 / 8)
    small = TraceCollective("all_gather", (0, 1), CALL_BYTES, 4, "shm")
    program = model.collective_cpu_s(small, 0) + model.cold_call_s(small, 0)
    assert out[0].ops[2].seconds == pytest.approx((2.0 - 1) * program)
    assert out[1].ops[2].seconds == pytest.approx(model.p2p_cpu_s(2, 1, 8)[1])
    # the cold extra: half the call's synchronisation (b2b is half the program figure)
    moved = 2 * CALL_BYTES / s.channel_copy_bytes_per_s     # all_gather over 2 at 4 KiB
    assert model.cold_call_s(big, 0) == pytest.approx(0.5 * (200 * US - moved))
    assert out[0].ops[3].seconds == pytest.approx(model.cold_call_s(big, 0))
    # 6 devices: halfway between the sizes
    w0, f = LocalhostCostModel(s, 6, "float32")._start_figures()
    assert (w0, f) == pytest.approx((400 * US, 1.75))
    # without the figures, nothing is added
    assert LocalhostCostModel(spec(), 8).prepare_traces(traces) == traces


def test_in_rhythm_calls_cost_the_back_to_back_figure():
    """A call's price in the trace is its back-to-back figure (the program figure scaled
    by the ratio of the two on all N devices); the cold extra makes up the difference."""
    s = spec(call_cpu_s=_rows(), **BUSY)
    model = LocalhostCostModel(s, 8, "float32")
    barrier = TraceCollective("barrier", (0, 1, 2, 3), 0, 1, "shm")
    ratio = BUSY["barrier_cpu_s"][1] / (400 * US)              # b2b / program, group 4 on 8
    assert model.collective_cpu_s(barrier, 0) == pytest.approx(400 * US * min(1, ratio))
    assert model.collective_cpu_s(barrier, 0) + model.cold_call_s(barrier, 0) \
        == pytest.approx(400 * US)
    ring = TraceCollective("all_reduce", (0, 1, 2, 3), 1 << 20, 4, "ring")
    assert model.cold_call_s(ring, 0) == 0.0


def test_start_rows_are_validated():
    with pytest.raises(ValueError, match="start_s"):
        spec(start_s=((8, 1e-4, 0.5),))                 # a factor below 1
    with pytest.raises(ValueError, match="start_s"):
        spec(start_s=((8, 1e-4),))
    s = spec(start_s=((8, 5e-4, 1.9), (4, 1e-4, 2.0)))
    assert s.start_s == ((4, 1e-4, 2.0), (8, 5e-4, 1.9))
    assert type(s).from_dict(s.to_dict()) == s


def test_measure_start_on_real_clusters():
    """The calibration's start programs run on clusters of 2 devices: an empty program's
    wall time and a first-call factor >= 1 (no timing bounds: a noisy machine), and the
    split of the devices over the cores counted in every timed run (Linux)."""
    import os
    from vcluster.timing.core_pool import CorePoolSpec
    from vcluster.localhost.start import START_REPS, current_core, measure_start
    cores = os.cpu_count()
    (row,), splits = measure_start((2,), lambda d: 100 * US, CorePoolSpec(cores))
    d, w0, f = row
    assert d == 2 and 0 < w0 < 0.1 and 1.0 <= f < 1e4
    if current_core() is None:
        assert splits is None
        return
    assert sum(n for _, _, n in splits) == 2 * START_REPS          # both programs, every rep
    assert all(d == 2 and sum(split) == 2 and len(split) == cores for d, split, _ in splits)


def _stamp(dev, task: int):
    """On rank 0: [(task, the moment it ran)]; None elsewhere (round_robin drops Nones)."""
    return [(task, time.perf_counter())] if dev.rank == 0 else None


def test_round_robin_runs_every_task_in_turns_on_a_real_cluster():
    from mesh import Mesh
    from vcluster import VirtualCluster
    from vcluster.localhost.calls import round_robin
    with VirtualCluster(Mesh((2,), ("x",))) as cluster:
        samples = round_robin(cluster, [(_stamp, [(t,)] * 2) for t in range(3)], runs=4)
    assert [[t for t, _ in got] for got in samples] == [[t] * 4 for t in range(3)]
    order = sorted((when, t) for t, got in enumerate(samples) for _, when in got)
    assert [t for _, t in order] == [0, 1, 2] * 4           # in turns, not back to back


def test_measure_call_cpu_on_a_real_cluster():
    from mesh import Mesh
    from vcluster import VirtualCluster
    from vcluster.localhost.calls import measure_call_cpu
    with VirtualCluster(Mesh((2, 2), ("a0", "a1"))) as cluster:
        rows = measure_call_cpu(cluster, (2, 2), ("a0", "a1"), cores=2)
    keys = [(d, c, g) for d, c, g, _ in rows]
    assert len(keys) == len(set(keys))
    seconds = {(d, c, g): s for d, c, g, s in rows}
    expected = {(d, c, g) for d, groups in ((2, (2,)), (4, (2, 4))) for g in groups
                for c in CALLS if not c.startswith(("send", "recv"))}
    expected |= {(d, c, 2) for d in (2, 4) for c in CALLS if c.startswith(("send", "recv"))}
    assert set(keys) == expected
    assert all(0 < s < 0.1 for *_, s in rows)
    table = CallCpu(rows)                                               # a valid table
    assert table.seconds("all_reduce", 4, 4) == seconds[(4, "all_reduce", 4)]
