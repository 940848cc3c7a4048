"""PyTorch's context-parallel attention, beside the ring the program traces.

The program's ring (:mod:`tensor_parallel.context_parallel`, ``algorithm="ring"``) is
Megatron's: it passes the grouped K and V (kv heads) in the model's 16-bit dtype, merges
each block's partial output in that dtype and accumulates dq, dk, dv in it. PyTorch's
experimental context parallelism (``torch.distributed.tensor.experimental
.context_parallel``, what torchtitan's ``context_parallel_degree`` runs; read at
``torch/distributed/tensor/experimental/_attention.py``, 2024-25: ``_SDPAMerger``,
``_templated_ring_attention``, ``_templated_ring_attention_backward``) does the same
products, through SDPA, with three differences that cost memory traffic:

* ``_cp_options.convert_to_f32`` (on by default): each block's output is cast to float32
  and merged there — ``out - sigmoid(block_lse - lse) * (out - block_out)``, three float32
  kernels over the output rows — and the merged output cast back to 16 bits once; the
  backward's dq, dk, dv accumulators are float32;
* torchtitan's Llama repeats K and V to every query head before SDPA (``repeat_kv``), so
  the ring carries, and the backward accumulates, K, V, dK, dV of the query heads: g times
  the grouped tensors (g = heads / kv_heads);
* each exchange concatenates K and V (``torch.cat([key.flatten(), value.flatten()])``),
  and the backward its dK, dV accumulators, into one buffer before sending; a rank adds
  a block's dK, dV into the half of the accumulator they belong to and concatenates the
  halves again (``_partial_update``).

:func:`with_torch_cp_kernels` rewrites a traced rank's ring ops into that form. Per
element, in bytes read plus written (16-bit 2, float32 4; E the elements an op of the
program names, K the elements of a grouped K shard):

===============================  ====================================  ===================
the program's op                 PyTorch                               bytes
===============================  ====================================  ===================
``flash forward`` (a block)      + its output cast to float32          6 per output elem.
``merge (log-sum-exp)``          three float32 kernels                 32 per element
                                 (``out - block_out``, ``sigmoid·()``,  (was 6)
                                 ``out - ·``)
``concatenate chunks``           + the cast back to 16 bits            + 6 per element
``dq +=``                        float32 accumulation                  10 per element
                                                                       (was 2)
``dk, dv +=``                    into float32 accumulators of the      10·g per element of
                                 query heads                           dk and of dv
``accumulate dk, dv``            the halves concatenated again and     16·g per element of
                                 the buffer to send: two float32       dk and of dv
                                 copies of the query heads' dK, dV
a K, V exchange                  + the concatenation into one buffer   8·g per element of
                                 (16-bit, query heads)                 K (K and V)
the K, V sends (tags 1, 2)       the query heads' K, V                 g times the bytes
the dK, dV sends (tags 3, 4)     float32 of the query heads            2·g times the bytes
===============================  ====================================  ===================

Each new or rewritten kernel is priced as an elementwise kernel of its bytes by the cost
model that prices the others; nothing is fitted. Not counted: the first block's cast of
each forward (a few percent of the merges), the forward's ``_partial_update`` copies on
the ranks whose later blocks cover half their rows (load balancing: a rank's first
steps merge whole outputs, the others half, with a copy of the whole output each), and the
all-gather PyTorch uses in place of the forward ring (``rotate_method`` "allgather",
torchtitan's default: the same bytes, in one collective overlapped with the first block).
Where it applies: torchtitan's rows with context parallelism
(``simulate_gpt(..., torch_cp=True)``, ``--torch-cp``); the ring algorithm only.
"""

from __future__ import annotations

import dataclasses

from vcluster.runtime.tracing import KernelKind, TraceCompute, TraceRecv, TraceSend

__all__ = ["with_torch_cp_kernels", "TORCH_CP_NAME", "KV_TAGS", "GRAD_TAGS"]

#: the added ops' names: ``<the block's prefix>: torch cp: <what>``
TORCH_CP_NAME = "torch cp:"
#: the ring's point-to-point tags (tensor_parallel.context_parallel): K, V and dK, dV
KV_TAGS, GRAD_TAGS = (1, 2), (3, 4)
_CP = ": cp: "          # the program's ring ops are named "<label>: cp: <what>"

# bytes per element of the program's op (its declared bytes are 16-bit elements: 2 each;
# a merge declares o1, o2, o1: 6 per element; "dk, dv +=" gk, gv, gk, gv: 8 per element
# of dk; "accumulate dk, dv" dk, rk, dv, rv: 8 per element of dk)
_MERGE = 12 + 8 + 12     # out - block_out; sigmoid(...) * (...); out - (...), float32
_TO_F32 = 2 + 4          # a 16-bit tensor cast to float32 (or back: 4 + 2)
_DQ_ACC = 4 + 2 + 4      # float32 dq += 16-bit block gradient
_DKV_ACC = 4 + 2 + 4     # the same for dk, dv, per query head
_DKV_COPIES = 2 * (4 + 4)   # the halves concatenated, the send buffer concatenated
_KV_CAT = 2 * (2 + 2)    # K and V, 16-bit, read and written into one buffer


def _elementwise(name: str, nbytes: int) -> TraceCompute:
    return TraceCompute.memory_bound(name, int(nbytes))


def _prefix(name: str) -> str:
    return name.split(_CP)[0]


def with_torch_cp_kernels(ops, group: int, cp_peers) -> list:
    """``ops`` (one rank's traced step) with its context-parallel ring priced as PyTorch
    runs it (module docstring): ``group`` query heads per K/V head (g), ``cp_peers`` the
    ranks of this rank's cp group (the sends and receives between them are the ring's).
    Every other op is kept as it is."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"with_torch_cp_kernels: group must be an int >= 1 (query heads "
                         f"per K/V head), got {group!r}")
    peers = frozenset(int(p) for p in cp_peers)
    g = group
    out = []
    for op in ops:
        if isinstance(op, (TraceSend, TraceRecv)) and op.peer in peers:
            if op.tag in KV_TAGS:
                if isinstance(op, TraceSend) and op.tag == KV_TAGS[0]:
                    # K's send opens an exchange: K and V concatenated first (K's bytes
                    # are |K| 16-bit elements: |K| = nbytes / 2)
                    out.append(_elementwise(f"{TORCH_CP_NAME} concatenate K, V",
                                            _KV_CAT * g * op.nbytes // 2))
                out.append(dataclasses.replace(op, nbytes=g * op.nbytes))
                continue
            if op.tag in GRAD_TAGS:
                out.append(dataclasses.replace(op, nbytes=2 * g * op.nbytes))
                continue
        if type(op) is not TraceCompute or _CP not in op.name:
            out.append(op)
            continue
        what = op.name.split(_CP, 1)[1]
        kernel = op.kernel
        if kernel is not None and kernel.kind is KernelKind.ATTENTION and kernel.flash:
            out.append(op)
            if not kernel.backward:
                b_heads, s_q, _, d = kernel.shape
                out.append(_elementwise(f"{_prefix(op.name)}: {TORCH_CP_NAME} block output "
                                        f"to float32", _TO_F32 * b_heads * s_q * d))
            continue
        if what == "merge (log-sum-exp)":
            out.append(dataclasses.replace(op, bytes=_MERGE * op.bytes // 6))
        elif what == "concatenate chunks":
            out.append(op)
            out.append(_elementwise(f"{_prefix(op.name)}: {TORCH_CP_NAME} cast to 16 bits",
                                    _TO_F32 * op.bytes // 2))
        elif what == "dq +=":
            out.append(dataclasses.replace(op, bytes=_DQ_ACC * op.bytes // 2))
        elif what == "dk, dv +=":
            out.append(dataclasses.replace(op, bytes=2 * _DKV_ACC * g * op.bytes // 8))
        elif what == "accumulate dk, dv":
            out.append(dataclasses.replace(op, bytes=2 * _DKV_COPIES * g * op.bytes // 8))
        else:
            out.append(op)
    return out
