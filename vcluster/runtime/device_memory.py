"""Where a collective's buffers live: the host's shared memory, or device memory that
peers read in place.

The shared-memory algorithm (:mod:`vcluster.runtime.collectives.shm`) reads and writes
peers' buffers at offsets they publish. Its arrays come from a *memory space*:

* :class:`HostSpace` (every cluster; the only one of ``array_module="numpy"``): the
  shared-memory arenas. Device arrays of the device modules are *staged*: copied to the
  host before the algorithm and back after it (counted in ``d2h_bytes``/``h2d_bytes``).
* :class:`CudaIpcSpace` (``array_module="cupy"``, ``transport="ipc"``): one block of GPU
  memory per device, exported through a CUDA IPC handle that every peer opens, so a
  collective on device arrays never touches the host: reductions run as CuPy kernels on
  peers' memory. Each device synchronises its stream before it tells its peers (through
  the host control words) that its input is ready or that it is done.
* :class:`StrictSpace` (``array_module="strict"``, ``transport="ipc"``): the same path on
  CPU: the shared arenas, handed to the algorithm as strict arrays, so CI runs the
  device-resident code (every numpy call on device arrays) without a GPU.

A space also carries the few host crossings a resident call makes: descriptors of
at most ``INLINE_BYTES`` carry their payload inline in the host's control words.
"""

from __future__ import annotations

import threading

import numpy as np

from .arena import Arena
from .strict import StrictArray, unwrap

__all__ = ["HostSpace", "StrictSpace", "CudaIpcSpace", "CudaArena", "TRANSPORTS"]

TRANSPORTS = ("auto", "ipc", "host")
_HANDLE_BYTES = 128          # flag (1) + CUDA IPC handle (64) + padding + size (int64 at 72)


class HostSpace:
    """The host's shared-memory arenas (the collectives' home on every cluster)."""

    name = "host"

    def __init__(self, arenas: list[Arena]):
        self.arenas = arenas

    def __repr__(self) -> str:
        return "HostSpace()"

    def from_host(self, x: np.ndarray):
        return x

    def inline_bytes(self, x) -> np.ndarray:
        return np.ascontiguousarray(x).view(np.uint8).reshape(-1)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def sync(self) -> None:
        """Nothing to wait for: host writes are visible to peers at once."""

    def available(self, members) -> bool:
        """Whether a group of these members may keep device arrays resident here
        (the host space holds host arrays only)."""
        return False

    def close(self) -> None:
        """Nothing to release: the arenas belong to the cluster."""


class _StrictArenaView:
    """An arena whose arrays are strict (device) arrays over the same shared memory."""

    def __init__(self, arena: Arena):
        self._arena = arena
        self.owner = arena.owner

    def empty(self, shape, dtype):
        arr = self._arena.empty(shape, dtype)
        return None if arr is None else StrictArray(arr)

    def offset_of(self, array) -> int | None:
        return self._arena.offset_of(unwrap(array)) if type(array) is StrictArray else None

    def view(self, offset: int, shape, dtype):
        return StrictArray(self._arena.view(offset, shape, dtype))

    @property
    def shortfall(self):
        return self._arena.shortfall


class StrictSpace(HostSpace):
    """The shared arenas as device memory of ``array_module="strict"``."""

    name = "ipc"

    def __init__(self, arenas: list[Arena]):
        super().__init__([_StrictArenaView(a) for a in arenas])

    def __repr__(self) -> str:
        return "StrictSpace()"

    def from_host(self, x: np.ndarray):
        return StrictArray(np.array(x, copy=True))

    def inline_bytes(self, x) -> np.ndarray:
        return np.ascontiguousarray(unwrap(x)).view(np.uint8).reshape(-1)

    def empty(self, shape, dtype):
        return StrictArray(np.empty(shape, dtype))

    def available(self, members) -> bool:
        return True


class _CudaBlock:
    """Owns one allocation of a :class:`CudaArena`; freed when CuPy drops the memory."""

    __slots__ = ("_arena", "_offset", "_size")

    def __init__(self, arena: "CudaArena", offset: int, size: int):
        self._arena, self._offset, self._size = arena, offset, size

    def __del__(self):
        self._arena._free(self._offset, self._size)


class CudaArena(Arena):
    """The allocator of :class:`Arena` over a block of GPU memory (CuPy arrays).

    The owner allocates; a peer's arena is the same block opened through its IPC handle
    (``owner`` is then the peer's rank, and nothing is allocated from it here).
    """

    def __init__(self, owner: int, address: int, size_bytes: int, cupy):
        self.owner, self.memory, self._cp = owner, None, cupy
        self._init_extents(address, size_bytes)

    def __repr__(self) -> str:
        return (f"CudaArena(owner={self.owner}, size_bytes={self.size_bytes}, "
                f"used_bytes={self.used_bytes})")

    def _array(self, address: int, nbytes: int, shape, dtype, keep):
        cp = self._cp
        memory = cp.cuda.UnownedMemory(address, nbytes, keep)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(memory, 0))

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return None
        size = -(-nbytes // 256) * 256            # CUDA's allocation alignment
        offset = self._take(size)
        if offset is None:
            return None
        return self._array(self.address + offset, size, shape, dtype,
                           _CudaBlock(self, offset, size))

    def offset_of(self, array) -> int | None:
        if not isinstance(array, self._cp.ndarray) or array.size == 0 \
                or not array.flags.c_contiguous:
            return None
        start = array.data.ptr
        if self.address <= start and start + array.nbytes <= self.address + self.size_bytes:
            return start - self.address
        return None

    def view(self, offset: int, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size_bytes:
            raise ValueError(f"view of {nbytes} bytes at offset {offset} exceeds the device "
                             f"arena of rank {self.owner} ({self.size_bytes} bytes)")
        return self._array(self.address + offset, max(nbytes, 1), tuple(shape), dtype, self)


class CudaIpcSpace(HostSpace):
    """Device memory shared between the device processes through CUDA IPC handles.

    Each device allocates ``size_bytes`` of GPU memory at start and writes its IPC
    handle into the first block of its host arena (allocated before anything else, so
    at offset 0); a peer opens it the first time a collective reads it. A device whose
    GPU refuses IPC writes no handle, and every group with such a member stages its
    collectives through the host (:meth:`available`), so all members agree.
    """

    name = "ipc"

    def __init__(self, rank: int, host_arenas: list[Arena], size_bytes: int, cupy):
        self._cp, self._rank, self._host_arenas = cupy, rank, host_arenas
        self._lock = threading.Lock()
        self._handle_block = host_arenas[rank].empty((_HANDLE_BYTES,), np.uint8)
        if self._handle_block is None or host_arenas[rank].offset_of(self._handle_block) != 0:
            raise RuntimeError(f"rank {rank}: the IPC handle must be the first block of the "
                               "device's arena")
        self._handle_block[:] = 0
        self._ptr = None
        self.error: str | None = None
        try:
            self._ptr = cupy.cuda.runtime.malloc(size_bytes)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            free, total = cupy.cuda.Device().mem_info
            raise MemoryError(
                f"rank {rank}: could not allocate device_arena_bytes={size_bytes} of GPU "
                f"memory to share through CUDA IPC ({exc}; {free} of {total} bytes free): "
                "pass a smaller VirtualCluster(device_arena_bytes=...), use fewer devices, "
                "or transport='host'") from None
        try:
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
        except Exception as exc:        # no IPC here (a sandbox, MIG, an old driver)
            self.error = f"{type(exc).__name__}: {exc}"
            cupy.cuda.runtime.free(self._ptr)
            self._ptr = None
            self.arenas = [None] * len(host_arenas)
            return
        self._handle_block[1:1 + len(handle)] = np.frombuffer(handle, np.uint8)
        self._handle_block[72:80].view(np.int64)[0] = size_bytes
        self._handle_block[0] = 1
        self.arenas = [None] * len(host_arenas)
        self.arenas[rank] = CudaArena(rank, self._ptr, size_bytes, cupy)
        self._opened: dict[int, int] = {}
        self._available: dict[tuple, bool] = {}

    def __repr__(self) -> str:
        state = "off: " + self.error if self.error else "on"
        return f"CudaIpcSpace(rank={self._rank}, {state})"

    def _header(self, rank: int) -> np.ndarray:
        return self._host_arenas[rank].view(0, (_HANDLE_BYTES,), np.uint8)

    def available(self, members) -> bool:
        """Whether every member exported its memory (so this group may go resident);
        opens the peers' handles the first time."""
        key = tuple(members)
        ok = self._available.get(key) if self._ptr is not None else False
        if ok is None:
            ok = all(int(self._header(m)[0]) == 1 for m in members)
            if ok:
                for m in members:
                    self._open(m)
            self._available[key] = ok
        return ok

    def _open(self, rank: int) -> None:
        with self._lock:
            if self.arenas[rank] is not None:
                return
            header = self._header(rank)
            handle = bytes(header[1:65])
            size = int(header[72:80].view(np.int64)[0])
            ptr = self._cp.cuda.runtime.ipcOpenMemHandle(handle)
            self._opened[rank] = ptr
            self.arenas[rank] = CudaArena(rank, ptr, size, self._cp)

    def from_host(self, x: np.ndarray):
        return self._cp.asarray(x)

    def inline_bytes(self, x) -> np.ndarray:
        return np.ascontiguousarray(self._cp.asnumpy(x)).view(np.uint8).reshape(-1)

    def empty(self, shape, dtype):
        return self._cp.empty(shape, dtype)

    def sync(self) -> None:
        """Wait for this device's queued kernels, so peers read finished data."""
        self._cp.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        """Close the peers' handles and free this device's block."""
        rt = self._cp.cuda.runtime
        self.sync()
        for ptr in getattr(self, "_opened", {}).values():
            rt.ipcCloseMemHandle(ptr)
        self._opened = {}
        if self._ptr is not None:
            self.arenas = [None] * len(self.arenas)
            rt.free(self._ptr)
            self._ptr = None
