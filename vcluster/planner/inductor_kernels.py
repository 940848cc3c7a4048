"""The kernels of the reference PyTorch step under ``torch.compile``: Inductor's fusions of
plain PyTorch's autocast kernels.

:func:`~.autocast_kernels.with_autocast_kernels` gives the kernel list of the eager
reference step (:mod:`vcluster.gpu.gpt_step`, ``torch_amp``). Under ``torch.compile``
(``vcluster bench gpu-step --compile``, the ``torch_compile`` precision policy) the
GEMMs and attention stay library kernels (cuBLAS, SDPA), and Inductor fuses the
memory-bound work between them: a pointwise op feeding a reduction is computed inside it
(its input is read, never written), and a pointwise op consuming a reduction's output
becomes that kernel's epilogue. :func:`with_inductor_fusion` rewrites the eager list so,
per layer and micro-batch (T tokens, width h; bytes per element of T·h):

=====================================================  ====================================
eager (:mod:`.autocast_kernels`)                       under ``torch.compile``
=====================================================  ====================================
fp32 residual add (10 B), fp32 LayerNorm (reads 4,     one LayerNorm kernel: reads the
writes 4), cast of its output to bf16 (6)              fp32 stream and the bf16 branch
                                                       (6), writes the new fp32 stream and
                                                       the bf16 output (6): 12 B, not 24
the first LayerNorm: the fp32 position add (12 B)      the same, reading the token and
before it                                              position rows (8), writing the
                                                       stream and the output (6): 14 B,
                                                       not 26
cast of the bf16 input gradient to fp32 (6), fp32      a LayerNorm backward whose input-
LayerNorm backward: its input-gradient kernel (reads   gradient kernel reads the bf16
8, writes 4) and its parameter-gradient kernel         gradient, the fp32 input and the
(reads 8), fp32 residual-gradient add (12), cast of    residual gradient (10) and writes
the sum to bf16 for the branch below (6)               the fp32 sum and its bf16 cast (6),
                                                       and whose parameter-gradient kernel
                                                       reads the bf16 gradient and the
                                                       input (6): 22 B, not 44
the loss: fp32 upcast of the logits, log-softmax,      one reduction reading the bf16
its gradient, the cast back (the ``cross_entropy``     logits (2 B a logit), one pointwise
profile's measured eager kernels)                      kernel writing their bf16 gradient
                                                       from them and the row statistics
                                                       (4 B a logit)
a bias gradient's reduction and its cast to fp32       one reduction (the cast its
                                                       epilogue)
=====================================================  ====================================

A fused LayerNorm is priced by the ``norm`` (``norm_backward``) profile at the width that
moves its bytes — the fp32 LayerNorm of the eager list is that profile at width 2h (8 B an
element forward, 20 backward: the profile's rows time both backward kernels), so a fused
one moving B bytes an element is width 2h·B/8 (2h·B/20) — and the loss's two kernels by
the ``elementwise`` profile at their bytes. Everything else is unchanged: the weight and
bias casts (their consumers are library GEMMs, which Inductor does not fuse into), the
weight-gradient casts, GELU and its gradient (their inputs are GEMM outputs), attention's
dq/dk/dv concatenation, the optimizer (outside the compiled model).

How these were checked. On the CPU, Inductor's own scheduler (the C++ backend) for the
compiled reference step writes the logits and their gradient only in bf16 (no fp32 copy
of either: ``tests/planner/test_inductor_kernels.py``), fuses each LayerNorm's output cast
into it, runs the position add, the residual adds (all but one: from two layers on it
writes one residual sum in a kernel of its own) and every residual-gradient add inside
the LayerNorms' kernels, and leaves the weight, bias and weight-gradient casts as kernels
of their own, one per tensor, as this rewrite does. It also leaves the cast of the
gradient entering a residual branch as a kernel of its own, where this rewrite fuses it
into the LayerNorm backward, as Inductor's GPU (Triton) backend can: there the LayerNorm
backward is a persistent reduction that stores several outputs. That step, and the fused
kernels' prices, were not checked on a GPU (no profile of a compiled step was taken); the
measured compiled steps of ``validate-model``'s tables are the only check, and they were
seen before this was written.
"""

from __future__ import annotations

import dataclasses

from vcluster.runtime.tracing import Kernel, KernelKind, TraceCompute

from .autocast_kernels import AUTOCAST_CAST, with_autocast_kernels

__all__ = ["with_inductor_fusion", "pytorch_kernels"]

# bytes per element of T·h that the eager fp32 LayerNorm moves (module docstring): forward
# reads x and writes y; backward, its input-gradient kernel reads dy and x and writes dx
# (12), its parameter-gradient kernel reads dy and x again (8)
_NORM_FORWARD_BYTES = 8
_NORM_BACKWARD_BYTES = 20
# what fusing a neighbour adds to (or takes from) a LayerNorm's bytes per element
_FUSED_RESIDUAL = 6         # reads the bf16 branch (2), writes the fp32 stream (4)
_FUSED_POSITION_ADD = 8     # reads the fp32 position rows (4), writes the fp32 stream (4)
_FUSED_OUTPUT_CAST = -2     # writes its output in bf16 (2), not fp32 (4)
_FUSED_INPUT_GRAD_CAST = -4   # both kernels read the bf16 gradient, not its fp32 cast
_FUSED_RESIDUAL_GRAD = 4    # reads the fp32 residual gradient
_FUSED_BRANCH_GRAD_CAST = 2   # writes the sum's bf16 cast too
# the neighbours a LayerNorm takes in: (name suffix, bytes per element added), in order
_FORWARD_BEFORE = ((": residual", _FUSED_RESIDUAL), (": + positions", _FUSED_POSITION_ADD))
_BACKWARD_BEFORE = ((f"{AUTOCAST_CAST} input gradient", _FUSED_INPUT_GRAD_CAST),)
_BACKWARD_AFTER = (("residual gradient add (fp32)", _FUSED_RESIDUAL_GRAD),
                   (f"{AUTOCAST_CAST} gradient", _FUSED_BRANCH_GRAD_CAST))
# the fused loss: bytes per logit read and written (module docstring)
_LOSS_FORWARD_BYTES = 2
_LOSS_BACKWARD_BYTES = 4


def _compute(op) -> bool:
    return isinstance(op, TraceCompute) and not op.contains and op.kernel is not None


def _named(op, suffix: str) -> bool:
    return _compute(op) and op.name.endswith(suffix)


def _norm(op: TraceCompute, fused_bytes: int, eager_bytes: int) -> TraceCompute:
    """``op`` (an fp32 LayerNorm of the eager list) widened to move ``fused_bytes`` per
    element where it moved ``eager_bytes``."""
    tokens, width = op.kernel.shape
    wide = max(1, round(width * fused_bytes / eager_bytes))
    return dataclasses.replace(op, bytes=op.bytes * fused_bytes // eager_bytes,
                               kernel=dataclasses.replace(op.kernel, shape=(tokens, wide)))


def _loss(op: TraceCompute, what: str, bytes_per_logit: int) -> TraceCompute:
    tokens, vocab = op.kernel.shape          # the logits (``parts``: the eager passes)
    logits = tokens * vocab
    block = op.name.rpartition(": ")[0]
    return TraceCompute(f"{block}: compiled: {what}", 0.0, bytes_per_logit * logits,
                        kernel=Kernel.elementwise(bytes_per_logit * logits // 2))


def _absorb_before(out: list, fusible) -> int:
    """Pop the op before (``out[-1]``) when its name ends with one of ``fusible``'s
    suffixes — (suffix, bytes per element it adds) pairs, the first match taken — and
    return the bytes it adds (0: nothing absorbed)."""
    for suffix, moved in fusible:
        if out and _named(out[-1], suffix):
            out.pop()
            return moved
    return 0


def _absorb_after(ops: list, i: int, fusible) -> tuple[int, int]:
    """Take the ops from ``ops[i]`` on that end with ``fusible``'s suffixes, in that order,
    each optional: (the index after them, the bytes per element they add)."""
    added = 0
    for suffix, moved in fusible:
        if i < len(ops) and _named(ops[i], suffix):
            i += 1
            added += moved
    return i, added


def with_inductor_fusion(ops) -> tuple:
    """``ops`` — a kernel list of :func:`~.autocast_kernels.with_autocast_kernels` — as
    ``torch.compile`` runs it: the module docstring's table, op by op. Ops it does not
    name pass unchanged."""
    ops, out, i = list(ops), [], 0
    while i < len(ops):
        op = ops[i]
        k = op.kernel if _compute(op) else None
        i += 1
        if k is None:
            out.append(op)
        elif k.kind is KernelKind.NORM and not k.backward:
            moved = _NORM_FORWARD_BYTES + _absorb_before(out, _FORWARD_BEFORE)
            i, cast = _absorb_after(ops, i, ((f"{op.name}: {AUTOCAST_CAST} input",
                                              _FUSED_OUTPUT_CAST),))
            out.append(_norm(op, moved + cast, _NORM_FORWARD_BYTES))
        elif k.kind is KernelKind.NORM:
            moved = _NORM_BACKWARD_BYTES + _absorb_before(out, _BACKWARD_BEFORE)
            i, after = _absorb_after(ops, i, _BACKWARD_AFTER)
            out.append(_norm(op, moved + after, _NORM_BACKWARD_BYTES))
        elif k.kind is KernelKind.CROSS_ENTROPY:
            name = op.name.rpartition(": ")[2]
            if name == "sum exp, target logit":
                out.append(_loss(op, "loss forward (max, log-sum-exp, target logit)",
                                 _LOSS_FORWARD_BYTES))
            elif name == "loss, dlogits":
                out.append(_loss(op, "loss backward (bf16 dlogits)", _LOSS_BACKWARD_BYTES))
            elif name != "row max":            # the forward reduction computes it
                out.append(op)
        elif not op.name.endswith(f"{AUTOCAST_CAST} bias gradient"):
            out.append(op)
    return tuple(out)


def pytorch_kernels(ops, compiled: bool = False) -> tuple:
    """The kernel list of the reference PyTorch step for the traced ``ops``: eager under
    autocast, or (``compiled``) under ``torch.compile``."""
    ops = with_autocast_kernels(ops)
    return with_inductor_fusion(ops) if compiled else ops
