"""The kernels plain PyTorch runs under bf16 autocast that the traced GPT program does not.

The traced GPT program (:mod:`pipeline_parallel.gpt`) declares Megatron's kernels on
16-bit tensors. The reference step that ``vcluster bench gpu-step`` measures
(:mod:`vcluster.gpu.gpt_step`: an fp32 model under ``torch.autocast(dtype=bfloat16)``,
the ``torch_amp`` precision policy) runs the same GEMMs, attention, GELU and loss, and
kernels of its own besides. :func:`with_autocast_kernels` rewrites a traced op list into
that step's kernel list. Per layer and micro-batch, with T tokens, width h and each
linear's weight k × n (sizes in the ``elementwise`` kernel's unit: elements of 16-bit
traffic, bytes / 2, as :class:`~vcluster.runtime.tracing.Kernel` counts them):

====================================================  =====================================
eager PyTorch under autocast                          the rewrite
====================================================  =====================================
each linear casts its fp32 weight (and bias) to bf16  + a cast before every forward GEMM of
in the forward: read 4 B, write 2 B an element        a linear: 3·k·n, and 3·n with a bias
the bf16 weight (bias) gradient is cast to fp32:      + a cast after every weight-gradient
read 2 B, write 4 B an element                        GEMM: 3·k·n, and 3·n after its bias
                                                      gradient
LayerNorm runs in fp32 (its input is the fp32         a norm of width 2h (twice the bytes),
residual stream): 4 B in, 4 B out an element          forward and backward
a LayerNorm's fp32 output is cast to bf16 for the     + a cast after ``ln1``, ``ln2`` and
linear it feeds (qkv, fc1, head); backward, that      ``final ln``: 3·T·h; + a cast after
linear's bf16 input gradient is cast back to fp32     the input-gradient GEMMs of qkv, fc1
                                                      and the head: 3·T·h
the fp32 gradient entering a bf16 residual branch     + a cast before the input-gradient
(attention's output projection, fc2) is cast to bf16  GEMMs of W_o and W2: 3·T·h
residual adds are fp32 + bf16 → fp32: 10 B an         the residual add at 5/3 of its 16-bit
element; the residual gradients add in fp32 (12 B)    size; + an add of 6·T·h after each
in their own kernel                                   LayerNorm backward that takes one
the embedding's position add is fp32                  twice its 16-bit size
dq, dk, dv are stacked into one tensor (``stack``:    the merge at 3/2 of its size (the
read and write 3·T·h in bf16)                         trace's is 4·T·h)
cuBLAS adds each bias in the GEMM's epilogue          the bias adds left out
(``addmm``); the head split and merge are views;
LayerNorm's backward computes its parameter           the heads' split/merge copies and the
gradients itself                                      LayerNorms' parameter-gradient blocks
                                                      left out
====================================================  =====================================

The casts' count and bytes equal, op for op, those a ``TorchDispatchMode`` records for the
reference step on the CPU (``tests/planner/test_autocast_kernels.py``, several shapes);
the CUDA kernel list of the same step, profiled on one H100, holds the same 291 casts to
bf16 and 243 to fp32 for 24 layers (``benchmarks/results/h100-2026-11-26/profile.json``:
12 and 10 a layer, and 3 for the head, its input and the logits). A recomputed forward
(``recompute``) casts its weights again, as ``torch.utils.checkpoint`` does. Ops named
otherwise — the Llama and MoE programs, which the ``torch_amp`` policy refuses — pass
through unchanged.

Where it applies (:func:`~vcluster.planner.simulation.simulate_gpt`): under the
``torch_amp`` policy, on hardware whose kernels are priced from measurements (a kernel
table or a ``hardware calibrate --gpu`` file); under ``torch_compile`` too, the list then
fused as Inductor fuses it (:mod:`.inductor_kernels`). The analytic presets divide every kernel by
``TRAINING_KERNEL_EFFICIENCY``, a constant that stands for the work a trace does not
itemise, eager PyTorch's casts among it: itemising them there as well would count them
twice.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from vcluster.runtime.tracing import Kernel, KernelKind, TraceCompute

__all__ = ["with_autocast_kernels", "autocast_kernels_priced", "AUTOCAST_CAST"]

#: the inserted casts' names end ``autocast: cast <what>``, after the name of the block
#: they serve ("gpt: attention: autocast: cast weight"), whose kind reports count them in
AUTOCAST_CAST = "autocast: cast"

# the traced op names the rewrite keys on: the last ": "-separated part of a
# TraceCompute's name (its prefixes name the module: "gpt: attention: x @ W_qkv"); a tied
# head (GPTConfig.tie_embeddings) multiplies by E^T and casts as the untied one does: its
# weight once forward (h·V elements), its input gradient (T·h), its weight gradient (V·h)
#: a linear's forward GEMM -> whether the linear has a bias
_LINEAR_FORWARD = MappingProxyType({"x @ W_qkv": True, "ctx @ W_o": True, "x @ W1": True,
                                    "a @ W2": True, "logits = x W_out": False,
                                    "logits = x E^T (tied)": False})
#: a weight-gradient GEMM -> whether its linear has a bias (its gradient cast follows)
_WEIGHT_GRAD = MappingProxyType({"dW_qkv = x^T dqkv": True, "dW_o = ctx^T dy": True,
                                 "dW1 = u^T dh": True, "dW2 = a^T dy": True,
                                 "dW_out = x^T dlogits": False,
                                 "dE += dlogits^T x (tied)": False})
#: the LayerNorms whose fp32 output a linear casts to bf16
_NORM_FEEDS_LINEAR = frozenset({"ln1", "ln2", "final ln"})
#: input-gradient GEMMs of the linears a LayerNorm feeds: their bf16 result is cast to fp32
_INPUT_GRAD_TO_FP32 = frozenset({"dx = dqkv W_qkv^T", "du = dh W1^T", "dx = dlogits W_out^T",
                                 "dx = dlogits E (tied)"})
#: input-gradient GEMMs of the residual branches' last linears: their fp32 input is cast
_INPUT_GRAD_FROM_FP32 = frozenset({"dctx = dy W_o^T", "da = dy W2^T"})
#: traced blocks eager PyTorch does not run as kernels of their own
_NOT_RUN = frozenset({"+ b_qkv", "+ b_o", "h = x W1 + b1", "+ b2", "y + b2", "split heads",
                      "merge heads", "ln1 params grad", "ln2 params grad", "final ln grads"})
#: traced elementwise blocks whose 16-bit traffic eager PyTorch scales by (num, den)
_RESIZED = MappingProxyType({"residual": (5, 3), "merge dq, dk, dv": (3, 2),
                             "+ positions": (2, 1)})


def _cast(block: str, what: str, elements16: int) -> TraceCompute:
    """A cast kernel of ``block`` moving ``elements16`` elements of 16-bit traffic (2 bytes
    each)."""
    return TraceCompute(f"{block}: {AUTOCAST_CAST} {what}", 0.0, 2 * elements16,
                        kernel=Kernel.elementwise(elements16))


def _resized(op: TraceCompute, num: int, den: int) -> TraceCompute:
    (elements,) = op.kernel.shape
    return dataclasses.replace(op, bytes=op.bytes * num // den,
                               kernel=Kernel.elementwise(elements * num // den))


def with_autocast_kernels(ops) -> tuple:
    """``ops`` (a traced op list of the GPT program) as plain PyTorch under bf16 autocast
    runs it: the module docstring's table, op by op. Ops other than the program's named
    compute blocks (communication, waits, blocks that hold others) pass unchanged."""
    out = []
    for op in ops:
        k = op.kernel if isinstance(op, TraceCompute) and not op.contains else None
        if k is None:
            out.append(op)
            continue
        block, _, name = op.name.rpartition(": ")
        if name in _NOT_RUN:
            continue
        if k.kind is KernelKind.NORM:
            tokens, width = k.shape
            fp32 = dataclasses.replace(k, shape=(tokens, 2 * width))
            out.append(dataclasses.replace(op, bytes=2 * op.bytes, kernel=fp32))
            if not k.backward and name in _NORM_FEEDS_LINEAR:
                out.append(_cast(op.name, "input", 3 * tokens * width))
            elif k.backward and name.endswith("+ residual"):
                out.append(TraceCompute(f"{op.name}: residual gradient add (fp32)", 0.0,
                                        12 * tokens * width,
                                        kernel=Kernel.elementwise(6 * tokens * width)))
        elif k.kind is KernelKind.GEMM:
            _, m, kk, n = k.shape
            if name in _LINEAR_FORWARD:
                out.append(_cast(block, "weight", 3 * kk * n))
                if _LINEAR_FORWARD[name]:
                    out.append(_cast(block, "bias", 3 * n))
                out.append(op)
            elif name in _INPUT_GRAD_FROM_FP32:
                out += [_cast(block, "gradient", 3 * m * kk), op]
            elif name in _INPUT_GRAD_TO_FP32:
                out += [op, _cast(block, "input gradient", 3 * m * n)]
            elif name in _WEIGHT_GRAD:
                out += [op, _cast(block, "weight gradient", 3 * m * n)]
                if _WEIGHT_GRAD[name]:
                    out.append(_cast(block, "bias gradient", 3 * n))
            else:
                out.append(op)
        elif k.kind is KernelKind.ELEMENTWISE and name in _RESIZED:
            out.append(_resized(op, *_RESIZED[name]))
        else:
            out.append(op)
    return tuple(out)


def autocast_kernels_priced(policy, costs) -> bool:
    """Whether a step under precision ``policy`` (a
    :class:`~vcluster.planner.precision.PrecisionPolicy`) priced by ``costs`` (a
    :class:`~vcluster.timing.hardware_model.HardwareCostModel`) runs these kernels by
    default: when the policy's step runs them (``torch_amp``, ``torch_compile``) and the
    hardware prices kernels from measurements (module docstring: why not on the analytic
    presets)."""
    return policy.autocast_kernels and costs.kernel_profile is not None
