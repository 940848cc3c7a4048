"""Where everything lives in the cluster's control segment (a small shared-memory block).

All fields are little-endian int64 words in one array ``words``::

    header      HEADER_WORDS words: abort flag, who aborted and why, epoch
    progress    [rank, group slot]                     collective sequence * 4 + phase
    descriptors [rank, group slot, parity, DESC_WORDS] what a member publishes for a call
    posted      [src, dst]                             last message sequence src posted to dst
    mailboxes   [src, dst, slot, SLOT_WORDS]           point-to-point message descriptors

A *group slot* numbers a set of mesh axes (a bitmask over the mesh's axes), so every
member of a group agrees on it without talking. Futex sleepers wait on the low half of
``progress``, ``posted`` and mailbox ``state`` words.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["ControlLayout", "HEADER_WORDS", "DESC_WORDS", "SLOT_WORDS", "INLINE_BYTES",
           "MAX_NDIM", "encode_dtype", "decode_dtype", "ABORT", "ABORT_RANK", "ABORT_KIND",
           "D", "S"]

HEADER_WORDS = 8
ABORT, ABORT_RANK, ABORT_KIND = 0, 1, 2  # header word indices
INLINE_BYTES = 512   # payloads up to this size travel inside the descriptor
MAX_NDIM = 8


class D:
    """Word offsets inside a collective descriptor."""
    SEQ, OP, DTYPE, NDIM = 0, 1, 2, 3
    SHAPE = 4                       # MAX_NDIM words
    IN_OWNER = SHAPE + MAX_NDIM     # rank whose arena holds the input, or -1 = inline
    IN_OFFSET = IN_OWNER + 1
    NBYTES = IN_OFFSET + 1
    OUT_OWNER = NBYTES + 1          # where peers may write this member's result
    OUT_OFFSET = OUT_OWNER + 1
    ARG = OUT_OFFSET + 1            # op-specific argument (dim, root, reduce op)
    INLINE = 24
    WORDS = INLINE + INLINE_BYTES // 8


class S:
    """Word offsets inside a mailbox slot (one point-to-point message)."""
    STATE, SEQ, KIND, TAG, DTYPE, NDIM = 0, 1, 2, 3, 4, 5
    SHAPE = 6
    OWNER = SHAPE + MAX_NDIM        # rank whose arena holds the payload, or -1 = inline
    OFFSET = OWNER + 1
    NBYTES = OFFSET + 1
    INLINE = 24
    WORDS = INLINE + INLINE_BYTES // 8


DESC_WORDS = D.WORDS
SLOT_WORDS = S.WORDS


@lru_cache(maxsize=64)   # pure: dtype -> word
@lru_cache(maxsize=64)   # pure: dtype -> word (two calls per collective otherwise ~2 us)
def encode_dtype(dtype: np.dtype) -> int:
    """Pack a simple dtype's ``str`` (e.g. '<f8') into one int64 word."""
    text = np.dtype(dtype).str.encode("ascii")
    if len(text) > 8 or np.dtype(dtype).fields is not None or np.dtype(dtype).hasobject:
        raise TypeError(f"dtype {dtype} cannot travel between devices; use a numeric dtype")
    return int.from_bytes(text.ljust(8, b"\0"), "little", signed=True)


@lru_cache(maxsize=64)   # pure: word -> dtype
def decode_dtype(word: int) -> np.dtype:
    return np.dtype(int(word).to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii"))


@dataclass(frozen=True)
class ControlLayout:
    """Sizes and offsets (in words) of the control segment for one cluster."""

    n_ranks: int
    n_slots: int          # 2 ** (number of mesh axes)
    mailbox_slots: int = 16

    @property
    def progress_at(self) -> int:
        return HEADER_WORDS

    @property
    def desc_at(self) -> int:
        return self.progress_at + self.n_ranks * self.n_slots

    @property
    def posted_at(self) -> int:
        return self.desc_at + self.n_ranks * self.n_slots * 2 * DESC_WORDS

    @property
    def mailbox_at(self) -> int:
        return self.posted_at + self.n_ranks * self.n_ranks

    @property
    def total_words(self) -> int:
        return self.mailbox_at + self.n_ranks * self.n_ranks * self.mailbox_slots * SLOT_WORDS

    @property
    def size_bytes(self) -> int:
        return self.total_words * 8

    def views(self, words: np.ndarray) -> dict[str, np.ndarray]:
        """Structured views over ``words`` (an int64 array of ``total_words``)."""
        n, k, m = self.n_ranks, self.n_slots, self.mailbox_slots
        return {
            "header": words[:HEADER_WORDS],
            "progress": words[self.progress_at:self.desc_at].reshape(n, k),
            "desc": words[self.desc_at:self.posted_at].reshape(n, k, 2, DESC_WORDS),
            "posted": words[self.posted_at:self.mailbox_at].reshape(n, n),
            "mailbox": words[self.mailbox_at:self.total_words].reshape(n, n, m, SLOT_WORDS),
        }
