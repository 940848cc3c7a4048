"""A call's CPU after longer stretches of work (vcluster.timing.localhost_gap): the lookup
interpolates as documented, the spec keeps and validates its rows, the model charges
``(g(w) - 1)`` times the call's program figure for the work ``w`` its rank did since its
previous communication, and a real measurement gives a row per gap, group and size."""

from __future__ import annotations

import pytest

from test_localhost import spec
from test_localhost_calls import HALF_B2B, _rows

from vcluster.runtime.tracing.ops import DeviceTrace, TraceCollective, TraceCompute, TraceRecv
from vcluster.timing.localhost import LocalhostCostModel
from vcluster.timing.localhost_gap import GAP_PASSES, CallGap, measure_gap_cpu
from vcluster.timing.localhost_start import COLD_CALL

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
