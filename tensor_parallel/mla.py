"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with Megatron-Core's tensor
parallelism: forward, input gradient and weight gradient on one device.

Shapes on one device of a tp group of t: b micro-batch, s sequence, h hidden, a heads
(a_l = a/t here), d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_qk = d_n + d_r,
d_v = v_head_dim, r_q = q_lora_rank (None: no query compression), r_kv = kv_lora_rank.
Parameters (Hugging Face DeepseekV3Attention's, column order per head as its views):

    w_q_a (h, r_q), q_a_norm_g (r_q,), w_q_b (r_q, a·d_qk)   or, without r_q, w_q (h, a·d_qk)
    w_kv_a (h, r_kv + d_r), kv_a_norm_g (r_kv,), w_kv_b (r_kv, a·(d_n + d_v)), w_o (a·d_v, h)

    forward:  xf = gather_seq(x)                                  SP only: all_gather(tp)
              c_q = N_q(xf W_qa);  q = c_q W_qb                   (or q = xf W_q)
              [c_kv0 | k_pe] = xf W_kva;  c_kv = N_kv(c_kv0);  kv = c_kv W_kvb
              per head: q = [q_nope | R(q_pe)],  k = [k_nope | R(k_pe)],  [k_nope | v] = kv
              (k_pe: ONE rotary key of d_r shared by every head, broadcast)
              C = softmax(q k^T / sqrt(d_qk) + M) v               (b·a_l, s, d_v)
              y = reduce(concat_heads(C) W_o)          all_reduce(tp) / SP: reduce_scatter(tp)
    backward: dC = dyf W_o^T;  (dq, dk, dv) of the causal core;  dq_pe = R^T(dq_pe),
              dk_pe = R^T(sum over heads of dk_pe);  dkv = [dk_nope | dv]
              dc_q = N_q'(dq W_qb^T);  dc_kv = N_kv'(dkv W_kvb^T)
              dx = reduce(dc_q W_qa^T + [dc_kv | dk_pe] W_kva^T)   ONE reduce of the sum
    weights:  dW_qa = xf^T dc_q, dW_qb = c_q^T dq, dW_kva = xf^T [dc_kv | dk_pe],
              dW_kvb = c_kv^T dkv, dW_o = ctx^T dyf, the norms' gains rowsum(d·xhat)

N an RMSNorm (:mod:`.rmsnorm`, eps of the block), R RoPE of width d_r (:class:`~.gqa.Rope`,
the "rotate half" pairing; DeepSeek's checkpoints pair interleaved columns, the same map
up to a fixed permutation of W_qb's and W_kva's rotary columns). YaRN's softmax scale
(mscale) is a scalar the timing does not see and is left out: the scale is 1/sqrt(d_qk).

Tensor parallelism (Megatron-Core's MLA): the heads split over tp — W_qb, W_q and W_kvb
column-parallel by whole heads, W_o row-parallel — while the down-projections W_qa,
W_kva and the two latent norms' gains are replicated: every tp rank computes c_q, c_kv
and k_pe from the same (gathered) x, redundantly ((t - 1)·2·b·s·h·(r_q + r_kv + d_r)
forward FLOPs per layer over the group beyond the model's count). Their gradients on a
rank hold only its heads' part (dc_q, dc_kv and dk_pe come from its heads): the layer
sums them over tp once per step (:meth:`~.llama.LlamaLayer.backward_weight`, as the
QK-norm gains), every micro-batch under ZeRO-2/3. Likewise dx: each rank's is its heads'
part through the replicated down-projections, so one reduction of the sum closes the
block, as the Llama attention's single reduction of dq W_q^T + dkv W_kv^T. Under
``ops.async_grad_reduce`` the x-side gradients (dW_qa or dW_q, and dW_kva) are computed
while dx is reduced.

Recomputation (``mla_up_proj``, Megatron-Core's recompute module: the layer sets
:attr:`MLAttention.recompute_up`): the forward keeps the latents c_q (or x), c_kv and the
raw k_pe instead of the per-head q, k and v, and the backward re-runs the up-projections
and RoPE first: + 2·b·s·(r_q·a_l·d_qk + r_kv·a_l·(d_n + d_v)) FLOPs (without r_q
h·a_l·d_qk for the first), and RoPE's bytes.

FLOPs (products only): forward 2·b·s·(h·r_q + r_q·a_l·d_qk + h·(r_kv + d_r) +
r_kv·a_l·(d_n + d_v) + a_l·d_v·h) (without r_q: h·a_l·d_qk for the first two) plus the
causal core at half the full count, b·a_l·s²·(d_qk + d_v) (:meth:`~.gqa.GQAttention.core`
with values d_v wide); the backward twice the forward.

Context parallelism (``cp=ContextParallelAttention(a_l, d_qk, ..., v_head_dim=d_v)``):
the rows are this rank's sequence chunks, R turns them by their global positions, and
the up-projected k (a_l·d_qk per row) and v (a_l·d_v) travel around the ring (or are
all-gathered) — the form modelled here. (The latent c_kv and k_pe, r_kv + d_r per row,
could travel instead and be up-projected on arrival: less traffic for more FLOPs; not
modelled.)
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from .gqa import GQAttention, Rope
from .rmsnorm import rms_norm, rms_norm_gain_grad, rms_norm_grad

__all__ = ["MLAttention", "mla_names", "MLA_SPLIT", "MLA_REPLICATED"]

#: the dimension of each MLA parameter split over tp (whole heads); the others whole
MLA_SPLIT = MappingProxyType({"w_q": 1, "w_q_b": 1, "w_kv_b": 1, "w_o": 0})
#: the parameters replicated over tp whose gradients are partial (summed over tp)
MLA_REPLICATED = ("w_q_a", "q_a_norm_g", "w_kv_a", "kv_a_norm_g")


def mla_names(q_lora: bool) -> tuple[str, ...]:
    """The attention's parameter names in the model's order: with query compression
    (``q_lora``) w_q_a, q_a_norm_g, w_q_b, else w_q; then w_kv_a, kv_a_norm_g, w_kv_b, w_o."""
    return (("w_q_a", "q_a_norm_g", "w_q_b") if q_lora else ("w_q",)) + (
        "w_kv_a", "kv_a_norm_g", "w_kv_b", "w_o")


def _count(what: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"MLAttention: {what} must be an int >= 1"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


class MLAttention:
    """The block's math on one device (see the module docstring) for ``heads_local``
    heads; ``rope`` a :class:`~.gqa.Rope` of width qk_rope_head_dim, ``cp`` a
    ContextParallelAttention (group 1, v_head_dim d_v) or None, ``eps`` the latent norms'.
    The caller keeps the per-micro-batch state (``forward`` returns it, the backward
    passes take it back) and passes the parameters (and gradients) by name
    (:attr:`names`)."""

    def __init__(self, heads_local: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: Rope,
                 cp=None, eps: float = 1e-5):
        self.a_l = _count("heads_local", heads_local)
        self.r_q = _count("q_lora_rank", q_lora_rank, allow_none=True)
        self.r_kv = _count("kv_lora_rank", kv_lora_rank)
        self.d_n, self.d_r = _count("qk_nope_head_dim", qk_nope_head_dim), \
            _count("qk_rope_head_dim", qk_rope_head_dim)
        self.d_v, self.d_qk = _count("v_head_dim", v_head_dim), self.d_n + self.d_r
        if rope.d != self.d_r:
            raise ValueError(f"MLAttention: the rope's width {rope.d} must be "
                             f"qk_rope_head_dim={self.d_r}")
        if cp is not None and (cp.group != 1 or cp.head_dim != self.d_qk
                               or cp.v_head_dim != self.d_v):
            raise ValueError(f"MLAttention: {cp!r} must have group 1, head_dim {self.d_qk} "
                             f"and v_head_dim {self.d_v}")
        self.rope, self.cp, self.eps = rope, cp, eps
        self.recompute_up = False      # mla_up_proj (the layer sets it): see forward
        self.qk_norm = None                  # (the layer asks: MLA has no QK-norm)
        # the causal core: a GQAttention of one query head per K/V head, scale 1/sqrt(d_qk)
        self.core_attn = GQAttention(self.a_l, self.a_l, self.d_qk, rope, cp)
        self.names = mla_names(self.r_q is not None)
        self.replicated = tuple(n for n in MLA_REPLICATED if n in self.names)

    @classmethod
    def of_spec(cls, spec, tp: int, rope_theta: float, positions=None, cp=None,
                eps: float = 1e-5) -> "MLAttention":
        """The attention of a :class:`~modeling.spec.LatentAttention` ``spec`` on one of
        ``tp`` ranks (its heads a multiple of tp), RoPE base ``rope_theta`` at
        ``positions`` (context parallelism; default 0..s-1)."""
        return cls(spec.heads // tp, spec.q_lora_rank, spec.kv_lora_rank,
                   spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                   Rope(spec.qk_rope_head_dim, rope_theta, positions), cp, eps)

    def __repr__(self) -> str:
        return (f"MLAttention(heads_local={self.a_l}, q_lora_rank={self.r_q}, "
                f"kv_lora_rank={self.r_kv}, qk={self.d_n}+{self.d_r}, v={self.d_v})")

    # --- layouts ------------------------------------------------------------------------
    @staticmethod
    def _heads_raw(t, b, s):
        """(b·s, n, w) -> (b·n, s, w)."""
        n, w = t.shape[1], t.shape[2]
        return t.reshape(b, s, n, w).transpose(0, 2, 1, 3).reshape(b * n, s, w)

    @staticmethod
    def _merge_raw(t, b, s):
        """(b·n, s, w) -> (b·s, n·w)."""
        w = t.shape[2]
        return t.reshape(b, -1, s, w).transpose(0, 2, 1, 3).reshape(b * s, -1)

    def _q_heads(self, ops, q, b, s):
        """q (b·s, a_l·d_qk) -> (b·a_l, s, d_qk) with RoPE on each head's last d_r."""
        a, dn, dr, d = self.a_l, self.d_n, self.d_r, self.d_qk
        pe = ops.ew("attention: split q_pe", lambda: q.reshape(b * s, a, d)[:, :, dn:]
                    .reshape(b * s, a * dr), q)
        pe = self.rope.apply(ops, pe, b, s, "attention: rope q_pe")
        return ops.ew("attention: [q_nope | q_pe], split heads", lambda: self._heads_raw(
            np.concatenate([q.reshape(b * s, a, d)[:, :, :dn], pe.reshape(b * s, a, dr)],
                           axis=2), b, s), q, pe)

    def _kv_heads(self, ops, kv, k_pe, b, s):
        """(k, v) (b·a_l, s, d_qk), (b·a_l, s, d_v) from kv (b·s, a_l·(d_n + d_v)) and the
        shared rotary key k_pe (b·s, d_r), turned here and broadcast to every head."""
        a, dn, dv = self.a_l, self.d_n, self.d_v
        pe = self.rope.apply(ops, k_pe, b, s, "attention: rope k_pe")          # (b·s, d_r)

        def k():
            t = kv.reshape(b * s, a, dn + dv)
            shared = np.zeros_like(t[:, :, :1]) + pe.reshape(b * s, 1, self.d_r)
            return self._heads_raw(np.concatenate([t[:, :, :dn], shared], axis=2), b, s)

        kh = ops.ew("attention: k = [k_nope | k_pe], split heads", k, kv, pe)
        vh = ops.ew("attention: split heads", lambda: self._heads_raw(
            kv.reshape(b * s, a, dn + dv)[:, :, dn:], b, s), kv)
        return kh, vh

    def _dq(self, ops, dq, b, s):
        """dq (b·a_l, s, d_qk) -> the gradient of q before RoPE, (b·s, a_l·d_qk)."""
        a, dn, dr, d = self.a_l, self.d_n, self.d_r, self.d_qk
        t = ops.ew("attention: merge dq", lambda: self._merge_raw(dq, b, s), dq)
        pe = ops.ew("attention: split dq_pe", lambda: t.reshape(b * s, a, d)[:, :, dn:]
                    .reshape(b * s, a * dr), t)
        pe = self.rope.apply(ops, pe, b, s, "attention: rope^T dq_pe", inverse=True)
        return ops.ew("attention: [dq_nope | dq_pe]", lambda: np.concatenate(
            [t.reshape(b * s, a, d)[:, :, :dn], pe.reshape(b * s, a, dr)], axis=2)
            .reshape(b * s, a * d), t, pe)

    def _dkv(self, ops, dk, dv, b, s):
        """(dkv (b·s, a_l·(d_n + d_v)), dk_pe (b·s, d_r) before RoPE, summed over the
        heads that share it) from the core's dk, dv."""
        a, dn, d = self.a_l, self.d_n, self.d_qk
        t = ops.ew("attention: merge dk", lambda: self._merge_raw(dk, b, s)
                   .reshape(b * s, a, d), dk)
        pe = ops.ew("attention: dk_pe = sum over heads", lambda: t[:, :, dn:].sum(axis=1), t)
        pe = self.rope.apply(ops, pe, b, s, "attention: rope^T dk_pe", inverse=True)
        dkv = ops.ew("attention: [dk_nope | dv]", lambda: np.concatenate(
            [t[:, :, :dn], self._merge_raw(dv, b, s).reshape(b * s, a, self.d_v)], axis=2)
            .reshape(b * s, -1), t, dv)
        return dkv, pe

    # --- the block ----------------------------------------------------------------------
    def forward(self, ops, x, P, keep: str = "all"):
        """y (x's layout) and the backward's state: ``keep`` = "all", "qkv" (selective
        recomputation: not P nor C) or "none"; ``P``: the parameters by name."""
        xf = ops.gather_seq(x, "attention: gather x")                       # (b, s, h)
        b, s, h = xf.shape
        x2 = xf.reshape(b * s, h)
        cq = nq = None
        if self.r_q is not None:
            cq0 = ops.matmul(x2, P["w_q_a"], "attention: x @ W_qa")          # (b·s, r_q)
            cq, nq = rms_norm(ops, cq0, P["q_a_norm_g"], self.eps, "attention: q latent norm")
        q = self._up_q(ops, x2 if cq is None else cq, P)                    # (b·s, a_l·d_qk)
        kva = ops.matmul(x2, P["w_kv_a"], "attention: x @ W_kva")           # (b·s, r_kv + d_r)
        ckv, nkv = rms_norm(ops, kva[:, :self.r_kv], P["kv_a_norm_g"], self.eps,
                            "attention: kv latent norm")                    # (b·s, r_kv)
        kv = ops.matmul(ckv, P["w_kv_b"], "attention: c_kv @ W_kvb")   # (b·s, a_l·(d_n+d_v))
        k_pe = kva[:, self.r_kv:]
        qh = self._q_heads(ops, q, b, s)
        kh, vh = self._kv_heads(ops, kv, k_pe, b, s)
        p, c = self.core_attn.core(ops, qh, kh, vh)
        if self.cp is not None:
            p = p[:1]           # L only: the backward takes C back from ctx (one copy kept)
        ctx = ops.ew("attention: merge heads", lambda: self._merge_raw(c, b, s), c)
        y = ops.matmul(ctx, P["w_o"], "attention: ctx @ W_o").reshape(b, s, h)
        y = ops.reduce_out(y, "attention: reduce y")
        latents = (cq, nq, ckv, nkv)
        if self.recompute_up and keep != "none":   # mla_up_proj: k_pe and s in place of q, k, v
            qh, kh, vh = None, k_pe, s
        state = {"all": (x2, latents, qh, kh, vh, p, ctx),
                 "qkv": (x2, latents, qh, kh, vh, None, None), "none": ()}[keep]
        return y, state

    def _up_q(self, ops, cq, P, tag=""):
        """q = c_q W_qb, or x W_q without query compression (``cq`` then x)."""
        if self.r_q is not None:
            return ops.matmul(cq, P["w_q_b"], f"attention: c_q @ W_qb{tag}")
        return ops.matmul(cq, P["w_q"], f"attention: x @ W_q{tag}")

    def _up(self, ops, cq, ckv, k_pe, P, b, s, tag=""):
        """The up-projections and RoPE (Megatron-Core's ``qkv_up_proj_and_rope_apply``,
        what ``mla_up_proj`` re-runs): q = c_q W_qb (without r_q: x W_q, ``cq`` then the
        gathered x), kv = c_kv W_kvb, the heads with RoPE on q_pe and the shared k_pe;
        (q, k, v) per head."""
        q = self._up_q(ops, cq, P, tag)
        kv = ops.matmul(ckv, P["w_kv_b"], f"attention: c_kv @ W_kvb{tag}")
        qh = self._q_heads(ops, q, b, s)
        kh, vh = self._kv_heads(ops, kv, k_pe, b, s)
        return qh, kh, vh

    def backward_input(self, ops, state, dy, P, G=None):
        """dx (x's layout) and the weight gradient's state (P and C recomputed first when
        the state holds none: selective recomputation). ``G``: the gradients by name; under
        ``ops.async_grad_reduce`` the x-side ones (dW_qa or dW_q, dW_kva) are accumulated
        here while dx is reduced (the state then says so)."""
        x2, (cq, nq, ckv, nkv), qh, kh, vh, p, ctx = state
        if qh is None:              # mla_up_proj: kh is k_pe, vh the sequence s; re-run them
            s = vh
            b = x2.shape[0] // s
            qh, kh, vh = self._up(ops, x2 if cq is None else cq, ckv, kh, P, b, s,
                                  " (recompute)")
        s = kh.shape[1]
        b = x2.shape[0] // s
        if p is None:
            p, c = self.core_attn.core(ops, qh, kh, vh)
            ctx = ops.ew("attention: merge heads", lambda: self._merge_raw(c, b, s), c)
        elif self.cp is not None:                                          # (L, C)
            p = (p[0], ops.ew("attention: split heads", lambda: self._heads_raw(
                ctx.reshape(b * s, self.a_l, self.d_v), b, s), ctx))
        dyf = ops.gather_seq(dy, "attention: gather dy")                    # (b, s, h)
        h = dyf.shape[-1]
        dy2 = dyf.reshape(b * s, h)
        dctx = ops.matmul(dy2, P["w_o"].T, "attention: dctx = dy W_o^T")   # (b·s, a_l·d_v)
        dch = ops.ew("attention: split heads", lambda: self._heads_raw(
            dctx.reshape(b * s, self.a_l, self.d_v), b, s), dctx)
        dq, dk, dv = self.core_attn.core_backward(ops, dch, qh, kh, vh, p)
        dq = self._dq(ops, dq, b, s)                                        # (b·s, a_l·d_qk)
        dkv, dk_pe = self._dkv(ops, dk, dv, b, s)
        dcq = None
        if self.r_q is not None:
            dcq = ops.matmul(dq, P["w_q_b"].T, "attention: dc_q = dq W_qb^T")
            dq_in = rms_norm_grad(ops, dcq, nq, P["q_a_norm_g"],
                                  "attention: q latent norm grad")
            dxq = ops.matmul(dq_in, P["w_q_a"].T, "attention: dx = dc_q W_qa^T")
        else:
            dq_in = dq
            dxq = ops.matmul(dq, P["w_q"].T, "attention: dx = dq W_q^T")
        dckv = ops.matmul(dkv, P["w_kv_b"].T, "attention: dc_kv = dkv W_kvb^T")
        dckv0 = rms_norm_grad(ops, dckv, nkv, P["kv_a_norm_g"],
                              "attention: kv latent norm grad")
        dkva = ops.ew("attention: [dc_kv | dk_pe]", lambda: np.concatenate(
            [dckv0, dk_pe], axis=1), dckv0, dk_pe)                          # (b·s, r_kv + d_r)
        dxkv = ops.matmul(dkva, P["w_kv_a"].T, "attention: dx += dkva W_kva^T")
        dx = ops.ew("attention: add dx", lambda: dxq + dxkv, dxq, dxkv).reshape(b, s, h)
        down, up = (x2, dq_in, dkva), (cq, dq, dcq, nq, ckv, dkv, dckv, nkv, ctx, dy2)
        if G is None:
            return ops.reduce_out(dx, "attention: reduce dx"), (down, up)
        dx, done = ops.reduce_input_grad(dx, "attention: reduce dx",
                                         lambda: self._down_grads(ops, G, *down))
        return dx, (None if done else down, up)

    def _down_grads(self, ops, G, x2, dq_in, dkva) -> None:
        """dW_qa (or dW_q) and dW_kva: the products with the block's input x (in place)."""
        if self.r_q is not None:
            G["w_q_a"] += ops.matmul(x2.T, dq_in, "attention: dW_qa = x^T dc_q")
        else:
            G["w_q"] += ops.matmul(x2.T, dq_in, "attention: dW_q = x^T dq")
        G["w_kv_a"] += ops.matmul(x2.T, dkva, "attention: dW_kva = x^T dkva")

    def backward_weight(self, ops, wstate, G) -> None:
        """Accumulate every gradient of ``G`` (by name; the x-side ones unless
        :meth:`backward_input` did) — this rank's part of the replicated ones
        (:attr:`replicated`: the caller sums them over tp)."""
        down, (cq, dq, dcq, nq, ckv, dkv, dckv, nkv, ctx, dy2) = wstate
        if down is not None:
            self._down_grads(ops, G, *down)
        if self.r_q is not None:
            G["w_q_b"] += ops.matmul(cq.T, dq, "attention: dW_qb = c_q^T dq")
            rms_norm_gain_grad(ops, dcq, nq[0], G["q_a_norm_g"],
                               "attention: q latent norm gain grad")
        G["w_kv_b"] += ops.matmul(ckv.T, dkv, "attention: dW_kvb = c_kv^T dkv")
        rms_norm_gain_grad(ops, dckv, nkv[0], G["kv_a_norm_g"],
                           "attention: kv latent norm gain grad")
        G["w_o"] += ops.matmul(ctx.T, dy2, "attention: dW_o = ctx^T dy")
