"""The optimizer step's HBM traffic follows the precision policy the step runs in: the
gradient read, the optimizer state (master copy and Adam's m, v) read and written, the
weights written (and read when they are the master copy) — not the 7 × 2 bytes a traced
16-bit program counts."""

import numpy as np
import pytest

from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.optim import Optimizer, OptimizerConfig
from vcluster.planner import simulate_gpt
from vcluster.planner.precision import PRECISIONS, PrecisionPolicy, precision_policy
from vcluster.planner.simulation import gpt_step_traces, with_optimizer_step_bytes
from vcluster.runtime.tracing import KernelKind, TraceCompute
from vcluster.runtime.tracing.kernel import Kernel
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

CFG = GPTConfig(hidden=64, layers=4, heads=4, seq=16, vocab=64)


@pytest.mark.parametrize("name, expected", [
    ("megatron", 4 + 2 * 12 + 2),        # fp32 main grad; master, m, v; bf16 copy written
    ("megatron_bf16", 2 + 2 * 12 + 2),
    ("torch_amp", 4 + 2 * 8 + 2 * 4),    # fused AdamW: p, g, m, v read; p, m, v written
    ("torch_compile", 4 + 2 * 8 + 2 * 4),
    ("fp64", 7 * 8), ("fp32", 7 * 4)])
def test_bytes_per_parameter_by_policy(name, expected):
    assert precision_policy(name).optimizer_step_bytes == expected


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_emulated_policies_count_what_the_emulator_touches(optimizer):
    """For the emulated program the formula gives the emulator's own count: its optimizer
    touches 7 (Adam) or 5 (SGD) bytes per byte of parameters."""
    params = [np.zeros((3, 5))]
    touched = Optimizer(OptimizerConfig(optimizer), params).bytes_touched_per_param_byte
    assert PrecisionPolicy.emulated("float64", optimizer).optimizer_step_bytes == touched * 8


def test_the_traced_step_counts_fourteen_and_the_policy_replaces_it():
    """The 16-bit trace's Adam step moves 14 bytes per parameter; with a policy's bytes the
    same op moves params × those, for the whole stage and for a ZeRO shard alike."""
    costs = HardwareCostModel(load_hardware("h100-dgx"))
    n_params = sum(int(np.prod(s)) for s in GPT(CFG).param_shapes().values())

    def optimizer_ops(par, b):
        (trace,) = gpt_step_traces(CFG, par, costs, optimizer_step_bytes=b)
        return [op for op in trace.ops if isinstance(op, TraceCompute) and op.kernel
                is not None and op.kernel.kind is KernelKind.OPTIMIZER]

    (own,) = optimizer_ops(ParallelConfig(global_batch=4), None)
    assert own.kernel.shape == (n_params,) and own.bytes == 14 * n_params
    (trace,) = gpt_step_traces(CFG, ParallelConfig(global_batch=4), costs)   # the default:
    assert [op.bytes for op in trace.ops if isinstance(op, TraceCompute) and op.kernel  # as
            is not None and op.kernel.kind is KernelKind.OPTIMIZER] == [30 * n_params]  # simulate_gpt
    (amp,) = optimizer_ops(ParallelConfig(global_batch=4), 28)
    assert amp.bytes == 28 * n_params and amp.flops == own.flops
    (shard,) = optimizer_ops(ParallelConfig(global_batch=8, dp=4, zero_stage=1), 30)
    assert shard.kernel.shape == (n_params // 4,) and shard.bytes == 30 * (n_params // 4)


def test_the_rewrite_leaves_every_other_op_alone():
    ops = [TraceCompute("gemm", 2e9, 10, kernel=Kernel.gemm(1, 8, 8, 8)),
           TraceCompute("optimizer", 0, 14 * 100, kernel=Kernel.optimizer(100, "adam")),
           TraceCompute("plain", 0, 7)]
    out = with_optimizer_step_bytes(ops, 30.0)
    assert out[0] is ops[0] and out[2] is ops[2]
    assert out[1].bytes == 3000 and out[1].kernel == ops[1].kernel


def test_simulated_optimizer_time_is_the_policy_traffic_over_hbm():
    """One GPU, analytic H100: the step's optimizer time is the kernel's price at the
    policy's bytes, (t_k + P·b / (HBM · efficiency)) / TRAINING_KERNEL_EFFICIENCY — so
    Megatron's 30 bytes cost 30/28 of PyTorch AMP's 28 on a model large enough that the
    launch is noise."""
    cfg = GPTConfig(hidden=1024, layers=4, heads=16, seq=256, vocab=1024)
    par = ParallelConfig(global_batch=1)
    costs = HardwareCostModel(load_hardware("h100-dgx"))
    n_params = sum(int(np.prod(s)) for s in GPT(cfg).param_shapes().values())
    times = {}
    for name in ("megatron", "torch_amp"):
        sim = simulate_gpt(cfg, par, "h100-dgx", precision=name)
        (opt,) = [o.compute_s for o in sim.ops if o.op == "optimizer"]
        b = PRECISIONS[name].optimizer_step_bytes
        expected = costs.compute_time_s(TraceCompute(
            "optimizer", 0, int(n_params * b), kernel=Kernel.optimizer(n_params, "adam")))
        assert opt == pytest.approx(expected, rel=1e-9)
        times[name] = opt
    assert times["megatron"] / times["torch_amp"] == pytest.approx(30 / 28, rel=0.01)


def test_master_weights_must_be_a_bool():
    with pytest.raises(ValueError, match="master_weights must be a bool, got 1"):
        PrecisionPolicy("x", 2, 4, 12, 2, 4, master_weights=1)
