"""A device's shared-memory arena: numpy arrays that every process of the cluster can read.

Each virtual device owns one arena (a shared-memory segment mapped by every process).
Only the owner allocates in it; peers read or write at offsets the owner publishes.
Arrays handed out by :meth:`Arena.empty` are ordinary ``numpy.ndarray`` objects whose
memory is a block of the arena; the block returns to the free list when the last view
of the array is garbage-collected.

Freed blocks keep their pages, so a buffer of the same size allocated again costs no
page faults (first touch of fresh shared memory runs at only ~0.8 GB/s on the
development machine, against ~9 GB/s for a warm copy).

Allocation is first-fit over a sorted free list with coalescing, in units of
``ALIGN_BYTES``; O(number of free extents), which stays small in practice.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

__all__ = ["Arena", "ALIGN_BYTES"]

ALIGN_BYTES = 64  # one cache line


class _Block:
    """Owns one allocation; numpy keeps it alive as the ``base`` of every view."""

    __slots__ = ("__array_interface__", "_arena", "_offset", "_size")

    def __init__(self, arena: "Arena", offset: int, size: int, shape, dtype: np.dtype):
        self._arena, self._offset, self._size = arena, offset, size
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(shape),
            "typestr": dtype.str,
            "descr": dtype.descr,
            "data": (arena.address + offset, False),
            "strides": None,
        }

    def __del__(self):
        self._arena._free(self._offset, self._size)


class Arena:
    """Allocator over ``memory``, a uint8 array over shared memory.

    ``owner`` is the rank that allocates here (-1 for the host). The arena of another
    rank can be *viewed* (``view``) but never allocated from.
    """

    def __init__(self, owner: int, memory: np.ndarray):
        self.owner = owner
        self.memory = memory                     # uint8 view of the whole arena
        self.address = memory.__array_interface__["data"][0]
        self.size_bytes = memory.nbytes
        self._free_offsets: list[int] = [0]      # sorted starts of free extents
        self._free_sizes: dict[int, int] = {0: self.size_bytes}
        self._lock = threading.RLock()           # __del__ may run inside an allocation
        self.used_bytes = 0                      # bytes of the live blocks (aligned)
        self.peak_bytes = 0                      # most used_bytes since reset_peak()

    def __repr__(self) -> str:
        return (f"Arena(owner={self.owner}, size_bytes={self.size_bytes}, "
                f"used_bytes={self.used_bytes}, peak_bytes={self.peak_bytes})")

    def reset_peak(self) -> None:
        """Start a new peak window at the bytes in use now (``cluster.reset_stats()``)."""
        with self._lock:
            self.peak_bytes = self.used_bytes

    # --- allocation -----------------------------------------------------------------
    def empty(self, shape, dtype) -> np.ndarray | None:
        """A new C-contiguous array in the arena, or None when it does not fit."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return None
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        offset = self._take(size)
        if offset is None:
            return None
        return np.asarray(_Block(self, offset, size, shape, dtype))

    def _take(self, size: int) -> int | None:
        with self._lock:
            for start in self._free_offsets:
                extent = self._free_sizes[start]
                if extent >= size:
                    self._free_offsets.remove(start)
                    del self._free_sizes[start]
                    if extent > size:
                        self._insert(start + size, extent - size)
                    self.used_bytes += size
                    self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                    return start
        return None

    def _insert(self, start: int, size: int) -> None:
        bisect.insort(self._free_offsets, start)
        self._free_sizes[start] = size

    def _free(self, start: int, size: int) -> None:
        with self._lock:
            self.used_bytes -= size
            i = bisect.bisect_left(self._free_offsets, start)
            # merge with the following extent
            if i < len(self._free_offsets) and self._free_offsets[i] == start + size:
                nxt = self._free_offsets.pop(i)
                size += self._free_sizes.pop(nxt)
            # merge with the preceding extent
            if i > 0:
                prev = self._free_offsets[i - 1]
                if prev + self._free_sizes[prev] == start:
                    self._free_sizes[prev] += size
                    return
            self._insert(start, size)

    # --- addressing -----------------------------------------------------------------
    def offset_of(self, array: np.ndarray) -> int | None:
        """Offset of a C-contiguous array that lies wholly inside this arena, else None."""
        if array.size == 0 or not array.flags.c_contiguous:
            return None
        start = array.__array_interface__["data"][0]
        if self.address <= start and start + array.nbytes <= self.address + self.size_bytes:
            return start - self.address
        return None

    def view(self, offset: int, shape, dtype) -> np.ndarray:
        """An array over bytes [offset, offset + nbytes) of this arena (no ownership)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size_bytes:
            raise ValueError(f"view of {nbytes} bytes at offset {offset} exceeds the arena "
                             f"of rank {self.owner} ({self.size_bytes} bytes)")
        return self.memory[offset:offset + nbytes].view(dtype).reshape(shape)
