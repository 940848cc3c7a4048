"""What every collective algorithm shares: groups, op codes, reductions, one call's state.

A collective call on a group is numbered per (member, group slot): the s-th call on a
slot is call s on every member, because SPMD programs issue the same collectives in the
same order. Members announce progress through ``progress[rank, slot] = 4 s + phase``
(phase 1: my descriptor is published; phase 2: I am done with my peers' buffers), and
publish a descriptor (op, dtype, shape, where their buffers are) at parity s mod 2, so
call s + 1 can start while a slow member still reads call s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

import numpy as np

from ..errors import ArenaFullError, CollectiveMismatch
from ..events import CommEvent
from ..device_memory import HostSpace
from ..fabric import Fabric
from ..layout import D, INLINE_BYTES, MAX_NDIM, decode_dtype, encode_dtype

__all__ = ["Group", "OP_CODES", "op_name", "ReduceOp", "GroupCall", "reduce_into", "reduce_rows",
           "split_bounds", "scaled_shape", "describe_wait", "call_event"]

OP_CODES = MappingProxyType({"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3,
                             "all_to_all": 4, "broadcast": 5, "scatter": 6, "gather": 7,
                             "reduce": 8, "barrier": 9})
_OP_NAMES = MappingProxyType({v: k for k, v in OP_CODES.items()})


def op_name(code: int) -> str:
    """The collective of an op code (``OP_CODES``), or "op N" for an unknown one."""
    return _OP_NAMES.get(int(code), f"op {int(code)}")
_BLOCK_BYTES = 256 * 1024   # reduction block: stays in L2 while it is combined


@dataclass(frozen=True)
class Group:
    """The ordered members of one collective group, from one member's point of view."""

    axes: tuple[str, ...]
    members: tuple[int, ...]
    slot: int        # bitmask of the axes over the mesh's axes: same on every member
    position: int    # this member's place in ``members``

    @property
    def size(self) -> int:
        return len(self.members)


class ReduceOp(Enum):
    """Elementwise reductions; ``avg`` is the sum divided by the group size."""

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"

    @classmethod
    def parse(cls, op, dtype: np.dtype) -> "ReduceOp":
        try:
            parsed = op if isinstance(op, ReduceOp) else \
                (type(op) is str and _BY_NAME.get(op)) or cls(str(op).lower())
        except ValueError:
            raise ValueError(f"op must be one of {[o.value for o in cls]}, got {op!r}") from None
        if parsed is cls.AVG and not np.issubdtype(dtype, np.inexact):
            raise TypeError(f"op='avg' needs a floating or complex dtype, got {dtype}")
        return parsed

    @property
    def ufunc(self) -> np.ufunc:
        return _UFUNCS[self]

    @property
    def code(self) -> int:
        return _CODES[self]


_UFUNCS = MappingProxyType({ReduceOp.SUM: np.add, ReduceOp.AVG: np.add,
                            ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum,
                            ReduceOp.MIN: np.minimum})
_CODES = MappingProxyType({op: i + 1 for i, op in enumerate(ReduceOp)})
_BY_NAME = MappingProxyType({op.value: op for op in ReduceOp})   # "sum" -> SUM, without Enum lookup


def reduce_into(dests: list[np.ndarray], sources: list[np.ndarray], op: ReduceOp,
                divisor: int, scratch: np.ndarray | None = None) -> None:
    """dests[*] = (((s0 op s1) op s2) ... ) [/ divisor], combined in list order.

    Contiguous 1-D host operands are processed block by block so the partial result stays
    in cache while it is combined and copied to every destination. Two operands (and no
    average) are combined straight into the first destination's block and copied from
    there: no scratch block, one pass fewer. numpy's ufuncs handle an output that is also
    an input (an all-reduce in place); with more operands a destination may be a later
    operand, so the fold goes through scratch. A 2-member all-reduce's 132 KiB halves
    (the width-128 MLP's DDP bucket, issue 32): 15.2 -> 7.1 us.
    """
    uf = op.ufunc
    direct = len(sources) == 2 and op is not ReduceOp.AVG
    if direct and sources[0].nbytes <= _BLOCK_BYTES:      # one block: no loop to set up
        uf(sources[0], sources[1], out=dests[0])
        for d in dests[1:]:
            np.copyto(d, dests[0])
        return
    flat = all(a.ndim == 1 for a in sources + dests)
    n = sources[0].size
    # host arrays go block by block (cache); device arrays in one kernel per operand
    on_host = isinstance(sources[0], np.ndarray)
    step = max(1, _BLOCK_BYTES // max(1, sources[0].itemsize)) if flat and on_host else max(n, 1)
    if not direct and (scratch is None or scratch.size < min(step, n)):
        scratch = np.empty_like(sources[0], shape=min(step, n) if flat else sources[0].shape)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        part = (lambda a: a[lo:hi]) if flat else (lambda a: a)
        if direct:
            tmp, others = part(dests[0]), dests[1:]
            uf(part(sources[0]), part(sources[1]), out=tmp)
        else:
            tmp, others = (scratch[:hi - lo] if flat else scratch), dests
            if len(sources) == 1:
                np.copyto(tmp, part(sources[0]))
            else:
                uf(part(sources[0]), part(sources[1]), out=tmp)
                for s in sources[2:]:
                    uf(tmp, part(s), out=tmp)
            if op is ReduceOp.AVG:
                np.true_divide(tmp, divisor, out=tmp, casting="unsafe")
        for d in others:
            np.copyto(part(d), tmp)


def reduce_rows(res: np.ndarray | None, rows: np.ndarray, op: ReduceOp,
                divisor: int) -> np.ndarray | None:
    """res = (((rows[0] op rows[1]) op rows[2]) ... ) [/ divisor], in one numpy call.

    ``ufunc.accumulate`` along axis 0 computes ``acc[i] = acc[i-1] op rows[i]``, strictly in
    row order, with the same elementwise loop as ``reduce_into``'s left fold, so the result
    is bit for bit the same (``ufunc.reduce`` is not: it may sum a contiguous axis
    pairwise). Complex products are the exception (numpy's binary loop may fuse
    multiply-adds where accumulate does not): for complex dtypes nothing is done and None
    returned, and the caller folds with ``reduce_into``. ``rows``: (members, elements),
    host memory; ``res``: any array of rows.shape[1] elements, or None for a new 1-D one.
    Returns the result.
    """
    if rows.dtype.kind == "c":
        return None
    acc = op.ufunc.accumulate(rows, axis=0, dtype=rows.dtype)[-1].copy()   # (elements,)
    if op is ReduceOp.AVG:
        np.true_divide(acc, divisor, out=acc, casting="unsafe")
    if res is None:
        return acc
    np.copyto(res, acc.reshape(res.shape))
    return res


def _from_all(rank: int, members: tuple, nbytes: int) -> dict:
    """peer -> [nbytes, 1 message] for every member but ``rank``."""
    return {m: [nbytes, 1] for m in members if m != rank}


def call_event(rank: int, collective: str, members: tuple, algorithm: str, nbytes: int,
                sent: dict, received: dict, received_from_all: int, seq: int, start: float,
                end: float, transport: str) -> CommEvent:
    """A collective call's :class:`CommEvent` from its counts (``GroupCall.event_later``)."""
    if received_from_all >= 0:
        received = {**received, **_from_all(rank, members, received_from_all)}
    return CommEvent.from_counts(rank, collective, members, algorithm, nbytes, sent, received,
                                 seq, start, end, transport)


def split_bounds(n_items: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of ``parts`` nearly equal pieces (the first n_items % parts get one more)."""
    base, extra = divmod(n_items, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def scaled_shape(shape: tuple, dim: int, factor: int, divide: bool, what: str) -> tuple:
    """``shape`` with ``shape[dim]`` multiplied (or divided, which must be exact) by factor."""
    shape = tuple(shape)
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"{what}: dim={dim} is out of range for an array of shape {shape}")
    dim %= len(shape)
    size = shape[dim]
    if divide:
        if size % factor:
            raise ValueError(f"{what}: dimension {dim} of size {size} does not split evenly "
                             f"into {factor} pieces (the group size)")
        new = size // factor
    else:
        new = size * factor
    return shape[:dim] + (new,) + shape[dim + 1:]


def describe_wait(f: Fabric, group: Group, target: int, collective: str, number: int,
                  run_base: int, why: str) -> str:
    """Who a member of ``group`` waits for (progress below ``target``) and how far they
    got: the tail of the CollectiveTimeout a wait raises."""
    slot, members = group.slot, group.members
    late = [m for m in members if f.progress[m, slot] < target]
    at = {m: int(f.progress[m, slot]) // 4 - run_base for m in late}
    return (f"in {collective} (call #{number} over axes {group.axes}, "
            f"group {members}) waiting for rank(s) {late}{' ' + why if why else ''}; "
            f"they have finished {sorted(set(at.values()))} call(s) on this group "
            "in this run")


class GroupCall:
    """One member's side of one collective call: descriptors, phases, byte accounting."""

    def __init__(self, fabric: Fabric, channel, group: Group, seq: int, collective: str,
                 algorithm: str, alloc, run_base: int = 0, space=None,
                 seen: list[int] | None = None):
        self.f, self.channel, self.group, self.seq = fabric, channel, group, seq
        # seen[slot]: a progress value every member of this slot's group is known to have
        # reached (this member waited for it), kept by the device across calls; progress
        # only grows (until a reset, which zeroes both), so it stays a lower bound
        self.seen = seen if seen is not None else [0] * (group.slot + 1)
        self.inline = False     # set once every input was copied out of the descriptors
        # where buffers live (vcluster.runtime.device_memory): the host's arenas, or
        # device memory the peers read in place
        self.space = space if space is not None else HostSpace(fabric.arenas)
        self.arenas = self.space.arenas
        self.run_base = run_base         # calls on this slot before the current run
        self.number = seq - run_base     # "call #k" in messages counts from the run start
        self.collective, self.algorithm, self.op_code = collective, algorithm, OP_CODES[collective]
        self.alloc = alloc               # alloc(shape, dtype, resident) -> array in space
        self.me = group.position
        self.sent: dict[int, list[int]] = {}       # peer -> [bytes, messages]
        self.received: dict[int, list[int]] = {}
        self._received_from_all = -1    # >= 0: bytes read from every other member, once
        self._keep: list[np.ndarray] = []   # staging blocks alive until the call ends

    # --- accounting -----------------------------------------------------------------
    def count_sent(self, peer: int, nbytes: int, messages: int = 1) -> None:
        if peer != self.f.rank:
            entry = self.sent.setdefault(peer, [0, 0])
            entry[0] += int(nbytes)
            entry[1] += messages

    def count_received(self, peer: int, nbytes: int, messages: int = 1) -> None:
        if peer != self.f.rank:
            if self._received_from_all >= 0:
                self._spell_out_received()
            entry = self.received.setdefault(peer, [0, 0])
            entry[0] += int(nbytes)
            entry[1] += messages

    def event_later(self, nbytes: int, start: float, end: float) -> tuple:
        """(build, args): ``build(*args)`` is this call's :class:`CommEvent`, for the
        recorder to build when it is read (the counts are not touched after the call
        ends). A call that read every member once keeps that as one number until then."""
        return call_event, (self.f.rank, self.collective, self.group.members,
                             self.algorithm, nbytes, self.sent, self.received,
                             self._received_from_all, self.seq, start, end, self.space.name)

    # --- descriptors ----------------------------------------------------------------
    def _row(self, member: int) -> np.ndarray:
        return self.f.desc[member, self.group.slot, self.seq % 2]

    def _locate(self, array: np.ndarray) -> tuple[int, int]:
        """(owner, offset) of an arena copy of ``array``: in place when already there."""
        arena = self.arenas[self.f.rank]
        offset = arena.offset_of(array)
        if offset is None:
            staged = self.alloc(array.shape, array.dtype, True)
            np.copyto(staged, array)
            self._keep.append(staged)
            offset = arena.offset_of(staged)
        return self.f.rank, offset

    def publish(self, array: np.ndarray | None, arg: int = 0,
                out: np.ndarray | None = None) -> None:
        """Describe my input (inline when small) and, for write-style algorithms, my output.

        The descriptor slot of parity s mod 2 was last used by call s - 2; every member
        must be done with that call (progress >= 4 (s - 2) + 2) before it is rewritten.
        No wait when this member already saw every member get that far (``seen``): after
        an shm call s - 1 it saw 4 (s - 1) + 1 >= 4 (s - 2) + 2 from each.
        """
        target = 4 * (self.seq - 2) + 2
        if self.seq > 2 and self.seen[self.group.slot] < target:
            self._wait_members(target, "to finish call #%d" % (self.number - 2))
        row = self._row(self.f.rank)
        # words SEQ .. ARG, the output as (-1, 0) until set below: every member writes
        # the same words for the same call (what an InlinePlan compares in one piece)
        if array is None:
            row[:D.ARG + 1] = [self.seq, self.op_code, 0, 0] + [0] * MAX_NDIM + [0, 0, -1,
                                                                                -1, 0, arg]
        else:
            if array.ndim > MAX_NDIM:
                raise ValueError(f"{self.collective}: arrays of more than {MAX_NDIM} dimensions "
                                 f"are not supported (got shape {array.shape})")
            row[:D.ARG + 1] = ([self.seq, self.op_code, encode_dtype(array.dtype), array.ndim]
                               + list(array.shape) + [0] * (MAX_NDIM - array.ndim)
                               + [-1, 0, array.nbytes, -1, 0, arg])
            if array.nbytes <= INLINE_BYTES:
                row[D.INLINE:].view(np.uint8)[:array.nbytes] = self.space.inline_bytes(array)
            elif array.nbytes:
                row[D.IN_OWNER], row[D.IN_OFFSET] = self._locate(array)
        if out is not None:
            offset = self.arenas[self.f.rank].offset_of(out)
            if offset is None:
                raise ArenaFullError(f"rank {self.f.rank}: {self.collective} output is not "
                                     "in the arena")
            row[D.OUT_OWNER], row[D.OUT_OFFSET] = self.f.rank, offset
        self.space.sync()           # my input is written before peers may read it
        self.arrive(1)

    def _snapshot(self) -> None:
        """Copy every member's descriptor once phase 1 is reached; check they match.

        Reading one copy costs one numpy call instead of several per member, and inline
        payloads stay valid in the copy however far the peers run ahead. The check
        compares the bytes of the (members, [seq, op]) block with n copies of this
        member's own (seq, op) words, which ``publish`` wrote; only a mismatch walks the
        members to name the first one that differs.
        """
        f, g = self.f, self.group
        self._rows = rows = f.desc[g.members, g.slot, self.seq % 2]   # (members, DESC_WORDS)
        self._header_list = None
        if rows[:, :D.OP + 1].tobytes() == rows[self.me, :D.OP + 1].tobytes() * g.size:
            return
        for member, h in zip(g.members, self._headers):
            if h[D.SEQ] != self.seq or h[D.OP] != self.op_code:
                theirs = op_name(h[D.OP])
                raise CollectiveMismatch(
                    f"rank {f.rank} called {self.collective} (call #{self.number} over axes "
                    f"{g.axes}, group {g.members}) but rank {member} called {theirs} "
                    f"(call #{h[D.SEQ] - self.run_base}) at that point")

    @property
    def _headers(self) -> list[list[int]]:
        """The members' descriptor headers (words before the inline payload) as lists,
        read from the snapshot on first use."""
        if self._header_list is None:
            self._header_list = self._rows[:, :D.INLINE].tolist()
        return self._header_list

    def peer_meta(self, member: int) -> tuple[np.dtype | None, tuple, int, int]:
        """(dtype, shape, nbytes, arg) that ``member`` published for this call."""
        h = self._headers[self.group.members.index(member)]
        nbytes = h[D.NBYTES]
        if nbytes < 0:
            return None, (), -1, h[D.ARG]
        return decode_dtype(h[D.DTYPE]), tuple(h[D.SHAPE:D.SHAPE + h[D.NDIM]]), nbytes, h[D.ARG]

    def inline_inputs(self, dtype: np.dtype, count: int) -> np.ndarray:
        """Every member's inline input as rows of one (n, count) array (a private copy)."""
        nbytes = count * np.dtype(dtype).itemsize
        return self.space.from_host(self._rows[:, D.INLINE:].view(np.uint8)[:, :nbytes].view(dtype))

    def count_received_from_all(self, nbytes: int) -> None:
        """``nbytes`` in one message from every other member (the entries are spelled
        out when the event is built, or before another count)."""
        self._received_from_all = int(nbytes)

    def _spell_out_received(self) -> None:
        self.received.update(_from_all(self.f.rank, self.group.members,
                                       self._received_from_all))
        self._received_from_all = -1

    def peer_input(self, member: int) -> np.ndarray:
        dtype, shape, nbytes, _ = self.peer_meta(member)
        i = self.group.members.index(member)
        h = self._headers[i]
        if nbytes == 0:
            return self.space.empty(shape, dtype)
        if h[D.IN_OWNER] < 0:
            return self.space.from_host(
                self._rows[i, D.INLINE:].view(np.uint8)[:nbytes].view(dtype).reshape(shape))
        return self.arenas[h[D.IN_OWNER]].view(h[D.IN_OFFSET], shape, dtype)

    def peer_output(self, member: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
        h = self._headers[self.group.members.index(member)]
        return self.arenas[h[D.OUT_OWNER]].view(h[D.OUT_OFFSET], shape, dtype)

    def all_inline(self) -> bool:
        return all(h[D.NBYTES] <= INLINE_BYTES for h in self._headers)

    def check_agree_all(self, dtype, shape, arg) -> None:
        """Every member published this dtype, shape and argument.

        The bytes of the (members, [dtype, ndim, shape words]) block and of the argument
        column are compared with n copies of the expected words: ``publish`` zero-fills
        the shape words past ndim, so equal words are equal (dtype, shape). Only a
        mismatch walks the members to name one.
        """
        mine = [encode_dtype(dtype), len(shape), *shape]
        rows, n = self._rows, self.group.size
        expected = np.array(mine + [0] * (MAX_NDIM - len(shape)) + [arg], np.int64).tobytes()
        if (rows[:, D.DTYPE:D.IN_OWNER].tobytes() == expected[:-8] * n
                and rows[:, D.ARG].tobytes() == expected[-8:] * n):
            return
        for member, h in zip(self.group.members, self._headers):
            if h[D.DTYPE:D.SHAPE + len(shape)] != mine or h[D.ARG] != arg:
                theirs = self.peer_meta(member)
                raise CollectiveMismatch(
                    f"rank {self.f.rank}: {self.collective} call #{self.number} over axes "
                    f"{self.group.axes}: rank {self.f.rank} has dtype {np.dtype(dtype)}, "
                    f"shape {tuple(shape)}, argument {arg} but rank {member} has dtype "
                    f"{theirs[0]}, shape {theirs[1]}, argument {theirs[3]}")

    def check_agree(self, what: str, mine, members_values: dict[int, object]) -> None:
        for m, v in members_values.items():
            if v != mine:
                raise CollectiveMismatch(
                    f"rank {self.f.rank}: {self.collective} call #{self.number} over axes "
                    f"{self.group.axes}: {what} differs — rank {self.f.rank} has {mine}, "
                    f"rank {m} has {v}")

    # --- phases ---------------------------------------------------------------------
    def arrive(self, phase: int) -> None:
        if phase == 2:
            self.space.sync()       # my reads and writes of peers' buffers are done
        f, me, slot = self.f, self.f.rank, self.group.slot
        f.progress[me, slot] = 4 * self.seq + phase
        f.waker.wake(f.progress_address(me, slot))

    def wait_all(self, phase: int) -> None:
        """Wait until every member has arrived at ``phase`` of this call (after phase 1
        the members' descriptors are read)."""
        target = 4 * self.seq + phase
        self._wait_members(target, "")
        if self.seen[self.group.slot] < target:
            self.seen[self.group.slot] = target
        if phase == 1:
            self._snapshot()

    def _wait_members(self, target: int, why: str) -> None:
        f, slot = self.f, self.group.slot
        members = self.group.members
        pending = [m for m in members if m != f.rank]

        def blocker():
            while pending:
                m = pending[-1]
                v = int(f.progress[m, slot])
                if v < target:
                    return f.progress_address(m, slot), v
                pending.pop()
            return None

        f.wait(blocker, lambda: describe_wait(f, self.group, target, self.collective,
                                              self.number, self.run_base, why),
               peers=members)

    def finish(self) -> None:
        """Mark the call done on this member (phase 2) and drop staging buffers.

        An ``inline`` call (every member's input copied out of the descriptor snapshot,
        no peer buffer touched) writes phase 2 without the futex wake, as nobody can
        need it: only call s + 2's ``publish`` waits for 4 s + 2 from this member. If
        call s + 1 on this slot is an shm call, a peer there has already seen this
        member's 4 (s + 1) + 1 and does not sleep; if it is a message algorithm, its
        ``finish`` writes 4 (s + 1) + 2 and wakes the word — before the peer could use
        the wake anyway, since its call s + 2 cannot end before this member publishes
        call s + 2, after call s + 1.
        """
        f, me, slot = self.f, self.f.rank, self.group.slot
        if f.progress[me, slot] < 4 * self.seq + 2:
            if self.inline:
                f.progress[me, slot] = 4 * self.seq + 2
            else:
                self.arrive(2)
        self._keep.clear()

    # --- messages (for ring, tree and pairwise algorithms) ---------------------------
    def tag(self, step: int) -> int:
        return (self.seq << 24) | (self.group.slot << 12) | step

    def isend(self, member: int, step: int, array: np.ndarray):
        self.count_sent(member, array.nbytes)
        return self.channel.isend(member, self.op_code, self.tag(step), array)

    def take(self, member: int, step: int):
        msg = self.channel.take(member, self.op_code, self.tag(step),
                                f"{self.collective} call #{self.number}")
        self.count_received(member, msg.nbytes)
        return msg

    def recv_into(self, member: int, step: int, out: np.ndarray | None) -> np.ndarray:
        msg = self.take(member, step)
        try:
            if out is None:
                out = self.alloc(msg.shape, msg.dtype, True)
            np.copyto(out, msg.view().reshape(out.shape))
        finally:
            msg.release()
        return out
