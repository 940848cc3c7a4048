"""Per-core run queues of the ``localhost`` replay (vcluster/timing/core_queues.py):
closed-form replays on ideal cores, the placements drawn from counted start splits, the
weighted median over placements, and the spec's counted splits (a real calibration counts
them: tests/localhost/test_localhost_calls.py)."""

from __future__ import annotations

import dataclasses

import pytest
from tests.localhost_specs import spec
from tests.localhost.test_localhost_calls import _rows

from vcluster.runtime.tracing.ops import DeviceTrace, TraceCollective, TraceCompute, TraceRecv, \
    TraceSend
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace
from vcluster.timing.core_queues import BALANCE_S, start_placements
from vcluster.timing.core_pool import CorePoolSpec

pytestmark = pytest.mark.timeout(120)

MS = 1e-3
UNIT = SimpleCostModel.compute_only(1.0)        # a compute op of f flops takes f seconds


def work(seconds: float, name: str = "w") -> TraceCompute:
    return TraceCompute(name, seconds, 0)        # UNIT: f flops take f seconds


def placed(*placement, cores: int = 2, mobile=()) -> CorePoolSpec:
    return CorePoolSpec(cores, placements=((placement, 1.0),), mobile_ops=frozenset(mobile))


def ends(rows, pool, costs=UNIT) -> list[float]:
    res = simulate_trace([DeviceTrace(r, tuple(ops)) for r, ops in enumerate(rows)], costs,
                         core_pool=pool)
    return [st.end_s for st in res.stats]


# --- closed forms on ideal cores -----------------------------------------------------------------
def test_pinned_work_keeps_its_split():
    """Four ranks of 1 ms each, split 1:3 over 2 cores: the lone rank ends at 1 ms, the three
    share their core to 3 ms (before a balance could pull one, 1 + BALANCE_S); one pool
    would end all at 2 ms, and a 2:2 split likewise."""
    rows = [[work(1 * MS)] for _ in range(4)]
    assert ends(rows, placed(0, 1, 1, 1)) == pytest.approx([1 * MS, 3 * MS, 3 * MS, 3 * MS])
    assert ends(rows, placed(0, 1, 0, 1)) == pytest.approx([2 * MS] * 4)
    assert ends(rows, CorePoolSpec(2)) == pytest.approx([2 * MS] * 4)


def test_an_idle_core_pulls_a_rank_after_the_balance_delay():
    """1:3 with 10 ms each. Core 0 idles from 10 ms; at b = 10 + B (B = BALANCE_S) core 1's
    jobs have 10 - b/3 left and the last-placed rank moves, running alone to b + (10 - b/3);
    the other two then share core 1 at 1/2 each, and the balance after the mover ends
    (B later) gives each a core for what is left."""
    B = BALANCE_S / MS
    b = 10 + B
    left = 10 - b / 3
    moved_end = b + left
    rest = left - left / 2                          # the two on core 1 at rate 1/2
    stay_end = moved_end + B + (rest - B / 2) if rest > B / 2 else moved_end + 2 * rest
    got = ends([[work(10 * MS)] for _ in range(4)], placed(0, 1, 1, 1))
    assert got[0] == pytest.approx(10 * MS)
    assert sorted(got[1:]) == pytest.approx([moved_end * MS, stay_end * MS, stay_end * MS])


def test_mobile_work_fills_the_idle_core():
    """Ranks 0-2 pinned on core 0 and rank 3 (there too) with 1 ms of mobile work: the
    mobile job takes core 1 alone (1 ms) while the pinned three share core 0 (3 ms). As
    pinned work, rank 3 makes four on core 0 until the balance at B = BALANCE_S pulls it
    (each has 1 - B/4 left): it ends at B + (1 - B/4), the three, at 1/3 each, at B + 3 (1 - B/4)."""
    rows = [[work(1 * MS)] for _ in range(3)] + [[work(1 * MS, "m")]]
    assert ends(rows, placed(0, 0, 0, 0, mobile={"m"})) == pytest.approx(
        [3 * MS, 3 * MS, 3 * MS, 1 * MS])
    B = BALANCE_S / MS
    left = 1 - B / 4
    assert ends(rows, placed(0, 0, 0, 0)) == pytest.approx(
        [(B + 3 * left) * MS] * 3 + [(B + left) * MS])


@pytest.mark.parametrize("placement", [(0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 1, 0)])
def test_communication_alone_equals_the_pool(placement):
    """Collective shares are mobile: with nothing pinned, any placement replays as the
    pool does, on a measured throughput too."""
    from vcluster.localhost.cost_model import LocalhostCostModel
    model = LocalhostCostModel(spec(), 4, "float32")
    ar = TraceCollective("all_reduce", (0, 1, 2, 3), 1 << 20, 4, "shm")
    ag = TraceCollective("all_gather", (0, 1, 2, 3), 1 << 18, 4, "ring")
    rows = [[ar, ag, ar]] * 4
    pool = CorePoolSpec(2, ((2, 1.9), (4, 1.8)))
    assert ends(rows, dataclasses.replace(pool, placements=((placement, 1.0),)), model) \
        == pytest.approx(ends(rows, pool, model), rel=1e-12)


def test_a_rank_resuming_after_a_wait_takes_an_idle_core():
    """Ranks 0 and 1 on core 0, rank 2 on core 1. Rank 2 computes 1 ms and sends to rank 0,
    which then computes 2 ms; rank 1 computes 4 ms. When rank 0 wakes at 1 ms its core is
    busy and core 1 idle: it moves there and ends at 3 ms; rank 1 runs alone to 4 ms."""
    rows = [[TraceRecv(2, 8, 0), work(2 * MS)], [work(4 * MS)], [work(1 * MS), TraceSend(0, 8, 0)]]
    got = ends(rows, placed(0, 0, 1))
    assert got == pytest.approx([3 * MS, 4 * MS, 1 * MS])


# --- placements and the weighted median -----------------------------------------------------------
def test_placements_follow_the_counted_splits():
    rows = ((8, (4, 4), 6), (8, (5, 3), 3), (8, (6, 2), 1), (4, (2, 2), 5))
    got = start_placements(rows, 8, 2, per_split=4)
    assert len(got) == 12 and got == start_placements(rows, 8, 2, per_split=4)  # seeded
    for (placement, weight), counts in zip(got, [(4, 4)] * 4 + [(5, 3)] * 4 + [(6, 2)] * 4):
        assert len(placement) == 8
        assert sorted((placement.count(0), placement.count(1)), reverse=True) == list(counts)
    assert [w for _, w in got] == pytest.approx([1.5] * 4 + [0.75] * 4 + [0.25] * 4)
    assert start_placements(rows, 6, 2) == ()            # no row for this size
    assert start_placements(rows, 8, 1) == ()            # one core: one pool
    assert start_placements(None, 8, 2) == ()


def test_the_result_is_the_replay_at_the_weighted_median():
    """Four ranks of 1 ms: a 2:2 placement ends at 2 ms, 1:3 at 3 ms and 0:4, until the
    balance pulls a rank (test above), at B + 3 (1 - B/4) ms; the weighted median moves
    with the weights."""
    rows = [[work(1 * MS)] for _ in range(4)]
    even, three, four = (0, 1, 0, 1), (0, 1, 1, 1), (0, 0, 0, 0)
    B = BALANCE_S / MS
    alone = B + 3 * (1 - B / 4)
    for weights, expected in (((3, 1, 1), 2), ((1, 3, 1), 3), ((1, 1, 3), alone),
                              ((1, 1, 1), 3)):
        pool = CorePoolSpec(2, placements=tuple(zip((even, three, four), weights)))
        res = simulate_trace([DeviceTrace(r, tuple(o)) for r, o in enumerate(rows)], UNIT,
                             core_pool=pool, timeline=False)
        assert res.step_time_s == pytest.approx(expected * MS)
        assert res.pool_work_s == pytest.approx(4 * MS)


def test_placement_validation():
    with pytest.raises(ValueError, match="placement"):
        CorePoolSpec(2, placements=(((0, 2), 1.0),))             # core 2 of 2
    with pytest.raises(ValueError, match="placement"):
        CorePoolSpec(2, placements=(((0, 1), 1.0), ((0, 1, 1), 1.0)))
    with pytest.raises(ValueError, match="placement"):
        CorePoolSpec(2, placements=(((0, 1), 0.0),))
    with pytest.raises(TypeError, match="placements"):
        CorePoolSpec(2, placements=((0, 1),))
    with pytest.raises(TypeError, match="mobile_ops"):
        CorePoolSpec(2, mobile_ops="run start")
    rows = [[work(1 * MS)] for _ in range(3)]
    with pytest.raises(ValueError, match="ranks 0..1"):
        simulate_trace([DeviceTrace(r, tuple(o)) for r, o in enumerate(rows)], UNIT,
                       core_pool=placed(0, 1))


# --- the spec and a real calibration ----------------------------------------------------------------
def test_spec_start_split_rows_and_the_models_placements(tmp_path):
    from vcluster.localhost.cost_model import LocalhostCostModel, load_localhost_spec, \
        save_localhost_spec
    from vcluster.localhost.start import MOBILE_OPS
    s = spec(start_split=((8, (5, 3), 4), (8, (4, 4), 6)))
    assert s.start_split == ((8, (4, 4), 6), (8, (5, 3), 4))
    for suffix in (".json", ".yaml"):
        save_localhost_spec(s, tmp_path / f"s{suffix}")
        assert load_localhost_spec(tmp_path / f"s{suffix}") == s
    assert LocalhostCostModel(s, 8, "float32").core_pool.placements == ()   # one pool
    pool = LocalhostCostModel(s, 8, "float32", core_queues=True).core_pool
    assert len(pool.placements) == 8 and pool.mobile_ops == MOBILE_OPS
    assert LocalhostCostModel(s, 4, "float32", core_queues=True).core_pool.placements == ()
    assert LocalhostCostModel(spec(), 8, "float32", core_queues=True).core_pool.placements \
        == ()                                                            # an older spec
    for bad in (((8, (5, 2), 4),), ((8, (3, 5), 4),), ((8, (4, 4), 0),), ((8, (8,), 2),),
                ((8, (4, 4), 1), (8, (4, 4), 2)), ((8, 4, 1),)):
        with pytest.raises(ValueError, match="start_split"):
            spec(start_split=bad)


def test_core_split_counts_devices_per_core():
    from vcluster.localhost.start import core_split
    assert core_split([3, 1, 1, 3, 1], 2) == (3, 2)
    assert core_split([0, 0], 2) == (2, 0)
    assert core_split([0, 1, 2], 2) is None              # more cores than the spec's
    assert core_split([0, None], 2) is None


def test_first_call_factor_on_per_core_queues():
    """Four ranks, 1:3 over 2 ideal cores, each waiting (f - 1) c on its own core before a
    call of c: the three share their core, so the call starts at 3 (f - 1) c and ends 2 c
    later; one pool ends at 2 (f - 1) c + 2 c. A measured 0.4 ms with c = 0.1 ms gives f = 2
    on one pool and 1 + 2/3 on the queues; the replay at the solved f ends at the wall."""
    from vcluster.localhost.start import RUN_START, first_call_factor
    c, w1 = 0.1 * MS, 0.4 * MS
    assert first_call_factor(0.0, w1, 4, c, CorePoolSpec(2)) == pytest.approx(2.0)
    queues = placed(0, 1, 1, 1, mobile={RUN_START})
    assert first_call_factor(0.0, w1, 4, c, queues) == pytest.approx(1 + 2 / 3, rel=1e-9)
    # the empty start is spread over the cores (mobile): W0 adds its wall, nothing more
    assert first_call_factor(0.05 * MS, w1 + 0.05 * MS, 4, c, queues) == pytest.approx(
        1 + 2 / 3, rel=1e-9)
    assert first_call_factor(0.0, 0.1 * MS, 4, c, queues) == 1.0   # faster than the call


def test_a_queue_model_solves_its_first_call_factor_from_the_same_walls():
    """The spec's f is one pool's; on per-core queues the model turns it back into the
    measured one-call wall W1 = W0 + (D c / T) f and solves again: its own f is no larger,
    and its replay of the one-call program ends at W1."""
    from vcluster.localhost.cost_model import LocalhostCostModel
    from vcluster.localhost.calls import CallCpu
    from vcluster.localhost.start import first_call_factor
    s = spec(call_cpu_s=_rows(), start_s=((4, 200e-6, 1.5), (8, 600e-6, 2.0)),
             start_split=((8, (4, 4), 5), (8, (5, 3), 4), (8, (6, 2), 1)))
    one = LocalhostCostModel(s, 8, "float32")
    queues = LocalhostCostModel(s, 8, "float32", core_queues=True)
    assert one._start_figures() == (600e-6, 2.0)
    w0, f = queues._start_figures()
    assert w0 == 600e-6 and 1.0 < f < 2.0
    c = CallCpu(s.call_cpu_s).seconds("all_reduce", 8, 8)
    w1 = w0 + 8 * c / queues.core_pool.throughput_at(8) * 2.0
    assert first_call_factor(w0, w1, 8, c, queues.core_pool) == pytest.approx(f)
