"""torchtitan's measured FSDP2 Llama throughput on 64 A100s (``torchtitan_a100_fsdp.csv``,
:func:`vcluster.planner.validation.validate_fsdp2`): the shipped rows are the published
ones, each architecture reproduces the row's published MFU from its throughput (so the
model and the figure are per GPU), and a row's prediction is what ``vcluster simulate
gpt`` says for the same command line."""

import json
import math
import os
import subprocess
import sys

import pytest

from pipeline_parallel.gpt import GPT, GPTConfig
from vcluster.planner.validation import FSDP2_HARDWARE, FSDP2_TABLE, validate_fsdp2
from vcluster.timing import read_data_csv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
A100_BF16_PEAK = 312e12          # NVIDIA A100 datasheet, dense BF16 (torchtitan's MFU)

pytestmark = pytest.mark.timeout(300)


def _table():
    return read_data_csv(FSDP2_TABLE)[1]


def _config(r):
    return GPTConfig(arch="llama", **{k: int(r[k]) for k in (
        "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab", "seq")})


def test_the_rows_are_the_published_ones():
    rows = _table()
    assert [(r["model"], r["batch"], r["activation_checkpointing"], r["tokens_per_s_per_gpu"])
            for r in rows] == [("llama3-70b", "1", "full", "331"),
                               ("llama2-13b", "2", "none", "2162"),
                               ("llama2-70b", "2", "full", "353")]
    assert {r["gpus"] for r in rows} == {"64"}


def test_each_architecture_gives_the_published_mfu():
    """torchtitan's MFU: (6 N + 12 l h s) tokens/s per GPU over the A100's peak, N the
    parameters without the token embedding: within 1.5% of the published figure."""
    for r in _table():
        cfg = _config(r)
        n = sum(math.prod(s) for k, s in GPT(cfg).param_shapes().items() if k != "wte")
        flops = 6 * n + 12 * cfg.layers * cfg.hidden * cfg.seq
        mfu = flops * float(r["tokens_per_s_per_gpu"]) / A100_BF16_PEAK
        assert mfu == pytest.approx(float(r["mfu_percent"]) / 100, rel=0.015), r["model"]


def test_a_row_is_the_simulate_command_a_user_types(tmp_path):
    r = _table()[1]
    rows = validate_fsdp2()
    row = rows[1]
    assert [x["published"] for x in rows] == [float(x["tokens_per_s_per_gpu"]) for x in _table()]
    assert row["source"] == FSDP2_TABLE and row["metric"] == "tokens_per_s_per_gpu"
    out = tmp_path / "sim.json"
    argv = ["--arch", "llama", "--hidden", r["hidden"], "--layers", r["layers"],
            "--heads", r["heads"], "--kv-heads", r["kv_heads"], "--ffn-hidden", r["ffn_hidden"],
            "--seq", r["seq"], "--vocab", r["vocab"], "--dp", r["gpus"], "--zero", "3",
            "--micro-batch", r["batch"], "--global-batch", str(int(r["gpus"]) * int(r["batch"])),
            "--grad-reduce-dtype", "fp32", "--fsdp2-copies",
            "--hardware", FSDP2_HARDWARE, "--allow-oom", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *argv],
                          capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    sim = json.loads(out.read_text())
    assert row["predicted"] == pytest.approx(int(r["batch"]) * int(r["seq"])
                                             / sim["step_time_s"], rel=1e-9)
    assert row["fits"] == sim["fits"]
