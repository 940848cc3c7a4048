"""The ``inference`` scenario kind: a model served, emulated, simulated or both.

* simulate: Llama 3.1 8B on an H100 node, 50 requests — the report's vLLM metrics equal
  what numpy makes of its own per-request rows, the decode floor lies between the
  closed-form weight read and that read plus the largest batch's KV, the KV cache fits
  the memory vLLM would give it, and trace.json holds one slice per engine step and one
  lifetime per request;
* both (localhost, a saved calibration): a tiny Llama on 2 tensor-parallel devices — every
  check passes, the tokens equal a greedy reference recomputed here, the first engine
  steps equal a schedule worked by hand, the traffic matches the trace and the prediction
  stands beside the measurement; a corrupted output fails the checks;
* a sweep over the request rate draws throughput and P90 latency against the rate, the
  knee visible (served = offered below it, saturated above);
* bad keys name their key path.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from modeling import MLP, Attention, Layer, ModelSpec
from pipeline_parallel.decoder import greedy_reference, serve_config
from pipeline_parallel.gpt import GPT
from reports import write_report
from reports.chrome_trace import chrome_trace
from reports.serving_plots import ecdf
from vcluster import VirtualCluster
from vcluster.scenario import (ScenarioError, build_workload, run_scenario, scenario_from_dict,
                               scenario_schema)
from vcluster.scenario.runner import SUMMARY_KEYS
from vcluster.timing.serving.deployment import REPORTED_MEMORY_GIB
from tests.localhost_specs import localhost_spec_file

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

# --- simulate --------------------------------------------------------------------------
SIMULATE = {"name": "sim", "hardware": "h100-dgx",
            "workload": {"kind": "inference", "model": "llama-3.1-8b", "requests": 50,
                         "input_len": 512, "output_len": 64, "rate": 8},
            "run": {"mode": "simulate"}}
# Llama 3.1 8B (its config.json): h, layers, heads, KV heads, head dim, SwiGLU width, V
H, L, A, C, D, F, V = 4096, 32, 32, 8, 128, 14336, 128256
H100_BYTES_PER_S = 3.35e12          # the H100 SXM5 datasheet's HBM3 bandwidth
H100_TORCH_GIB = REPORTED_MEMORY_GIB["H100-SXM5-80GB"]   # torch's total of an H100 (vLLM logs)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    record = run_scenario(scenario_from_dict(SIMULATE, "sim"))
    out = write_report(record, tmp_path_factory.mktemp("sim") / "report")
    return record, out


def test_simulate_metrics_are_numpy_of_the_reports_own_rows(simulated):
    record, out = simulated
    s = record.summary
    assert s["kind"] == "inference" and s["hardware"] == "h100-dgx" and s["fits"] is True
    assert set(SUMMARY_KEYS["serving"]) <= set(s)
    assert not set(SUMMARY_KEYS["simulate"]) - {"hardware"} & set(s)   # no trace replay
    import pandas as pd
    rows = pd.read_csv(out / "requests.csv")
    assert len(rows) == 50 and set(rows["source"]) == {"simulated"}
    np.testing.assert_allclose(rows["ttft_s"], rows["first_token_s"] - rows["arrival_s"])
    np.testing.assert_allclose(rows["e2el_s"], rows["finish_s"] - rows["arrival_s"])
    duration = rows["finish_s"].max()                 # vLLM: from t = 0 to the last token
    assert s["duration"] == pytest.approx(duration)
    assert s["request_throughput"] == pytest.approx(50 / duration)
    assert s["output_throughput"] == pytest.approx(50 * 64 / duration)
    assert s["total_input_tokens"] == 50 * 512 and s["completed"] == 50
    for name in ("ttft", "tpot", "e2el"):
        ms = rows[f"{name}_s"].to_numpy() * 1e3
        assert s[f"mean_{name}_ms"] == pytest.approx(ms.mean())
        assert s[f"median_{name}_ms"] == pytest.approx(np.median(ms))
        assert s[f"p90_{name}_ms"] == pytest.approx(np.percentile(ms, 90))
        assert s[f"p99_{name}_ms"] == pytest.approx(np.percentile(ms, 99))
    steps = pd.read_csv(out / "engine_steps.csv")
    assert steps["prefill_tokens"].sum() == 50 * 512            # no preemption: once each
    assert steps["decode_seqs"].sum() == 50 * 63                # the first token: prefill's
    summary = (out / "summary.md").read_text()
    assert "## Serving: latency (ms, simulated)" in summary and "| TTFT |" in summary
    assert (out / "latency_cdf.png").read_bytes().startswith(PNG)
    assert (out / "kv_usage.png").read_bytes().startswith(PNG)


def test_simulate_physics_and_memory_in_closed_form(simulated):
    """The decode floor reads every weight but the embedding table (a lookup) once:
    (L (h·a·d + 2·h·c·d + a·d·h + 3·h·f + 2h) + V·h + h) · 2 bytes over the datasheet
    bandwidth, plus the KV it attends to, at most the peak batch's whole contexts; the
    memory vLLM may use is ceil(79.11 GiB × 0.9); the KV blocks (16 tokens × 2 × L × c ×
    d × 2 bytes each) fit what the weights leave of it."""
    s = simulated[0].summary
    params = L * (H * A * D + 2 * H * C * D + A * D * H + 3 * H * F + 2 * H) + V * H + H
    weights_s = 2 * params / H100_BYTES_PER_S
    kv_token_bytes = 2 * L * C * D * 2
    kv_s = s["max_concurrent_requests"] * (512 + 64) * kv_token_bytes / H100_BYTES_PER_S
    floor_s = s["decode_step_floor_ms"] / 1e3
    assert weights_s <= floor_s <= weights_s + kv_s
    assert s["decode_step_ms"] >= s["decode_step_floor_ms"] and s["busy_s"] >= s["floor_s"]
    limit = math.ceil(H100_TORCH_GIB * 2**30 * 0.9)
    assert s["memory_limit_gb"] == pytest.approx(limit / 1e9)
    block_bytes = 16 * kv_token_bytes
    budget = limit - s["weights_gb_per_gpu"] * 1e9
    assert 0.95 * budget <= s["kv_blocks_per_replica"] * block_bytes <= budget
    assert s["kv_tokens_per_replica"] == 16 * s["kv_blocks_per_replica"]


def test_simulate_trace_has_a_slice_per_step_and_a_lifetime_per_request(simulated):
    record, out = simulated
    trace = json.loads((out / "trace.json").read_text())
    assert trace == json.loads(json.dumps(chrome_trace(record)))
    events = trace["traceEvents"]
    assert all({"ph", "pid"} <= set(e) for e in events)
    steps = [e for e in events if e.get("cat") == "engine step"]
    assert len(steps) == len(record.engine_steps)
    assert all(e["ph"] == "X" and e["dur"] > 0 and {"prefill_tokens", "decode_seqs",
                                                    "kv_usage"} <= set(e["args"])
               for e in steps)
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names == {"replica 0"}
    opened, closed = {}, {}
    for e in (e for e in events if e.get("cat") == "request"):
        (opened if e["ph"] == "b" else closed).setdefault(e["id"], []).append(e["ts"])
    assert len(opened) == 50 and opened.keys() == closed.keys()
    for ident, starts in opened.items():
        assert len(starts) == len(closed[ident]) == 2 and min(starts) <= min(closed[ident])


def test_a_deployment_that_does_not_fit_is_flagged_as_training_is():
    """Llama 3.1 70B's bf16 weights (2 x 70.6 B parameters, 141 GB) on one H100: the
    weights alone exceed the 76.5 GB vLLM may use; the run still simulates (one longest
    request's blocks) and says so."""
    doc = dict(SIMULATE, workload=dict(SIMULATE["workload"], model="llama-3.1-70b",
                                       requests=5))
    record = run_scenario(scenario_from_dict(doc, "oom"))
    s = record.summary
    assert s["fits"] is False and s["completed"] == 5
    assert s["weights_gb_per_gpu"] > 140 and s["predicted_peak_memory_gb"] > 140
    (line,) = record.out_of_memory
    usable = math.ceil(H100_TORCH_GIB * 2**30 * 0.9) / 1e9
    assert f"GB per device > {usable:.1f} GB usable" in line


# --- emulate and simulate on localhost ---------------------------------------------------
TINY = {"kind": "inference", "hidden": 32, "heads": 4, "kv_heads": 2, "layers": 2,
        "vocab": 64, "ffn_hidden": 64, "input_len": [5, 17, 9, 3],
        "output_len": [4, 3, 6, 5], "arrival_steps": [0, 0, 1, 3]}
ENGINE = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "block_size": 4}


def _tiny(tmp_path, mode="both"):
    spec = localhost_spec_file(tmp_path / "machine.json")
    return scenario_from_dict({"name": "tiny", "workload": TINY, "parallel": {"tp": 2},
                               "engine": ENGINE, "run": {"mode": mode, "check": True},
                               "hardware": {"name": "localhost",
                                            "calibration": str(spec)}}, "tiny")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("both")
    record = run_scenario(_tiny(tmp))
    return record, write_report(record, tmp / "report")


def test_both_checks_pass_and_prediction_stands_beside_measurement(both):
    record, out = both
    s = record.summary
    assert record.checks_status == "passed" and s["checks_passed"] is True
    assert len(record.checks) == 1 + 2 * 4 + 1         # agreement, tokens + logits, steps
    assert s["traffic_matches"] is True and s["measured_bytes_sent"] > 0
    assert s["measured_bytes_sent"] == s["traced_bytes_sent"]
    assert s["predicted_over_measured"] == pytest.approx(
        s["predicted_step_time_s"] / s["measured_step_time_s"])
    assert set(SUMMARY_KEYS["emulated_serving"]) <= set(s)
    assert not set(SUMMARY_KEYS["serving"]) - {"hardware"} & set(s)   # localhost: none
    # 1 null block + ceil((prompt + output) / 4) for each request
    assert s["emulated_kv_blocks"] == 1 + 3 + 5 + 4 + 2
    assert s["emulated_output_tokens"] == 4 + 3 + 6 + 5 and s["emulated_preemptions"] == 0
    assert (out / "predicted_vs_measured.png").read_bytes().startswith(PNG)
    assert (out / "kv_usage.png").read_bytes().startswith(PNG)
    assert not (out / "latency_cdf.png").exists()       # nothing simulated: no latencies
    assert "## Serving: the emulated run" in (out / "summary.md").read_text()


def test_both_tokens_equal_a_greedy_reference_recomputed_here(both):
    """The documented draws (parameters GPT(config, seed 0), prompts rng([0, 2])) through
    the cache-free reference give the tokens the report lists."""
    spec = ModelSpec("tiny", hidden=32, vocab=64,
                     layers=(Layer(Attention(4, 2, 8), MLP("swiglu", 64)),) * 2)
    config = serve_config(spec)
    params = GPT(config, seed=0).init_params()
    rng = np.random.default_rng([0, 2])
    rows = both[0].requests.sort_values("request_id")
    for (p, o), listed in zip(zip(TINY["input_len"], TINY["output_len"]), rows["tokens"]):
        tokens, _ = greedy_reference(config, params, rng.integers(0, 64, p), o)
        assert " ".join(map(str, tokens)) == listed


def test_both_engine_steps_equal_the_schedule_worked_by_hand(both):
    """vLLM v1 with a budget of 8 tokens, 3 sequences, blocks of 4 (14 usable):
    step 0: A (prompt 5) 5 + B (17) 3 -> blocks 2 + 1; A samples;
    step 1: C arrives; A decodes, B 7 more (10: 3 blocks), budget spent;
    step 2: A decodes, B 7 more (17: 5 blocks) and samples;
    step 3: D arrives; A, B decode; C admitted, 6 of 9 (2 blocks); the cap of 3 holds D;
            A's 4th token: A finishes;
    step 4: B decodes (19: still 5 blocks) and finishes; C's last 3 (3 blocks); D's 3 (1)."""
    steps = both[0].engine_steps
    first = steps[steps["step"] < 5]
    assert list(first["prefill_tokens"]) == [8, 7, 7, 6, 6]
    assert list(first["decode_seqs"]) == [0, 1, 1, 2, 1]
    np.testing.assert_allclose(first["kv_usage"] * 14, [3, 5, 7, 9, 9])
    assert steps["num_scheduled_tokens"].max() <= 8 and steps["num_seqs"].max() <= 3
    requests = both[0].requests.set_index("request_id")
    assert list(requests["first_token_step"]) == [0, 2, 4, 4]
    assert list(requests["finish_step"]) == [3, 4, 9, 8]
    # every prompt prefilled once, every later token one decode
    assert steps["prefill_tokens"].sum() == sum(TINY["input_len"])
    assert steps["decode_seqs"].sum() == sum(TINY["output_len"]) - 4


def test_a_corrupted_output_fails_the_checks(tmp_path):
    """The checks can fail: one token changed on one rank fails that request's tokens
    and the ranks' agreement, and nothing else."""
    workload = build_workload(_tiny(tmp_path, "emulate"))
    with VirtualCluster(workload.mesh) as cluster:
        outputs = cluster.run(workload.program, list(workload.args_by_rank))
    assert all(c["passed"] for c in workload.check(outputs, 1e-9))
    tokens = dict(outputs[0]["outputs"])
    tokens[2] = (tokens[2][0] + 1,) + tokens[2][1:]
    outputs[0] = dict(outputs[0], outputs=tokens)
    failed = {c["name"] for c in workload.check(outputs, 1e-9) if not c["passed"]}
    assert failed == {"request 2: tokens", "tokens agree across ranks (ranks that differ)"}


# --- a sweep over the rate ---------------------------------------------------------------
def test_rate_sweep_draws_throughput_against_rate_with_the_knee(tmp_path):
    """Below the knee the requests served per second follow the offered rate: vLLM's send
    times end at N/rate exactly, so D = N/rate + the last request's E2EL; far above it the
    engine serves what it can and the P90 TTFT grows."""
    doc = dict(SIMULATE, name="sweep", sweep={"workload.rate": [2, 200]})
    doc["workload"] = dict(SIMULATE["workload"], requests=60, input_len=1024, output_len=128)
    record = run_scenario(scenario_from_dict(doc, "sweep"))
    out = write_report(record, tmp_path / "report")
    assert (out / "throughput_vs_rate.png").read_bytes().startswith(PNG)
    sweep = record.sweep.set_index("workload.rate")
    rows = record.requests[record.requests["point"] == 0]
    last = rows.loc[rows["arrival_s"].idxmax()]
    assert last["arrival_s"] == pytest.approx(60 / 2)
    assert sweep.loc[2, "duration"] == pytest.approx(60 / 2 + last["e2el_s"])
    assert sweep.loc[2, "request_throughput"] > 0.95 * 2
    assert sweep.loc[200, "request_throughput"] < 0.5 * 200
    assert sweep.loc[200, "p90_ttft_ms"] > 5 * sweep.loc[2, "p90_ttft_ms"]
    assert sorted(record.requests["point"].unique()) == [0, 1]


def test_ecdf_steps_one_over_n_at_each_value():
    x, y = ecdf([3.0, 1.0, float("nan"), 2.0])
    assert list(x) == [1.0, 2.0, 3.0] and list(y) == pytest.approx([1 / 3, 2 / 3, 1.0])


# --- bad keys ----------------------------------------------------------------------------
@pytest.mark.parametrize("change, path", [
    ({"workload": dict(TINY, requests=4, input_len=[5, 6])}, "workload.input_len"),
    ({"workload": dict(TINY, arrival_steps=[0, 1])}, "workload.arrival_steps"),
    ({"workload": dict(TINY, model="llama-3.1-8b", experts=4)}, "workload.experts"),
    ({"workload": dict(TINY, model="no-such-model")}, "workload.model"),
    ({"workload": dict(TINY, kv_heads=3)}, "workload.kv_heads"),
    ({"parallel": {"tp": 2, "replicas": 2}}, "parallel.replicas"),
    ({"parallel": {"tp": 2, "ep": 2}}, "parallel.ep"),
    ({"engine": {"name": "sglang"}}, "engine.name"),
    ({"engine": {"gpu_memory_utilization": 1.5}}, "engine.gpu_memory_utilization"),
    ({"engine": dict(ENGINE, num_blocks=3)}, "engine.num_blocks"),
    ({"engine": dict(ENGINE, enable_prefix_caching="no")}, "engine.enable_prefix_caching"),
    ({"cluster": {"mesh": {"tp": 2, "pp": 1}}}, "cluster.mesh"),
    ({"run": {"mode": "simulate"}, "hardware": "localhost"}, "hardware"),
    ({"workload": dict(TINY, trace="t.csv", input_len=4)}, "workload.input_len"),
    ({"workload": {"kind": "matmul"}, "cluster": {"mesh": {"tp": 2}},
      "parallel": {"policy": "Unsharded"}}, "engine"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_keys_are_named_by_path(change, path):
    doc = {"workload": TINY, "parallel": {"tp": 2}, "engine": ENGINE, **change}
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(doc, "bad")
    assert info.value.path == path and info.value.allowed


def test_engine_enable_prefix_caching_reaches_the_plan_and_the_emulated_scheduler():
    """Default on (vLLM v1's); false reaches the simulated deployment and the decoder's
    scheduler settings alike."""
    from modeling.presets import load_model
    from vcluster.scenario.workloads.inference import (_emulation_settings,
                                                       emulated_requests, serving_plan)
    spec = load_model("llama-3.1-8b")
    on = scenario_from_dict(SIMULATE, "on")
    assert serving_plan(on, spec).enable_prefix_caching
    off = scenario_from_dict(dict(SIMULATE, engine={"enable_prefix_caching": False}), "off")
    assert not serving_plan(off, spec).enable_prefix_caching
    tiny = scenario_from_dict({"workload": TINY, "parallel": {"tp": 2},
                               "engine": dict(ENGINE, enable_prefix_caching=False)}, "t")
    assert _emulation_settings(tiny, emulated_requests(tiny))["enable_prefix_caching"] is False


def test_every_inference_key_is_documented():
    """Every key of the kind, its parallel section, the engine section and its summary is
    in the docs (docs/scenario.md, "kind: inference")."""
    from vcluster.scenario.schema import _PARALLEL, _WORKLOAD
    docs = "".join(p.read_text() for p in (ROOT / "docs").glob("scenario*.md"))
    engine = scenario_schema()["properties"]["engine"]["properties"]
    paths = ([f"workload.{k}" for k in _WORKLOAD["inference"]]
             + [f"parallel.{k}" for k in _PARALLEL["inference"]]
             + ["engine"] + [f"engine.{k}" for k in engine]
             + list(SUMMARY_KEYS["serving"]) + list(SUMMARY_KEYS["emulated_serving"]))
    missing = [p for p in paths if f"`{p}`" not in docs]
    assert not missing, missing


def test_a_shared_prefix_is_emulated_against_the_reference_and_simulated(tmp_path):
    """workload.prefix_len: every prompt starts with the same 10 tokens (drawn from
    rng([seed, 3, 0])), after which its own input_len follow. Emulated (tp 2, blocks of 4):
    every check passes — tokens and logits equal the cache-free reference — and the
    requests admitted after the first computed less than their prompts (their first two
    blocks, 8 tokens, were the first request's). Simulated: the prompts are 10 tokens
    longer and the prefix cache's hit rate is what those blocks give."""
    doc = {"name": "prefix", "workload": dict(TINY, prefix_len=10), "parallel": {"tp": 2},
           "engine": ENGINE, "run": {"mode": "emulate", "check": True}}
    record = run_scenario(scenario_from_dict(doc, "prefix"))
    assert record.checks_status == "passed"
    steps = record.engine_steps
    assert steps["prefill_tokens"].sum() == sum(TINY["input_len"]) + 10 + 3 * 2
    sim = run_scenario(scenario_from_dict(dict(SIMULATE, workload=dict(
        SIMULATE["workload"], prefix_len=2048)), "sim-prefix"))
    s = sim.summary
    assert s["total_input_tokens"] == 50 * (2048 + 512)
    # 49 of 50 requests find the 128 blocks of the prefix, each looking up 160
    assert s["prefix_cache_hit_rate"] == pytest.approx(49 * 128 / (50 * 160))
