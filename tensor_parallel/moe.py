"""``MoE``: a mixture-of-experts layer with expert parallelism over a mesh axis ``ep``.

E experts, each a SwiGLU MLP; ep ranks, each holding E_l = E/ep experts (rank r: experts
r·E_l … (r+1)·E_l − 1) and its own T tokens: the tokens are data-parallel over ep (as in
Megatron, where ep divides dp·cp). Other mesh axes, if any, hold replicas. Shapes on
one rank: x (T, h) (the global x (N, ...) is split on its first dimension, T = N/ep
tokens each), W_r (h, E) replicated, W_gate, W_up (E_l, h, f), W_down (E_l, f, h).

Forward on rank r:

    l = x W_r,  v = softmax(l) or sigmoid(l)      (T, E)      router scores
    e[t, :k] = the k largest v[t] (ties: the lower expert index), 1 <= k <= E; with
               ``groups`` (n_group, topk_group) only among the experts of t's topk_group
               best groups (a group's score: its two best experts' scores summed)
    g[t, c]  = σ · v[t, e_c]                      raw (Switch, Qwen2-MoE)
             = σ · v[t, e_c] / S_t, S_t = sum_c v[t, e_c]   normalised over the k chosen
               (``normalize_top_k``; Mixtral, Qwen3, DeepSeek-V3; for a softmax router =
               the softmax of the k chosen logits); σ = ``routed_scaling`` (DeepSeek-V3 2.5)
    p = v (softmax) or v / sum_e v[t, e] (sigmoid): the probabilities the aux loss reads
    capacity C = ceil(capacity_factor · T·k / E) per expert and rank (None: dropless);
      slots fill in a fixed order: every token's first choice in token order, then every
      second choice (GShard); a choice that finds its expert full is dropped and
      contributes 0 (the residual is the caller's); g keeps its value (no renormalising
      over the kept choices)
    dispatch: the kept rows x[t], sorted by (expert, slot), go to their expert's rank
    expert i on its m_i rows X_i:  O_i = (silu(X_i Wg_i) * (X_i Wu_i)) Wd_i,
      silu(a) = a·sigmoid(a)
    combine: O back to the token's rank; y[t] = sum over kept c of g[t, c] · O[t, c]
    shared expert (``shared_ffn_hidden`` F_s > 0; DeepSeek, Qwen2-MoE): one SwiGLU MLP of
      width F_s (the shared experts side by side) on every token, y[t] += S(x[t]); its
      weights are replicated over ep like the router's
    aux = alpha · E · sum_i f_i · P_i   over the *global* batch of the ep group (N = ep·T
      tokens): f_i = (assignments routed to i, before dropping) / (N·k),
      P_i = (1/N) sum_t p[t, i]; one all_reduce(ep) of the 2·E local sums. = alpha when
      perfectly balanced.

Backward of L = <dy, y> + d_aux · aux (f is a count: no gradient), per rank:

    dO[t, c] = g[t, c] dy[t]  (dispatched like x),  dg[t, c] = <dy[t], O[t, c]>
    expert: dWd = H^T dO, dH = dO Wd^T, dA = dH·B·silu'(A), dB = dH·silu(A),
            dWg = X^T dA, dWu = X^T dB, dX = dA Wg^T + dB Wu^T  (combined back like O)
            with A = X Wg, B = X Wu, H = silu(A)·B, silu'(a) = s(a)(1 + a(1 − s(a)))
    gates: dv[t, e_c] = σ dg_c (raw);  dv[t, e_c] = (σ dg_c − sum_c' g_c' dg_c') / S_t
           (normalised);  aux: dp[t, i] = d_aux · alpha·E·f_i / N, through p's
           normalisation for a sigmoid router: dv[t] += (dp[t] − <p[t], dp[t]>) / sum v[t]
    scores: dl = v·(dv − <v, dv>) (softmax), dv·v·(1 − v) (sigmoid);
            dW_r = all_reduce_ep(x^T dl);  dx = dX + dl W_r^T (+ the shared expert's dx)

Every expert's gradient lives on its owner (nothing to reduce over ep); the router is
replicated over ep, so its gradient is summed over ep by one all_reduce.

Biases (GPT-OSS; ``router_bias``, ``expert_bias``; the training layer passes them to
:meth:`MoE.forward_saved`): l = x W_r + b_r, b_r (E,) replicated like W_r; expert i
O_i = (silu(X_i Wg_i + bg_i) * (X_i Wu_i + bu_i)) Wd_i + bd_i, so y[t] = Σ_c g[t, c]·O
holds the down bias inside the gate (Hugging Face's GptOssExperts adds down_proj_bias
before weighting by the routing weights). Gradients: db_r = Σ_t dl[t] (beside dW_r, this
rank's tokens: reduced as dW_r), bg_i = Σ_rows dA, bu_i = Σ_rows dB, bd_i = Σ_rows dO (on
the owner). With etp, bg and bu split with Wg's and Wu's columns; bd is whole on every
etp rank and added by etp rank 0 only, before the caller's reduction of the partial O
(after it, the caller would need Σ_c g·bd of other ranks' experts); dO is whole on every
etp rank, so each holds all of dbd (equal, no collective), and the all-reduced dg counts
bd once. Adds and sums: 0 FLOPs.

Expert tensor parallelism (a training layer's ``device_ops(dev, etp_axis="tp")``,
Megatron-Core's etp = tp): every etp rank routes the same tokens and holds a column
slice f/t of each expert's (and the shared expert's) W_gate, W_up and the matching row
slice of W_down, so its O (and y) is a partial sum over the etp group — the caller
reduces it (all_reduce, or reduce_scatter under sequence parallelism) — and its expert
FLOPs are 1/t of the expert's. In the backward dg = <dy, O> needs the whole O: one
all_reduce(etp) of dg over the kept rows (A values); dX of the experts is again a
partial sum (the caller's reduction), the router's dl W_r^T whole on every rank.

Exchanges. The counts first: one all_to_all(ep) of the E kept counts (int64; rank r
learns c[s][j], the rows rank s sends to its expert j). Then the rows, in one of two
ways, as real systems do:

* capacity (GShard, Switch, DeepSpeed-MoE; Megatron's ``pad_expert_input_to_capacity``):
  a fixed (E, C, h) buffer, empty slots zero, through all_to_all(ep) — equal pieces,
  so the traffic is fixed by the shapes, whatever the routing;
* dropless (Megatron's all-to-all token dispatcher: ``all_to_all_single`` with the split
  sizes the counts gave, which NCCL runs as one send and one receive per peer): exactly
  the routed rows, one message per peer that has any, as ``send``/``recv`` over the ep
  group (user tags ``MOE_TAG`` + 0..3), no padding.

The experts compute only their routed rows in both modes (the counts say which slots
hold rows).

Flex (``dispatcher="flex"``; Megatron-Core's ``moe_token_dispatcher_type="flex"`` with
``moe_flex_dispatcher_backend="deepep"`` or ``"hybridep"``: ``MoEFlexTokenDispatcher``
and ``_DeepepManager`` in megatron/core/transformer/moe/token_dispatcher.py, over DeepEP's
``Buffer.dispatch(x, topk_idx=, topk_weights=, ...)`` -> (recv_x, recv_topk_idx,
recv_topk_weights, num_recv_tokens_per_expert_list, handle) and ``Buffer.combine(x,
handle, topk_weights=)``, github.com/deepseek-ai/DeepEP): a token crosses the link once
per *destination rank*, not once per chosen expert. On rank r, with q(e) = e // E_l the
member holding expert e and K_q[t] = {c kept : q(e[t, c]) = q}:

    send to q:  one row per token t with K_q[t] non-empty, in token order:
                [x[t] | id_c | g_c] (h + 2k wide): id_c = e[t, c] − q·E_l for c in K_q[t],
                −1 otherwise, and g_c = g[t, c] there, 0 otherwise (DeepEP's recv_topk_idx
                and recv_topk_weights; carried here in x's dtype, one message per peer)
    receiver:   expands: local expert j's rows X_j are the received rows with an id j,
                ordered by source rank, then the source's token order (fixed, so results
                are deterministic); O_j = expert_j(X_j) (biases as above: b_d inside the
                gate); each received row u gets Y[u] = Σ_{j: id_c(u) = j} g_c(u) · O_j[u]
    combine:    Y[u] back to its source, one row per (token, member); the owner sums:
                y[t] = Σ_q Y_q[t]  (= Σ_c g·O as above)

Backward: dy[t] once per (token, member) (the combine's transpose); the receiver, which
holds O, forms per local expert dO_j = g·dy and dg = <dy, O_j> (a partial sum over etp,
like O), runs the experts' backward (weight gradients as before, on the owner), and
returns [Σ_j dX_j | dg_c] (h + k wide: DeepEP's combine of x and topk_weights) one row per
(token, member); the owner sums dX over the members and scatters dg to its kept
choices, then all-reduces dg over etp (A values, as the all-to-all dispatcher). With etp
each etp rank exchanges over its own ep group, so its O, y and dX are partial sums the
caller reduces, exactly as above. With a capacity the dropped choices are left out of
K_q (DeepEP's −1 in topk_idx: Megatron masks them so), nothing is padded.

The counts: one all_to_all(ep) of (n, 1 + E_l) int64 per call (per member: the distinct
rows, then the kept rows per local expert, DeepEP's notify step) — (n−1)(1 + E_l)·8 bytes
sent and received. With tokens[s][d] the distinct tokens rank s sends member d
(:class:`~tensor_parallel.moe_load.ExpertLoad`'s ``tokens`` table; a trace takes it
from the load), per rank r and exchange:

    dispatch x       sent  (h + 2k)·b · Σ_{q≠r} tokens[r][q]    received (h + 2k)·b · Σ_{s≠r} tokens[s][r]
    combine Y        sent  h·b · Σ_{s≠r} tokens[s][r]           received h·b · Σ_{q≠r} tokens[r][q]
    dispatch dy      as dispatch x with h·b per row
    combine [dX|dg]  as combine Y with (h + k)·b per row

against the all-to-all dispatcher's Σ_e kept rows: equal rows when no token has two
choices on one member (always for k = 1), fewer when it has; the routing columns cost
2k·b per row forward and k·b backward. FLOPs are the all-to-all dispatcher's (each
expert computes the same rows).

Flex across nodes (``ep_node_ranks=d`` < n, n a multiple of d; DeepEP's internode
"normal" kernels — ``Buffer.get_dispatch_layout`` gives ``num_tokens_per_rdma_rank``
beside ``num_tokens_per_rank``, csrc/kernels/internode.cu forwards RDMA-received tokens
over NVLink; its README: "kernels optimized for asymmetric-domain bandwidth forwarding,
such as forwarding data from NVLink domain to RDMA domain", github.com/deepseek-ai/DeepEP
— and Megatron-Core's HybridEP across NVLink domains). The expert group's positions
[0..d-1], [d..2d-1], ... share a node; node N holds experts N·d·E_l … (N+1)·d·E_l − 1;
rank r's proxy on node N is N·d + (r mod d), the rank there with r's local index (r
itself on r's own node). With U_N[t] = {c kept : e[t, c] in node N}:

    inter-node (tags MOE_TAG + 0..3): r sends node N's proxy one row per token t with
        U_N[t] non-empty, token order: [x[t] | id_c | g_c], id_c = e[t, c] − N·d·E_l
        (the node's local expert) for c in U_N[t], −1 otherwise
    proxy p: splits each source's rows to its node's ranks q (its own included): the rows
        with an id in q's range, re-based (id_c − (q mod d)·E_l, −1 and g_c = 0 outside)
        — exactly the rows flex would send q from that source, in its token order
    intra-node (tags MOE_TAG + 4..7 = MOE_TAG + _INTRA + 0..3): one message p -> q with
        the rows of all p's sources (one per node) in source order
    q: computes as flex (its received rows, by source rank, then token order)
    combine: q returns each source's rows Y to that source's proxy on q's node (intra);
        the proxy adds its node's rows per token, Z_s[t] = Σ_{q of its node} Y_q[t], and
        sends one row per token back to the source (inter); y[t] = Σ_N Z_N[t]
    backward: dy once per (token, node) (inter), forwarded like x (intra, h wide); the
        [dX | dg] rows (h + k) back to the proxy (intra), summed per token there — a
        choice's dg is non-zero on its owner only, so the sum carries each dg once —
        and one row per token back (inter)

The counts: one all_to_all(ep) of (n, 2 + E_l) int64 — per member q: the distinct rows
for q's node (its proxy reads its sources'), for q, then the kept rows per local expert.
With tokens[s][q] and node_tokens[s][N] (:class:`~tensor_parallel.moe_load.ExpertLoad`),
ν = ⌊r/d⌋, S_r = {N·d + (r mod d)} (r's sources as a proxy, and its proxies), L_r = ν's
ranks, per rank r and exchange, w the row width (h + 2k for x, h, h, h + k as above):

    inter-node dispatch  sent  w·b · Σ_{N≠ν} node_tokens[r][N]
                         recvd w·b · Σ_{s∈S_r, s≠r} node_tokens[s][ν]
    intra-node dispatch  sent  w·b · Σ_{q∈L_r, q≠r} Σ_{s∈S_r} tokens[s][q]
                         recvd w·b · Σ_{s: s mod d ≠ r mod d} tokens[s][r]
    combines             the same with sent and received swapped

so the rows crossing nodes are Σ_{N≠ν} node_tokens[r][N] <= Σ_{q∉L_r} tokens[r][q] (the
one-hop flex's), fewer exactly when some token picks two ranks of one other node; with
d = 1 every rank is its own node and the inter-node hop is the one-hop flex's, byte for
byte. The proxy's splits and sums are declared with 0 FLOPs and the bytes they touch.

Traffic per rank r, with b the itemsize, n = ep, kept[s][e] the kept table
(:class:`~tensor_parallel.moe_load.ExpertLoad`) and the pairwise all_to_all
(per rank (n−1)/n of its input, sent and received):

    counts:    (n−1)/n · E · 8 bytes, sent and received, once per call
    capacity:  (n−1) · E_l · C · h · b per token exchange, sent and received
    dropless:  sent   h·b · sum_{e not r's} kept[r][e]
               recvd  h·b · sum_{s != r} sum_{e r's} kept[s][e]      (per exchange;
               combine exchanges swap the two)

A forward makes two token exchanges (dispatch x, combine O); forward + backward four
(then dO like x, dX like O). Plus all_reduce(ep) of the (2, E) aux sums (float) in the
forward and of dW_r (h, E) in the backward.

FLOPs declared (products only; softmax, routing, gathers and SwiGLU's elementwise work
are declared with 0 FLOPs and the bytes they touch): router 2·T·h·E forward, 4·T·h·E
backward; experts 2·3·h·f per row they compute forward (m_r = rows rank r's experts
receive), 2·6·h·f backward; the shared expert 2·3·h·F_s per token forward, 2·6·h·F_s
backward. Many small expert GEMMs are declared one per expert with its own (m_j, h, f)
shape, so the timing model prices each at the efficiency of its size.

Tracing. A trace holds no values, so it cannot route: it takes the counts as given, an
:class:`ExpertLoad` (``meta_args``; the emulator returns the load it saw, and
``ExpertLoad.skewed`` builds one for a chosen imbalance). With capacity the rows' traffic
does not depend on it (the FLOPs do); dropless both do. Given the load the emulation
saw, the trace moves what the emulator moved, message for message.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Mapping

import numpy as np

from sharding import TensorSharding as TS
from vcluster.runtime.algorithm import choose_algorithm
from vcluster.runtime.tracing import MetaArray, is_meta
from .matmul import local_matmul
from .moe_load import ExpertLoad, MoEGradients, MoEOutput, expert_capacity
from .moe_reference import moe_reference
from .operation import ShardedOperation, run_sharded

__all__ = ["MoE", "MOE_TAG", "DISPATCHERS", "ROUTERS"]

MOE_TAG = 0x4D6F45 << 4            # "MoE": user tags MOE_TAG + 0..3 of the dropless exchanges
_DISPATCH, _COMBINE, _GRAD_DISPATCH, _GRAD_COMBINE = range(4)
_INTRA = 4                         # + the above: the intra-node hop of ``ep_node_ranks``
_WHAT = {_DISPATCH: "dispatch", _COMBINE: "combine", _GRAD_DISPATCH: "backward dispatch",
         _GRAD_COMBINE: "backward combine"}


def _nbytes(a) -> int:
    return int(a.size) * np.dtype(a.dtype).itemsize


def _sigmoid(a):
    return 0.5 * (1.0 + np.tanh(0.5 * a))        # = 1/(1 + exp(-a)), without overflow


# --- the device steps -------------------------------------------------------------------
class _Ops:
    """A rank's steps: products through ``local_matmul``, other work declared with 0
    FLOPs; collectives over the ep axis (and the etp axis, when the experts' hidden
    dimension is split over it)."""

    def __init__(self, dev, ep_axis: str, algorithms: Mapping[str, str],
                 etp_axis: str | None = None, recompute_act: bool = False):
        self.recompute_act = bool(recompute_act)   # moe_act: :func:`_expert_forward`
        axes = (ep_axis,) if isinstance(ep_axis, str) else tuple(ep_axis)
        present = tuple(a for a in axes if a in dev.mesh.axes)
        self.dev, self.algorithms = dev, algorithms
        self.ep_axis = present[0] if len(present) == 1 else present   # one axis or several
        self.etp_axis = etp_axis if etp_axis in dev.mesh.axes and \
            dev.mesh.axis_size(etp_axis) > 1 else None
        self.etp_rank = 0 if self.etp_axis is None else \
            dev.mesh.group_position(self.etp_axis, dev.rank)   # adds b_down when 0
        self.solo = not present                        # no ep axis: all experts here
        self.group = (dev.rank,) if self.solo else dev.mesh.group(present, dev.rank)
        self.n = len(self.group)
        self.pos = self.group.index(dev.rank)

    def matmul(self, a, b, name):
        return local_matmul(self.dev, a, b, f"moe: {name}")

    def ew(self, name, fn, *operands, shape=None, dtype=None, nbytes=None):
        """``fn()`` over ``operands``; on shape-only operands (a trace) a result of
        ``shape`` and ``dtype`` (default: the first operand's) when ``shape`` is given.
        Declared with 0 FLOPs and the bytes it reads: ``nbytes``, or all of ``operands``
        (a copy of some rows of them reads only those: give ``nbytes``)."""
        read = sum(map(_nbytes, operands)) if nbytes is None else int(nbytes)
        with self.dev.compute(f"moe: {name}", flops=0, bytes=read):
            if shape is not None and any(is_meta(o) for o in operands):
                return MetaArray(shape, dtype or operands[0].dtype)
            return fn()

    def all_reduce(self, x):
        if self.solo:
            return x
        return self.dev.all_reduce(x, self.ep_axis,
                                   algorithm=self.algorithms.get("all_reduce", "auto"))

    def all_reduce_etp(self, x):
        """Sum over the expert-tensor-parallel group (x itself without one)."""
        if self.etp_axis is None:
            return x
        return self.dev.all_reduce(x, self.etp_axis,
                                   algorithm=self.algorithms.get("all_reduce", "auto"))

    def all_to_all(self, x):
        if self.solo:
            return x
        return self.dev.all_to_all(x, self.ep_axis, split_dim=0, concat_dim=0,
                                   algorithm=self.algorithms.get("all_to_all", "auto"))

    def exchange(self, pieces, counts_in, like, tag: int, members=None):
        """All-to-all-v: ``pieces[q]`` (rows for group member q) goes to q, one message
        per member with rows; returns the pieces received, ``counts_in[q]`` rows from q.
        ``members``: the group positions taking part (this rank's among them; default
        all), ``pieces`` and ``counts_in`` then indexed like ``members``."""
        members = list(range(self.n)) if members is None else list(members)
        n, me, h = len(members), members.index(self.pos), like.shape[-1]
        for d in range(1, n):
            q = (me + d) % n
            if pieces[q].shape[0]:
                self.dev.send(pieces[q], self.group[members[q]], MOE_TAG + tag)
        got = [None] * n
        got[me] = pieces[me]
        for d in range(1, n):
            q = (me - d) % n
            got[q] = np.empty_like(like, shape=(counts_in[q], h))
            if counts_in[q]:
                got[q] = self.dev.recv(self.group[members[q]], MOE_TAG + tag, out=got[q])
        return got


class _Routing:
    """One rank's routing: scores v (T, E), experts and gates (T, k); the kept assignments
    sorted by (expert, slot): tok, choice (A,) and slot = expert·C + position (A,);
    routed and kept counts (E,) as device arrays, kept also as host ints; rank_arr (n,)
    the distinct tokens with a kept choice on each member of the expert group (the
    ``flex`` dispatcher's rows, :class:`~.moe_load.ExpertLoad`'s ``tokens`` row), also as
    host ints ``rank_tokens`` (None in a trace whose load has no such table)."""

    def __init__(self, scores, experts, gates, tok, choice, slot, routed, kept_arr, kept,
                 rank_arr, rank_tokens, node_arr=None, node_tokens=None):
        self.scores, self.experts, self.gates = scores, experts, gates
        self.tok, self.choice, self.slot = tok, choice, slot
        self.routed, self.kept_arr, self.kept = routed, kept_arr, tuple(kept)
        self.rank_arr = rank_arr
        self.rank_tokens = None if rank_tokens is None else tuple(rank_tokens)
        # per destination node (``ep_node_ranks``): distinct tokens with a kept choice on
        # one of the node's ranks (ExpertLoad's ``node_tokens`` row); None without nodes
        self.node_arr = node_arr
        self.node_tokens = None if node_tokens is None else tuple(node_tokens)


def _group_mask(scores, groups):
    """The scores with every expert outside each token's ``topk_group`` best of
    ``n_group`` groups set to -inf (a group's score: the sum of its two best experts',
    DeepSeek-V3's; ties: the lower group)."""
    n_group, topk_group = groups
    t, n_exp = scores.shape
    by_group = scores.reshape(t, n_group, n_exp // n_group)
    best2 = -np.sort(-by_group, axis=2)[:, :, :min(2, n_exp // n_group)].sum(axis=2)
    keep = np.argsort(-best2, axis=1, kind="stable")[:, :topk_group]      # (T, topk_group)
    allowed = np.zeros((t, n_group), dtype=bool)
    np.put_along_axis(allowed, keep, True, axis=1)
    return np.where(np.repeat(allowed, n_exp // n_group, axis=1), scores, -np.inf)


def _route_values(scores, k: int, cap: int | None, normalize: bool, scaling: float,
                  groups=None, bias=None, ranks: int = 1, nodes: int | None = None):
    """Top-k, gates and capacity on real arrays (see the module docstring); ``bias``
    (E,) shifts the choice, not the gates (DeepSeek-V3's auxiliary-loss-free balance);
    the last results: per member of the ``ranks`` expert group, the distinct tokens with a
    kept choice among its experts; per node of ``nodes`` (None: none), the same per node
    (its ranks' experts together)."""
    t, n_exp = scores.shape
    choose = scores if bias is None else scores + bias
    choose = choose if groups is None else _group_mask(choose, groups)
    experts = np.argsort(-choose, axis=1, kind="stable")[:, :k]           # (T, k)
    sel = np.take_along_axis(scores, experts, axis=1)
    gates = scaling * (sel / sel.sum(axis=1, keepdims=True) if normalize else sel)
    flat = experts.T.reshape(-1)                      # choice-major: all 1st, then 2nd
    onehot = (flat[:, None] == np.arange(n_exp, like=flat)[None, :]).astype(np.int64)
    position = np.take_along_axis(np.cumsum(onehot, axis=0) - onehot, flat[:, None], 1)[:, 0]
    kept_idx = np.nonzero(position < (cap if cap is not None else k * t + 1))[0]
    order = kept_idx[np.argsort(flat[kept_idx] * (k * t) + position[kept_idx], kind="stable")]
    e_kept = flat[order]
    kept_arr = onehot[order].sum(axis=0)
    slot = e_kept * (cap or 0) + position[order]
    reach = np.zeros_like(onehot, shape=(t, ranks))
    reach[order % t, e_kept // (n_exp // ranks)] = 1            # token t reaches rank q
    node_reach = None
    if nodes is not None:
        node_reach = np.zeros_like(onehot, shape=(t, nodes))
        node_reach[order % t, e_kept // (n_exp // nodes)] = 1   # token t reaches node N
        node_reach = node_reach.sum(axis=0)
    return (experts, gates, order % t, order // t, slot, onehot.sum(axis=0), kept_arr,
            reach.sum(axis=0), node_reach)


def _route(ops, probs, k: int, cap: int | None, load: ExpertLoad | None,
           normalize: bool = False, scaling: float = 1.0, groups=None, bias=None,
           nodes: int | None = None):
    t, n_exp = probs.shape
    if is_meta(probs):
        if load is None:
            raise ValueError("MoE: a traced program cannot route (its arrays hold no values); "
                             "pass load=ExpertLoad(...) (see MoE.meta_args)")
        kept = load.kept[ops.pos]
        a = sum(kept)
        i64 = np.dtype(np.int64)
        res = (MetaArray((t, k), i64), MetaArray((t, k), probs.dtype),
               *(MetaArray((a,), i64) for _ in range(3)), MetaArray((n_exp,), i64),
               MetaArray((n_exp,), i64))
        ops.ew("route: top-k, capacity", lambda: None, probs)
        tokens = None if load.tokens is None or len(load.tokens[0]) != ops.n \
            else load.tokens[ops.pos]
        node_tokens = None if nodes is None or load.node_tokens is None or \
            len(load.node_tokens[0]) != nodes else load.node_tokens[ops.pos]
        return _Routing(probs, *res, kept, MetaArray((ops.n,), i64), tokens,
                        None if nodes is None else MetaArray((nodes,), i64), node_tokens)
    res = ops.ew("route: top-k, capacity", lambda: _route_values(
        probs, k, cap, normalize, scaling, groups, bias, ops.n, nodes), probs)
    return _Routing(probs, *res[:-2], res[-3].tolist(), res[-2], res[-2].tolist(), res[-1],
                    None if res[-1] is None else res[-1].tolist())


class _Exchange:
    """The token exchanges of one call: the kept rows (A, h) sorted by (expert, slot) to
    per-expert inputs on their owners (``dispatch``) and back (``combine``)."""

    def __init__(self, ops, route: _Routing, recv_counts, cap: int | None, e_l: int):
        self.ops, self.route, self.cap, self.e_l = ops, route, cap, e_l
        self.c = recv_counts                            # c[s][j]: rows from member s to j
        kept, n = route.kept, ops.n
        self.send_rows = [sum(kept[q * e_l:(q + 1) * e_l]) for q in range(n)]
        self.recv_rows = [sum(row) for row in self.c]

    def _segments(self, j):
        """(s, start, stop) of expert j's rows from each member s, in its input."""
        out, at = [], 0
        for s in range(self.ops.n):
            out.append((s, at, at + self.c[s][j]))
            at += self.c[s][j]
        return out

    def dispatch(self, rows, tag: int, what: str):
        """rows (A, h) -> [X_j (m_j, h) for the E_l local experts]."""
        ops, n, e_l, h = self.ops, self.ops.n, self.e_l, rows.shape[1]
        if self.cap is not None:
            n_exp, cap = n * e_l, self.cap

            def pack():
                buf = np.zeros_like(rows, shape=(n_exp * cap, h))
                buf[self.route.slot] = rows
                return buf.reshape(n_exp, cap, h)

            got = ops.all_to_all(ops.ew(f"{what}: pack (E, C, h)", pack, rows,
                                        self.route.slot, shape=(n_exp, cap, h)))
            item = np.dtype(rows.dtype).itemsize
            return [ops.ew(f"{what}: gather expert rows", lambda j=j: np.concatenate(
                [got[s * e_l + j, :self.c[s][j]] for s in range(n)]), got,
                nbytes=sum(self.c[s][j] for s in range(n)) * h * item) for j in range(e_l)]
        bounds = np.concatenate([[0], np.cumsum(self.send_rows)]).tolist()
        pieces = [rows[bounds[q]:bounds[q + 1]] for q in range(n)]
        got = ops.exchange(pieces, self.recv_rows, rows, tag)
        out = []
        for j in range(e_l):
            def gather(j=j):
                offs = [sum(self.c[s][:j]) for s in range(n)]
                return np.concatenate([got[s][offs[s]:offs[s] + self.c[s][j]]
                                       for s in range(n)])
            out.append(ops.ew(f"{what}: gather expert rows", gather, *got,
                              nbytes=sum(self.c[s][j] for s in range(n)) * h
                              * np.dtype(rows.dtype).itemsize))
        return out

    def combine(self, outs, tag: int, what: str):
        """[O_j (m_j, h)] -> rows (A, h) in the order dispatch took them."""
        ops, n, e_l, h = self.ops, self.ops.n, self.e_l, outs[0].shape[1]
        segs = [self._segments(j) for j in range(e_l)]
        if self.cap is not None:
            cap = self.cap

            def pack():
                buf = np.zeros_like(outs[0], shape=(n * e_l, cap, h))
                for j in range(e_l):
                    for s, a, b in segs[j]:
                        buf[s * e_l + j, :b - a] = outs[j][a:b]
                return buf

            got = ops.all_to_all(ops.ew(f"{what}: pack (E, C, h)", pack, *outs))
            a = self.route.slot.shape[0]
            return ops.ew(f"{what}: unpack rows", lambda: got.reshape(n * e_l * cap, h)[
                self.route.slot], got, self.route.slot, shape=(a, h))
        item = np.dtype(outs[0].dtype).itemsize
        pieces = [ops.ew(f"{what}: pack rows for member {s}", lambda s=s: np.concatenate(
            [outs[j][segs[j][s][1]:segs[j][s][2]] for j in range(e_l)]), *outs,
            nbytes=sum(segs[j][s][2] - segs[j][s][1] for j in range(e_l)) * h * item)
            for s in range(n)]
        got = ops.exchange(pieces, self.send_rows, outs[0], tag)
        return ops.ew(f"{what}: unpack rows", lambda: np.concatenate(got), *got)


class _AllToAllDispatch:
    """The all-to-all dispatcher (Megatron's ``alltoall``; the module docstring's
    "Exchanges"): the kept rows to their experts' owners and back, by all_to_all (a
    capacity's padded buffers) or one message per peer (dropless)."""

    def __init__(self, ops, route, cap, e_l: int, load):
        self.ops, self.route, self.e_l = ops, route, e_l
        counts = ops.all_to_all(route.kept_arr)                   # (n·E_l,): [s][j]
        if is_meta(counts):
            if load is None:
                raise ValueError("MoE: a traced program needs load=ExpertLoad(...)")
            mine = range(ops.pos * e_l, (ops.pos + 1) * e_l)
            c = [[load.kept[s][e] for e in mine] for s in range(ops.n)]
        else:
            flat = counts.tolist()
            c = [flat[s * e_l:(s + 1) * e_l] for s in range(ops.n)]
        self.ex = _Exchange(ops, route, c, cap, e_l)

    def forward(self, x2, weights, biases=None):
        """(y of the routed experts (T, h), the backward's state); ``biases``: the local
        experts' (b_gate, b_up, b_down) or None."""
        ops, route, ex, h, t = self.ops, self.route, self.ex, x2.shape[1], x2.shape[0]
        wg, wu, wd = weights
        a = route.tok.shape[0]
        rows = ops.ew("dispatch: gather kept rows", lambda: x2[route.tok], x2, route.tok,
                      shape=(a, h))
        xs = ex.dispatch(rows, _DISPATCH, "dispatch")
        outs, states = zip(*(_expert_forward(ops, xs[j], wg[j], wu[j], wd[j], j,
                                             _expert_biases(biases, j))
                             for j in range(self.e_l)))
        out_rows = ex.combine(list(outs), _COMBINE, "combine")
        g_sel = ops.ew("combine: gates of kept rows", lambda: route.gates[
            route.tok, route.choice], route.gates, route.tok)
        y = _scatter_rows(ops, "combine: y = sum g O", t, route.tok,
                          ops.ew("combine: g O", lambda: g_sel[:, None] * out_rows,
                                 g_sel, out_rows))
        return y, (xs, states, out_rows, g_sel)

    def backward(self, state, dy2, weights, biases=None):
        """(dx of the routed experts (T, h), dg of the kept assignments (A,), summed over
        etp, [dW_gate, dW_up, dW_down] + [db_gate, db_up, db_down] with ``biases``)."""
        ops, route, ex, t, h = self.ops, self.route, self.ex, dy2.shape[0], dy2.shape[1]
        xs, states, out_rows, g_sel = state
        wg, wu, wd = weights
        dy_rows = ops.ew("backward: gather dy rows", lambda: dy2[route.tok], dy2, route.tok,
                         shape=(route.tok.shape[0], h))
        d_out_rows = ops.ew("backward: dO = g dy", lambda: g_sel[:, None] * dy_rows,
                            g_sel, dy_rows)
        dg_sel = ops.all_reduce_etp(ops.ew("backward: dg = <dy, O>", lambda: (
            dy_rows * out_rows).sum(axis=1), dy_rows, out_rows))
        d_outs = ex.dispatch(d_out_rows, _GRAD_DISPATCH, "backward dispatch")
        dw = [np.zeros_like(w) for w in tuple(weights) + tuple(biases or ())]
        dxs = []
        for j in range(self.e_l):
            dxj, *gj = _expert_backward(ops, xs[j], wg[j], wu[j], wd[j], states[j],
                                        d_outs[j], j, biases is not None)
            dxs.append(dxj)
            for acc, g in zip(dw, gj):
                acc[j] = g
        dx_rows = ex.combine(dxs, _GRAD_COMBINE, "backward combine")
        return _scatter_rows(ops, "backward: dx = sum dX", t, route.tok, dx_rows), dg_sel, dw


class _AllGatherDispatch:
    """The all-gather dispatcher (Megatron's ``allgather``, for small expert groups):
    every rank all-gathers the group's tokens x (n·T, h) and their routing table (T, 2k:
    each choice's expert, -1 when dropped, and gate), computes its experts on the rows
    routed to them, weighs them by their gates into a partial y (n·T, h) and
    reduce-scatters it back to the tokens' owners. The backward all-gathers dy, and
    reduce-scatters dx (n·T, h) and dg (n·T, k). Traffic per rank and call, whatever the
    routing, with b the itemsize and n the group: all_gather (n−1)·T·(h + 2k)·b received,
    reduce_scatter (n−1)/n of n·T·h·b sent; backward all_gather (n−1)·T·h·b, reduce_scatter
    (n−1)/n of n·T·(h + k)·b."""

    def __init__(self, ops, route, cap, e_l: int, load):
        self.ops, self.route, self.e_l, self.load = ops, route, e_l, load

    def _all_gather(self, x):
        ops = self.ops
        if ops.solo:
            return x
        return ops.dev.all_gather(x, ops.ep_axis, dim=0,
                                  algorithm=ops.algorithms.get("all_gather", "auto"))

    def _reduce_scatter(self, x):
        ops = self.ops
        if ops.solo:
            return x
        return ops.dev.reduce_scatter(x, ops.ep_axis, dim=0,
                                      algorithm=ops.algorithms.get("reduce_scatter", "auto"))

    def _rows(self, table, j: int):
        """(i, c): the gathered tokens routed to local expert j and their choice."""
        e = self.ops.pos * self.e_l + j
        if is_meta(table):
            m = sum(row[e] for row in self.load.kept)
            return MetaArray((m,), np.dtype(np.int64)), MetaArray((m,), np.dtype(np.int64))
        k = table.shape[1] // 2
        return np.nonzero(table[:, :k] == e)

    def forward(self, x2, weights, biases=None):
        ops, route, (t, h) = self.ops, self.route, x2.shape
        k = route.gates.shape[1]
        wg, wu, wd = weights

        def table():
            chosen = np.full(route.experts.shape, -1.0, dtype=route.gates.dtype)
            chosen[route.tok, route.choice] = route.experts[route.tok, route.choice]
            return np.concatenate([chosen, route.gates], axis=1)

        tab = self._all_gather(ops.ew("dispatch: routing table (T, 2k)", table, route.gates,
                                      route.experts, shape=(t, 2 * k)))
        x_all = self._all_gather(x2)                                   # (n·T, h)
        n_t = x_all.shape[0]
        rows = [self._rows(tab, j) for j in range(self.e_l)]
        item = np.dtype(x2.dtype).itemsize
        xs = [ops.ew(f"dispatch: rows of expert {j}", lambda i=i: x_all[i], x_all, i,
                     shape=(i.shape[0], h), nbytes=i.shape[0] * h * item)
              for j, (i, _) in enumerate(rows)]
        gs = [ops.ew(f"dispatch: gates of expert {j}", lambda i=i, c=c: tab[i, k + c], tab, i,
                     shape=(i.shape[0],), nbytes=i.shape[0] * item)
              for j, (i, c) in enumerate(rows)]
        outs, states = zip(*(_expert_forward(ops, xs[j], wg[j], wu[j], wd[j], j,
                                             _expert_biases(biases, j))
                             for j in range(self.e_l)))

        def partial():
            y = np.zeros_like(x_all)
            for (i, _), g, o in zip(rows, gs, outs):
                np.add.at(y, i, g[:, None] * o)
            return y

        y_all = ops.ew("combine: partial y = sum g O (n·T, h)", partial, *outs,
                       shape=(n_t, h), dtype=x2.dtype)
        return self._reduce_scatter(y_all), (rows, xs, gs, outs, states, n_t)

    def backward(self, state, dy2, weights, biases=None):
        ops, route, (t, h) = self.ops, self.route, dy2.shape
        k = route.gates.shape[1]
        rows, xs, gs, outs, states, n_t = state
        wg, wu, wd = weights
        dy_all = self._all_gather(dy2)
        dw = [np.zeros_like(w) for w in tuple(weights) + tuple(biases or ())]
        dxs, dgs = [], []
        for j, (i, _) in enumerate(rows):
            dyj = ops.ew(f"backward: dy rows of expert {j}", lambda i=i: dy_all[i], dy_all, i,
                         shape=(i.shape[0], h),
                         nbytes=i.shape[0] * h * np.dtype(dy2.dtype).itemsize)
            dgs.append(ops.ew(f"backward: dg = <dy, O> of expert {j}", lambda d=dyj, o=outs[j]:
                              (d * o).sum(axis=1), dyj, outs[j], shape=(i.shape[0],)))
            d_out = ops.ew(f"backward: dO = g dy of expert {j}", lambda d=dyj, g=gs[j]:
                           g[:, None] * d, dyj, gs[j])
            dxj, *gj = _expert_backward(ops, xs[j], wg[j], wu[j], wd[j], states[j], d_out, j,
                                        biases is not None)
            dxs.append(dxj)
            for acc, g in zip(dw, gj):
                acc[j] = g

        def partial():
            dx = np.zeros((n_t, h + k), dtype=dy2.dtype)
            for (i, c), dxj, dgj in zip(rows, dxs, dgs):
                np.add.at(dx[:, :h], i, dxj)
                dx[i, h + c] = dgj
            return dx

        both = self._reduce_scatter(ops.ew("backward: partial [dx | dg] (n·T, h + k)",
                                           partial, *dxs, *dgs, shape=(n_t, h + k),
                                           dtype=dy2.dtype))
        dx = ops.ew("backward: dx", lambda: both[:, :h], both, shape=(t, h))
        dg = ops.all_reduce_etp(ops.ew("backward: dg", lambda: both[:, h:], both,
                                       shape=(t, k)))
        dg_sel = ops.ew("backward: dg of kept rows", lambda: dg[route.tok, route.choice],
                        dg, route.tok, shape=(route.tok.shape[0],))
        return dx, dg_sel, dw


class _FlexDispatch:
    """The token-deduplicating dispatcher (Megatron-Core's ``flex`` with DeepEP or HybridEP;
    the module docstring's "Flex"): each token goes once to each expert-group member that
    holds any of its kept choices, with its routing there; that member expands it to its
    experts and returns one row per (token, member) holding Σ_{e of the member} g_e·O_e.

    The source's side sends to *units* (here the members; :class:`_NodeFlexDispatch`'s
    nodes) through :meth:`_out` and gets their rows back through :meth:`_back`."""

    unit = "member"

    def __init__(self, ops, route, cap, e_l: int, load):
        self.ops, self.route, self.e_l = ops, route, e_l
        self.span = e_l                                  # experts per unit
        n, me = ops.n, ops.pos
        self._check_tables(route, n)
        counts = ops.all_to_all(ops.ew("dispatch: counts per rank [rows, per expert]",
                                       lambda: np.concatenate([route.rank_arr[:, None],
                                                               route.kept_arr.reshape(n, e_l)],
                                                              axis=1).reshape(-1),
                                       route.rank_arr, route.kept_arr,
                                       shape=(n * (1 + e_l),)))
        if is_meta(counts):
            self.m_in = [load.tokens[s][me] for s in range(n)]
            self.c = [[load.kept[s][me * e_l + j] for j in range(e_l)] for s in range(n)]
        else:
            flat = counts.tolist()
            self.m_in = [flat[s * (1 + e_l)] for s in range(n)]
            self.c = [flat[s * (1 + e_l) + 1:(s + 1) * (1 + e_l)] for s in range(n)]
        self._sizes(list(route.rank_tokens))             # rows this rank sends to each q

    def _sizes(self, m_out):
        n, e_l = self.ops.n, self.e_l
        self.m_out = m_out                               # rows this rank sends each unit
        self.out_at = np.concatenate([[0], np.cumsum(self.m_out)]).astype(int).tolist()
        self.in_at = np.concatenate([[0], np.cumsum(self.m_in)]).astype(int).tolist()
        self.m_exp = [sum(self.c[s][j] for s in range(n)) for j in range(e_l)]
        self.exp_at = np.concatenate([[0], np.cumsum(self.m_exp)]).astype(int).tolist()

    def _out(self, pieces, like, tag: int):
        """pieces[u] (this rank's rows for unit u) out; the rows received per source."""
        return self.ops.exchange(pieces, self.m_in, like, tag)

    def _back(self, pieces, like, tag: int):
        """pieces[s] (the rows received from source s, answered) back; this rank's rows
        per unit."""
        return self.ops.exchange(pieces, self.m_out, like, tag)

    @staticmethod
    def _check_tables(route, n):
        if route.rank_tokens is None:
            raise ValueError(
                f"MoE: dispatcher='flex' in a trace needs load=ExpertLoad(..., tokens=...), a "
                f"(ranks, {n}) table of the distinct tokens each rank sends to each of the "
                f"expert group's {n} members (ExpertLoad.skewed fills it; the emulator's "
                "MoE.run/backward report it)")

    def _pieces(self, rows, at):
        return [rows[at[q]:at[q + 1]] for q in range(len(at) - 1)]

    def _expert(self, table, j):
        return table[self.exp_at[j]:self.exp_at[j + 1]]

    def forward(self, x2, weights, biases=None):
        """(y of the routed experts (T, h), the backward's state)."""
        ops, route, e_l, span, unit = self.ops, self.route, self.e_l, self.span, self.unit
        n = len(self.m_out)                              # units
        (t, h), k = x2.shape, route.gates.shape[1]
        i64, item = np.dtype(np.int64), np.dtype(x2.dtype).itemsize
        wg, wu, wd = weights

        def ranks():                     # (T, k): the unit holding each kept choice, or -1
            kept = np.zeros_like(route.experts, shape=route.experts.shape)
            kept[route.tok, route.choice] = 1
            return np.where(kept > 0, route.experts // span, -1)

        dst = ops.ew(f"dispatch: {unit} of each kept choice", ranks, route.experts, route.tok,
                     shape=(t, k), dtype=i64)

        def order():                     # unit-major, then token order
            reach = (dst[None, :, :] == np.arange(n, like=dst)[:, None, None]).any(axis=2)
            return np.nonzero(reach)[1]

        tok = ops.ew(f"dispatch: tokens per {unit}", order, dst,
                     shape=(self.out_at[-1],), dtype=i64)

        def pack(q):
            rows = tok[self.out_at[q]:self.out_at[q + 1]]
            on = dst[rows] == q
            ids = np.where(on, route.experts[rows] % span, -1).astype(x2.dtype)
            gates = np.where(on, route.gates[rows], 0).astype(x2.dtype)
            return np.concatenate([x2[rows], ids, gates], axis=1)

        pieces = [ops.ew(f"dispatch: pack [x | ids | gates] for {unit} {q}",
                         lambda q=q: pack(q), x2, tok, dst, route.gates,
                         shape=(self.m_out[q], h + 2 * k),
                         nbytes=self.m_out[q] * ((h + k) * item + k * 8)) for q in range(n)]
        got = self._out(pieces, pieces[0], _DISPATCH)
        m_all = self.exp_at[-1]

        def expand():                    # (M, 2): per local expert, [received row, choice]
            ids = np.concatenate([g[:, h:h + k] for g in got])
            out = []
            for j in range(e_l):
                rows = np.nonzero((ids == j).any(axis=1))[0]
                cols = np.argmax(ids[rows] == j, axis=1)
                out.append(np.stack([rows, cols], axis=1))
            return np.concatenate(out)

        slots = ops.ew("dispatch: expand rows to local experts", expand, *got,
                       shape=(m_all, 2), dtype=i64,
                       nbytes=self.in_at[-1] * k * item)
        g_sel = ops.ew("dispatch: gates of the expanded rows", lambda: np.concatenate(
            [g[:, h + k:] for g in got])[slots[:, 0], slots[:, 1]], slots, *got,
            shape=(m_all,), dtype=x2.dtype, nbytes=m_all * item)
        xs = [ops.ew(f"dispatch: rows of expert {j}", lambda j=j: np.concatenate(
            [g[:, :h] for g in got])[self._expert(slots, j)[:, 0]], slots, *got,
            shape=(self.m_exp[j], h), dtype=x2.dtype, nbytes=self.m_exp[j] * h * item)
            for j in range(e_l)]
        outs, states = zip(*(_expert_forward(ops, xs[j], wg[j], wu[j], wd[j], j,
                                             _expert_biases(biases, j))
                             for j in range(e_l)))

        def member_sums():               # (R, h): Σ_{e here} g_e O_e per received row
            y = np.zeros_like(outs[0], shape=(self.in_at[-1], h))
            for j in range(e_l):
                np.add.at(y, self._expert(slots, j)[:, 0],
                          self._expert(g_sel, j)[:, None] * outs[j])
            return y

        y_rows = ops.ew("combine: sum g O per received row", member_sums, slots, g_sel, *outs,
                        shape=(self.in_at[-1], h), dtype=x2.dtype)
        back = self._back(self._pieces(y_rows, self.in_at), y_rows, _COMBINE)
        y_got = ops.ew("combine: unpack rows", lambda: np.concatenate(back), *back,
                       shape=(self.out_at[-1], h), dtype=x2.dtype)
        y = _scatter_rows(ops, f"combine: y = sum over {unit}s", t, tok, y_got)
        return y, (tok, slots, g_sel, xs, outs, states)

    def backward(self, state, dy2, weights, biases=None):
        """(dx of the routed experts (T, h), dg of the kept assignments (A,), summed over
        etp, [dW_gate, dW_up, dW_down] + [db_gate, db_up, db_down] with ``biases``)."""
        ops, route, e_l = self.ops, self.route, self.e_l
        (t, h), k = dy2.shape, route.gates.shape[1]
        item = np.dtype(dy2.dtype).itemsize
        tok, slots, g_sel, xs, outs, states = state
        wg, wu, wd = weights
        dy_rows = ops.ew(f"backward: gather dy rows per {self.unit}", lambda: dy2[tok], dy2,
                         tok, shape=(self.out_at[-1], h))
        got = self._out(self._pieces(dy_rows, self.out_at), dy_rows, _GRAD_DISPATCH)
        dw = [np.zeros_like(w) for w in tuple(weights) + tuple(biases or ())]
        dxs, dgs = [], []
        for j in range(e_l):
            rows = self._expert(slots, j)
            dyj = ops.ew(f"backward: dy rows of expert {j}", lambda r=rows: np.concatenate(
                got)[r[:, 0]], rows, *got, shape=(self.m_exp[j], h), dtype=dy2.dtype,
                nbytes=self.m_exp[j] * h * item)
            gj = self._expert(g_sel, j)
            dgs.append(ops.ew(f"backward: dg = <dy, O> of expert {j}", lambda d=dyj, o=outs[j]:
                              (d * o).sum(axis=1), dyj, outs[j], shape=(self.m_exp[j],)))
            d_out = ops.ew(f"backward: dO = g dy of expert {j}", lambda d=dyj, g=gj:
                           g[:, None] * d, dyj, gj)
            dxj, *gw = _expert_backward(ops, xs[j], wg[j], wu[j], wd[j], states[j], d_out, j,
                                        biases is not None)
            dxs.append(dxj)
            for acc, g in zip(dw, gw):
                acc[j] = g

        def member_grads():              # (R, h + k): [Σ_{e here} dX_e | dg per choice]
            out = np.zeros_like(dxs[0], shape=(self.in_at[-1], h + k))
            for j in range(e_l):
                rows = self._expert(slots, j)
                np.add.at(out[:, :h], rows[:, 0], dxs[j])
                out[rows[:, 0], h + rows[:, 1]] = dgs[j]
            return out

        both = ops.ew("backward combine: [dX | dg] per received row", member_grads, slots,
                      *dxs, *dgs, shape=(self.in_at[-1], h + k), dtype=dy2.dtype)
        back = self._back(self._pieces(both, self.in_at), both, _GRAD_COMBINE)
        rows = ops.ew("backward combine: unpack rows", lambda: np.concatenate(back), *back,
                      shape=(self.out_at[-1], h + k), dtype=dy2.dtype)
        dx = _scatter_rows(ops, f"backward: dx = sum dX over {self.unit}s", t, tok,
                           rows[:, :h])

        def dg_kept():
            table = np.zeros_like(rows, shape=(t, k))
            np.add.at(table, tok, rows[:, h:])
            return table[route.tok, route.choice]

        dg_sel = ops.all_reduce_etp(ops.ew("backward: dg of kept rows", dg_kept, rows, tok,
                                           route.tok, shape=(route.tok.shape[0],),
                                           nbytes=self.out_at[-1] * k * item))
        return dx, dg_sel, dw


class _NodeFlexDispatch(_FlexDispatch):
    """The flex dispatcher across nodes (DeepEP's internode kernels, Megatron-Core's
    HybridEP; the module docstring's "Flex across nodes"): a token goes once to each
    destination *node*, to its proxy there (the node's rank with the source's local
    index), which forwards it to the node's ranks holding its choices; the proxy sums the
    node's answers per token before the one row goes back."""

    unit = "node"

    def __init__(self, ops, route, cap, e_l: int, load, node_ranks: int):
        self.ops, self.route, self.e_l = ops, route, e_l
        n, me, d = ops.n, ops.pos, node_ranks
        self.d, self.span = d, d * e_l
        self._check_tables(route, n)
        if route.node_tokens is None:
            raise ValueError(
                f"MoE: ep_node_ranks={d} in a trace needs load=ExpertLoad(..., "
                f"node_tokens=...), a (ranks, {n // d}) table of the distinct tokens each "
                f"rank sends to each of the expert group's {n // d} nodes "
                "(ExpertLoad.skewed(..., node_ranks=) fills it; the emulator's "
                "MoE.run/backward report it)")
        w = 2 + e_l
        counts = ops.all_to_all(ops.ew(
            "dispatch: counts per rank [node rows, rows, per expert]",
            lambda: np.concatenate([np.repeat(route.node_arr, d)[:, None],
                                    route.rank_arr[:, None], route.kept_arr.reshape(n, e_l)],
                                   axis=1).reshape(-1),
            route.node_arr, route.rank_arr, route.kept_arr, shape=(n * w,)))
        if is_meta(counts):
            node_in = [load.node_tokens[s][me // d] for s in range(n)]
            self.m_in = [load.tokens[s][me] for s in range(n)]
            self.c = [[load.kept[s][me * e_l + j] for j in range(e_l)] for s in range(n)]
        else:
            flat = counts.tolist()
            node_in = [flat[s * w] for s in range(n)]
            self.m_in = [flat[s * w + 1] for s in range(n)]
            self.c = [flat[s * w + 2:(s + 1) * w] for s in range(n)]
        # this rank as a proxy: its sources (one per node, this rank's local index) and
        # the rows each sends it; its node's ranks
        self.src = [node * d + me % d for node in range(n // d)]
        self.node_in = [node_in[s] for s in self.src]
        self.local = [(me // d) * d + lr for lr in range(d)]
        self.meta_fwd = None if not is_meta(counts) else [
            [load.tokens[s][q] for q in self.local] for s in self.src]
        self._sizes(list(route.node_tokens))

    def _out(self, pieces, like, tag: int):
        """Inter-node hop (tag ``MOE_TAG + tag``): pieces[N] to the proxy on node N; the
        proxy splits each source's rows to its node's ranks (the routing columns, when
        carried, re-based to the rank's local experts) — intra-node hop, tag ``MOE_TAG +
        _INTRA + tag``; the rows received per source."""
        ops, d, e_l, what = self.ops, self.d, self.e_l, _WHAT[tag]
        w, k = like.shape[1], self.route.gates.shape[1]
        h = w - 2 * k                        # x's width, when the rows carry the routing
        got = ops.exchange(pieces, self.node_in, like, tag, members=self.src)
        if tag == _DISPATCH:                 # [x | ids | gates]: where each row goes

            def split(g):                    # (rows, 2): [row, node rank], rank-major
                ids = g[:, h:h + k]
                on = [np.nonzero(((ids >= lr * e_l) & (ids < (lr + 1) * e_l)).any(axis=1))[0]
                      for lr in range(d)]
                return np.concatenate([np.stack([r, np.full_like(r, lr)], axis=1)
                                       for lr, r in enumerate(on)])
            self.sel = []
            for i, g in enumerate(got):
                m = None if self.meta_fwd is None else sum(self.meta_fwd[i])
                sel = ops.ew(f"{what}: proxy: node ranks of source {self.src[i]}'s rows",
                             lambda g=g: split(g), g, shape=(m, 2) if m is not None else None,
                             dtype=np.dtype(np.int64), nbytes=int(g.shape[0]) * k
                             * np.dtype(g.dtype).itemsize)
                sizes = self.meta_fwd[i] if self.meta_fwd is not None else \
                    [int((sel[:, 1] == lr).sum()) for lr in range(d)]
                at = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
                self.sel.append([sel[at[lr]:at[lr + 1], 0] for lr in range(d)])
            self.fwd = [[int(r.shape[0]) for r in sel] for sel in self.sel]

        def forward(lr):                     # this proxy's rows for node rank lr
            parts = [g[self.sel[i][lr]] for i, g in enumerate(got)]
            rows = np.concatenate(parts)
            if tag != _DISPATCH:
                return rows
            ids = rows[:, h:h + k]
            on = (ids >= lr * e_l) & (ids < (lr + 1) * e_l)
            return np.concatenate([rows[:, :h], np.where(on, ids - lr * e_l, -1),
                                   np.where(on, rows[:, h + k:], 0)], axis=1)

        fwd = [ops.ew(f"{what}: proxy: rows for node rank {lr}", lambda lr=lr: forward(lr),
                      *got, shape=(sum(f[lr] for f in self.fwd), w), dtype=like.dtype,
                      nbytes=sum(f[lr] for f in self.fwd) * w * np.dtype(like.dtype).itemsize)
               for lr in range(d)]
        into = [sum(self.m_in[s] for s in range(self.ops.n) if s % d == lr) for lr in range(d)]
        recv = ops.exchange(fwd, into, like, _INTRA + tag, members=self.local)
        out = [None] * self.ops.n                # per source: its slice of its proxy's rows
        for lr in range(d):
            at = 0
            for s in range(lr, self.ops.n, d):
                out[s] = recv[lr][at:at + self.m_in[s]]
                at += self.m_in[s]
        return out

    def _back(self, pieces, like, tag: int):
        """Intra-node hop (tag ``MOE_TAG + _INTRA + tag``): each source's answered rows to
        its proxy on this node; the proxy adds its node's rows per token; inter-node hop
        (tag ``MOE_TAG + tag``): one row per token back to the source. This rank's rows
        per node."""
        ops, d, n, what = self.ops, self.d, self.ops.n, _WHAT[tag]
        w, item = like.shape[1], np.dtype(like.dtype).itemsize
        to = [ops.ew(f"{what}: pack rows for proxy {lr}", lambda lr=lr: np.concatenate(
            [pieces[s] for s in range(lr, n, d)]), *pieces,
            shape=(sum(self.m_in[s] for s in range(lr, n, d)), w), dtype=like.dtype,
            nbytes=sum(self.m_in[s] for s in range(lr, n, d)) * w * item) for lr in range(d)]
        got = ops.exchange(to, [sum(f[lr] for f in self.fwd) for lr in range(d)], like,
                           _INTRA + tag, members=self.local)
        offs = [np.concatenate([[0], np.cumsum([f[lr] for f in self.fwd])]).astype(int)
                for lr in range(d)]

        def node_sum(i):                     # one row per token of source i: Σ over ranks
            z = np.zeros_like(like, shape=(self.node_in[i], w))
            for lr in range(d):
                z[self.sel[i][lr]] += got[lr][offs[lr][i]:offs[lr][i + 1]]
            return z

        sums = [ops.ew(f"{what}: proxy: sum the node's rows for source {s}",
                       lambda i=i: node_sum(i), *got, shape=(self.node_in[i], w),
                       dtype=like.dtype, nbytes=sum(self.fwd[i]) * w * item)
                for i, s in enumerate(self.src)]
        return ops.exchange(sums, self.m_out, like, tag, members=self.src)


_DISPATCHERS = {"alltoall": _AllToAllDispatch, "allgather": _AllGatherDispatch,
                "flex": _FlexDispatch}
DISPATCHERS = tuple(_DISPATCHERS)


def _expert_biases(biases, j):
    """Local expert j's (b_gate, b_up, b_down), or None without biases."""
    return None if biases is None else tuple(b[j] for b in biases)


def _expert_forward(ops, x, wg, wu, wd, j, biases=None):
    """O = (silu(X Wg + b_g) * (X Wu + b_u)) Wd + b_d (``biases`` (b_g, b_u, b_d) or
    None); b_d is added by etp rank 0 only (the caller's reduction over etp adds it once).
    The state is (A, B, silu(A), H); under ``ops.recompute_act`` (``moe_act``, a routed
    expert: j an int) (A, B, None, None), :func:`_expert_backward` re-running silu(A) and
    H = silu(A)·B (0 FLOPs, their bytes) before its first use of them."""
    a = ops.matmul(x, wg, f"expert {j}: A = X Wg")
    b = ops.matmul(x, wu, f"expert {j}: B = X Wu")
    if biases is not None:
        bg, bu, bd = biases
        a = ops.ew(f"expert {j}: A += b_g", lambda: a + bg, a, bg)
        b = ops.ew(f"expert {j}: B += b_u", lambda: b + bu, b, bu)
    s = ops.ew(f"expert {j}: silu(A)", lambda: a * _sigmoid(a), a)
    hid = ops.ew(f"expert {j}: H = silu(A) B", lambda: s * b, s, b)
    out = ops.matmul(hid, wd, f"expert {j}: O = H Wd")
    if biases is not None and ops.etp_rank == 0:
        out = ops.ew(f"expert {j}: O += b_d", lambda: out + bd, out, bd)
    if getattr(ops, "recompute_act", False) and j != "shared":
        return out, (a, b, None, None)
    return out, (a, b, s, hid)


def _expert_act(ops, a, b, j, tag=""):
    """(silu(A), H = silu(A)·B) of an expert's products (declared with their bytes)."""
    s = ops.ew(f"expert {j}: silu(A){tag}", lambda: a * _sigmoid(a), a)
    return s, ops.ew(f"expert {j}: H = silu(A) B{tag}", lambda: s * b, s, b)


def _expert_backward(ops, x, wg, wu, wd, state, d_out, j, biased: bool = False):
    """(dX, dWg, dWu, dWd[, db_g, db_u, db_d with ``biased``]): db_g = Σ_rows dA,
    db_u = Σ_rows dB, db_d = Σ_rows dO (dO whole on every etp rank: each holds all of
    db_d, the replicas equal without a collective)."""
    a, b, s, hid = state
    if hid is None:                          # moe_act: the activation re-run first
        s, hid = _expert_act(ops, a, b, j, " (recompute)")
    dwd = ops.matmul(hid.T, d_out, f"expert {j}: dWd = H^T dO")
    dhid = ops.matmul(d_out, wd.T, f"expert {j}: dH = dO Wd^T")

    def da_fn():
        sig = _sigmoid(a)
        return dhid * b * sig * (1 + a * (1 - sig))

    da = ops.ew(f"expert {j}: dA = dH B silu'(A)", da_fn, dhid, a, b)
    db = ops.ew(f"expert {j}: dB = dH silu(A)", lambda: dhid * s, dhid, s)
    dwg = ops.matmul(x.T, da, f"expert {j}: dWg = X^T dA")
    dwu = ops.matmul(x.T, db, f"expert {j}: dWu = X^T dB")
    dx = ops.matmul(da, wg.T, f"expert {j}: dX = dA Wg^T")
    dx2 = ops.matmul(db, wu.T, f"expert {j}: dX += dB Wu^T")
    dx = ops.ew(f"expert {j}: dX sum", lambda: dx + dx2, dx, dx2)
    if not biased:
        return dx, dwg, dwu, dwd
    return (dx, dwg, dwu, dwd, ops.ew(f"expert {j}: db_g = sum dA", lambda: da.sum(axis=0), da),
            ops.ew(f"expert {j}: db_u = sum dB", lambda: db.sum(axis=0), db),
            ops.ew(f"expert {j}: db_d = sum dO", lambda: d_out.sum(axis=0), d_out))


def _scatter_rows(ops, name, t, tok, rows):
    """(T, h) with rows[i] added at row tok[i] (a token may come twice: k = 2)."""
    def fn():
        out = np.zeros_like(rows, shape=(t, rows.shape[1]))
        np.add.at(out, tok, rows)
        return out
    return ops.ew(name, fn, tok, rows, shape=(t, rows.shape[1]), dtype=rows.dtype)


# --- the operation ----------------------------------------------------------------------
ROUTERS = ("softmax", "sigmoid")
_SHARED = ("w_shared_gate", "w_shared_up", "w_shared_down")


class MoE(ShardedOperation):
    """``MoE(hidden, ffn_hidden, experts, top_k=2, capacity_factor=None, aux_coef=0.01,
    seed=0, ep_axis="ep", algorithms=None, *, router="softmax", normalize_top_k=None,
    routed_scaling=1.0, shared_ffn_hidden=0, dispatcher="alltoall")``; see the module
    docstring.

    ``top_k``: experts per token, 1 to ``experts``; ``capacity_factor`` None is
    dropless; ``aux_coef`` is alpha of the auxiliary loss (0: none, as DeepSeek-V3's
    auxiliary-loss-free routing); ``router``: the scores, ``softmax`` or ``sigmoid``;
    ``normalize_top_k``: the k gates divided by their sum (None: True for k > 1 with a
    softmax router — Mixtral's — and for a sigmoid router, False for k = 1);
    ``routed_scaling``: σ, the gates' factor; ``shared_ffn_hidden``: the width of the
    always-on shared expert (0: none); ``dispatcher``: how tokens reach the experts,
    ``alltoall`` (the module docstring's exchanges), ``allgather`` (every rank gathers
    the group's tokens and reduce-scatters its experts' partial outputs; Megatron's for
    small groups) or ``flex`` (DeepEP / HybridEP: each token once per destination rank,
    the module docstring's "Flex"); ``ep_node_ranks``: with ``flex``, the expert group's
    ranks per node — each token once per destination node, forwarded there (DeepEP's
    internode path, the module docstring's "Flex across nodes"; None or >= the group:
    one node); ``groups``: (n_group, topk_group), DeepSeek's group-limited routing —
    each token chooses its k experts within its ``topk_group`` best of ``n_group`` equal
    groups of experts (a group scored by its two best experts' scores), None: among all; ``seed`` draws :meth:`init_params`;
    ``algorithms`` maps ``all_to_all`` / ``all_reduce`` to the algorithm every such call
    uses (default ``auto``).

    The per-device programs take the weights in the order of :meth:`weight_names`:
    router, the routed experts' three, then the shared expert's three when it has one.
    """

    name = "mixture-of-experts"

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, aux_coef: float = 0.01, seed: int = 0,
                 ep_axis: str = "ep", algorithms: Mapping[str, str] | None = None, *,
                 router: str = "softmax", normalize_top_k: bool | None = None,
                 routed_scaling: float = 1.0, shared_ffn_hidden: int = 0,
                 dispatcher: str = "alltoall", groups: tuple | None = None,
                 router_bias: bool = False, expert_bias: bool = False,
                 ep_node_ranks: int | None = None):
        for name, v, low in (("hidden", hidden, 1), ("ffn_hidden", ffn_hidden, 1),
                             ("experts", experts, 1), ("top_k", top_k, 1),
                             ("shared_ffn_hidden", shared_ffn_hidden, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"MoE: {name} must be an int >= {low}, got {v!r}")
        if top_k > experts:
            raise ValueError(f"MoE: top_k={top_k} exceeds experts={experts} (a token uses "
                             "at most every expert once)")
        if capacity_factor is not None and (
                isinstance(capacity_factor, bool) or not isinstance(capacity_factor, Real)
                or not math.isfinite(capacity_factor) or capacity_factor <= 0):
            raise ValueError(f"MoE: capacity_factor must be a number > 0 or None (dropless), "
                             f"got {capacity_factor!r}")
        if not isinstance(aux_coef, Real) or not math.isfinite(aux_coef) or aux_coef < 0:
            raise ValueError(f"MoE: aux_coef must be a finite number >= 0, got {aux_coef!r}")
        if groups is not None:
            ok = isinstance(groups, (tuple, list)) and len(groups) == 2 and all(
                isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g >= 1
                for g in groups)
            if not ok or experts % groups[0] or groups[1] > groups[0] or \
                    groups[1] * (experts // groups[0]) < top_k:
                raise ValueError(f"MoE: groups must be (n_group, topk_group) with n_group "
                                 f"dividing experts={experts}, topk_group <= n_group and "
                                 f"topk_group x experts/n_group >= top_k={top_k}, got "
                                 f"{groups!r}")
            groups = (int(groups[0]), int(groups[1]))
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"MoE: dispatcher must be one of {DISPATCHERS}, got "
                             f"{dispatcher!r}")
        if router not in ROUTERS:
            raise ValueError(f"MoE: router must be one of {ROUTERS}, got {router!r}")
        if ep_node_ranks is not None and (
                isinstance(ep_node_ranks, bool) or not isinstance(ep_node_ranks, (int, np.integer))
                or ep_node_ranks < 1 or dispatcher != "flex"):
            raise ValueError(f"MoE: ep_node_ranks must be None or an int >= 1 (the expert "
                             f"group's ranks per node) with dispatcher='flex', got "
                             f"ep_node_ranks={ep_node_ranks!r} with dispatcher={dispatcher!r}")
        for name, flag in (("router_bias", router_bias), ("expert_bias", expert_bias)):
            if flag not in (False, True):
                raise ValueError(f"MoE: {name} must be True or False, got {flag!r}")
        if normalize_top_k not in (None, False, True):
            raise ValueError(f"MoE: normalize_top_k must be True, False or None (the "
                             f"router's default), got {normalize_top_k!r}")
        if isinstance(routed_scaling, bool) or not isinstance(routed_scaling, Real) \
                or not math.isfinite(routed_scaling) or routed_scaling <= 0:
            raise ValueError(f"MoE: routed_scaling must be a finite number > 0, got "
                             f"{routed_scaling!r}")
        self.hidden, self.ffn_hidden, self.experts = int(hidden), int(ffn_hidden), int(experts)
        self.top_k, self.aux_coef, self.seed = int(top_k), float(aux_coef), seed
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.router = router
        self.normalize_top_k = (router == "sigmoid" or self.top_k > 1) \
            if normalize_top_k is None else bool(normalize_top_k)
        self.routed_scaling = float(routed_scaling)
        self.shared_ffn_hidden = int(shared_ffn_hidden)
        self.dispatcher, self.groups = dispatcher, groups
        self.ep_node_ranks = None if ep_node_ranks is None else int(ep_node_ranks)
        self.router_bias, self.expert_bias = bool(router_bias), bool(expert_bias)
        self.ep_axis = ep_axis
        self.algorithms = dict(algorithms or {})
        for kind, alg in self.algorithms.items():
            choose_algorithm(kind, 0, 2, requested=alg)   # unknown names raise ValueError

    def __repr__(self) -> str:
        extra = "".join((
            f", router={self.router!r}" if self.router != "softmax" else "",
            f", normalize_top_k={self.normalize_top_k}",
            f", routed_scaling={self.routed_scaling:g}" if self.routed_scaling != 1 else "",
            f", shared_ffn_hidden={self.shared_ffn_hidden}" if self.shared_ffn_hidden else "",
            f", dispatcher={self.dispatcher!r}" if self.dispatcher != "alltoall" else "",
            f", ep_node_ranks={self.ep_node_ranks}" if self.ep_node_ranks else "",
            f", groups={self.groups}" if self.groups else "",
            ", router_bias=True" if self.router_bias else "",
            ", expert_bias=True" if self.expert_bias else ""))
        return (f"MoE(hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
                f"experts={self.experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, aux_coef={self.aux_coef}"
                f"{extra}, seed={self.seed}, ep_axis={self.ep_axis!r})")

    # --- parameters and layouts ---------------------------------------------------------
    def weight_names(self) -> tuple[str, ...]:
        """The weights in the order the per-device programs take them."""
        return ("w_router", "w_gate", "w_up", "w_down") + (
            _SHARED if self.shared_ffn_hidden else ())

    def weight_shapes(self) -> dict:
        """Name -> global shape: w_router (h, E), w_gate and w_up (E, h, f), w_down
        (E, f, h); with a shared expert w_shared_gate, w_shared_up (h, F_s) and
        w_shared_down (F_s, h)."""
        h, f, e, fs = self.hidden, self.ffn_hidden, self.experts, self.shared_ffn_hidden
        shapes = {"w_router": (h, e), "w_gate": (e, h, f), "w_up": (e, h, f),
                  "w_down": (e, f, h)}
        if fs:
            shapes.update(w_shared_gate=(h, fs), w_shared_up=(h, fs), w_shared_down=(fs, h))
        return shapes

    def init_params(self, dtype=np.float64) -> dict:
        """Every weight of :meth:`weight_shapes`, normal with standard deviation
        1/sqrt(fan-in), drawn from ``seed``."""
        rng = np.random.default_rng(self.seed)
        return {n: (rng.standard_normal(s) / math.sqrt(s[-2])).astype(dtype)
                for n, s in self.weight_shapes().items()}

    @property
    def layouts(self) -> dict:
        """Name -> TensorSharding: experts' weights split by expert over ep, the router
        and the shared expert replicated, tokens (x, y, dx) split on their first
        dimension over ep."""
        ep = self.ep_axis
        return {"w_router": TS(None, None), "w_gate": TS(ep, None, None),
                "w_up": TS(ep, None, None), "w_down": TS(ep, None, None),
                **{n: TS(None, None) for n in _SHARED},
                "aux": TS(None), "counts": TS(ep, None)}

    def _tokens_layout(self, ndim: int) -> TS:
        return TS(self.ep_axis, *([None] * (ndim - 1)))

    def ep_size(self, mesh) -> int:
        """The size of the ep axis on ``mesh``; E must divide by it."""
        if self.ep_axis not in mesh.shape:
            raise ValueError(f"MoE: mesh {mesh} has no axis ep_axis={self.ep_axis!r}")
        ep = mesh.axis_size(self.ep_axis)
        if self.experts % ep:
            raise ValueError(f"MoE: experts={self.experts} is not divisible by "
                             f"ep={ep} (mesh axis {self.ep_axis!r})")
        return ep

    def node_ranks(self, n: int) -> int | None:
        """The expert group's ranks per node for a group of ``n`` ranks: ``ep_node_ranks``
        when it splits the group into several nodes (n a multiple of it), None when the
        group lies in one node (None or >= n: the one-hop flex); ValueError otherwise."""
        d = self.ep_node_ranks
        if d is None or d >= n:
            return None
        if n % d:
            raise ValueError(f"MoE: ep_node_ranks={d} must divide the expert group's {n} "
                             f"ranks (consecutive positions [0..d-1], [d..2d-1], ... share "
                             "a node), or be >= it (one node)")
        return d

    def capacity(self, tokens_per_rank: int) -> int | None:
        """ceil(capacity_factor · T·k / E) (None: dropless)."""
        return expert_capacity(self.capacity_factor, tokens_per_rank, self.top_k, self.experts)

    def _split(self, rest, tail: int):
        """(shared weights or None, the ``tail`` arguments after them) of a per-device
        program's arguments past w_down."""
        n = len(_SHARED) if self.shared_ffn_hidden else 0
        return (tuple(rest[:n]) or None), tuple(rest[n:n + tail])

    # --- per-device programs --------------------------------------------------------------
    def _scores(self, ops, logits):
        """v = softmax(l) or sigmoid(l), and p (the aux loss's probabilities)."""
        if self.router == "sigmoid":
            v = ops.ew("router: v = sigmoid(l)", lambda: _sigmoid(logits), logits)
            p = ops.ew("router: p = v / sum v", lambda: v / v.sum(axis=1, keepdims=True), v)
            return v, p

        def softmax():
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)

        v = ops.ew("router: p = softmax(l)", softmax, logits)
        return v, v

    def _forward(self, ops, x, w_router, w_gate, w_up, w_down, load, shared=None,
                 bias=None, biases=None):
        h, k, n_exp = self.hidden, self.top_k, self.experts
        e_l = n_exp // ops.n
        x2 = x.reshape(-1, h)
        t = x2.shape[0]
        cap = self.capacity(t)
        b_router, expert_biases = self._biases(biases)
        logits = ops.matmul(x2, w_router, "router: l = x W_r")
        if b_router is not None:
            logits = ops.ew("router: l += b_r", lambda: logits + b_router, logits, b_router)
        scores, probs = self._scores(ops, logits)
        d = self.node_ranks(ops.n)
        route = _route(ops, scores, k, cap, load, self.normalize_top_k, self.routed_scaling,
                       self.groups, bias, None if d is None else ops.n // d)

        # aux loss: global f and P over the ep group
        sums = ops.all_reduce(ops.ew("aux: local sums", lambda: np.concatenate(
            [route.routed.astype(probs.dtype), probs.sum(axis=0)]), route.routed, probs))
        n_glob = t * ops.n
        f = sums[:n_exp] / (n_glob * k)
        aux = ops.ew("aux = alpha E sum f P", lambda: (self.aux_coef * n_exp * (
            f * sums[n_exp:] / n_glob).sum()).reshape(1), sums)

        disp = _DISPATCHERS[self.dispatcher](ops, route, cap, e_l, load) if d is None else \
            _NodeFlexDispatch(ops, route, cap, e_l, load, d)
        y, d_state = disp.forward(x2, (w_gate, w_up, w_down), expert_biases)
        s_state = None
        if shared is not None:
            y_s, s_state = _expert_forward(ops, x2, *shared, "shared")
            y = ops.ew("y += shared expert", lambda: y + y_s, y, y_s)
        saved = (x2, route, disp, d_state, f, probs, s_state, expert_biases)
        return y.reshape(x.shape), aux, route, saved

    def _biases(self, biases):
        """(b_router or None, the experts' (b_gate, b_up, b_down) or None) of ``biases``
        = (b_router, b_gate, b_up, b_down) (None where the layer has none), checked
        against the layer's ``router_bias`` and ``expert_bias``."""
        b_router, *experts = biases if biases is not None else (None,) * 4
        for name, on, given in (("router_bias", self.router_bias, b_router is not None),
                                ("expert_bias", self.expert_bias,
                                 all(b is not None for b in experts))):
            if on != given:
                raise ValueError(f"MoE: {name}={on} but the {name.split('_')[0]}'s biases "
                                 f"were {'not ' if on else ''}given")
        return b_router, (tuple(experts) if self.expert_bias else None)

    @staticmethod
    def _report(route):
        """routed, kept, distinct tokens per member (1, ·) and, across nodes
        (``ep_node_ranks``), distinct tokens per node."""
        return (route.routed.reshape(1, -1), route.kept_arr.reshape(1, -1),
                route.rank_arr.reshape(1, -1)) + (
            () if route.node_arr is None else (route.node_arr.reshape(1, -1),))

    def forward_local(self, dev, x, w_router, w_gate, w_up, w_down, *rest):
        """(y, aux (1,), routed (1, E), kept (1, E), distinct tokens per expert-group member
        (1, ep)) on this rank; ``rest``: the shared
        expert's weights when the layer has one, then optionally ``load``, the counts a
        trace takes as given (ignored when the arrays hold values)."""
        shared, tail = self._split(rest, 1)
        load = tail[0] if tail else None
        self.ep_size(dev.mesh)
        ops = _Ops(dev, self.ep_axis, self.algorithms)
        y, aux, route, _ = self._forward(ops, x, w_router, w_gate, w_up, w_down, load,
                                         shared)
        return (y, aux, *self._report(route))

    # --- hooks for a layer inside a training program (tensor_parallel.moe_layer) ---------
    def device_ops(self, dev, etp_axis: str | None = None, ep_axes=None,
                   recompute_act: bool = False):
        """This rank's steps (collectives over ``ep_axes``, default ``ep_axis``: one mesh
        axis or a tuple of them, the expert group folded over several; a mesh without
        them holds every expert on each rank and communicates nothing); ``etp_axis``: the
        axis the experts' hidden dimension is split over (the module docstring);
        ``recompute_act``: the routed experts keep A and B only and re-run silu(A)·B in
        the backward (Megatron-Core's ``moe_act`` recompute module)."""
        ops = _Ops(dev, self.ep_axis if ep_axes is None else ep_axes, self.algorithms,
                   etp_axis, recompute_act)
        if self.experts % ops.n:
            raise ValueError(f"MoE: experts={self.experts} is not divisible by the expert "
                             f"group's {ops.n} ranks (mesh axes {ops.ep_axis!r})")
        return ops

    def forward_saved(self, ops, x2, w_router, w_gate, w_up, w_down, load=None, shared=None,
                      bias=None, biases=None):
        """Forward of x2 (T, h) on ``ops`` (:meth:`device_ops`): (y (T, h), aux (1,),
        routed (E,), kept (E,), distinct tokens per expert-group member (n,), distinct
        tokens per node (n/d,; None unless the group spans nodes, ``ep_node_ranks``),
        state for :meth:`backward_saved`); ``shared``: the shared
        expert's (W_gate, W_up, W_down) when the layer has one; ``bias``: (E,) added to
        the scores for the choice only (auxiliary-loss-free balancing), or None;
        ``biases``: (b_router (E,), b_gate, b_up (E_l, f), b_down (E_l, h)), None where
        the layer has none (``router_bias``, ``expert_bias``; the module docstring)."""
        y, aux, route, saved = self._forward(ops, x2, w_router, w_gate, w_up, w_down, load,
                                             shared, bias, biases)
        return y, aux, route.routed, route.kept_arr, route.rank_arr, route.node_arr, saved

    def backward_saved(self, ops, saved, dy2, w_router, w_gate, w_up, w_down, d_aux,
                       shared=None):
        """Backward of <dy2, y> + d_aux · aux: (dx of the experts (T, h) — a partial sum
        over the etp group when there is one —, the router's dx (T, h), dW_r of this
        rank's tokens (not summed over ep: the caller reduces it with the other
        replicated parameters), [dW_gate, dW_up, dW_down] of this rank's experts (+
        [db_gate, db_up, db_down] with ``expert_bias``), the shared expert's three
        gradients of this rank's tokens or None, db_r of this rank's tokens (reduced as
        dW_r) or None without ``router_bias``)."""
        return self._backward(ops, saved, dy2, w_router, w_gate, w_up, w_down, d_aux, shared)

    def _dlogits(self, route, probs, dg_sel, f, t: int, n: int, d_aux: float):
        """dl (T, E) on real arrays: the gates', the aux loss's and the scores' chain (the
        module docstring's 'gates' and 'scores' lines)."""
        v, n_exp = route.scores, self.experts
        sigma = self.routed_scaling
        dg = np.zeros_like(route.gates)
        dg[route.tok, route.choice] = dg_sel
        if self.normalize_top_k:
            s = np.take_along_axis(v, route.experts, axis=1).sum(axis=1, keepdims=True)
            dv_sel = (sigma * dg - (route.gates * dg).sum(axis=1, keepdims=True)) / s
        else:
            dv_sel = sigma * dg
        dp = np.zeros_like(v) + d_aux * self.aux_coef * n_exp / (t * n) * f
        if self.router == "sigmoid":            # p = v / sum v
            dv = (dp - (probs * dp).sum(axis=1, keepdims=True)) / v.sum(axis=1, keepdims=True)
        else:
            dv = dp
        dv[np.arange(t, like=route.experts)[:, None], route.experts] += dv_sel
        if self.router == "sigmoid":
            return dv * v * (1 - v)
        return v * (dv - (v * dv).sum(axis=1, keepdims=True))

    def _backward(self, ops, saved, dy, w_router, w_gate, w_up, w_down, d_aux, shared=None):
        """The backward of :meth:`_forward` (``saved`` its state): (the experts' dx
        (T, h), the router's dx (T, h), dW_r of this rank's tokens — not yet summed over
        ep —, [dW_gate, dW_up, dW_down] (+ the experts' three biases'), the shared
        expert's [dW_gate, dW_up, dW_down] or None, db_r or None)."""
        x2, route, disp, d_state, f, probs, s_state, expert_biases = saved
        t = x2.shape[0]
        dy2 = dy.reshape(-1, self.hidden)
        dx, dg_sel, dw = disp.backward(d_state, dy2, (w_gate, w_up, w_down), expert_biases)
        d_shared = None
        if shared is not None:
            dx_s, *d_shared = _expert_backward(ops, x2, *shared, s_state, dy2, "shared")
            dx = ops.ew("backward: dx += shared expert", lambda: dx + dx_s, dx, dx_s)

        dl = ops.ew("router: dl = scores'(dv)", lambda: self._dlogits(
            route, probs, dg_sel, f, t, ops.n, d_aux), route.scores, route.gates, f,
            shape=route.scores.shape)
        d_router = ops.matmul(x2.T, dl, "router: dW_r = x^T dl")
        db_router = ops.ew("router: db_r = sum dl", lambda: dl.sum(axis=0), dl) \
            if self.router_bias else None
        dx_r = ops.matmul(dl, w_router.T, "router: dx = dl W_r^T")
        return dx, dx_r, d_router, dw, d_shared, db_router

    def backward_local(self, dev, x, w_router, w_gate, w_up, w_down, *rest):
        """Forward and backward in one program: (y, aux, dx, dW_r, dW_gate, dW_up,
        dW_down, [the shared expert's three,] routed, kept, tokens per member); dW_r (and the shared
        expert's) summed over ep, the experts' on their owners. ``rest``: the shared
        expert's weights when the layer has one, then dy, optionally d_aux (default 1)
        and ``load`` (traces)."""
        shared, tail = self._split(rest, 3)
        dy, d_aux, load = tail + (1.0, None)[len(tail) - 1:]
        self.ep_size(dev.mesh)
        ops = _Ops(dev, self.ep_axis, self.algorithms)
        y, aux, route, saved = self._forward(ops, x, w_router, w_gate, w_up, w_down, load,
                                             shared)
        dx, dx_r, d_router, dw, d_shared, _ = self._backward(ops, saved, dy, w_router, w_gate,
                                                             w_up, w_down, d_aux, shared)
        dx = ops.ew("backward: dx + router", lambda: dx + dx_r, dx, dx_r)
        d_router = ops.all_reduce(d_router)
        d_shared = [ops.all_reduce(g) for g in d_shared] if shared is not None else []
        return (y, aux, dx.reshape(x.shape), d_router, *dw, *d_shared, *self._report(route))

    # --- host conveniences ----------------------------------------------------------------
    def _host_without_biases(self, what: str) -> None:
        """The host conveniences run the layer without biases (the training layer,
        :mod:`.moe_layer`, passes them to :meth:`forward_saved`)."""
        if self.router_bias or self.expert_bias:
            raise ValueError(f"MoE: {what} takes no biases (router_bias={self.router_bias}, "
                             f"expert_bias={self.expert_bias}); the training layer "
                             "(tensor_parallel.moe_layer) runs them")

    def _check(self, mesh, x, params, dy=None) -> int:
        self._host_without_biases("run/backward")
        ep = self.ep_size(mesh)
        h = self.hidden
        xs = np.shape(x)
        if len(xs) < 2 or xs[-1] != h:
            raise ValueError(f"MoE: x must have shape (tokens, ..., hidden={h}), got {xs}")
        if xs[0] % ep:
            raise ValueError(f"MoE: x's first dimension {xs[0]} is not divisible by ep={ep}")
        expected = self.weight_shapes()
        if set(params) != set(expected):
            raise ValueError(f"MoE: params must have the keys {sorted(expected)}, got "
                             f"{sorted(params)}")
        for name, shape in expected.items():
            if np.shape(params[name]) != shape:
                raise ValueError(f"MoE: {name} has shape {np.shape(params[name])}, must be "
                                 f"{shape}")
        if dy is not None and np.shape(dy) != xs:
            raise ValueError(f"MoE: dy has shape {np.shape(dy)}, must be x's {xs}")
        return ep

    def _inputs(self, x, params, *more):
        L = self.layouts
        tok = self._tokens_layout(np.ndim(x))
        return ([(x, tok)] + [(params[n], L[n]) for n in self.weight_names()]
                + [(m, tok) for m in more])

    def _load(self, routed, kept, tokens, x, ep, node_tokens=None) -> ExpertLoad:
        return ExpertLoad(np.asarray(routed).tolist(), np.asarray(kept).tolist(),
                          self.capacity(int(np.prod(np.shape(x)[:-1])) // ep),
                          np.asarray(tokens).tolist(),
                          None if node_tokens is None else np.asarray(node_tokens).tolist())

    def run(self, cluster, x, params) -> MoEOutput:
        """Global x and params in; y, the aux loss and the load out."""
        ep = self._check(cluster.mesh, x, params)
        L = self.layouts
        reports = 3 if self.node_ranks(ep) is None else 4
        y, aux, *load = run_sharded(
            cluster, self.forward_local, self._inputs(x, params),
            [self._tokens_layout(np.ndim(x)), L["aux"]] + [L["counts"]] * reports)
        return MoEOutput(y, float(aux[0]), self._load(*load[:3], x, ep, *load[3:]))

    def backward(self, cluster, x, params, dy, d_aux: float = 1.0) -> MoEGradients:
        """Forward and backward of <dy, y> + d_aux · aux: every gradient, global (the
        shared expert's in ``shared_grads``)."""
        ep = self._check(cluster.mesh, x, params, dy)
        L, tok = self.layouts, self._tokens_layout(np.ndim(x))
        names = self.weight_names()
        reports = 3 if self.node_ranks(ep) is None else 4
        out = run_sharded(cluster, self.backward_local, self._inputs(x, params, dy),
                          [tok, L["aux"], tok] + [L[n] for n in names]
                          + [L["counts"]] * reports, extra_args=(float(d_aux),))
        y, aux, dx, dr, dg, du, dd, *shared = out[:len(out) - reports]
        load = self._load(*out[len(out) - reports:len(out) - reports + 3], x, ep,
                          *out[len(out) - reports + 3:])
        return MoEGradients(y, float(aux[0]), dx, dr, dg, du, dd, load,
                            tuple(shared) or None)

    def reference(self, x, params, dy=None, ep: int = 1, d_aux: float = 1.0):
        """The plain-numpy layer (:mod:`tensor_parallel.moe_reference`) on the global
        batch, capacity per ep rank as here: a MoEOutput, or with ``dy`` a MoEGradients."""
        self._host_without_biases("reference")
        shared = tuple(params[n] for n in _SHARED) if self.shared_ffn_hidden else None
        result, _, _ = moe_reference(x, params["w_router"], params["w_gate"], params["w_up"],
                                     params["w_down"], top_k=self.top_k,
                                     capacity_factor=self.capacity_factor,
                                     aux_coef=self.aux_coef, ep=ep, dy=dy, d_aux=d_aux,
                                     router=self.router,
                                     normalize_top_k=self.normalize_top_k,
                                     routed_scaling=self.routed_scaling, shared=shared,
                                     groups=self.groups)
        return result

    def meta_args(self, mesh, x_shape, load: ExpertLoad, backward: bool = False,
                  dtype=np.float64) -> list[tuple]:
        """Per-rank arguments of ``forward_local`` (``backward_local`` with ``backward``)
        on shape-only arrays, for ``trace_program``; ``load`` gives the counts."""
        self._host_without_biases("meta_args")
        ep = self.ep_size(mesh)
        if not isinstance(load, ExpertLoad) or (load.ep, load.experts) != (ep, self.experts):
            raise ValueError(f"MoE: load must be an ExpertLoad of ep={ep} ranks and "
                             f"{self.experts} experts, got {load!r}")
        shapes = self.weight_shapes()
        e_l = self.experts // ep
        x_local = (x_shape[0] // ep,) + tuple(x_shape[1:])
        w = [MetaArray((e_l,) + shapes[n][1:] if n in ("w_gate", "w_up", "w_down")
                       else shapes[n], dtype) for n in self.weight_names()]
        args = (MetaArray(x_local, dtype), *w)
        args += (MetaArray(x_local, dtype), 1.0, load) if backward else (load,)
        return [args] * mesh.size
