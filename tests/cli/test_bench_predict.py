"""``vcluster bench predict`` (vcluster/cli/bench_predict.py): rounds bracketed by
calibrations, steps back to back, the spread, the documented JSON, and the timed runs'
CPU on real devices."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest

from tests.localhost_specs import spec

from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.localhost.cost_model import LocalhostSpec, save_localhost_spec

pytestmark = pytest.mark.timeout(120)


def test_rounds_recalibrate_between_them():
    """Calibrations bracket the measurement rounds: the prediction is their median."""
    from vcluster.cli.bench_predict import build_bench_workload, run_workloads
    given = [spec(p2p_latency_s=60e-6), spec(p2p_latency_s=90e-6), spec(p2p_latency_s=120e-6)]
    later = iter(given[1:])
    record = run_workloads(given[0], [build_bench_workload("all_reduce-1MiB", tiny=True)], reps=1,
                           rounds=2, recalibrate=lambda: next(later))
    assert [LocalhostSpec.from_dict(d) for d in record["specs"]] == given
    (row,) = record["workloads"]
    assert len(row["predicted_by_spec_s"]) == 3 and len(row["measured_runs_s"]) == 2
    assert row["predicted_s"] == sorted(row["predicted_by_spec_s"])[1]
    # each round against the two calibrations around it; the ratio is the rounds' median
    p, m = row["predicted_by_spec_s"], row["measured_runs_s"]
    assert row["round_ratios"] == pytest.approx([(p[0] + p[1]) / 2 / m[0],
                                                 (p[1] + p[2]) / 2 / m[1]])
    assert row["ratio"] == pytest.approx(sum(row["round_ratios"]) / 2)
    assert row["unpaired_ratio"] == pytest.approx(row["predicted_s"] / row["measured_s"])
    with pytest.raises(ValueError, match="rounds"):
        run_workloads(given[0], [], rounds=0)


def test_steps_run_the_program_back_to_back_and_report_per_step():
    """``steps=K``: the measured and traced program is K of the workload's back to back
    (K times its calls), and every time in the record is per step."""
    from vcluster.cli.bench_predict import (build_bench_workload, predict_workload, run_workloads,
                                            stepped)
    from vcluster.runtime.tracing import trace_program
    wl = build_bench_workload("all_gather-1MiB", tiny=True)
    assert stepped(wl, 1) is wl
    calls = [[op for op in t.ops if isinstance(op, TraceCollective)]
             for t in (trace_program(w.mesh, w.program, w.meta_args)[0]
                       for w in (wl, stepped(wl, 3)))]
    assert len(calls[1]) == 3 * len(calls[0]) > 0
    record = run_workloads(spec(), [wl], reps=2, steps=3)
    (row,) = record["workloads"]
    assert record["steps"] == 3 and row["name"] == wl.name
    assert row["measured_s"] == pytest.approx(sum(row["measured_runs_s"]) / 2)
    assert row["predicted_s"] == pytest.approx(row["predicted_by_spec_s"][0])
    assert row["predicted_s"] == pytest.approx(predict_workload(stepped(wl, 3), spec()) / 3)
    assert row["ratio"] == pytest.approx(row["predicted_s"] / row["measured_s"])
    with pytest.raises(ValueError, match="steps"):
        run_workloads(spec(), [wl], steps=0)


def test_paired_ratios_compare_each_round_with_the_calibrations_around_it():
    from vcluster.cli.bench_predict import paired_ratios
    # calibrations before round 0, between the rounds and after round 1
    assert paired_ratios([10.0, 14.0, 30.0], [[8.0, 12.0, 100.0], [40.0, 44.0]]) \
        == pytest.approx([12.0 / 12.0, 22.0 / 42.0])
    # one spec for every round
    assert paired_ratios([6.0], [[4.0], [3.0, 9.0, 5.0]]) == pytest.approx([1.5, 1.2])
    for predicted, by_round in (([1.0, 2.0], [[1.0], [1.0]]), ([1.0], []),
                                ([1.0, 2.0, 3.0], [[1.0], []])):
        with pytest.raises(ValueError, match="paired_ratios: .* rounds"):
            paired_ratios(predicted, by_round)


def test_median_interval_takes_the_order_statistics_that_cover_the_median():
    from vcluster.cli.bench_predict import median_interval
    # 8 rounds: P(B < 2) = (1 + 8) / 256, so x(2)..x(7) covers 1 - 18/256 >= 0.9, while
    # x(3)..x(6) would cover only 1 - 2 (1 + 8 + 28) / 256 = 0.71
    values = [1.3, 0.7, 1.1, 0.9, 1.0, 0.8, 1.2, 0.6]
    assert median_interval(values) == pytest.approx((0.7, 1.2, 1 - 18 / 256))
    assert median_interval(values, level=0.99) == pytest.approx((0.6, 1.3, 1 - 2 / 256))
    assert median_interval(values, level=0.7) == pytest.approx((0.8, 1.1, 1 - 74 / 256))
    # three rounds: only the extremes, covering 1 - 2/8; one round: a point, coverage 0
    assert median_interval([2.0, 0.5, 1.0]) == pytest.approx((0.5, 2.0, 0.75))
    assert median_interval([1.5]) == (1.5, 1.5, 0.0)
    with pytest.raises(ValueError, match="no values"):
        median_interval([])
    with pytest.raises(ValueError, match="level must be in"):
        median_interval([1.0], level=1.0)


def test_round_drift_takes_out_what_moved_a_whole_round():
    """A drift that scales every point of a round alike shows in the rounds' medians and
    leaves the relative ratios alone."""
    from vcluster.cli.bench_predict_stats import round_drift
    model = [0.8, 1.0, 1.1, 1.3]                     # each point's error, fixed
    drift = [0.7, 1.0, 1.4, 0.9, 1.2]                # each round's machine, common to all
    ratios = [[e * d for d in drift] for e in model]
    medians, relative = round_drift(ratios)
    assert medians == pytest.approx([1.05 * d for d in drift])  # median of model: 1.05
    assert relative == pytest.approx([e / 1.05 for e in model])
    # noise of one point in one round moves only its own relative ratio's median
    ratios[0][2] *= 2.0
    assert round_drift(ratios)[1][1:] == pytest.approx([e / 1.05 for e in model[1:]])
    for bad in ([], [[1.0, 2.0], [1.0]], [[1.0, 0.0]], [[float("nan")]]):
        with pytest.raises(ValueError, match="round_drift"):
            round_drift(bad)


def test_summary_prints_the_drift_and_the_point_furthest_from_the_others(capsys):
    from vcluster.cli.bench_predict import print_drift
    rows = [{"name": n, "relative_ratio": r} for n, r in (("a", 0.9), ("b", 1.0), ("c", 1.3))]
    print_drift({"workloads": rows, "round_median_ratios": [0.77, 1.08]})
    out = capsys.readouterr().out
    assert "rounds' median ratio 0.77-1.08" in out
    assert "2 of 3 points within 25%, furthest c 1.30" in out
    for medians, few in (([1.0], rows), ([0.9, 1.1], rows[:2])):   # one round, two points
        print_drift({"workloads": few, "round_median_ratios": medians})
        assert capsys.readouterr().out == ""


def test_spread_is_half_the_interquartile_range_over_the_median():
    from vcluster.cli.bench_predict import spread
    row = {"measured_s": 10.0, "measured_iqr_s": [8.0, 13.0]}
    assert spread(row) == pytest.approx(0.25)
    assert spread({"measured_s": 2.0, "measured_iqr_s": [2.0, 2.0]}) == 0.0


def test_bench_predict_writes_the_documented_json(tmp_path):
    from vcluster.cli import bench_predict
    save_localhost_spec(spec(), tmp_path / "spec.json")
    parser = argparse.ArgumentParser(prog="vcluster")
    bench = parser.add_subparsers(dest="command").add_parser("bench")
    bench_predict.add_parser(bench.add_subparsers(dest="bench"))
    out = tmp_path / "predict.json"
    args = parser.parse_args(["bench", "predict", "--spec", str(tmp_path / "spec.json"),
                              "--workloads", "all_gather-1MiB,matmul", "--tiny", "--reps", "1",
                              "--rounds", "2", "--steps", "2", "--json", str(out)])
    assert args.run(args) == 0
    record = json.loads(out.read_text())
    assert set(record) == {"spec", "specs", "steps", "core_queues", "tiny", "workloads",
                           "round_median_ratios", "max_error"}
    assert record["steps"] == 2 and record["core_queues"] is False and record["tiny"] is True
    assert LocalhostSpec.from_dict(record["spec"]) == spec()
    assert len(record["specs"]) == 1                     # a given spec is not recalibrated
    assert [w["name"] for w in record["workloads"]] == ["all_gather-1MiB", "matmul"]
    for w in record["workloads"]:
        assert set(w) == {"name", "devices", "dtype", "measured_s", "measured_runs_s",
                          "measured_iqr_s", "predicted_s", "predicted_by_spec_s", "ratio",
                          "round_ratios", "unpaired_ratio", "ratio_interval",
                          "ratio_interval_level", "relative_ratio", "measured_cpu_s",
                          "predicted_cpu_s", "cpu_ratio", "background_cores",
                          "measured_round_s", "measured_cpu_round_s"}
        assert w["devices"] == 8 and w["measured_s"] > 0 and w["predicted_s"] > 0
        assert len(w["measured_runs_s"]) == 2               # one run in each of two rounds
        assert w["measured_round_s"] == w["measured_runs_s"]   # each round's median: its run
        assert len(w["measured_cpu_round_s"]) == 2
        assert w["measured_cpu_s"] == pytest.approx(np.median(w["measured_cpu_round_s"]))
        assert w["measured_s"] == pytest.approx(sorted(w["measured_runs_s"])[0] / 2
                                                + sorted(w["measured_runs_s"])[1] / 2)
        lo, hi = sorted(w["measured_runs_s"])              # quartiles of two runs
        assert w["measured_iqr_s"] == pytest.approx([lo + (hi - lo) / 4, hi - (hi - lo) / 4])
        # one spec: each round's run against its prediction, the median of the two
        assert w["round_ratios"] == pytest.approx([w["predicted_s"] / r
                                                   for r in w["measured_runs_s"]])
        assert w["ratio"] == pytest.approx(sum(w["round_ratios"]) / 2)
        # two rounds: the interval is their extremes, covering the median half the time
        assert w["ratio_interval"] == pytest.approx(sorted(w["round_ratios"]))
        assert w["ratio_interval_level"] == pytest.approx(0.5)
        assert w["measured_cpu_s"] > 0 and w["predicted_cpu_s"] > 0
        assert 0 < w["cpu_ratio"] < 100
    assert record["max_error"] == max(abs(w["ratio"] - 1) for w in record["workloads"])
    # two points: each round's median is the mean of their two ratios
    a, b = (w["round_ratios"] for w in record["workloads"])
    assert record["round_median_ratios"] == pytest.approx([(x + y) / 2 for x, y in zip(a, b)])
    assert record["workloads"][0]["relative_ratio"] == pytest.approx(
        sum(x / ((x + y) / 2) for x, y in zip(a, b)) / 2)


def _spin(dev, seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _nap(dev, seconds: float) -> None:
    time.sleep(seconds)


def test_timed_runs_report_the_devices_cpu_in_the_program():
    """``timed_run_cpu``: a device spinning 30 ms of CPU reports at least that; one
    sleeping 30 ms reports almost none; and the span is the one ``timed_run`` gives."""
    from mesh import Mesh
    from vcluster import VirtualCluster
    from vcluster.localhost.start import timed_run_cpu
    with VirtualCluster(Mesh((2,), ("x",))) as cluster:
        spun = cluster.run(timed_run_cpu, [(_spin, 0.03)] * 2)
        napped = cluster.run(timed_run_cpu, [(_nap, 0.03)] * 2)
    assert all(cpu >= 0.03 and end - start >= 0.03 for start, end, cpu in spun)
    assert all(cpu < 0.01 and end - start >= 0.03 for start, end, cpu in napped)


def test_core_queues_replay_the_counted_splits():
    """``--core-queues``: the record says so, and the prediction is the weighted median of
    the placements' replays (a 6:2 split alone is slower than one pool for a MatMul whose
    work stays on the devices' cores)."""
    from vcluster.cli.bench_predict import predict_run, run_workloads
    from vcluster.cli.bench_predict_workloads import build_bench_workload
    wl = build_bench_workload("matmul", True)
    skewed = spec(start_split=((8, (6, 2), 3),))
    pool_s, work = predict_run(wl, skewed)
    queues_s, queue_work = predict_run(wl, skewed, core_queues=True)
    assert queue_work == pytest.approx(work, rel=0.05)       # the same work, other cores
    assert queues_s > pool_s
    record = run_workloads(skewed, [wl], reps=1, core_queues=True)
    assert record["core_queues"] is True and record["workloads"][0]["predicted_s"] > 0
