"""A call's CPU after longer stretches of work (vcluster.localhost.gaps): the lookup
interpolates as documented, the spec keeps and validates its rows, the model charges
``(g(w) - 1)`` times the call's program figure for the work ``w`` its rank did since its
previous communication, and a real measurement gives a row per gap, group and size. The
stretches' own CPU against their warm price gives the cold-stretch extra
(``ColdStretch``), which host-timed traces pay between blocking calls."""

from __future__ import annotations

import pytest

from tests.localhost_specs import spec
from tests.localhost.test_localhost_calls import HALF_B2B, _rows

from vcluster.runtime.tracing.ops import DeviceTrace, TraceCollective, TraceCompute, TraceRecv
from vcluster.localhost.cost_model import LocalhostCostModel
from vcluster.localhost.calls import GAP_REFERENCE_CALLS
from vcluster.localhost.gaps import GAP_PASSES, CallGap, ColdStretch, measure_gap_cpu
from vcluster.localhost.host_work import REFERENCE_CALLS, TracerRates
from vcluster.localhost.start import COLD_CALL, COLD_STRETCH

pytestmark = pytest.mark.timeout(120)

US = 1e-6
# 4 and 8 devices; groups 2 and 8 on 8, 2 on 4; gaps 0.1 and 1.1 ms
GAP_ROWS = ((8, 2, 100 * US, 100 * US), (8, 2, 1100 * US, 150 * US),
            (8, 8, 100 * US, 200 * US), (8, 8, 1100 * US, 400 * US),
            (4, 2, 100 * US, 100 * US), (4, 2, 1100 * US, 120 * US))


def test_factor_is_linear_in_the_gap_and_clamped():
    g = CallGap(GAP_ROWS)
    assert g.factor(8, 8, 100 * US) == pytest.approx(1.0)
    assert g.factor(8, 8, 0.0) == pytest.approx(1.0)              # below the first gap
    assert g.factor(8, 8, 600 * US) == pytest.approx(1.5)         # halfway: 300 / 200
    assert g.factor(8, 8, 1.0) == pytest.approx(2.0)              # beyond the last
    assert g.factor(8, 2, 1100 * US) == pytest.approx(1.5)
    # groups: linear between the measured ones; devices: linear between the sizes
    assert g.factor(8, 5, 1100 * US) == pytest.approx(1.75)
    assert g.factor(6, 2, 1100 * US) == pytest.approx((1.5 + 1.2) / 2)
    assert g.factor(4, 8, 1100 * US) == pytest.approx(1.2)        # 4 devices know group 2


@pytest.mark.parametrize("rows, what", [
    (((8, 9, 1e-4, 1e-4),), "group <= devices"),
    (((8, 2, -1.0, 1e-4),), "gap_s >= 0"),
    (((8, 2, 1e-4, 0.0),), "seconds > 0"),
    (((8, 2, 1e-4, 1e-4), (8, 2, 1e-4, 2e-4)), "a gap twice"),
    (((8, 2, 1e-4),), "rows must be"),
    ((), "no rows"),
])
def test_rows_are_validated(rows, what):
    with pytest.raises(ValueError, match=what):
        CallGap(rows)
    with pytest.raises(ValueError, match="call_gap_cpu_s"):
        spec(call_gap_cpu_s=rows)


def test_spec_keeps_the_rows_and_older_specs_load():
    s = spec(call_cpu_s=_rows(), call_gap_cpu_s=GAP_ROWS)
    assert type(s).from_dict(s.to_dict()) == s
    d = s.to_dict()
    del d["call_gap_cpu_s"]
    assert type(s).from_dict(d).call_gap_cpu_s is None


def test_model_charges_the_work_since_the_last_communication():
    """Rank 0 works 600 us (two ops) before a cold all_reduce over 8: its extra is the
    cold extra plus (g - 1) = 0.5 times the call's program figure; after a receive the
    count starts again; message algorithms and specs without rows add nothing."""
    s = spec(call_cpu_s=_rows(), call_gap_cpu_s=GAP_ROWS, **HALF_B2B)
    model = LocalhostCostModel(s, 8, "float32")
    work = TraceCompute("w", 0.0, 0, seconds=300 * US)
    group = tuple(range(8))
    call = TraceCollective("all_reduce", group, 4096, 4, "shm")
    ring = TraceCollective("all_reduce", group, 4096, 4, "ring")
    program = model._parts(call, 0)[2]
    assert model.gap_extra_s(call, 0, 600 * US) == pytest.approx(0.5 * program)
    assert model.gap_extra_s(call, 0, 50 * US) == 0.0
    assert model.gap_extra_s(ring, 0, 600 * US) == 0.0
    out = model.prepare_traces([DeviceTrace(0, (work, work, call)),
                                DeviceTrace(0, (work, work, TraceRecv(1, 8, 0), call))])
    cold = [op.seconds for op in out[0].ops if getattr(op, "name", None) == COLD_CALL]
    assert cold == pytest.approx([model.cold_call_s(call, 0) + 0.5 * program])
    cold = [op.seconds for op in out[1].ops if getattr(op, "name", None) == COLD_CALL]
    assert cold == pytest.approx([model.cold_call_s(call, 0)])    # nothing since the recv
    plain = LocalhostCostModel(spec(call_cpu_s=_rows(), **HALF_B2B), 8, "float32")
    assert plain.gap_extra_s(call, 0, 600 * US) == 0.0


# --- the cold stretch ------------------------------------------------------------------------
NUMPY_S, PYTHON_S = 1 * US, 20 * US
WARM = tuple(GAP_REFERENCE_CALLS * REFERENCE_CALLS * NUMPY_S + PYTHON_S + p * PYTHON_S
             for p in GAP_PASSES)                         # 42, 282, 842 us


def _cold_rows(extras_by_size: dict) -> tuple:
    """Gap rows whose stretches measured their warm price plus ``extras`` (per size, one
    per GAP_PASSES; groups 2 and the size, the group 2 rows 10 us dearer)."""
    rows = []
    for d, extras in extras_by_size.items():
        for g, more in ((2, 10 * US), (d, 0.0)):
            rows += [(d, g, w + e + more, 100 * US) for w, e in zip(WARM, extras)]
    return tuple(rows)


def _cold_spec(extras_by_size):
    return spec(call_cpu_s=_rows(), call_gap_cpu_s=_cold_rows(extras_by_size),
                numpy_call_s=NUMPY_S, python_unit_s=PYTHON_S, block_overhead_s=2 * US,
                **HALF_B2B)


def test_cold_stretch_is_the_measured_cpu_less_the_warm_price():
    s = _cold_spec({4: (20 * US, 30 * US, 50 * US), 8: (30 * US, 40 * US, 60 * US)})
    cold = ColdStretch.of_spec(s)
    assert cold.warm_s == pytest.approx(WARM)
    assert cold.sizes == (4, 8)
    # median over the groups (2: 10 us dearer, 8: as listed) of measured - warm
    assert cold.extra_s[1] == pytest.approx((35 * US, 45 * US, 65 * US))
    assert cold.extra(8, WARM[0]) == pytest.approx(35 * US)
    assert cold.extra(8, WARM[0] / 2) == pytest.approx(17.5 * US)   # proportional below
    assert cold.extra(8, (WARM[1] + WARM[2]) / 2) == pytest.approx(55 * US)
    assert cold.extra(8, 1.0) == pytest.approx(65 * US)            # flat beyond
    assert cold.extra(6, WARM[2]) == pytest.approx((55 + 65) / 2 * US)
    assert cold.extra(8, 0.0) == 0.0
    # a stretch measured cheaper than its warm price costs nothing more
    assert ColdStretch.of_spec(_cold_spec({8: (-15 * US, 0.0, 0.0)})).extra(8, WARM[0]) == 0.0
    assert ColdStretch.of_spec(spec()) is None                       # no gap rows, no rates
    two_gaps = spec(call_gap_cpu_s=GAP_ROWS, numpy_call_s=NUMPY_S, python_unit_s=PYTHON_S,
                    block_overhead_s=2 * US)
    assert ColdStretch.of_spec(two_gaps) is None                     # not one per GAP_PASSES


def test_host_timed_traces_pay_the_cold_stretch_unless_between_messages():
    """Rank 0 works 300 us, receives, works 100 us, sends (not blocking), works 100 us,
    calls all_reduce, works 30 us, receives, works 50 us, receives and works 20 us: five
    stretches. Those from the start (300 us), into the collective (200, after a receive)
    and out of it (30) pay the cold extra; those from a receive to a receive (50) or to
    the end (20) none."""
    s = _cold_spec({8: (30 * US, 40 * US, 60 * US)})
    rates = TracerRates(segment_s=1 * US, meta_call_s=5 * US, python_unit_s=PYTHON_S)
    model = LocalhostCostModel(s, 8, "float32", tracer=rates)
    cold = ColdStretch.of_spec(s)

    def work(us):
        return TraceCompute("w", 0.0, 0, seconds=us * US)
    from vcluster.runtime.tracing.ops import TraceSend
    call = TraceCollective("all_reduce", tuple(range(8)), 4096, 4, "shm")
    ops = (work(300), TraceRecv(1, 8, 0), work(100), TraceSend(1, 8, 1), work(100), call,
           work(30), TraceRecv(1, 8, 2), work(50), TraceRecv(1, 8, 3), work(20))
    (out,) = model.prepare_traces([DeviceTrace(0, ops)])
    got = [op.seconds for op in out.ops if getattr(op, "name", None) == COLD_STRETCH]
    assert got == pytest.approx([cold.extra(8, w * US) for w in (300, 200, 30)])
    assert got[0] == pytest.approx(45 * US + 20 * US * (300 * US - WARM[1])  # 282 < 300 us
                                   / (WARM[2] - WARM[1]))
    assert got[2] == pytest.approx(35 * US * 30 * US / WARM[0])   # proportional below 42 us
    # each extra comes right before the blocking call its stretch ends at
    names = [getattr(op, "name", type(op).__name__) for op in out.ops]
    blocking = [i for i, name in enumerate(names) if name in ("TraceRecv", "TraceCollective")]
    charged = [i for i, name in enumerate(names) if name == COLD_STRETCH]
    assert [names[i + 1] for i in charged] == ["TraceRecv", COLD_CALL, "TraceRecv"]
    assert names[charged[1] + 2] == "TraceCollective" and len(blocking) == 4
    # traces without host timing (a model without tracer rates) pay none
    (plain,) = LocalhostCostModel(s, 8, "float32").prepare_traces([DeviceTrace(0, ops)])
    assert COLD_STRETCH not in [getattr(op, "name", None) for op in plain.ops]


def test_measure_gap_cpu_on_a_real_cluster():
    from mesh import Mesh
    from vcluster import VirtualCluster
    with VirtualCluster(Mesh((2, 2), ("a0", "a1"))) as cluster:
        rows = measure_gap_cpu(cluster, (2, 2), ("a0", "a1"), cores=2)
    keys = [(d, g) for d, g, _, _ in rows]
    assert sorted(set(keys)) == [(2, 2), (4, 2), (4, 4)]
    assert all(keys.count(k) == len(GAP_PASSES) for k in set(keys))
    for d, g in set(keys):
        gaps = [w for dd, gg, w, _ in rows if (dd, gg) == (d, g)]
        assert gaps == sorted(gaps) and gaps[0] > 0            # longer stretches measured
    assert all(0 < s < 0.1 for *_, s in rows)
    CallGap(rows)                                               # a valid table
