"""The small parts of a replay (:mod:`vcluster.timing.replay`): records, events, errors.

Nothing here is shared between replays: every :class:`~vcluster.timing.replay.Replay`
builds its own records.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from simpy.events import NORMAL, Event

from vcluster.runtime.errors import VClusterError
from vcluster.runtime.tracing.ops import TraceWait

__all__ = ["ReplayDeadlock", "LATE", "Late", "GroupInfo", "Call", "cost_value", "describe_call",
           "describe_recv"]

#: Event priority after SimPy's URGENT (0) and NORMAL (1): a collective start at instant t
#: is decided once every other event of instant t has run.
LATE = NORMAL + 1


class ReplayDeadlock(VClusterError):
    """The replay ran out of events with ranks still holding ops.

    ``stuck`` maps each stuck rank to what it waits for; ``now_s`` is the time it stopped.
    """

    def __init__(self, now_s: float, stuck: dict[int, str]):
        self.now_s, self.stuck = now_s, dict(stuck)
        lines = "\n".join(f"  rank {r}: {why}" for r, why in sorted(stuck.items()))
        super().__init__(f"replay deadlock at t={now_s:.9g} s: {len(stuck)} rank(s) can never "
                         f"finish (stuck ranks {sorted(stuck)}):\n{lines}")


class Late(Event):
    """An already-triggered event processed at ``now + delay`` with priority :data:`LATE`."""

    def __init__(self, env, delay: float, value):
        super().__init__(env)
        self._ok = True
        self._value = value
        env.schedule(self, LATE, delay)


def cost_value(value, method: str, op) -> float:
    """``value`` as a float duration, checked finite and ``>= 0``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"cost model: {method}({op!r}) returned {value!r}; expected a "
                        f"duration in seconds (a float)") from None
    if not 0.0 <= v < math.inf:
        raise ValueError(f"cost model: {method}({op!r}) returned {value!r}; durations must be "
                         f"finite and >= 0")
    return v


@dataclass(frozen=True)
class GroupInfo:
    """A group as the replay sees it: its members, the traced ones, each one's position."""

    group: tuple[int, ...]
    traced: tuple[int, ...]
    position: dict

    @classmethod
    def build(cls, group, traces, symmetric: bool, limit: int | None, where: str) -> "GroupInfo":
        """Validate ``group`` (distinct ranks, inside the mesh, traced unless symmetric)."""
        if not isinstance(group, tuple) or not group:
            raise TypeError(f"{where}: group must be a non-empty tuple of ranks, got {group!r}")
        try:
            members = tuple(operator.index(m) for m in group)
        except TypeError:
            raise TypeError(f"{where}: group must hold int ranks, got {group!r}") from None
        if len(set(members)) != len(members):
            raise ValueError(f"{where}: group {group} lists a rank twice")
        if limit is not None:
            bad = [m for m in members if not 0 <= m < limit]
            if bad:
                raise ValueError(f"{where}: ranks {bad} of group {group} are outside the mesh "
                                 f"(valid ranks 0..{limit - 1})")
        traced = tuple(m for m in members if m in traces)
        untraced = [m for m in members if m not in traces]
        if untraced and not symmetric:
            raise ValueError(f"{where}: members {untraced} of group {group} have no trace; pass "
                             f"every member's trace, or symmetric=True to let untraced members "
                             f"mirror the traced ones")
        return cls(group, traced, {m: p for p, m in enumerate(members)})


class Call:
    """One collective instance: the k-th call on a group, gathering its members' arrivals.

    ``calls`` maps each member that called it to ``(op index, op)``; ``async_ranks`` lists
    the members that issued it asynchronously (their communication streams run it);
    ``op`` is the call of the member with the lowest group position (priced by the model);
    ``kinds`` the op kind each member's time is charged to (per-op accounting only).
    """

    __slots__ = ("info", "k", "op", "pos", "done", "late", "calls", "async_ranks", "arrived",
                 "ready_s", "start_s", "end_s", "kinds")

    def __init__(self, info: GroupInfo, k: int, op, pos: int):
        self.info, self.k, self.op, self.pos = info, k, op, pos
        self.done: Event | None = None                 # fires once the end is known
        self.late: Event | None = None                 # the event that starts it
        self.calls: dict[int, tuple] = {}
        self.async_ranks: list[int] = []
        self.arrived = 0
        self.ready_s = 0.0
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.kinds: dict[int, str] = {}                   # member -> op kind it is charged to

    def __repr__(self) -> str:
        return (f"Call({self.op.collective} on {self.info.group}, call #{self.k}, "
                f"arrived {self.arrived}/{len(self.info.traced)})")


def _status(rank: int, traces, waiting) -> str:
    if rank in waiting:
        i = waiting[rank][0]
        where = "the end of its trace" if i >= len(traces[rank]) else f"op #{i}"
        return f"rank {rank} is stuck itself at {where}"
    return f"rank {rank} finished its trace"


def describe_recv(rank: int, i: int, op, traces, waiting) -> str:
    """Why a receive can never complete."""
    return (f"op #{i} {op!r} waits for a send from rank {op.peer} with tag {op.tag} that never "
            f"comes ({_status(op.peer, traces, waiting)} without sending it)")


def describe_call(rank: int, i: int, op, call: Call, queues, traces, waiting) -> str:
    """Why a blocking collective, a wait or the end-of-trace drain can never complete."""
    c = call.op
    what = f"{c.collective} on group {call.info.group} (call #{call.k} on that group)"
    if op is None:
        head = f"at the end of its trace, waits for un-waited asynchronous {what}"
    elif isinstance(op, TraceWait):
        head = f"op #{i} {op!r} waits for asynchronous {what}"
    else:
        head = f"op #{i} waits in blocking {what}"
    reasons = []
    missing = [m for m in call.info.traced if m not in call.calls]
    if missing:
        states = "; ".join(_status(m, traces, waiting) for m in missing)
        reasons.append(f"ranks {missing} never call it ({states})")
    queued = [m for m in call.calls
              if any(q is call for stream in queues[m].values() for q, _ in stream)]
    for m in queued:
        reasons.append(f"it is queued on rank {m}'s communication stream behind an earlier "
                       f"collective that never completes")
    return f"{head}: " + ("; ".join(reasons) or "it never starts")
