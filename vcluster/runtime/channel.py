"""Point-to-point messages between virtual devices, tagged (source, destination, tag).

Every ordered pair (src, dst) has a mailbox of ``mailbox_slots`` descriptor slots in
the control segment and a ``posted`` counter. Message number q (1, 2, ...) of a pair
lives in any slot that was free when it was sent. A slot's ``state`` word is 0 when free
and q while it holds message q::

    sender:   wait for a slot with state == 0; write descriptor; state = q; posted = q;
              wake(posted)
    receiver: read posted = p; scan the K slots for messages q <= p, oldest first, for
              (kind, tag); copy; state = 0; wake(state)

So a message that is not received yet holds one slot and nothing else: later messages
of the pair use the other slots (a send is queued, below, only while all K slots hold
messages the receiver has not taken).

The scan reads the K state words one after another, not at one instant: a receiver
descheduled between reading slot 0 and slot 3 can find slot 0 still free and, in slot
3, a message the sender posted after the one it has since put in slot 0 — the newer
message of a (kind, tag) without the older. The receiver therefore reads ``posted``
first and looks only at messages numbered up to it: their states were written before
``posted`` was (program order, and x86's ordered stores), the receiver is the only one
that frees them, so the scan sees every one of them however long it is held up. Later
messages wait for the next scan. Without that bound a loaded machine swapped two K
blocks of a context-parallel ring about once in 150 training runs (issue 56): a wrong
loss and no error. Each receive also checks that it takes a (kind, tag)'s messages in
increasing number (:class:`~.errors.MessageOrderError` otherwise).

Payloads up to ``INLINE_BYTES`` travel inside the slot and the send completes at once
(eager). Larger payloads stay in the sender's arena — without any copy when the array
already lives there (``dev.empty`` buffers), else copied once into a staging block — and
the send completes when the receiver has copied them out (rendezvous), which is why
``send`` may block until the matching receive is posted. No payload is ever pickled.

Messages of one pair with the same (kind, tag) are received in the order they were sent;
different tags may be received in any order.

``send_buffered`` copies the payload and returns at once; the channel keeps the copy
alive until the receiver has taken it, so a program may post its sends before its
receives in any order without deadlock. ``isend`` never waits either, as MPI's does not:
its handle's ``wait`` is where a program waits. When all K slots of a pair hold messages
the receiver has not taken, further sends of either kind wait in a local overflow queue,
in order (a buffered send's copy, an ``isend``'s array itself), and are posted as slots
free up — by the next send, by any wait of this device (``Fabric.pump``) or by the
``wait`` of a queued ``isend`` (:class:`QueuedSend`); and a receiver that finds a pair's
mailbox full of messages it does not want yet copies the oldest out into a local
unexpected-message store (as MPI implementations do), freeing the slot. So sends are
buffered without bound: two ranks may each ``isend`` the other more than K messages
before receiving any (with an ``isend`` that waited for a slot, both waited forever).

The channel is thread-safe (a device's communication thread and its program share it).
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np

from .collectives.common import op_name
from .errors import ArenaFullError, CollectiveMismatch, MessageOrderError
from .fabric import Fabric
from .layout import INLINE_BYTES, MAX_NDIM, S, decode_dtype, encode_dtype

__all__ = ["VirtualChannel", "SendHandle", "QueuedSend", "Incoming", "USER_KIND", "kind_text"]

USER_KIND = 0   # kind word of user send/recv; collectives use their op code


def kind_text(kind: int) -> str:
    """A message's kind word in words: "send" or the collective that sent it."""
    return "send" if kind == USER_KIND else f"{op_name(kind)} message"


class SendHandle:
    """Completion of one send: ``wait()`` returns once the payload has been taken."""

    def __init__(self, fabric: Fabric, dst: int, slot: int, seq: int, keep, eager: bool):
        self._fabric, self._dst, self._slot, self._seq = fabric, dst, slot, seq
        self._keep = keep            # staging block or source array, alive until taken
        self._done = eager

    def is_completed(self) -> bool:
        if not self._done:
            f = self._fabric
            self._done = f.mailbox[f.rank, self._dst, self._slot, S.STATE] != self._seq
            if self._done:
                self._keep = None
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        f = self._fabric
        words = f.mailbox[f.rank, self._dst, self._slot]
        addr = f.state_address(f.rank, self._dst, self._slot)

        def blocker():
            v = int(words[S.STATE])
            return None if v != self._seq else (addr, v)

        f.wait(blocker, lambda: f"waiting for rank {self._dst} to receive message "
                                f"#{self._seq} (tag {int(words[S.TAG])})",
               peers=(self._dst,))
        self._done, self._keep = True, None


class QueuedSend:
    """An ``isend`` that found its pair's mailbox full: it waits in the channel's overflow
    queue, in order, and becomes ``posted`` (a :class:`SendHandle`) when a slot frees;
    ``wait()`` posts it (and the sends queued before it) if nothing has yet, then waits
    for the receiver to take it."""

    def __init__(self, channel: "VirtualChannel", dst: int):
        self._channel, self._dst = channel, dst
        self.posted: SendHandle | None = None

    def __repr__(self) -> str:
        return f"QueuedSend(dst={self._dst}, posted={self.posted is not None})"

    def is_completed(self) -> bool:
        return self.posted is not None and self.posted.is_completed()

    def wait(self) -> None:
        if self.posted is None:
            self._channel._post_queued(self._dst, self)
        self.posted.wait()


class Incoming:
    """A matched message; ``view()`` reads the payload in place until ``release()``."""

    def __init__(self, fabric: Fabric, src: int, slot: int, words: np.ndarray):
        self._fabric, self.src, self._slot, self._words = fabric, src, slot, words
        head = words[:S.INLINE].tolist()          # one read of the header words
        self.seq = head[S.SEQ]
        self.dtype = decode_dtype(head[S.DTYPE])
        self.shape = tuple(head[S.SHAPE:S.SHAPE + head[S.NDIM]])
        self.nbytes = head[S.NBYTES]
        self._owner, self._offset = head[S.OWNER], head[S.OFFSET]

    def view(self) -> np.ndarray:
        if self._owner < 0:
            raw = self._words[S.INLINE:].view(np.uint8)[:self.nbytes]
            return raw.view(self.dtype).reshape(self.shape)
        return self._fabric.arenas[self._owner].view(self._offset, self.shape, self.dtype)

    def release(self) -> None:
        f = self._fabric
        self._words[S.STATE] = 0
        f.waker.wake(f.state_address(self.src, f.rank, self._slot))


class _Received:
    """A message already copied out of the mailbox (see ``VirtualChannel._set_aside``)."""

    def __init__(self, src: int, seq: int, data: np.ndarray):
        self.src, self.seq, self._data = src, seq, data
        self.dtype, self.shape, self.nbytes = data.dtype, data.shape, data.nbytes

    def view(self) -> np.ndarray:
        return self._data

    def release(self) -> None:
        pass


class VirtualChannel:
    """The mailboxes of one device: sends from it and receives into it."""

    def __init__(self, fabric: Fabric):
        self._f = fabric
        n = fabric.layout.n_ranks
        self._k = fabric.layout.mailbox_slots
        self._sent = [0] * n                 # last message number posted to each dst
        self._taken: list[set[int]] = [set() for _ in range(n)]   # taken, not yet released
        self._buffered: list[SendHandle] = []    # buffered sends not yet taken
        # dst -> (kind, tag, array, copy, QueuedSend or None for a buffered send), not
        # yet posted
        self._overflow: dict[int, deque] = {}
        self._unexpected: dict[tuple, deque] = {}   # (src, kind, tag) -> messages set aside
        self._last_taken: dict[tuple, int] = {}     # (src, kind, tag) -> number last taken
        self._in_post = False
        # Sending and receiving state have separate locks: a sender waiting for a free
        # slot must never stop this device's other thread from receiving.
        self._send_lock = threading.RLock()
        self._recv_lock = threading.Lock()

    def reset(self) -> None:
        """Forget all message state (the host zeroes the mailboxes at the same time)."""
        with self._send_lock, self._recv_lock:
            n = len(self._sent)
            self._sent = [0] * n
            self._taken = [set() for _ in range(n)]
            self._buffered = []
            self._overflow = {}
            self._unexpected = {}
            self._last_taken = {}
            self._f.pump = None

    def send_buffered(self, dst: int, kind: int, tag: int, array: np.ndarray) -> None:
        """Send a private copy of ``array``; never waits for the receiver."""
        with self._send_lock:
            if self._buffered:
                self._buffered = [h for h in self._buffered if not h.is_completed()]
            if self._overflow:
                self._pump(dst)
            if self._overflow.get(dst) or not self._has_free_slot(dst):
                self._overflow.setdefault(dst, deque()).append(
                    (kind, tag, array.copy(), True, None))
                self._f.pump = self.pump
                return
            handle = self._post(dst, kind, tag, array, True)
            if not handle.is_completed():
                self._buffered.append(handle)

    def release_taken(self) -> None:
        """Free the staging copies of buffered sends that their receivers have taken.

        A buffered send owns its copy (a block of this device's arena) until the receiver
        takes it; the channel notices that at its next send, or here. The device calls
        this before each host command, when every receive of the last run is done, so no
        staging block outlives the run that sent it.
        """
        with self._send_lock:
            self._buffered = [h for h in self._buffered if not h.is_completed()]

    def _has_free_slot(self, dst: int) -> bool:
        f = self._f
        return 0 in f.mailbox[f.rank, dst, :, S.STATE].tolist()

    def _pump(self, dst: int) -> None:
        """Post queued overflow messages to ``dst`` while slots are free (send lock held)."""
        queue = self._overflow.get(dst)
        while queue and self._has_free_slot(dst):
            self._post_entry(dst, queue.popleft())
        if queue is not None and not queue:
            del self._overflow[dst]
        if not self._overflow:
            self._f.pump = None

    def flush(self) -> None:
        """Post every queued overflow message, waiting for slots (end of a program)."""
        with self._send_lock:
            for dst in list(self._overflow):
                while self._overflow.get(dst):
                    self._post_overflow_blocking(dst)

    def pump(self) -> None:
        """Post what overflow messages fit now (called from this device's waits)."""
        if self._in_post or not self._send_lock.acquire(blocking=False):
            return
        try:
            if not self._in_post:
                for dst in list(self._overflow):
                    self._pump(dst)
        finally:
            self._send_lock.release()

    # --- sending --------------------------------------------------------------------
    def isend(self, dst: int, kind: int, tag: int, array: np.ndarray,
              copy: bool = False) -> SendHandle | QueuedSend:
        """Post ``array`` to ``dst``, never waiting; zero-copy when it lives in this
        device's arena and ``copy`` is false (then the caller must keep it unchanged until
        ``wait()``). With the pair's mailbox full, or earlier sends to ``dst`` still
        queued, it joins the overflow queue (a :class:`QueuedSend`)."""
        with self._send_lock:
            if self._overflow.get(dst):
                self._pump(dst)
            if self._overflow.get(dst) or not self._has_free_slot(dst):
                queued = QueuedSend(self, dst)
                self._overflow.setdefault(dst, deque()).append(
                    (kind, tag, array, copy, queued))
                self._f.pump = self.pump
                return queued
            return self._post(dst, kind, tag, array, copy)

    def _post_queued(self, dst: int, queued: QueuedSend) -> None:
        """Post the overflow queue to ``dst`` up to ``queued``, waiting for slots."""
        with self._send_lock:
            while queued.posted is None:
                self._post_overflow_blocking(dst)

    def _post_entry(self, dst: int, entry: tuple) -> None:
        """Post one overflow entry (send lock held): a queued isend gets its handle, a
        buffered send's handle is kept until the receiver takes it."""
        kind, tag, array, copy, queued = entry
        handle = self._post(dst, kind, tag, array, copy)
        if queued is not None:
            queued.posted = handle
        elif not handle.is_completed():
            self._buffered.append(handle)

    def _post_overflow_blocking(self, dst: int) -> None:
        queue = self._overflow[dst]
        entry = queue.popleft()
        if not queue:
            del self._overflow[dst]
        self._post_entry(dst, entry)
        self._pump(dst)          # posts what else fits; clears Fabric.pump when all is out

    def _post(self, dst: int, kind: int, tag: int, array: np.ndarray, copy: bool) -> SendHandle:
        self._in_post = True
        try:
            return self._post_now(dst, kind, tag, array, copy)
        finally:
            self._in_post = False

    def _post_now(self, dst: int, kind: int, tag: int, array: np.ndarray,
                  copy: bool) -> SendHandle:
        f, me = self._f, self._f.rank
        if array.ndim > MAX_NDIM:
            raise ValueError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent "
                             f"(got shape {array.shape})")
        q = self._sent[dst] + 1
        states = f.mailbox[me, dst, :, S.STATE]
        free: list[int] = []

        def all_busy():
            seen = states.tolist()
            if 0 in seen:
                free.append(seen.index(0))
                return None
            oldest = seen.index(min(seen))       # the likeliest to be taken next
            return f.state_address(me, dst, oldest), seen[oldest]

        if all_busy() is not None:      # no free slot: wait for one (usually there is)
            f.wait(all_busy, lambda: f"waiting for rank {dst} to take one of messages "
                                     f"#{sorted(states.tolist())} and free a mailbox slot",
                   peers=(dst,))
        slot = free[0]
        words = f.mailbox[me, dst, slot]
        words[S.SEQ], words[S.KIND], words[S.TAG] = q, kind, tag
        words[S.DTYPE], words[S.NDIM] = encode_dtype(array.dtype), array.ndim
        words[S.SHAPE:S.SHAPE + array.ndim] = array.shape
        words[S.NBYTES] = array.nbytes
        keep, eager = None, array.nbytes <= INLINE_BYTES
        if eager:
            words[S.OWNER] = -1
            words[S.INLINE:].view(np.uint8)[:array.nbytes] = np.ascontiguousarray(array).view(
                np.uint8).reshape(-1)
        else:
            arena = f.arenas[me]
            offset = None if copy else arena.offset_of(array)
            keep = array
            if offset is None:
                placed = arena.allocate(array.shape, array.dtype)
                if placed is None:
                    raise ArenaFullError(f"rank {me}: no room for a {array.nbytes}-byte "
                                         f"message to rank {dst}: {arena.shortfall}; "
                                         "release arrays, or raise "
                                         "VirtualCluster(arena_bytes=...) if you capped it")
                keep, offset = placed
                np.copyto(keep, array)
            words[S.OWNER], words[S.OFFSET] = me, offset
        words[S.STATE] = q
        f.posted[me, dst] = q
        f.waker.wake(f.posted_address(me, dst))
        self._sent[dst] = q
        return SendHandle(f, dst, slot, q, keep, eager)

    # --- receiving ------------------------------------------------------------------
    def take(self, src: int, kind: int, tag: int, what: str) -> Incoming:
        """Block until the next message from ``src`` with this (kind, tag) has arrived."""
        f, me = self._f, self._f.rank
        posted_addr = f.posted_address(src, me)
        found: list[Incoming] = []
        scanned = [-1]      # posted[src, me] when the mailbox was last scanned in vain

        key = (src, kind, tag)

        def blocker():
            with self._recv_lock:
                return scan()

        def take_in_order(msg) -> None:
            """Keep ``msg``, checking it is later than the key's last taken (lock held)."""
            if msg.seq <= self._last_taken.get(key, 0):
                raise MessageOrderError(
                    f"rank {me}: {what} from rank {src} took message #{msg.seq} after "
                    f"message #{self._last_taken[key]} of the same (kind {kind_text(kind)}, "
                    f"tag {tag}): messages of one tag must be received in the order they "
                    "were sent")
            self._last_taken[key] = msg.seq
            found.append(msg)

        def scan():
            early = self._unexpected.get(key)
            if early:
                take_in_order(early[0])
                early.popleft()
                if not early:
                    del self._unexpected[key]
                return None
            last = int(f.posted[src, me])
            if last == scanned[0]:
                # Nothing posted since the last scan, which found no match: a match would
                # have to be a new message (one set aside by the other thread is in
                # _unexpected, looked at above). Spares the scan on each yield of a wait.
                return (posted_addr, last)
            taken = self._taken[src]
            box = f.mailbox[src, me]
            states = self._read_states(box)
            taken.intersection_update(states)    # forget messages released since
            # only messages up to `last`: the scan is sure to see all of those (module
            # docstring); a later one seen now may have an earlier one it missed
            candidates = sorted((q, slot) for slot, q in enumerate(states)
                                if q and q <= last and q not in taken)  # oldest first
            for q, slot in candidates:
                if q == 0 or q in taken:
                    continue
                words = box[slot]
                if words[S.TAG] != tag:
                    continue
                if words[S.KIND] != kind:
                    if kind == USER_KIND or words[S.KIND] == USER_KIND:
                        continue
                    raise CollectiveMismatch(
                        f"rank {me} expected {what} from rank {src} (tag {tag}) but rank "
                        f"{src} sent a message of another operation (kind "
                        f"{int(words[S.KIND])} instead of {kind})")
                take_in_order(Incoming(f, src, slot, words))
                taken.add(q)
                return None
            if candidates and 0 not in states:
                # The pair's mailbox is full of messages this receive does not want:
                # move them into local memory so the sender can post more.
                for q, slot in candidates:
                    self._set_aside(src, q, slot)
                return (posted_addr, -1)        # scan again at once
            scanned[0] = last
            return (posted_addr, last)

        if blocker() is not None:        # not there yet: wait (a message there needs none)
            f.wait(blocker, lambda: f"in {what} waiting for rank {src} (tag {tag})",
                   peers=(src,))
        return found[0]

    @staticmethod
    def _read_states(box: np.ndarray) -> list[int]:
        """The state word of each of a pair's slots, read one after another (not at one
        instant: a slot read early can change before a later one is read)."""
        return box[:, S.STATE].tolist()

    def probe(self, src: int, kind: int, tag: int) -> bool:
        """Whether a message from ``src`` with this (kind, tag) has arrived and is not
        taken yet (never blocks; the message stays where it is)."""
        f, me = self._f, self._f.rank
        with self._recv_lock:
            if self._unexpected.get((src, kind, tag)):
                return True
            box = f.mailbox[src, me]
            taken = self._taken[src]
            for slot, q in enumerate(box[:, S.STATE].tolist()):
                if q and q not in taken and box[slot, S.TAG] == tag \
                        and box[slot, S.KIND] == kind:
                    return True
        return False

    def leftovers(self) -> list[str]:
        """What the receiving side holds that no receive took: messages set aside (copied
        out of a full mailbox) and never received. Empty at the end of a correct run."""
        with self._recv_lock:
            return [f"{len(queue)} message(s) from rank {src} ({kind_text(kind)}, tag {tag}) "
                    "arrived and were never received"
                    for (src, kind, tag), queue in self._unexpected.items() if queue]

    def _set_aside(self, src: int, q: int, slot: int) -> None:
        """Copy message q out of its slot into the unexpected-message store, free the slot."""
        words = self._f.mailbox[src, self._f.rank, slot]
        msg = Incoming(self._f, src, slot, words)
        key = (src, int(words[S.KIND]), int(words[S.TAG]))
        self._unexpected.setdefault(key, deque()).append(_Received(src, q, msg.view().copy()))
        msg.release()

    def recv_into(self, src: int, kind: int, tag: int, what: str,
                  out: np.ndarray | None, alloc) -> np.ndarray:
        """Receive into ``out`` (or a new array from ``alloc(shape, dtype)``)."""
        msg = self.take(src, kind, tag, what)
        try:
            if out is None:
                out = alloc(msg.shape, msg.dtype)
            elif out.size != math.prod(msg.shape):
                raise ValueError(f"rank {self._f.rank}: {what} from rank {src} carries shape "
                                 f"{msg.shape}, which does not fit out= of shape {out.shape}")
            np.copyto(out, msg.view().reshape(out.shape), casting="unsafe")
        finally:
            msg.release()
        return out
