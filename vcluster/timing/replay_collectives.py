"""Collectives in the SimPy replay (:class:`~vcluster.timing.replay.Replay`): matching
calls across a group, starting every call of one instant together, ending them.

A member's k-th call on a group matches the other members' k-th (:meth:`_issue`, which
also queues asynchronous calls on the member's communication stream); the call starts
when its last traced member arrives (:meth:`_arrive`), at a :class:`Late` event of that
instant, so that all calls starting at the same instant count each other as concurrent
(:meth:`_start`); its duration is ``collective_time_s(op, concurrent)``. Without a core
pool the end time is known at the start and waiting ranks resume from it; an
asynchronous call keeps an event at its end, where its streams' next calls arrive
(:meth:`_end`). With a pool, :meth:`~.core_pool.PooledReplayMixin._start_pooled`
serves the members' shares first.
"""

from __future__ import annotations

from collections import deque

from simpy.events import Event

from vcluster.runtime.errors import CollectiveMismatch

from .replay_state import Call, GroupInfo, Late, cost_value
from .results import Interval, Stream

__all__ = ["CollectiveReplayMixin"]

_COMM = Stream.COMM
_new = tuple.__new__                                       # Interval without its __new__ wrapper


class CollectiveReplayMixin:
    """The collective steps of :class:`~vcluster.timing.replay.Replay` (its state: the
    replay's ``groups``, ``open_calls``, ``call_count``, ``batches``, ``inflight``,
    ``queue``, ``stream_busy``, ``handles``, ``history``; a communication stream per rank
    and group, or per rank under ``stream_per_group`` False)."""

    def _group(self, rank: int, i: int, op) -> GroupInfo:
        info = GroupInfo.build(op.group, self.traces, self.symmetric, self.limit,
                               f"rank {rank} op #{i} {op!r}")
        self.groups[op.group] = info
        return info

    def _issue(self, rank: int, i: int, op, t: float, kind: str | None = None) -> Call:
        """Match ``op`` (rank's op #i, reached at local time ``t``) to its call and arrive
        (a blocking call) or queue it on its stream (an asynchronous one); ``kind``: the op
        kind its time is charged to (per-op accounting)."""
        group = op.group
        info = self.groups.get(group) or self._group(rank, i, op)
        pos = info.position.get(rank)
        if pos is None:
            raise ValueError(f"rank {rank} op #{i} {op!r}: rank {rank} is not a member of "
                             f"group {group}")
        counts = self.call_count[rank]
        k = counts.get(group, 0)
        counts[group] = k + 1
        call = self.open_calls.get((group, k))
        if call is None:
            call = self.open_calls[(group, k)] = Call(info, k, op, pos)
        else:
            first = call.op
            if op is not first and (op.collective != first.collective or op.root != first.root
                                    or op.algorithm != first.algorithm):
                other = next(iter(call.calls))
                raise CollectiveMismatch(
                    f"call #{k} on group {group}: rank {rank} (op #{i}) calls "
                    f"{op.collective}(root={op.root}, algorithm={op.algorithm!r}) but rank "
                    f"{other} (op #{call.calls[other][0]}) calls {first.collective}"
                    f"(root={first.root}, algorithm={first.algorithm!r})")
            if pos < call.pos:
                call.op, call.pos = op, pos
        call.calls[rank] = (i, op)
        if kind is not None:
            call.kinds[rank] = kind
        if op.handle is None:
            if len(info.traced) == 1 and not self.stream_busy[rank] and self.pool is None \
                    and self._start_now(call, t):
                return call
            self._arrive(call, t)
            return call
        handles = self.handles[rank]
        if op.handle in handles:
            raise ValueError(f"rank {rank} op #{i} {op!r}: handle {op.handle} is still "
                             f"outstanding (wait for it before reusing it)")
        handles[op.handle] = call
        call.async_ranks.append(rank)
        self.history[rank].append(call)
        busy, stream = self.stream_busy[rank], group if self.stream_per_group else None
        if stream in busy:                                 # the stream is running
            queue = self.queue[rank].get(stream)
            if queue is None:
                queue = self.queue[rank][stream] = deque()
            queue.append((call, t))
        else:
            busy.add(stream)
            self._arrive(call, t)
        return call

    def _arrive(self, call: Call, t: float) -> None:
        call.arrived += 1
        if t > call.ready_s:
            call.ready_s = t
        if call.arrived < len(call.info.traced):
            return
        del self.open_calls[(call.info.group, call.k)]
        s = call.ready_s
        batch = self.batches.get(s)
        if batch is None:
            self.batches[s] = [call]
            delay = s - self.env.now
            call.late = Late(self.env, delay if delay > 0.0 else 0.0, s)
            call.late.callbacks.append(self._start)
        else:
            call.late = batch[0].late
            batch.append(call)

    def _start(self, event: Event) -> None:
        """Start every collective of instant ``t`` together (they count each other)."""
        t = event.value
        batch = self.batches.pop(t)
        inflight, price = self.inflight, self.costs.collective_time_s
        if len(batch) == 1 and len(batch[0].info.traced) == 1 and self.pool is None:
            self._start_alone(batch[0], t)
            return
        if len(batch) == 1:
            load = dict.fromkeys(batch[0].info.traced, 1)
        else:
            load = {}
            for call in batch:
                for m in call.info.traced:
                    load[m] = load.get(m, 0) + 1
        for m in load:
            ends = inflight[m]
            if ends:                                       # pool mode: calls, not end times
                inflight[m] = ends = [e for e in ends if e > t] if self.pool is None else \
                    [c for c in ends if c.end_s is None or c.end_s > t]
            load[m] += len(ends)                           # in flight on m, batch included
        durations = [cost_value(price(call.op, max(map(load.__getitem__, call.info.traced))),
                                "collective_time_s", call.op) for call in batch]
        if self.pool is not None:
            for call, d in zip(batch, durations):
                self._start_pooled(call, t, d)
            return
        tls, comm_s, env, end_call = self.timelines, self.comm_s, self.env, self._end
        for call, d in zip(batch, durations):
            call.start_s, end = t, t + d
            call.end_s = end
            if end > self.last_s:
                self.last_s = end
            for m in call.info.traced:
                inflight[m].append(end)
                comm_s[m] += d
            if call.kinds:
                self._charge(call, d)
            if tls is not None:
                for m, (i, op) in call.calls.items():
                    tls[m].append(_new(Interval, (i, op, t, end, _COMM)))
            if call.done is not None:                      # its end is known: waiters go on
                call.done.succeed()
            if call.async_ranks:                           # their streams move on at the end
                env.timeout(d, call).callbacks.append(end_call)

    def _start_now(self, call: Call, t: float) -> bool:
        """Start a blocking call of a lone traced member at its arrival ``t`` without an
        event, when nothing can start beside it at ``t`` on that member; False (nothing
        done) otherwise.

        Exact, not an approximation: its member's streams are idle (every asynchronous call
        it issued has ended, at an environment time <= now <= t), and its compute stream is
        held by this call, so no other call of the member can start at ``t`` — unless this
        one lasts 0 s, when the member could issue another at the same instant (then the
        event path decides). Its other calls that are still in flight are the blocking
        ones already started, whose ends are known. So :meth:`_start` at instant ``t``
        would count the same concurrency and price the same duration; this saves the
        event and the rank's resumption, the replay's commonest step. The rank then runs
        on ahead of ``env.now``; what depends on the order ranks run in (ports shared by
        transfers) waits for the environment at the rank's sends
        (:class:`~vcluster.timing.replay.Replay`).
        """
        (m,) = call.info.traced
        ends = [e for e in self.inflight[m] if e > t]
        d = self._lone_duration(call, ends)
        if d <= 0.0:
            return False
        del self.open_calls[(call.info.group, call.k)]
        call.arrived, call.ready_s = 1, t
        self.inflight[m] = ends
        self._started_alone(call, t, d)
        return True

    def _start_alone(self, call: Call, t: float) -> None:
        """:meth:`_start` of the most common case, one collective with one traced member."""
        (m,) = call.info.traced
        ends = self.inflight[m]
        if ends:
            self.inflight[m] = ends = [e for e in ends if e > t]
        self._started_alone(call, t, self._lone_duration(call, ends))

    def _lone_duration(self, call: Call, ends: list) -> float:
        """The price of a lone member's ``call`` beside its ``ends`` (the end times of its
        calls still in flight at the start)."""
        return cost_value(self.costs.collective_time_s(call.op, 1 + len(ends)),
                          "collective_time_s", call.op)

    def _started_alone(self, call: Call, t: float, d: float) -> None:
        """Book a lone member's call started at ``t`` lasting ``d``."""
        (m,) = call.info.traced
        call.start_s, end = t, t + d
        call.end_s = end
        if end > self.last_s:
            self.last_s = end
        self.inflight[m].append(end)
        self.comm_s[m] += d
        if call.kinds:
            self._charge(call, d)
        if self.timelines is not None:
            i, op = call.calls[m]
            self.timelines[m].append(_new(Interval, (i, op, t, end, _COMM)))
        if call.done is not None:
            call.done.succeed()
        if call.async_ranks:
            self.env.timeout(d, call).callbacks.append(self._end)

    def _done(self, call: Call) -> Event:
        """The event that fires when ``call``'s end is known (made when first awaited)."""
        if call.done is None:
            call.done = self.env.event()
        return call.done

    def _charge(self, call: Call, d: float) -> None:
        """Book ``d`` seconds of ``call`` to each traced member's kind at its call."""
        for m, kind in call.kinds.items():
            comm = self.kind_comm_s[m]
            comm[kind] = comm.get(kind, 0.0) + d

    def _end(self, event: Event) -> None:
        call = event.value
        if call.done is not None and not call.done.triggered:   # pool mode: the end is now
            call.done.succeed()
        stream = call.info.group if self.stream_per_group else None
        for m in call.async_ranks:                         # next collective of the stream
            q = self.queue[m].get(stream)
            if q:
                nxt, issued = q.popleft()
                self._arrive(nxt, issued if issued > call.end_s else call.end_s)
            else:
                self.stream_busy[m].discard(stream)

    def _stream_overlap(self, rank: int, call: Call, b: float, e: float) -> float:
        """Time of [b, e] during which ``call`` or a collective ahead of it on its group's
        stream runs."""
        hist = self.history[rank]
        while hist and hist[0] is not call and hist[0].end_s is not None \
                and hist[0].end_s <= b:
            hist.popleft()                                 # ended before b: never counts again
        total, group = 0.0, call.info.group if self.stream_per_group else None
        for c in hist:                                     # all ahead of call have started
            if group is not None and c.info.group != group:
                continue                                   # another stream's
            lo = c.start_s if c.start_s > b else b
            hi = c.end_s if c.end_s < e else e
            if hi > lo:
                total += hi - lo
            if c is call:
                break
        return total

