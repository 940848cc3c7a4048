"""What ``vcluster simulate train`` prints and writes (issue 56): tokens/s per GPU, the
hardware and model TFLOP/s under honest labels, and the data-parallel communication in a
row of its own in the per-op table — each figure against its closed form."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_parallel.gpt import megatron_flops_with_recompute, megatron_model_flops
from vcluster.timing import load_hardware

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
B, S, L, H, V = 32, 512, 4, 512, 4096          # global batch, seq, layers, hidden, vocab
ARGS = ["simulate", "train", "--hidden", str(H), "--layers", str(L), "--heads", "8", "--seq",
        str(S), "--vocab", str(V), "--global-batch", str(B), "--tp", "1", "--pp", "1",
        "--hardware", "h100-dgx", "--dp", "4", "--gpus", "4"]


def _simulate(tmp_path, *extra):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", *ARGS, *extra, "--json", str(out)],
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def _line(text: str, start: str) -> str:
    return next(ln for ln in text.splitlines() if ln.strip().startswith(start))


@pytest.fixture(scope="module")
def full_recompute(tmp_path_factory):
    return _simulate(tmp_path_factory.mktemp("full"), "--recompute", "full")


def test_tokens_per_second_per_gpu_is_the_closed_form(full_recompute):
    text, data = full_recompute
    expected = B * S / (data["step_time_s"] * 4)
    assert data["tokens_per_s_per_gpu"] == pytest.approx(expected, rel=1e-12)
    line = _line(text, "tokens/s per GPU")
    assert re.search(rf"tokens/s per GPU\s+{expected:,.0f}\s", line), line


def test_hardware_tflops_count_recomputation_and_model_tflops_do_not(full_recompute):
    """With --recompute full the hardware TFLOP/s exceed the model's (MFU's numerator) by
    Megatron's recompute factor, 96·(1 + s/6h + V/16lh) / 72·(1 + s/6h + V/12lh) — and the
    printed labels say which is which."""
    text, data = full_recompute
    factor = megatron_flops_with_recompute(B, S, L, H, V) / megatron_model_flops(B, S, L, H, V)
    assert factor == pytest.approx(1.3, abs=0.05)
    assert data["hardware_tflops_per_gpu"] == data["tflops_per_gpu"]      # the earlier key
    assert data["hardware_tflops_per_gpu"] / data["model_tflops_per_gpu"] == pytest.approx(
        factor, rel=1e-9)
    model = megatron_model_flops(B, S, L, H, V) / (data["step_time_s"] * 4) / 1e12
    assert data["model_tflops_per_gpu"] == pytest.approx(model, rel=1e-12)
    peak_tflops = load_hardware("h100-dgx").device.peak_flops("bf16") / 1e12
    assert data["mfu"] == pytest.approx(model / peak_tflops, rel=1e-12)
    hw_line, model_line = _line(text, "hardware TFLOP/s"), _line(text, "model TFLOP/s")
    assert f"{data['hardware_tflops_per_gpu']:.1f} per GPU" in hw_line
    assert "the FLOPs executed, recomputation included" in hw_line
    assert f"{data['model_tflops_per_gpu']:.1f} per GPU" in model_line
    assert f"MFU {100 * data['mfu']:.1f}%" in model_line
    assert "TFLOP/s per GPU  " not in text         # the unlabelled figure of earlier versions


def test_data_parallel_gradient_reduction_is_its_own_row(full_recompute):
    """dp = 4, tp = cp = pp = 1: the gradient all-reduces are the only communication; the
    "grad reduce (dp)" row holds all of it, attention none."""
    text, data = full_recompute
    rows = {r["op"]: r for r in data["ops"]}
    assert rows["grad reduce (dp)"]["comm_s"] > 0
    assert rows["grad reduce (dp)"]["compute_s"] == 0.0
    assert rows["grad reduce (dp)"]["compute_comm_ratio"] is None
    assert rows["grad reduce (dp)"]["low_ratio"] is False
    assert rows["attention"]["comm_s"] == 0.0 and rows["attention"]["compute_s"] > 0
    assert sum(r["comm_s"] for r in rows.values()) == pytest.approx(data["comm_s"], rel=1e-12)
    table = text[text.index("compute/comm"):]
    dp_line = _line(table, "grad reduce (dp)")
    assert re.fullmatch(r"\s+grad reduce \(dp\)\s+0\.000s\s+\d+\.\d{3}s\s+-", dp_line), dp_line
    attention = _line(table, "attention")
    assert re.fullmatch(r"\s+attention\s+\d+\.\d{3}s\s+0\.000s\s+no comm", attention), attention


def test_without_data_parallelism_there_is_no_dp_row(tmp_path):
    args = ["--dp", "1", "--gpus", "1"]
    text, data = _simulate(tmp_path, *args)
    assert {r["op"] for r in data["ops"]} == {"embedding", "attention", "mlp", "logits",
                                               "optimizer"}
    assert "(dp)" not in text
