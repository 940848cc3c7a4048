"""Context parallelism: causal attention with the sequence split over a mesh axis ``cp``.

Layout (Megatron CP's causal load balancing). The sequence of length s is cut into 2·cp
chunks of c = s/(2·cp) rows; position p lies in chunk p // c. Rank r of the cp group
(its position along the axis) holds chunks r and 2·cp−1−r, in that order: its s_l = 2c
local rows have the global positions [r·c, (r+1)·c) ∪ [(2cp−1−r)·c, (2cp−r)·c)
(:func:`sequence_positions`; RoPE needs them). Without load balancing rank r holds
chunks 2r and 2r+1 (contiguous rows [r·s_l, (r+1)·s_l)). :func:`split_sequence` and
:func:`join_sequence` move a global (b, s, ...) array to and from the ranks' rows.

Attention on one rank: q, k, v of shape (B, s_l, d), B = b·heads, scale σ = 1/sqrt(d).
A *block* is one local q chunk (global chunk Q, c rows) against key rows made of whole
chunks K_1 < K_2 < ...; by the causal rule query position i sees key position j iff
j ≤ i, so chunk K is fully visible to Q when K < Q, the diagonal when K = Q (masked
above its diagonal: M_ij = −∞ for j > i, by global positions) and fully masked when
K > Q — those are skipped. A rank's key chunks come in ascending order, so the chunks
Q sees are a prefix of them: one q k^T and one P v per (q chunk, key block), each
2·B·c·n·d FLOPs.

    S   = σ·q_Q k^T + M                   (B, c, n)      n = c·(visible chunks)
    m   = rowmax S,  l = rowsum exp(S − m)
    O_b = exp(S − m)/l · v,  L_b = m + log l                 (partial output, log-sum-exp)
    merge (online softmax): L = logaddexp(L_1, L_2),
                            O = O_1·exp(L_1 − L) + O_2·exp(L_2 − L)

The merged (O, L) over every key chunk is softmax(σ q k^T + M) v and its row
log-sum-exp. The backward recomputes the probabilities from the saved L (flash
attention): with D = rowsum(dO·O) (B, c, 1),

    P  = exp(σ·q_Q k^T + M − L)    dv += P^T dO    dP = dO v^T
    dS = P·(dP − D)·σ              dq += dS k      dk += dS^T q

Algorithms (``algorithm=``):

* ``ring``: K and V pass around the cp ring, cp−1 steps: at step t rank r holds the
  block of rank r−t (mod cp) and isends it to r+1 while it computes (the next block is
  irecv'd from r−1, so a simulator overlaps the transfer with the products). The
  backward passes K, V the same way and with them the dK, dV accumulators of the block
  (Megatron CP, ring-flash-attention): at step t rank r adds its contribution to the
  accumulator received from r−1 and sends it on; after cp steps each accumulator has
  visited every rank and arrives at its owner.
* ``all_gather``: all_gather K and V over cp (rank-major rows), reorder them to global
  order, attend each local q chunk Q to the prefix of chunks 0..Q; the backward
  re-gathers K, V, accumulates dK, dV over the full sequence and reduce_scatters them
  back to their owners (in rank-major order).

FLOPs (products only, Megatron's convention; softmax and merges declare 0 FLOPs and the
bytes they touch). Each computed chunk pair (Q, K ≤ Q) is c × c, the diagonal counted
whole; rank r computes N_r = Σ_{Q ∈ chunks(r)} (Q+1) pairs (:func:`causal_chunk_pairs`):
N_r = 2·cp+1 on every rank with load balancing, 4r+3 without (rank cp−1 does
(4cp−1)/3 times rank 0's work). Forward 2 products: 4·B·c²·d·N_r; backward 5 products
(the recomputed q k^T, dP, dv, dq, dk): 10·B·c²·d·N_r. Both algorithms compute the same
pairs.

Traffic per rank (:meth:`ContextParallelAttention.sent_bytes`), X = B·s_l·d·itemsize
the bytes of one local K (= V) shard; a rank receives what it sends. The ring's forward
sends cp−1 blocks of K and V, (cp−1)·(|K_r| + |V_r|) = (cp−1)·2X, and receives as many;
its backward sends K, V cp−1 times and the dK, dV accumulators cp times:

    ring        forward (cp−1)·2X            backward (cp−1)·2X + cp·2X (dK, dV)
    all_gather  forward 2 all_gather(X)      backward 2 all_gather(X) + 2 reduce_scatter(cp·X)
                (ring algorithms: forward 2(cp−1)X, backward 4(cp−1)X)

cp = 1 is plain causal attention with no communication.

Grouped-query attention (``group`` g > 1 query heads per K/V head, as
:mod:`tensor_parallel.gqa` lays them out): local q, O, dO are (B, g·s_l, d) with the g
query heads of one K/V head stacked on rows, head-major (row r is head r // s_l at local
row r mod s_l), while k, v are (B, s_l, d). A block is then the g·c rows of one q chunk
(every head) against the key rows; dk and dv sum over the g heads in the products
(dS^T q). Only K and V travel: the traffic is that of k's shape, the FLOPs g times.

A value dimension of its own (``v_head_dim`` d_v ≠ d, multi-head latent attention's
q, k of d_nope + d_rope and v of d_v: :mod:`tensor_parallel.mla`): v, O, dO and dv are
(B, ·, d_v) while q, k, dq, dk stay d wide; the scale is still 1/sqrt(d). The products
with v (P v, dP = dO v^T, dv = P^T dO) count d_v instead of d: forward
2·B·c²·(d + d_v)·N_r, backward 2·B·c²·(3d + 2d_v)·N_r (times g); a block's traffic is
|K_r| + |V_r| = X + X·d_v/d. With d_v = d everything above is unchanged.

Sliding-window attention (``window`` w: key j visible to query i iff i − w < j ≤ i,
:mod:`tensor_parallel.gqa`): key chunk K is visible to query chunk Q when K ≤ Q and
(Q − K)·c ≤ w + c − 2 (some pair of the two chunks lies in the window), so the chunks Q
sees are a contiguous run K_lo..Q of the global order and, on a rank, a contiguous run
of its (ascending) key chunks — no longer a prefix. A block is that run; blocks wholly
outside the window are skipped (no products, no FLOPs declared) and a block that
reaches past the window is masked there too (M_ij = −∞ at j ≤ i − w, by global
positions; a row that sees none of a block's keys gets a log-sum-exp of about −big,
which the merge weighs by exp(−big − L) = 0). A computed pair is still c × c whole, so
N_r counts the visible pairs (:func:`causal_chunk_pairs` with ``window``), min(Q, ⌊(w +
c − 2)/c⌋) + 1 key chunks for query chunk Q. What still travels: the ring passes every
K, V block (and dK, dV accumulator) the whole way round and the all_gather variant
gathers the whole K, V, as without a window — the traffic (:meth:`~ContextParallelAttention.
sent_bytes`) does not shrink, only the products do (a window shorter than a chunk
leaves each rank's ring steps but the first with little or nothing to compute).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from mesh.arguments import as_int
from modeling.choices import CPAlgorithm
from sharding import TensorSharding
from vcluster.runtime.algorithm import choose_algorithm
from vcluster.runtime.traffic import collective_traffic
from vcluster.runtime.tracing.kernel import Kernel

from .attention import LSE_BYTES, batched_matmul
from .operation import ShardedOperation, run_sharded

__all__ = ["ContextParallelAttention", "CP_ALGORITHMS", "chunk_ids", "sequence_positions",
           "sequence_order", "split_sequence", "join_sequence", "causal_chunk_pairs"]

CP_ALGORITHMS = CPAlgorithm.values()     # the one list: modeling.choices
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 1, 2, 3, 4        # p2p tags of the ring's four streams


# --- the layout (pure) -------------------------------------------------------------------
def _check_cp(cp, what: str) -> int:
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"{what}: cp must be an int >= 1, got {cp!r}")
    return int(cp)


def _check_seq(s, cp: int, what: str) -> int:
    if s % (2 * cp):
        raise ValueError(f"{what}: the sequence length s={s} must be divisible by 2·cp = "
                         f"{2 * cp} (cp={cp}: 2·cp chunks of equal length)")
    return s // (2 * cp)


def chunk_ids(cp: int, rank: int, load_balance: bool = True) -> tuple[int, int]:
    """The two global chunks (of 2·cp) that cp position ``rank`` holds, in local order:
    (rank, 2·cp−1−rank), or (2·rank, 2·rank+1) without load balancing."""
    cp = _check_cp(cp, "chunk_ids")
    if not 0 <= rank < cp:
        raise ValueError(f"chunk_ids: rank must be in [0, {cp}), got {rank!r}")
    return (rank, 2 * cp - 1 - rank) if load_balance else (2 * rank, 2 * rank + 1)


def sequence_positions(s: int, cp: int, rank: int, load_balance: bool = True) -> np.ndarray:
    """Global positions (s_l = s/cp,) of the rows cp position ``rank`` holds."""
    c = _check_seq(s, _check_cp(cp, "sequence_positions"), "sequence_positions")
    return np.concatenate([np.arange(t * c, (t + 1) * c)
                           for t in chunk_ids(cp, rank, load_balance)])


def sequence_order(s: int, cp: int, load_balance: bool = True) -> np.ndarray:
    """(s,) global positions of rank 0's rows, then rank 1's, ...: x[:, order] split in
    cp contiguous pieces gives every rank its rows."""
    return np.concatenate([sequence_positions(s, cp, r, load_balance) for r in range(cp)])


def split_sequence(x, cp: int, load_balance: bool = True) -> list[np.ndarray]:
    """A global (b, s, ...) array as the cp ranks' (b, s/cp, ...) rows."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"split_sequence: x must be (b, s, ...), got shape {x.shape}")
    return np.split(x[:, sequence_order(x.shape[1], cp, load_balance)], cp, axis=1)


def join_sequence(pieces, load_balance: bool = True) -> np.ndarray:
    """The inverse of :func:`split_sequence`: cp pieces (b, s/cp, ...) -> (b, s, ...)."""
    x = np.concatenate([np.asarray(p) for p in pieces], axis=1)
    out = np.empty_like(x)
    out[:, sequence_order(x.shape[1], len(pieces), load_balance)] = x
    return out


def causal_chunk_pairs(cp: int, rank: int, load_balance: bool = True,
                       window: int | None = None, chunk: int | None = None) -> int:
    """N_r = Σ_{Q ∈ chunk_ids} (Q+1): the c × c chunk pairs (key chunk ≤ query chunk,
    diagonal whole) cp position ``rank`` computes: 2·cp+1, or 4·rank+3 unbalanced. With a
    sliding ``window`` over chunks of ``chunk`` rows: Σ_Q min(Q, ⌊(w + c − 2)/c⌋) + 1,
    the chunks in the window (the module docstring)."""
    ids = chunk_ids(cp, rank, load_balance)
    if window is None:
        return sum(q + 1 for q in ids)
    c = as_int(chunk, "causal_chunk_pairs: chunk (with a window)", 1)
    return sum(min(q, (window + c - 2) // c) + 1 for q in ids)


# --- one rank's blocks -------------------------------------------------------------------
class _Blocks:
    """The per-block math of one rank: products through ``batched_matmul``, elementwise
    work declared with 0 FLOPs and the bytes it touches — or, with ``flash``, each block's
    forward (scores, mask, softmax, P v) and backward as one fused attention kernel
    (:meth:`_fused`), the same math inside."""

    def __init__(self, dev, scale: float, label: str = "cp attention", group: int = 1,
                 flash: bool = False, window: int | None = None):
        self.dev, self.xp, self.scale, self.label, self.g = dev, dev.xp, scale, label, group
        self.flash, self._inside, self.window = bool(flash), False, window

    def ew(self, name, fn, *operands):
        if self._inside:
            return fn()
        nbytes = sum(int(o.size) * np.dtype(o.dtype).itemsize for o in operands)
        with self.dev.compute(f"{self.label}: {name}", flops=0, bytes=nbytes):
            return fn()

    def bmm(self, a, b, name):
        if self._inside:
            return self.xp.matmul(a, b)
        return batched_matmul(self.dev, a, b, f"{self.label}: {name}")

    @contextlib.contextmanager
    def _fused(self, name, products: tuple[int, int], q, k, arrays, diagonal: bool,
               backward: bool):
        """One flash-attention kernel for a block of q (B, g·c, d) against k (B, n, d) and
        v (``arrays[2]``, (B, n, d_v)): ``products`` = (GEMMs over d, GEMMs over d_v),
        2·B·g·c·n·d (or d_v) FLOPs each, as the unfused block declares them, and the bytes
        of ``arrays`` plus the fp32 row log-sum-exp — never the g·c × n scores. The kernel
        is (B·g heads, c queries, n keys, the mean (d + d_v)/2 of the two head dims: its
        price is by 4·heads·c·n·head_dim), causal when the block is the diagonal chunk
        alone (a block with earlier chunks too is priced as full: its diagonal part's
        masked half is counted)."""
        b, rows, d = q.shape
        n, c, dv = k.shape[1], rows // self.g, arrays[2].shape[2]
        itemsize = np.dtype(q.dtype).itemsize
        nbytes = sum(int(a.size) for a in arrays) * itemsize + LSE_BYTES * b * rows
        causal = diagonal and n == c
        kernel = Kernel.attention(b * self.g, c, n, (d + dv) // 2, causal=causal,
                                  flash=True, backward=backward,
                                  window=self.window if causal else None)
        flops = 2 * b * rows * n * (products[0] * d + products[1] * dv)
        with self.dev.compute(f"{self.label}: {name}", flops=flops,
                              bytes=nbytes, kernel=kernel):
            self._inside = True
            try:
                yield
            finally:
                self._inside = False

    def scores(self, q, k, q_chunk, k_chunks, c):
        """σ·q k^T with −big above the causal diagonal and, with a window w, at keys
        j <= i − w (global positions), (B, g·c, n) (row r of q at position q_chunk·c +
        r mod c)."""
        s = self.bmm(q, k.transpose(0, 2, 1), "S = q k^T")
        w = self.window
        inside = w is None or (q_chunk - k_chunks[0] + 1) * c <= w   # no key too old
        if q_chunk not in k_chunks and inside:             # every key before every query
            return self.ew("scale", lambda: s * self.scale, s)
        xp = self.xp
        big = s.dtype.type(-np.finfo(s.dtype).max / 2)     # exp(−big − ...) is exactly 0

        def masked():
            # the mask (1, g·c, n) built from s so that it is shape-only in a trace: row r's
            # position q_chunk·c + r mod c, from s's (1, g·c, 1) column seen as (1, g, c, 1)
            qpos = xp.arange(c) + q_chunk * c
            kpos = xp.concatenate([xp.arange(t * c, (t + 1) * c) for t in k_chunks])
            at = (xp.zeros_like(s[:1, :, :1]).reshape(1, self.g, c, 1)
                  + qpos[:, None]).reshape(1, self.g * c, 1)
            future = at < kpos
            if not inside:
                future = future + (at - w >= kpos)        # boolean or: the keys too old
            return s * self.scale + future * big
        return self.ew("causal mask", masked, s)

    def forward(self, q, k, v, q_chunk, k_chunks, c):
        """Partial (O_b, L_b) of q (B, c, d) against k, v (B, n, d)."""
        if self.flash and not self._inside:
            with self._fused("flash forward", (1, 1), q, k, (q, k, v, q), q_chunk in k_chunks,
                             backward=False):
                return self.forward(q, k, v, q_chunk, k_chunks, c)
        z = self.scores(q, k, q_chunk, k_chunks, c)

        def softmax():
            m = z.max(axis=-1, keepdims=True)
            e = np.exp(z - m)
            z_sum = e.sum(axis=-1, keepdims=True)
            return e / z_sum, m + np.log(z_sum)
        p, lse = self.ew("softmax, log-sum-exp", softmax, z, z)
        return self.bmm(p, v, "O = P v"), lse

    def merge(self, acc, part):
        """Online softmax: (O, L) of the union of two key sets."""
        if acc is None:
            return part
        (o1, l1), (o2, l2) = acc, part

        def fn():
            lse = np.logaddexp(l1, l2)
            return o1 * np.exp(l1 - lse) + o2 * np.exp(l2 - lse), lse
        return self.ew("merge (log-sum-exp)", fn, o1, o2, o1)

    def backward(self, q, k, v, do, lse, delta, q_chunk, k_chunks, c):
        """(dq, dk, dv) of one block, P recomputed from the saved log-sum-exp."""
        if self.flash and not self._inside:
            with self._fused("flash backward", (3, 2), q, k, (q, k, v, do, do, q, k, v),
                             q_chunk in k_chunks, backward=True):
                return self.backward(q, k, v, do, lse, delta, q_chunk, k_chunks, c)
        z = self.scores(q, k, q_chunk, k_chunks, c)
        p = self.ew("P = exp(S - L)", lambda: np.exp(z - lse), z)
        dv = self.bmm(p.transpose(0, 2, 1), do, "dv = P^T dO")
        dp = self.bmm(do, v.transpose(0, 2, 1), "dP = dO v^T")
        ds = self.ew("dS = P (dP - D) σ", lambda: p * (dp - delta) * self.scale, p, dp)
        return (self.bmm(ds, k, "dq = dS k"), self.bmm(ds.transpose(0, 2, 1), q, "dk = dS^T q"),
                dv)


def _q_rows(x, i: int, c: int, g: int):
    """Local chunk i's rows of a q-shaped (B, g·2c, ...) array (heads head-major): (B, g·c,
    ...) — a slice when g = 1."""
    if g == 1:
        return x[:, i * c:(i + 1) * c]
    b, rest = x.shape[0], tuple(x.shape[2:])
    return x.reshape((b, g, 2, c) + rest)[:, :, i].reshape((b, g * c) + rest)


def _q_join(xp, parts, c: int, g: int):
    """The inverse of :func:`_q_rows` over both chunks: (B, g·2c, ...)."""
    if g == 1:
        return xp.concatenate(parts, axis=1)
    b, rest = parts[0].shape[0], tuple(parts[0].shape[2:])
    return xp.concatenate([p.reshape((b, g, c) + rest) for p in parts], axis=2).reshape(
        (b, g * 2 * c) + rest)


def _sees(q_chunk: int, k_chunk: int, c: int, window: int | None) -> bool:
    """Whether some query of chunk ``q_chunk`` sees some key of chunk ``k_chunk`` (c rows
    each): K ≤ Q, and with a window w (Q − K)·c ≤ w + c − 2."""
    return k_chunk <= q_chunk and (window is None or (q_chunk - k_chunk) * c <= window + c - 2)


def _visible(q_chunk: int, k_chunks, c: int = 1, window: int | None = None
             ) -> tuple[int, int]:
    """(i0, i1): the ascending ``k_chunks[i0:i1]`` query chunk ``q_chunk`` sees (a
    contiguous run: a prefix without a window); i0 == i1 when none."""
    seen = [i for i, t in enumerate(k_chunks) if _sees(q_chunk, t, c, window)]
    return (seen[0], seen[-1] + 1) if seen else (0, 0)


def _add_to(pairs, start: int, stop: int) -> None:
    """acc[:, start:stop] += g for each (acc, g) of ``pairs`` (in place)."""
    for acc, g in pairs:
        acc[:, start:stop] += g


# --- the operation -----------------------------------------------------------------------
class ContextParallelAttention(ShardedOperation):
    """``ContextParallelAttention(heads, head_dim, algorithm="ring", axis="cp",
    load_balance=True, collective_algorithm="auto", group=1, label="cp attention",
    flash=False, v_head_dim=None, window=None)``: causal softmax(q k^T/sqrt(d)) v with the
    sequence split over mesh axis ``axis`` (see the module docstring); ``group`` query heads
    per K/V head (GQA; the per-device programs only), ``v_head_dim`` the values' (and the
    output's) width d_v (default head_dim; MLA's differs), ``window`` a sliding window
    (each query sees its last ``window`` keys; None: every earlier key), ``label`` begins
    the names of its compute ops; ``flash``:
    each block's forward and backward declared as one fused attention kernel (the same
    FLOPs, the bytes of q, k, v and the outputs, no scores), as Megatron's CP runs a flash
    kernel per ring step — the math is the same either way.

    Global q, k are (b·heads, s, head_dim), v, dy (b·heads, s, d_v), with s divisible by
    2·cp; each rank
    holds the rows of :func:`split_sequence`. ``collective_algorithm`` is the algorithm
    of the all_gather variant's collectives (ring, shm, ... or auto).

    Per device: ``forward_local(dev, q, k, v) -> (O, L)``, ``backward_local(dev, q, k, v,
    O, L, dO) -> (dq, dk, dv)`` and both in ``forward_backward_local``; on a cluster, with
    global arrays: ``run(cluster, q, k, v) -> O`` and ``backward(cluster, q, k, v, dy) ->
    (O, dq, dk, dv)``; closed forms: ``flops`` and ``sent_bytes``.
    """

    name = "context-parallel attention"

    def __init__(self, heads: int, head_dim: int, algorithm: str = "ring", axis: str = "cp",
                 load_balance: bool = True, collective_algorithm: str = "auto",
                 group: int = 1, label: str = "cp attention", flash: bool = False,
                 v_head_dim: int | None = None, window: int | None = None):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if window is not None:
            window = as_int(window, "ContextParallelAttention: window", 1)
        for what, n in (("heads", heads), ("head_dim", head_dim), ("group", group),
                        ("v_head_dim", v_head_dim)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"ContextParallelAttention: {what} must be an int >= 1, "
                                 f"got {n!r}")
        if algorithm not in CP_ALGORITHMS:
            raise ValueError(f"ContextParallelAttention: unknown algorithm {algorithm!r}; "
                             f"choose one of {CP_ALGORITHMS}")
        for kind in ("all_gather", "reduce_scatter"):
            choose_algorithm(kind, 0, 2, requested=collective_algorithm)  # unknown: ValueError
        self.heads, self.head_dim, self.algorithm = int(heads), int(head_dim), algorithm
        self.axis, self.load_balance = axis, bool(load_balance)
        self.collective_algorithm = collective_algorithm
        self.group, self.label, self.flash = int(group), str(label), bool(flash)
        self.v_head_dim, self.window = int(v_head_dim), window
        self.scale = 1.0 / math.sqrt(head_dim)

    def windowed(self, window: int | None) -> "ContextParallelAttention":
        """The same operation with a sliding ``window`` (a layer's: :mod:`.gqa`)."""
        return ContextParallelAttention(
            self.heads, self.head_dim, self.algorithm, self.axis, self.load_balance,
            self.collective_algorithm, self.group, self.label, self.flash, self.v_head_dim,
            window)

    def __repr__(self) -> str:
        dv = "" if self.v_head_dim == self.head_dim else f", v_head_dim={self.v_head_dim}"
        dv += "" if self.window is None else f", window={self.window}"
        return (f"ContextParallelAttention(heads={self.heads}, head_dim={self.head_dim}{dv}, "
                f"algorithm={self.algorithm!r}, axis={self.axis!r}, "
                f"load_balance={self.load_balance}{', flash=True' if self.flash else ''})")

    # --- per-device programs ---------------------------------------------------------
    def _where(self, dev, q, k):
        """(cp, position, group, c) of this rank, with the local shapes checked."""
        cp = dev.mesh.axis_size(self.axis)
        g = self.group
        if q.ndim != 3 or k.ndim != 3 or k.shape[1] % 2 or q.shape[2] != self.head_dim \
                or tuple(q.shape) != (k.shape[0], g * k.shape[1], k.shape[2]):
            raise ValueError(f"{self!r}: local q must be (B, {g}·s_l, {self.head_dim}) and k, v "
                             f"(B, s_l, {self.head_dim}) with s_l even (two chunks), got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}")
        return (cp, dev.mesh.group_position(self.axis, dev.rank),
                dev.mesh.group(self.axis, dev.rank), k.shape[1] // 2)

    def forward_local(self, dev, q, k, v):
        """This rank's (O (B, s_l, d), L (B, s_l, 1)): output rows and their log-sum-exp."""
        cp, me, group, c = self._where(dev, q, k)
        g = self.group
        blk = _Blocks(dev, self.scale, self.label, g, self.flash, self.window)
        mine = chunk_ids(cp, me, self.load_balance)
        acc = [None, None]
        if self.algorithm == "ring":
            for t in range(cp):
                src = (me - t) % cp
                nxt = self._pass(dev, group, me, (k, v), (_TAG_K, _TAG_V)) if t < cp - 1 \
                    else None
                theirs = chunk_ids(cp, src, self.load_balance)
                for i, qc in enumerate(mine):
                    i0, i1 = _visible(qc, theirs, c, self.window)
                    if i1 > i0:
                        part = blk.forward(_q_rows(q, i, c, g), k[:, i0 * c:i1 * c],
                                           v[:, i0 * c:i1 * c], qc, theirs[i0:i1], c)
                        acc[i] = blk.merge(acc[i], part)
                if nxt is not None:
                    k, v = self._finish(nxt)
        else:
            kg, vg = (self._gather(dev, blk, x, cp, c) for x in (k, v))
            every = tuple(range(2 * cp))
            for i, qc in enumerate(mine):
                i0, i1 = _visible(qc, every, c, self.window)
                acc[i] = blk.forward(_q_rows(q, i, c, g), kg[:, i0 * c:i1 * c],
                                     vg[:, i0 * c:i1 * c], qc, every[i0:i1], c)
        xp = dev.xp
        return tuple(blk.ew("concatenate chunks", lambda j=j: _q_join(
            xp, [acc[0][j], acc[1][j]], c, g), acc[0][j], acc[1][j]) for j in (0, 1))

    def backward_local(self, dev, q, k, v, o, lse, do):
        """This rank's (dq, dk, dv), each (B, s_l, d), from ``forward_local``'s (O, L)."""
        cp, me, group, c = self._where(dev, q, k)
        g = self.group
        blk = _Blocks(dev, self.scale, self.label, g, self.flash, self.window)
        xp = dev.xp
        mine = chunk_ids(cp, me, self.load_balance)
        delta = blk.ew("D = rowsum(dO O)", lambda: (do * o).sum(axis=-1, keepdims=True), do, o)
        dq = [None, None]

        def grads_of(kk, vv, dk, dv, theirs):
            """Add the local q chunks' gradients against key rows kk, vv (chunks theirs)."""
            for i, qc in enumerate(mine):
                i0, i1 = _visible(qc, theirs, c, self.window)
                if i1 > i0:
                    gq, gk, gv = blk.backward(*(_q_rows(x, i, c, g) for x in (q,)),
                                              kk[:, i0 * c:i1 * c], vv[:, i0 * c:i1 * c],
                                              *(_q_rows(x, i, c, g) for x in (do, lse, delta)),
                                              qc, theirs[i0:i1], c)
                    dq[i] = gq if dq[i] is None else blk.ew("dq +=", lambda a=dq[i]: a + gq, gq)
                    blk.ew("dk, dv +=", lambda: _add_to(((dk, gk), (dv, gv)), i0 * c, i1 * c),
                           gk, gv, gk, gv)

        if self.algorithm == "ring":
            acc = None
            sends = []
            for t in range(cp):
                src = (me - t) % cp
                nxt = self._pass(dev, group, me, (k, v), (_TAG_K, _TAG_V)) if t < cp - 1 \
                    else None
                got = self._post(dev, group, me, (_TAG_DK, _TAG_DV)) if t > 0 else None
                dk, dv = (blk.ew("zeros", lambda x=x: xp.zeros_like(x), x) for x in (k, v))
                grads_of(k, v, dk, dv, chunk_ids(cp, src, self.load_balance))
                if got is not None:
                    rk, rv = (w.wait() for w in got)
                    dk, dv = blk.ew("accumulate dk, dv", lambda: (dk + rk, dv + rv), dk, rk, dv, rv)
                if cp > 1:
                    sends += self._send(dev, group, me, (dk, dv), (_TAG_DK, _TAG_DV))
                acc = (dk, dv)
                if nxt is not None:
                    k, v = self._finish(nxt)
            if cp > 1:
                acc = tuple(w.wait() for w in self._post(dev, group, me, (_TAG_DK, _TAG_DV)))
                for w in sends:
                    w.wait()
            dk, dv = acc
        else:
            kg, vg = (self._gather(dev, blk, x, cp, c) for x in (k, v))
            dkg, dvg = (blk.ew("zeros", lambda x=x: xp.zeros_like(x), x) for x in (kg, vg))
            grads_of(kg, vg, dkg, dvg, tuple(range(2 * cp)))
            dk, dv = (self._scatter(dev, blk, g, cp, c) for g in (dkg, dvg))
        dq = blk.ew("concatenate chunks", lambda: _q_join(xp, dq, c, g), *dq)
        return dq, dk, dv

    # --- the ring's point to point ---------------------------------------------------
    def _send(self, dev, group, me, arrays, tags):
        to = group[(me + 1) % len(group)]
        return [dev.isend(x, to, tag=tag) for x, tag in zip(arrays, tags)]

    def _post(self, dev, group, me, tags):
        src = group[(me - 1) % len(group)]
        return [dev.irecv(src, tag=tag) for tag in tags]

    def _pass(self, dev, group, me, arrays, tags):
        """Start sending ``arrays`` to the next rank and receiving the previous rank's."""
        return self._send(dev, group, me, arrays, tags), self._post(dev, group, me, tags)

    @staticmethod
    def _finish(pending):
        sends, recvs = pending
        got = tuple(w.wait() for w in recvs)
        for w in sends:
            w.wait()
        return got

    # --- the all_gather variant's collectives ----------------------------------------
    def _gather(self, dev, blk, x, cp, c):
        """x of every rank (B, s, d) in global order: all_gather (rank-major), reordered."""
        if cp == 1:
            return x
        g = dev.all_gather(x, self.axis, dim=1, algorithm=self.collective_algorithm)
        where = {t: r * 2 + i for r in range(cp)
                 for i, t in enumerate(chunk_ids(cp, r, self.load_balance))}
        return blk.ew("reorder to global", lambda: dev.xp.concatenate(
            [g[:, where[t] * c:(where[t] + 1) * c] for t in range(2 * cp)], axis=1), g)

    def _scatter(self, dev, blk, g, cp, c):
        """Global-order gradient (B, s, d) -> this rank's rows, summed over cp."""
        if cp == 1:
            return g
        order = [t for r in range(cp) for t in chunk_ids(cp, r, self.load_balance)]
        ranked = blk.ew("reorder to ranks", lambda: dev.xp.concatenate(
            [g[:, t * c:(t + 1) * c] for t in order], axis=1), g)
        return dev.reduce_scatter(ranked, self.axis, dim=1, algorithm=self.collective_algorithm)

    # --- closed forms ----------------------------------------------------------------
    def flops(self, local_shape, cp: int, rank: int, backward: bool = False) -> int:
        """Declared FLOPs of ``forward_local`` (2·g·B·c²·(d + d_v)·N_r, 4·g·B·c²·d·N_r when
        d_v = d) or ``backward_local`` (2·g·B·c²·(3d + 2d_v)·N_r, 10·g·B·c²·d·N_r) on cp
        position ``rank`` with local k of ``local_shape`` (B, s_l, d) (= q's when group
        g = 1)."""
        b, s_l, d = local_shape
        c, dv = s_l // 2, self.v_head_dim * d // self.head_dim
        width = 3 * d + 2 * dv if backward else d + dv
        return 2 * width * self.group * b * c * c * causal_chunk_pairs(
            cp, rank, self.load_balance, self.window, c)

    def sent_bytes(self, local_shape, cp: int, itemsize: int, backward: bool = False) -> int:
        """Bytes one rank sends in ``forward_local`` or ``backward_local`` (it receives as
        many) with local k of ``local_shape`` (B, s_l, d): ring (cp−1)·2X forward, (2cp−1)·2X backward; all_gather the collectives'
        traffic (:func:`~vcluster.runtime.traffic.collective_traffic`) of
        ``collective_algorithm`` (not auto). With d_v ≠ d, 2X is |K| + |V| = X·(1 +
        d_v/d)."""
        x = int(np.prod(local_shape)) * itemsize
        xv = x * self.v_head_dim // self.head_dim           # one local V block
        if cp == 1:
            return 0
        if self.algorithm == "ring":
            return (x + xv) * ((cp - 1) + (cp if backward else 0))
        if self.collective_algorithm == "auto":
            raise ValueError(f"{self!r}.sent_bytes: name the collective_algorithm (auto "
                             "depends on the cluster's settings)")

        def sent(kind, nbytes):
            alg = choose_algorithm(kind, nbytes, cp, requested=self.collective_algorithm)
            return collective_traffic(kind, alg, tuple(range(cp)), 0, nbytes,
                                      itemsize).bytes_sent
        total = sent("all_gather", x) + sent("all_gather", xv)
        return total + sent("reduce_scatter", cp * x) + sent("reduce_scatter", cp * xv) \
            if backward else total

    # --- host conveniences -----------------------------------------------------------
    def _check(self, mesh, **arrays):
        cp = mesh.axis_size(self.axis) if self.axis in mesh.axes else None
        if cp is None:
            raise ValueError(f"{self!r}: the mesh {mesh} has no axis {self.axis!r}")
        shape = np.shape(arrays["q"])
        for name, a in arrays.items():
            want = shape[:2] + (self.v_head_dim,) if name in ("v", "dy") \
                and self.v_head_dim != self.head_dim else shape
            if np.shape(a) != want or len(shape) != 3:
                raise ValueError(f"{self!r}: {name} has shape {np.shape(a)}; q, k must be "
                                 f"(b·heads, s, head_dim) and v, dy (b·heads, s, v_head_dim),"
                                 f" q is {shape}")
        if shape[0] % self.heads or shape[2] != self.head_dim:
            raise ValueError(f"{self!r}: q of shape {shape} must be (b·heads, s, "
                             f"{self.head_dim}) with b·heads a multiple of heads={self.heads}")
        _check_seq(shape[1], cp, repr(self))
        return cp

    def forward_backward_local(self, dev, q, k, v, dy):
        """This rank's (O, dq, dk, dv): ``forward_local``, then ``backward_local`` from its
        saved output and log-sum-exp (what :meth:`backward` runs on every rank)."""
        o, lse = self.forward_local(dev, q, k, v)
        return (o, *self.backward_local(dev, q, k, v, o, lse, dy))

    def _program(self, dev, q, k, v, dy=None):
        if dy is None:
            return self.forward_local(dev, q, k, v)[0]
        return self.forward_backward_local(dev, q, k, v, dy)

    def _run(self, cluster, arrays, outputs: int):
        cp = self._check(cluster.mesh, **arrays)
        lay = TensorSharding(None, self.axis, None)
        order = sequence_order(np.shape(arrays["q"])[1], cp, self.load_balance)
        inputs = [(np.asarray(a)[:, order], lay) for a in arrays.values()]
        res = run_sharded(cluster, self._program, inputs, [lay] * outputs)
        res = res if outputs > 1 else (res,)
        out = []
        for a in res:
            g = np.empty_like(a)
            g[:, order] = a
            out.append(g)
        return tuple(out) if outputs > 1 else out[0]

    def run(self, cluster, q, k, v):
        """Global q, k, v (b·heads, s, d) in; the global output O out."""
        return self._run(cluster, {"q": q, "k": k, "v": v}, 1)

    def backward(self, cluster, q, k, v, dy):
        """Global q, k, v, dy in; global (O, dq, dk, dv) out (one program: forward, then
        backward from its saved O and log-sum-exp)."""
        return self._run(cluster, {"q": q, "k": k, "v": v, "dy": dy}, 4)
