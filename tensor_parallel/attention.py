"""Causal multi-head self-attention with Megatron tensor parallelism, forward and backward.

Local shapes on one device of a tp group of t: b micro-batch, s sequence, h hidden,
a heads, d = h/a, a_l = a/t heads here, h_l = a_l·d; the layer's input x is (b, s, h),
or (b, s/t, h) with sequence parallelism (SP). Parameters: W_qkv (h, 3, h) and b_qkv
(3, h) split on the last dimension (whole heads: column-parallel), W_o (h, h) split on
its rows (row-parallel), b_o (h,) replicated.

    forward:   xf  = gather_seq(x)                    (b, s, h)      SP only: all_gather(tp)
               qkv = xf W_qkv + b_qkv                 (b·s, 3·h_l)   -> q, k, v (b·a_l, s, d)
               S   = q k^T / sqrt(d) + M              (b·a_l, s, s)  M: -inf above the diagonal
               P   = softmax(S)                       (b·a_l, s, s)
               C   = P v                              (b·a_l, s, d)  -> ctx (b·s, h_l)
               y   = reduce(ctx W_o) + b_o            (b, s, h)      all_reduce(tp), or
                                                      (b, s/t, h)    SP: reduce_scatter(tp)
    backward:  dyf = gather_seq(dy);  dctx = dyf W_o^T;  dP = dC v^T;  dv = P^T dC
               dS  = P·(dP - rowsum(dP·P)) / sqrt(d);  dq = dS k;  dk = dS^T q
               dx  = reduce(dqkv W_qkv^T)             all_reduce(tp) / SP: reduce_scatter(tp),
                                                      overlapping dW_qkv, db_qkv when
                                                      ops.async_grad_reduce
    weights:   dW_qkv = xf^T dqkv, db_qkv = rowsum dqkv, dW_o = ctx^T dyf, db_o = rowsum dyf

FLOPs (only the products, Megatron's count): forward 2·b·s·h·3h_l + 2·(2·b·a_l·s²·d)
+ 2·b·s·h_l·h, i.e. (6bsh² + 4bs²h + 2bsh²)/t; the backward twice as much. The
products run as whole-batch 2-D or batched 3-D matmuls (over b·a_l), never per head.

With ``TransformerOps(..., flash=True)`` (``ParallelConfig.attention="flash"``) the core
attention (q k^T, softmax, P v, and their backward) runs in one compute block each way,
declared as one fused kernel (:func:`flash_block`: the same FLOPs, O(s) bytes, never the
s² scores); the math is the same.

``selective`` recomputation (Korthikanti et al. 2022) keeps q, k, v and drops P and C,
re-running the core attention (q k^T, softmax, P v) at the start of the backward.

Context parallelism (``Attention(..., cp=ContextParallelAttention(...))``): the rows are
this rank's load-balanced sequence chunks (:mod:`tensor_parallel.context_parallel`); the
core attention is the operation's ``forward_local`` (K/V passed around the cp ring, or
all-gathered) and its backward ``backward_local``, which recomputes P from the kept
output and row log-sum-exp (the state holds L where it would hold P; C is taken back
from the kept ctx, so one copy of the output is kept, as flash attention keeps it).
Everything else is per row, unchanged.
"""

from __future__ import annotations

import math

import numpy as np

from vcluster.runtime.tracing.kernel import Kernel

from .collective_matmul import ring_gather_matmul, ring_matmul_reduce
from .ffn import ACTIVATIONS, _OnDevice
from .ffn_sharding import FeedForwardSharding
from .matmul import local_matmul

__all__ = ["TransformerOps", "batched_matmul", "Attention", "saved_bytes", "flash_block",
           "flash_grads"]


def batched_matmul(dev, a, b, name: str = "batched matmul"):
    """a @ b over a leading batch: (n, m, k) @ (n, k, p), declared 2·n·m·k·p FLOPs."""
    n, m, k = a.shape
    p = b.shape[-1]
    itemsize = np.dtype(a.dtype).itemsize
    with dev.compute(name, flops=2 * n * m * k * p, bytes=n * (m * k + k * p + m * p) * itemsize,
                     gemm=(n, m, k, p)):
        return dev.xp.matmul(a, b)


def saved_bytes(*states) -> int:
    """Bytes of the distinct arrays held in dicts of per-micro-batch (nested) tuples."""
    seen, total = set(), 0
    stack = [st for d in states for st in d.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, (tuple, list)):
            stack.extend(a)
        elif hasattr(a, "nbytes") and id(a) not in seen:
            seen.add(id(a))
            total += int(a.nbytes)
    return total


class TransformerOps(_OnDevice):
    """The device steps of a transformer: :mod:`tensor_parallel.ffn`'s on-device backend
    (its collectives ``c`` of the FeedForward policy: Unsharded, Megatron or
    SequenceParallel over ``tp``) with Megatron's FLOP convention — products through
    ``local_matmul`` / :func:`batched_matmul`, elementwise work (LayerNorm, softmax,
    gelu, residuals) declared with 0 FLOPs and the bytes it touches."""

    def __init__(self, dev, tp_axis: str | None, sequence_parallel: bool, flash: bool = False,
                 async_grad_reduce: bool = False, tp_comm_overlap: bool = False):
        super().__init__(dev, ACTIVATIONS["gelu"], {})
        self.flash = bool(flash)     # core attention as one fused kernel (Attention.core)
        # a column-parallel linear's input gradient reduced while its weight gradient is
        # computed (reduce_input_grad)
        self.async_grad_reduce = bool(async_grad_reduce)
        tp = tp_axis is not None and dev.mesh.axis_size(tp_axis) > 1
        self.tp_axis = tp_axis if tp else None
        self.tp_size = dev.mesh.axis_size(tp_axis) if tp else 1
        self.tp_rank = dev.mesh.group_position(tp_axis, dev.rank) if tp else 0
        self.sequence_parallel = bool(sequence_parallel and tp)
        policy = ("SequenceParallel" if self.sequence_parallel else "Megatron") if tp \
            else "Unsharded"
        self.c = FeedForwardSharding(policy, tp=self.tp_axis).collectives
        # the sequence-parallel gathers and reduce-scatters as ring steps overlapping their
        # GEMMs (gather_matmul, matmul_reduce; :mod:`tensor_parallel.collective_matmul`)
        self.tp_comm_overlap = bool(tp_comm_overlap and self.sequence_parallel)

    def work(self, name, flops, operands, out_shape, fn, kernel=None, nbytes=None):
        """``fn()`` declared with 0 FLOPs and the bytes of ``operands`` (or ``nbytes``, where
        the kernel moves other bytes than its operands'); ``kernel`` (default: an elementwise
        kernel moving the operands' elements)."""
        elements = sum(int(o.size) for o in operands)
        if nbytes is None:
            nbytes = elements * np.dtype(operands[0].dtype).itemsize
        with self.dev.compute(f"gpt: {name}", flops=0, bytes=nbytes,
                              kernel=Kernel.elementwise(elements) if kernel is None else kernel):
            return fn()

    def ew(self, name: str, fn, *operands):
        """Elementwise ``fn()`` over ``operands`` (and an output like the first)."""
        return self.work(name, 0, operands + operands[:1], None, fn)

    def matmul(self, a, b, name):
        return local_matmul(self.dev, a, b, f"gpt: {name}")

    def bmm(self, a, b, name):
        return batched_matmul(self.dev, a, b, f"gpt: {name}")

    def gather_seq(self, x, name):
        """Enter a TP region: SP all-gathers the sequence (dim 1); else x itself."""
        return self.comm(self.c.x_in, x, name)

    def reduce_out(self, x, name):
        """Leave a TP region: all_reduce(tp), SP reduce_scatter(tp) on dim 1, or x."""
        return self.comm(self.c.y_out, x, name)

    def gather_matmul(self, c, x, weights, gather_name, names):
        """``(xf, [xf2 @ w ...])`` (:meth:`~tensor_parallel.ffn._Backend.gather_matmul`);
        under ``tp_comm_overlap`` the sequence-parallel gather runs as ring steps that
        overlap the products (:func:`~tensor_parallel.collective_matmul.
        ring_gather_matmul`). ``c``: ``self.c.x_in`` (None outside a TP region)."""
        if self.tp_comm_overlap and c is self.c.x_in and c is not None:
            return ring_gather_matmul(self, x, weights, names)
        return super().gather_matmul(c, x, weights, gather_name, names)

    def matmul_reduce(self, c, a, w, shape, name, reduce_name):
        """``c`` on ``(a @ w).reshape(shape)``; under ``tp_comm_overlap`` the
        sequence-parallel reduce-scatter as ring steps overlapping the product
        (:func:`~tensor_parallel.collective_matmul.ring_matmul_reduce`)."""
        if self.tp_comm_overlap and c is self.c.y_out and c is not None:
            return ring_matmul_reduce(self, a, w, shape, name, reduce_name)
        return super().matmul_reduce(c, a, w, shape, name, reduce_name)

    def reduce_input_grad(self, dx, name, weight_grads) -> tuple:
        """Leave a TP region with ``dx``, the input gradient of a column-parallel linear
        (all_reduce(tp), or reduce_scatter(tp) under SP, as :meth:`reduce_out`): ``(dx
        reduced, True)`` after running ``weight_grads()`` — that linear's weight and
        bias gradients, accumulated in place — while the reduction is in flight, as
        Megatron-LM's column-parallel linears do (``async_grad_reduce``: the reduction
        issued asynchronously before the weight-gradient GEMM and waited after it, Megatron's
        ``--async-tensor-model-parallel-allreduce``, Korthikanti et al. 2022 §6.2); else
        ``(reduce_out(dx), False)`` with ``weight_grads`` left to the caller's weight pass."""
        c = self.c.y_out
        if c is None or not self.async_grad_reduce:
            return self.reduce_out(dx, name), False
        work = self.comm(c, dx, name, async_op=True)
        weight_grads()
        return work.wait(), True

    def all_reduce_tp(self, x, op: str = "sum"):
        return x if self.tp_axis is None else self.dev.all_reduce(x, self.tp_axis, op=op)

    # --- LayerNorm over the last dimension h: y = xhat·g + b, xhat = (x - mean)·rstd ------
    def layer_norm(self, x, g, b, eps: float, name: str):
        """(y, (xhat, rstd)), rstd = 1/sqrt(var + eps)."""
        h = x.shape[-1]

        def fn():
            xc = x - x.sum(axis=-1, keepdims=True) / h
            rstd = 1.0 / np.sqrt((xc * xc).sum(axis=-1, keepdims=True) / h + eps)
            xhat = xc * rstd
            return xhat * g + b, (xhat, rstd)

        return self.work(name, 0, (x, x, x), None, fn, Kernel.norm(x.size // h, h))

    def layer_norm_grad(self, dy, state, g, name: str, residual=None):
        """dx = rstd·(d - mean(d) - xhat·mean(d·xhat)), d = dy·g; plus ``residual``."""
        xhat, rstd = state
        h = dy.shape[-1]

        def fn():
            d = dy * g
            dx = rstd * (d - d.sum(axis=-1, keepdims=True) / h
                         - xhat * (d * xhat).sum(axis=-1, keepdims=True) / h)
            return dx if residual is None else dx + residual

        return self.work(name, 0, (dy, xhat, dy), None, fn, Kernel.norm(dy.size // h, h, True))

    def layer_norm_params_grad(self, dy, xhat, gg, gb, name: str) -> None:
        """gg += rowsum(dy·xhat), gb += rowsum(dy) (in place)."""
        gg += self.ew(name, lambda: (dy * xhat).reshape(-1, dy.shape[-1]).sum(axis=0), dy, xhat)
        gb += self.sum_rows(dy, name)


LSE_BYTES = 4      # a fused attention kernel's fp32 row log-sum-exp, per (row, head)


def flash_block(ops, name: str, flops: float, arrays, batch_heads: int, s: int, d: int,
                backward: bool, window: int | None = None):
    """The compute block of one fused (flash) causal attention kernel over ``batch_heads``
    (s, d) heads: ``flops`` as the program declares its products, and the bytes it moves —
    ``arrays`` (what it reads and writes: q, k, v, O forward; q, k, v, O, dO, dq, dk, dv
    backward) plus the row log-sum-exp — O(s), never the s×s scores (FlashAttention keeps
    them on chip); ``window``: a sliding window (the kernel's, :mod:`.gqa`). The math
    inside runs as plain array calls (no nested blocks)."""
    itemsize = np.dtype(arrays[0].dtype).itemsize
    nbytes = sum(int(a.size) for a in arrays) * itemsize + LSE_BYTES * batch_heads * s
    return ops.dev.compute(f"gpt: {name}", flops=flops, bytes=nbytes,
                           kernel=Kernel.attention(batch_heads, s, s, d, causal=True, flash=True,
                                                   backward=backward, window=window))


def flash_grads(xp, dc, q, k, v, p, scale: float):
    """(dq, dk, dv) of C = P v, P = softmax(q k^T·scale + M), from P (the math of the
    unfused backward, in one block): the k/v-side products are over k's rows (GQA: q's
    rows may hold g query groups per K/V head)."""
    dp = xp.matmul(dc, v.transpose(0, 2, 1))
    dv = xp.matmul(p.transpose(0, 2, 1), dc)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale
    return xp.matmul(ds, k), xp.matmul(ds.transpose(0, 2, 1), q), dv


class Attention:
    """The attention block's math on one device; per micro-batch state is kept by the
    caller (``forward`` returns it, the backward passes take it back)."""

    def __init__(self, heads_local: int, head_dim: int, cp=None):
        self.a_l, self.d, self.cp = heads_local, head_dim, cp
        self.scale = 1.0 / math.sqrt(head_dim)

    def _heads(self, ops, t, b, s, name):
        """(b·s, a_l·d) -> (b·a_l, s, d)."""
        return ops.ew(name, lambda: t.reshape(b, s, self.a_l, self.d).transpose(0, 2, 1, 3)
                      .reshape(b * self.a_l, s, self.d), t)

    def _merge(self, ops, t, b, s, name):
        """(b·a_l, s, d) -> (b·s, a_l·d)."""
        return ops.ew(name, lambda: self._merge_raw(t, b, s), t)

    # --- core attention --------------------------------------------------------------
    def core(self, ops, q, k, v):
        """P = softmax(q k^T / sqrt(d) + M), C = P v, for (b·a_l, s, d) q, k, v; under
        context parallelism ((L, C), C): the row log-sum-exp L stands in for P."""
        if self.cp is not None:
            c, lse = self.cp.forward_local(ops.dev, q, k, v)
            return (lse, c), c
        n, s, d = q.shape
        if ops.flash:
            with flash_block(ops, "attention: flash forward", 4 * n * s * s * d, (q, k, v, q),
                             n, s, d, backward=False):
                p = self._probs(ops, ops.xp.matmul(q, k.transpose(0, 2, 1)))
                return p, ops.xp.matmul(p, v)
        scores = ops.bmm(q, k.transpose(0, 2, 1), "attention: q @ k^T")
        p = ops.ew("attention: causal softmax", lambda: self._probs(ops, scores), scores)
        return p, ops.bmm(p, v, "attention: P @ v")

    def _probs(self, ops, scores):
        """softmax(scores·scale + M), M = -inf above the diagonal."""
        s = scores.shape[1]
        big = np.finfo(scores.dtype).max / 2    # exp(-big - max) is exactly 0, as exp(-inf)
        # future[0, i, j] = j > i, built from scores so that it is shape-only in a trace
        pos = ops.xp.arange(s)
        future = (np.zeros_like(scores[:1, :, :1]) + pos[:, None]) < pos
        z = scores * self.scale - future * big
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def core_backward(self, ops, dc, q, k, v, p):
        """(dq, dk, dv) from dC (b·a_l, s, d) (``p``: core's first output)."""
        if self.cp is not None:
            lse, c = p
            return self.cp.backward_local(ops.dev, q, k, v, c, lse, dc)
        if ops.flash:
            n, s, d = q.shape
            with flash_block(ops, "attention: flash backward", 8 * n * s * s * d,
                             (q, k, v, dc, dc, q, k, v), n, s, d, backward=True):
                return flash_grads(ops.xp, dc, q, k, v, p, self.scale)
        dp = ops.bmm(dc, v.transpose(0, 2, 1), "attention: dP = dC v^T")
        dv = ops.bmm(p.transpose(0, 2, 1), dc, "attention: dv = P^T dC")
        ds = ops.ew("attention: softmax grad",
                    lambda: p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * self.scale, dp, p)
        dq = ops.bmm(ds, k, "attention: dq = dS k")
        dk = ops.bmm(ds.transpose(0, 2, 1), q, "attention: dk = dS^T q")
        return dq, dk, dv

    # --- the block ------------------------------------------------------------------------
    def forward(self, ops, x, w_qkv, b_qkv, w_o, b_o, keep: str = "all"):
        """y (x's layout) and the state for the backward: ``keep`` = "all" (everything),
        "qkv" (selective recomputation: not P nor C) or "none" (nothing)."""
        w2 = w_qkv.reshape(x.shape[-1], -1)                                 # (h, 3·h_l)
        xf, (qkv,) = ops.gather_matmul(ops.c.x_in, x, (w2,), "attention: gather x",
                                       ("attention: x @ W_qkv",))           # (b, s, h)
        b, s, h = xf.shape
        x2 = xf.reshape(b * s, h)
        qkv = ops.add_bias(qkv, b_qkv.reshape(-1), "attention: + b_qkv")    # (b·s, 3·h_l)
        h_l = self.a_l * self.d
        q, k, v = (self._heads(ops, qkv[:, i * h_l:(i + 1) * h_l], b, s, "attention: split heads")
                   for i in range(3))
        p, c = self.core(ops, q, k, v)
        if self.cp is not None:
            p = p[:1]           # L only: the backward takes C back from ctx (one copy kept)
        ctx = self._merge(ops, c, b, s, "attention: merge heads")           # (b·s, h_l)
        y = ops.matmul_reduce(ops.c.y_out, ctx, w_o, (b, s, h), "attention: ctx @ W_o",
                              "attention: reduce y")
        y = ops.add_bias(y, b_o, "attention: + b_o")
        state = {"all": (x2, q, k, v, p, ctx), "qkv": (x2, q, k, v, None, None),
                 "none": ()}[keep]
        return y, state

    def backward_input(self, ops, state, dy, w_qkv, w_o, g_qkv=None, gb_qkv=None):
        """dx (x's layout) and the state of the weight gradient, from ``forward``'s state
        (with P and C recomputed first when it holds none: selective recomputation).
        ``g_qkv``, ``gb_qkv``: W_qkv's and b_qkv's gradients, accumulated here while dx is
        reduced under ``ops.async_grad_reduce`` (:meth:`TransformerOps.reduce_input_grad`;
        the state then says so and :meth:`backward_weight` leaves them)."""
        x2, q, k, v, p, ctx = state
        b, s = self._bs(x2, q)
        if p is None:
            p, c = self.core(ops, q, k, v)
            ctx = self._merge(ops, c, b, s, "attention: merge heads")
        elif self.cp is not None:
            p = (p[0], self._heads(ops, ctx, b, s, "attention: split heads"))   # (L, C)
        dyf, (dctx,) = ops.gather_matmul(ops.c.x_in, dy, (w_o.T,), "attention: gather dy",
                                         ("attention: dctx = dy W_o^T",))   # (b·s, h_l)
        h = dyf.shape[-1]
        dy2 = dyf.reshape(b * s, h)
        dq, dk, dv = self.core_backward(
            ops, self._heads(ops, dctx, b, s, "attention: split heads"), q, k, v, p)
        dqkv = ops.ew("attention: merge dq, dk, dv", lambda: np.concatenate(
            [self._merge_raw(t, b, s) for t in (dq, dk, dv)], axis=1), dq, dk, dv)
        dx = ops.matmul(dqkv, w_qkv.reshape(h, -1).T, "attention: dx = dqkv W_qkv^T")
        if g_qkv is None:
            return ops.reduce_out(dx.reshape(b, s, h), "attention: reduce dx"), \
                (x2, dqkv, ctx, dy2)
        dx, done = ops.reduce_input_grad(
            dx.reshape(b, s, h), "attention: reduce dx",
            lambda: self._qkv_grads(ops, x2, dqkv, g_qkv, gb_qkv))
        return dx, ((None, None) if done else (x2, dqkv)) + (ctx, dy2)

    @staticmethod
    def _qkv_grads(ops, x2, dqkv, g_qkv, gb_qkv) -> None:
        g_qkv += ops.matmul(x2.T, dqkv, "attention: dW_qkv = x^T dqkv").reshape(g_qkv.shape)
        gb_qkv += ops.sum_rows(dqkv, "attention: db_qkv").reshape(gb_qkv.shape)

    def backward_weight(self, ops, wstate, g_qkv, gb_qkv, g_o, gb_o) -> None:
        """Accumulate dW_qkv, db_qkv (unless :meth:`backward_input` did), dW_o, db_o (in
        place)."""
        x2, dqkv, ctx, dy2 = wstate
        if x2 is not None:
            self._qkv_grads(ops, x2, dqkv, g_qkv, gb_qkv)
        g_o += ops.matmul(ctx.T, dy2, "attention: dW_o = ctx^T dy")
        gb_o += ops.sum_rows(dy2, "attention: db_o")

    def _bs(self, x2, q):
        s = q.shape[1]
        return x2.shape[0] // s, s

    def _merge_raw(self, t, b, s):
        return t.reshape(b, self.a_l, s, self.d).transpose(0, 2, 1, 3).reshape(b * s, -1)
