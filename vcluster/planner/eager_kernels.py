"""The unfused kernels eager PyTorch runs for a Llama layer's memory-bound work.

The traced Llama program (:mod:`tensor_parallel.llama`) declares its RMSNorms, rotary
embeddings and SwiGLU as one fused kernel each, as Transformer Engine, Megatron's fused
kernels and ``torch.compile`` run them, and attends with the grouped K/V heads in place.
Eager PyTorch — torchtitan's Llama 3 without ``torch.compile``, its parameters in bf16
under FSDP2's mixed precision — runs each elementwise op of those functions as a kernel
of its own, every one reading and writing HBM. :func:`with_eager_kernels` adds, after
each fused op of the traced list, the bytes and kernels eager PyTorch runs beyond it. Per
layer and micro-batch, bf16 tensors, with T tokens, width h, n the elements of a rotated
q or k, n_q (n_kv) the query (K/V) head elements, f the SwiGLU width (bytes read plus
written, the kernels' count in brackets):

====================================  ===============================  ==========================
torchtitan's code (eager)             forward                          backward
====================================  ===============================  ==========================
``RMSNorm``: ``(x.float() * rsqrt(     36·T·h + 24·T + 2·h [8]:         92·T·h + 40·T + 4·h [16],
x.float().pow(2).mean(-1) + eps))      casts up and down, pow, mean,    its weight's gradient
.type_as(x) * weight``                 add, rsqrt, two muls             among them; + 6·T·h [1]
                                                                        adding the residual's
                                                                        gradient
``apply_rotary_emb`` (complex):        20·n [3]: cast up, complex       20·n [4]
``view_as_complex(x.float()) *         multiply, cast down
freqs_cis``, ``type_as``
``repeat_kv`` (K and V to every        2·(2·n_kv + 2·n_q) [2]: the      2·(2·n_q + 2·n_kv) [2]:
query head: expand + reshape; none     copies                           the sums over the repeats
with as many K/V heads as heads)
``silu(w1(x)) * w3(x)``                10·T·f [2]                       18·T·f [3]
====================================  ===============================  ==========================

against the program's fused ops: a norm 6·T·h forward and 6·T·h backward (its input
gradient with the residual's) plus 6·T·h for its weight's gradient; a rotary embedding 4·n
each way; no K/V repeat; SwiGLU 6·T·f forward and 10·T·f backward. The rotary
embeddings' tables (4·s·d bytes forward, 12·s·d backward) and the norms' per-row terms
are small and left out of the added bytes; the final norm has no residual. The counts
are those a ``TorchDispatchMode`` records for these functions, op by op, in bf16 on the
CPU (``tests/planner/test_eager_kernels.py``: every kernel an op whose output does not
alias its input, its bytes the distinct elements it reads — a broadcast operand once —
plus those it writes): nothing here is fitted. Where it applies: a dense Llama run without
``torch.compile`` (``simulate_gpt(..., eager_kernels=True)``; torchtitan's rows with
``compiled`` 0 in ``torchtitan_long_context.csv``). Each added group of kernels is priced
as that many elementwise kernels sharing the bytes, by the cost model that prices the
others (analytic: launch overhead plus bytes over the achieved HBM bandwidth).
"""

from __future__ import annotations

from types import MappingProxyType

from vcluster.runtime.tracing import TraceCompute

__all__ = ["with_eager_kernels", "EAGER_KERNELS", "EAGER_NAME"]

#: the added ops' names end ``eager: <what>``, after the block they serve
EAGER_NAME = "eager:"

# (bytes per element of the op's main tensor, kernels) eager PyTorch runs for a traced
# fused op, by the last part of its name (before " (recompute)"); the op's unit is T·h
# for a norm, n for a rotary embedding (half its elementwise elements), T·f for SwiGLU
_NORM_FWD, _NORM_BWD, _RESIDUAL_GRAD = (36, 8), (92, 16), (6, 1)
_ROPE_FWD, _ROPE_BWD = (20, 3), (20, 4)
_SWIGLU_FWD, _SWIGLU_BWD = (10, 2), (18, 3)
#: a norm's weight gradient, a traced op of its own after the backward (bytes per T·h)
_GAIN_GRAD = 6

#: what eager PyTorch runs per traced op name: (kind, eager bytes/unit, kernels)
EAGER_KERNELS = MappingProxyType({
    "attention: norm": ("norm", *_NORM_FWD),
    "mlp: norm": ("norm", *_NORM_FWD),
    "head: final norm": ("norm", *_NORM_FWD),
    "attention: norm grad + residual": ("norm grad", _NORM_BWD[0] + _RESIDUAL_GRAD[0],
                                        _NORM_BWD[1] + _RESIDUAL_GRAD[1]),
    "mlp: norm grad + residual": ("norm grad", _NORM_BWD[0] + _RESIDUAL_GRAD[0],
                                  _NORM_BWD[1] + _RESIDUAL_GRAD[1]),
    "head: final norm grad": ("norm grad", *_NORM_BWD),
    "attention: rope q": ("rope", *_ROPE_FWD),
    "attention: rope k": ("rope", *_ROPE_FWD),
    "attention: rope^T dq": ("rope", *_ROPE_BWD),
    "attention: rope^T dk": ("rope", *_ROPE_BWD),
    "mlp: silu(zg) * zu": ("swiglu", *_SWIGLU_FWD),
    "mlp: swiglu grad": ("swiglu grad", *_SWIGLU_BWD),
})


def _base(name: str) -> tuple[str, str, str]:
    """(prefix, base, suffix) of a traced name: "gpt: " + "mlp: norm" + " (recompute)"."""
    prefix = name[:name.index(": ") + 2] if name.startswith("gpt: ") else ""
    rest = name[len(prefix):]
    suffix = " (recompute)" if rest.endswith(" (recompute)") else ""
    return prefix, rest[:len(rest) - len(suffix)], suffix


def _unit(op: TraceCompute, kind: str) -> int:
    """The elements of the op's main tensor: T·h (norm), n (rope), T·f (SwiGLU)."""
    k = op.kernel
    if kind == "rope":
        return k.shape[0] // 2                   # elementwise: read plus written
    return k.shape[0] * k.shape[1]               # norm, activation: (tokens, width)


def _extra(name: str, nbytes: int, kernels: int) -> list[TraceCompute]:
    """``kernels`` elementwise kernels sharing ``nbytes`` (16-bit elements: bytes / 2)."""
    if nbytes <= 0 or kernels <= 0:
        return []
    share = nbytes // kernels
    return [TraceCompute.memory_bound(name, share, share // 2) for _ in range(kernels)]


def with_eager_kernels(ops) -> tuple:
    """``ops`` with, after each fused op :data:`EAGER_KERNELS` names, the kernels and bytes
    eager PyTorch runs beyond it, and after each layer's rotated k (its gradient) the K/V
    repeat's copies (sums). Ops named otherwise pass unchanged (GPT and MoE programs
    too: their blocks are not torchtitan's Llama)."""
    out, n_q = [], 0
    for op in ops:
        out.append(op)
        if type(op) is not TraceCompute or op.kernel is None:
            continue
        prefix, base, suffix = _base(op.name)
        spec = EAGER_KERNELS.get(base)
        if spec is None:
            continue
        kind, per_unit, kernels = spec
        unit = _unit(op, kind)
        # what the program declares for the same work: the op, and a norm's weight
        # gradient (its own op later in the list: eager computes it in the same kernels)
        program = op.bytes + (_GAIN_GRAD * unit if kind == "norm grad" else 0)
        out += _extra(f"{prefix}{base}: {EAGER_NAME} unfused{suffix}",
                      per_unit * unit - program, kernels - 1)
        if base in ("attention: rope q", "attention: rope^T dq"):
            n_q = unit
        elif base in ("attention: rope k", "attention: rope^T dk") and n_q > unit:
            # K and V repeated to every query head (forward: copies reading n_kv, writing
            # n_q; backward: sums reading n_q, writing n_kv), bf16; torchtitan's repeat_kv
            # returns K and V themselves when every query head has its own (n_q = n_kv)
            out += _extra(f"{prefix}attention: {EAGER_NAME} repeat K, V{suffix}",
                          2 * (2 * unit + 2 * n_q), 2)
    return tuple(out)
