"""Per-call CPU of communication on ``localhost`` (vcluster.timing.localhost_calls): the
lookup table interpolates as documented, and the cost model prices calls from it — the
measured CPU at CALL_BYTES less the bytes it moved there, plus the bytes of the call."""

from __future__ import annotations

import math

import pytest

from test_localhost import spec
from vcluster.runtime.layout import INLINE_BYTES
from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.runtime.traffic import collective_traffic
from vcluster.timing.localhost import LocalhostCostModel
from vcluster.timing.localhost_calls import CALL_BYTES, CALLS, CallCpu, cluster_sizes

US = 1e-6


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
    # a ring all_reduce is its messages, each priced as a message of its size
    members = tuple(range(4))
    op = TraceCollective("all_reduce", members, 1 << 20, 4, "ring")
    t = collective_traffic("all_reduce", "ring", members, 0, 1 << 20, 4)
    want = sum(m * model.p2p_cpu_s(0, 1, b // m)[0] for _, b, m in t.sent) \
        + sum(m * model.p2p_cpu_s(0, 1, b // m)[1] for _, b, m in t.received)
    assert model.collective_cpu_s(op, 0) == pytest.approx(want)
    assert math.isfinite(want) and want > 0


def test_without_the_table_the_older_pricing_stands():
    old, new = LocalhostCostModel(spec(), 8), LocalhostCostModel(spec(call_cpu_s=_rows()), 8)
    op = TraceCollective("barrier", tuple(range(8)), 0, 1, "shm")
    assert old.collective_cpu_s(op, 0) == pytest.approx(old.barrier_share_s(8))
    assert new.collective_cpu_s(op, 0) == pytest.approx(800 * US)
