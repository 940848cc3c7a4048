"""Every example scenario runs through the real CLI (``python -m vcluster run``) and its
results.json holds the documented keys; a ``check: true`` scenario whose result is wrong
exits 1; ``--mode`` and ``--set`` override the file."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from vcluster.scenario import load_scenario, run_scenario, sweep_points
from vcluster.scenario.runner import SUMMARY_KEYS
from tests.localhost_specs import localhost_spec_file

ROOT = Path(__file__).resolve().parents[2]
# faults.yaml (a crash and a restart) runs through the CLI in tests/scenario/test_faults_scenario.py
# faults: tests/scenario/test_faults_scenario.py; quickstart: its own test below, which
# checks its report as these do (and its default --out, and a silent stderr)
EXAMPLES = sorted(p for p in (ROOT / "scenarios").glob("*.yaml")
                  if p.stem not in ("faults", "quickstart"))
FAST = {"matmul_layouts", "transformer_simulate", "serving"}
pytestmark = pytest.mark.timeout(600)


def _run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vcluster", "run", *map(str, args)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=500)
    return proc, time.perf_counter() - t0


def _expected_keys(scenario) -> set:
    mode, kind = scenario.run.mode, scenario.workload.kind
    keys = set(SUMMARY_KEYS["always"])
    if mode != "simulate":
        keys |= set(SUMMARY_KEYS["emulate"]) - {"final_loss", "final_params_sha256"}
        keys |= {"final_loss"} if kind in ("mlp", "transformer") else set()
    if mode != "emulate":
        keys |= set(SUMMARY_KEYS["simulate"])
    if mode == "both" and not scenario.document.get("faults"):
        keys |= set(SUMMARY_KEYS["both"])
    if kind == "inference":     # a served model: the serving simulation's keys, which
        if mode == "simulate":  # replace the trace replay's when it runs alone
            keys -= set(SUMMARY_KEYS["simulate"])
        if mode != "emulate" and scenario.hardware.name != "localhost":
            keys |= set(SUMMARY_KEYS["serving"])
        if mode != "simulate":
            keys |= set(SUMMARY_KEYS["emulated_serving"])
    return keys


def _check_report(out: Path, scenario) -> dict:
    results = json.loads((out / "results.json").read_text())
    assert results["name"] == scenario.name and results["mode"] == scenario.run.mode
    missing = _expected_keys(scenario) - set(results["summary"])
    assert not missing, missing
    assert results["passed"] is True
    if scenario.run.check and scenario.run.mode != "simulate":
        assert results["checks"] and all(c["passed"] for c in results["checks"])
        assert results["summary"]["checks_passed"] is True
    if scenario.run.mode == "both" and not scenario.document.get("faults"):
        assert results["summary"]["traffic_matches"] is True
        # "matches" follows from the figures shown: measured == traced bytes, every point
        for row in [results["summary"], *(results.get("sweep") or [])]:
            if row.get("traffic_matches") is not None and row.get("traced_bytes_sent") is not None:
                assert row["traced_bytes_sent"] == row["measured_bytes_sent"], row
    if scenario.run.mode != "simulate":       # every report says what measured means
        assert "_Measured: the program run by" in (out / "summary.md").read_text()
    if scenario.sweep:
        assert len(results["sweep"]) == len(sweep_points(scenario))
    if scenario.run.mode == "simulate" and scenario.report.formats is None:
        assert not (out / "trace.json").exists()       # written only when asked
    else:
        trace = json.loads((out / "trace.json").read_text())
        assert trace["traceEvents"]
    return results


@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.stem, marks=() if p.stem in FAST else pytest.mark.slow)
    for p in EXAMPLES])
def test_example_runs_through_the_cli(path, tmp_path):
    proc, seconds = _run(tmp_path, path, "--out", tmp_path / "report", "--quiet")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    _check_report(tmp_path / "report", load_scenario(path))
    print(f"{path.stem}: {seconds:.1f} s")


def test_quickstart_measured_beside_predicted(tmp_path):
    """The README's main job: both modes, every check passed, no progress bar without a
    terminal (stderr empty), report under runs/<name> by default."""
    proc, seconds = _run(tmp_path, ROOT / "scenarios" / "quickstart.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = tmp_path / "runs" / "quickstart"
    results = _check_report(out, load_scenario(ROOT / "scenarios" / "quickstart.yaml"))
    s = results["summary"]
    assert s["measured_step_time_s"] > 0 and s["predicted_step_time_s"] > 0
    # the emulator's bytes (its shm algorithm) and the A100 model's (NCCL's, on the
    # links) are counted apart; the trace moves exactly what the emulator measured
    assert s["hardware"] == "a100-80gb-dgx" and s["traffic_matches"] is True
    assert s["measured_bytes_sent"] > 0
    assert s["predicted_bytes_sent"] == s["predicted_bytes_received"] > 0
    assert s["localhost_calibration"] is None              # a preset: no calibration
    sources = {row["source"] for row in results["devices"]}
    assert sources == {"measured", "predicted"}
    print(f"quickstart: {seconds:.1f} s wall (goal < 30 s)")


def test_wrong_result_fails_the_check_with_exit_1(tmp_path):
    """float32 MatMul checked against the float64 product with tolerance 0: the sharded
    float32 result really differs (rounding), the check detects it, exit 1, report kept."""
    scenario = tmp_path / "wrong.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "wrong", "cluster": {"mesh": {"tp": 4}},
        "workload": {"kind": "matmul", "m": 32, "k": 64, "n": 16, "dtype": "float32"},
        "parallel": {"policy": "MatchedInnerSharding"},
        "run": {"mode": "emulate", "check": True, "tolerance": 0}}))
    proc, _ = _run(tmp_path, scenario, "--out", tmp_path / "report", "--quiet")
    assert proc.returncode == 1, proc.stderr
    assert "checks FAILED (C)" in proc.stderr
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert results["passed"] is False and results["summary"]["checks_passed"] is False
    (check,) = results["checks"]
    assert check["name"] == "C" and check["passed"] is False
    assert 0 < check["max_abs_error"] < 1e-4 * 64        # float32 rounding, no more
    # the same file with the default float32 tolerance passes: the check is not rigged
    proc, _ = _run(tmp_path, scenario, "--out", tmp_path / "ok", "--quiet",
                   "--set", "run.tolerance=1e-4")
    assert proc.returncode == 0, proc.stderr


def test_mode_and_set_override_the_file(tmp_path):
    proc, _ = _run(tmp_path, ROOT / "scenarios" / "ffn_megatron.yaml", "--mode", "emulate",
                   "--set", "workload.backward=false", "--set", "run.steps=2",
                   "--set", "report.formats=[md, csv]", "--out", tmp_path / "r", "--quiet")
    assert proc.returncode == 0, proc.stderr
    written = {p.name for p in (tmp_path / "r").iterdir()}
    assert {"results.json", "summary.md", "devices.csv"} <= written
    assert not written & {"report.html", "trace.json", "timeline.png"}
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["mode"] == "emulate" and results["summary"]["steps"] == 2
    assert "predicted_step_time_s" not in results["summary"]
    assert [c["name"] for c in results["checks"]] == ["y"]          # no backward outputs
    assert len([r for r in results["steps"] if r["source"] == "measured"]) == 2


def test_run_scenario_record_and_independent_reference():
    """In process: the record's checks compare the emulated outputs with a reference this
    test recomputes itself (an all_reduce over tp is the sum of the group's inputs)."""
    s = load_scenario(ROOT / "scenarios" / "collective_all_reduce.yaml",
                      ["run.mode=emulate", "workload.size=4KiB", "run.steps=1"])
    from vcluster.scenario import build_workload
    from vcluster import VirtualCluster
    w = build_workload(s)
    with VirtualCluster(w.mesh) as cluster:
        outputs = cluster.run(w.program, list(w.args_by_rank))
    for r in range(w.mesh.size):
        group = w.mesh.group("tp", r)
        want = np.sum([w.args_by_rank[g][1].astype(np.float64) for g in group], axis=0)
        np.testing.assert_allclose(outputs[r]["out"], want, rtol=1e-5, atol=1e-5)
    assert all(c["passed"] for c in w.check(outputs, 1e-5))
    record = run_scenario(s)
    assert record.passed and len(record.checks) == 8
    assert set(record.devices["rank"]) == set(range(8))
    assert record.summary["measured_bytes_sent"] + record.summary[
        "measured_bytes_received"] > 0


def test_localhost_hardware_from_a_saved_calibration(tmp_path):
    spec = localhost_spec_file(tmp_path / "machine.json")
    s = load_scenario(ROOT / "scenarios" / "mlp_dp_pp_tp.yaml",
                      ["run.mode=both", "run.steps=1",
                       f"hardware={{name: localhost, calibration: {spec}}}"])
    record = run_scenario(s)
    summary = record.summary
    assert summary["hardware"] == "localhost" and summary["traffic_matches"] is True
    assert summary["predicted_over_measured"] == pytest.approx(
        summary["predicted_step_time_s"] / summary["measured_step_time_s"])
    assert summary["predicted_over_measured"] > 0
    assert summary["localhost_calibration"] == f"saved {spec}"


@pytest.mark.slow
def test_localhost_hardware_calibrated_on_the_spot_once_per_run(tmp_path):
    """Without a saved calibration, a run measures this machine once per cluster size:
    every sweep point shares it (it used to calibrate again for each, ~20 s apiece on 8
    devices; 2 devices here, ~4 s, the same code path)."""
    s = load_scenario(ROOT / "scenarios" / "collective_all_reduce.yaml",
                      ["hardware=localhost", "cluster.mesh={dp: 1, tp: 2}", "cluster.devices=2",
                       "sweep={workload.size: [64KiB, 256KiB]}"])
    record = run_scenario(s)
    sweep = record.sweep
    assert list(sweep["hardware"]) == ["localhost"] * 2
    assert (sweep["predicted_over_measured"] > 0).all()
    calibrations = set(sweep["localhost_calibration"])
    assert len(calibrations) == 1, calibrations
    assert calibrations.pop().startswith("measured ") and "on 2 devices" in \
        sweep["localhost_calibration"][0]


@pytest.mark.parametrize("command", ["run", "validate", "schema"])
def test_help(command):
    proc = subprocess.run([sys.executable, "-m", "vcluster", command, "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: vcluster " + command in proc.stdout


def test_progress_bar_on_a_terminal_and_quiet_silences_it(tmp_path):
    """On a (pseudo-)terminal the run shows a rich progress bar on stderr; --quiet hides
    it (without a terminal it never shows: see test_quickstart_...)."""
    import os
    import pty

    def run(*extra) -> str:
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "vcluster", "run",
             str(ROOT / "scenarios" / "collective_all_reduce.yaml"), "--mode", "simulate",
             "--set", "workload.size=4KiB", "--out", str(tmp_path / "r"), *extra],
            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=slave, env=dict(os.environ, TERM="xterm", COLUMNS="100"))
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:                   # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=120) == 0
        os.close(master)
        return b"".join(chunks).decode(errors="replace")

    assert "vcluster run collective_all_reduce" in run()
    assert run("--quiet") == ""


def test_hardware_from_a_file_and_inline(tmp_path):
    """User hardware: H100 with twice the NVLink bandwidth, from a YAML file (relative to
    the scenario) and inline; a bandwidth-bound all_reduce is predicted faster than on
    the preset (at least 1.5x: the per-step latency terms do not halve)."""
    from vcluster.timing import hardware_to_dict, preset
    spec = hardware_to_dict(preset("h100-dgx"))
    spec["name"] = "h100-fast-nvlink"
    spec["node"]["gpu_link"]["bandwidth_gbps"] *= 2
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(spec))
    base = yaml.safe_load((ROOT / "scenarios" / "collective_all_reduce.yaml").read_text())
    base["run"] = {"mode": "simulate"}
    base["workload"]["size"] = "64MiB"
    times = {}
    for label, hardware in (("preset", "h100-dgx"), ("file", {"file": "hw.yaml"}),
                            ("inline", {"spec": spec})):
        (tmp_path / f"{label}.yaml").write_text(yaml.safe_dump(dict(base, hardware=hardware)))
        record = run_scenario(load_scenario(tmp_path / f"{label}.yaml"))
        times[label] = record.summary["predicted_step_time_s"]
        assert record.summary["hardware"] == ("h100-dgx" if label == "preset"
                                              else "h100-fast-nvlink")
    assert times["file"] == times["inline"]
    assert times["preset"] / times["file"] > 1.5


@pytest.mark.parametrize("name", ["matmul_layouts", "mlp_dp_pp_tp"])
def test_simulate_alone_makes_no_data_and_predicts_the_same(name):
    """run.mode simulate builds shape-only arguments (from the layouts, the parameter
    shapes); the prediction equals the one traced from the real arrays in mode both."""
    from vcluster.scenario import build_workload
    path = ROOT / "scenarios" / f"{name}.yaml"
    alone = load_scenario(path, ["run.mode=simulate", "run.steps=1"])
    assert build_workload(alone).args_by_rank == ()
    a = run_scenario(alone).summary
    b = run_scenario(load_scenario(path, ["run.mode=both", "run.steps=1"])).summary
    assert a["predicted_step_time_s"] == b["predicted_step_time_s"] > 0
    assert a["predicted_bytes_sent"] == b["predicted_bytes_sent"] > 0
    assert b["traffic_matches"] is True and b["measured_bytes_sent"] > 0
