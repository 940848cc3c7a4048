"""A device's counters and trace: what ``cluster.stats()`` and ``cluster.trace()`` read.

Counters are derived from the recorded events plus the host-transfer bytes, so the two
can never disagree. Thread-safe: a device's program and its communication thread both
record.
"""

from __future__ import annotations

import threading

from .events import CommEvent, ComputeEvent

__all__ = ["Recorder", "STAT_COLUMNS", "PEER_COLUMNS"]

STAT_COLUMNS = ("rank", "messages_sent", "bytes_sent", "messages_received", "bytes_received",
                "h2d_bytes", "d2h_bytes", "flops", "arena_bytes_in_use", "arena_peak_bytes",
                "arena_committed_bytes")
PEER_COLUMNS = ("rank", "peer", "messages_sent", "bytes_sent", "messages_received",
                "bytes_received")


class Recorder:
    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with getattr(self, "_lock"):
            self.events: list = []
            self.h2d_bytes = 0
            self.d2h_bytes = 0

    def record(self, event: CommEvent | ComputeEvent) -> None:
        with self._lock:
            self.events.append(event)

    def add_transfer(self, h2d_bytes: int = 0, d2h_bytes: int = 0) -> None:
        with self._lock:
            self.h2d_bytes += h2d_bytes
            self.d2h_bytes += d2h_bytes

    def totals(self) -> dict:
        """The recorded part of one row of ``cluster.stats()`` (the device adds the
        arena columns, which the arena itself counts)."""
        with self._lock:
            comm = [e for e in self.events if isinstance(e, CommEvent)]
            return {
                "rank": self.rank,
                "messages_sent": sum(e.messages_sent for e in comm),
                "bytes_sent": sum(e.bytes_sent for e in comm),
                "messages_received": sum(e.messages_received for e in comm),
                "bytes_received": sum(e.bytes_received for e in comm),
                "h2d_bytes": self.h2d_bytes,
                "d2h_bytes": self.d2h_bytes,
                "flops": sum(e.flops for e in self.events if isinstance(e, ComputeEvent)),
            }

    def per_peer(self) -> list[dict]:
        """Rows of ``cluster.stats(per_peer=True)``: one per peer this rank talked to.

        For message algorithms a message is a message; for ``shm`` one access to a
        peer's buffer counts as one message.
        """
        rows: dict[int, dict] = {}
        with self._lock:
            for e in self.events:
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
