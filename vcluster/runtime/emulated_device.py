"""``EmulatedDevice``: the :class:`~vcluster.runtime.context.DeviceContext` of the emulator.

It turns each call into one :class:`~vcluster.runtime.collectives.common.GroupCall` run by
the chosen algorithm, records a trace event for it, and keeps the program's issue order
(see :mod:`vcluster.runtime.work`).

Arrays: with ``array_module="numpy"`` a device's arrays are host arrays in shared memory.
With a device module (``cupy``, ``strict``; :mod:`vcluster.runtime.arrays`) its arrays
are device arrays, and a collective either keeps them resident — the ``shm`` algorithm
reading peers' device memory in place (``transport="ipc"``,
:mod:`vcluster.runtime.device_memory`) — or stages them through the host: copied out
before the algorithm and back after it (``transport="host"``, and every message
algorithm), counted in ``d2h_bytes`` / ``h2d_bytes``. Results of collectives and
receives are device arrays on device modules; each trace event says which path ran.
"""

from __future__ import annotations

import math
import operator
import time
from collections import deque
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from . import collectives as C
from .algorithm import AlgorithmSettings, choose_algorithm
from .arguments import check_peer, check_root
from .arrays import ArrayModule
from .channel import USER_KIND, VirtualChannel
from .collectives.common import Group, GroupCall, ReduceOp, scaled_shape
from .collectives.inline import InlinePlan, inline_eligible
from .device_memory import HostSpace
from .errors import ArenaFullError, LeftoverMessagesError
from .events import CommEvent
from .fabric import Fabric
from .layout import INLINE_BYTES
from .recorder import Recorder
from .work import CommQueue, Work

__all__ = ["EmulatedDevice"]

_RESIDENT_MIN_BYTES = 64 * 1024   # results this large are allocated in the arena
_MAX_PLANS = 256                  # inline plans kept per device (a program has a few call sites)

# (collective, algorithm) -> function(call, x, out, **arguments)
_RUNNERS = MappingProxyType({
    ("all_reduce", "shm"): C.shm.all_reduce, ("all_reduce", "ring"): C.messages.ring_all_reduce,
    ("all_reduce", "tree"): C.messages.tree_all_reduce,
    ("all_gather", "shm"): C.shm.all_gather, ("all_gather", "ring"): C.messages.ring_all_gather,
    ("reduce_scatter", "shm"): C.shm.reduce_scatter,
    ("reduce_scatter", "ring"): C.messages.ring_reduce_scatter,
    ("all_to_all", "shm"): C.shm.all_to_all,
    ("all_to_all", "pairwise"): C.messages.pairwise_all_to_all,
    ("broadcast", "shm"): C.shm.broadcast, ("broadcast", "tree"): C.messages.tree_broadcast,
    ("reduce", "shm"): C.shm.reduce, ("reduce", "tree"): C.messages.tree_reduce,
    ("scatter", "shm"): C.shm.scatter, ("scatter", "pairwise"): C.messages.pairwise_scatter,
    ("gather", "shm"): C.shm.gather, ("gather", "pairwise"): C.messages.pairwise_gather,
})


def _local(collective: str, x, out, op=None, root=0, dim=0, **_):
    """A group of one: every collective is a copy (barrier: nothing)."""
    if collective == "barrier":
        return None
    res = x.copy() if out is None else out
    if out is not None and out is not x:
        np.copyto(out, x)
    return res


@dataclass(eq=False)
class _RecvRequest:
    """A posted receive: filled by whichever wait reaches it first."""

    src: int
    tag: int
    out: object
    done: bool = False
    result: object = None


class _ComputeBlock:
    """``with dev.compute(...)``: records a ComputeEvent when the block ends normally.

    A plain class rather than ``contextlib.contextmanager``: a training step enters
    ~130 of these per device, and the generator machinery cost ~3x as much per block.

    On a slow device (an injected fault) a block sleeps for its *own* time times the
    slowdown less one: its elapsed time less that of the blocks nested in it (their own
    sleeps included), so a block inside a block is slowed once, not once per level."""

    __slots__ = ("_dev", "_name", "_flops", "_bytes", "_start", "_slowed")

    def __init__(self, dev: "EmulatedDevice", name, flops, nbytes):
        self._dev, self._name, self._flops, self._bytes = dev, name, flops, nbytes

    def __enter__(self) -> None:
        dev = self._dev
        self._slowed = dev._delays is not None
        if self._slowed:
            dev._nested_s.append(0.0)         # time of the blocks nested in this one
        self._start = time.perf_counter()

    def __exit__(self, exc_type, exc, tb) -> bool:
        dev = self._dev
        if self._slowed:                      # an injected slow device (vcluster.runtime.faults)
            inner_s = dev._nested_s.pop()
            if exc_type is None:
                own_s = time.perf_counter() - self._start - inner_s
                time.sleep(dev._delays.compute_extra_s(max(0.0, own_s)))
            if dev._nested_s:                 # this block, sleep included, is its parent's
                dev._nested_s[-1] += time.perf_counter() - self._start
        if exc_type is not None:
            return False
        dev._recorder.record_compute(str(self._name), float(self._flops), int(self._bytes),
                                     self._start, time.perf_counter())
        if self._slowed:
            dev._pause()                      # an injected jitter, outside the block's time
        return False


class EmulatedDevice:
    """The ``dev`` a per-device program receives on a :class:`VirtualCluster`."""

    def __init__(self, rank: int, mesh, fabric: Fabric, channel: VirtualChannel,
                 recorder: Recorder, arrays: ArrayModule, settings: AlgorithmSettings,
                 space=None):
        self.rank = rank
        self.mesh = mesh
        self._size = mesh.size
        self.index = mesh.index(rank)
        self.xp = arrays.xp
        self._arrays = arrays
        self._device_arrays = arrays.device
        self._host_space = HostSpace(fabric.arenas)
        self._space = space          # device memory peers read in place, or None
        self._f, self._channel, self._recorder = fabric, channel, recorder
        self._settings = settings
        self._groups: dict = {}
        # (collective, axis, op, algorithm[, dtype, shape]) -> InlinePlan, or None where
        # such calls take the general path (collectives.inline)
        self._plans: dict = {}
        self._seq = [0] * (1 << len(mesh.axes))
        self._seen = [0] * len(self._seq)    # per slot: progress every member reached
        self._run_base = list(self._seq)
        self._queue = CommQueue(rank)
        self._posted_recvs: dict[tuple[int, int], deque] = {}   # (src, tag) -> requests
        self._delays = None          # vcluster.runtime.faults.DeviceDelays of injected faults, or None
        self._jitter = None          # the random stream of an injected jitter, or None
        self._nested_s: list = []    # per open compute block on a slow device: nested time

    def __repr__(self) -> str:
        return f"EmulatedDevice(rank={self.rank}, index={self.index!r})"

    # --- memory ---------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32):
        """An uninitialised array in this device's memory that peers can reach:
        collectives read and write it in place, without staging copies.

        numpy: a block of the device's shared-memory arena. Device modules: an
        ``xp`` array; with ``transport="ipc"`` in the device memory its peers open
        (a private device array when that is full or when staging through the host).
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype)
        if self._device_arrays:
            arena = self._space.arenas[self.rank] if self._space is not None else None
            arr = arena.empty(shape, dtype) if arena is not None else None
            return arr if arr is not None else self.xp.empty(shape, dtype)
        if math.prod(shape) == 0:
            return np.empty(shape, dtype)
        arr = self._f.arenas[self.rank].empty(shape, dtype)
        if arr is None:
            raise self._arena_full(shape, dtype, self._f.arenas[self.rank])
        return arr

    def _arena_full(self, shape, dtype, arena) -> ArenaFullError:
        return ArenaFullError(
            f"rank {self.rank}: no room for an array of shape {tuple(shape)} and dtype "
            f"{np.dtype(dtype)}: {arena.shortfall}; release arrays, or "
            "raise VirtualCluster(arena_bytes=...) if you capped it")

    def _alloc(self, shape, dtype, resident: bool) -> np.ndarray:
        """A host array: in this device's shared arena when ``resident`` (or big)."""
        return self._alloc_in(self._host_space, shape, dtype, resident)

    def _alloc_private(self, shape, dtype) -> np.ndarray:
        """A received message's host array (private memory unless it is big)."""
        return self._alloc_in(self._host_space, shape, dtype, False)

    def _device_alloc(self, shape, dtype, resident: bool):
        """A device array of the resident space, likewise."""
        return self._alloc_in(self._space, shape, dtype, resident)

    def _alloc_in(self, space, shape, dtype, resident: bool):
        """An array of ``space``: in this device's arena when ``resident`` or at least
        ``_RESIDENT_MIN_BYTES`` (peers can read it in place), else private memory; a
        resident array that does not fit is an ArenaFullError."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes and (resident or nbytes >= _RESIDENT_MIN_BYTES):
            arena = space.arenas[self.rank]
            arr = arena.empty(shape, dtype)
            if arr is not None:
                return arr
            if resident:
                raise self._arena_full(shape, dtype, arena)
        return space.empty(shape, dtype)

    # --- host/device crossings (device modules) ---------------------------------------
    def _host(self, x):
        """``x`` as a host array (device arrays are copied out: counted in d2h_bytes)."""
        if x is None or isinstance(x, np.ndarray):
            return x
        if self._arrays.is_device(x):
            self._recorder.add_transfer(d2h_bytes=x.nbytes)
            return self._arrays.to_host(x)
        return np.asarray(x)

    def _device(self, x):
        """``x`` as a device array on device modules (host arrays are copied in: h2d)."""
        if x is None or not self._device_arrays or self._arrays.is_device(x):
            return x
        self._recorder.add_transfer(h2d_bytes=x.nbytes)
        return self._arrays.to_device(x)

    def _resident(self, alg: str, group: Group) -> bool:
        """Whether this call keeps device arrays in device memory (no host staging)."""
        return (alg in ("shm", "local") and self._space is not None
                and self._space.available(group.members))

    def _input(self, x):
        """A collective's input as given (host or device array); other values (lists,
        scalars) as host arrays."""
        if x is None or isinstance(x, np.ndarray) or self._arrays.is_device(x):
            return x
        return np.asarray(x)

    # --- compute --------------------------------------------------------------------
    def compute(self, name: str, flops: float = 0, bytes: int = 0,
                gemm: tuple | None = None, kernel=None) -> "_ComputeBlock":
        """Declare the work inside the block: ``flops`` operations touching ``bytes``;
        ``kernel`` (a :class:`~vcluster.runtime.tracing.kernel.Kernel`: kind and shape), or
        ``gemm`` = (batch, m, k, n) when the block is one (batched) GEMM kernel (the tracer
        records it for the timing model; the emulator needs only flops)."""
        if flops < 0 or bytes < 0:
            raise ValueError(f"compute({name!r}): flops and bytes must be >= 0, "
                             f"got flops={flops}, bytes={bytes}")
        return _ComputeBlock(self, name, flops, bytes)

    def record_memory(self, **held_bytes: int) -> None:
        """Say what the program holds now, in bytes per kind (params, grads, optimizer,
        activations); ``cluster.stats()`` reports each kind's peak (``peak_params_bytes``
        ...) since the last ``reset_stats``."""
        self._recorder.record_memory(held_bytes)

    # --- groups ---------------------------------------------------------------------
    def _group(self, axis) -> Group:
        key = axis if isinstance(axis, (str, type(None))) else tuple(axis)
        group = self._groups.get(key)
        if group is None:
            axes = self.mesh.axis_tuple(axis)
            members = self.mesh.group(axes, self.rank)
            slot = sum(1 << self.mesh.axes.index(a) for a in axes)
            group = Group(axes, members, slot, members.index(self.rank))
            self._groups[key] = group
        return group

    def set_delays(self, delays) -> None:
        """Slow this device or its links, or jitter it (a :class:`vcluster.runtime.faults.
        DeviceDelays`; None: off)."""
        self._delays = delays if delays is not None and delays.active else None
        self._jitter = None if self._delays is None else self._delays.jitter_stream()

    def _link_delay(self, peers, start: float) -> None:
        if self._delays is not None:          # an injected slow link (vcluster.runtime.faults)
            time.sleep(self._delays.transfer_extra_s(peers, time.perf_counter() - start))
            self._pause()

    def _pause(self) -> None:
        """An injected jitter's random pause (:class:`vcluster.runtime.faults.JitterFault`):
        taken before and after each send, receive and collective and after each compute
        block, so that the devices meet in a different order from run to run."""
        if self._jitter is not None:
            pause_s = self._delays.jitter_s(self._jitter)
            if pause_s:
                time.sleep(pause_s)

    def reset(self) -> None:
        """Forget call numbers (the host zeroes the shared counters at the same time)."""
        self._seq = [0] * len(self._seq)
        self._seen = [0] * len(self._seq)
        self._posted_recvs = {}
        self._run_base = list(self._seq)

    def begin_run(self) -> None:
        """Mark the start of a run: error messages number calls from here."""
        self._run_base = list(self._seq)

    # --- the collective engine ----------------------------------------------------------
    def _collective(self, name: str, axis, x, out, async_op: bool, algorithm: str, **args):
        group = self._group(axis)
        nbytes = 0 if x is None else x.nbytes
        alg = choose_algorithm(name, nbytes, group.size, self._settings, algorithm)

        def thunk():
            self._pause()
            start = time.perf_counter()
            resident = self._device_arrays and self._resident(alg, group)
            if resident:                # device arrays stay in device memory
                x_in, space, alloc = self._device(x), self._space, self._device_alloc
                out_in = out if out is None or self._arrays.is_device(out) else None
            else:                       # host arrays (device ones staged through the host)
                x_in = self._host(x) if self._device_arrays else x
                out_in = out if out is None or isinstance(out, np.ndarray) else None
                space, alloc = self._host_space, self._alloc
            if alg == "local":
                res = _local(name, x_in, out_in, **args)
                self._recorder.record(CommEvent(self.rank, name, group.members, alg, nbytes,
                                                (), (), 0, start, time.perf_counter(),
                                                space.name))
            else:
                self._seq[group.slot] += 1
                call = GroupCall(self._f, self._channel, group, self._seq[group.slot], name,
                                 alg, alloc, self._run_base[group.slot], space, self._seen)
                if name == "barrier":
                    res = C.shm.barrier(call)
                else:
                    res = _RUNNERS[(name, alg)](call, x_in, out_in, **args)
                call.finish()
                self._link_delay(group.members, start)
                self._recorder.record_later(*call.event_later(nbytes, start, time.perf_counter()))
            if out is not None and out_in is None and res is not None:
                out[...] = self._device(res)
                return out
            return res if resident else self._device(res)

        if async_op:
            work = Work(self._f.check_abort, future=self._queue.submit(thunk))
            # Give the GIL away for a moment so the communication thread starts the
            # collective now, not when this thread next blocks: overlap is real.
            time.sleep(0)
            return work
        if self._queue.idle():
            return thunk()
        return Work(self._f.check_abort, future=self._queue.submit(thunk)).wait()

    def synchronize(self) -> None:
        """Wait for every queued operation and post every buffered send (the end of each
        run does this, so no message is left behind in this process)."""
        self._queue.drain(self._f.check_abort)
        self._channel.flush()

    def check_clean(self) -> None:
        """Raise :class:`LeftoverMessagesError` when this device ends a run holding
        point-to-point state: a receive posted with ``irecv`` that no wait completed, or a
        message that arrived and no receive took. Either would be matched by the next
        run's receive of the same (source, tag) — its data silently replaced by stale data —
        so the run that leaves it fails instead (messages still in a mailbox are the
        host's check, once every device has finished)."""
        lines = [f"{len(queue)} receive(s) from rank {src} (tag {tag}) posted with irecv "
                 "and never waited for" for (src, tag), queue in self._posted_recvs.items()
                 if queue]
        lines += self._channel.leftovers()
        if lines:
            raise LeftoverMessagesError(
                f"rank {self.rank}: the run ended with " + "; ".join(lines) + " — every "
                "message must be received, and every irecv waited for, in the run that "
                "posts it")

    def close(self) -> None:
        self._queue.shutdown()

    # --- small calls: a plan per call site (collectives.inline) -------------------------
    def _inline_plan(self, name: str, axis, x, op, algorithm) -> InlinePlan | None:
        """The plan of a blocking inline ``name`` call of this signature, or None when it
        takes the general path: device arrays, injected delays, queued asynchronous
        operations (issue order), another algorithm, a group of one, or an ``x`` that
        :func:`inline_eligible` refuses."""
        if self._device_arrays or self._delays is not None or not self._queue.idle():
            return None
        key = (name, axis, op, algorithm) if x is None else \
            (name, axis, op, algorithm, x.dtype, x.shape)
        try:
            return self._plans[key]
        except KeyError:
            pass
        except TypeError:                  # an unhashable axis (a list) or op
            return None
        plan = self._new_plan(name, axis, x, op, algorithm)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _new_plan(self, name: str, axis, x, op, algorithm) -> InlinePlan | None:
        """Build the plan; errors (a bad op, axis or algorithm) are raised in the general
        path's order: op, then axis, then algorithm."""
        if x is not None and not inline_eligible(x):
            return None
        rop = ReduceOp.parse(op, x.dtype) if name == "all_reduce" else None
        group = self._group(axis)
        nbytes = 0 if x is None else x.nbytes
        if choose_algorithm(name, nbytes, group.size, self._settings, algorithm) != "shm":
            return None
        if x is None:
            return InlinePlan(self._f, group, name)
        return InlinePlan(self._f, group, name, x.dtype, x.shape, rop)

    def _run_inline(self, plan: InlinePlan, x, out):
        """One call by its plan: counted, run, recorded like ``_collective``'s."""
        start = time.perf_counter()
        slot = plan.slot
        s = self._seq[slot] + 1
        self._seq[slot] = s
        res = plan.run(s, x, out, self._seen, self._run_base[slot], self._alloc)
        self._recorder.record_later(*plan.event_later(s, start, time.perf_counter()))
        return res

    # --- collectives ----------------------------------------------------------------
    def all_reduce(self, x, axis=None, op="sum", *, out=None, async_op=False, algorithm="auto"):
        if (type(x) is np.ndarray and x.nbytes <= INLINE_BYTES and not async_op
                and (out is None or type(out) is np.ndarray)):
            plan = self._inline_plan("all_reduce", axis, x, op, algorithm)
            if plan is not None:
                return self._run_inline(plan, x, out)
        x = self._input(x)
        return self._collective("all_reduce", axis, x, out, async_op, algorithm,
                                op=ReduceOp.parse(op, x.dtype))

    def all_gather(self, x, axis=None, dim=0, *, out=None, async_op=False, algorithm="auto"):
        x = self._input(x)
        scaled_shape(x.shape, dim, 1, False, "all_gather")
        return self._collective("all_gather", axis, x, out, async_op, algorithm, dim=dim)

    def reduce_scatter(self, x, axis=None, dim=0, op="sum", *, out=None, async_op=False,
                       algorithm="auto"):
        x = self._input(x)
        scaled_shape(x.shape, dim, self._group(axis).size, True, "reduce_scatter")
        return self._collective("reduce_scatter", axis, x, out, async_op, algorithm, dim=dim,
                                op=ReduceOp.parse(op, x.dtype))

    def all_to_all(self, x, axis=None, split_dim=0, concat_dim=0, *, out=None,
                   async_op=False, algorithm="auto"):
        x = self._input(x)
        scaled_shape(x.shape, split_dim, self._group(axis).size, True, "all_to_all")
        scaled_shape(x.shape, concat_dim, 1, False, "all_to_all")
        return self._collective("all_to_all", axis, x, out, async_op, algorithm,
                                split_dim=split_dim, concat_dim=concat_dim)

    def broadcast(self, x, axis=None, root=0, *, out=None, async_op=False, algorithm="auto"):
        root = self._root(axis, root, "broadcast")
        x = self._input(x) if self._group(axis).position == root else None
        self._need_root_input("broadcast", axis, root, x)
        return self._collective("broadcast", axis, x, out, async_op, algorithm, root=root)

    def scatter(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
                algorithm="auto"):
        root = self._root(axis, root, "scatter")
        x = self._input(x) if self._group(axis).position == root else None
        self._need_root_input("scatter", axis, root, x)
        if x is not None:
            scaled_shape(x.shape, dim, self._group(axis).size, True, "scatter")
        return self._collective("scatter", axis, x, out, async_op, algorithm, root=root,
                                dim=dim)

    def gather(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
               algorithm="auto"):
        root = self._root(axis, root, "gather")
        x = self._input(x)
        scaled_shape(x.shape, dim, 1, False, "gather")
        return self._collective("gather", axis, x, out, async_op, algorithm, root=root, dim=dim)

    def reduce(self, x, axis=None, root=0, op="sum", *, out=None, async_op=False,
               algorithm="auto"):
        root = self._root(axis, root, "reduce")
        x = self._input(x)
        return self._collective("reduce", axis, x, out, async_op, algorithm, root=root,
                                op=ReduceOp.parse(op, x.dtype))

    def barrier(self, axis=None, *, async_op=False, algorithm="auto"):
        if not async_op:
            plan = self._inline_plan("barrier", axis, None, None, algorithm)
            if plan is not None:
                return self._run_inline(plan, None, None)
        return self._collective("barrier", axis, None, None, async_op, algorithm)

    def _root(self, axis, root, what: str) -> int:
        return check_root(root, self._group(axis).size, what)

    def _need_root_input(self, what: str, axis, root: int, x) -> None:
        if self._group(axis).position == root and x is None:
            raise ValueError(f"{what}: the root (rank {self.rank}) must pass an array, got None")

    # --- point to point -------------------------------------------------------------
    def _peer(self, peer, what: str) -> int:
        if type(peer) is int and 0 <= peer < self._size:    # the common case, no call
            return peer
        return check_peer(peer, self._size, what)

    @staticmethod
    def _tag(tag) -> int:
        if type(tag) is not int:
            tag = operator.index(tag)
        if not 0 <= tag < 2**62:
            raise ValueError(f"tag must be an int in [0, 2**62), got {tag}")
        return tag

    def _p2p_event(self, name, peer, x, tag, start, sent) -> None:
        """The call's CommEvent, built when the events are read (like compute events):
        a pipeline step sends and receives ~16 messages per device, and building each
        frozen dataclass at once was ~2 us of a ~15 us send."""
        nbytes = x.nbytes
        pair = ((peer, nbytes, 1),) if peer != self.rank else ()
        self._recorder.record_later(CommEvent, (self.rank, name, (self.rank, peer), "p2p",
                                                nbytes, pair if sent else (),
                                                () if sent else pair, tag, start,
                                                time.perf_counter()))

    def send(self, x, to: int, tag: int = 0) -> None:
        """Send ``x`` to global rank ``to``; returns once the payload is copied out."""
        to, tag, x = self._peer(to, "send"), self._tag(tag), self._host(x)
        self._pause()
        start = time.perf_counter()
        self._channel.send_buffered(to, USER_KIND, tag, x)
        if self._delays is not None:
            self._link_delay(to, start)
        self._p2p_event("send", to, x, tag, start, True)

    def isend(self, x, to: int, tag: int = 0) -> Work:
        """Start sending ``x``; keep it unchanged until ``wait()`` (zero-copy from the arena)."""
        to, tag, x = self._peer(to, "isend"), self._tag(tag), self._host(x)
        self._pause()
        start = time.perf_counter()
        handle = self._channel.isend(to, USER_KIND, tag, x)

        def finish(_):
            handle.wait()
            self._p2p_event("send", to, x, tag, start, True)

        return Work(self._f.check_abort, after=finish)

    def iprobe(self, src: int, tag: int = 0) -> bool:
        """Whether a message from ``src`` with ``tag`` is waiting to be received (never
        blocks; a later ``recv`` takes it). Receives already posted for (src, tag) with
        ``irecv`` have the first claim on such messages."""
        src, tag = self._peer(src, "iprobe"), self._tag(tag)
        if self._posted_recvs.get((src, tag)):
            return False
        return self._channel.probe(src, USER_KIND, tag)

    def recv(self, src: int, tag: int = 0, *, out=None):
        """Receive the next message from ``src`` with ``tag`` (after earlier irecvs)."""
        src, tag = self._peer(src, "recv"), self._tag(tag)
        if (src, tag) not in self._posted_recvs:     # no irecv of (src, tag) comes first
            return self._receive_now(src, tag, out)
        return self._complete(self._post_recv(src, tag, out, "recv"))

    def irecv(self, src: int, tag: int = 0, *, out=None) -> Work:
        """Post a receive now; ``wait()`` returns its array. Receives of one (src, tag)
        match messages in the order they were posted, whatever order they are waited in."""
        request = self._post_recv(src, tag, out, "irecv")
        return Work(self._f.check_abort, resolve=lambda: self._complete(request))

    def _post_recv(self, src, tag, out, what: str) -> "_RecvRequest":
        src, tag = self._peer(src, what), self._tag(tag)
        request = _RecvRequest(src, tag, out)
        self._posted_recvs.setdefault((src, tag), deque()).append(request)
        return request

    def _complete(self, request: "_RecvRequest"):
        """Receive messages for the posted requests of (src, tag), oldest first, until
        ``request`` has its own."""
        if request.done:
            return request.result
        key = (request.src, request.tag)
        queue = self._posted_recvs[key]
        while not request.done:
            head = queue[0]
            head.result = self._receive_now(head.src, head.tag, head.out)
            head.done = True
            queue.popleft()
        if not queue:
            del self._posted_recvs[key]
        return request.result

    def _receive_now(self, src: int, tag: int, out):
        self._pause()
        start = time.perf_counter()
        host_out = out if out is None or isinstance(out, np.ndarray) else None
        res = self._channel.recv_into(src, USER_KIND, tag, f"recv (tag {tag})", host_out,
                                      self._alloc_private)
        if self._delays is not None:
            self._link_delay(src, start)
        self._p2p_event("recv", src, res, tag, start, False)
        if out is not None and host_out is None:
            out[...] = self._device(res)
            return out
        return self._device(res)
