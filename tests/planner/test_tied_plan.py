"""`simulate gpt --tie-embeddings` and `plan gpt --tie-embeddings`: the memory model's
parameters lose V·h where one stage holds both ends, not on a pipeline (the last stage's
copy), and the planner searches the tied model."""

import json
import os
import subprocess
import sys

import pytest

from vcluster.planner.search import plan_gpt

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--hidden", "768", "--layers", "12", "--heads", "12", "--seq", "1024",
         "--vocab", "50304", "--global-batch", "16", "--hardware", "h100-dgx"]


def _simulate(tmp_path, *argv):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *MODEL, *argv,
                           "--json", str(out)], capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("parallel, fewer_params", [
    (["--micro-batch", "4"], 50304 * 768),                    # one stage: E once
    (["--dp", "4", "--zero", "3", "--micro-batch", "4"], 50304 * 768 // 4),   # sharded
    (["--pp", "2", "--micro-batch", "2"], 0)])                # the last stage's copy
def test_simulate_counts_e_once_on_one_stage(tmp_path, parallel, fewer_params):
    text, tied = _simulate(tmp_path, *parallel, "--tie-embeddings")
    _, untied = _simulate(tmp_path, *parallel)
    assert "V=50304 (tied embeddings)" in text.splitlines()[0]
    weight_bytes = 2                                          # Megatron precision: bf16
    diff = untied["memory_breakdown_gb"]["params"] - tied["memory_breakdown_gb"]["params"]
    assert diff == pytest.approx(fewer_params * weight_bytes / 1e9, rel=1e-9, abs=1e-12)
    assert tied["step_time_s"] == pytest.approx(untied["step_time_s"], rel=0.05)


def test_plan_searches_the_tied_model():
    kw = dict(hidden=768, layers=12, heads=12, seq=1024, vocab=50304, gpus=8, global_batch=32,
              hardware="h100-dgx", top=3, replay=0, max_tp=2, progress=False)
    tied, untied = plan_gpt(tie_embeddings=True, **kw), plan_gpt(**kw)
    assert tied.attrs["config"].tie_embeddings and not untied.attrs["config"].tie_embeddings
    knobs = [c for c in tied.columns if c not in ("step_time_s", "tflops_per_gpu", "mfu",
                                                   "peak_memory_gb", "compute_comm_ratio",
                                                   "screen_step_time_s", "replayed")]
    both = tied.merge(untied, on=knobs, suffixes=("_tied", "_untied"))
    one_stage = both[both["pp"] == 1]
    assert len(one_stage) and (one_stage["peak_memory_gb_tied"]
                               < one_stage["peak_memory_gb_untied"]).all()
