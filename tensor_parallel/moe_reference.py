"""A plain-numpy mixture-of-experts layer: the reference the sharded one is checked against.

Written apart from :mod:`tensor_parallel.moe` and in another way: routing by Python loops
over tokens, every expert computed *densely* on every token (a combine matrix of gates
zeroes what was not routed or was dropped), gradients by hand from the definitions:

    p = softmax(x W_r)                          (N, E)
    choice[t] = the k largest p[t] (ties: the lower index), in decreasing order
    gate[t, c] = p[t, choice]            k = 1   (Switch)
               = softmax(l[t, choice])_c k = 2   (Mixtral: renormalised over the k)
    capacity per ep rank (T = N/ep tokens each): C = ceil(cf · T·k / E); rank r fills
      its experts' slots with all first choices in token order, then all second choices;
      a choice that finds its expert full is dropped (keep = 0)
    O_e = (silu(x Wg_e) * (x Wu_e)) Wd_e        (N, h), every token
    y[t] = sum_c keep[t,c] gate[t,c] O_{choice[t,c]}[t]
    aux = alpha · E · sum_e f_e P_e,  f_e = routed_e / (N k),  P_e = mean_t p[t, e]

The gradients are those of  L = <dy, y> + d_aux · aux  (f is a count: no gradient).
"""

from __future__ import annotations

import numpy as np

from .moe_load import ExpertLoad, MoEGradients, MoEOutput, expert_capacity

__all__ = ["moe_reference"]


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def moe_reference(x, w_router, w_gate, w_up, w_down, *, top_k: int, capacity_factor,
                  aux_coef: float, ep: int = 1, dy=None, d_aux: float = 1.0):
    """(result, choice (N, k), keep (N, k)): result a MoEOutput, or with ``dy`` a
    MoEGradients; x (N, h) or (..., h) with N tokens, split into ep contiguous ranks."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    n_tok, n_exp, k = x2.shape[0], w_router.shape[1], top_k
    t_rank = n_tok // ep
    logits = x2 @ w_router
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)

    choice = np.zeros((n_tok, k), dtype=np.int64)
    gate = np.zeros((n_tok, k))
    for t in range(n_tok):
        order = sorted(range(n_exp), key=lambda e: (-p[t, e], e))[:k]
        choice[t] = order
        if k == 1:
            gate[t, 0] = p[t, order[0]]
        else:
            sel = np.exp(logits[t, order] - logits[t, order].max())
            gate[t] = sel / sel.sum()

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
    load = ExpertLoad(routed.tolist(), kept.tolist(), cap)

    # dense combine matrix: w[t, e] = sum_c keep gate [choice == e]
    w = np.zeros((n_tok, n_exp))
    for c in range(k):
        w[np.arange(n_tok), choice[:, c]] += keep[:, c] * gate[:, c]
    acts = []
    outs = np.zeros((n_exp, n_tok, h))
    for e in range(n_exp):
        a, b = x2 @ w_gate[e], x2 @ w_up[e]
        s = a * _sigmoid(a)
        acts.append((a, b, s))
        outs[e] = (s * b) @ w_down[e]
    y = np.einsum("te,eth->th", w, outs).reshape(x.shape)
    f = routed.sum(axis=0) / (n_tok * k)
    aux = float(aux_coef * n_exp * np.sum(f * p.mean(axis=0)))
    if dy is None:
        return MoEOutput(y, aux, load), choice, keep

    dy2 = np.asarray(dy, np.float64).reshape(-1, h)
    dx = np.zeros_like(x2)
    d_gate, d_up, d_down = (np.zeros_like(np.asarray(m, np.float64))
                            for m in (w_gate, w_up, w_down))
    for e in range(n_exp):
        a, b, s = acts[e]
        d_out = w[:, e:e + 1] * dy2
        d_down[e] = (s * b).T @ d_out
        dhid = d_out @ w_down[e].T
        sig = _sigmoid(a)
        da = dhid * b * sig * (1 + a * (1 - sig))
        db = dhid * s
        d_gate[e] = x2.T @ da
        d_up[e] = x2.T @ db
        dx += da @ w_gate[e].T + db @ w_up[e].T

    dg = np.zeros((n_tok, k))
    for c in range(k):
        dg[:, c] = keep[:, c] * np.einsum("th,th->t", dy2, outs[choice[:, c], np.arange(n_tok)])
    dl = np.zeros((n_tok, n_exp))
    for t in range(n_tok):
        if k == 1:
            e = choice[t, 0]
            onehot = np.eye(n_exp)[e]
            dl[t] += dg[t, 0] * p[t, e] * (onehot - p[t])       # d p_e / d l = p_e (1_e - p)
        else:
            g = gate[t]
            dl[t, choice[t]] += g * (dg[t] - np.dot(g, dg[t]))  # softmax over the k logits
    # d aux / d l[t] = alpha E / N · p[t] (f - <p[t], f>)
    dl += d_aux * aux_coef * n_exp / n_tok * p * (f[None, :] - (p @ f)[:, None])
    dx += dl @ w_router.T
    grads = MoEGradients(y, aux, dx.reshape(x.shape), x2.T @ dl, d_gate, d_up, d_down, load)
    return grads, choice, keep
