"""Issue 26: the tracer records each compute op's kind and shape (a Kernel), set where the
GPT and Llama programs issue it — GEMMs, flash or unfused attention, norms, activations,
elementwise work, the cross-entropy and the optimizer step — checked against the model's
own dimensions."""

import math

import pytest

from mesh import Mesh
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.optim import OptimizerConfig
from vcluster.runtime.tracing import Kernel, KernelKind, TraceCompute, trace_program

CFG = GPTConfig(hidden=256, layers=1, heads=4, seq=128, vocab=512)
LLAMA = GPTConfig(hidden=256, layers=1, heads=4, seq=128, vocab=512, arch="llama", kv_heads=2)
B = 2


def _ops(cfg, attention="flash", optimizer="adam"):
    mesh = Mesh((1,), ("dp",))
    par = ParallelConfig(global_batch=B, micro_batch=B, attention=attention)
    args = GPT(cfg).meta_args(mesh, par, 1, optimizer=OptimizerConfig(optimizer))
    return [op for op in trace_program(mesh, train_program, args)[0].ops
            if isinstance(op, TraceCompute)]


def _kinds(ops, kind):
    return [op.kernel for op in ops if op.kernel is not None and op.kernel.kind is kind]


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
def test_every_op_with_work_is_a_kernel_of_a_known_kind(cfg):
    ops = _ops(cfg)
    for op in ops:
        if op.flops or op.bytes:
            assert op.kernel is not None, op.name
    tokens, h, d = B * cfg.seq, cfg.hidden, cfg.head_dim
    # flash attention: one fused kernel forward, one backward, of the layer's heads
    att = _kinds(ops, KernelKind.ATTENTION)
    assert att == [Kernel.attention(B * cfg.heads, cfg.seq, cfg.seq, d),
                   Kernel.attention(B * cfg.heads, cfg.seq, cfg.seq, d, backward=True)]
    norms = _kinds(ops, KernelKind.NORM)      # two per layer and the final one, fwd and bwd
    assert sorted(norms, key=repr) == sorted([Kernel.norm(tokens, h)] * 3
                                             + [Kernel.norm(tokens, h, True)] * 3, key=repr)
    act = _kinds(ops, KernelKind.ACTIVATION)
    width = 4 * h if cfg.arch == "gpt" else cfg.ffn_hidden
    assert [(k.shape, k.backward) for k in act] == [((tokens, width), False),
                                                    ((tokens, width), True)]
    assert _kinds(ops, KernelKind.CROSS_ENTROPY) == [Kernel.cross_entropy(tokens, cfg.vocab, 3)] * 3
    params = sum(math.prod(shape) for shape in GPT(cfg).param_shapes().values())
    assert _kinds(ops, KernelKind.OPTIMIZER) == [Kernel.optimizer(params, "adam")]
    for op in ops:
        if op.kernel is not None and op.kernel.kind is KernelKind.GEMM:
            batch, m, k, n = op.gemm
            assert op.flops in (2 * batch * m * k * n, batch * m * k * n)   # causal: half


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
def test_flash_and_unfused_trace_the_same_flops_flash_moves_no_scores(cfg):
    flash, unfused = _ops(cfg, "flash"), _ops(cfg, "unfused")
    assert sum(op.flops for op in flash) == sum(op.flops for op in unfused)
    assert not _kinds(unfused, KernelKind.ATTENTION)
    s2 = B * cfg.heads * cfg.seq * cfg.seq        # one s×s score matrix per head
    assert sum(op.bytes for op in unfused) - sum(op.bytes for op in flash) > 4 * s2
    scores = [op for op in flash if "softmax" in op.name or "q @ k^T" in op.name]
    assert not scores


def test_kernel_values_are_checked_and_print_their_shape():
    assert repr(Kernel.attention(64, 2048, 2048, 128, backward=True)) == \
        "Kernel(attention 64x2048x2048x128 causal flash bwd)"
    assert repr(Kernel.optimizer(10, "adam")) == "Kernel(optimizer 10 adam)"
    with pytest.raises(ValueError, match=r"a norm kernel's shape is \(tokens, width\)"):
        Kernel("norm", (1, 2, 3))
    with pytest.raises(ValueError, match="kind must be one of gemm, attention"):
        Kernel("conv", (1,))
    with pytest.raises(ValueError, match="elements must be an int >= 0, got -1"):
        Kernel.elementwise(-1)
