"""The timing model's benchmarks run and report what they claim: ``bench simulate-scale``
(a fresh process per case: its wall time, peak memory and the same step time as
``simulate_gpt`` here) and ``bench predict --scenarios`` (bundled scenarios predicted on
``localhost``). No timing assertions: this machine is shared and noisy."""

import dataclasses

import numpy as np
import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.simulation import simulate_gpt
from tests.localhost_specs import localhost_spec_file
from vcluster.cli.bench_predict_scenarios import (SCENARIO_DIR, emulated_scenarios,
                                                  run_scenarios_predict)
from vcluster.cli.bench_simulate import CASES, ScaleCase, run_case

pytestmark = pytest.mark.timeout(600)


def test_simulate_scale_case_runs_in_a_fresh_process():
    model = dict(hidden=256, layers=8, heads=4, seq=128, vocab=1024)
    case = ScaleCase("tiny", model, tp=2, pp=4, dp=2, microbatches=8,
                     schedule="interleaved_1f1b", virtual_stages=2, goal_s=30.0)
    fast, full = run_case(case), run_case(case, all_positions=True)
    here = simulate_gpt(GPTConfig(**model), ParallelConfig(
        global_batch=16, dp=2, pp=4, tp=2, schedule="interleaved_1f1b", virtual_stages=2,
        recompute="full"), "a100-80gb-dgx")
    assert fast["step_time_s"] == full["step_time_s"] == here.step_time_s
    assert fast["mfu"] == pytest.approx(here.mfu, rel=1e-12)
    for r in (fast, full):
        assert r["wall_s"] > 0 and 10e6 < r["peak_rss_bytes"] < 4e9
        assert r["gpus"] == 16 and r["goal_s"] == 30.0
    assert full["all_positions_traced"] and not fast["all_positions_traced"]


def test_simulate_scale_case_reports_its_own_peak_not_the_parents():
    """A child started by vfork + exec keeps its parent's peak in ru_maxrss (Linux): the
    case's peak must be its own (VmHWM), however large this process has grown."""
    ballast = np.ones(96 << 20)                  # 768 MiB resident in this process
    model = dict(hidden=256, layers=8, heads=4, seq=128, vocab=1024)
    r = run_case(ScaleCase("tiny", model, tp=2, pp=4, dp=2, microbatches=8, schedule="1f1b",
                           virtual_stages=None, goal_s=30.0))
    assert float(ballast.sum()) == ballast.size
    assert 10e6 < r["peak_rss_bytes"] < 400e6, r


def test_simulate_scale_cases_are_the_acceptance_configurations():
    gpt3 = CASES["gpt3-1024-1f1b"]
    assert (gpt3.gpus, gpt3.microbatches * gpt3.dp, gpt3.goal_s) == (1024, 1536, 10.0)
    assert gpt3.model == dict(hidden=12288, layers=96, heads=96, seq=2048, vocab=51200)
    big = [c for c in CASES.values() if c.gpus == 6144]
    assert {c.schedule for c in big} == {"1f1b", "interleaved_1f1b", "zero_bubble", "gpipe"}
    assert all(c.microbatches == 512 and c.goal_s == 30.0 for c in big)
    assert all(dataclasses.is_dataclass(c) for c in CASES.values())


def test_predict_scenarios_on_localhost(tmp_path):
    """Bundled scenarios (one with faults and checkpoints: its plain program) measured
    and predicted like the built-in workloads: one row per sweep point."""
    from vcluster.localhost.cost_model import load_localhost_spec
    assert {p.stem for p in emulated_scenarios()} >= {"quickstart", "faults", "transformer"}
    spec = load_localhost_spec(localhost_spec_file(tmp_path / "machine.json"))
    record = run_scenarios_predict(spec, reps=1, paths=[SCENARIO_DIR / "faults.yaml",
                                                        SCENARIO_DIR / "ffn_policies.yaml"])
    rows = record["workloads"]
    assert [r["name"] for r in rows] == ["faults/0"] + [f"ffn_policies/{i}" for i in range(4)]
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0
        assert r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])  # one round
    assert record["within_goal"] == sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    # one round: each interval is the ratio itself, beyond the goal exactly when it is
    assert all(r["ratio_interval"] == [r["ratio"]] * 2 for r in rows)
    assert record["outside_goal_surely"] == len(rows) - record["within_goal"]
    assert record["max_error"] == max(abs(r["ratio"] - 1) for r in rows)


def test_predict_a_users_scenario_file_from_the_command_line(tmp_path, capsys):
    """``--scenario FILE`` predicts that file's points (a user's, not a bundled one):
    one row per sweep point, named after the file, in the printout and the JSON."""
    import json
    from tests.cli_helpers import run_cli
    from vcluster.cli.bench_cmd import add_parser
    mine = tmp_path / "my_all_gather.yaml"
    mine.write_text("name: my_all_gather\ncluster:\n  mesh: {x: 4}\nworkload:\n"
                    "  kind: collective\n  op: all_gather\n  size: 64KiB\n  calls: 2\n"
                    "run:\n  mode: emulate\nsweep:\n  workload.size: [64KiB, 1MiB]\n")
    spec_file = localhost_spec_file(tmp_path / "machine.json")
    out = tmp_path / "record.json"
    assert run_cli(add_parser, ["bench", "predict", "--spec", str(spec_file), "--scenario",
                                str(mine), "--reps", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["name"] for r in record["workloads"]] == ["my_all_gather/0", "my_all_gather/1"]
    assert all(r["devices"] == 4 and r["measured_s"] > 0 for r in record["workloads"])
    printed = capsys.readouterr().out
    assert "my_all_gather/1" in printed and "of 2 points within 25%" in printed


def test_predict_refuses_a_scenario_that_only_simulates_before_calibrating(monkeypatch):
    """Nothing to measure: the error names the file and its run.mode, and comes before
    the calibration would spend its 20 s."""
    from tests.cli_helpers import run_cli
    from vcluster.cli.bench_cmd import add_parser

    def calibrate(*args):
        raise AssertionError("calibrated before checking the scenario")
    monkeypatch.setattr("vcluster.localhost.calibrate.calibrate_localhost", calibrate)
    path = SCENARIO_DIR / "transformer_simulate.yaml"
    with pytest.raises(ValueError, match=r"transformer_simulate\.yaml has run\.mode 'simulate'"):
        run_cli(add_parser, ["bench", "predict", "--scenario", str(path)])
