"""The tracer: run per-device programs on shape-only arrays and record what they do.

``trace_program(mesh, fn, args_per_rank, ranks=None)`` runs ``fn(dev, *args)`` for each
traced rank in a thread of this process, with a :class:`TracingDevice` as ``dev`` and
:class:`~vcluster.runtime.tracing.meta.MetaArray` inputs, and returns one
:class:`~vcluster.runtime.tracing.ops.DeviceTrace` per traced rank. Nothing is computed
and nothing is moved: compute declared with ``dev.compute`` becomes ``TraceCompute``,
every collective ``TraceCollective`` (with the algorithm ``choose_algorithm`` picks, as
on the emulator), every send and receive ``TraceSend``/``TraceRecv``.

Threads are needed only where one device must learn a shape from another: a receive
waits for the matching send, a non-root of broadcast or scatter for the root's call.
With ``host_time=True`` each rank's trace also carries its program's own host work (see
:mod:`vcluster.runtime.tracing.host`): before every device call, and before the end of
every ``dev.compute`` block, a ``TraceCompute("host", 0, 0, host_s=..., array_calls=...)``
holds the thread CPU and the array operations of the program since the previous device
call (only the ``localhost`` timing model prices them; other models are given traces
without them).

With ``ranks`` a subset (symmetric tracing: one representative per pipeline stage, say),
collectives over groups whose other members are not traced complete on their own; a
receive from an untraced rank, or a rooted collective whose root is untraced and no
``out=`` gives the shape, is an error that says so.
"""

from __future__ import annotations

import functools
import itertools
import threading
import traceback
from contextlib import contextmanager

import numpy as np

from ..algorithm import AlgorithmSettings, choose_algorithm
from ..collectives.common import ReduceOp, scaled_shape
from ..errors import VClusterError
from ..recorder import MemoryPeaks
from .host import HOST_OP, HostClock
from .kernel import as_kernel
from .meta import MetaArray
from .ops import DeviceTrace, TraceCollective, TraceCompute, TraceRecv, TraceSend, TraceWait

__all__ = ["TracingDevice", "trace_program", "TraceError"]


class TraceError(VClusterError):
    """A program could not be traced (names the rank and the reason)."""


class _Board:
    """Shapes one traced device publishes for another (sends, rooted collectives)."""

    def __init__(self, traced: frozenset, timeout_s: float):
        self.traced, self.timeout_s = traced, timeout_s
        self._cv = threading.Condition()
        self._values: dict = {}
        self.failed = False

    def put(self, key, value) -> None:
        with self._cv:
            self._values.setdefault(key, []).append(value)
            self._cv.notify_all()

    def take(self, key, what: str):
        with self._cv:
            ok = self._cv.wait_for(lambda: self._values.get(key) or self.failed,
                                   timeout=self.timeout_s)
            if self.failed:
                raise TraceError("tracing stopped: another traced rank failed")
            if not ok:
                raise TraceError(f"tracing: waited {self.timeout_s:g} s for {what}")
            return self._values[key].pop(0)

    def peek(self, key, what: str):
        value = self.take(key, what)
        self.put(key, value)
        return value


class _Work:
    def __init__(self, ops, handle, value):
        self._ops, self._handle, self._value, self._done = ops, handle, value, False

    def wait(self, timeout_s=None):
        if not self._done and self._handle is not None:
            self._ops.append(TraceWait(self._handle))
        self._done = True
        return self._value() if callable(self._value) else self._value

    def is_completed(self) -> bool:
        return self._done


def _device_call(fn):
    """A device call: with host timing on, it ends the program's host segment (recorded
    as a host op), and its own work is not the program's."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        clock = self.host_clock
        if clock is None or clock.depth:
            return fn(self, *args, **kwargs)
        self.record_host()
        clock.pause()
        try:
            return fn(self, *args, **kwargs)
        finally:
            clock.resume()
    return wrapper


class TracingDevice:
    """A :class:`~vcluster.runtime.context.DeviceContext` that records instead of running.

    ``host_clock``: a running :class:`~vcluster.runtime.tracing.host.HostClock` of the
    thread that runs this rank's program, or None (no host work recorded).
    """

    def __init__(self, rank: int, mesh, board: _Board, settings: AlgorithmSettings,
                 host_clock: HostClock | None = None):
        self.rank, self.mesh, self.index, self.xp = rank, mesh, mesh.index(rank), np
        self.ops: list = []
        self.host_clock = host_clock
        self._board, self._settings = board, settings
        self._calls: dict = {}                  # group -> calls so far
        self._handles = itertools.count()
        self.memory = MemoryPeaks()

    def __repr__(self) -> str:
        return f"TracingDevice(rank={self.rank})"

    def record_memory(self, **held_bytes: int) -> None:
        """Keep the peak of each kind (the trace's ``peak_bytes``)."""
        self.memory.record(held_bytes)

    def record_host(self) -> None:
        """Close the program's current host segment into a host op (host timing on);
        the caller resumes the clock once its own bookkeeping is done."""
        host_s, calls, array_s = self.host_clock.lap()
        if host_s > 0.0 or calls:
            self.ops.append(TraceCompute(HOST_OP, 0.0, 0, host_s=host_s, array_calls=calls,
                                         array_s=array_s))

    def empty(self, shape, dtype=np.float32):
        clock = self.host_clock
        if clock is not None and not clock.depth:
            clock.count_call()
        return MetaArray((shape,) if isinstance(shape, int) else shape, dtype)

    @contextmanager
    def compute(self, name: str, flops: float = 0, bytes: int = 0, gemm=None, kernel=None):
        clock = self.host_clock
        timed = clock is not None and not clock.depth
        if timed:
            self.record_host()                  # the program's work before the block
            clock.resume()
        first = len(self.ops)
        yield
        if timed:
            self.record_host()                  # the block's own calls (its kernels' host)
        held = sum(getattr(op, "name", None) != HOST_OP for op in self.ops[first:])
        self.ops.append(TraceCompute(str(name), float(flops), int(bytes), contains=held,
                                     kernel=as_kernel(name, gemm, kernel)))
        if timed:
            clock.resume()

    # --- collectives ------------------------------------------------------------------
    def _group(self, axis):
        return self.mesh.group(self.mesh.axis_tuple(axis), self.rank)

    def _collective(self, name, axis, x, shape, dtype, out, async_op, algorithm, root=0,
                    nbytes=None, result=True):
        group = self._group(axis)
        nbytes = x.nbytes if nbytes is None else nbytes
        alg = choose_algorithm(name, nbytes, len(group), self._settings, algorithm)
        handle = next(self._handles) if async_op else None
        itemsize = np.dtype(dtype).itemsize if dtype is not None else 1
        self.ops.append(TraceCollective(name, group, int(nbytes), itemsize, alg, root, handle))
        value = None
        if result:
            value = out if out is not None else MetaArray(shape, dtype)
        return _Work(self.ops, handle, value) if async_op else value

    def _call_key(self, group):
        k = self._calls.get(group, 0)
        self._calls[group] = k + 1
        return ("rooted", group, k)

    @_device_call
    def all_reduce(self, x, axis=None, op="sum", *, out=None, async_op=False, algorithm="auto"):
        ReduceOp.parse(op, x.dtype)
        return self._collective("all_reduce", axis, x, x.shape, x.dtype, out, async_op, algorithm)

    @_device_call
    def all_gather(self, x, axis=None, dim=0, *, out=None, async_op=False, algorithm="auto"):
        shape = scaled_shape(x.shape, dim, len(self._group(axis)), False, "all_gather")
        return self._collective("all_gather", axis, x, shape, x.dtype, out, async_op, algorithm)

    @_device_call
    def reduce_scatter(self, x, axis=None, dim=0, op="sum", *, out=None, async_op=False,
                       algorithm="auto"):
        ReduceOp.parse(op, x.dtype)
        shape = scaled_shape(x.shape, dim, len(self._group(axis)), True, "reduce_scatter")
        return self._collective("reduce_scatter", axis, x, shape, x.dtype, out, async_op,
                                algorithm)

    @_device_call
    def all_to_all(self, x, axis=None, split_dim=0, concat_dim=0, *, out=None, async_op=False,
                   algorithm="auto"):
        n = len(self._group(axis))
        shape = scaled_shape(scaled_shape(x.shape, split_dim, n, True, "all_to_all"),
                             concat_dim, n, False, "all_to_all")
        return self._collective("all_to_all", axis, x, shape, x.dtype, out, async_op, algorithm)

    def _rooted(self, name, axis, x, root, out):
        """(shape, dtype, nbytes) of the root's input, published by the root."""
        group = self._group(axis)
        key = self._call_key(group)
        if group.index(self.rank) == root:
            if x is None:
                raise ValueError(f"{name}: the root (rank {self.rank}) must pass an array")
            self._board.put(key, (x.shape, x.dtype))
            return x.shape, x.dtype
        if group[root] not in self._board.traced:
            if out is None:
                raise TraceError(f"rank {self.rank}: {name} from untraced root rank "
                                 f"{group[root]}: pass out= so the tracer knows the shape")
            return None, out.dtype
        return self._board.peek(key, f"rank {group[root]} to reach {name}")

    @_device_call
    def broadcast(self, x, axis=None, root=0, *, out=None, async_op=False, algorithm="auto"):
        shape, dtype = self._rooted("broadcast", axis, x, root, out)
        shape = out.shape if shape is None else shape
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self._collective("broadcast", axis, x, shape, dtype, out, async_op, algorithm,
                                root, nbytes)

    @_device_call
    def scatter(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
                algorithm="auto"):
        n = len(self._group(axis))
        shape, dtype = self._rooted("scatter", axis, x, root, out)
        full = scaled_shape(out.shape, dim, n, False, "scatter") if shape is None else shape
        piece = scaled_shape(full, dim, n, True, "scatter")
        nbytes = int(np.prod(full, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self._collective("scatter", axis, x, piece, dtype, out, async_op, algorithm,
                                root, nbytes)

    @_device_call
    def gather(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
               algorithm="auto"):
        group = self._group(axis)
        shape = scaled_shape(x.shape, dim, len(group), False, "gather")
        is_root = group.index(self.rank) == root
        return self._collective("gather", axis, x, shape, x.dtype, out, async_op, algorithm,
                                root, result=is_root)

    @_device_call
    def reduce(self, x, axis=None, root=0, op="sum", *, out=None, async_op=False,
               algorithm="auto"):
        ReduceOp.parse(op, x.dtype)
        is_root = self._group(axis).index(self.rank) == root
        return self._collective("reduce", axis, x, x.shape, x.dtype, out, async_op, algorithm,
                                root, result=is_root)

    @_device_call
    def barrier(self, axis=None, *, async_op=False, algorithm="auto"):
        return self._collective("barrier", axis, None, None, None, None, async_op, algorithm,
                                nbytes=0, result=False)

    # --- point to point -----------------------------------------------------------------
    @_device_call
    def send(self, x, to: int, tag: int = 0) -> None:
        self.ops.append(TraceSend(int(to), x.nbytes, int(tag)))
        self._board.put(("p2p", self.rank, int(to), int(tag)), (x.shape, x.dtype))

    @_device_call
    def isend(self, x, to: int, tag: int = 0):
        self.send(x, to, tag)
        return _Work(self.ops, None, None)

    @_device_call
    def recv(self, src: int, tag: int = 0, *, out=None):
        src, tag = int(src), int(tag)
        if src not in self._board.traced:
            if out is None:
                raise TraceError(f"rank {self.rank}: recv from untraced rank {src}: trace it "
                                 "too, or pass out= so the tracer knows the shape")
            shape, dtype = out.shape, out.dtype
        else:
            shape, dtype = self._board.take(("p2p", src, self.rank, tag),
                                            f"rank {src} to send tag {tag} to rank {self.rank}")
        value = out if out is not None else MetaArray(shape, dtype)
        self.ops.append(TraceRecv(src, value.nbytes, tag))
        return value

    def irecv(self, src: int, tag: int = 0, *, out=None):
        return _Work(self.ops, None, lambda: self.recv(src, tag, out=out))


def trace_program(mesh, fn, args_per_rank=None, ranks=None, algorithm: str = "auto",
                  timeout_s: float = 60.0, host_time: bool = False) -> list[DeviceTrace]:
    """Trace ``fn(dev, *args_per_rank[r])`` for every rank in ``ranks`` (default: all);
    ``host_time``: record the programs' host work too (module docstring)."""
    ranks = list(range(mesh.size)) if ranks is None else sorted(set(ranks))
    args_per_rank = args_per_rank or [()] * mesh.size
    board = _Board(frozenset(ranks), timeout_s)
    settings = AlgorithmSettings(algorithm)
    devices = {r: TracingDevice(r, mesh, board, settings, HostClock() if host_time else None)
               for r in ranks}
    errors: dict[int, str] = {}

    def run(rank):
        dev = devices[rank]
        try:
            if dev.host_clock is not None:
                dev.host_clock.start()
            fn(dev, *args_per_rank[rank])
            if dev.host_clock is not None:
                dev.record_host()
        except BaseException as exc:  # reported below with the rank
            errors[rank] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            with board._cv:
                board.failed = True
                board._cv.notify_all()
        finally:
            if dev.host_clock is not None:
                dev.host_clock.stop()

    threads = [threading.Thread(target=run, args=(r,), name=f"trace-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = min(r for r, e in errors.items() if "another traced rank failed" not in e) \
            if any("another traced rank failed" not in e for e in errors.values()) else min(errors)
        raise TraceError(f"tracing failed on rank {first}: {errors[first]}")
    return [DeviceTrace(r, tuple(devices[r].ops), tuple(devices[r].memory.peaks.items()))
            for r in ranks]
