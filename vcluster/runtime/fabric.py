"""The shared memory every process of one cluster maps, seen from one process.

A :class:`Fabric` bundles the control words (see :mod:`vcluster.runtime.layout`), one
:class:`~vcluster.runtime.arena.Arena` per rank plus the host's, the futex waker and
the cluster's timeout. Devices and the host each build their own from the same
segments; nothing here is global, so two clusters in one process never meet.

:meth:`Fabric.wait` is the only place anything in the runtime sleeps on a peer: it
checks the abort word between naps and turns an expired deadline into a
:class:`~vcluster.runtime.errors.CollectiveTimeout` whose text says who waited for whom.

Before it sleeps, a wait yields its CPU a few times (``os.sched_yield``), so that a peer
that is runnable on the same CPU arrives without a futex round trip. When the devices are
pinned (``cpu_sets``) a wait yields only where that can help (:meth:`Fabric.yields_for`):
toward a peer that shares one of its CPUs, or on a CPU no other device uses. A wait for
peers that all run on other CPUs, beside other devices on its own, sleeps at once: its
yields would only hand the CPU to whatever else is runnable there, and Linux's scheduler
(EEVDF, 6.6 and later) gives a yielding task's CPU to another runnable task for a whole
time slice (~3-4 ms) — measured on the 2-core machine (issue 32), a step whose DDP
all-reduce waited in the program's thread for its partner on the other CPU took
13.7-14.4 ms beside two CPU-bound processes with the yields, 7.5-7.6 ms without them.
For the same reason a wait spins for at most ``_SPIN_BUDGET_S``, pinned or not: one
yield that gave such a process its slice ends the spinning (devices free to migrate, the
same step beside two such processes: 10.2-13.4 ms spinning up to 10 yields, 7.8-10.6
with a budget; benchmarks/README.md).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from .arena import Arena
from .errors import CollectiveTimeout, DeviceAborted
from .layout import ABORT, ABORT_KIND, ABORT_RANK, SLOT_WORDS, ControlLayout, S

__all__ = ["Fabric", "ABORT_LOST", "ABORT_ERROR", "ABORT_HOST", "fabric_from_segments"]

ABORT_LOST, ABORT_ERROR, ABORT_HOST = 1, 2, 3   # why the run was aborted
_NAP_S = 0.05                                   # longest single sleep: bounds abort latency
_PUMP_NAP_S = 0.002                             # ... while buffered sends wait for a slot
# Yield the core a few times before sleeping: a peer that is runnable gets to arrive
# without a futex round trip. 8-byte all_reduce over 8 devices on 2 cores, median:
# 0 yields ~710 us, 3 ~590 us, 10 ~540 us, 30 ~580 us, 100 ~630 us.
_YIELDS_BEFORE_SLEEP = 10
# ... but for at most this long: a yield that let a CPU-bound process on the same CPU run
# took ~3.8 ms (its time slice; 90th percentile of 200 yields beside one, the 2-core
# machine, Linux 6.18), where a yield to a device that soon blocks takes tens to hundreds
# of us. One such yield ends the spinning: the wait sleeps, and the peer's wake ends it.
# (The width-128 MLP step, pinned, quiet: 7.2-7.4 ms with 0.25 ms, 1 ms or no budget.)
_SPIN_BUDGET_S = 1e-3
_ABORT_WHY = {ABORT_LOST: "died", ABORT_ERROR: "raised an error", ABORT_HOST: "was interrupted"}

Blocker = Callable[[], "tuple[int, int] | None"]


class Fabric:
    """One process's view of a cluster's shared memory."""

    def __init__(self, rank: int, layout: ControlLayout, control: np.ndarray,
                 arenas: list[Arena], host_arena: Arena, waker, timeout_s: float,
                 cpu_sets: tuple | None = None):
        self.rank = rank                     # -1 in the host
        self.layout = layout
        self.words = control                 # int64 over the whole control segment
        v = layout.views(control)
        self.header, self.progress, self.desc = v["header"], v["progress"], v["desc"]
        self.posted, self.mailbox = v["posted"], v["mailbox"]
        self.arenas = arenas
        self.host_arena = host_arena
        self.arenas_by_owner = {**dict(enumerate(arenas)), -1: host_arena}
        self.waker = waker
        self.timeout_s = timeout_s
        self._base = control.__array_interface__["data"][0]
        self._n, self._k = layout.n_ranks, layout.mailbox_slots
        self._posted_at, self._mailbox_at = layout.posted_at, layout.mailbox_at
        self.yields = _YIELDS_BEFORE_SLEEP
        self.pump = None        # set by the channel while buffered sends wait for slots
        self._near = _near_ranks(rank, cpu_sets)
        self._yields_for: dict = {}

    def yields_for(self, peers: tuple) -> int:
        """How many times a wait for ``peers`` (global ranks) yields before it sleeps:
        ``yields``, or 0 when the devices are pinned, none of ``peers`` shares a CPU with
        this rank, and another device does (see the module docstring). Memoised per
        tuple of peers."""
        near = self._near
        if not near:                    # not pinned, or alone on its CPUs: spin freely
            return self.yields
        n = self._yields_for.get(peers)
        if n is None:
            n = self._yields_for[peers] = self.yields if any(p in near for p in peers) else 0
        return n

    # --- addresses of futex words ---------------------------------------------------
    def address_of(self, view: np.ndarray, index: tuple) -> int:
        """Address of the int64 word ``view[index]`` (a view into the control words)."""
        start = view.__array_interface__["data"][0]
        return start + sum(i * s for i, s in zip(index, view.strides))

    def progress_address(self, rank: int, slot: int) -> int:
        return self._base + 8 * (self.layout.progress_at + rank * self.layout.n_slots + slot)

    def posted_address(self, src: int, dst: int) -> int:
        """Address of ``posted[src, dst]`` (arithmetic: ``address_of`` builds the view's
        array interface on every call, ~3 us; a message wakes or waits on two words)."""
        return self._base + 8 * (self._posted_at + src * self._n + dst)

    def state_address(self, src: int, dst: int, slot: int) -> int:
        """Address of the state word of mailbox slot ``mailbox[src, dst, slot]``."""
        return self._base + 8 * (self._mailbox_at + ((src * self._n + dst) * self._k + slot)
                                 * SLOT_WORDS + S.STATE)

    def wake(self, view: np.ndarray, index: tuple) -> None:
        self.waker.wake(self.address_of(view, index))

    # --- the abort word -------------------------------------------------------------
    def abort(self, rank: int, why: int) -> None:
        """Tell every device to give up its waits (first writer wins the reason)."""
        if self.header[ABORT] == 0:
            self.header[ABORT_RANK] = rank
            self.header[ABORT_KIND] = why
            self.header[ABORT] = 1
        self.waker.wake(self.address_of(self.header, (ABORT,)))

    def check_abort(self) -> None:
        if self.header[ABORT]:
            who, why = int(self.header[ABORT_RANK]), int(self.header[ABORT_KIND])
            raise DeviceAborted(f"rank {self.rank}: run aborted because rank {who} "
                                f"{_ABORT_WHY.get(why, 'failed')}")

    # --- waiting --------------------------------------------------------------------
    def wait(self, blocker: Blocker, describe: Callable[[], str],
             timeout_s: float | None = None, peers: tuple | None = None) -> None:
        """Return when ``blocker()`` is None; else sleep on the word it names.

        ``blocker`` returns None when the wait is over, or ``(address, value)``: the
        futex word to sleep on and the value it was seen to hold. ``peers``: the global
        ranks it waits for, which decide how often it yields the CPU before sleeping
        (:meth:`yields_for`; ``self.yields`` when not given).
        """
        blocked = blocker()
        if blocked is None:
            return
        n = self.yields if peers is None else self.yields_for(peers)
        if n:
            spin_end = time.perf_counter() + _SPIN_BUDGET_S
            for _ in range(n):
                os.sched_yield()
                blocked = blocker()
                if blocked is None:
                    return
                if time.perf_counter() > spin_end:
                    break
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit_s
        while blocked is not None:
            self.check_abort()
            if self.pump is not None:
                self.pump()
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(f"rank {self.rank} timed out after {limit_s:g} s "
                                        f"{describe()}")
            nap = _PUMP_NAP_S if self.pump is not None else _NAP_S
            self.waker.sleep(blocked[0], blocked[1], min(left, nap))
            blocked = blocker()


def _near_ranks(rank: int, cpu_sets) -> frozenset:
    """The other ranks that share a CPU with ``rank``: empty when the devices are not
    pinned, ``rank`` is the host (-1), or no other rank uses its CPUs."""
    if cpu_sets is None or not 0 <= rank < len(cpu_sets):
        return frozenset()
    mine = set(cpu_sets[rank])
    return frozenset(r for r, cpus in enumerate(cpu_sets) if r != rank and mine & set(cpus))


def fabric_from_segments(rank: int, layout: ControlLayout, control, arenas: list, host_arena,
                         wait: str, timeout_s: float, cpu_sets: tuple | None = None) -> Fabric:
    """Build a Fabric over mapped :class:`~vcluster.runtime.segments.Segment` objects.

    The arena that ``rank`` owns (the host's for -1) grows through its segment's file
    descriptor, which must stay open while the fabric is used. ``cpu_sets``: each rank's
    CPUs when the devices are pinned (the waits' yields depend on them), else None."""
    from .futex import make_waker
    words = np.frombuffer(control.buf, np.int64, count=layout.total_words)
    device_arenas = [Arena(r, np.frombuffer(seg.buf, np.uint8), seg.fd if r == rank else None)
                     for r, seg in enumerate(arenas)]
    host = Arena(-1, np.frombuffer(host_arena.buf, np.uint8),
                 host_arena.fd if rank == -1 else None)
    return Fabric(rank, layout, words, device_arenas, host, make_waker(wait), timeout_s,
                  cpu_sets)
