"""Causal grouped-query attention (GQA) with rotary embeddings (RoPE), with or without
biases on its projections, with Megatron tensor parallelism: forward, input gradient and
weight gradient on one device.

Local shapes on one device of a tp group of t: b micro-batch, s sequence, h hidden,
a query heads, c = kv_heads key/value heads (a % c == 0), d = h/a, g = a/c query heads
per KV head; here a_l = a/t query heads and c_l = max(c/t, 1) KV heads (g = a_l/c_l).
Parameters: W_q (h, a·d) split on columns (whole heads), W_kv (h, 2, c·d) split on the
last dimension when c >= t (c % t == 0) — when c < t (t % c == 0) a rank holds the one
KV head its query heads use, replicated over t/c ranks (:mod:`tensor_parallel.llama`
sums the replicas' gradients) — and W_o (a·d, h) split on rows. Query head i uses KV
head i // g.

    forward:  xf = gather_seq(x)                      (b, s, h)      SP only: all_gather(tp)
              q = R(xf W_q),  [k | v] = xf W_kv,  k = R(k)            R: RoPE, per head
              S = q k^T / sqrt(d) + M                 (b·c_l, g·s, s) the g query heads of a
              P = softmax(S),  C = P v                (b·c_l, g·s, d) KV head stacked on rows
              y = reduce(C W_o)                       all_reduce(tp) / SP: reduce_scatter(tp)
    backward: dC = dyf W_o^T;  dP = dC v^T;  dv = P^T dC;  dS = P·(dP - rowsum(dP·P))/sqrt(d)
              dq = R^T(dS k);  dk = R^T(dS^T q)       (dv, dk sum over the g heads by the
              dx = reduce(dq W_q^T + [dk | dv] W_kv^T)  products themselves)
    weights:  dW_q = xf^T dq,  dW_kv = xf^T [dk | dv],  dW_o = C^T dyf

Biases (``GQAttention(..., qkv_bias=True, out_bias=True)``; Qwen2/Qwen2.5: q, k, v;
GPT-OSS: q, k, v and output), added before QK-norm and RoPE, and after the row-parallel
reduction:

    q = xf W_q + b_q,  [k | v] = xf W_kv + b_kv       b_q (a_l·d,), b_kv (2, c_l·d)
    y = reduce(C W_o) + b_o                           b_o (h,), on the reduced rows
    db_q = Σ_rows dq,  db_kv = Σ_rows [dk | dv],  db_o = Σ_rows dy

dq, dk are the gradients with respect to the projections' outputs, before QK-norm and
RoPE (what dW_q, dW_kv take). Over tp: b_q is split with W_q's columns (whole query
heads), b_kv with W_kv's last dimension (c >= t; when c < t each rank holds its K/V
head's bias, replicated over t/c ranks, whose gradients are summed with W_kv's by
:mod:`tensor_parallel.llama`); b_o is whole on every rank and added once, after the
all_reduce(tp) — under sequence parallelism after the reduce_scatter(tp), on the rank's
own rows. db_o sums the rows of the rank's dy: without sequence parallelism every rank
holds every row (db_o whole, equal on all ranks); with it only its sequence shard, so db_o
is partial over tp and the caller sums it over tp (``seq_partial``, as the norms'
gains). Under context parallelism the rows are the rank's chunks: every bias gradient is
partial over cp and joins the data-parallel reduction over dp × cp, as the weights'. The
adds and row sums are declared as elementwise work (0 FLOPs, as every elementwise op).

RoPE (the "rotate half" form of GPT-NeoX and Hugging Face Llama): for position p and
i < d/2, angle θ_{p,i} = p·base^(-2i/d);  R(x)_i = x_i cos θ - x_{i+d/2} sin θ,
R(x)_{i+d/2} = x_i sin θ + x_{i+d/2} cos θ; its transpose (the backward) turns by -θ.

The head dimension d is free of h (Qwen3: 32 heads x 128 = 4096 with h 2560; GPT-OSS
64 x 64 with h 2880): only W_q's and W_kv's columns and W_o's rows are a·d and c·d wide.

QK-norm (``GQAttention(..., qk_norm=eps)``, Qwen3 and OLMo 2; Hugging Face's order
q = R(N_q(x W_q)), k = R(N_k(x W_k))): N an RMSNorm of width d over each head
(:mod:`.rmsnorm`), one gain vector per side, g_q and g_k (d,), shared by all heads.
Backward: the gradient leaving R^T passes N's RMSNorm' per head before dW_q, dW_kv and
dx; the gains' gradients dg = sum over rows and heads of (gradient · xhat), this rank's
heads only (the caller sums them over tp). Declared as norm kernels with 0 FLOPs, as the
block's other norms.

FLOPs (products only): projections forward 2·b·s·h·(a_l·d + 2·c_l·d) + 2·b·s·a_l·d·h;
the causal core attention is declared at half the full count (FlashAttention's
convention: the masked half is never computed), forward 2·b·a_l·s²·d, backward twice
that (:meth:`GQAttention.core` takes values of another width d_v too, as
:mod:`.mla`'s: forward b·a_l·s²·(d + d_v)). GQA saves parameters and K/V memory, not attention FLOPs. The causal products are
declared without a GEMM shape (one causal kernel is no plain GEMM): the timing model
prices them by their FLOPs.

Sliding-window attention (``GQAttention(..., window=w)``; Mistral, GPT-OSS, Hugging
Face's convention): key j is visible to query i iff i − w < j ≤ i, so the mask M is −∞
above the diagonal and at j ≤ i − w; w >= s is plain causal attention. The products
still run over the (g·s, s) scores (the mask zeroes the old keys' probabilities) but
are declared by the pairs a windowed kernel reads: s² becomes 2·m·s − m², m = min(s,
w) (:func:`modeling.counts.causal_square`: Σ_i min(i+1, w) pairs per head, the diagonal
at half as the causal count's), and the fused kernel carries the window
(``Kernel.attention(..., window=w)``), priced by those FLOPs.

Attention sinks (``GQAttention(..., sinks=True)``, GPT-OSS): a learned logit σ_n per
query head n joins every row's softmax and its probability is dropped,

    P_ij = exp(S_ij) / (Σ_k exp(S_ik) + exp(σ_n)),    p_i = exp(σ_n) / (same) = 1 − Σ_j P_ij

so a row's weights sum to 1 − p_i. The scores' gradient is unchanged in form, dS =
P·(dP − D)/sqrt(d) with D_i = Σ_j P_ij dP_ij (the sink's column carries dP = 0), and the
sink's is dσ_n = −Σ_{rows i of head n} p_i·D_i (summed over the batch). The parameter
``sinks`` (a,) is split over tp by query heads, as W_q's columns: a rank's gradient is
whole for its heads (no tp reduction). Under context parallelism the core's merged
(O, L) take the sink after the ring: L' = logaddexp(L, σ), O' = O·exp(L − L'); the
backward runs from (O', L') unchanged (D = rowsum(dO·O')), and p_i = exp(σ − L'_i) — no
communication.

Context parallelism (``GQAttention(..., cp=ContextParallelAttention(..., group=g))``):
the rows are this rank's sequence chunks, RoPE turns them by their global positions
(``Rope(..., positions=)``) and the core attention is the operation's
``forward_local`` / ``backward_local`` with the g query heads of a K/V head on rows, as
here; only the c_l K/V heads travel.
"""

from __future__ import annotations

import math

import numpy as np

from modeling.counts import causal_square
from vcluster.runtime.tracing import MetaArray, is_meta
from vcluster.runtime.tracing.kernel import Kernel

from .attention import flash_block, flash_grads
from .rmsnorm import rms_norm, rms_norm_gain_grad, rms_norm_grad

__all__ = ["GQAttention", "Rope", "causal_bmm"]


def causal_bmm(dev, a, b, name: str, seq: int | None = None, window: int | None = None):
    """a @ b over a leading batch, (n, m, k) @ (n, k, p), one of causal attention's
    products: declared n·m·k·p FLOPs, half of the full 2·n·m·k·p; under a sliding
    ``window`` over ``seq`` positions n·m·k·p·causal_square(s, w)/s² (two of m, k, p
    are s or a multiple of it: the count is whole)."""
    n, m, k = a.shape
    p = b.shape[-1]
    itemsize = np.dtype(a.dtype).itemsize
    flops = n * m * k * p
    if window is not None and window < seq:
        flops = flops * causal_square(seq, window) // (seq * seq)
    with dev.compute(name, flops=flops, bytes=n * (m * k + k * p + m * p) * itemsize,
                     gemm=(n, m, k, p)):     # the kernel computes the full product, then masks
        return dev.xp.matmul(a, b)


class Rope:
    """Rotary embeddings of head dimension d with base ``theta``; the (s, d) cos / sin
    tables are built once per sequence length (declared as elementwise work).
    ``positions``: the global positions of the rows (a sequence of ints, e.g. a context-
    parallel rank's chunks, :func:`~tensor_parallel.context_parallel.sequence_positions`);
    default 0, 1, ..., s-1."""

    def __init__(self, head_dim: int, theta: float, positions=None):
        self.d, self.theta = head_dim, float(theta)
        self.positions = None if positions is None else tuple(int(p) for p in positions)
        self._tables: dict = {}

    def __repr__(self) -> str:
        at = "" if self.positions is None else f", positions={len(self.positions)} rows"
        return f"Rope(head_dim={self.d}, theta={self.theta}{at})"

    def tables(self, ops, s: int, dtype, meta: bool = False):
        """(cos, sin), each (s, 1, d): [cos θ | cos θ] and [-sin θ | sin θ]. ``meta``: a
        traced program's (shape and dtype only: a trace never reads their values, and a
        long sequence's real tables cost ~0.07 s each at s = 8192)."""
        key = (s, np.dtype(dtype).name, meta)
        if key not in self._tables:
            nbytes = 2 * s * self.d * np.dtype(dtype).itemsize
            with ops.dev.compute("gpt: attention: rope cos, sin tables", flops=0, bytes=nbytes,
                                 kernel=Kernel.elementwise(2 * s * self.d)):
                xp, half = ops.xp, self.d // 2
                if self.positions is not None and len(self.positions) != s:
                    raise ValueError(f"{self!r}: {s} rows given, the positions name "
                                     f"{len(self.positions)}")
                if meta:
                    self._tables[key] = (MetaArray((s, 1, self.d), dtype),) * 2
                else:
                    inv = self.theta ** (-2.0 * xp.arange(half) / self.d)
                    pos = xp.arange(s) if self.positions is None else xp.asarray(self.positions)
                    angle = pos[:, None] * inv[None, :]                       # (s, d/2)
                    cos, sin = np.cos(angle), np.sin(angle)
                    self._tables[key] = tuple(
                        np.concatenate(t, axis=1).reshape(s, 1, self.d).astype(dtype)
                        for t in ((cos, cos), (-sin, sin)))
        return self._tables[key]

    def apply(self, ops, x, b: int, s: int, name: str, inverse: bool = False):
        """R(x) (or R^T(x)) for x (b·s, n·d): pairs (i, i + d/2) of each head turned by θ."""
        cos, sin = self.tables(ops, s, x.dtype, meta=is_meta(x))
        half = self.d // 2

        def fn():
            t = x.reshape(b, s, -1, self.d)                              # (b, s, n, d)
            swapped = np.concatenate([t[..., half:], t[..., :half]], axis=-1)
            # R: x cos + [x_hi | x_lo]·[-sin | sin];  R^T: y cos + [y_hi | y_lo]·[sin | -sin]
            return (t * cos + swapped * (-sin if inverse else sin)).reshape(x.shape)

        return ops.ew(name, fn, x)


class GQAttention:
    """The block's math on one device (see the module docstring); the caller keeps the
    per-micro-batch state (``forward`` returns it, the backward passes take it back).
    ``qk_norm``: QK-norm's eps (None: no QK-norm); its gains (g_q, g_k) are then passed
    to every pass (``qk_gains``), and their gradients to :meth:`backward_weight`.
    ``window``: the sliding window w (None: every earlier key; a context-parallel ``cp``
    takes it too); ``sinks``: attention sinks, whose (a_l,) logits are then passed to
    every pass (``sinks=``) and their gradient to :meth:`backward_weight`.
    ``qkv_bias``, ``out_bias``: biases on the q, k, v and on the output projections,
    whose local pieces (b_q, b_kv, b_o; None where absent) are then passed to every pass
    (``biases=``) and their gradients to :meth:`backward_input` and
    :meth:`backward_weight` (``bias_grads=``)."""

    def __init__(self, heads_local: int, kv_heads_local: int, head_dim: int, rope: Rope,
                 cp=None, qk_norm: float | None = None, window: int | None = None,
                 sinks: bool = False, qkv_bias: bool = False, out_bias: bool = False):
        if heads_local % kv_heads_local:
            raise ValueError(f"GQAttention: heads_local={heads_local} is not a multiple of "
                             f"kv_heads_local={kv_heads_local}")
        if qk_norm is not None and not (isinstance(qk_norm, (int, float)) and qk_norm > 0):
            raise ValueError(f"GQAttention: qk_norm must be None or the norm's eps > 0, got "
                             f"{qk_norm!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(
                window, (int, np.integer)) or window < 1):
            raise ValueError(f"GQAttention: window must be None or an int >= 1, got "
                             f"{window!r}")
        for name, flag in (("sinks", sinks), ("qkv_bias", qkv_bias), ("out_bias", out_bias)):
            if flag not in (False, True):
                raise ValueError(f"GQAttention: {name} must be True or False, got {flag!r}")
        self.a_l, self.c_l, self.d = heads_local, kv_heads_local, head_dim
        self.g = heads_local // kv_heads_local
        self.window, self.sinks = None if window is None else int(window), bool(sinks)
        if cp is not None and self.window is not None:
            cp = cp.windowed(self.window)
        self.scale, self.rope, self.cp = 1.0 / math.sqrt(head_dim), rope, cp
        self.qk_norm = qk_norm
        self.qkv_bias, self.out_bias = bool(qkv_bias), bool(out_bias)

    def __repr__(self) -> str:
        norm = "" if self.qk_norm is None else f", qk_norm={self.qk_norm}"
        norm += "" if self.window is None else f", window={self.window}"
        norm += ", sinks=True" if self.sinks else ""
        norm += ", qkv_bias=True" if self.qkv_bias else ""
        norm += ", out_bias=True" if self.out_bias else ""
        return (f"GQAttention(heads_local={self.a_l}, kv_heads_local={self.c_l}, "
                f"d={self.d}{norm})")

    # --- QK-norm: an RMSNorm of width d on each head of (rows, n·d) ------------------
    def _head_norm(self, ops, t, g, name):
        """(N(t), state) for t (rows, n·d): each head's d values normalised, times g."""
        rows = t.shape[0]
        y, state = rms_norm(ops, t.reshape(rows, -1, self.d), g, self.qk_norm, name)
        return y.reshape(t.shape), state                          # state: (rows, n, d|1)

    def _head_norm_grad(self, ops, dy, state, g, name):
        """N's input gradient of dy (rows, n·d)."""
        rows = dy.shape[0]
        return rms_norm_grad(ops, dy.reshape(rows, -1, self.d), state, g, name) \
            .reshape(dy.shape)

    # --- layouts ----------------------------------------------------------------------
    def _q_group(self, ops, t, b, s, name):
        """(b·s, a_l·d) -> (b·c_l, g·s, d): the query heads of one KV head on rows."""
        return ops.ew(name, lambda: t.reshape(b, s, self.c_l, self.g, self.d)
                      .transpose(0, 2, 3, 1, 4).reshape(b * self.c_l, self.g * s, self.d), t)

    def _q_merge(self, ops, t, b, s, name):
        """(b·c_l, g·s, d) -> (b·s, a_l·d)."""
        return ops.ew(name, lambda: t.reshape(b, self.c_l, self.g, s, self.d)
                      .transpose(0, 3, 1, 2, 4).reshape(b * s, self.a_l * self.d), t)

    def _kv_heads(self, ops, t, b, s, name):
        """(b·s, c_l·d) -> (b·c_l, s, d)."""
        return ops.ew(name, lambda: t.reshape(b, s, self.c_l, self.d).transpose(0, 2, 1, 3)
                      .reshape(b * self.c_l, s, self.d), t)

    def _kv_merge(self, ops, t, b, s, name):
        """(b·c_l, s, d) -> (b·s, c_l·d)."""
        return ops.ew(name, lambda: t.reshape(b, self.c_l, s, self.d).transpose(0, 2, 1, 3)
                      .reshape(b * s, self.c_l * self.d), t)

    # --- core attention ---------------------------------------------------------------
    def core(self, ops, q, k, v, sinks=None):
        """P = softmax(q k^T / sqrt(d) + M), C = P v; q (b·c_l, g·s, d), k, v (b·c_l, s, d);
        under context parallelism ((L, C), C): the row log-sum-exp L stands in for P.
        ``sinks``: this rank's (a_l,) sink logits (with ``self.sinks``)."""
        if self.cp is not None:
            c, lse = self.cp.forward_local(ops.dev, q, k, v)
            if sinks is not None:           # the sink joins each row's denominator
                col = self._sink_column(lse, sinks)

                def sink():
                    full = np.logaddexp(lse, col)
                    return c * np.exp(lse - full), full
                c, lse = ops.ew("attention: sink", sink, c, lse, c)
            return (lse, c), c
        n, s, d = k.shape
        dv = v.shape[2]     # the values' width (d; MLA's v_head_dim, :mod:`.mla`)
        if ops.flash:       # declared as causal_bmm declares: half the full s² products
            with flash_block(ops, "attention: flash forward",
                             n * self.g * causal_square(s, self.window) * (d + dv),
                             (q, k, v, q), n * self.g, s, (d + dv) // 2, backward=False,
                             window=self.window):
                p = self._probs(ops, ops.xp.matmul(q, k.transpose(0, 2, 1)), sinks)
                return p, ops.xp.matmul(p, v)
        scores = self._bmm(ops, q, k.transpose(0, 2, 1), "attention: q @ k^T", s)
        p = ops.ew("attention: causal softmax", lambda: self._probs(ops, scores, sinks),
                   scores)
        return p, self._bmm(ops, p, v, "attention: P @ v", s)

    def _sink_column(self, like, sinks):
        """The sink logit of each row of a q-shaped ``like`` (b·c_l, g·s, ·): (b·c_l, g·s,
        1), row r of K/V head c holding query head c·g + r // s's (built from ``like``'s
        shape so that it is shape-only in a trace)."""
        n, rows = like.shape[0], like.shape[1]
        zero = np.zeros_like(like[:, :, :1]).reshape(n // self.c_l, self.c_l, self.g,
                                                     rows // self.g)
        return (zero + sinks.reshape(1, self.c_l, self.g, 1)).reshape(n, rows, 1)

    def _sink_grad(self, psink, delta):
        """dσ (a_l,) = −Σ over the batch and each head's rows of p_i·D_i, from (b·c_l, g·s,
        1) row arrays."""
        n, rows = psink.shape[0], psink.shape[1]
        per_row = (-psink * delta).reshape(n // self.c_l, self.c_l, self.g, rows // self.g)
        return per_row.sum(axis=(0, 3)).reshape(self.a_l)

    def _probs(self, ops, scores, sinks=None):
        """softmax(scores·scale + M) over (n, g·s, s) scores (row r is query position r mod
        s; M: −big above the diagonal and, with a window w, at keys j <= i − w), with the
        sink logits in the denominator when ``sinks`` is given."""
        s = scores.shape[2]
        big = np.finfo(scores.dtype).max / 2    # exp(-big - max) is exactly 0, as exp(-inf)
        # future[0, r, j] = j > (r mod s); with a window also j <= (r mod s) - w. Row r
        # mod s built from scores' (1, g·s, 1) column seen as (1, g, s, 1), so that it is
        # shape-only in a trace (at 128K tokens a real column of g·s rows cost ~10 ms a call)
        pos = ops.xp.arange(s)
        at = (np.zeros_like(scores[:1, :, :1]).reshape(1, self.g, s, 1)
              + pos[:, None]).reshape(1, self.g * s, 1)
        masked = at < pos
        if self.window is not None and self.window < s:
            masked = masked + (at - self.window >= pos)                   # boolean or
        z = scores * self.scale - masked * big
        if sinks is None:
            e = np.exp(z - z.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)
        col = self._sink_column(scores, sinks)
        m = np.maximum(z.max(axis=-1, keepdims=True), col)
        e = np.exp(z - m)
        return e / (e.sum(axis=-1, keepdims=True) + np.exp(col - m))

    def core_backward(self, ops, dc, q, k, v, p, sinks=None):
        """(dq, dk, dv) from dC (b·c_l, g·s, d), in q's, k's and v's layouts (``p``: core's
        first output); with ``sinks`` (the (a_l,) logits) (dq, dk, dv, dσ)."""
        if self.cp is not None:
            lse, c = p
            grads = self.cp.backward_local(ops.dev, q, k, v, c, lse, dc)
            if sinks is None:
                return grads
            col = self._sink_column(lse, sinks)
            dsink = ops.ew("attention: sink grad", lambda: self._sink_grad(
                np.exp(col - lse), (dc * c).sum(axis=-1, keepdims=True)), dc, c, lse)
            return (*grads, dsink)
        if ops.flash:
            (n, s, d), dv = k.shape, v.shape[2]
            with flash_block(ops, "attention: flash backward",
                             2 * n * self.g * causal_square(s, self.window) * (d + dv),
                             (q, k, v, dc, dc, q, k, v), n * self.g, s, (d + dv) // 2,
                             backward=True, window=self.window):
                if sinks is None:
                    return flash_grads(ops.xp, dc, q, k, v, p, self.scale)
                xp = ops.xp
                dp = xp.matmul(dc, v.transpose(0, 2, 1))
                delta = (dp * p).sum(axis=-1, keepdims=True)
                ds = p * (dp - delta) * self.scale
                return (xp.matmul(ds, k), xp.matmul(ds.transpose(0, 2, 1), q),
                        xp.matmul(p.transpose(0, 2, 1), dc),
                        self._sink_grad(1 - p.sum(axis=-1, keepdims=True), delta))
        s = k.shape[1]
        dp = self._bmm(ops, dc, v.transpose(0, 2, 1), "attention: dP = dC v^T", s)
        dv = self._bmm(ops, p.transpose(0, 2, 1), dc, "attention: dv = P^T dC", s)
        delta = None if sinks is None else ops.ew(
            "attention: D = rowsum(dP P)", lambda: (dp * p).sum(axis=-1, keepdims=True), dp, p)
        ds = ops.ew("attention: softmax grad", lambda: p * (dp - (
            (dp * p).sum(axis=-1, keepdims=True) if delta is None else delta)) * self.scale,
            dp, p)
        dq = self._bmm(ops, ds, k, "attention: dq = dS k", s)
        dk = self._bmm(ops, ds.transpose(0, 2, 1), q, "attention: dk = dS^T q", s)
        if sinks is None:
            return dq, dk, dv
        dsink = ops.ew("attention: sink grad", lambda: self._sink_grad(
            1 - p.sum(axis=-1, keepdims=True), delta), p, delta)
        return dq, dk, dv, dsink

    # --- the block --------------------------------------------------------------------
    def forward(self, ops, x, w_q, w_kv, w_o, keep: str = "all", qk_gains=None, sinks=None,
                biases=None):
        """y (x's layout) and the backward's state: ``keep`` = "all", "qkv" (selective
        recomputation: not P nor C), "op" (torchtitan's per-op policy: :meth:`recompute_op`)
        or "none"; ``qk_gains``: (g_q, g_k) with QK-norm;
        ``sinks``: the (a_l,) sink logits with attention sinks; ``biases``: (b_q, b_kv, b_o)
        with ``qkv_bias`` or ``out_bias`` (None where absent)."""
        xf, (q, kv) = ops.gather_matmul(                  # (b, s, h); (b·s, a_l·d); (b·s, 2·c_l·d)
            ops.c.x_in, x, (w_q, w_kv.reshape(x.shape[-1], -1)), "attention: gather x",
            ("attention: x @ W_q", "attention: x @ W_kv"))
        b, s, h = xf.shape
        x2 = xf.reshape(b * s, h)
        if self.qkv_bias:
            q = ops.add_bias(q, biases[0], "attention: + b_q")
            kv = ops.add_bias(kv, biases[1].reshape(-1), "attention: + b_kv")
        kd = self.c_l * self.d
        qm, vm = q, kv[:, kd:]
        q, k, v, norms = self._heads(ops, qm, kv[:, :kd], vm, b, s, qk_gains, "")
        p, c = self.core(ops, q, k, v, sinks)
        if self.cp is not None:
            p = p[:1]           # L only: the backward takes C back from ctx (one copy kept)
        ctx = self._q_merge(ops, c, b, s, "attention: merge heads")         # (b·s, a_l·d)
        reduced = ops.matmul_reduce(ops.c.y_out, ctx, w_o, (b, s, h), "attention: ctx @ W_o",
                                    "attention: reduce y")
        y = self._out_bias(ops, reduced, biases, "")
        if keep == "op":        # torchtitan's per-op policy: see recompute_op
            return y, (qm, vm, p, ctx, reduced if ops.sequence_parallel else None)
        state = {"all": (x2, q, k, v, p, ctx, norms),
                 "qkv": (x2, q, k, v, None, None, norms), "none": ()}[keep]
        return y, state

    def _out_bias(self, ops, y, biases, tag: str):
        """y + b_o (on this rank's rows, after the reduction) with ``out_bias``, else y."""
        if not self.out_bias:
            return y
        return ops.add_bias(y, biases[2], f"attention: + b_o{tag}")

    def _heads(self, ops, q, k, v, b: int, s: int, qk_gains, tag: str):
        """(q, k, v, norms): the projections (b·s, ·) as the core takes them — QK-norm
        (``qk_gains``), RoPE, heads split — and the QK-norms' states (None without)."""
        norms = None
        if self.qk_norm is not None:
            q, nq = self._head_norm(ops, q, qk_gains[0], f"attention: q norm{tag}")
            k, nk = self._head_norm(ops, k, qk_gains[1], f"attention: k norm{tag}")
            norms = (nq, nk)
        q = self._q_group(ops, self.rope.apply(ops, q, b, s, f"attention: rope q{tag}"), b, s,
                          f"attention: split heads{tag}")
        k = self._kv_heads(ops, self.rope.apply(ops, k, b, s, f"attention: rope k{tag}"),
                           b, s, f"attention: split heads{tag}")
        v = self._kv_heads(ops, v, b, s, f"attention: split heads{tag}")
        return q, k, v, norms

    def recompute_op(self, ops, x, state, w_q, w_kv, w_o, qk_gains=None, biases=None):
        """(y, the "all" state) from the state ``forward(keep="op")`` kept — W_q's and
        W_v's products (their biases added), the attention kernel's P and C, and the
        reduced W_o product where a reduce-scatter produced it (sequence parallelism) —
        and the block's input ``x``, as torchtitan's per-op policy re-runs the rest in
        the backward: the sequence-parallel gather, the K product (W_kv's first half, and
        b_k), QK-norm, RoPE, the W_o product with its reduction where y was not kept (an
        all-reduce's output is not saved) and b_o's add."""
        qm, vm, p, ctx, y = state
        xf = ops.gather_seq(x, "attention: gather x (recompute)")
        b, s, h = xf.shape
        x2 = xf.reshape(b * s, h)
        w_k = w_kv.reshape(h, 2, -1)[:, 0]
        km = ops.matmul(x2, w_k, "attention: x @ W_k (recompute)")
        if self.qkv_bias:
            km = ops.add_bias(km, biases[1][0], "attention: + b_k (recompute)")
        q, k, v, norms = self._heads(ops, qm, km, vm, b, s, qk_gains, " (recompute)")
        if y is None:
            y = ops.matmul_reduce(ops.c.y_out, ctx, w_o, (b, s, h),
                                  "attention: ctx @ W_o (recompute)",
                                  "attention: reduce y (recompute)")
        return self._out_bias(ops, y, biases, " (recompute)"), (x2, q, k, v, p, ctx, norms)

    def backward_input(self, ops, state, dy, w_q, w_kv, w_o, g_q=None, g_kv=None,
                       qk_gains=None, sinks=None, bias_grads=None):
        """dx (x's layout) and the weight gradient's state (P and C recomputed first when
        the state holds none: selective recomputation). ``g_q``, ``g_kv``: W_q's and
        W_kv's gradients, accumulated here while dx is reduced under
        ``ops.async_grad_reduce`` (``TransformerOps.reduce_input_grad``; the state then
        says so and :meth:`backward_weight` leaves them), with ``qkv_bias`` b_q's and
        b_kv's too (``bias_grads``: (db_q, db_kv, ...)). ``qk_gains``: (g_q, g_k) with
        QK-norm; ``sinks``: the sink logits with attention sinks (their gradient rides in
        the weight gradient's state)."""
        x2, q, k, v, p, ctx, norms = state
        b, s = x2.shape[0] // k.shape[1], k.shape[1]
        if p is None:
            p, c = self.core(ops, q, k, v, sinks)
            ctx = self._q_merge(ops, c, b, s, "attention: merge heads")
        elif self.cp is not None:
            p = (p[0], self._q_group(ops, ctx, b, s, "attention: split heads"))  # (L, C)
        dyf, (dctx,) = ops.gather_matmul(ops.c.x_in, dy, (w_o.T,), "attention: gather dy",
                                         ("attention: dctx = dy W_o^T",))   # (b·s, a_l·d)
        h = dyf.shape[-1]
        dy2 = dyf.reshape(b * s, h)
        dyb = dy if self.out_bias else None      # this rank's rows of dy: db_o's
        grads = self.core_backward(
            ops, self._q_group(ops, dctx, b, s, "attention: split heads"), q, k, v, p, sinks)
        (dq, dk, dv), dsink = grads[:3], (grads[3] if sinks is not None else None)
        dq = self.rope.apply(ops, self._q_merge(ops, dq, b, s, "attention: merge dq"), b, s,
                             "attention: rope^T dq", inverse=True)          # (b·s, a_l·d)
        dk = self.rope.apply(ops, self._kv_merge(ops, dk, b, s, "attention: merge dk"), b, s,
                             "attention: rope^T dk", inverse=True)
        gains = None                    # QK-norm: (dN_q, xhat_q, dN_k, xhat_k) for the gains
        if norms is not None:
            (nq, nk), dqn, dkn = norms, dq, dk
            dq = self._head_norm_grad(ops, dqn, nq, qk_gains[0], "attention: q norm grad")
            dk = self._head_norm_grad(ops, dkn, nk, qk_gains[1], "attention: k norm grad")
            gains = (dqn, nq[0], dkn, nk[0])
        dkv = ops.ew("attention: merge dk, dv", lambda: np.concatenate(
            [dk, self._kv_merge_raw(dv, b, s)], axis=1), dk, dv)            # (b·s, 2·c_l·d)
        dxq = ops.matmul(dq, w_q.T, "attention: dx = dq W_q^T")
        dxkv = ops.matmul(dkv, w_kv.reshape(h, -1).T, "attention: dx += dkv W_kv^T")
        dx = ops.ew("attention: add dx", lambda: dxq + dxkv, dxq, dxkv).reshape(b, s, h)
        if g_q is None:
            return ops.reduce_out(dx, "attention: reduce dx"), \
                (x2, dq, dkv, ctx, dy2, gains, dsink, dyb)
        gb = bias_grads[:2] if self.qkv_bias else (None, None)
        dx, done = ops.reduce_input_grad(dx, "attention: reduce dx",
                                         lambda: self._qkv_grads(ops, x2, dq, dkv, g_q, g_kv,
                                                                 *gb))
        return dx, ((None, None, None) if done else (x2, dq, dkv)) + (ctx, dy2, gains, dsink,
                                                                      dyb)

    @staticmethod
    def _qkv_grads(ops, x2, dq, dkv, g_q, g_kv, gb_q=None, gb_kv=None) -> None:
        """dW_q, dW_kv (and with the biases' gradients ``gb_q``, ``gb_kv`` db_q = Σ_rows
        dq, db_kv = Σ_rows dkv) accumulated in place."""
        g_q += ops.matmul(x2.T, dq, "attention: dW_q = x^T dq")
        g_kv += ops.matmul(x2.T, dkv, "attention: dW_kv = x^T dkv").reshape(g_kv.shape)
        if gb_q is not None:
            gb_q += ops.sum_rows(dq, "attention: db_q")
            gb_kv += ops.sum_rows(dkv, "attention: db_kv").reshape(gb_kv.shape)

    def backward_weight(self, ops, wstate, g_q, g_kv, g_o, qk_gain_grads=None,
                        sink_grad=None, bias_grads=None) -> None:
        """Accumulate dW_q, dW_kv (unless :meth:`backward_input` did), dW_o, with QK-norm
        this rank's part of the gains' gradients ``qk_gain_grads``, with attention
        sinks the sinks' gradient ``sink_grad`` (whole for this rank's heads) and with
        biases ``bias_grads`` (db_q, db_kv, db_o; None where absent): db_q, db_kv with
        dW_q, dW_kv; db_o over this rank's rows of dy (partial over tp under sequence
        parallelism: the caller sums it) (in place)."""
        x2, dq, dkv, ctx, dy2, gains, dsink, dyb = wstate
        if dsink is not None:
            ops.ew("attention: sinks' gradient", lambda: np.add(sink_grad, dsink,
                                                                 out=sink_grad), dsink)
        if x2 is not None:
            self._qkv_grads(ops, x2, dq, dkv, g_q, g_kv,
                            *(bias_grads[:2] if self.qkv_bias else ()))
        g_o += ops.matmul(ctx.T, dy2, "attention: dW_o = ctx^T dy")
        if dyb is not None:
            gb_o = bias_grads[2]
            gb_o += ops.sum_rows(dyb, "attention: db_o")
        if gains is not None:
            dqn, xq, dkn, xk = gains
            rows = dqn.shape[0]
            rms_norm_gain_grad(ops, dqn.reshape(rows, -1, self.d), xq, qk_gain_grads[0],
                               "attention: q norm gain grad")
            rms_norm_gain_grad(ops, dkn.reshape(rows, -1, self.d), xk, qk_gain_grads[1],
                               "attention: k norm gain grad")

    def _bmm(self, ops, a, b, name, seq: int):
        return causal_bmm(ops.dev, a, b, f"gpt: {name}", seq, self.window)

    def _kv_merge_raw(self, t, b, s):
        return t.reshape(b, self.c_l, s, self.d).transpose(0, 2, 1, 3).reshape(b * s, -1)
