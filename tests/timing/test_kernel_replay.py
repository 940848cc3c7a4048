"""Issue 26: the replay prices each traced kernel from its kind's profile on hardware that
carries a measured table, at no less than the launch interval; flash attention moves O(s)
bytes, not the s² scores, on every hardware model (the unfused program is priced as
before)."""

import dataclasses

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.optim import OptimizerConfig
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import KernelKind, TraceCompute, trace_program
from vcluster.timing import load_hardware
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import TRAINING_KERNEL_EFFICIENCY, HardwareCostModel
from vcluster.timing.kernel_profile import TILE
from vcluster.timing.kernel_profiles import LAUNCH_INTERVAL_S
from vcluster.timing.attention_kernels import attention_prices

CFG = GPTConfig(hidden=256, layers=1, heads=4, seq=128, vocab=512, dtype="float16")


def _profiled(name="h100-dgx"):
    hw = load_hardware(name)
    return dataclasses.replace(hw, device=dataclasses.replace(
        hw.device, kernel_table="h100_kernels.csv"))


def _one_layer(attention="flash"):
    mesh = Mesh((1,), ("dp",))
    par = ParallelConfig(global_batch=2, micro_batch=2, attention=attention)
    args = GPT(CFG).meta_args(mesh, par, 1, optimizer=OptimizerConfig("adam"))
    return trace_program(mesh, train_program, args)


def _by_hand(op, costs):
    """The documented price of one traced op, from the profiles' constants."""
    k, prof, dev = op.kernel, costs.kernel_profile, costs.hardware.device
    analytic = dev.compute_time_s(op.flops, op.bytes, "bf16") / TRAINING_KERNEL_EFFICIENCY
    if k is None:
        return analytic
    d = k.dims()
    p = prof.kinds
    if k.kind is KernelKind.GEMM:
        pad = lambda x: -(-x // TILE) * TILE                            # noqa: E731
        t = prof.gemm.call_s + d["batch"] * 2 * pad(d["m"]) * d["k"] * pad(d["n"]) \
            / prof.gemm.flops_per_s
    elif k.kind is KernelKind.ATTENTION:
        flops = 2 * d["batch_heads"] * d["s_q"] * d["s_kv"] * d["head_dim"]   # causal
        name = "attention_backward" if k.backward else "attention"
        t = p[name].call_s + (2.5 if k.backward else 1.0) * flops * p[name].unit_s
    elif k.kind is KernelKind.NORM:
        name = "norm_backward" if k.backward else "norm"
        t = p[name].call_s + d["tokens"] * d["width"] * p[name].unit_s
    elif k.kind is KernelKind.ACTIVATION and not k.backward:
        t = p["activation"].call_s + d["tokens"] * d["width"] * p["activation"].unit_s
    elif k.kind is KernelKind.ELEMENTWISE:
        t = p["elementwise"].call_s + d["elements"] * p["elementwise"].unit_s
    elif k.kind is KernelKind.CROSS_ENTROPY:
        t = p["cross_entropy"].call_s + d["tokens"] * d["vocab"] / 3 * p["cross_entropy"].unit_s
    elif k.kind is KernelKind.OPTIMIZER:
        t = p["optimizer"].call_s + d["params"] * p["optimizer"].unit_s
    else:                                      # no rows: the analytic model
        t = analytic
    return max(t, LAUNCH_INTERVAL_S)


def test_a_one_layer_steps_compute_is_the_sum_of_its_kernels_at_their_profile_prices():
    """One GPU, nothing overlaps: the replay's compute time = Σ max(profile price, launch
    interval) over the step's kernels (the analytic price where a kind has no rows)."""
    costs = HardwareCostModel(_profiled())
    traces = _one_layer()
    kernels = [op for op in traces[0].ops if isinstance(op, TraceCompute) and op.kernel]
    kinds = {op.kernel.kind for op in kernels}
    assert kinds == set(KernelKind) - {KernelKind.DROPOUT}     # the GPT program has none
    by_hand = sum(_by_hand(op, costs) for op in kernels)
    assert all(op.flops == 0 and op.bytes == 0 for op in traces[0].ops
               if isinstance(op, TraceCompute) and op.kernel is None)  # markers: free
    result = simulate_trace(traces, costs)
    assert result.stats[0].compute_s == pytest.approx(by_hand, rel=1e-12)
    # the small kernels sit on the launch floor; the step is slower than its kernels alone
    floored = [op for op in kernels if costs.compute_time_s(op) == LAUNCH_INTERVAL_S]
    assert len(floored) >= 10
    plain = HardwareCostModel(load_hardware("h100-dgx"))
    assert costs.compute_time_s(kernels[0]) != plain.compute_time_s(kernels[0])


def test_without_a_table_the_prices_are_the_analytic_ones():
    """No measured kernels: every op at its analytic price but fused attention, which the
    device's published curves price (vcluster.timing.attention_kernels)."""
    plain = HardwareCostModel(load_hardware("h100-dgx"))
    assert plain.kernel_profile is None and plain.gemm_profile is None
    device = plain.hardware.device
    curves = attention_prices(device.attention_gpu, device.attention_kernel)
    attention = 0
    for op in _one_layer()[0].ops:
        if isinstance(op, TraceCompute) and op.kernel is not None \
                and op.kernel.kind is KernelKind.ATTENTION:
            attention += 1
            assert plain.compute_time_s(op) == curves.time_s(
                op.kernel, device.kernel_overhead_us * 1e-6)
        elif isinstance(op, TraceCompute):
            assert plain.compute_time_s(op) == plain.analytic_time_s(op)
    assert attention >= 2


LONG = GPTConfig(hidden=512, layers=2, heads=8, seq=8192, vocab=1024)


@pytest.mark.parametrize("hardware", ["h100-dgx", "profiled"])
def test_a_long_sequence_step_with_flash_is_cheaper_than_unfused(hardware):
    hw = _profiled() if hardware == "profiled" else load_hardware(hardware)
    flash = simulate_gpt(LONG, ParallelConfig(global_batch=1, attention="flash"), hw)
    unfused = simulate_gpt(LONG, ParallelConfig(global_batch=1, attention="unfused"), hw)
    assert flash.step_time_s < 0.8 * unfused.step_time_s
    assert flash.tflops_per_gpu > unfused.tflops_per_gpu


def test_unfused_attention_still_moves_its_scores_and_is_priced_as_before():
    """The unfused program's softmax passes touch the s² scores (2 bytes each, read and
    written), priced by the analytic model as before issue 26."""
    mesh = Mesh((1,), ("dp",))
    par = ParallelConfig(global_batch=1, attention="unfused")
    ops = [op for op in trace_program(mesh, train_program, GPT(dataclasses.replace(
        LONG, dtype="float16", layers=1)).meta_args(mesh, par))[0].ops
        if isinstance(op, TraceCompute)]
    n, s = LONG.heads, LONG.seq
    softmax = [op for op in ops if op.name == "gpt: attention: causal softmax"]
    assert [op.bytes for op in softmax] == [2 * n * s * s * np.dtype("float16").itemsize]
    grad = [op for op in ops if op.name == "gpt: attention: softmax grad"]
    assert [op.bytes for op in grad] == [3 * n * s * s * 2]
    plain = HardwareCostModel(load_hardware("h100-dgx"))
    dev = plain.hardware.device
    for op in softmax + grad:
        assert plain.compute_time_s(op) == dev.compute_time_s(0, op.bytes, "bf16") \
            / TRAINING_KERNEL_EFFICIENCY


def test_a_hardware_file_opts_in_to_the_shipped_table_and_a_wrong_name_is_refused():
    hw = load_hardware({"base": "h100-dgx", "device": {"kernel_table": "h100_kernels.csv"}})
    costs = HardwareCostModel(hw)
    assert costs.kernel_profile.launch_s == LAUNCH_INTERVAL_S
    assert costs.gemm_profile.call_s == pytest.approx(5.30e-6)
    with pytest.raises(ValueError, match="'h100.csv' is not a shipped table of measured "
                                         "kernels; known: h100_kernels.csv"):
        load_hardware({"base": "h100-dgx", "device": {"kernel_table": "h100.csv"}})
