"""A group's plan for small (inline) shm calls, built once per call site instead of per call.

An 8-byte all_reduce over 8 devices sharing 2 cores costs each device a few tens of
microseconds of Python, and the group's wall time is roughly n x that / cores. The
general path (:class:`~.common.GroupCall` and :mod:`.shm`) rebuilds, on every call, what
does not change between the calls of one call site: the descriptor words, where the
members' progress words and rows are, the closures of the waits, the checks' expected
bytes. An :class:`InlinePlan` holds them for one (group, collective, dtype, shape, op),
so a call is a few writes and reads of the control words:

1. publish: my descriptor row's 18 header words (``D.SEQ`` .. ``D.ARG``) from a template,
   then the call number, then the payload into the row's inline words;
   ``progress[me] = 4 s + 1`` and one futex wake (peers may sleep on that word);
2. wait until every member's progress is at least 4 s + 1 (one ``min`` over the
   members' words when nobody is late; else :meth:`Fabric.wait` with the same blocker
   and the same "waiting for rank(s) ..." text as the general path);
3. check: the members' 18 header words are n copies of mine (one bytes comparison).
   Any difference hands the call to the general checks (``GroupCall._snapshot``,
   ``check_agree_all``), which raise the same :class:`CollectiveMismatch` as before — or
   find nothing wrong, and the general inline reduction runs;
4. reduce: one ``ufunc.accumulate`` over the members' inline payloads, read in place in
   the control segment (:func:`~.common.reduce_rows`: the group-order fold, bit for bit);
5. ``progress[me] = 4 s + 2`` without a wake (``GroupCall.finish``'s reasoning).

Reading the payloads in place (the general path copies them first) is safe for the same
reason the general path may skip phase 2: a member rewrites the row of parity s mod 2 only
in call s + 2, whose ``publish`` waits until every member wrote 4 s + 2 (or saw 4 (s+1) + 1
from each, written after they finished call s).

Every member writes the same 18 header words for the same call, on either path
(``GroupCall.publish`` writes the output words as (-1, 0) when it publishes no output),
so the check is one comparison. Only numpy host arrays of 1 to ``INLINE_BYTES`` bytes of a
non-complex numeric dtype take a plan (complex products fold differently under
``accumulate``, :func:`~.common.reduce_rows`); all else takes the general path.
"""

from __future__ import annotations

import math
from itertools import pairwise
from types import MappingProxyType

import numpy as np

from ..layout import INLINE_BYTES, MAX_NDIM, D, encode_dtype
from .common import (OP_CODES, Group, GroupCall, ReduceOp, call_event, describe_wait,
                     reduce_rows)
from .shm import reduce_inline

__all__ = ["InlinePlan", "HEAD_WORDS", "inline_eligible"]

HEAD_WORDS = D.ARG + 1          # words every member writes alike: SEQ .. ARG
_NO_COUNTS = MappingProxyType({})   # an inline call writes into no peer's buffer


def inline_eligible(x: np.ndarray) -> bool:
    """Whether ``x`` may take an inline plan: 1..INLINE_BYTES bytes of a non-complex
    numeric (or bool) dtype, at most MAX_NDIM dimensions."""
    return (0 < x.nbytes <= INLINE_BYTES and x.dtype.kind in "biuf"
            and x.ndim <= MAX_NDIM)


def _arithmetic(values: tuple[int, ...]) -> int | None:
    """The common step of ``values`` (sorted, at least 2), or None when there is none."""
    step = values[1] - values[0]
    if step > 0 and all(b - a == step for a, b in pairwise(values)):
        return step
    return None


class InlinePlan:
    """What one member needs to run inline calls of one signature on one group.

    ``collective`` is ``all_reduce`` (``x`` of ``dtype`` and ``shape``, reduced by
    ``op``) or ``barrier`` (no payload). Built by the device on the first call of a
    signature and kept with it; holds views of the fabric's control words, never the
    device's call counters (passed in on each call, as ``reset`` replaces them).
    """

    __slots__ = ("f", "group", "slot", "n", "collective", "dtype", "shape", "op", "nbytes", "arg",
                 "_mv", "_address", "_head_at", "_header", "_rest", "_progress_at",
                 "_peer_progress", "_peer_addresses", "_progress_slice", "_progress_idx",
                 "_payload", "_rows", "_heads", "_members_idx", "_event_args")

    def __init__(self, fabric, group: Group, collective: str, dtype=None, shape=(),
                 op: ReduceOp | None = None):
        f, g = fabric, group
        self.f, self.group, self.collective, self.n = f, g, collective, g.size
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.shape, self.op = tuple(shape), op
        self.nbytes = 0 if dtype is None else math.prod(self.shape) * self.dtype.itemsize
        self.arg = 0 if op is None else op.code
        layout = f.layout
        self._mv = memoryview(f.words)                   # Python ints, ~20 ns a word
        self.slot = g.slot
        self._address = f.progress_address(f.rank, g.slot)   # my progress word, for wakes
        # word index of my row's header, per parity
        desc0 = layout.desc_at + (f.rank * layout.n_slots + g.slot) * 2 * D.WORDS
        self._head_at = (desc0, desc0 + D.WORDS)
        header = np.zeros(HEAD_WORDS, np.int64)          # SEQ stays 0: written per call
        header[D.OP] = OP_CODES[collective]
        # as GroupCall.publish writes them: input (-1 = inline, 0), bytes, output (-1, 0)
        header[D.IN_OWNER:D.ARG + 1] = [-1, 0, -1, -1, 0, self.arg]
        if self.dtype is None:
            header[D.IN_OWNER] = 0                       # no input at all (a barrier)
        else:
            header[D.DTYPE], header[D.NDIM] = encode_dtype(self.dtype), len(self.shape)
            header[D.SHAPE:D.SHAPE + len(self.shape)] = self.shape
            header[D.NBYTES] = self.nbytes
        self._header = memoryview(header)
        self._rest = header[1:].tobytes()
        progress = [layout.progress_at + m * layout.n_slots + g.slot for m in g.members]
        self._progress_at = progress[g.position]
        peers = [p for m, p in zip(g.members, progress) if m != f.rank]
        self._peer_progress = peers
        self._peer_addresses = {p: f.progress_address(m, g.slot)
                                for m, p in zip(g.members, progress) if m != f.rank}
        self._progress_idx = progress
        step = _arithmetic(g.members)
        self._progress_slice = (slice(progress[0], progress[-1] + 1, step * layout.n_slots)
                                if step else None)
        # the members' rows of each parity: a strided view when the members are evenly
        # spaced (a mesh axis), else gathered per call (several axes)
        self._members_idx = list(g.members)
        if step:
            blocks = [f.desc[g.members[0]:g.members[-1] + 1:step, g.slot, p] for p in (0, 1)]
            self._heads = [b[:, :HEAD_WORDS] for b in blocks]
            self._rows = [self._typed(b) for b in blocks]
        else:
            self._heads = self._rows = None
        mine = f.desc[f.rank, g.slot]
        self._payload = [None if self.dtype is None else
                         mine[p, D.INLINE:].view(np.uint8)[:self.nbytes]
                         .view(self.dtype).reshape(self.shape) for p in (0, 1)]
        self._event_args = (f.rank, collective, g.members, "shm", self.nbytes, _NO_COUNTS,
                            _NO_COUNTS, self.nbytes if collective == "all_reduce" else -1)

    def __repr__(self) -> str:
        return (f"InlinePlan({self.collective}, group={self.group.members}, "
                f"dtype={self.dtype}, shape={self.shape}, op={self.op})")

    def _typed(self, block: np.ndarray) -> np.ndarray | None:
        """The (members, elements) payloads of a (members, D.WORDS) block of rows."""
        if self.dtype is None:
            return None
        return block[:, D.INLINE:].view(np.uint8)[:, :self.nbytes].view(self.dtype)

    # --- one call -------------------------------------------------------------------
    def run(self, s: int, x, out, seen: list[int], run_base: int, alloc):
        """Call number ``s`` on this group (the device has counted it): publish, wait,
        check, reduce. ``seen``, ``run_base`` and ``alloc`` are the device's (see
        ``GroupCall``), for the general path's :class:`GroupCall` when a check fails."""
        mv, slot = self._mv, self.slot
        target = 4 * s - 6                               # call s - 2 finished everywhere
        if s > 2 and seen[slot] < target:
            self._wait(target, s, run_base, f"to finish call #{s - run_base - 2}")
        parity = s & 1
        at = self._head_at[parity]
        mv[at:at + HEAD_WORDS] = self._header
        mv[at] = s
        if x is not None:
            self._payload[parity][...] = x
        mv[self._progress_at] = 4 * s + 1                # data before the flag (x86 TSO)
        self.f.waker.wake(self._address)
        target = 4 * s + 1
        sl = self._progress_slice
        low = min(mv[sl]) if sl is not None else min(map(mv.__getitem__, self._progress_idx))
        if low < target:
            self._wait(target, s, run_base, "")
        if seen[slot] < target:
            seen[slot] = target
        if self._heads is not None:
            heads, rows = self._heads[parity], self._rows[parity]
        else:
            block = self.f.desc[self._members_idx, slot, parity]   # (members, D.WORDS) copy
            heads, rows = block[:, :HEAD_WORDS], self._typed(block)
        expected = (s.to_bytes(8, "little", signed=True) + self._rest) * self.n
        if heads.tobytes() != expected:
            res = self._general(s, x, out, run_base, seen, alloc)
        elif rows is None:
            res = None
        else:
            res = reduce_rows(out, rows, self.op, self.n)
            if out is None:
                res = res.reshape(self.shape)
        mv[self._progress_at] = 4 * s + 2                # finished: no wake (GroupCall.finish)
        return res

    def event_later(self, s: int, start: float, end: float) -> tuple:
        """(build, args) of call ``s``'s :class:`CommEvent`, as ``GroupCall.event_later``
        gives them: no bytes sent, ``nbytes`` received from every other member."""
        return call_event, self._event_args + (s, start, end, "host")

    # --- the slow branches ------------------------------------------------------------
    def _wait(self, target: int, s: int, run_base: int, why: str) -> None:
        """Wait until every member's progress is at least ``target``, as
        ``GroupCall._wait_members`` does (sleeping on the last late member's word)."""
        mv, pending, addresses = self._mv, list(self._peer_progress), self._peer_addresses

        def blocker():
            while pending:
                p = pending[-1]
                v = mv[p]
                if v < target:
                    return addresses[p], v
                pending.pop()
            return None

        g = self.group
        self.f.wait(blocker, lambda: describe_wait(self.f, g, target, self.collective,
                                                   s - run_base, run_base, why),
                    peers=g.members)

    def _general(self, s: int, x, out, run_base: int, seen: list[int], alloc):
        """The general path's checks and inline reduction of this call (its descriptors
        differ from mine somewhere: the checks name the member, or pass)."""
        call = GroupCall(self.f, None, self.group, s, self.collective, "shm", alloc,
                         run_base, None, seen)
        call._snapshot()
        if self.collective == "barrier":
            return None
        call.check_agree_all(self.dtype, self.shape, self.arg)
        return reduce_inline(call, out, x, self.op, self.n)
