"""``BlockPool``: the paged KV cache's bookkeeping — which fixed-size blocks hold whose tokens.

A GPU's KV cache is ``num_blocks`` blocks of ``block_size`` token slots (vLLM's
PagedAttention). A sequence owns a *block table*: token position p lives in block
``table[p // block_size]`` at slot ``p % block_size``, so a sequence of n tokens holds
⌈n / block_size⌉ blocks wherever they are, and a finished sequence's blocks serve the
next one.

Imitated: vLLM v1's ``BlockPool`` and ``KVCacheManager`` (vllm/v1/core, 0.8–0.11) without
prefix caching: block 0 is the *null block* the engine keeps for padding, so
``num_blocks − 1`` are usable; free blocks form a queue — allocation takes from its head,
a freed table goes to its tail in reverse order (its last block first) — and an
allocation that does not fit changes nothing.
"""

from __future__ import annotations

from collections import deque

from modeling.errors import ConfigError

__all__ = ["BlockPool", "blocks_for"]

NULL_BLOCK = 0   # vLLM v1 BlockPool: block 0 is the null block, never handed to a request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """⌈num_tokens / block_size⌉: the blocks that hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


class BlockPool:
    """``num_blocks`` ≥ 2 blocks of ``block_size`` tokens (block 0 reserved); tables by
    request id."""

    def __init__(self, num_blocks: int, block_size: int = 16):
        for name, value, low in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, value, f"an integer >= {low}",
                                  "a paged KV cache needs blocks (block 0 is vLLM's null block)"
                                  if name == "num_blocks" else "not a block size",
                                  owner="BlockPool")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(1, num_blocks))
        self._tables: dict = {}
        self._frozen: dict = {}          # request id -> its table as a tuple, until it grows

    @property
    def num_usable(self) -> int:
        """Blocks a request may hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def usage(self) -> float:
        """Used / usable blocks, 0..1 (vLLM's ``kv_cache_usage`` gauge)."""
        return self.num_used / self.num_usable

    @property
    def capacity_tokens(self) -> int:
        """Token slots a single request could ever hold."""
        return self.num_usable * self.block_size

    def table(self, request_id) -> tuple[int, ...]:
        """The request's block ids in token order (empty when it holds none)."""
        frozen = self._frozen.get(request_id)
        if frozen is None:
            frozen = self._frozen[request_id] = tuple(self._tables.get(request_id, ()))
        return frozen

    def needed(self, request_id, num_tokens: int) -> int:
        """Blocks to add so the request holds ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size)
                   - len(self._tables.get(request_id, ())))

    def allocate(self, request_id, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; False, and nothing
        changed, when fewer blocks are free than it needs."""
        need = self.needed(request_id, num_tokens)
        if need > len(self._free):
            return False
        if need:
            table = self._tables.setdefault(request_id, [])
            for _ in range(need):
                table.append(self._free.popleft())
            self._frozen.pop(request_id, None)
        return True

    def free(self, request_id) -> None:
        """The request's blocks return to the free queue's tail, last block first."""
        self._free.extend(reversed(self._tables.pop(request_id, [])))
        self._frozen.pop(request_id, None)

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={self.num_used}, free={self.num_free}, tables={len(self._tables)})")
