"""The traffic a trace predicts, in the form the emulator records it.

``trace_comm_signature(trace)`` and ``comm_signature(events, rank)`` both give, per
communication group (a collective's member tuple, or the (rank, peer) pair of a send or
receive), the ordered list of (operation, algorithm, sent, received) with sent/received
as (peer, bytes, messages) tuples. The invariant of the project — the emulator moves
exactly what the trace predicts — is ``trace_comm_signature(t) == comm_signature(...)``.
"""

from __future__ import annotations

from ..events import CommEvent
from ..traffic import collective_traffic
from .ops import DeviceTrace, TraceCollective, TraceRecv, TraceSend

__all__ = ["trace_comm_signature", "comm_signature"]


def trace_comm_signature(trace: DeviceTrace) -> dict:
    out: dict = {}
    me = trace.rank
    for op in trace.ops:
        if isinstance(op, TraceCollective):
            t = collective_traffic(op.collective, op.algorithm, op.group, op.group.index(me),
                                   op.nbytes, op.itemsize, op.root)
            key, entry = op.group, (op.collective, op.algorithm, t.sent, t.received)
        elif isinstance(op, TraceSend):
            pair = ((op.peer, op.nbytes, 1),) if op.peer != me else ()
            key, entry = (me, op.peer), ("send", "p2p", pair, ())
        elif isinstance(op, TraceRecv):
            pair = ((op.peer, op.nbytes, 1),) if op.peer != me else ()
            key, entry = (me, op.peer), ("recv", "p2p", (), pair)
        else:
            continue
        out.setdefault(key, []).append(entry)
    return out


def comm_signature(events, rank: int) -> dict:
    """The same, from the emulator's CommEvents of ``rank`` (ordered by start time)."""
    out: dict = {}
    mine = sorted((e for e in events if isinstance(e, CommEvent) and e.rank == rank),
                  key=lambda e: e.start)
    for e in mine:
        out.setdefault(e.group, []).append((e.collective, e.algorithm, e.sent, e.received))
    return out
