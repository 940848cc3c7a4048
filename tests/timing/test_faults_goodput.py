"""Simulated faults: goodput's closed form against a SimPy Monte Carlo, the optimum
checkpoint interval against Daly's formula, stragglers against the pipeline closed form,
and degraded links against the alpha-beta formula."""

import math

import numpy as np
import pytest

from pipelining import make_schedule
from vcluster.timing.faults.goodput import (FailureModel, daly_interval_s, expected_goodput,
                                     expected_segment_s, segment_cv, simulate_goodput,
                                     young_interval_s)
from vcluster.timing.faults.impact import (MAX_FAILURES_PER_POINT, goodput_table,
                                    simulate_with_faults, straggler_table)
from vcluster.timing.faults.links import DegradedLinks
from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import traces_from_schedule


@pytest.mark.parametrize("t,k,c,r,mtbf", [
    (1.0, 100, 20.0, 60.0, 3600.0),        # T << M: a few failures per hundred segments
    (1.0, 50, 5.0, 10.0, 60.0),            # T ~ M: most segments fail at least once
    (0.5, 10, 0.0, 0.0, 1e9),              # no failures in practice
])
def test_closed_form_matches_simpy_monte_carlo(t, k, c, r, mtbf):
    m = FailureModel(t, k, c, r, mtbf)
    run = simulate_goodput(m, segments=3000, seed=1)
    expected = expected_segment_s(m)
    assert abs(run.mean_segment_s - expected) <= 4 * run.stderr_segment_s + 1e-6 * expected, \
        (run.mean_segment_s, expected, run.stderr_segment_s)
    assert run.goodput == pytest.approx(expected_goodput(m), rel=0.03)
    # the accounting adds up: wall = useful + checkpoints + lost work + restarts
    assert run.wall_s == pytest.approx(run.useful_s + run.checkpoint_s + run.lost_s
                                       + run.restart_s, rel=1e-9)
    # E[failures per segment] = e^{T/M} - 1
    assert run.failures / run.segments == pytest.approx(math.expm1(m.segment_s / mtbf),
                                                        rel=0.15, abs=0.01)


def test_limits_of_the_closed_form():
    m = FailureModel(2.0, 10, 4.0, 100.0, 1e12)
    assert expected_goodput(m) == pytest.approx(20 / 24, rel=1e-6)   # only checkpoint cost
    # small T/M: E ~ T + (T^2/2 + R T)/M
    m = FailureModel(1.0, 10, 2.0, 30.0, 1e5)
    T = m.segment_s
    assert expected_segment_s(m) == pytest.approx(T + (T * T / 2 + 30 * T) / 1e5, rel=1e-6)


@pytest.mark.parametrize("c,mtbf", [(10.0, 3600.0), (60.0, 6 * 3600.0), (1.0, 600.0)])
def test_best_interval_is_dalys(c, mtbf):
    intervals = np.linspace(0.2, 5, 20000) * math.sqrt(2 * c * mtbf)
    goodput = [expected_goodput(FailureModel(tau, 1, c, 0.0, mtbf)) for tau in intervals]
    best = intervals[int(np.argmax(goodput))]
    assert best == pytest.approx(daly_interval_s(c, mtbf), rel=0.02)
    assert best == pytest.approx(young_interval_s(c, mtbf), rel=0.1)


def test_goodput_table_is_plot_ready():
    table = goodput_table(1.0, 20.0, 60.0, mtbf_s=[1800.0, 7200.0],
                          checkpoint_every=[50, 200, 800], segments=400)
    assert list(table.columns) == ["mtbf_s", "checkpoint_every", "interval_s",
                                   "goodput_expected", "goodput_simulated", "goodput_stderr",
                                   "failures_simulated", "young_interval_s", "daly_interval_s"]
    assert len(table) == 6
    np.testing.assert_allclose(table.goodput_simulated, table.goodput_expected, rtol=0.05)
    assert (table.groupby("mtbf_s").goodput_expected.max().diff().dropna() > 0).all()


@pytest.mark.parametrize("t,k,c,r,mtbf", [
    (1.0, 100, 20.0, 60.0, 3600.0),        # rare failures, restarts dominate the spread
    (0.02, 512, 0.002, 0.05, 5.0),         # ~7 failures per segment
    (0.005, 2, 0.002, 1.0, 5.0),           # a restart costs 80 segments
    (0.5, 10, 0.0, 0.0, 1e9),              # no failures: no spread
])
def test_segment_cv_matches_the_monte_carlo_spread(t, k, c, r, mtbf):
    """The closed-form spread of a segment (random sum of geometric many truncated
    exponentials) against the sample spread of 4,000 simulated segments."""
    m = FailureModel(t, k, c, r, mtbf)
    run = simulate_goodput(m, segments=4000, seed=7)
    sample_cv = run.stderr_segment_s * math.sqrt(run.segments) / run.mean_segment_s
    cv = segment_cv(m)
    if cv < 1e-3:                          # ~no failure expected in 4,000 segments
        assert sample_cv < 1e-3
    else:
        assert sample_cv == pytest.approx(cv, rel=0.25)


def test_goodput_table_sizes_each_point_for_its_precision():
    """Default sizing: every simulated point lands within 5 of its predicted standard
    errors, which is about 1.5 % of the goodput where the caps do not bind; the table
    of the faults scenario (t ~ 20 ms, C ~ 2 ms, R ~ 0.3 s, MTBF 5/30/120 s) once missed a
    fixed 10 % tolerance with 50-segment runs."""
    table = goodput_table(0.02, 0.002, 0.3, mtbf_s=[5.0, 30.0, 120.0],
                          checkpoint_every=[2 ** i for i in range(11)], seed=1)
    done = table.dropna()
    assert len(done) >= 25
    err = (done.goodput_simulated - done.goodput_expected).abs()
    assert (err <= 5 * done.goodput_stderr).all(), done
    assert (done.goodput_stderr <= 0.03 * done.goodput_expected + 0.005).all(), done
    assert (done.failures_simulated <= 1.2 * MAX_FAILURES_PER_POINT).all()


@pytest.mark.parametrize("p,m,slow_stage,s", [(4, 8, 2, 2.0), (3, 5, 0, 3.0), (4, 4, 3, 1.5)])
def test_straggler_step_time_matches_gpipe_closed_form(p, m, slow_stage, s):
    """GPipe with a stage ``s`` times slower: the slow stage processes every micro-batch
    back to back in each phase, the others add one action each:
    T = (p - 1)(F + B) + m s (F + B)."""
    f, b = 1.0, 2.0
    traces = traces_from_schedule(make_schedule("gpipe", p, m), f, b, 0.0)
    costs = SimpleCostModel.compute_only(1.0)
    table = straggler_table(traces, costs, rank=slow_stage, slowdowns=[1, s])
    assert table.step_time_s[0] == pytest.approx((m + p - 1) * (f + b))
    assert table.step_time_s[1] == pytest.approx((p - 1) * (f + b) + m * s * (f + b))
    assert table.step_time_ratio[1] > 1


def test_degraded_link_scales_only_the_bandwidth_term():
    alpha, bw, n, f = 1e-5, 1e9, 8 << 20, 0.25
    base = SimpleCostModel(1e12, math.inf, alpha, bw)
    model = DegradedLinks.from_faults(base, [{"kind": "link", "ranks": [2, 1],
                                              "bandwidth_factor": f}])
    assert model.p2p_time_s(1, 2, n) == pytest.approx(alpha + n / (f * bw))
    assert model.p2p_time_s(2, 1, n) == pytest.approx(alpha + n / (f * bw))
    assert model.p2p_time_s(0, 1, n) == pytest.approx(alpha + n / bw)
    ring = TraceCollective("all_reduce", (0, 1, 2, 3), n, 4, "ring")
    assert model.collective_time_s(ring) == pytest.approx(6 * alpha + 1.5 * n / (f * bw))
    other = TraceCollective("all_reduce", (0, 1, 3), n, 4, "ring")
    assert model.collective_time_s(other) == base.collective_time_s(other)


def test_slow_link_between_stages_lengthens_the_step():
    p, m, nbytes = 4, 6, 64 << 20
    traces = traces_from_schedule(make_schedule("1f1b", p, m), 1e-3, 2e-3, 0.0, nbytes)
    costs = SimpleCostModel(1.0, math.inf, 1e-5, 1e10)
    clean = simulate_with_faults(traces, costs, []).step_time_s
    slow = simulate_with_faults(traces, costs, [{"kind": "link", "ranks": [1, 2],
                                                 "bandwidth_factor": 0.1}]).step_time_s
    off_path = simulate_with_faults(traces, costs, [{"kind": "link", "ranks": [0, 3],
                                                     "bandwidth_factor": 0.1}]).step_time_s
    transfer = nbytes / 1e10
    assert off_path == pytest.approx(clean)           # no traffic between ranks 0 and 3
    assert slow - clean >= 2 * 9 * transfer * 0.99    # each message on the link at least 10x


def test_goodput_plot_is_a_real_png():
    import io
    from matplotlib.image import imread
    from reports.goodput_plot import goodput_png
    table = goodput_table(1.0, 20.0, 60.0, mtbf_s=[1800.0, 7200.0],
                          checkpoint_every=[25, 100, 400], segments=200)
    png = goodput_png(table)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(io.BytesIO(png))
    assert pixels.shape[0] > 200 and pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05                 # lines and text, not a blank canvas
    assert goodput_png(table.iloc[0:0]) is None


def test_hopeless_points_are_refused_not_run_for_hours():
    m = FailureModel(1.0, 1000, 0.0, 1.0, 10.0)          # e^100 failures per segment
    with pytest.raises(ValueError, match="expect .* failures, more than max_failures"):
        simulate_goodput(m, segments=10)
    table = goodput_table(1.0, 0.0, 1.0, mtbf_s=[10.0], checkpoint_every=[1, 1000])
    assert table.goodput_simulated.isna().tolist() == [False, True]
    assert table.goodput_expected[1] < 1e-30


def test_gpt_goodput_on_simulated_hardware():
    """A long GPT run: the step time from the hardware simulation, the checkpoint cost
    from the per-device state bytes, the job MTBF from the device MTBF and GPU count,
    plugged into the closed form (checked by hand here) and the Monte Carlo."""
    from pipeline_parallel import GPTConfig, ParallelConfig
    from vcluster.planner.goodput import gpt_goodput
    from vcluster.planner.simulation import simulate_gpt
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=1024, vocab=32000)
    par = ParallelConfig(global_batch=64, micro_batch=1, dp=4, pp=2, tp=4)
    table = gpt_goodput(cfg, par, "a100-80gb-dgx", device_mtbf_h=[1000, 10000],
                        checkpoint_every=[20, 200], write_bytes_per_s=1e9, restart_s=120.0)
    step = simulate_gpt(cfg, par, "a100-80gb-dgx", "bf16").step_time_s
    assert table.gpus[0] == 32 and table.step_time_s[0] == pytest.approx(step)
    # state per device ~ (params 2 B + Adam fp32 master, m, v 12 B) x params / (tp x pp)
    params = 12 * 8 * 1024 ** 2 + 32000 * 1024          # layers + embedding, approximately
    assert table.checkpoint_s[0] == pytest.approx(14 * params / 8 / 1e9, rel=0.35)
    for row in table.itertuples():
        mtbf = row.device_mtbf_h * 3600 / 32
        T = row.checkpoint_every * step + row.checkpoint_s
        assert row.mtbf_s == pytest.approx(mtbf)
        assert row.goodput_expected == pytest.approx(
            row.checkpoint_every * step / ((mtbf + 120.0) * math.expm1(T / mtbf)))
        assert row.goodput_simulated == pytest.approx(row.goodput_expected, abs=0.05)
