"""KV-cache groups: how vLLM v1's hybrid KV-cache manager lays out a model that mixes
sliding-window and full-attention layers (and a model whose every layer slides).

Imitated: ``vllm/v1/core/kv_cache_utils._get_kv_cache_groups_uniform_page_size`` and the
sliding-window manager (``single_type_kv_cache_manager.SlidingWindowManager``) of vLLM
0.10–0.11, the hybrid manager on (its default; ``--disable-hybrid-kv-cache-manager``
turns it off).

The layers are bucketed by attention type, in order of first appearance: full attention,
and one bucket per sliding window w. With one bucket there is one group of every layer
(a sliding one when every layer slides: Mistral-7B-v0.1); with the manager off, one full
group (a sliding layer counted as a full one). Otherwise the group size
G is the smallest bucket's layer count — or the largest's when that is under 1.5 times
the smallest (vLLM's rule: gpt-oss-20b with an EAGLE drafter, 12 sliding + 13 full, pads
to 13 + 13) — and each bucket of n layers becomes ⌈n/G⌉ groups, group i taking the
bucket's layers i, i + k, i + 2k, ... (k = ⌈n/G⌉; so pipeline stages share groups
evenly). Every group has its own block table per request; all draw from one pool whose
block holds G layers' pages, so

    num_blocks = ⌊budget / (page_bytes × G_stage)⌋

with G_stage the most layers of one group on the stage (:func:`serving.memory.
kv_capacity`) — where one group of all L layers would give ⌊budget / (page_bytes × L)⌋.
GPT-OSS (half its layers sliding at 128, half full) has two groups of L/2 layers: twice
the blocks, and a request holds ⌈tokens/B⌉ blocks in the full group but only the blocks
its window reaches in the sliding one.

A sliding group frees what left the window (``remove_skipped_blocks``): before each
allocation for a request with c tokens computed, its blocks wholly before token
c − w + 1 go back to the pool and its table keeps the null block (block 0) in their place,
so the table still has one entry per ⌈tokens/B⌉. A prefix-cache hit in a sliding group
needs only the ⌈(w − 1)/B⌉ blocks before the hit point (``find_longest_cache_hit``).

Uniform page size is required (every layer the same KV heads × head dim, as GPT-OSS,
Gemma 3, Mistral): vLLM otherwise rescales block sizes per group, which is not modelled —
such a model is laid out as one group (:attr:`KVCacheGroups.hybrid` False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modeling.spec import LatentAttention, ModelSpec

__all__ = ["KVCacheGroups", "kv_cache_groups", "layer_groups", "request_blocks",
           "HYBRID_GROUP_SIZE_SLACK"]

#: vLLM's heuristic: the largest bucket sets the group size when it has fewer than this
#: many times the smallest's layers (``_get_kv_cache_groups_uniform_page_size``)
HYBRID_GROUP_SIZE_SLACK = 1.5


@dataclass(frozen=True)
class KVCacheGroups:
    """The groups of one model: ``windows[g]`` the sliding window of group g (None: full
    attention), ``layers[g]`` its global layer indices, ``group_size`` G (padded: a group
    may hold fewer layers)."""

    windows: tuple
    layers: tuple
    group_size: int

    @property
    def hybrid(self) -> bool:
        """Whether there is more than one group (the hybrid manager's layout)."""
        return len(self.windows) > 1

    def group_of(self, layer: int) -> int:
        """The group holding global layer ``layer``."""
        for g, members in enumerate(self.layers):
            if layer in members:
                return g
        raise ValueError(f"layer {layer} is in no KV-cache group of {self!r}")

    def blocks_for_request(self, num_tokens: int, block_size: int,
                           max_num_batched_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once: ⌈T/B⌉ in
        each full group, and in a sliding group of window w at most ⌈(w − 1 + budget)/B⌉
        + 1 (a chunk of the step's token budget beside the window; vLLM's
        ``SlidingWindowSpec.max_memory_usage_bytes``), never more than ⌈T/B⌉."""
        return request_blocks(self.windows, num_tokens, block_size, max_num_batched_tokens)

    def stage_group_size(self, layers) -> int:
        """G_stage: the most layers of one group among ``layers`` (a stage's)."""
        stage = set(layers)
        return max(len(stage.intersection(members)) for members in self.layers)

    def __repr__(self) -> str:
        kinds = ", ".join("full" if w is None else f"window {w}" for w in self.windows)
        return (f"KVCacheGroups({len(self.windows)} of {self.group_size} layers: {kinds})")


def request_blocks(windows, num_tokens: int, block_size: int,
                   max_num_batched_tokens: int) -> int:
    """Σ over groups of the blocks one request of ``num_tokens`` tokens holds at most
    (:meth:`KVCacheGroups.blocks_for_request`)."""
    full = -(-num_tokens // block_size)
    total = 0
    for window in windows:
        if window is None:
            total += full
        else:
            total += min(full, -(-(window - 1 + max_num_batched_tokens) // block_size) + 1)
    return total


def _window(layer) -> int | None:
    att = layer.attention
    return None if isinstance(att, LatentAttention) else att.window


def _page_shape(layer) -> tuple:
    att = layer.attention
    if isinstance(att, LatentAttention):
        return ("latent", att.kv_lora_rank + att.qk_rope_head_dim)
    return ("heads", att.kv_heads, att.head_dim)


def kv_cache_groups(spec: ModelSpec, hybrid: bool = True) -> KVCacheGroups:
    """The KV-cache groups vLLM forms for ``spec`` (module docstring); ``hybrid`` False:
    ``--disable-hybrid-kv-cache-manager``, one group of every layer."""
    uniform = len({_page_shape(x) for x in spec.layers}) == 1
    return layer_groups([_window(x) for x in spec.layers], hybrid and uniform)


def layer_groups(windows, hybrid: bool = True) -> KVCacheGroups:
    """The groups of layers whose sliding windows are ``windows`` (None: full attention),
    every layer's page the same size (module docstring)."""
    layers = range(len(windows))
    buckets: dict = {}
    for i in layers:
        buckets.setdefault(windows[i], []).append(i)
    if len(buckets) == 1:            # one type: one group, a sliding one if every layer is
        return KVCacheGroups((windows[0],), (tuple(layers),), len(windows))
    if not hybrid:                   # the manager off: sliding layers counted as full
        return KVCacheGroups((None,), (tuple(layers),), len(windows))
    sizes = [len(b) for b in buckets.values()]
    size = min(sizes)
    if max(sizes) < HYBRID_GROUP_SIZE_SLACK * size:
        size = max(sizes)
    windows, members = [], []
    for window, bucket in buckets.items():
        k = math.ceil(len(bucket) / size)
        for i in range(k):
            windows.append(window)
            members.append(tuple(bucket[i::k]))
    return KVCacheGroups(tuple(windows), tuple(members), size)
