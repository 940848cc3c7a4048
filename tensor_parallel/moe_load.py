"""``ExpertLoad``: how many tokens a mixture-of-experts layer routed to each expert.

A table per ep rank r (its own T tokens) and expert e:

    routed[r][e]   assignments rank r's router made to e (top-k choices, before dropping)
    kept[r][e]     those within e's capacity: the rows rank r sends to e's owner
                   (dropless: kept == routed)

Summed over the ranks, ``per_expert_routed`` is what the router asked of each expert and
``per_expert_kept`` what each expert computed. The imbalance is the busiest expert's
count over the mean count, ``max_e n_e / mean_e n_e`` (1 = perfectly balanced, E/k at
most for routed assignments when every token picks the same experts).

The layer's emulation returns the load it saw (``MoE.run``/``MoE.backward``); a trace,
whose arrays hold no values, takes one as given: :meth:`ExpertLoad.skewed` builds the
table for a chosen imbalance (the busiest expert's tokens over the mean), the knob a
simulator turns as ``--expert-skew``.

A third, optional table serves the token-deduplicating ``flex`` dispatcher (DeepEP /
HybridEP), which sends a token once per destination *rank* rather than once per expert:

    tokens[r][d]   distinct tokens of rank r with at least one kept choice among the
                   experts of expert-group rank d (d's experts: d·E/g … (d+1)·E/g − 1,
                   g = the table's width, the expert group's size)

It holds  max_{e of d} kept[r][e] <= tokens[r][d] <= sum_{e of d} kept[r][e]  (a token
chooses an expert at most once; equality on the right when no token has two choices on
d, always for k = 1). The emulator counts it from its routing (None when the routing
ranks are not the expert group's, e.g. a training report). :meth:`ExpertLoad.skewed`
fills it with an expectation: a token's k distinct choices uniformly among the E experts
(evenly E/g on each of the g ranks) miss all of rank d's with probability
C(E − E/g, k) / C(E, k), so

    tokens[r][d] = T · (1 − C(E − E/g, k) / C(E, k))

rounded, then clamped into [max(max_{e of d} kept[r][e], ceil(Σ_{e of d} kept[r][e] /
min(k, E/g))), Σ_{e of d} kept[r][e]] (a token brings at most min(k, E/g) rows to one
rank, so k = 1 gives exactly the kept rows; a skewed table's busiest expert alone may
need more rows on its rank than the uniform expectation; a capacity's drops fewer).

A fourth, optional table serves the flex dispatcher across nodes (``MoE(...,
ep_node_ranks=d)``, DeepEP's internode kernels), which sends a token once per destination
*node* — the g expert-group ranks split into g/d nodes of d consecutive ranks:

    node_tokens[r][N]   distinct tokens of rank r with at least one kept choice among the
                        experts of node N's ranks (experts N·E·d/g … (N+1)·E·d/g − 1)

with  max_{q of N} tokens[r][q] <= node_tokens[r][N] <= Σ_{q of N} tokens[r][q]  (and the
same bounds from the kept rows of N's experts). The emulator counts it when the layer
runs across nodes; :meth:`ExpertLoad.skewed` (``node_ranks=d``) fills it with the same
expectation over nodes: a token's k distinct uniform choices miss all E·d/g experts of a
node with probability C(E − E·d/g, k) / C(E, k), so

    node_tokens[r][N] = T · (1 − C(E − E·d/g, k) / C(E, k))

rounded, then clamped into [max(max_{q of N} tokens[r][q], ceil(Σ_{e of N} kept[r][e] /
min(k, E·d/g))), min(Σ_{q of N} tokens[r][q], Σ_{e of N} kept[r][e])].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ExpertLoad", "MoEOutput", "MoEGradients", "expert_capacity",
           "distinct_rank_fraction"]


def distinct_rank_fraction(experts: int, ranks: int, top_k: int) -> float:
    """1 − C(E − E/g, k) / C(E, k): the chance that a token's k distinct uniformly chosen
    experts include one of a given rank's E/g (g = ``ranks`` evenly holding the E)."""
    return 1.0 - math.comb(experts - experts // ranks, top_k) / math.comb(experts, top_k)


def _rank_bounds(kept_row, ranks: int) -> list[tuple[int, int]]:
    """(lower, upper) of tokens[r][d] for each of ``ranks`` destinations, from the kept
    row of rank r: (max over d's experts, sum over d's experts)."""
    e_l = len(kept_row) // ranks
    return [(max(kept_row[d * e_l:(d + 1) * e_l]), sum(kept_row[d * e_l:(d + 1) * e_l]))
            for d in range(ranks)]


def _check_within(table, name: str, bounds, what: str) -> None:
    """Raise unless every ``table[r][c]`` lies in ``bounds[r][c]`` = (lower, upper)."""
    for r, (row, b_row) in enumerate(zip(table, bounds)):
        for c, (v, (lo, hi)) in enumerate(zip(row, b_row)):
            if not lo <= v <= hi:
                raise ValueError(f"ExpertLoad: {name}[{r}][{c}]={v} must lie in [{lo}, {hi}] "
                                 f"({what})")


def _table(rows, what: str) -> tuple[tuple[int, ...], ...]:
    table = tuple(tuple(int(v) for v in row) for row in rows)
    if not table or len({len(r) for r in table}) != 1 or not table[0]:
        raise ValueError(f"ExpertLoad: {what} must be a non-empty (ep, experts) table, "
                         f"got {rows!r}")
    if any(v < 0 for row in table for v in row):
        raise ValueError(f"ExpertLoad: {what} has a negative count: {table}")
    return table


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per (ep rank, expert) before (``routed``) and after (``kept``) dropping;
    ``capacity`` the per-rank capacity of an expert (None: dropless); ``tokens``: the
    distinct tokens per (ep rank, destination rank), the ``flex`` dispatcher's rows (the
    module docstring), or None when not known; ``node_tokens``: the distinct tokens per
    (ep rank, destination node), the flex dispatcher's rows across nodes, or None."""

    routed: tuple[tuple[int, ...], ...]
    kept: tuple[tuple[int, ...], ...]
    capacity: int | None = None
    tokens: tuple[tuple[int, ...], ...] | None = None
    node_tokens: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        routed, kept = _table(self.routed, "routed"), _table(self.kept, "kept")
        if np.shape(routed) != np.shape(kept):
            raise ValueError(f"ExpertLoad: routed {np.shape(routed)} and kept "
                             f"{np.shape(kept)} tables differ in shape")
        if any(k > r for rr, kk in zip(routed, kept) for r, k in zip(rr, kk)):
            raise ValueError("ExpertLoad: kept exceeds routed for some (rank, expert)")
        if self.capacity is not None and any(k > self.capacity for row in kept for k in row):
            raise ValueError(f"ExpertLoad: kept exceeds capacity={self.capacity}")
        object.__setattr__(self, "routed", routed)
        object.__setattr__(self, "kept", kept)
        if self.tokens is not None:
            tokens = _table(self.tokens, "tokens")
            width = len(tokens[0])
            if len(tokens) != len(kept) or len(kept[0]) % width:
                raise ValueError(f"ExpertLoad: tokens must be a (ep={len(kept)}, g) table "
                                 f"with g dividing experts={len(kept[0])}, got "
                                 f"{np.shape(tokens)}")
            _check_within(tokens, "tokens", [_rank_bounds(k, width) for k in kept],
                          "the most kept rows of one of that rank's experts, and their sum")
            object.__setattr__(self, "tokens", tokens)
        if self.node_tokens is not None:
            self._check_node_tokens()

    def _check_node_tokens(self) -> None:
        nodes = _table(self.node_tokens, "node_tokens")
        width, kept = len(nodes[0]), self.kept
        ranks = None if self.tokens is None else len(self.tokens[0])
        if len(nodes) != len(kept) or len(kept[0]) % width or (
                ranks is not None and ranks % width):
            raise ValueError(f"ExpertLoad: node_tokens must be a (ep={len(kept)}, nodes) "
                             f"table with nodes dividing experts={len(kept[0])} (and the "
                             f"tokens table's {ranks} ranks), got {np.shape(nodes)}")
        bounds = [_rank_bounds(k, width) for k in kept]
        if ranks is not None:            # and within the node's ranks' distinct tokens
            d = ranks // width
            bounds = [[(max(lo, max(mine)), min(hi, sum(mine)))
                       for (lo, hi), mine in zip(row, (t[nd * d:(nd + 1) * d]
                                                       for nd in range(width)))]
                      for row, t in zip(bounds, self.tokens)]
        _check_within(nodes, "node_tokens", bounds, "the most distinct tokens of one of that "
                      "node's ranks, and their sum")
        object.__setattr__(self, "node_tokens", nodes)

    @classmethod
    def skewed(cls, ep: int, experts: int, tokens_per_rank: int, top_k: int, skew: float = 1.0,
               capacity: int | None = None, node_ranks: int | None = None) -> "ExpertLoad":
        """The same table on every rank: expert 0 gets round(skew · T·k/E) of the T·k
        assignments, the others share the rest as evenly as integers allow; ``kept`` is
        min(routed, capacity). ``skew`` must be in [1, E/k] (a token picks an expert at
        most once, so the busiest expert has at most T). ``tokens`` (an ep × ep table; when
        ep divides E): the module docstring's expectation, clamped. ``node_ranks`` d (1 <= d
        < ep, dividing ep): also ``node_tokens`` (an ep × ep/d table), its expectation
        over the ep/d nodes, clamped (None or >= ep: no node table)."""
        for name, v in (("ep", ep), ("experts", experts), ("tokens_per_rank", tokens_per_rank),
                        ("top_k", top_k)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ExpertLoad.skewed: {name} must be an int >= 1, got {v!r}")
        if top_k > experts:
            raise ValueError(f"ExpertLoad.skewed: top_k={top_k} exceeds experts={experts}")
        if not 1.0 <= skew <= experts / top_k:
            raise ValueError(f"ExpertLoad.skewed: skew={skew} must be in [1, experts/top_k = "
                             f"{experts / top_k:g}]")
        total = tokens_per_rank * top_k
        busiest = min(tokens_per_rank, round(skew * total / experts))
        rest, others = total - busiest, experts - 1
        row = [busiest] + [rest // others + (i < rest % others) for i in range(others)] \
            if others else [total]
        kept = row if capacity is None else [min(n, capacity) for n in row]
        tokens = nodes = None
        if experts % ep == 0:
            want = round(tokens_per_rank * distinct_rank_fraction(experts, ep, top_k))
            most = min(top_k, experts // ep)             # rows one token brings one rank
            tokens = [tuple(min(max(want, lo, -(-hi // most)), hi)
                            for lo, hi in _rank_bounds(kept, ep))] * ep
        if node_ranks is not None and tokens is not None and node_ranks < ep:
            if isinstance(node_ranks, bool) or not isinstance(node_ranks, (int, np.integer)) \
                    or node_ranks < 1 or ep % node_ranks:
                raise ValueError(f"ExpertLoad.skewed: node_ranks must be an int >= 1 dividing "
                                 f"ep={ep} (or None), got {node_ranks!r}")
            g = ep // node_ranks
            want = round(tokens_per_rank * distinct_rank_fraction(experts, g, top_k))
            most = min(top_k, experts // g)              # rows one token brings one node
            per_rank = tokens[0]
            nodes = [tuple(min(max(want, lo, -(-hi // most),
                                   max(per_rank[nd * node_ranks:(nd + 1) * node_ranks])),
                               hi, sum(per_rank[nd * node_ranks:(nd + 1) * node_ranks]))
                           for nd, (lo, hi) in enumerate(_rank_bounds(kept, g)))] * ep
        return cls(tuple(tuple(row) for _ in range(ep)), tuple(tuple(kept) for _ in range(ep)),
                   capacity, None if tokens is None else tuple(tokens),
                   None if nodes is None else tuple(nodes))

    # --- shape ------------------------------------------------------------------------
    @property
    def ep(self) -> int:
        return len(self.routed)

    @property
    def experts(self) -> int:
        return len(self.routed[0])

    # --- totals -----------------------------------------------------------------------
    @property
    def per_expert_routed(self) -> tuple[int, ...]:
        """Assignments to each expert over all ranks, before dropping."""
        return tuple(int(n) for n in np.sum(self.routed, axis=0))

    @property
    def per_expert_kept(self) -> tuple[int, ...]:
        """Tokens each expert computed (after dropping)."""
        return tuple(int(n) for n in np.sum(self.kept, axis=0))

    @property
    def dropped(self) -> int:
        """Assignments dropped for capacity (they contribute 0 to the output)."""
        return int(np.sum(self.routed) - np.sum(self.kept))

    @staticmethod
    def _imbalance(counts) -> float:
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else 1.0

    @property
    def imbalance(self) -> float:
        """Busiest expert ÷ mean, over the routed assignments (before dropping)."""
        return self._imbalance(self.per_expert_routed)

    @property
    def kept_imbalance(self) -> float:
        """Busiest expert ÷ mean, over the tokens the experts computed."""
        return self._imbalance(self.per_expert_kept)

    def received(self, rank: int) -> int:
        """Rows ep rank ``rank``'s experts compute (from every rank, its own included)."""
        e_l = self.experts // self.ep
        return int(sum(row[e] for row in self.kept for e in range(rank * e_l, (rank + 1) * e_l)))

    def __str__(self) -> str:
        cap = "dropless" if self.capacity is None else f"capacity {self.capacity} per rank"
        return (f"tokens per expert (routed) {list(self.per_expert_routed)}, kept "
                f"{list(self.per_expert_kept)}; dropped {self.dropped}; imbalance "
                f"{self.imbalance:.3g} (kept {self.kept_imbalance:.3g}); {cap}")


def _shape(a) -> str:
    return "None" if a is None else f"{tuple(np.shape(a))}"


@dataclass(frozen=True, repr=False)
class MoEOutput:
    """The forward: y (x's shape), the auxiliary loss, the load."""

    y: np.ndarray
    aux_loss: float
    load: ExpertLoad

    def __repr__(self) -> str:
        return f"MoEOutput(y={_shape(self.y)}, aux_loss={self.aux_loss:.6g}, load=<{self.load}>)"


@dataclass(frozen=True, repr=False)
class MoEGradients:
    """Forward and backward: y, aux loss, dx, the router's and the experts' gradients
    (d_gate, d_up (E, h, f), d_down (E, f, h)), the load; ``shared_grads``: the shared
    expert's (d_gate, d_up (h, F_s), d_down (F_s, h)), None without one; ``bias_grads``:
    the biases' by name ("router" (E,), "gate", "up" (E, f), "down" (E, h)), None
    without biases."""

    y: np.ndarray
    aux_loss: float
    dx: np.ndarray
    d_router: np.ndarray
    d_gate: np.ndarray
    d_up: np.ndarray
    d_down: np.ndarray
    load: ExpertLoad
    shared_grads: tuple | None = None
    bias_grads: dict | None = None

    def __repr__(self) -> str:
        return (f"MoEGradients(y={_shape(self.y)}, aux_loss={self.aux_loss:.6g}, "
                f"dx={_shape(self.dx)}, d_router={_shape(self.d_router)}, "
                f"d_gate={_shape(self.d_gate)}, d_up={_shape(self.d_up)}, "
                f"d_down={_shape(self.d_down)}, load=<{self.load}>"
                + (f", shared_grads={tuple(_shape(g) for g in self.shared_grads)}"
                   if self.shared_grads is not None else "")
                + (f", bias_grads={ {n: _shape(g) for n, g in self.bias_grads.items()} }"
                   if self.bias_grads is not None else "") + ")")


def expert_capacity(capacity_factor: float | None, tokens: int, top_k: int,
                    experts: int) -> int | None:
    """ceil(capacity_factor · T·k / E) slots per expert for T tokens (None: dropless)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / experts)
