"""``data_parallel: {mode: ddp | zero | ps}`` (issue 28): each mode runs and equals the
single-process reference; ZeRO-3 puts 1.5x DDP's bytes on the links at one micro-batch;
the parameter server's bytes land on the server; the section's rules name their keys."""

import math

import pytest

from vcluster.scenario import ScenarioError, run_scenario, scenario_from_dict, sweep_points
from vcluster.scenario.choices import DataParallelMode
from vcluster.scenario.model import DataParallelSpec

pytestmark = pytest.mark.timeout(300)

MLP = {"kind": "mlp", "sizes": [8, 16, 16, 4], "batch": 16, "optimizer": "adam",
       "lr": 0.01}


def _mlp(data_parallel=None, **sections):
    doc = {"name": "dp", "workload": dict(MLP),
           "parallel": {"dp": 2, "pp": 1, "microbatches": 1},
           "run": {"mode": "emulate", "steps": 2, "check": True, "warmup": 0}}
    if data_parallel is not None:
        doc["data_parallel"] = data_parallel
    doc.update(sections)
    return doc


def test_every_mode_emulates_equal_to_the_reference_and_says_what_ran():
    doc = _mlp(sweep={"data_parallel": [{"mode": "ddp"}, {"mode": "zero", "zero_stage": 3},
                                        {"mode": "ps"}]})
    record = run_scenario(scenario_from_dict(doc))
    rows = record.sweep.to_dict("records")
    assert [r["data_parallel"] for r in rows] == ["ddp", "zero-3",
                                                  "ps (1 server, staleness 0)"]
    assert [r["devices"] for r in rows] == [2, 2, 3]          # ps: 1 server + dp workers
    assert all(r["checks_passed"] is True for r in rows)
    assert record.checks and all(c["passed"] for c in record.checks)
    assert "ZeRO-3 over dp" in rows[1]["workload"]
    assert "parameter server: 1 server + 2 workers, synchronous" in rows[2]["workload"]
    # the parameter server's traffic: the server sends W x the model, a worker the model
    ps = rows[2]
    assert ps["measured_server_bytes_sent"] == 2 * ps["measured_worker_bytes_sent"] > 0
    assert math.isnan(rows[0].get("measured_server_bytes_sent", math.nan))


def _simulated(data_parallel, **parallel):
    doc = _mlp(data_parallel, hardware="a100-80gb-dgx")
    doc["workload"]["dtype"] = "float32"
    doc["parallel"] = {"dp": 4, "pp": 1, "microbatches": 1, **parallel}
    doc["run"] = {"mode": "simulate", "steps": 1}
    return run_scenario(scenario_from_dict(doc)).summary


def test_zero3_puts_one_and_a_half_times_ddps_bytes_on_the_links():
    ddp, zero1, zero3 = (_simulated(d) for d in (None, {"mode": "zero"},
                                                 {"mode": "zero", "zero_stage": 3}))
    assert (ddp["data_parallel"], zero1["data_parallel"], zero3["data_parallel"]) == \
        ("ddp", "zero-1", "zero-3")
    # reduce-scatter + all-gather = one all-reduce; ZeRO-3 gathers the parameters twice
    assert zero1["predicted_bytes_sent"] == ddp["predicted_bytes_sent"]
    assert zero3["predicted_bytes_sent"] == pytest.approx(1.5 * ddp["predicted_bytes_sent"],
                                                          rel=0.01)


def test_parameter_server_trace_puts_w_times_the_model_on_the_server():
    s = _simulated({"mode": "ps", "servers": 1})
    assert s["devices"] == 5 and s["mesh"] == "ps=5"
    assert s["predicted_server_bytes_sent"] == 4 * s["predicted_worker_bytes_sent"] > 0


def test_asynchronous_parameter_server_emulates_unchecked():
    doc = _mlp({"mode": "ps", "staleness": 1})
    doc["parallel"] = {"dp": 4}
    doc["run"] = {"mode": "emulate", "steps": 3, "warmup": 0}
    record = run_scenario(scenario_from_dict(doc))
    s = record.summary
    assert s["data_parallel"] == "ps (1 server, staleness 1)"
    assert "asynchronous, staleness 1" in s["workload"]
    assert s["checks_passed"] is None and math.isfinite(s["final_loss"])
    assert len(record.steps) == 3 and (record.steps["time_s"] > 0).all()


def test_transformer_zero_stage_reaches_the_program_and_the_memory_model():
    doc = {"workload": {"kind": "transformer", "dtype": "float32"},
           "parallel": {"dp": 4}, "run": {"mode": "simulate"}}
    ddp = run_scenario(scenario_from_dict(doc)).summary
    zero = run_scenario(scenario_from_dict(
        dict(doc, data_parallel={"mode": "zero", "zero_stage": 3}))).summary
    alias = run_scenario(scenario_from_dict(
        dict(doc, parallel={"dp": 4, "distributed_optimizer": True}))).summary
    assert (ddp["data_parallel"], zero["data_parallel"], alias["data_parallel"]) == \
        ("ddp", "zero-3", "zero-1")
    assert "ZeRO-3 over dp" in zero["workload"]
    assert zero["predicted_peak_memory_gb"] < alias["predicted_peak_memory_gb"] \
        < ddp["predicted_peak_memory_gb"]


def test_transformer_zero_emulates_equal_to_the_reference():
    doc = {"workload": {"kind": "transformer", "layers": 2}, "parallel": {"dp": 2},
           "data_parallel": {"mode": "zero", "zero_stage": 2},
           "run": {"mode": "emulate", "check": True, "warmup": 0}}
    s = run_scenario(scenario_from_dict(doc)).summary
    assert s["checks_passed"] is True and s["data_parallel"] == "zero-2"


def test_the_mode_sweeps_like_any_key():
    doc = _mlp(sweep={"data_parallel.mode": ["ddp", "zero", "ps"]})
    points = sweep_points(scenario_from_dict(doc))
    assert [p.data_parallel for _, p in points] == [
        DataParallelSpec(), DataParallelSpec(DataParallelMode.ZERO, zero_stage=1),
        DataParallelSpec(DataParallelMode.PS, servers=1)]
    assert [dict(p.mesh.shape) for _, p in points] == [{"dp": 2, "pp": 1}] * 2 + [{"ps": 3}]


def test_the_model_is_small_and_frozen():
    spec = scenario_from_dict(_mlp()).data_parallel
    assert spec == DataParallelSpec() and spec.label == "ddp" and spec.mode == "ddp"
    with pytest.raises(AttributeError):
        spec.mode = "ps"
    two = DataParallelSpec(DataParallelMode.PS, servers=2, staleness=1)
    assert two.label == "ps (2 servers, staleness 1)"


def test_a_given_cluster_mesh_is_one_ps_axis():
    doc = _mlp({"mode": "ps", "servers": 2}, cluster={"mesh": {"ps": 6}})
    doc["parallel"] = {}
    assert dict(scenario_from_dict(doc).mesh.shape) == {"ps": 6}      # 2 servers, 4 workers


@pytest.mark.parametrize("change, path, value", [
    ({"data_parallel": {"mode": "zero", "staleness": 1}}, "data_parallel.staleness", 1),
    ({"data_parallel": {"mode": "ps", "zero_stage": 2}}, "data_parallel.zero_stage", 2),
    ({"data_parallel": {"mode": "ps", "servers": 7}}, "data_parallel.servers", 7),
    ({"data_parallel": {"mode": "ps"}, "parallel": {"dp": 2, "tp": 2}}, "parallel.tp", 2),
    ({"data_parallel": {"mode": "ps"}, "workload": dict(MLP, batch=15)},
     "workload.batch", 15),
    ({"data_parallel": {"mode": "ps"}, "cluster": {"mesh": {"dp": 3}}}, "cluster.mesh",
     {"dp": 3}),
    ({"data_parallel": {"mode": "ps"}, "cluster": {"mesh": {"ps": 4}}}, "parallel.dp", 2),
    ({"data_parallel": {"mode": "ps", "staleness": 2}, "run": {"mode": "both"}},
     "data_parallel.staleness", 2),
    ({"data_parallel": {"mode": "zero"}, "checkpoint": {"every": 1}}, "data_parallel.mode",
     "zero"),
    ({"data_parallel": {"mode": "zero"}, "workload": {"kind": "collective"},
      "cluster": {"mesh": {"x": 2}}, "parallel": {}}, "data_parallel.mode", "zero"),
])
def test_broken_rules_name_the_key(change, path, value):
    doc = {**_mlp(), **change}
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(doc)
    assert (info.value.path, info.value.value) == (path, value), info.value
    assert info.value.allowed


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_transformer_zero_with_sequence_parallelism_emulates_equal_to_the_reference(
        zero_stage):
    """FSDP2 + TP + SP: ZeRO-2/3 beside tp 2 with sequence parallelism (refused before
    2026-11-30) runs, equal to the reference, in 2 micro-batches per step."""
    doc = {"workload": {"kind": "transformer", "layers": 2, "batch": 8},
           "parallel": {"dp": 2, "tp": 2, "sequence_parallel": True, "micro_batch": 2},
           "data_parallel": {"mode": "zero", "zero_stage": zero_stage},
           "run": {"mode": "emulate", "check": True, "warmup": 0}}
    s = run_scenario(scenario_from_dict(doc)).summary
    assert s["checks_passed"] is True and s["data_parallel"] == f"zero-{zero_stage}"


def test_a_large_simulated_parameter_server_traces_every_rank():
    """Above 16 devices a simulate-only DDP run traces one pipeline and mirrors it; a
    parameter server's ranks differ, so each is traced (the server's bytes are W x)."""
    doc = _mlp({"mode": "ps"}, hardware="a100-80gb-dgx")
    doc["workload"] = dict(MLP, batch=20)
    doc["parallel"] = {"dp": 20}
    doc["run"] = {"mode": "simulate"}
    s = run_scenario(scenario_from_dict(doc)).summary
    assert s["devices"] == 21
    assert s["predicted_server_bytes_sent"] == 20 * s["predicted_worker_bytes_sent"] > 0


GPT_SMALL = {"kind": "transformer", "layers": 2, "hidden": 16, "heads": 2, "seq": 8,
             "vocab": 32, "batch": 8}


def _gpt_ps(data_parallel, **sections):
    doc = {"name": "gpt-ps", "workload": dict(GPT_SMALL), "parallel": {"dp": 4},
           "data_parallel": data_parallel,
           "run": {"mode": "both", "steps": 2, "check": True, "warmup": 0},
           "hardware": "a100-80gb-dgx"}
    doc.update(sections)
    return doc


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_transformer_parameter_server_equals_the_reference_and_its_trace(arch):
    """``kind: transformer`` with ``mode: ps``: what GPT.fit_parameter_server runs; the
    server sends W x what a worker sends, measured and predicted alike."""
    doc = _gpt_ps({"mode": "ps", "servers": 1})
    doc["workload"]["arch"] = arch
    s = run_scenario(scenario_from_dict(doc)).summary
    assert s["checks_passed"] is True
    assert s["mesh"] == "ps=5" and s["data_parallel"] == "ps (1 server, staleness 0)"
    assert "parameter server: 1 server + 4 workers, synchronous" in s["workload"]
    assert s["measured_server_bytes_sent"] == 4 * s["measured_worker_bytes_sent"] > 0
    for role in ("server", "worker"):
        assert s[f"measured_{role}_bytes_sent"] == s[f"predicted_{role}_bytes_sent"]


def test_transformer_asynchronous_parameter_server_emulates_unchecked():
    doc = _gpt_ps({"mode": "ps", "servers": 2, "staleness": 1},
                  run={"mode": "emulate", "steps": 3, "warmup": 0})
    doc.pop("hardware")
    s = run_scenario(scenario_from_dict(doc)).summary
    assert s["data_parallel"] == "ps (2 servers, staleness 1)"
    assert s["checks_passed"] is None and math.isfinite(s["final_loss"])


@pytest.mark.parametrize("change, path, value", [
    ({"workload": dict(GPT_SMALL, arch="llama", experts=2)}, "workload.experts", 2),
    ({"parallel": {"dp": 2, "cp": 2}}, "parallel.cp", 2),
    ({"parallel": {"dp": 2, "tp": 2}}, "parallel.tp", 2),
    ({"workload": dict(GPT_SMALL, batch=6)}, "workload.batch", 6),
    ({"data_parallel": {"mode": "ps", "servers": 30}, "parallel": {"dp": 1}},
     "data_parallel.servers", 30),
])
def test_transformer_parameter_server_rules_name_the_key(change, path, value):
    doc = {**_gpt_ps({"mode": "ps"}), **change}
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(doc)
    assert (info.value.path, info.value.value) == (path, value), info.value
    assert info.value.allowed


def test_transformer_tp_overlap_reaches_the_simulated_step():
    """``parallel.tp_overlap``: the default overlaps tensor parallelism's backward
    reductions, "none" keeps them blocking — the same traffic, less of it exposed."""
    doc = {"workload": {"kind": "transformer", "hidden": 1024, "heads": 16, "seq": 512},
           "parallel": {"tp": 4}, "hardware": {"name": "a100-80gb-dgx"},
           "run": {"mode": "simulate"}}
    overlapped = run_scenario(scenario_from_dict(doc)).summary
    blocking = run_scenario(scenario_from_dict(
        dict(doc, parallel={"tp": 4, "tp_overlap": "none"}))).summary
    assert overlapped["predicted_bytes_sent"] == blocking["predicted_bytes_sent"]
    assert overlapped["predicted_comm_s"] == pytest.approx(blocking["predicted_comm_s"])
    assert overlapped["predicted_exposed_comm_s"] < blocking["predicted_exposed_comm_s"]
    assert overlapped["predicted_step_time_s"] < blocking["predicted_step_time_s"]


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_transformer_grad_reduce_dtype_reaches_the_emulated_and_simulated_step(mode):
    """``parallel.grad_reduce_dtype: fp32`` on a float16 workload: the simulated step
    sends more bytes (its gradient reductions at 4 bytes where the gradients hold 2) and
    takes at least as long; a value outside model/fp32 is refused, naming the key."""
    dp = {"mode": mode, **({"zero_stage": 1} if mode == "zero" else {})}
    doc = {"workload": {"kind": "transformer", "hidden": 256, "heads": 4, "seq": 128,
                        "layers": 2, "dtype": "float16"},
           "parallel": {"dp": 4}, "data_parallel": dp, "hardware": {"name": "h100-dgx"},
           "run": {"mode": "simulate"}}
    model = run_scenario(scenario_from_dict(doc)).summary
    fp32 = run_scenario(scenario_from_dict(
        dict(doc, parallel={"dp": 4, "grad_reduce_dtype": "fp32"}))).summary
    assert fp32["predicted_bytes_sent"] > model["predicted_bytes_sent"]
    assert fp32["predicted_step_time_s"] >= model["predicted_step_time_s"]
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(dict(doc, parallel={"dp": 4, "grad_reduce_dtype": "bf16"}))
    assert info.value.path == "parallel.grad_reduce_dtype" and info.value.value == "bf16"
