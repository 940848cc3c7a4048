"""``vcluster simulate serve`` and ``vcluster plan serve`` as a user types them (issue 53):
vLLM's result keys, the floors beside the prediction, exit codes, and agreement with the
library call they wrap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modeling.presets import load_model
from serving import ServingPlan
from vcluster.timing.presets import preset
from vcluster.timing.serving.deployment import simulate_serve
from vcluster.timing.serving.workload import Workload

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]

#: vllm bench serve's result keys (vllm/benchmarks/serve.py, the --save-result JSON)
VLLM_KEYS = ("duration", "completed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "output_throughput", "total_token_throughput",
             *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
               for s in ("mean", "median", "std", "p90", "p99")))


def vcluster(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "vcluster", *args], capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_the_issue_command_prints_vllm_keys_and_equals_the_library():
    proc = vcluster("simulate", "serve", "--model", "llama-3.1-8b", "--hardware", "h100-dgx",
                    "--tp", "1", "--pp", "1", "--ep", "1", "--replicas", "2", "--engine",
                    "vllm-v1", "--rate", "8", "--input-len", "512", "--output-len", "64",
                    "--requests", "120", "--json")
    got = json.loads(proc.stdout)
    for key in VLLM_KEYS:
        assert key in got, key
    assert got["completed"] == 120 and got["total_output_tokens"] == 120 * 64
    assert got["num_gpus"] == 2 and got["fits"]
    report = simulate_serve(load_model("llama-3.1-8b"), preset("h100-dgx"),
                            ServingPlan(replicas=2),
                            Workload(num_requests=120, input_len=512, output_len=64, rate=8.0))
    want = report.as_json()
    for key in VLLM_KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-12), key
    # the physics printed beside it: never faster than the floor
    assert got["busy_s"] >= got["floor_s"] > 0
    assert got["decode_step_ms"] >= got["decode_step_floor_ms"] > 0


def test_no_enable_prefix_caching_recomputes_preempted_requests_whole():
    """A KV cache of ~15K tokens for 40 prompts of 1,024 + 256 at once: the same
    preemptions either way, and the run without the prefix cache is slower (each victim
    recomputes its whole prompt and outputs instead of what was overwritten)."""
    args = ("simulate", "serve", "--model", "llama-3.1-8b", "--hardware", "h100-dgx",
            "--gpu-memory-utilization", "0.225", "--input-len", "1024", "--output-len",
            "256", "--requests", "40", "--json")
    cached = json.loads(vcluster(*args).stdout)
    plain = json.loads(vcluster(*args, "--no-enable-prefix-caching").stdout)
    assert cached["enable_prefix_caching"] and not plain["enable_prefix_caching"]
    assert cached["preemptions"] == plain["preemptions"] > 0
    assert cached["duration"] < plain["duration"]
    assert 0 < cached["prefix_cache_hit_rate"] < 1 and plain["prefix_cache_hit_rate"] is None
    assert cached["total_output_tokens"] == plain["total_output_tokens"] == 40 * 256


def test_random_prefix_len_shares_a_prefix_and_equals_the_library():
    """vLLM's --random-prefix-len: prompts are the prefix + --input-len tokens, every
    request after the first finds the prefix's 64 blocks (of 96 looked up), and the
    output equals simulate_serve of Workload(prefix_len=1024)."""
    args = ("simulate", "serve", "--model", "llama-3.1-8b", "--rate", "5", "--requests",
            "40", "--input-len", "512", "--output-len", "32", "--json", "-")
    got = json.loads(vcluster(*args, "--random-prefix-len", "1024").stdout)
    assert got["total_input_tokens"] == 40 * (1024 + 512)
    assert got["prefix_cache_hit_rate"] == pytest.approx(39 * 64 / (40 * 96))
    lib = simulate_serve(load_model("llama-3.1-8b"), preset("h100-dgx"), ServingPlan(),
                         Workload(40, 512, 32, rate=5, prefix_len=1024)).metrics
    assert got["mean_ttft_ms"] == pytest.approx(lib.ttft.mean_ms)
    plain = json.loads(vcluster(*args).stdout)
    assert got["mean_ttft_ms"] < 1.5 * plain["mean_ttft_ms"]   # 512 computed, not 1,536
    assert json.loads(vcluster(*args, "--prefix-len", "1024").stdout) == got
    bad = vcluster(*args, "--prefix-len", "-1", check=False)
    assert bad.returncode == 2 and "--prefix-len" in bad.stderr


def test_gpt_oss_fits_one_h100_only_with_its_mxfp4_experts():
    """GPT-OSS-120B's bf16 weights (234 GB) cannot fit an 80 GB H100 (exit 1); with its
    checkpoint's MXFP4 experts (65.2 GB: 60.7 GiB) the run goes on."""
    args = ("simulate", "serve", "--model", "gpt-oss-120b", "--requests", "20",
            "--input-len", "256", "--output-len", "16")
    assert vcluster(*args, check=False).returncode == 1
    proc = vcluster(*args, "--weight-dtype", "mxfp4")
    assert "weights 65.2 GB per GPU" in proc.stdout and "Serving Benchmark Result" in proc.stdout
    # vLLM's hybrid manager (its default): 2 groups of 18 layers, twice the blocks of one
    # group over all 36 (--disable-hybrid-kv-cache-manager), the same tokens reported
    hybrid = proc.stdout.split("KV cache per replica: ")[1].split(" blocks")[0]
    one = vcluster(*args, "--weight-dtype", "mxfp4", "--disable-hybrid-kv-cache-manager")
    single = one.stdout.split("KV cache per replica: ")[1].split(" blocks")[0]
    assert int(hybrid) == 2 * int(single) + 1 and "2 KV-cache groups of 18" in proc.stdout


def test_the_text_report_has_the_vllm_block_floors_and_kv(tmp_path):
    out = tmp_path / "serve.json"
    proc = vcluster("simulate", "serve", "--model", "qwen3-30b-a3b", "--tp", "2", "--ep", "2",
                    "--concurrency", "8", "--input-len", "256", "--output-len", "32",
                    "--requests", "40", "--json", str(out))
    text = proc.stdout
    for line in ("Serving Benchmark Result", "Mean TTFT (ms):", "P90 TPOT (ms):",
                 "P99 ITL (ms):", "Output token throughput per GPU", "floor",
                 "KV cache per replica:", "preemptions"):
        assert line in text, line
    saved = json.loads(out.read_text())
    assert saved["ep"] == 2 and saved["completed"] == 40
    assert saved["max_concurrent_requests"] <= 8


def test_a_trace_csv_drives_the_run(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,input_len,output_len\n0.0,100,5\n0.5,300,10\n0.6,50,1\n")
    got = json.loads(vcluster("simulate", "serve", "--model", "llama-3.1-8b", "--trace",
                              str(trace), "--json").stdout)
    assert got["completed"] == 3 and got["total_input_tokens"] == 450
    assert got["total_output_tokens"] == 16


def test_a_model_that_does_not_fit_exits_1_unless_allowed():
    args = ("simulate", "serve", "--model", "llama-3.1-70b", "--tp", "1", "--requests", "4",
            "--output-len", "4", "--input-len", "64")
    proc = vcluster(*args, check=False)
    assert proc.returncode == 1
    assert "KV cache holds" in proc.stderr and "weights" in proc.stderr
    forced = vcluster(*args, "--allow-oom", check=False)
    assert forced.returncode == 0, forced.stderr
    assert "Serving Benchmark Result" in forced.stdout


@pytest.mark.parametrize("args, flag", [
    (("--tp", "3"), "--tp"),                       # 32 heads
    (("--ep", "2"), "--ep"),                       # dense model, ep != tp
    (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization"),
    (("--rate", "0"), "--rate"),
    (("--rate", "2", "--concurrency", "4"), "--concurrency"),
    (("--weight-dtype", "mxfp4"), "--weight-dtype"),          # a dense model: no experts
])
def test_bad_flags_exit_2_and_name_the_flag(args, flag):
    proc = vcluster("simulate", "serve", "--model", "llama-3.1-8b", *args, check=False)
    assert proc.returncode == 2
    assert flag in proc.stderr, proc.stderr


def test_plan_serve_finds_the_fewest_gpus_meeting_the_slos(tmp_path):
    out = tmp_path / "plan.json"
    proc = vcluster("plan", "serve", "--model", "llama-3.1-8b", "--gpus", "4", "--rate", "30",
                    "--slo-ttft", "500", "--slo-tpot", "40", "--requests", "300",
                    "--input-len", "512", "--output-len", "64", "--json", str(out))
    assert "best: tp" in proc.stdout
    got = json.loads(out.read_text())
    meets = [c for c in got["candidates"] if c["meets_slo"]]
    best = got["candidates"][0]
    assert best["meets_slo"] and best["gpus"] <= 4
    assert best["goodput_per_gpu"] == max(c["goodput_per_gpu"] for c in meets)
    # the bisection's answer is the fewest replicas of its layout that meet the SLOs
    same = [c for c in got["candidates"] if (c["tp"], c["pp"], c["ep"]) ==
            (best["tp"], best["pp"], best["ep"]) and c["prefill_replicas"] == 0]
    assert all(c["meets_slo"] for c in same if c["replicas"] >= best["replicas"])
    assert not any(c["meets_slo"] for c in same if c["replicas"] < best["replicas"])


def _readme_serve_commands():
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    return [line.split()[1:] for line in text.splitlines()
            if line.startswith(("vcluster simulate serve", "vcluster plan serve"))]


@pytest.mark.slow
def test_the_readme_serve_commands_run_as_written():
    commands = _readme_serve_commands()
    assert len(commands) == 2
    for args in commands:
        proc = vcluster(*args)
        assert ("Serving Benchmark Result" in proc.stdout) or ("best: tp" in proc.stdout)


def test_validate_serving_prints_both_roles_and_writes_every_row(tmp_path):
    out = tmp_path / "v.json"
    proc = vcluster("validate-serving", "--json", str(out))
    assert "| * | fit |" in proc.stdout and "| * | held_out |" in proc.stdout
    got = json.loads(out.read_text())
    from vcluster.timing.serving.validation import serving_rows
    assert len(got["rows"]) == len(serving_rows())
    simulated = [r for r in got["rows"] if r["refused"] is None]
    assert simulated and all(r["errors"] for r in simulated)
    for r in simulated:
        for e in r["errors"]:
            assert e["rel_error"] == pytest.approx(e["predicted"] / e["published"] - 1)
    assert all(r["refused"] for r in got["rows"] if not r["errors"])
