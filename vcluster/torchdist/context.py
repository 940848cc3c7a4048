"""``TorchDeviceContext``: the :class:`~vcluster.runtime.context.DeviceContext` on
torch.distributed.

Programs see numpy arrays in and out, exactly as on the emulator; each call becomes one
torch.distributed call on the process group of its mesh axes (gloo on CPU, NCCL when
CUDA is available, where tensors are staged on this rank's GPU). Mapping:

================  ==============================================================
all_reduce        ``all_reduce`` on a copy (``avg``: the sum divided by the group size)
all_gather        ``all_gather`` into a list; pieces concatenated along dim in mesh order
reduce_scatter    ``reduce_scatter`` of the pieces along dim (piece j for member j)
all_to_all        ``all_to_all`` of the pieces along split_dim; concatenated along concat_dim
broadcast         a header (dtype, shape) then ``broadcast`` from the root's global rank
scatter           a header then ``scatter`` of the root's pieces
gather / reduce   ``gather`` / ``reduce`` to the root; None elsewhere
send / recv       ``isend``/``irecv`` of a header on tag 2t and the payload on tag 2t+1
barrier           ``barrier`` on the group
================  ==============================================================

torch orders a group's members by global rank; the mesh by coordinates along the axes.
Piece lists are permuted between the two, so ``root`` is a position in the mesh's order
and concatenations follow it, as the protocol says. ``algorithm=`` accepts the
emulator's names and is otherwise ignored: the backend picks its own algorithm.
Point to point: :mod:`vcluster.torchdist.p2p`; dtypes, headers, ``TorchWork``:
:mod:`vcluster.torchdist.tensors`.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager

import numpy as np

from vcluster.runtime.arguments import check_root
from vcluster.runtime.collectives.common import ReduceOp, scaled_shape
from vcluster.runtime.errors import CollectiveTimeout
from vcluster.runtime.events import CommEvent, ComputeEvent
from vcluster.runtime.recorder import MemoryPeaks

from .p2p import PointToPoint
from .tensors import TorchWork, check_dtype, encode_header, parse_header, to_wire

__all__ = ["TorchDeviceContext", "TorchWork", "ALGORITHM_NAMES"]

ALGORITHM_NAMES = ("auto", "ring", "tree", "pairwise", "shm")
def _parse_op(op, dtype: np.dtype) -> ReduceOp:
    """The emulator's op rules, plus: complex tensors travel as (re, im) pairs, so only
    componentwise reductions (sum, avg) are defined for them here."""
    parsed = ReduceOp.parse(op, dtype)
    if np.issubdtype(dtype, np.complexfloating) and parsed not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"op={parsed.value!r} on {dtype} is not supported by the torch engine "
                        "(complex reductions: 'sum', 'avg')")
    return parsed


class TorchDeviceContext(PointToPoint):
    """The ``dev`` a per-device program receives on a torch.distributed rank.

    ``groups`` maps the sorted member tuple of every group this rank belongs to (the
    whole world included) to its torch process group; ``device`` is where tensors are
    staged ("cpu" for gloo, "cuda:i" for NCCL).
    """

    def __init__(self, rank: int, mesh, groups: dict, device: str = "cpu"):
        import torch
        import torch.distributed as dist
        self._torch, self._dist = torch, dist
        self.rank = rank
        self.mesh = mesh
        self.index = mesh.index(rank)
        self.xp = np
        self.device = device
        self._torch_groups = dict(groups)
        self._groups: dict = {}
        self._pending_sends: list = []
        self._posted_recvs: dict[tuple[int, int], deque] = {}
        self.events: list = []
        self.memory = MemoryPeaks()
        self._backend = "nccl" if device.startswith("cuda") else "gloo"

    def __repr__(self) -> str:
        return f"TorchDeviceContext(rank={self.rank}, index={self.index!r}, device={self.device!r})"

    # --- memory and compute -------------------------------------------------------
    def empty(self, shape, dtype=np.float32):
        """An uninitialised host array (torch stages it for the backend as needed)."""
        return np.empty((shape,) if isinstance(shape, int) else tuple(shape), np.dtype(dtype))

    @contextmanager
    def compute(self, name: str, flops: float = 0, bytes: int = 0, gemm=None, kernel=None):
        """Declare the work inside the block (recorded in ``self.events`` per run)."""
        if flops < 0 or bytes < 0:
            raise ValueError(f"compute({name!r}): flops and bytes must be >= 0, "
                             f"got flops={flops}, bytes={bytes}")
        start = time.perf_counter()
        yield
        self.events.append(ComputeEvent(self.rank, str(name), float(flops), int(bytes),
                                        start, time.perf_counter()))

    def record_memory(self, **held_bytes: int) -> None:
        """Keep the peak of each kind held (``self.memory``, until ``reset_stats``)."""
        self.memory.record(held_bytes)

    def reset_stats(self) -> None:
        """Forget the recorded events and memory peaks."""
        self.events = []
        self.memory = MemoryPeaks()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait for every pending (buffered) send of this run."""
        sends, self._pending_sends = self._pending_sends, []
        for work in sends:
            work.wait(timeout_s)

    # --- groups and tensors ---------------------------------------------------------
    def _group(self, axis):
        """(mesh-ordered members, torch group or None for a group of one, torch order)."""
        key = axis if isinstance(axis, (str, type(None))) else tuple(axis)
        if key not in self._groups:
            members = self.mesh.group(self.mesh.axis_tuple(axis), self.rank)
            order = tuple(sorted(members))
            pg = self._torch_groups[order] if len(members) > 1 else None
            self._groups[key] = (members, pg, order)
        return self._groups[key]

    def _tensor(self, x: np.ndarray):
        """A torch tensor on the backend's device holding a private copy of ``x``."""
        arr = np.array(x, order="C", copy=True)
        check_dtype(arr.dtype, self.rank)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        t = self._torch.from_numpy(arr)
        return t if self.device == "cpu" else t.to(self.device)

    def _empty_tensor(self, shape, dtype):
        t = self._torch.empty(tuple(shape), dtype=self._torch.from_numpy(
            np.empty(0, np.dtype(dtype))).dtype)
        return t if self.device == "cpu" else t.to(self.device)

    @staticmethod
    def _numpy(t) -> np.ndarray:
        return t.detach().cpu().numpy()

    def _op(self, op: ReduceOp):
        R = self._dist.ReduceOp
        return {ReduceOp.SUM: R.SUM, ReduceOp.PROD: R.PRODUCT, ReduceOp.MAX: R.MAX,
                ReduceOp.MIN: R.MIN, ReduceOp.AVG: R.SUM}[op]

    @staticmethod
    def _check_algorithm(algorithm, name: str) -> None:
        if algorithm not in ALGORITHM_NAMES:
            raise ValueError(f"{name}: algorithm must be one of {ALGORITHM_NAMES} (the torch "
                             f"engine lets the backend choose), got {algorithm!r}")

    def _deliver(self, res, out):
        """Write ``res`` into ``out`` when given (and return it), else return ``res``."""
        if res is None or out is None:
            return res
        if out.shape != res.shape:
            raise ValueError(f"rank {self.rank}: out= has shape {out.shape}, the result has "
                             f"shape {res.shape}")
        np.copyto(out, res, casting="unsafe")
        return out

    def _issue(self, name, axis, works, finish, async_op: bool, nbytes: int = 0):
        """A TorchWork that finishes the call and records its CommEvent (issue to
        completion; per-peer bytes are the backend's business and are not reported)."""
        members = self._group(axis)[0]
        start = time.perf_counter()

        def describe():
            return f"rank {self.rank}: {name} over group {list(members)} (axis={axis!r})"

        def done():
            res = finish()
            self.events.append(CommEvent(self.rank, name, tuple(members), self._backend,
                                         int(nbytes), (), (), 0, start, time.perf_counter()))
            return res

        work = TorchWork(works, done, describe)
        return work if async_op else work.wait()

    def _call(self, name, axis, fn):
        """Run ``fn()`` (issuing torch calls); name this rank and group on failure."""
        try:
            return fn()
        except RuntimeError as exc:
            members = self._group(axis)[0]
            raise CollectiveTimeout(f"rank {self.rank}: {name} over group {list(members)} "
                                    f"(axis={axis!r}) failed or timed out: {exc}") from exc

    # --- collectives ----------------------------------------------------------------
    def all_reduce(self, x, axis=None, op="sum", *, out=None, async_op=False, algorithm="auto"):
        self._check_algorithm(algorithm, "all_reduce")
        x = np.asarray(x)
        op = _parse_op(op, x.dtype)
        members, pg, _ = self._group(axis)
        if pg is None:
            return self._issue("all_reduce", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        t = self._tensor(x)
        work = self._call("all_reduce", axis, lambda: self._dist.all_reduce(
            to_wire(t), op=self._op(op), group=pg, async_op=True))

        def finish():
            res = self._numpy(t)
            if op is ReduceOp.AVG:
                res = np.true_divide(res, len(members), casting="unsafe").astype(res.dtype)
            return self._deliver(res, out)
        return self._issue("all_reduce", axis, [work], finish, async_op, x.nbytes)

    def all_gather(self, x, axis=None, dim=0, *, out=None, async_op=False, algorithm="auto"):
        self._check_algorithm(algorithm, "all_gather")
        x = np.asarray(x)
        scaled_shape(x.shape, dim, 1, False, "all_gather")
        members, pg, order = self._group(axis)
        if pg is None:
            return self._issue("all_gather", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        t = self._tensor(x)
        got = [self._empty_tensor(x.shape, x.dtype) for _ in order]
        work = self._call("all_gather", axis, lambda: self._dist.all_gather(
            [to_wire(g) for g in got], to_wire(t), group=pg, async_op=True))

        def finish():
            pieces = [self._numpy(got[order.index(m)]) for m in members]
            return self._deliver(np.concatenate(pieces, axis=dim), out)
        return self._issue("all_gather", axis, [work], finish, async_op, x.nbytes)

    def reduce_scatter(self, x, axis=None, dim=0, op="sum", *, out=None, async_op=False,
                       algorithm="auto"):
        self._check_algorithm(algorithm, "reduce_scatter")
        x = np.asarray(x)
        op = _parse_op(op, x.dtype)
        members, pg, order = self._group(axis)
        piece_shape = scaled_shape(x.shape, dim, len(members), True, "reduce_scatter")
        if pg is None:
            return self._issue("reduce_scatter", axis, [],
                               lambda: self._deliver(x.copy(), out), async_op)
        pieces = np.split(x, len(members), axis=dim)
        send = [self._tensor(pieces[members.index(g)]) for g in order]
        t = self._empty_tensor(piece_shape, x.dtype)
        work = self._call("reduce_scatter", axis, lambda: self._dist.reduce_scatter(
            to_wire(t), [to_wire(p) for p in send], op=self._op(op), group=pg, async_op=True))

        def finish():
            res = self._numpy(t)
            if op is ReduceOp.AVG:
                res = np.true_divide(res, len(members), casting="unsafe").astype(res.dtype)
            return self._deliver(res, out)
        return self._issue("reduce_scatter", axis, [work], finish, async_op, x.nbytes)

    def all_to_all(self, x, axis=None, split_dim=0, concat_dim=0, *, out=None,
                   async_op=False, algorithm="auto"):
        self._check_algorithm(algorithm, "all_to_all")
        x = np.asarray(x)
        members, pg, order = self._group(axis)
        scaled_shape(x.shape, split_dim, len(members), True, "all_to_all")
        scaled_shape(x.shape, concat_dim, 1, False, "all_to_all")
        if pg is None:
            return self._issue("all_to_all", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        pieces = np.split(x, len(members), axis=split_dim)
        send = [self._tensor(pieces[members.index(g)]) for g in order]
        got = [self._empty_tensor(pieces[0].shape, x.dtype) for _ in order]
        work = self._call("all_to_all", axis, lambda: self._dist.all_to_all(
            [to_wire(g) for g in got], [to_wire(p) for p in send], group=pg, async_op=True))

        def finish():
            parts = [self._numpy(got[order.index(m)]) for m in members]
            return self._deliver(np.concatenate(parts, axis=concat_dim), out)
        return self._issue("all_to_all", axis, [work], finish, async_op, x.nbytes)

    def broadcast(self, x, axis=None, root=0, *, out=None, async_op=False, algorithm="auto"):
        self._check_algorithm(algorithm, "broadcast")
        members, pg, _ = self._group(axis)
        root = self._root(axis, root, "broadcast")
        mine = members.index(self.rank) == root
        x = np.asarray(x) if mine and x is not None else None
        self._need_root_input("broadcast", root, mine, x)
        if pg is None:
            return self._issue("broadcast", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        shape, dtype = self._bcast_header(axis, pg, members[root], x)
        t = self._tensor(x) if mine else self._empty_tensor(shape, dtype)
        work = self._call("broadcast", axis, lambda: self._dist.broadcast(
            to_wire(t), src=members[root], group=pg, async_op=True))
        return self._issue("broadcast", axis, [work], lambda: self._deliver(self._numpy(t), out),
                           async_op, t.numel() * t.element_size())

    def _bcast_header(self, axis, pg, src: int, x):
        """(shape, dtype) of the root's array, for members that must allocate for it."""
        h = self._tensor(encode_header(x, self.rank))
        self._call("broadcast header", axis, lambda: self._dist.broadcast(h, src=src, group=pg))
        return parse_header(self._numpy(h))

    def scatter(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
                algorithm="auto"):
        self._check_algorithm(algorithm, "scatter")
        members, pg, order = self._group(axis)
        root = self._root(axis, root, "scatter")
        mine = members.index(self.rank) == root
        x = np.asarray(x) if mine and x is not None else None
        self._need_root_input("scatter", root, mine, x)
        pieces = None
        if mine:
            scaled_shape(x.shape, dim, len(members), True, "scatter")
            pieces = np.split(x, len(members), axis=dim)
        if pg is None:
            return self._issue("scatter", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        shape, dtype = self._bcast_header(axis, pg, members[root], pieces[0] if mine else None)
        t = self._empty_tensor(shape, dtype)
        send = [self._tensor(pieces[members.index(g)]) for g in order] if mine else None
        work = self._call("scatter", axis, lambda: self._dist.scatter(
            to_wire(t), send and [to_wire(p) for p in send], src=members[root], group=pg, async_op=True))
        return self._issue("scatter", axis, [work], lambda: self._deliver(self._numpy(t), out),
                           async_op, t.numel() * t.element_size())

    def gather(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
               algorithm="auto"):
        self._check_algorithm(algorithm, "gather")
        x = np.asarray(x)
        members, pg, order = self._group(axis)
        root = self._root(axis, root, "gather")
        scaled_shape(x.shape, dim, 1, False, "gather")
        mine = members.index(self.rank) == root
        if pg is None:
            return self._issue("gather", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        t = self._tensor(x)
        got = [self._empty_tensor(x.shape, x.dtype) for _ in order] if mine else None
        work = self._call("gather", axis, lambda: self._dist.gather(
            to_wire(t), got and [to_wire(g) for g in got], dst=members[root], group=pg, async_op=True))

        def finish():
            if not mine:
                return None
            pieces = [self._numpy(got[order.index(m)]) for m in members]
            return self._deliver(np.concatenate(pieces, axis=dim), out)
        return self._issue("gather", axis, [work], finish, async_op, x.nbytes)

    def reduce(self, x, axis=None, root=0, op="sum", *, out=None, async_op=False,
               algorithm="auto"):
        self._check_algorithm(algorithm, "reduce")
        x = np.asarray(x)
        op = _parse_op(op, x.dtype)
        members, pg, _ = self._group(axis)
        root = self._root(axis, root, "reduce")
        mine = members.index(self.rank) == root
        if pg is None:
            return self._issue("reduce", axis, [], lambda: self._deliver(x.copy(), out),
                               async_op)
        t = self._tensor(x)
        work = self._call("reduce", axis, lambda: self._dist.reduce(
            to_wire(t), dst=members[root], op=self._op(op), group=pg, async_op=True))

        def finish():
            if not mine:
                return None
            res = self._numpy(t)
            if op is ReduceOp.AVG:
                res = np.true_divide(res, len(members), casting="unsafe").astype(res.dtype)
            return self._deliver(res, out)
        return self._issue("reduce", axis, [work], finish, async_op, x.nbytes)

    def barrier(self, axis=None, *, async_op=False, algorithm="auto"):
        self._check_algorithm(algorithm, "barrier")
        _, pg, _ = self._group(axis)
        if pg is None:
            return self._issue("barrier", axis, [], lambda: None, async_op)
        work = self._call("barrier", axis, lambda: self._dist.barrier(group=pg, async_op=True))
        return self._issue("barrier", axis, [work], lambda: None, async_op)

    def _root(self, axis, root, what: str) -> int:
        return check_root(root, len(self._group(axis)[0]), what)

    def _need_root_input(self, what: str, root: int, mine: bool, x) -> None:
        if mine and x is None:
            raise ValueError(f"{what}: the root (rank {self.rank}) must pass an array, got None")
