"""``vcluster bench emulation``: both sides measured in one command, the emulated losses
equal to the reference's, the ratio and the JSON as documented; bad cases named."""

import json
import subprocess
import sys

import pytest

from vcluster.cli.bench_emulation import measure_mlp

pytestmark = pytest.mark.timeout(300)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "vcluster", "bench", "emulation", *args],
                          capture_output=True, text=True, timeout=280, cwd=cwd)


def test_measure_mlp_times_both_sides_and_checks_the_losses():
    # the per-step time is the difference of a 1-step and a (1 + steps)-step run: with
    # steps=2 and one rep, a width-32 reference step (~0.1 ms) drowned in the noise of a
    # loaded machine once (0.0); six steps and the median of three reps do not
    case = measure_mlp(32, 64, steps=6, reps=3)
    assert case.reference_step_s > 0 and case.emulated_step_s > 0
    assert case.ratio == pytest.approx(case.emulated_step_s / case.reference_step_s)
    assert case.max_rel_error < 1e-12
    assert case.microbatched_step_s > 0
    assert case.overhead_ratio == pytest.approx(case.emulated_step_s / case.microbatched_step_s)
    assert case.cpu_ratio is None or case.cpu_ratio > 0
    assert case.mesh == "dp 2 x pp 4" and case.name == "MLP width 32, batch 64"


def test_bench_emulation_command_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "emu.json"
    proc = _cli("--mlp", "16x32", "--steps", "1", "--reps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "MLP width 16, batch 32" in proc.stdout and "GPT hidden 64" in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["mesh"] for r in rows] == ["dp 2 x pp 4", "tp 2 x pp 2 x dp 2"]
    assert all(r["max_rel_error"] < 1e-9 for r in rows)


@pytest.mark.parametrize("value, message", [
    ("128", "expected WIDTHxBATCH"),
    ("128x12", "batch a positive multiple of 8"),
])
def test_bench_emulation_rejects_bad_cases(value, message):
    proc = _cli("--mlp", value)
    assert proc.returncode == 2 and message in proc.stderr


def test_bench_emulation_says_whether_the_devices_are_pinned():
    proc = _cli("--mlp", "16x32", "--no-gpt", "--steps", "1", "--reps", "1",
                "--pin-devices", "off")
    assert proc.returncode == 0, proc.stderr
    assert "devices pinned: off" in proc.stdout and "MLP width 16, batch 32" in proc.stdout
    assert _cli("--pin-devices", "maybe").returncode == 2
