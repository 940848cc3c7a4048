"""A what-if over TP/PP splits (issue 31, items 7 and 8): a scenario comparing three
splits of one GPT at 64 GPUs runs in at most 2x the time of the three ``vcluster simulate
gpt`` calls (it was 4.2x: full-pipeline tracing and a 16 MB trace.json), predicts the same step
times, reports MFU, memory and fits per split, and its plot labels each split."""

import os
import subprocess
import sys
import time

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from reports.plots import sweep_figure
from vcluster.planner.simulation import simulate_gpt
from vcluster.scenario import load_scenario, run_scenario

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPLITS = os.path.join(ROOT, "scenarios", "gpt_splits.yaml")
pytestmark = pytest.mark.timeout(600)


def _simulate_gpt_three():
    cfg = GPTConfig(hidden=4096, layers=32, heads=32, seq=2048, vocab=32000, dtype="float16")
    out = []
    for dp, pp, tp in ((8, 1, 8), (4, 2, 8), (2, 4, 8)):
        par = ParallelConfig(global_batch=64, micro_batch=1, dp=dp, pp=pp, tp=tp)
        out.append(simulate_gpt(cfg, par, "h100-dgx"))
    return out


def _cli(*args):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vcluster", *map(str, args)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    return time.perf_counter() - t0


@pytest.mark.alone   # wall-clock speed against simulate gpt
def test_splits_scenario_runs_at_the_speed_of_simulate_gpt(tmp_path):
    """As a user runs them: ``vcluster run gpt_splits.yaml`` (report written) against the
    three ``vcluster simulate gpt`` commands, best of up to two rounds each on this shared
    machine, the second only when the first misses (measured: 6.8 s against 4.4 s; 18.5 s
    before)."""
    common = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--seq", "2048",
              "--vocab", "32000", "--global-batch", "64", "--hardware", "h100-dgx"]
    scenario_s, three_s = [], []
    for k in range(2):
        scenario_s.append(_cli("run", SPLITS, "--out", tmp_path / f"r{k}", "--quiet"))
        three_s.append(sum(_cli("simulate", "gpt", *common, "--dp", dp, "--pp", pp,
                                "--tp", "8") for dp, pp in (("8", "1"), ("4", "2"), ("2", "4"))))
        if min(scenario_s) <= 2.0 * min(three_s):
            break
    assert min(scenario_s) <= 2.0 * min(three_s), (scenario_s, three_s)
    assert not (tmp_path / "r0" / "trace.json").exists()


def test_splits_scenario_predicts_what_simulate_gpt_does():
    record = run_scenario(load_scenario(SPLITS), progress=False)
    direct = _simulate_gpt_three()
    sweep = record.sweep
    assert list(sweep["predicted_step_time_s"]) == pytest.approx(
        [r.step_time_s for r in direct], rel=2e-2)
    assert sweep["fits"].all() and (sweep["mfu"] > 0).all()
    assert list(sweep["predicted_peak_memory_gb"]) == pytest.approx(
        [r.peak_memory_gb for r in direct], rel=1e-9)


def test_splits_plot_labels_each_split():
    record = run_scenario(load_scenario(SPLITS), progress=False)
    fig = sweep_figure(record)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["dp=8 pp=1 tp=8", "dp=4 pp=2 tp=8", "dp=2 pp=4 tp=8"]
    assert fig.axes[0].get_xlabel() == "parallel"
