"""``BlockPool``: the paged KV cache's bookkeeping — which fixed-size blocks hold whose tokens.

A GPU's KV cache is ``num_blocks`` blocks of ``block_size`` token slots (vLLM's
PagedAttention). A sequence owns a *block table*: token position p lives in block
``table[p // block_size]`` at slot ``p % block_size``, so a sequence of n tokens holds
⌈n / block_size⌉ blocks wherever they are, and a finished sequence's blocks serve the
next one.

Imitated: vLLM v1's ``BlockPool`` and ``KVCacheManager`` (vllm/v1/core, 0.8–0.11): block 0
is the *null block* the engine keeps for padding, so ``num_blocks − 1`` are usable; free
blocks form a queue — allocation takes from its head, a freed table goes to its tail in
reverse order (its last block first) — and an allocation that does not fit changes nothing.

**Prefix caching** (``enable_caching``, vLLM v1's default): a block whose ``block_size``
slots are all filled is registered under what it holds; freeing it keeps it registered, and
it leaves the cache only when the free queue hands it to someone else (the head of the
queue: least recently freed, a table's last block first). A request admitted with nothing
computed first takes back the longest run of its leading blocks still registered
(:meth:`BlockPool.cached_prefix`, :meth:`BlockPool.allocate` with ``hit_blocks``) and
computes only the rest. vLLM names a full block by a hash of its tokens chained to its
parent block's; here the name says the same without tokens: a block wholly inside a
request's *shared prefix* (:attr:`serving.Request.shared_prefix`: the first ``prefix_len``
tokens are those of prefix ``prefix_id``, as ``vllm bench serve --random-prefix-len``
gives every prompt one prefix) is (prefix, block index) — the same tokens at the same
positions in every request of that prefix — and any other block is (request, block index):
a request's tokens never change and its own tokens are its own, so such a hit is its KV
surviving a preemption. A block may then sit in several tables at once: each holder
counts (vLLM's ``ref_cnt``), it joins the free queue when the last one frees it, and
admitting a request that takes back cached blocks needs free blocks only for its new ones
and for those of its hits now in the free queue.
"""

from __future__ import annotations

from collections import OrderedDict

from modeling.errors import ConfigError

from .kv_groups import request_blocks

__all__ = ["BlockPool", "blocks_for"]

NULL_BLOCK = 0   # vLLM v1 BlockPool: block 0 is the null block, never handed to a request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """⌈num_tokens / block_size⌉: the blocks that hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


class BlockPool:
    """``num_blocks`` ≥ 2 blocks of ``block_size`` tokens (block 0 reserved); tables by
    request id, one per KV-cache group (``group_windows``: each group's sliding window,
    None for full attention; :mod:`serving.kv_groups`)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = False,
                 group_windows: tuple = (None,)):
        for name, value, low in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, value, f"an integer >= {low}",
                                  "a paged KV cache needs blocks (block 0 is vLLM's null block)"
                                  if name == "num_blocks" else "not a block size",
                                  owner="BlockPool")
        if not isinstance(enable_caching, bool):
            raise ConfigError("enable_caching", enable_caching, "true or false",
                              "not a boolean", owner="BlockPool")
        windows = tuple(group_windows) if isinstance(group_windows, (tuple, list)) else ()
        if not windows or any(w is not None and (isinstance(w, bool) or not isinstance(w, int)
                                                 or w < 2) for w in windows):
            raise ConfigError("group_windows", group_windows, "a non-empty tuple of None "
                              "(full attention) or windows >= 2", "not KV-cache groups",
                              owner="BlockPool")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        self.group_windows = windows
        self._sliding = any(w is not None for w in windows)
        # The free queue, in two parts (a cache of millions of blocks costs nothing until
        # its blocks are used): blocks never handed out, _fresh .. num_blocks - 1, at its
        # head in id order (the queue vLLM starts with), then the blocks freed since, in
        # the order freed (insertion order; O(1) removal of a cached one). Only a freed
        # block can hold anything, so a hit never touches the fresh part.
        self._fresh = 1
        self._free: OrderedDict = OrderedDict()
        self._tables: dict = {}          # request id -> [its table in group g, ...]
        self._frozen: dict = {}          # request id -> its tables as tuples, until they change
        self._holds: dict = {}           # block -> its name (_name, group): what it holds
        self._cached: dict = {}          # (name, group) -> block, while registered
        self._registered: dict = {}      # request id -> its leading blocks registered so far
        self._refs: dict = {}            # block -> tables holding it (absent: free)
        self.hit_blocks = self.queried_blocks = 0   # vLLM's prefix-cache hit-rate counters

    @property
    def num_usable(self) -> int:
        """Blocks a request may hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def free_queue(self) -> list[int]:
        """The free blocks in queue order (the next allocation takes the first)."""
        return list(range(self._fresh, self.num_blocks)) + list(self._free)

    @property
    def usage(self) -> float:
        """Used / usable blocks, 0..1 (vLLM's ``kv_cache_usage`` gauge)."""
        return self.num_used / self.num_usable

    @property
    def capacity_tokens(self) -> int:
        """Token slots a single request could ever hold in one group."""
        return self.num_usable // len(self.group_windows) * self.block_size

    def blocks_for_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, over every
        group (:func:`serving.kv_groups.request_blocks`)."""
        return request_blocks(self.group_windows, num_tokens, self.block_size,
                              max_num_batched_tokens)

    def tables(self, request_id) -> tuple:
        """The request's block ids in token order, one tuple per group (empty when it holds
        none; :data:`NULL_BLOCK` where a sliding group dropped a block that left its
        window)."""
        frozen = self._frozen.get(request_id)
        if frozen is None:
            held = self._tables.get(request_id)
            frozen = self._frozen[request_id] = tuple(tuple(t) for t in held) if held \
                else ((),) * len(self.group_windows)
        return frozen

    def table(self, request_id) -> tuple[int, ...]:
        """The request's block ids in token order in the first group."""
        return self.tables(request_id)[0]

    def cached_prefix(self, request_id, num_tokens: int, prefix=None) -> int:
        """Leading blocks of ``request_id`` (which holds none now) found cached, at most
        ⌊(num_tokens − 1) / block_size⌋ of them: vLLM recomputes at least the last known
        token, whose logits it samples from (``max_cache_hit_length = num_tokens − 1``).
        ``prefix``: (prefix id, tokens) the request shares with others
        (:attr:`serving.Request.shared_prefix`; None: nothing shared). A full group needs
        every leading block; a sliding group of window w only the ⌈(w − 1)/B⌉ blocks before
        the hit point (vLLM's ``find_longest_cache_hit``: the rightmost such run, else the
        leading run); the hit is the shortest over the groups. 0 without caching."""
        if not self.enable_caching:
            return 0
        hits = max(0, num_tokens - 1) // self.block_size
        full = [g for g, w in enumerate(self.group_windows) if w is None]
        if full:
            run = 0
            while run < hits and self._all_cached(request_id, run, prefix, full):
                run += 1
            hits = run
        for window in dict.fromkeys(w for w in self.group_windows if w is not None):
            groups = [g for g, w in enumerate(self.group_windows) if w == window]
            hits = self._sliding_hit(request_id, hits, prefix, groups, window)
        return hits

    def _all_cached(self, request_id, index: int, prefix, groups) -> bool:
        name = self._name(request_id, index, prefix)
        return all((name, g) in self._cached for g in groups)

    def _contiguous(self, window: int) -> int:
        """Blocks a sliding-window hit needs before its end: ⌈(w − 1)/B⌉."""
        return -(-(window - 1) // self.block_size)

    def _sliding_hit(self, request_id, limit: int, prefix, groups, window: int) -> int:
        """The longest hit of at most ``limit`` blocks in the sliding ``groups``: scanning
        from the right, the end of the first run of ⌈(w − 1)/B⌉ cached blocks; without one,
        the run of cached blocks from block 0."""
        need, run = self._contiguous(window), 0
        for index in range(limit - 1, -1, -1):
            if self._all_cached(request_id, index, prefix, groups):
                run += 1
                if run >= need:
                    return index + run
            else:
                run = 0
        return run

    def _name(self, request_id, index: int, prefix) -> tuple:
        """What block ``index`` of the request holds: (None, prefix id, index) for a block
        wholly inside its shared prefix — the same tokens at the same positions in every
        request of that prefix, as vLLM's chained hash names them — else (request id,
        index)."""
        if prefix is not None and (index + 1) * self.block_size <= prefix[1]:
            return None, prefix[0], index
        return request_id, index

    def record_admission(self, num_tokens: int, hit_blocks: int) -> None:
        """Count one admission's lookup for :attr:`hit_rate`: ``num_tokens`` known tokens,
        ``hit_blocks`` of their blocks found cached."""
        self.queried_blocks += blocks_for(num_tokens, self.block_size)
        self.hit_blocks += hit_blocks

    @property
    def hit_rate(self) -> float:
        """Blocks found cached / blocks looked up at admissions (0 when none looked up)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0

    def _drop_skipped(self, request_id, computed: int) -> None:
        """vLLM's ``remove_skipped_blocks``: in each sliding group of window w, the blocks
        wholly before token ``computed`` − w + 1 return to the pool (those nobody else
        holds, to the free queue's tail), the null block taking their place."""
        held = self._tables.get(request_id)
        if not held:
            return
        dropped = False
        for window, table in zip(self.group_windows, held):
            if window is None:
                continue
            first_useful = (computed - window + 1) // self.block_size
            for index in range(min(first_useful, len(table)) - 1, -1, -1):
                if table[index] == NULL_BLOCK:       # and so is every block before it
                    break
                self._release(table[index])
                table[index] = NULL_BLOCK
                dropped = True
        if dropped:
            self._frozen.pop(request_id, None)

    def _release(self, block: int) -> None:
        left = self._refs[block] - 1
        if left:
            self._refs[block] = left
        else:
            del self._refs[block]
            self._free[block] = None

    def allocate(self, request_id, num_tokens: int, hit_blocks: int = 0,
                 prefix=None, computed: int | None = None) -> bool:
        """Grow the request's tables to hold ``num_tokens`` tokens — first taking back its
        ``hit_blocks`` cached leading blocks (:meth:`cached_prefix` with the same
        ``prefix``; the request holds none): out of the free queue, or shared with the
        requests holding them — and register the blocks it fills; False, and nothing
        changed, when fewer blocks are free than it needs (cached ones it takes out of the
        free queue included, as vLLM counts its evictable computed blocks). ``computed``:
        the request's tokens computed so far; given, its sliding groups first drop the
        blocks that left their windows (:meth:`_drop_skipped`; kept even when the
        allocation then fails, as in vLLM)."""
        held = self._tables.get(request_id)
        # the common case, a decode inside its last block, has nothing to take or drop
        inside = held is not None and not hit_blocks and not self._sliding \
            and num_tokens <= len(held[0]) * self.block_size
        if not inside and not self._grow(request_id, num_tokens, hit_blocks, prefix,
                                         computed):
            return False
        if self.enable_caching:
            full, done = num_tokens // self.block_size, self._registered.get(request_id, 0)
            if full > done:
                self._register(request_id, self._tables[request_id], done, full, prefix)
        return True

    def _grow(self, request_id, num_tokens: int, hit_blocks: int, prefix, computed) -> bool:
        """:meth:`allocate`'s blocks (its registration apart)."""
        if computed is not None and self._sliding:
            self._drop_skipped(request_id, computed)
        held = self._tables.get(request_id)
        groups = len(self.group_windows)
        wanted = blocks_for(num_tokens, self.block_size)
        if hit_blocks:
            if held:
                raise ValueError(f"allocate: request {request_id!r} already holds blocks; "
                                 "cached blocks are taken back only on admission")
            hits = [self._hit_table(request_id, hit_blocks, prefix, g, w)
                    for g, w in enumerate(self.group_windows)]
            taken = [b for table in hits for b in table if b != NULL_BLOCK]
            evictable = sum(1 for block in taken if block in self._free)
            need = (wanted - hit_blocks) * groups
            if wanted < hit_blocks or need + evictable > self.num_free:
                return False
            for block in taken:
                if block in self._free:
                    del self._free[block]
                self._refs[block] = self._refs.get(block, 0) + 1
            held = self._tables[request_id] = hits
            self._registered[request_id] = hit_blocks
            self._frozen.pop(request_id, None)
        else:
            need = (wanted - (len(held[0]) if held else 0)) * groups
        if need > 0:
            if need > self.num_free:
                return False
            if held is None:
                held = self._tables[request_id] = [[] for _ in range(groups)]
            holds, refs, pop = self._holds, self._refs, self._free.popitem
            for table in held:
                for _ in range(wanted - len(table)):
                    if self._fresh < self.num_blocks:     # the queue's never-used head
                        block = self._fresh
                        self._fresh += 1
                    else:
                        block, _ = pop(last=False)
                        if holds:
                            content = holds.pop(block, None)
                            if content is not None:       # evicted: the cache forgets it
                                del self._cached[content]
                    refs[block] = 1
                    table.append(block)
            self._frozen.pop(request_id, None)
        return True

    def _hit_table(self, request_id, hits: int, prefix, group: int, window) -> list:
        """Group ``group``'s table of a hit of ``hits`` blocks: every cached block of a
        full group; in a sliding group the ⌈(w − 1)/B⌉ before the hit point, the null
        block before them."""
        first = 0 if window is None else max(0, hits - self._contiguous(window))
        return [NULL_BLOCK if index < first else
                self._cached[(self._name(request_id, index, prefix), group)]
                for index in range(hits)]

    def _register(self, request_id, held: list, start: int, stop: int, prefix) -> None:
        """Name blocks ``start``..``stop`` − 1 of the request's tables by what they hold
        (:meth:`_name`, and the group); an older copy of one (a request that computed the
        same shared block beside it, or its own before a preemption) stops being
        findable. A null block (dropped from a sliding window) holds nothing."""
        cached, holds = self._cached, self._holds
        for g, table in enumerate(held):
            for index in range(start, stop):
                block = table[index]
                if block == NULL_BLOCK:
                    continue
                name = (self._name(request_id, index, prefix), g)
                stale = cached.get(name)
                if stale is not None and stale != block:
                    del holds[stale]
                cached[name] = block
                holds[block] = name
        self._registered[request_id] = stop

    def free(self, request_id) -> None:
        """The request's blocks leave its tables, group by group; those no other request
        holds return to the free queue's tail, each table's last block first; full ones
        stay registered until handed out again."""
        for table in self._tables.pop(request_id, ()):
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self._release(block)
        self._frozen.pop(request_id, None)
        self._registered.pop(request_id, None)

    def holders(self, block: int) -> int:
        """Requests whose tables hold ``block`` now (0: free)."""
        return self._refs.get(block, 0)

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={self.num_used}, free={self.num_free}, tables={len(self._tables)}"
                + (f", groups={len(self.group_windows)}" if len(self.group_windows) > 1
                   else "")
                + (f", cached={len(self._cached)}" if self.enable_caching else "") + ")")
