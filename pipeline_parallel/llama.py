"""The Llama model's parameters and its single-process numpy reference (forward and
backward, written apart from the sharded program of :mod:`tensor_parallel.llama`).

Model (B batch, s sequence, h hidden, a heads, c kv_heads, d = h/a, f ffn_hidden, l
layers, V vocabulary): x = E[tokens], E (V, h); l layers

    x1 = x + (softmax(R(u W_q) R(u W_k)^T / sqrt(d) + M) (u W_v)) W_o,   u = RMSNorm1(x)
    x  = x1 + (silu(u2 W_gate) * (u2 W_up)) W_down,                      u2 = RMSNorm2(x1)

(query head i attends with KV head i // (a/c); R: RoPE, here as a (d, d) rotation matrix
per position); logits = RMSNorm_f(x) W_out; loss = mean over the B·s tokens of
-log softmax(logits)[target].
"""

from __future__ import annotations

import numpy as np

from tensor_parallel.moe_reference import moe_reference

from .functional import loss_and_grad

__all__ = ["llama_param_shapes", "llama_reference", "moe_calls_reference"]

_LAYER = ("attn_norm_g", "w_q", "w_kv", "w_o", "mlp_norm_g", "w_gate", "w_up", "w_down")


def llama_param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Global shapes by name: wte (V, h), layers.{i}.{attn_norm_g (h,), w_q (h, a·d),
    w_kv (h, 2, c·d), w_o (a·d, h), mlp_norm_g (h,), w_gate, w_up (h, f), w_down (f, h)},
    norm_f_g (h,), w_out (h, V) (not with ``tie_embeddings``: the head uses E^T)."""
    h, f, hq, hkv = cfg.hidden, cfg.ffn_hidden, cfg.heads * cfg.head_dim, \
        cfg.kv_heads * cfg.head_dim
    layer = dict(zip(_LAYER, [(h,), (h, hq), (h, 2, hkv), (hq, h), (h,), (h, f), (h, f),
                              (f, h)]))
    if getattr(cfg, "experts", 0):        # MoE: the MLP's three become the router + experts
        e, fe = cfg.experts, cfg.moe_ffn_hidden
        layer = {**{n: layer[n] for n in _LAYER[:5]}, "w_router": (h, e),
                 "moe_gate": (e, h, fe), "moe_up": (e, h, fe), "moe_down": (e, fe, h)}
    return {"wte": (cfg.vocab, h),
            **{f"layers.{i}.{n}": layer[n] for i in range(cfg.layers) for n in layer},
            "norm_f_g": (h,),
            **({} if getattr(cfg, "tie_embeddings", False) else {"w_out": (h, cfg.vocab)})}


def _rotations(s: int, d: int, theta: float) -> np.ndarray:
    """R (s, d, d): position p turns each pair (i, i + d/2) by p·theta^(-2i/d)."""
    R = np.zeros((s, d, d))
    for i in range(d // 2):
        angle = np.arange(s) * theta ** (-2 * i / d)
        c, sn, j = np.cos(angle), np.sin(angle), i + d // 2
        R[:, i, i], R[:, i, j], R[:, j, i], R[:, j, j] = c, -sn, sn, c
    return R


def _rms(x, g, eps):
    r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * g, (x * r, r, g)


def _rms_back(dy, cache):
    """(dx, dg) of an RMSNorm over the last axis."""
    xhat, r, g = cache
    d = dy * g
    return r * (d - xhat * np.mean(d * xhat, axis=-1, keepdims=True)), (dy * xhat).sum((0, 1))


def _silu(z):
    return z / (1 + np.exp(-z))


def moe_calls_reference(cfg, L, u2, groups, dy=None):
    """The MoE block (``cfg.experts`` > 0) on u2 (B, s, h), each call apart: ``groups`` =
    (ep, [rows of each call]) — a call's tokens are its rows' in order, ep contiguous
    ranks of equal share (:func:`~tensor_parallel.moe_reference.moe_reference`, capacity
    per rank). Forward: (y, aux = mean over the calls); with ``dy``: (du2, grads by name)
    of <dy, y> + aux."""
    ep, calls = groups
    h, w = u2.shape[-1], [L[n] for n in ("w_router", "moe_gate", "moe_up", "moe_down")]
    out, aux = np.zeros_like(u2), 0.0
    grads = {n: np.zeros_like(L[n]) for n in ("w_router", "moe_gate", "moe_up", "moe_down")}
    for rows in calls:
        res, _, _ = moe_reference(u2[rows].reshape(-1, h), *w, top_k=cfg.moe_top_k,
                                  capacity_factor=cfg.capacity_factor,
                                  aux_coef=cfg.moe_aux_coef, ep=ep,
                                  dy=None if dy is None else dy[rows].reshape(-1, h),
                                  d_aux=1 / len(calls))
        if dy is None:
            out[rows] = res.y.reshape(len(rows), -1, h)
            aux += res.aux_loss / len(calls)
        else:
            out[rows] = res.dx.reshape(len(rows), -1, h)
            for n, g in zip(grads, (res.d_router, res.d_gate, res.d_up, res.d_down)):
                grads[n] += g
    return (out, aux) if dy is None else (out, grads)


def llama_reference(cfg, P: dict, tokens, targets, backward: bool = False, moe_groups=None):
    """Forward (and backward) of the whole model on the whole batch: (loss, logits,
    grads by name or None). An MoE model (``cfg.experts``) needs ``moe_groups``: (ep,
    the batch rows of each MoE call) — see :func:`moe_calls_reference`; its loss adds every
    layer's aux loss."""
    (B, s), a, c, d, V = tokens.shape, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab
    grp, R = a // c, _rotations(s, d, cfg.rope_theta).astype(cfg.dtype)
    causal = np.tril(np.ones((s, s), bool))
    x, caches, aux_total = P["wte"][tokens], [], 0.0
    moe = bool(getattr(cfg, "experts", 0))
    names = _LAYER[:5] + ("w_router", "moe_gate", "moe_up", "moe_down") if moe else _LAYER
    for i in range(cfg.layers):
        L = {n: P[f"layers.{i}.{n}"] for n in names}
        u, c1 = _rms(x, L["attn_norm_g"], cfg.eps)
        q0 = (u @ L["w_q"]).reshape(B, s, a, d)
        kv = np.einsum("bsh,htk->bstk", u, L["w_kv"])                     # (B, s, 2, c·d)
        k0, v = kv[:, :, 0].reshape(B, s, c, d), kv[:, :, 1].reshape(B, s, c, d)
        q = np.einsum("pij,bpnj->bpni", R, q0)                            # RoPE
        k = np.einsum("pij,bpnj->bpni", R, k0)
        kr, vr = np.repeat(k, grp, axis=2), np.repeat(v, grp, axis=2)     # (B, s, a, d)
        S = np.where(causal, np.einsum("bqnd,bknd->bnqk", q, kr) / np.sqrt(d), -np.inf)
        A = np.exp(S - S.max(-1, keepdims=True))
        A /= A.sum(-1, keepdims=True)                                     # (B, a, s, s)
        ctx = np.einsum("bnqk,bknd->bqnd", A, vr).reshape(B, s, a * d)
        x1 = x + ctx @ L["w_o"]
        u2, c2 = _rms(x1, L["mlp_norm_g"], cfg.eps)
        if moe:
            y, aux = moe_calls_reference(cfg, L, u2, moe_groups)
            x, aux_total, zg, zu, act = x1 + y, aux_total + aux, None, None, None
        else:
            zg, zu = u2 @ L["w_gate"], u2 @ L["w_up"]
            act = _silu(zg) * zu
            x = x1 + act @ L["w_down"]
        caches.append((L, u, c1, q, kr, vr, A, ctx, u2, c2, zg, zu, act))
    uf, cf = _rms(x, P["norm_f_g"], cfg.eps)
    tied = getattr(cfg, "tie_embeddings", False)
    w_out = P["wte"].T if tied else P["w_out"]                            # (h, V)
    logits = uf @ w_out                                                   # (B, s, V)
    ce, dlogits = loss_and_grad("cross_entropy", logits.reshape(B * s, V),
                                targets.reshape(-1), B * s)       # mean over the B·s tokens
    loss = ce + aux_total
    if not backward:
        return loss, logits, None
    G = {}
    dlogits = dlogits.reshape(B, s, V)
    G["w_out"] = np.einsum("bsh,bsv->hv", uf, dlogits)
    dx, G["norm_f_g"] = _rms_back(dlogits @ w_out.T, cf)
    for i in reversed(range(cfg.layers)):
        L, u, c1, q, kr, vr, A, ctx, u2, c2, zg, zu, act = caches[i]
        if moe:
            dmoe, g = moe_calls_reference(cfg, L, u2, moe_groups, dy=dx)
            du2, g["mlp_norm_g"] = _rms_back(dmoe, c2)
        else:
            g = {"w_down": np.einsum("bsf,bsh->fh", act, dx)}
            dact = dx @ L["w_down"].T
            sig = 1 / (1 + np.exp(-zg))
            dzg, dzu = dact * zu * (sig + zg * sig * (1 - sig)), dact * _silu(zg)
            g["w_gate"] = np.einsum("bsh,bsf->hf", u2, dzg)
            g["w_up"] = np.einsum("bsh,bsf->hf", u2, dzu)
            du2, g["mlp_norm_g"] = _rms_back(dzg @ L["w_gate"].T + dzu @ L["w_up"].T, c2)
        dx1 = dx + du2
        g["w_o"] = np.einsum("bsk,bsh->kh", ctx, dx1)
        dctx = (dx1 @ L["w_o"].T).reshape(B, s, a, d)
        dA = np.einsum("bqnd,bknd->bnqk", dctx, vr)
        dvr = np.einsum("bnqk,bqnd->bknd", A, dctx)
        dS = A * (dA - (dA * A).sum(-1, keepdims=True)) / np.sqrt(d)
        dq = np.einsum("bnqk,bknd->bqnd", dS, kr)
        dkr = np.einsum("bnqk,bqnd->bknd", dS, q)
        dk = dkr.reshape(B, s, c, grp, d).sum(3)                          # the group's sum
        dv = dvr.reshape(B, s, c, grp, d).sum(3)
        dq0 = np.einsum("pij,bpni->bpnj", R, dq).reshape(B, s, a * d)     # R^T
        dk0 = np.einsum("pij,bpni->bpnj", R, dk).reshape(B, s, c * d)
        dkv = np.stack([dk0, dv.reshape(B, s, c * d)], axis=2)            # (B, s, 2, c·d)
        g["w_q"] = np.einsum("bsh,bsk->hk", u, dq0)
        g["w_kv"] = np.einsum("bsh,bstk->htk", u, dkv)
        du, g["attn_norm_g"] = _rms_back(dq0 @ L["w_q"].T
                                         + np.einsum("bstk,htk->bsh", dkv, L["w_kv"]), c1)
        dx = dx1 + du
        G.update({f"layers.{i}.{n}": g[n] for n in names})
    G["wte"] = np.zeros_like(P["wte"])
    np.add.at(G["wte"], tokens, dx)
    if tied:
        G["wte"] += G.pop("w_out").T
    return loss, logits, {n: G[n] for n in P}
