"""Trace events: what one device did, and when.

The emulator records these with measured times (``time.perf_counter`` seconds, one
clock for every process of the machine); the tracer and the timing model use the same
types with predicted times. Both are small frozen dataclasses, so a trace is plain data.

Byte accounting per algorithm (``sent``/``received`` map peer rank -> bytes):

* message algorithms (ring, tree, pairwise, send/recv): the payload bytes of each message,
  counted once by the sender (``sent``) and once by the receiver (``received``);
* the shared-memory direct algorithm (``shm``): the bytes a device *writes into* a peer's
  buffer count as sent to that peer, the bytes it *reads from* a peer's buffer count as
  received from that peer. A device's own buffer costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ComputeEvent", "CommEvent", "Event", "PeerTotals"]


class PeerTotals:
    """Totals over ``sent`` / ``received``: tuples of (peer, bytes, messages)."""

    sent: tuple
    received: tuple

    @property
    def bytes_sent(self) -> int:
        return sum(b for _, b, _ in self.sent)

    @property
    def bytes_received(self) -> int:
        return sum(b for _, b, _ in self.received)

    @property
    def messages_sent(self) -> int:
        return sum(m for _, _, m in self.sent)

    @property
    def messages_received(self) -> int:
        return sum(m for _, _, m in self.received)


@dataclass(frozen=True)
class ComputeEvent:
    """``flops`` floating-point operations touching ``bytes`` of memory on ``rank``."""

    rank: int
    name: str
    flops: float
    bytes: int
    start: float
    end: float

    @property
    def duration_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CommEvent(PeerTotals):
    """One collective or point-to-point operation as seen by ``rank``.

    ``group`` is the ordered tuple of member ranks (for send/recv: the two ranks),
    ``nbytes`` the size of the local input (of the output for receives),
    ``sent``/``received`` tuples of (peer rank, bytes, messages), sorted by peer, and
    ``tag`` the user tag of send/recv (for collectives: the call number on its group),
    ``transport`` where the data moved: ``"host"`` (shared host memory; device arrays
    staged through it) or ``"ipc"`` (device memory read in place by peers,
    :mod:`vcluster.runtime.device_memory`).
    """

    rank: int
    collective: str
    group: tuple[int, ...]
    algorithm: str
    nbytes: int
    sent: tuple[tuple[int, int, int], ...]
    received: tuple[tuple[int, int, int], ...]
    tag: int
    start: float
    end: float
    transport: str = "host"

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @classmethod
    def from_counts(cls, rank: int, collective: str, group: tuple[int, ...], algorithm: str,
                    nbytes: int, sent: dict, received: dict, tag: int, start: float,
                    end: float, transport: str = "host") -> "CommEvent":
        """The event of a call that counted ``sent``/``received`` as peer -> [bytes,
        messages] (what a collective accumulates while it runs), pairs sorted by peer."""
        return cls(rank, collective, group, algorithm, int(nbytes), _pairs(sent),
                   _pairs(received), tag, start, end, transport)


def _pairs(counts: dict) -> tuple:
    """((peer, bytes, messages), ...) sorted by peer, from peer -> [bytes, messages]."""
    return tuple((p, b, m) for p, (b, m) in sorted(counts.items()))


Event = ComputeEvent | CommEvent
