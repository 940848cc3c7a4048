"""A device's counters and trace: what ``cluster.stats()`` and ``cluster.trace()`` read.

Counters are derived from the recorded events plus the host-transfer bytes, so the two
can never disagree. Thread-safe: a device's program and its communication thread both
record.
"""

from __future__ import annotations

import threading

from .events import CommEvent, ComputeEvent

__all__ = ["Recorder", "STAT_COLUMNS", "PEER_COLUMNS", "MEMORY_KINDS", "MemoryPeaks"]

#: what a program may say it holds (``dev.record_memory``); stats keep each one's peak
MEMORY_KINDS = ("params", "grads", "optimizer", "activations")
STAT_COLUMNS = ("rank", "messages_sent", "bytes_sent", "messages_received", "bytes_received",
                "h2d_bytes", "d2h_bytes", "flops", "arena_bytes_in_use", "arena_peak_bytes",
                "arena_committed_bytes") + tuple(f"peak_{k}_bytes" for k in MEMORY_KINDS)
PEER_COLUMNS = ("rank", "peer", "messages_sent", "bytes_sent", "messages_received",
                "bytes_received")


class MemoryPeaks:
    """The most bytes of each :data:`MEMORY_KINDS` a program said it held at once
    (``dev.record_memory(params=..., ...)``), since the last reset. The program counts
    (a training executor knows which arrays are parameters, gradients, optimizer state,
    activations); the engines only keep the peaks, so emulator, tracer and torch agree."""

    def __init__(self):
        self.peaks = dict.fromkeys(MEMORY_KINDS, 0)

    def __repr__(self) -> str:
        return f"MemoryPeaks({self.peaks})"

    def record(self, held: dict) -> None:
        for kind, nbytes in held.items():
            if kind not in MEMORY_KINDS:
                raise ValueError(f"record_memory: unknown kind {kind!r}; the kinds are "
                                 f"{MEMORY_KINDS}")
            if int(nbytes) < 0:
                raise ValueError(f"record_memory: {kind}={nbytes} bytes; must be >= 0")
            self.peaks[kind] = max(self.peaks[kind], int(nbytes))

    def columns(self) -> dict:
        """``peak_{kind}_bytes`` per kind (the stats columns)."""
        return {f"peak_{k}_bytes": v for k, v in self.peaks.items()}


class Recorder:
    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with getattr(self, "_lock"):
            self._events: list = []     # events, and (build, args) of ones built when read
            self.h2d_bytes = 0
            self.d2h_bytes = 0
            self.memory = MemoryPeaks()

    def record(self, event: CommEvent | ComputeEvent) -> None:
        with self._lock:
            self._events.append(event)

    def record_later(self, build, args: tuple) -> None:
        """The event ``build(*args)``, built when the events are read (``args`` must not
        change afterwards): a small collective's whole cost is a few tens of
        microseconds, and building its frozen dataclass with sorted peer pairs was ~5% of it."""
        with self._lock:
            self._events.append((build, args))

    def record_compute(self, name: str, flops: float, nbytes: int, start: float,
                       end: float) -> None:
        """A :class:`ComputeEvent`, built when the events are read: a training step ends
        ~130 compute blocks per device, and building each frozen dataclass at once was
        ~40% of a block's cost."""
        with self._lock:
            self._events.append((ComputeEvent, (self.rank, name, flops, nbytes, start, end)))

    @property
    def events(self) -> list:
        """Every event recorded since the last reset, in order."""
        with self._lock:
            return self._built()

    def _built(self) -> list:
        events = self._events
        for i, e in enumerate(events):
            if type(e) is tuple:          # (build, args) of record_later / record_compute
                events[i] = e[0](*e[1])
        return events

    def add_transfer(self, h2d_bytes: int = 0, d2h_bytes: int = 0) -> None:
        with self._lock:
            self.h2d_bytes += h2d_bytes
            self.d2h_bytes += d2h_bytes

    def record_memory(self, held: dict) -> None:
        with self._lock:
            self.memory.record(held)

    def totals(self) -> dict:
        """The recorded part of one row of ``cluster.stats()`` (the device adds the
        arena columns, which the arena itself counts)."""
        with self._lock:
            events = self._built()
            comm = [e for e in events if isinstance(e, CommEvent)]
            return {
                "rank": self.rank,
                "messages_sent": sum(e.messages_sent for e in comm),
                "bytes_sent": sum(e.bytes_sent for e in comm),
                "messages_received": sum(e.messages_received for e in comm),
                "bytes_received": sum(e.bytes_received for e in comm),
                "h2d_bytes": self.h2d_bytes,
                "d2h_bytes": self.d2h_bytes,
                "flops": sum(e.flops for e in events if isinstance(e, ComputeEvent)),
                **self.memory.columns(),
            }

    def per_peer(self) -> list[dict]:
        """Rows of ``cluster.stats(per_peer=True)``: one per peer this rank talked to.

        For message algorithms a message is a message; for ``shm`` one access to a
        peer's buffer counts as one message.
        """
        rows: dict[int, dict] = {}
        with self._lock:
            for e in self._built():
                if not isinstance(e, CommEvent):
                    continue
                for key, pairs in (("sent", e.sent), ("received", e.received)):
                    for peer, nbytes, messages in pairs:
                        row = rows.setdefault(peer, {"rank": self.rank, "peer": peer,
                                                     "messages_sent": 0, "bytes_sent": 0,
                                                     "messages_received": 0,
                                                     "bytes_received": 0})
                        row[f"messages_{key}"] += messages
                        row[f"bytes_{key}"] += nbytes
        return [rows[p] for p in sorted(rows)]
