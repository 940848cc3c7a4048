"""The Llama model's parameters and its single-process numpy reference (forward and
backward, written apart from the sharded program of :mod:`tensor_parallel.llama`).

Model (B batch, s sequence, h hidden, a heads, c kv_heads, d head_dim (default h/a), f
ffn_hidden, l layers, V vocabulary): x = E[tokens], E (V, h); l layers

    x1 = x + (softmax(R(u W_q) R(u W_k)^T / sqrt(d) + M) (u W_v)) W_o,   u = RMSNorm1(x)
    x  = x1 + (silu(u2 W_gate) * (u2 W_up)) W_down,                      u2 = RMSNorm2(x1)

(query head i attends with KV head i // (a/c); R: RoPE, here as a (d, d) rotation matrix
per position; W_q (h, a·d), W_k, W_v (h, c·d), W_o (a·d, h)); logits = RMSNorm_f(x)
W_out; loss = mean over the B·s tokens of -log softmax(logits)[target].

QK-norm (``cfg.qk_norm``): R(u W_q) becomes R(N(u W_q; g_q)) and R(u W_k) R(N(u W_k;
g_k)), N(z; g)_j = g_j·z_j / rho(z), rho(z) = sqrt(sum_j z_j²/d + eps) over each head's d
values. Its backward here is the Jacobian written out, dN_j/dz_i = g_j·(δ_ij/rho -
z_j·z_i/(d·rho³)), so dz = g·dy/rho - z·sum_j(g_j·dy_j·z_j)/(d·rho³) and dg = sum over
tokens and heads of dy·z/rho (not the sharded program's xhat form).

Multi-head latent attention (``cfg.kv_lora_rank`` set; DeepSeek-V2/V3, d_n + d_r query
and key dims, d_v value dims): c_q = N(u W_q_a; g_qa), q = c_q W_q_b (or q = u W_q);
[c_kv0 | k_pe] = u W_kv_a, c_kv = N(c_kv0; g_kva), [k_nope | v] = c_kv W_kv_b per head;
the score of head n is (q_nope·k_nope + R q_pe·R k_pe)/sqrt(d_n + d_r) with ONE rotary
key k_pe (d_r, R its (d_r, d_r) rotations) shared by every head, written here as those
two terms (the program concatenates [k_nope | R k_pe] per head); x1 = x + ctx W_o with
ctx (a·d_v). The latent norms N are N above over one head of width r_q (r_kv), their
backward its Jacobian form.

Sliding-window attention (``cfg.window`` on the layers ``cfg.window_layers``, None:
every layer): the layer's mask allows key j for query i iff j ≤ i and j > i − w, written
here as an explicit (s, s) boolean matrix per layer. Attention sinks
(``cfg.attention_sinks``; GPT-OSS): each head n's logit σ_n is a column appended to the
scores, A_ext = softmax([S | σ_n]) over s + 1 columns, and the sink's column is dropped,
A = A_ext[..., :s]; its backward is the softmax's over the s + 1 columns with a zero
upstream gradient in the sink's, dσ_n = Σ over the batch and queries of that column of
dS_ext.

MoE biases (``cfg.moe_router_bias``, ``cfg.moe_expert_bias``: GPT-OSS) are the MoE
reference's (:func:`~tensor_parallel.moe_reference.moe_reference`): router logits u W_r +
b_r, each expert's gate, up and down projections with their biases, b_down inside the
routing weight.

Attention biases (``cfg.qkv_bias``: Qwen2/Qwen2.5; with ``cfg.out_bias``: GPT-OSS): q0 =
u W_q + b_q, [k0 | v] = u W_kv + b_kv (before QK-norm and RoPE), x1 = x + ctx W_o + b_o;
their gradients are the sums over the batch and positions of the gradients of q0, [k0 |
v] (after the QK-norm's backward and R^T) and of x1.
"""

from __future__ import annotations

import numpy as np

from tensor_parallel.moe_reference import moe_reference

from .functional import loss_and_grad

__all__ = ["llama_param_shapes", "llama_reference", "moe_calls_reference"]

_LAYER = ("attn_norm_g", "w_q", "w_kv", "w_o", "mlp_norm_g", "w_gate", "w_up", "w_down")


def llama_param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Global shapes by name: wte (V, h), layers.{i}.{attn_norm_g (h,), w_q (h, a·d),
    w_kv (h, 2, c·d), [q_norm_g, k_norm_g (d,) with ``qk_norm``], w_o (a·d, h),
    mlp_norm_g (h,), w_gate, w_up (h, f), w_down (f, h)}, norm_f_g (h,), w_out (h, V)
    (not with ``tie_embeddings``: the head uses E^T). MLA (``kv_lora_rank``): w_q, w_kv,
    w_o become w_q_a (h, r_q), q_a_norm_g (r_q,), w_q_b (r_q, a·(d_n + d_r)) — or w_q
    (h, a·(d_n + d_r)) without ``q_lora_rank`` — w_kv_a (h, r_kv + d_r), kv_a_norm_g
    (r_kv,), w_kv_b (r_kv, a·(d_n + d_v)), w_o (a·d_v, h). Attention sinks
    (``attention_sinks``): sinks (a,) after w_o. Attention biases: b_q (a·d,) after w_q,
    b_kv (2, c·d) after w_kv (``qkv_bias``), b_o (h,) after w_o (``out_bias``), the
    program's order (:meth:`~tensor_parallel.llama.LlamaLayer.layer_names`)."""
    h, f, hq, hkv = cfg.hidden, cfg.ffn_hidden, cfg.heads * cfg.head_dim, \
        cfg.kv_heads * cfg.head_dim
    dense = dict(zip(_LAYER, [(h,), (h, hq), (h, 2, hkv), (hq, h), (h,), (h, f), (h, f),
                              (f, h)]))
    for after, name, shape, on in (("w_q", "b_q", (hq,), "qkv_bias"),
                                   ("w_kv", "b_kv", (2, hkv), "qkv_bias"),
                                   ("w_o", "b_o", (h,), "out_bias"),
                                   (None, "sinks", (cfg.heads,), "attention_sinks")):
        if getattr(cfg, on, False):     # after its weight (sinks: after W_o and b_o)
            items = list(dense.items())
            keys = [n for n, _ in items]
            at = keys.index(after or ("b_o" if "b_o" in keys else "w_o")) + 1
            dense = dict(items[:at] + [(name, shape)] + items[at:])
    layer = dense
    if getattr(cfg, "experts", 0):        # MoE: the MLP's three become the router + experts
        e, fe, fs = cfg.experts, cfg.moe_ffn_hidden, cfg.moe_shared_ffn_hidden
        attention = list(dense)[:list(dense).index("mlp_norm_g") + 1]
        layer = {**{n: dense[n] for n in attention}, "w_router": (h, e),
                 **({"b_router": (e,)} if getattr(cfg, "moe_router_bias", False) else {}),
                 "moe_gate": (e, h, fe), "moe_up": (e, h, fe), "moe_down": (e, fe, h),
                 **({"moe_b_gate": (e, fe), "moe_b_up": (e, fe), "moe_b_down": (e, h)}
                    if getattr(cfg, "moe_expert_bias", False) else {}),
                 **({"shared_gate": (h, fs), "shared_up": (h, fs), "shared_down": (fs, h)}
                    if fs else {})}
    kinds = {False: dense, True: layer}      # dense-first layers keep the dense MLP
    for moe, one in kinds.items():
        if getattr(cfg, "kv_lora_rank", None):  # MLA: W_q, W_kv, W_o become the latent ones
            items = list(one.items())
            at, end = [n for n, _ in items].index("w_q"), [n for n, _ in items].index("w_o") + 1
            one = dict(items[:at] + list(_mla_shapes(cfg).items()) + items[end:])
        if getattr(cfg, "qk_norm", False):  # QK-norm's gains, after W_kv, b_kv (the program's)
            items, d = list(one.items()), cfg.head_dim
            at = [n for n, _ in items].index("b_kv" if "b_kv" in one else "w_kv") + 1
            one = dict(items[:at] + [("q_norm_g", (d,)), ("k_norm_g", (d,))] + items[at:])
        kinds[moe] = one
    return {"wte": (cfg.vocab, h),
            **{f"layers.{i}.{n}": shape for i in range(cfg.layers)
               for n, shape in kinds[_is_moe_layer(cfg, i)].items()},
            "norm_f_g": (h,),
            **({} if getattr(cfg, "tie_embeddings", False) else {"w_out": (h, cfg.vocab)})}


def _mla_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's parameters (module docstring), in the program's order."""
    h, a, r_q, r_kv = cfg.hidden, cfg.heads, cfg.q_lora_rank, cfg.kv_lora_rank
    d_qk, d_r, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, \
        cfg.v_head_dim
    q = {"w_q_a": (h, r_q), "q_a_norm_g": (r_q,), "w_q_b": (r_q, a * d_qk)} if r_q else \
        {"w_q": (h, a * d_qk)}
    return {**q, "w_kv_a": (h, r_kv + d_r), "kv_a_norm_g": (r_kv,),
            "w_kv_b": (r_kv, a * (cfg.qk_nope_head_dim + d_v)), "w_o": (a * d_v, h)}


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


def _head_norm(z, g, eps):
    """N(z; g) over the last axis (each head's d values): (y, (z, rho, g))."""
    rho = np.sqrt(np.mean(z ** 2, axis=-1, keepdims=True) + eps)
    return g * z / rho, (z, rho, g)


def _head_norm_back(dy, cache):
    """(dz, dg) of N from its Jacobian (the module docstring); dy, z (B, s, n, d)."""
    z, rho, g = cache
    d = z.shape[-1]
    dz = g * dy / rho - z * np.sum(g * dy * z, axis=-1, keepdims=True) / (d * rho ** 3)
    return dz, np.einsum("bsnd,bsnd->d", dy, z / rho)


def _mla_forward(cfg, L, u, R, causal):
    """Multi-head latent attention on u (B, s, h): (ctx (B, s, a·d_v), what the backward
    needs). The latents' norms are :func:`_head_norm` over one "head" of width r; the
    score is written as its two parts, q_nope·k_nope per head plus q_pe·k_pe against the
    ONE shared rotary key (never copied per head)."""
    (B, s, _), a, r_kv = u.shape, cfg.heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    cq = cqn = None
    if cfg.q_lora_rank:
        cq, cqn = _head_norm((u @ L["w_q_a"])[:, :, None], L["q_a_norm_g"], cfg.eps)
        q = (cq[:, :, 0] @ L["w_q_b"]).reshape(B, s, a, dn + dr)
    else:
        q = (u @ L["w_q"]).reshape(B, s, a, dn + dr)
    kva = u @ L["w_kv_a"]                                                 # (B, s, r_kv + d_r)
    ckv, ckvn = _head_norm(kva[:, :, None, :r_kv], L["kv_a_norm_g"], cfg.eps)
    kv = (ckv[:, :, 0] @ L["w_kv_b"]).reshape(B, s, a, dn + dv)
    q_nope, q_pe = q[..., :dn], np.einsum("pij,bpnj->bpni", R, q[..., dn:])
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k_pe = np.einsum("pij,bpj->bpi", R, kva[:, :, r_kv:])                 # (B, s, d_r)
    S = (np.einsum("bqnd,bknd->bnqk", q_nope, k_nope)
         + np.einsum("bqnd,bkd->bnqk", q_pe, k_pe)) / np.sqrt(dn + dr)
    S = np.where(causal, S, -np.inf)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)                                         # (B, a, s, s)
    ctx = np.einsum("bnqk,bknd->bqnd", A, v).reshape(B, s, a * dv)
    return ctx, (cq, cqn, ckv, ckvn, q_nope, q_pe, k_nope, k_pe, v, A)


def _mla_backward(cfg, L, u, R, cache, dctx):
    """(du, gradients by name) of :func:`_mla_forward` from dctx (B, s, a·d_v): the
    shared rotary key's gradient is the sum over the heads (its einsum), R^T turns the
    rotary parts back, the latents' norms go back through their Jacobian."""
    cq, cqn, ckv, ckvn, q_nope, q_pe, k_nope, k_pe, v, A = cache
    (B, s, a, dn), dv = q_nope.shape, cfg.v_head_dim
    dctx = dctx.reshape(B, s, a, dv)
    dA = np.einsum("bqnd,bknd->bnqk", dctx, v)
    d_v = np.einsum("bnqk,bqnd->bknd", A, dctx)
    dS = A * (dA - (dA * A).sum(-1, keepdims=True)) / np.sqrt(dn + cfg.qk_rope_head_dim)
    dq = np.concatenate([np.einsum("bnqk,bknd->bqnd", dS, k_nope),
                         np.einsum("pij,bpni->bpnj", R,
                                   np.einsum("bnqk,bkd->bqnd", dS, k_pe))], -1)
    dk_pe = np.einsum("pij,bpi->bpj", R, np.einsum("bnqk,bqnd->bkd", dS, q_pe))
    dq, g = dq.reshape(B, s, -1), {}
    if cfg.q_lora_rank:
        g["w_q_b"] = np.einsum("bsr,bsk->rk", cq[:, :, 0], dq)
        dcq, g["q_a_norm_g"] = _head_norm_back((dq @ L["w_q_b"].T)[:, :, None], cqn)
        g["w_q_a"] = np.einsum("bsh,bsr->hr", u, dcq[:, :, 0])
        du = dcq[:, :, 0] @ L["w_q_a"].T
    else:
        g["w_q"] = np.einsum("bsh,bsk->hk", u, dq)
        du = dq @ L["w_q"].T
    dkv = np.concatenate([np.einsum("bnqk,bqnd->bknd", dS, q_nope), d_v], -1).reshape(B, s, -1)
    g["w_kv_b"] = np.einsum("bsr,bsk->rk", ckv[:, :, 0], dkv)
    dckv, g["kv_a_norm_g"] = _head_norm_back((dkv @ L["w_kv_b"].T)[:, :, None], ckvn)
    dkva = np.concatenate([dckv[:, :, 0], dk_pe], -1)                     # (B, s, r_kv + d_r)
    g["w_kv_a"] = np.einsum("bsh,bsk->hk", u, dkva)
    return du + dkva @ L["w_kv_a"].T, g


def _visible(cfg, i: int, s: int) -> np.ndarray:
    """(s, s) booleans of layer ``i``: query p sees key j iff j <= p and, under a sliding
    window w (``cfg.window`` on ``cfg.window_layers``, None: every layer), j > p − w."""
    p, j = np.arange(s)[:, None], np.arange(s)[None, :]
    w = getattr(cfg, "window", None)
    layers = getattr(cfg, "window_layers", None)
    if w is None or (layers is not None and i not in layers):
        return j <= p
    return (j <= p) & (j > p - w)


def _silu(z):
    return z / (1 + np.exp(-z))


def _is_moe_layer(cfg, i: int) -> bool:
    """Whether layer i's MLP is the mixture of experts (not one of ``moe_dense_layers``)."""
    return bool(getattr(cfg, "experts", 0)) and i not in getattr(cfg, "moe_dense_layers", ())


#: the MoE block's biases (router; routed experts: GPT-OSS)
_MOE_BIASES = ("b_router", "moe_b_gate", "moe_b_up", "moe_b_down")


def _moe_names(cfg) -> tuple[str, ...]:
    """The MoE block's parameter names: router, routed experts[, shared expert][, the
    router's and the experts' biases]."""
    return ("w_router", "moe_gate", "moe_up", "moe_down") + (
        ("shared_gate", "shared_up", "shared_down") if cfg.moe_shared_ffn_hidden else ()) \
        + (_MOE_BIASES[:1] if getattr(cfg, "moe_router_bias", False) else ()) \
        + (_MOE_BIASES[1:] if getattr(cfg, "moe_expert_bias", False) else ())


def moe_calls_reference(cfg, L, u2, groups, dy=None, bias=None, routed=None):
    """The MoE block (``cfg.experts`` > 0) on u2 (B, s, h), each call apart: ``groups`` =
    (ep, [blocks of each call]) — a call's tokens are its blocks' (batch rows, positions;
    :func:`~pipeline_parallel.gpt.moe_call_blocks`) in order, ep
    contiguous ranks of equal share (:func:`~tensor_parallel.moe_reference.moe_reference`,
    capacity per rank). Forward: (y, aux = mean over the calls); with ``dy``: (du2, grads
    by name) of <dy, y> + aux. ``bias``: the auxiliary-loss-free balancing's (E,) offset
    to the choice; ``routed``: an (E,) array the calls' routed tokens per expert are
    added to."""
    ep, calls = groups
    names = _moe_names(cfg)
    h, w = u2.shape[-1], [L[n] for n in names[:4]]
    shared = tuple(L[n] for n in names[4:] if n.startswith("shared_")) or None
    biases = {n: L.get(n) for n in _MOE_BIASES}
    out, aux = np.zeros_like(u2), 0.0
    grads = {n: np.zeros_like(L[n]) for n in names}
    def tokens(a, blocks):
        return np.concatenate([a[np.ix_(rows, pos)].reshape(-1, h) for rows, pos in blocks])

    def put(a, blocks, values):
        at = 0
        for rows, pos in blocks:
            n = len(rows) * len(pos)
            a[np.ix_(rows, pos)] = values[at:at + n].reshape(len(rows), len(pos), h)
            at += n

    for blocks in calls:
        res, _, _ = moe_reference(tokens(u2, blocks), *w, top_k=cfg.moe_top_k,
                                  capacity_factor=cfg.capacity_factor,
                                  aux_coef=cfg.moe_aux_coef, ep=ep,
                                  dy=None if dy is None else tokens(dy, blocks),
                                  d_aux=1 / len(calls), router=cfg.moe_router,
                                  normalize_top_k=cfg.moe_normalize_top_k,
                                  routed_scaling=cfg.moe_routed_scaling, shared=shared,
                                  groups=getattr(cfg, "moe_groups", None), bias=bias,
                                  b_router=biases["b_router"], b_gate=biases["moe_b_gate"],
                                  b_up=biases["moe_b_up"], b_down=biases["moe_b_down"])
        if routed is not None:
            routed += np.asarray(res.load.per_expert_routed)
        if dy is None:
            put(out, blocks, res.y)
            aux += res.aux_loss / len(calls)
        else:
            put(out, blocks, res.dx)
            for n, g in zip(grads, (res.d_router, res.d_gate, res.d_up, res.d_down,
                                    *(res.shared_grads or ()))):
                grads[n] += g
            for n, key in zip(_MOE_BIASES, ("router", "gate", "up", "down")):
                if n in grads:
                    grads[n] += res.bias_grads[key]
    return (out, aux) if dy is None else (out, grads)


def llama_reference(cfg, P: dict, tokens, targets, backward: bool = False, moe_groups=None,
                    moe_state=None):
    """Forward (and backward) of the whole model on the whole batch: (loss, logits,
    grads by name or None). An MoE model (``cfg.experts``) needs ``moe_groups``: (ep,
    the batch rows of each MoE call) — see :func:`moe_calls_reference`; its loss adds every
    layer's aux loss."""
    (B, s), a, c, d, V = tokens.shape, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab
    grp, R = a // c, _rotations(s, d, cfg.rope_theta).astype(cfg.dtype)
    causal = np.tril(np.ones((s, s), bool))
    x, caches, aux_total = P["wte"][tokens], [], 0.0
    qk_norm = bool(getattr(cfg, "qk_norm", False))
    latent = bool(getattr(cfg, "kv_lora_rank", None))
    sinks = bool(getattr(cfg, "attention_sinks", False))
    qkv_bias = bool(getattr(cfg, "qkv_bias", False))
    out_bias = bool(getattr(cfg, "out_bias", False))
    names = {}                  # per kind of layer (MoE or dense), its parameters' names
    for kind in (False, True):
        one = _LAYER[:5] + _moe_names(cfg) if kind else _LAYER
        one += ("q_norm_g", "k_norm_g") if qk_norm else ()
        one += ("sinks",) if sinks else ()
        one += (("b_q", "b_kv") if qkv_bias else ()) + (("b_o",) if out_bias else ())
        if latent:              # MLA: its parameters for w_q, w_kv, w_o; RoPE on d_rope
            at, end = one.index("w_q"), one.index("w_o") + 1
            one = one[:at] + tuple(_mla_shapes(cfg)) + one[end:]
        names[kind] = one
    if latent:
        R = _rotations(s, cfg.qk_rope_head_dim, cfg.rope_theta).astype(cfg.dtype)
    for i in range(cfg.layers):
        moe = _is_moe_layer(cfg, i)
        L = {n: P[f"layers.{i}.{n}"] for n in names[moe]}
        u, c1 = _rms(x, L["attn_norm_g"], cfg.eps)
        mla = None
        if latent:
            ctx, mla = _mla_forward(cfg, L, u, R, causal)
            q = kr = vr = A = qkn = None
        else:
            q0 = u @ L["w_q"]
            kv = np.einsum("bsh,htk->bstk", u, L["w_kv"])                 # (B, s, 2, c·d)
            if qkv_bias:
                q0, kv = q0 + L["b_q"], kv + L["b_kv"]
            q0 = q0.reshape(B, s, a, d)
            k0, v = kv[:, :, 0].reshape(B, s, c, d), kv[:, :, 1].reshape(B, s, c, d)
            qkn = None
            if qk_norm:                               # QK-norm: each head, before RoPE
                (q0, cq), (k0, ck) = (_head_norm(q0, L["q_norm_g"], cfg.eps),
                                      _head_norm(k0, L["k_norm_g"], cfg.eps))
                qkn = (cq, ck)
            q = np.einsum("pij,bpnj->bpni", R, q0)                        # RoPE
            k = np.einsum("pij,bpnj->bpni", R, k0)
            kr, vr = np.repeat(k, grp, axis=2), np.repeat(v, grp, axis=2)  # (B, s, a, d)
            S = np.where(_visible(cfg, i, s), np.einsum("bqnd,bknd->bnqk", q, kr) / np.sqrt(d),
                         -np.inf)
            if sinks:                                 # the sink's column, then dropped
                S = np.concatenate([S, np.broadcast_to(L["sinks"][None, :, None, None],
                                                       (B, a, s, 1))], axis=-1)
            A = np.exp(S - S.max(-1, keepdims=True))
            A /= A.sum(-1, keepdims=True)             # (B, a, s, s) (+ the sink's column)
            ctx = np.einsum("bnqk,bknd->bqnd", A[..., :s], vr).reshape(B, s, a * d)
        x1 = x + ctx @ L["w_o"] + (L["b_o"] if out_bias else 0)
        u2, c2 = _rms(x1, L["mlp_norm_g"], cfg.eps)
        if moe:
            bias = moe_state["bias"].get(i) if moe_state else None
            routed = moe_state["routed"].setdefault(i, np.zeros(cfg.experts)) \
                if moe_state is not None else None
            y, aux = moe_calls_reference(cfg, L, u2, moe_groups, bias=bias, routed=routed)
            x, aux_total, zg, zu, act = x1 + y, aux_total + aux, None, None, None
        else:
            zg, zu = u2 @ L["w_gate"], u2 @ L["w_up"]
            act = _silu(zg) * zu
            x = x1 + act @ L["w_down"]
        caches.append((L, u, c1, q, kr, vr, A, ctx, u2, c2, zg, zu, act, qkn, mla))
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
        L, u, c1, q, kr, vr, A, ctx, u2, c2, zg, zu, act, qkn, mla = caches[i]
        moe = _is_moe_layer(cfg, i)
        if moe:
            dmoe, g = moe_calls_reference(cfg, L, u2, moe_groups, dy=dx, bias=moe_state[
                "bias"].get(i) if moe_state else None)
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
        if out_bias:
            g["b_o"] = dx1.sum((0, 1))
        if mla is not None:
            datt, gm = _mla_backward(cfg, L, u, R, mla, dx1 @ L["w_o"].T)
            g.update(gm)
        else:
            dctx = (dx1 @ L["w_o"].T).reshape(B, s, a, d)
            dA = np.einsum("bqnd,bknd->bnqk", dctx, vr)
            dvr = np.einsum("bnqk,bqnd->bknd", A[..., :s], dctx)
            if sinks:                                 # the sink's column: no upstream
                dA = np.concatenate([dA, np.zeros((B, a, s, 1))], axis=-1)
            dS = A * (dA - (dA * A).sum(-1, keepdims=True))
            if sinks:
                g["sinks"], dS = dS[..., s].sum((0, 2)), dS[..., :s]
            dS = dS / np.sqrt(d)
            dq = np.einsum("bnqk,bknd->bqnd", dS, kr)
            dkr = np.einsum("bnqk,bqnd->bknd", dS, q)
            dk = dkr.reshape(B, s, c, grp, d).sum(3)                      # the group's sum
            dv = dvr.reshape(B, s, c, grp, d).sum(3)
            dq0 = np.einsum("pij,bpni->bpnj", R, dq)                      # R^T
            dk0 = np.einsum("pij,bpni->bpnj", R, dk)
            if qkn is not None:                       # back through QK-norm
                dq0, g["q_norm_g"] = _head_norm_back(dq0, qkn[0])
                dk0, g["k_norm_g"] = _head_norm_back(dk0, qkn[1])
            dq0, dk0 = dq0.reshape(B, s, a * d), dk0.reshape(B, s, c * d)
            dkv = np.stack([dk0, dv.reshape(B, s, c * d)], axis=2)        # (B, s, 2, c·d)
            g["w_q"] = np.einsum("bsh,bsk->hk", u, dq0)
            g["w_kv"] = np.einsum("bsh,bstk->htk", u, dkv)
            if qkv_bias:
                g["b_q"], g["b_kv"] = dq0.sum((0, 1)), dkv.sum((0, 1))
            datt = dq0 @ L["w_q"].T + np.einsum("bstk,htk->bsh", dkv, L["w_kv"])
        du, g["attn_norm_g"] = _rms_back(datt, c1)
        dx = dx1 + du
        G.update({f"layers.{i}.{n}": g[n] for n in names[moe]})
    G["wte"] = np.zeros_like(P["wte"])
    np.add.at(G["wte"], tokens, dx)
    if tied:
        G["wte"] += G.pop("w_out").T
    return loss, logits, {n: G[n] for n in P}
