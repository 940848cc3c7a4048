"""A paged KV cache on one device and the attention that reads it (vLLM's PagedAttention).

The cache of one layer is two block pools, K and V, each (num_blocks, block_size, c_l, d):
c_l the key/value heads on this tensor-parallel rank, d the head dimension. A sequence
owns a block table (from the scheduler, :class:`serving.ScheduledRequest`); its token at
position p lives in block ``table[p // block_size]``, slot ``p % block_size``:

    slot(p) = table[p // B]·B + p % B        (B = block_size; the pool seen as
                                              (num_blocks·B, c_l, d) rows)

One engine step runs the new tokens of every scheduled sequence as ONE batch of N rows
(concatenated; sequence r owns rows o_r .. o_r + n_r − 1, its positions c_r .. c_r + n_r
− 1, c_r = its ``num_computed_tokens``). The step first writes every new token's k and v
at its slot (vLLM's ``reshape_and_cache``), then sequence r attends through its table:

    K_r = K[slot(0 .. c_r + n_r − 1)]          (ctx_r, c_l, d) gathered from its blocks
    S   = q_r K_r^T / sqrt(d) + M_r            (c_l, g·n_r, ctx_r)  the g = a_l/c_l query
    O_r = softmax(S) V_r                       (c_l, g·n_r, d)      heads of a KV head
                                                                    stacked on rows
    M_r[i, j] = 0 if j <= c_r + i else −inf    (causal, bottom-right aligned: the chunk's
                                                query i sits at position c_r + i)

A decode is n_r = 1 (it sees every cached key); a prefill chunk n_r > 1 sees the cached
prefix and its own tokens causally. Query head j of this rank uses its KV head j // g.
No sequence ever has a contiguous cache: it reads only what its table names.

Sliding window w (``window``; Mistral, GPT-OSS's windowed layers): query i (absolute
position p = c_r + i) sees key j iff p − w < j ≤ p — the window is applied to each
query's absolute position against the cached keys, so a decode and every row of a
prefill chunk see their own last w tokens. The cache still keeps EVERY token of the
sequence (as vLLM's paged cache does without the hybrid KV-cache manager, which would
free the blocks that fell out of the window); the kernel reads only the keys from
position max(0, c_r − w + 1) on (the chunk's first query's window), skipping what lies
wholly outside. Attention sinks (``sinks``, GPT-OSS: one logit σ_n per query head of
this rank, (a_l,)): σ_n joins every row's softmax denominator and its probability is
dropped, O = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{σ_n}).

Declared cost (one kernel for the whole batch, as vLLM's varlen paged kernel): the
products of the (query, key) pairs a causal kernel visits, pairs_r = n_r·c_r +
n_r·(n_r + 1)/2 (with a window, Σ_p min(p + 1, w) over the chunk's positions p), each
2·d FLOPs for q·k and 2·d for p·v per query head (the sinks: elementwise, 0):

    FLOPs = Σ_r 4·a_l·d·pairs_r
    bytes = (2·N·a_l·d + 2·Σ_r ctx_r·c_l·d)·itemsize      (q, O; K and V read once;
                                                          ctx_r: the keys read)

The cache write is an elementwise kernel of 2·N·c_l·d elements read and written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vcluster.runtime.tracing import Kernel

__all__ = ["PagedKVCache", "SequenceChunk", "causal_pairs", "paged_attention_flops", "slots",
           "window_start"]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: its rows ``first`` .. ``first + n_new − 1`` of the
    batch, ``n_computed`` tokens already cached (the first new token's position) and its
    ``block_table``."""

    first: int
    n_new: int
    n_computed: int
    block_table: tuple[int, ...]

    @property
    def context(self) -> int:
        """Keys the chunk's last query sees: n_computed + n_new."""
        return self.n_computed + self.n_new


def slots(block_table, positions, block_size: int) -> np.ndarray:
    """The pool rows of ``positions``: table[p // B]·B + p % B (module docstring)."""
    table = np.asarray(block_table, dtype=np.int64)
    p = np.asarray(positions, dtype=np.int64)
    return table[p // block_size] * block_size + p % block_size


def causal_pairs(n_new: int, n_computed: int, window: int | None = None) -> int:
    """(query, key) pairs a causal chunk visits: n·c + n·(n + 1)/2; with a sliding
    ``window`` w, Σ min(p + 1, w) over its positions p = c .. c + n − 1."""
    if window is None or n_computed + n_new <= window:
        return n_new * n_computed + n_new * (n_new + 1) // 2
    k = max(0, window - n_computed)          # the first k positions see all p + 1 keys
    return k * n_computed + k * (k + 1) // 2 + (n_new - k) * window


def window_start(chunk: "SequenceChunk", window: int | None) -> int:
    """The first position a chunk's keys are read from: 0, or with a sliding ``window``
    w, its first query's window start max(0, c − w + 1)."""
    return 0 if window is None else max(0, chunk.n_computed - window + 1)


def paged_attention_flops(chunks, heads_local: int, head_dim: int,
                          window: int | None = None) -> int:
    """Σ_r 4·a_l·d·pairs_r over the step's ``chunks`` (module docstring)."""
    return sum(4 * heads_local * head_dim * causal_pairs(c.n_new, c.n_computed, window)
               for c in chunks)


class PagedKVCache:
    """The K and V block pools of this device's ``layers`` (global layer indices), each
    (num_blocks, block_size, kv_heads_local, head_dim), allocated with ``dev.empty`` (a
    slot is read only after the step that writes it)."""

    def __init__(self, dev, layers, num_blocks: int, block_size: int, kv_heads_local: int,
                 head_dim: int, dtype):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.kv_heads_local, self.head_dim = int(kv_heads_local), int(head_dim)
        shape = (self.num_blocks, self.block_size, self.kv_heads_local, self.head_dim)
        self.pools = {int(i): (dev.empty(shape, dtype), dev.empty(shape, dtype))
                      for i in layers}

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={sorted(self.pools)}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, kv_heads_local={self.kv_heads_local}, "
                f"head_dim={self.head_dim})")

    @property
    def nbytes(self) -> int:
        """Bytes of every pool of every layer."""
        return sum(k.nbytes + v.nbytes for k, v in self.pools.values())

    def _rows(self, layer: int):
        """The layer's K and V pools seen as (num_blocks·block_size, c_l, d) slot rows."""
        k, v = self.pools[layer]
        shape = (self.num_blocks * self.block_size, self.kv_heads_local, self.head_dim)
        return k.reshape(shape), v.reshape(shape)

    def write(self, ops, layer: int, k, v, rows) -> None:
        """Store the step's new keys and values k, v (N, c_l, d) at pool rows ``rows``
        (:func:`slots` of each new token)."""
        kr, vr = self._rows(layer)
        n = int(k.size)

        def fn():
            kr[rows] = k
            vr[rows] = v

        ops.work("attention: write K, V into the paged cache", 0, (k, v), None, fn,
                 Kernel.elementwise(4 * n), nbytes=4 * n * np.dtype(k.dtype).itemsize)

    def attend(self, ops, layer: int, q, chunks, window: int | None = None,
               sinks=None) -> np.ndarray:
        """O (N, a_l·d) of queries q (N, a_l·d) after :meth:`write`: each chunk attends
        to its own sequence's cached keys through its block table, within the sliding
        ``window`` (None: every earlier key) and with the attention ``sinks`` (a_l,)
        logits in each softmax's denominator (None: none) — module docstring."""
        kr, vr = self._rows(layer)
        c_l, d, B = self.kv_heads_local, self.head_dim, self.block_size
        a_l = q.shape[1] // d
        g = a_l // c_l
        itemsize = np.dtype(q.dtype).itemsize
        ctx_total = sum(c.context - window_start(c, window) for c in chunks)
        nbytes = (2 * q.size + 2 * ctx_total * c_l * d) * itemsize
        flops = paged_attention_flops(chunks, a_l, d, window)

        def one(c: SequenceChunk):
            n, ctx, start = c.n_new, c.context, window_start(c, window)
            keys_at = np.arange(start, ctx)                         # the keys read
            rows = slots(c.block_table, keys_at, B)
            keys = kr[rows].transpose(1, 2, 0)                      # (c_l, d, ctx')
            values = vr[rows].transpose(1, 0, 2)                    # (c_l, ctx', d)
            qr = q[c.first:c.first + n].reshape(n, c_l, g, d)
            qr = qr.transpose(1, 2, 0, 3).reshape(c_l, g * n, d)    # (c_l, g·n, d)
            pos = c.n_computed + np.arange(n)
            seen = keys_at[None, :] <= pos[:, None]
            if window is not None:
                seen &= keys_at[None, :] > pos[:, None] - window
            bias = np.where(seen, 0.0, -np.inf)
            s = qr @ keys / math.sqrt(d)                            # (c_l, g·n, ctx')
            s = s + np.tile(bias, (g, 1)).astype(s.dtype)
            m = s.max(axis=-1, keepdims=True)
            if sinks is not None:   # row r of KV head h: query head h·g + r // n's logit
                col = (np.zeros_like(s[:, :, :1]).reshape(c_l, g, n)
                       + sinks.reshape(c_l, g, 1)).reshape(c_l, g * n, 1)
                m = np.maximum(m, col)
            p = np.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            if sinks is not None:
                denom = denom + np.exp(col - m)
            o = (p / denom @ values).reshape(c_l, g, n, d)          # (c_l, g, n, d)
            return o.transpose(2, 0, 1, 3).reshape(n, a_l * d)

        with ops.dev.compute("gpt: attention: paged attention", flops=flops, bytes=nbytes):
            return np.concatenate([one(c) for c in chunks], axis=0)
