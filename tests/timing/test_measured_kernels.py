"""Issue 26: on hardware with measured kernels, the replay prices each traced GEMM from
the device's GEMM profile by its shape (one batched kernel: a fixed cost plus tile-padded
FLOPs at the fitted rate), and everything else as before."""

import dataclasses

import pytest

from mesh import Mesh
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.runtime.tracing import KernelKind, TraceCompute, trace_program
from vcluster.timing.attention_kernels import attention_prices
from vcluster.timing import load_hardware
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import HardwareCostModel, TRAINING_KERNEL_EFFICIENCY
from vcluster.timing.kernel_profile import GemmProfile, KernelTiming

CFG = GPTConfig(hidden=256, layers=1, heads=4, seq=128, vocab=512)
# a profile of two GEMMs: 8 us + FLOPs at 500 TFLOP/s (exactly: both rows lie on it)
PROFILE = GemmProfile(call_s=8e-6, flops_per_s=500e12)
ROWS = [KernelTiming("gemm", PROFILE.time_s(m, k, n), m=m, k=k, n=n, dtype="bf16")
        for m, k, n in ((256, 256, 256), (4096, 4096, 4096))]


def _measured():
    hw = load_hardware("h100-dgx")
    return dataclasses.replace(hw, device=dataclasses.replace(hw.device, kernels=tuple(ROWS)))


def _one_layer_traces():
    mesh = Mesh((1,), ("dp",))
    par = ParallelConfig(global_batch=2)
    return trace_program(mesh, train_program, GPT(CFG).meta_args(mesh, par, 1))


def test_traced_gemms_carry_their_shapes():
    ops = [op for op in _one_layer_traces()[0].ops if isinstance(op, TraceCompute)]
    gemms = [op for op in ops if op.gemm is not None]
    assert len(gemms) >= 8                     # qkv, scores, context, proj, fc1, fc2, logits
    for op in gemms:
        batch, m, k, n = op.gemm
        assert op.flops == 2 * batch * m * k * n
    assert all(op.gemm is None for op in ops if op.flops == 0)


def test_gemms_are_priced_by_the_profile_the_rest_as_before():
    measured = HardwareCostModel(_measured())
    plain = HardwareCostModel(load_hardware("h100-dgx"))
    assert measured.gemm_profile.call_s == pytest.approx(8e-6)
    assert measured.gemm_profile.flops_per_s == pytest.approx(500e12)
    assert plain.gemm_profile is None
    for op in (op for op in _one_layer_traces()[0].ops if isinstance(op, TraceCompute)):
        if op.gemm is not None:
            batch, m, k, n = op.gemm
            assert measured.compute_time_s(op) == pytest.approx(PROFILE.time_s(m, k, n, batch))
        else:
            assert measured.compute_time_s(op) == plain.compute_time_s(op)


def test_a_one_layer_steps_compute_is_the_sum_of_its_kernels():
    """Σ over the traced kernels of their prices = the replay's compute time (one GPU:
    nothing overlaps); GEMMs at the profile's price, fused attention at the device's
    published curves (its measured rows are GEMMs only), the rest at t_k + max(F/rate,
    B/bw) over the training-kernel efficiency."""
    costs = HardwareCostModel(_measured())
    traces = _one_layer_traces()
    expected = sum(costs.compute_time_s(op) for op in traces[0].ops
                   if isinstance(op, TraceCompute))
    device = costs.hardware.device

    curves = attention_prices(device.attention_gpu, device.attention_kernel)

    def price(op):
        if op.kernel is not None and op.kernel.kind is KernelKind.ATTENTION:
            return curves.time_s(op.kernel, device.kernel_overhead_us * 1e-6)
        if op.gemm is None:
            return device.compute_time_s(op.flops, op.bytes, "bf16") / TRAINING_KERNEL_EFFICIENCY
        batch, m, k, n = op.gemm
        return PROFILE.time_s(m, k, n, batch)

    by_hand = sum(price(op) for op in traces[0].ops if isinstance(op, TraceCompute))
    assert expected == pytest.approx(by_hand)
    result = simulate_trace(traces, costs)
    assert result.stats[0].compute_s == pytest.approx(expected)


def test_batched_price_and_its_checks():
    assert PROFILE.time_s(64, 64, 64, batch=8) == pytest.approx(8e-6 + 8 * 2 * 128 * 64 * 128 / 500e12)
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        PROFILE.time_s(64, 64, 64, batch=0)


def test_transfers_between_nodes_queue_at_a_shared_nic():
    """Two ranks of node 1 send to rank 0 (node 0) at once: on the hardware model the
    second transfer waits for the first at rank 0's NIC; within a node they overlap."""
    from vcluster.runtime.tracing import DeviceTrace, TraceRecv, TraceSend
    costs = HardwareCostModel(load_hardware("a100-80gb-dgx"))
    nbytes = 64 << 20

    def step(a, b):
        traces = [DeviceTrace(0, (TraceRecv(a, nbytes, 1), TraceRecv(b, nbytes, 1))),
                  DeviceTrace(a, (TraceSend(0, nbytes, 1),)),
                  DeviceTrace(b, (TraceSend(0, nbytes, 1),))]
        return simulate_trace(traces, costs).step_time_s

    one = costs.p2p_time_s(8, 0, nbytes)
    assert step(8, 9) == pytest.approx(2 * one)                # node 1 -> node 0: queued
    assert step(1, 2) == pytest.approx(costs.p2p_time_s(1, 0, nbytes))   # in node 0: parallel
    assert costs.p2p_ports(8, 0) == (("nic_out", 8), ("nic_in", 0))
    assert costs.p2p_ports(1, 0) == ()
