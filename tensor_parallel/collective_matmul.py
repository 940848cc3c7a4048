"""Collective matmuls: a sequence-parallel all-gather or reduce-scatter decomposed into ring
steps that overlap the GEMMs they feed or drain, as Transformer Engine runs a layer's
linears under ``tp_comm_overlap`` (userbuffers' ring exchange; Megatron-LM
``--tp-comm-overlap``, NeMo ``tp_comm_overlap: True``) and PyTorch's asynchronous tensor
parallelism does (torchtitan ``enable_async_tensor_parallel``). Wang et al., "Overlap
communication with dependent computation via decomposition in large deep learning
models" (ASPLOS 2023) describe the decomposition; ``ParallelConfig.tp_overlap = "te"``
selects it.

A tp group of t ranks, rank r holding sequence chunk r of every activation (x (b, s/t, h)
under sequence parallelism: chunk c is rows c·s/t … (c+1)·s/t − 1 of each sequence).

**All-gather then GEMM** (:func:`ring_gather_matmul`, the forward's x W_qkv and x W_1,
the backward's dy W_o^T and dy W_2^T): Y = gather(x) W without waiting for the gather.

    step i = 0 … t−1:  c = (r − i) mod t     (the chunk rank r holds: its own at step 0)
        isend x_c to r+1 and irecv x_{c−1} from r−1   (not at the last step)
        Y_c = x_c W                                   (while they travel)
        wait for the receive

Each rank sends t−1 messages of |x_r| bytes, as NCCL's ring all-gather does; a step exposes
only max(0, transfer − GEMM on s/t rows).

**GEMM then reduce-scatter** (:func:`ring_matmul_reduce`, the forward's ctx W_o and a W_2,
whose row-parallel partial sums leave the region): y_r = Σ_j (A_j W)[chunk r].

    step i = 0 … t−1:  c = (r − i − 1) mod t
        P = A[chunk c] W                              (while the accumulator travels)
        i > 0: P += the accumulator of chunk c received from r−1
        i < t−1: isend P to r+1                      (at i = t−1, c = r: P is y_r)

Chunk c's sum starts on rank c+1 and goes round the ring, ending on rank c: t−1 messages of
|y_r| bytes per rank, as NCCL's ring reduce-scatter; a step exposes max(0, transfer − GEMM).

What it does not model: the GEMM writes its chunk of Y in place (TE's output buffer) and
the gathered x lands in one buffer, so assembling Y and x here is not a kernel (no
``dev.compute``); the adds are (one elementwise kernel per step, as TE reduces the
received chunks). The transfers are copy-engine copies (TE's default ring exchange):
they take no SMs, so the GEMMs are not slowed. The bulk overlaps of the backward (the
input gradient's reduce-scatter with the weight-gradient GEMM) are ``tp_overlap``'s
``backward`` form (:meth:`~tensor_parallel.attention.TransformerOps.reduce_input_grad`),
which ``te`` includes.

Symmetric tracing (one traced rank of the tp group, the others mirroring it) receives
with ``out=`` a buffer shaped like its own send, so the tracer needs no peer.
"""

from __future__ import annotations

from vcluster.runtime.tracing.ops import RING_TAG_BASE

__all__ = ["ring_gather_matmul", "ring_matmul_reduce", "TAG_GATHER", "TAG_REDUCE"]

#: p2p tags of the two rings: ring tags (symmetric replay mirrors an untraced peer's steps
#: by the traced rank's own, :data:`~vcluster.runtime.tracing.ops.RING_TAG_BASE`)
TAG_GATHER, TAG_REDUCE = RING_TAG_BASE + 1, RING_TAG_BASE + 2


def _ring(ops):
    """(t, this rank's position r, the next rank, the previous rank) of ``ops``' tp group."""
    dev = ops.dev
    group = dev.mesh.group(ops.tp_axis, dev.rank)
    t, r = len(group), ops.tp_rank
    return t, r, group[(r + 1) % t], group[(r - 1) % t]


def ring_gather_matmul(ops, x, weights, names):
    """``(xf, [xf2 @ w for w in weights])``: x (b, s/t, h) gathered on the sequence (xf
    (b, s, h)) and, with xf2 = xf as (b·s, h) rows, each product — computed a chunk at a
    time while the next chunk travels (module docstring). ``names``: one per weight."""
    dev, xp = ops.dev, ops.dev.xp
    t, r, nxt, prv = _ring(ops)
    b, s_l, h = x.shape
    chunks, outs = [None] * t, [[None] * t for _ in weights]
    cur = x
    for i in range(t):
        c = (r - i) % t
        pending = None
        if i < t - 1:
            pending = (dev.isend(cur, nxt, tag=TAG_GATHER),
                       dev.irecv(prv, tag=TAG_GATHER, out=xp.empty_like(cur)))
        chunks[c] = cur
        rows = cur.reshape(b * s_l, h)
        for out, w, name in zip(outs, weights, names):
            out[c] = ops.matmul(rows, w, name).reshape(b, s_l, -1)
        if pending is not None:
            sent, got = pending
            cur = got.wait()
            sent.wait()
    xf = xp.concatenate(chunks, axis=1)
    return xf, [xp.concatenate(out, axis=1).reshape(b * s_l * t, -1) for out in outs]


def ring_matmul_reduce(ops, a, w, shape, name, reduce_name):
    """y (b, s/t, n): this rank's sequence chunk of the sum over the tp group of
    ``(a @ w).reshape(shape)`` (shape (b, s, n), a (b·s, k) rows), each chunk's product
    computed while the previous partial sum travels (module docstring)."""
    dev, xp = ops.dev, ops.dev.xp
    t, r, nxt, prv = _ring(ops)
    b, s, n = shape
    s_l, k = s // t, a.shape[-1]
    a3 = a.reshape(b, s, k)
    sends, acc = [], None
    for i in range(t):
        c = (r - i - 1) % t
        rows = a3[:, c * s_l:(c + 1) * s_l].reshape(b * s_l, k)
        part = ops.matmul(rows, w, name)
        if i > 0:
            got = dev.irecv(prv, tag=TAG_REDUCE, out=xp.empty_like(part)).wait()
            part = ops.ew(f"{reduce_name}: add", lambda p=part, g=got: p + g, part, got)
        if i < t - 1:
            sends.append(dev.isend(part, nxt, tag=TAG_REDUCE))
        acc = part
    for sent in sends:
        sent.wait()
    return acc.reshape(b, s_l, n)
