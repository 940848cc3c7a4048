"""FP8 linear layers (``simulate_gpt(fp8=True)``, ``--fp8``): which GEMMs run in FP8, their
price at the datasheet's FP8 peak, and the refusals (no FP8 peak, measured BF16 kernels)."""

import json
import os
import subprocess
import sys

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.search import plan_gpt
from vcluster.planner.simulation import fp8_gemm, gpt_step_traces, simulate_gpt
from vcluster.runtime.tracing import Kernel, TraceCompute
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import TRAINING_KERNEL_EFFICIENCY, HardwareCostModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)


class _Recorder:
    """A cost model that prices as ``costs`` does and keeps every compute op it prices."""

    def __init__(self, costs):
        self.costs, self.ops = costs, []

    def compute_time_s(self, op):
        self.ops.append(op)
        return self.costs.compute_time_s(op)

    def __getattr__(self, name):
        return getattr(self.costs, name)


def _gemm_names(config, parallel):
    recorder = _Recorder(HardwareCostModel(load_hardware("h100-dgx")))
    gpt_step_traces(config, parallel, recorder)
    gemms = {op.name: fp8_gemm(op) for op in recorder.ops
             if op.kernel is not None and op.kernel.kind.value == "gemm"}
    assert gemms
    return gemms


@pytest.mark.parametrize("arch, experts", [("gpt", 0), ("llama", 0), ("llama", 4)])
def test_the_layers_linear_gemms_run_in_fp8_and_nothing_else(arch, experts):
    config = GPTConfig(hidden=256, layers=2, heads=4, seq=128, vocab=512, arch=arch,
                       experts=experts)
    parallel = ParallelConfig(global_batch=2, micro_batch=1, tp=2, attention="unfused")
    for name, fp8 in _gemm_names(config, parallel).items():
        linear = any(w in name for w in ("W_qkv", "W_q", "W_kv", "W_o", "W1", "W2", "W_gate",
                                         "W_up", "W_down", "dW1", "dW2")) \
            or name.startswith("moe: expert")
        if "head:" in name or "router" in name or any(
                p in name for p in ("q @ k^T", "P @ v", "dP =", "dq =", "dk =", "dv =")):
            assert not fp8, name        # output head, router, attention's batched products
        else:
            assert linear and fp8, name


def test_an_fp8_gemm_is_priced_at_the_datasheet_fp8_peak():
    # H100 SXM: FP8 3,958 TFLOPS with sparsity -> 1,978.8 dense; e_max 0.709 (the measured
    # FP8 MAMF; BF16's 0.801); HBM 3,350 GB/s at 0.9; 5 us per kernel; the training-kernel
    # divisor
    op = TraceCompute("gpt: mlp: x @ W1", 2 * 8192 * 4096 * 16384, 2 * (8192 * 4096
                      + 4096 * 16384 + 8192 * 16384), kernel=Kernel.gemm(1, 8192, 4096, 16384))
    assert fp8_gemm(op)
    fp8 = HardwareCostModel(load_hardware("h100-dgx"), fp8_gemms=fp8_gemm)
    bf16 = HardwareCostModel(load_hardware("h100-dgx"))
    expected = (5e-6 + op.flops / (1978.8e12 * 0.709)) / TRAINING_KERNEL_EFFICIENCY
    assert fp8.compute_time_s(op) == pytest.approx(expected, rel=1e-9)
    assert bf16.compute_time_s(op) == pytest.approx(
        (5e-6 + op.flops / (989.4e12 * 0.801)) / TRAINING_KERNEL_EFFICIENCY, rel=1e-9)
    head = TraceCompute("gpt: head: logits = x W_out", op.flops, op.bytes,
                        kernel=Kernel.gemm(1, 8192, 4096, 16384))
    assert not fp8_gemm(head) and fp8.compute_time_s(head) == bf16.compute_time_s(head)


def test_a_row_scaled_fp8_gemm_computes_at_its_share_of_the_fp8_rate():
    """``fp8-row`` (PyTorch's row-scaled GEMM): the compute-bound time over its rate share,
    the launch and the memory-bound floor unchanged; a bad share is refused by name."""
    from vcluster.timing.gemm_formats import FP8_ROW_RATE_SHARE, GemmFormat
    op = TraceCompute("gpt: mlp: x @ W1", 2 * 8192 * 4096 * 16384, 2 * (8192 * 4096
                      + 4096 * 16384 + 8192 * 16384), kernel=Kernel.gemm(1, 8192, 4096, 16384))
    hw = load_hardware("h100-dgx")
    row = HardwareCostModel(hw, fp8_gemms=fp8_gemm, gemm_format="fp8-row")
    assert FP8_ROW_RATE_SHARE == 0.76
    expected = (5e-6 + op.flops / (1978.8e12 * 0.709 * 0.76)) / TRAINING_KERNEL_EFFICIENCY
    assert row.compute_time_s(op) == pytest.approx(expected, rel=1e-9)
    # a tiny GEMM is launch- and memory-bound: the share changes nothing there
    tiny = TraceCompute("gpt: mlp: x @ W1", 2.0, 1e6, kernel=Kernel.gemm(1, 1, 1, 1))
    assert row.compute_time_s(tiny) == HardwareCostModel(
        hw, fp8_gemms=fp8_gemm).compute_time_s(tiny)
    with pytest.raises(ValueError, match=r"GemmFormat 'x': rate_share must be in \(0, 1\], "
                                         r"got 1.5"):
        GemmFormat("x", "fp8", rate_share=1.5)


def test_the_row_scaled_share_reproduces_torchaos_measured_ratio(monkeypatch):
    """FP8_ROW_RATE_SHARE's source (vcluster.timing.gemm_formats): torchao's README measures
    one torchtitan run of Llama 3 8B on 8 H100s (FSDP2, batch 1, sequence 8192, compile,
    per-op SAC) at 7,689.5 tokens/s with the tensorwise recipe and 6,768 with rowwise
    (0.880); with the share the model's ratio is within 0.005 of it, and the share is the
    best of its 0.01 grid."""
    from dataclasses import replace
    import vcluster.timing.gemm_formats as G
    from vcluster.planner.validation_long_context import _hardware
    cfg = GPTConfig(hidden=4096, layers=32, heads=32, kv_heads=8, seq=8192, vocab=128256,
                    arch="llama", ffn_hidden=14336)
    par = ParallelConfig(global_batch=8, micro_batch=1, dp=8, zero_stage=3, recompute="op",
                         grad_reduce_dtype="fp32", attention="flash2")
    hw = _hardware("h100-sxm-hbm2e")        # Meta's H100s (torchtitan's hosts)

    formats = dict(G.GEMM_FORMATS)

    def ratio(share):
        formats["fp8-row"] = replace(G.GEMM_FORMATS["fp8-row"], rate_share=share)
        monkeypatch.setattr(G, "GEMM_FORMATS", formats)
        steps = [simulate_gpt(cfg, par, hw, fp8=True, fp8_casts=c,
                              fsdp2_copies=True).step_time_s
                 for c in ("torchao-tensorwise", "torchao-rowwise")]
        return steps[0] / steps[1]

    measured = 6768 / 7689.5
    at = {s: ratio(s) for s in (0.75, 0.76, 0.77)}
    assert at[0.76] == pytest.approx(measured, abs=0.005)
    assert min(at, key=lambda s: abs(at[s] - measured)) == G.FP8_ROW_RATE_SHARE


def test_fp8_cuts_the_linear_layers_time_by_the_achieved_fp8_rate():
    config = GPTConfig(hidden=4096, layers=4, heads=32, seq=2048, vocab=32000)
    parallel = ParallelConfig(global_batch=8, micro_batch=1, dp=8)
    bf16 = simulate_gpt(config, parallel, "h100-dgx")
    fp8 = simulate_gpt(config, parallel, "h100-dgx", fp8=True)
    assert fp8.fp8 and not bf16.fp8
    mlp = {r.op: r.compute_s for r in bf16.ops}["mlp"], {r.op: r.compute_s for r in fp8.ops}["mlp"]
    gemms = 0.801 / (2 * 0.709)        # the GEMMs at FP8's achieved rate over BF16's
    assert gemms * mlp[0] < mlp[1] < (gemms + 0.1) * mlp[0]   # the GELU and adds as before
    logits = [{r.op: r.compute_s for r in s.ops}["logits"] for s in (bf16, fp8)]
    assert logits[0] == pytest.approx(logits[1])      # the output head stays BF16
    assert fp8.step_time_s < bf16.step_time_s
    assert fp8.peak_memory_gb == bf16.peak_memory_gb  # the memory model is unchanged
    assert fp8.to_json()["fp8"] is True


def test_fp8_needs_an_fp8_peak_and_analytic_prices():
    config = GPTConfig(hidden=256, layers=2, heads=4, seq=128, vocab=512)
    parallel = ParallelConfig(global_batch=2, micro_batch=1)
    with pytest.raises(ValueError, match=r"a100-80gb-dgx \(A100-SXM4-80GB\) has peaks for "
                                         r"bf16, fp16, tf32, fp32 only"):
        simulate_gpt(config, parallel, "a100-80gb-dgx", fp8=True)
    table = {"base": "h100-dgx", "device": {"kernel_table": "h100_kernels.csv"}}
    with pytest.raises(ValueError, match="priced by the analytic model.*measured BF16"):
        simulate_gpt(config, parallel, table, fp8=True)
    with pytest.raises(ValueError, match="fp8 must be True or False"):
        simulate_gpt(config, parallel, "h100-dgx", fp8="yes")


def test_the_planner_prices_every_candidate_in_fp8():
    kw = dict(hidden=1024, layers=8, heads=16, seq=1024, vocab=32000, gpus=8, global_batch=16,
              hardware="h100-dgx", top=3, workers=1, progress=False, max_micro_batch=2)
    bf16, fp8 = plan_gpt(**kw), plan_gpt(**kw, fp8=True)
    assert fp8.attrs["fp8"] is True and bf16.attrs["fp8"] is False
    assert fp8.step_time_s.iloc[0] < bf16.step_time_s.iloc[0]
    with pytest.raises(ValueError, match="has peaks for"):
        plan_gpt(**(kw | {"hardware": "a100-80gb-dgx"}), fp8=True)


def _vcluster(*args):
    return subprocess.run([sys.executable, "-m", "vcluster", *args], capture_output=True,
                          text=True, timeout=200, env=dict(os.environ, PYTHONPATH=ROOT))


def test_the_cli_flag(tmp_path):
    model = ["--hidden", "1024", "--layers", "4", "--heads", "16", "--seq", "1024",
             "--vocab", "32000", "--global-batch", "8"]
    out = tmp_path / "sim.json"
    proc = _vcluster("simulate", "gpt", *model, "--dp", "8", "--hardware", "h100-dgx", "--fp8",
                     "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert ", FP8 linear layers" in proc.stdout and json.loads(out.read_text())["fp8"] is True
    proc = _vcluster("simulate", "gpt", *model, "--dp", "8", "--fp8")
    assert proc.returncode == 2 and "fp8 GEMMs need FP8 tensor cores: a100-80gb-dgx" in proc.stderr
    proc = _vcluster("simulate", "train", *model, "--dp", "8", "--hardware", "b200-dgx",
                     "--gemm-format", "nvfp4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert ", NVFP4 linear layers" in proc.stdout
    assert json.loads(out.read_text())["gemm_format"] == "nvfp4"
    proc = _vcluster("simulate", "train", *model, "--dp", "8", "--hardware", "h200-dgx",
                     "--gemm-format", "mxfp8")
    assert proc.returncode == 2 and "mxfp8 GEMMs need tensor cores that read mxfp8" in proc.stderr
    proc = _vcluster("simulate", "train", *model, "--dp", "8", "--hardware", "b200-dgx",
                     "--fp8", "--gemm-format", "mxfp8")
    assert proc.returncode == 2 and "--fp8 and --gemm-format mxfp8 disagree" in proc.stderr
    plan = tmp_path / "plan.json"
    proc = _vcluster("plan", "gpt", *model, "--gpus", "8", "--hardware", "h100-dgx", "--fp8",
                     "--workers", "1", "--quiet", "--json", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert "; FP8 linear layers" in proc.stdout and json.loads(plan.read_text())["fp8"] is True


def test_the_hopper_presets_carry_the_datasheet_fp8_peak():
    for name in ("h100-dgx", "h200-dgx"):
        peaks = load_hardware(name).device.peak_tflops
        assert peaks["fp8"] == 2 * peaks["bf16"] == pytest.approx(1978.8)
    for name in ("a100-40gb-dgx", "a100-80gb-dgx"):
        assert "fp8" not in load_hardware(name).device.peak_tflops


def test_the_nemo_fp8_table_is_the_published_one_with_its_architectures():
    """Every row's model: the table's own Model TFLOP/s over its tokens/s is the model's
    FLOPs per token (attention counted over the full s², as NeMo counts it). Its rows are
    simulated, each with its published value, in validate-model's acceptance test
    (tests/planner/test_simulate.py), the one run of the whole table in the suite."""
    from pipeline_parallel.gpt import model_flops
    from vcluster.planner.validation import FP8_TABLE, fp8_row_config
    from vcluster.timing import read_data_csv
    comments, rows = read_data_csv(FP8_TABLE)
    assert "NVIDIA/NeMo" in comments[0] and "070a0bb168d405d6" in comments[0]
    assert [r["model"] for r in rows] == ["GPT3-5B", "GPT3-20B", "GPT3-175B", "GPT3-175B",
                                          "LLAMA2-7B", "LLAMA2-13B", "LLAMA2-70B", "LLAMA3-8B",
                                          "LLAMA3-70B"]
    for r in rows:
        cfg, par = fp8_row_config(r)
        assert par.gpus == int(r["gpus"]) and (par.tp, par.pp, par.cp) == tuple(
            int(r[k]) for k in ("tp", "pp", "cp"))
        per_token = model_flops(cfg, 1) / cfg.seq
        if cfg.arch == "llama":                  # the causal half the simulator leaves out
            per_token += 6 * cfg.seq * cfg.hidden * cfg.layers
        published = float(r["model_tflops_per_gpu"]) * 1e12 / float(r["tokens_per_s_per_gpu"])
        assert published == pytest.approx(per_token, rel=0.005), r["model"]


def test_the_megatron_bridge_table_is_the_published_one_with_its_architectures():
    """Megatron-Bridge 25.11's DGX-H100 Llama 3 rows: the table's Model TFLOP/s over its
    tokens/s is the model's FLOPs per token (causal attention at half the s² products, as
    Megatron-Bridge counts it); 8B under Megatron FSDP (ZeRO-3 over 8), 70B tp 4 x pp 8
    interleaved 5 with the distributed optimizer."""
    from pipeline_parallel.gpt import model_flops
    from vcluster.planner.validation import FP8_BRIDGE_TABLE, fp8_row_config, validate_fp8
    from vcluster.timing import read_data_csv
    comments, rows = read_data_csv(FP8_BRIDGE_TABLE)
    assert "NVIDIA-NeMo/Megatron-Bridge" in comments[0] and "00b7660be0254ac6" in comments[0]
    assert [(r["model"], r["tokens_per_s_per_gpu"]) for r in rows] == [
        ("LLAMA3_8B", "14451"), ("LLAMA3_70B", "1602")]
    configs = [fp8_row_config(r) for r in rows]
    for r, (cfg, par) in zip(rows, configs):
        published = float(r["model_tflops_per_gpu"]) * 1e12 / float(r["tokens_per_s_per_gpu"])
        assert published == pytest.approx(model_flops(cfg, 1) / cfg.seq, rel=0.002), r["model"]
        assert par.gpus == int(r["gpus"]) and par.microbatches * par.dp * par.micro_batch \
            == int(r["global_batch"])
    (_, p8), (_, p70) = configs
    assert (p8.dp, p8.zero_stage, p8.tp, p8.pp) == (8, 3, 1, 1)
    assert (p70.dp, p70.tp, p70.pp, p70.chunks, p70.zero_stage, p70.sequence_parallel) == \
        (2, 4, 8, 5, 1, True)
    got = validate_fp8(tables=(FP8_BRIDGE_TABLE,))
    assert [g["published"] for g in got] == [14451.0, 1602.0]
    assert all(g["source"] == FP8_BRIDGE_TABLE for g in got)


def _scenario(*overrides):
    """scenarios/transformer_simulate.yaml's GPT at h 4096 (large enough GEMMs to be
    compute-bound) on one preset, not its sweep."""
    from pathlib import Path

    import yaml

    from vcluster.scenario import parse_override, scenario_from_dict
    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "scenarios" / "transformer_simulate.yaml").read_text())
    del doc["sweep"]
    doc["hardware"]["name"] = "h100-dgx"
    doc["workload"].update(hidden=4096, heads=32, seq=2048)
    for text in overrides:
        key, value = parse_override(text)
        *path, last = key.split(".")
        node = doc
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return scenario_from_dict(doc)


def test_the_scenario_key_prices_a_simulation_as_simulate_gpt_fp8():
    """workload.fp8 on a simulate-only transformer scenario prices the linear layers'
    GEMMs with simulate gpt --fp8's predicate: faster than BF16, by less than half."""
    from vcluster.scenario import build_workload, run_scenario
    steps = {}
    for fp8 in (False, True):
        s = _scenario(f"workload.fp8={str(fp8).lower()}")
        w = build_workload(s)
        assert (w.fp8_gemms is fp8_gemm) == fp8
        assert ("FP8 linear layers" in w.description) == fp8
        steps[fp8] = run_scenario(s).summary["predicted_step_time_s"]
    assert 0.5 * steps[False] < steps[True] < 0.97 * steps[False]


@pytest.mark.parametrize("overrides, says", [
    (("run.mode=emulate", "workload.dtype=float64", "workload.hidden=32", "workload.heads=4",
      "workload.seq=16", "parallel.tp=2", "parallel.pp=2", "parallel.dp=1"),
     "allowed: run.mode simulate or both"),
    (("hardware.name=localhost",), "localhost prices this machine's CPU kernels"),
    (("hardware.name=a100-80gb-dgx",), r"A100-SXM4-80GB\) has peaks for")])
def test_the_scenario_key_is_refused_where_it_cannot_apply(overrides, says):
    from vcluster.scenario import ScenarioError
    with pytest.raises(ScenarioError, match=says) as info:
        _scenario("workload.fp8=true", *overrides)
    assert "workload.fp8" in str(info.value)


def test_the_scenario_gemm_format_key():
    """workload.gemm_format: nvfp4 on a B200 prices the linear layers at the FP4 peak
    (faster than its FP8); on an H200 it is refused naming the key and the hardware."""
    from vcluster.scenario import ScenarioError, build_workload, run_scenario
    steps = {}
    for fmt in ("fp8", "nvfp4"):
        s = _scenario("hardware.name=b200-dgx", f"workload.gemm_format={fmt}")
        w = build_workload(s)
        assert w.gemm_format == fmt and f"{fmt.upper()} linear layers" in w.description
        steps[fmt] = run_scenario(s).summary["predicted_step_time_s"]
    assert steps["nvfp4"] < steps["fp8"]
    with pytest.raises(ScenarioError, match="nvfp4 GEMMs need FP4 tensor cores") as info:
        _scenario("workload.gemm_format=nvfp4")
    assert "workload.gemm_format" in str(info.value)
    with pytest.raises(ScenarioError, match="fp8: true is gemm_format: fp8"):
        _scenario("hardware.name=b200-dgx", "workload.fp8=true", "workload.gemm_format=mxfp8")
