"""``parallel.policy: auto`` in scenarios: the layout that runs is the one
MatMulSharding.auto / FeedForwardSharding.auto rank first on the scenario's hardware, and
the run is still checked against numpy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mesh import Mesh
from tensor_parallel import FeedForwardSharding, MatMulSharding
from vcluster.planner import auto_ffn, auto_matmul
from vcluster.scenario import build_workload, load_scenario, run_scenario
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_matmul_auto_scenario_runs_the_layout_auto_ranks_first(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "run",
                           str(ROOT / "scenarios" / "matmul_auto.yaml"), "--out", str(out),
                           "--quiet"], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] and results["checks"]
    best, ranking = auto_matmul(Mesh((2, 4), ("x", "y")), (1024, 1024), (1024, 1024),
                                        hardware="h100-dgx")
    assert len(ranking) == 81
    assert results["summary"]["workload"].startswith(str(best))
    assert "auto: fastest of 81 layouts on h100-dgx" in results["summary"]["workload"]
    assert best.a.dims != best.b.dims or str(best) != "A[R, R] @ B[R, R] -> C[R, R]"


@pytest.mark.parametrize("hardware, mesh", [("a100-80gb-dgx", {"dp": 2, "tp": 2}),
                                            ("h200-dgx", {"a": 4})])
def test_ffn_auto_picks_the_top_ranked_policy_and_checks(tmp_path, hardware, mesh):
    doc = {"name": "ffn_auto", "cluster": {"mesh": mesh}, "hardware": hardware,
           "workload": {"kind": "ffn", "batch": 4, "seq": 32, "d_model": 64, "d_ff": 256,
                        "backward": True, "dtype": "float64"},
           "parallel": {"policy": "auto"}, "run": {"mode": "emulate", "check": True}}
    path = tmp_path / "ffn_auto.yaml"
    import yaml
    path.write_text(yaml.safe_dump(doc))
    scenario = load_scenario(path)
    workload = build_workload(scenario)
    m = Mesh(tuple(mesh.values()), tuple(mesh))
    fp32_peak = HardwareCostModel(load_hardware(hardware), "fp32")   # hardware.dtype default
    best, ranking = auto_ffn(m, (4, 32, 64), 256, hardware=hardware,
                                             backward=True, dtype="float64",
                                             cost_model=fp32_peak)
    assert workload.description.startswith(f"FeedForward {best.policy.name}")
    assert f"fastest of {len(ranking)} layouts on {hardware}" in workload.description
    record = run_scenario(scenario)
    assert record.checks and record.passed


def test_auto_with_explicit_layouts_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text((ROOT / "scenarios" / "matmul_auto.yaml").read_text().replace(
        "  policy: auto", "  policy: auto\n  layouts: {a: [null, null], b: [null, null], "
        "c: [null, null]}"))
    proc = subprocess.run([sys.executable, "-m", "vcluster", "validate", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "parallel.policy" in proc.stderr and "auto" in proc.stderr
