"""A plain-numpy mixture-of-experts layer: the reference the sharded one is checked against.

Written apart from :mod:`tensor_parallel.moe` and in another way: routing by Python loops
over tokens, every expert computed *densely* on every token (a combine matrix of gates
zeroes what was not routed or was dropped), gradients by hand from the definitions:

    v = softmax(x W_r + b_r) or sigmoid(x W_r + b_r)   (N, E)  router scores (b_r: 0
                                                        without a router bias)
    choice[t] = the k largest v[t] (ties: the lower index), in decreasing order
    gate[t, c] = σ v[t, choice]                        raw
               = σ v[t, choice] / sum_c' v[t, choice']  normalised (softmax router: the
                                                        softmax of the k chosen logits)
    p = v (softmax) or v / sum_e v (sigmoid)    the probabilities the aux loss reads
    capacity per ep rank (T = N/ep tokens each): C = ceil(cf · T·k / E); rank r fills
      its experts' slots with all first choices in token order, then all second choices;
      a choice that finds its expert full is dropped (keep = 0)
    O_e = (silu(x Wg_e + bg_e) * (x Wu_e + bu_e)) Wd_e + bd_e   (N, h), every token
          (the experts' biases: GPT-OSS's; 0 without)
    y[t] = sum_c keep[t,c] gate[t,c] O_{choice[t,c]}[t]  (+ S(x[t]), the shared expert:
           a SwiGLU MLP like the others, on every token)
    aux = alpha · E · sum_e f_e P_e,  f_e = routed_e / (N k),  P_e = mean_t p[t, e]

The gradients are those of  L = <dy, y> + d_aux · aux  (f is a count: no gradient),
each chain rule written as its Jacobian matrix, token by token; a bias's gradient is the
sum over the tokens of its output's (db_r = Σ_t dl[t], bd_e = Σ_t w[t, e] dy[t], bg_e
and bu_e the sums of expert e's dA and dB).
"""

from __future__ import annotations

import numpy as np

from .moe_load import ExpertLoad, MoEGradients, MoEOutput, expert_capacity

__all__ = ["moe_reference"]


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _swiglu(x2, wg, wu, wd, bg=0.0, bu=0.0, bd=0.0):
    a, b = x2 @ wg + bg, x2 @ wu + bu
    s = a * _sigmoid(a)
    return (s * b) @ wd + bd, (a, b, s)


def _swiglu_grads(x2, wg, wu, wd, acts, d_out):
    """(dx, dWg, dWu, dWd, (dbg, dbu, dbd)) of O = (silu(x Wg + bg) * (x Wu + bu)) Wd + bd."""
    a, b, s = acts
    dhid = d_out @ wd.T
    sig = _sigmoid(a)
    da = dhid * b * sig * (1 + a * (1 - sig))
    db = dhid * s
    return (da @ wg.T + db @ wu.T, x2.T @ da, x2.T @ db, (s * b).T @ d_out,
            (da.sum(axis=0), db.sum(axis=0), d_out.sum(axis=0)))


def moe_reference(x, w_router, w_gate, w_up, w_down, *, top_k: int, capacity_factor,
                  aux_coef: float, ep: int = 1, dy=None, d_aux: float = 1.0,
                  router: str = "softmax", normalize_top_k: bool | None = None,
                  routed_scaling: float = 1.0, shared=None, groups=None, bias=None,
                  b_router=None, b_gate=None, b_up=None, b_down=None):
    """(result, choice (N, k), keep (N, k)): result a MoEOutput, or with ``dy`` a
    MoEGradients; x (N, h) or (..., h) with N tokens, split into ep contiguous ranks.
    ``normalize_top_k`` None: True for a sigmoid router or k > 1; ``shared``: the shared
    expert's (W_gate, W_up, W_down) or None; ``groups``: (n_group, topk_group), each
    token choosing among its topk_group best groups of experts (a group's score its two
    best experts' scores summed), None: all; ``bias`` (E,): added to the scores for the
    choice only (DeepSeek-V3's auxiliary-loss-free balancing), None: none; ``b_router``
    (E,): the router's bias, ``b_gate``, ``b_up`` (E, f), ``b_down`` (E, h): the experts'
    (GPT-OSS; all three or none), None: none — with ``dy`` their gradients are the
    MoEGradients' ``bias_grads``."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    n_tok, n_exp, k = x2.shape[0], w_router.shape[1], top_k
    norm = (router == "sigmoid" or k > 1) if normalize_top_k is None else normalize_top_k
    t_rank = n_tok // ep
    logits = x2 @ w_router + (0.0 if b_router is None else b_router)
    biased = b_gate is not None
    if router == "sigmoid":
        v = _sigmoid(logits)
        p = v / v.sum(axis=1, keepdims=True)
    else:
        v = np.exp(logits - logits.max(axis=1, keepdims=True))
        v /= v.sum(axis=1, keepdims=True)
        p = v

    choice = np.zeros((n_tok, k), dtype=np.int64)
    gate = np.zeros((n_tok, k))
    size = n_exp // groups[0] if groups else n_exp
    for t in range(n_tok):
        c = [v[t, e] + (0.0 if bias is None else bias[e]) for e in range(n_exp)]
        allowed = range(n_exp)
        if groups:
            score = [sum(sorted(c[g * size:(g + 1) * size], reverse=True)[:2])
                     for g in range(groups[0])]
            best = sorted(range(groups[0]), key=lambda g: (-score[g], g))[:groups[1]]
            allowed = [e for e in range(n_exp) if e // size in best]
        order = sorted(allowed, key=lambda e: (-c[e], e))[:k]
        choice[t] = order
        sel = v[t, order]
        gate[t] = routed_scaling * (sel / sel.sum() if norm else sel)

    cap = expert_capacity(capacity_factor, t_rank, k, n_exp)
    keep = np.zeros((n_tok, k), dtype=bool)
    routed = np.zeros((ep, n_exp), dtype=np.int64)
    kept = np.zeros((ep, n_exp), dtype=np.int64)
    for r in range(ep):
        for c in range(k):
            for t in range(r * t_rank, (r + 1) * t_rank):
                e = choice[t, c]
                routed[r, e] += 1
                if cap is None or kept[r, e] < cap:
                    kept[r, e] += 1
                    keep[t, c] = True
    # distinct tokens of rank r with a kept choice on expert-group member d (flex's rows)
    e_l = n_exp // ep
    tokens = np.zeros((ep, ep), dtype=np.int64)
    for t in range(n_tok):
        for d in {int(choice[t, c]) // e_l for c in range(k) if keep[t, c]}:
            tokens[t // t_rank, d] += 1
    load = ExpertLoad(routed.tolist(), kept.tolist(), cap, tokens.tolist())

    # dense combine matrix: w[t, e] = sum_c keep gate [choice == e]
    w = np.zeros((n_tok, n_exp))
    for c in range(k):
        w[np.arange(n_tok), choice[:, c]] += keep[:, c] * gate[:, c]
    acts = []
    outs = np.zeros((n_exp, n_tok, h))
    for e in range(n_exp):
        outs[e], act = _swiglu(x2, w_gate[e], w_up[e], w_down[e],
                               *((b_gate[e], b_up[e], b_down[e]) if biased else ()))
        acts.append(act)
    y = np.einsum("te,eth->th", w, outs)
    if shared is not None:
        y_shared, shared_acts = _swiglu(x2, *shared)
        y = y + y_shared
    y = y.reshape(x.shape)
    f = routed.sum(axis=0) / (n_tok * k)
    aux = float(aux_coef * n_exp * np.sum(f * p.mean(axis=0)))
    if dy is None:
        return MoEOutput(y, aux, load), choice, keep

    dy2 = np.asarray(dy, np.float64).reshape(-1, h)
    dx = np.zeros_like(x2)
    d_gate, d_up, d_down = (np.zeros_like(np.asarray(m, np.float64))
                            for m in (w_gate, w_up, w_down))
    d_biases = [np.zeros((n_exp,) + np.shape(m)[1:]) for m in (b_gate, b_up, b_down)] \
        if biased else None
    for e in range(n_exp):
        dxe, d_gate[e], d_up[e], d_down[e], db_e = _swiglu_grads(
            x2, w_gate[e], w_up[e], w_down[e], acts[e], w[:, e:e + 1] * dy2)
        dx += dxe
        for acc, g in zip(d_biases or (), db_e):
            acc[e] = g
    shared_grads = None
    if shared is not None:
        dxs, *shared_grads, _ = _swiglu_grads(x2, *shared, shared_acts, dy2)
        dx += dxs
        shared_grads = tuple(shared_grads)

    dg = np.zeros((n_tok, k))
    for c in range(k):
        dg[:, c] = keep[:, c] * np.einsum("th,th->t", dy2, outs[choice[:, c], np.arange(n_tok)])
    # d aux / d p[t, i] = alpha E f_i / N
    dp = d_aux * aux_coef * n_exp / n_tok * np.broadcast_to(f, (n_tok, n_exp))
    dl = np.zeros((n_tok, n_exp))
    for t in range(n_tok):
        sel = v[t, choice[t]]
        if norm:     # J[c, d] = d gate_c / d v_d = σ (δ_cd / S - v_c / S²)
            tot = sel.sum()
            jac_gate = routed_scaling * (np.eye(k) / tot - sel[:, None] / tot ** 2)
        else:
            jac_gate = routed_scaling * np.eye(k)
        dv = np.zeros(n_exp)
        dv[choice[t]] += jac_gate.T @ dg[t]
        if router == "sigmoid":     # d p_i / d v_j = δ_ij / Σv - v_i / (Σv)²
            tot = v[t].sum()
            dv += (np.eye(n_exp) / tot - v[t][:, None] / tot ** 2).T @ dp[t]
            dl[t] = dv * v[t] * (1 - v[t])
        else:                       # d v_i / d l_j = v_i (δ_ij - v_j)
            dv += dp[t]
            dl[t] = (np.diag(v[t]) - np.outer(v[t], v[t])).T @ dv
    dx += dl @ w_router.T
    bias_grads = {**({"router": dl.sum(axis=0)} if b_router is not None else {}),
                  **(dict(zip(("gate", "up", "down"), d_biases)) if biased else {})}
    grads = MoEGradients(y, aux, dx.reshape(x.shape), x2.T @ dl, d_gate, d_up, d_down, load,
                         shared_grads, bias_grads or None)
    return grads, choice, keep
