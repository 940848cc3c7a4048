"""The SimPy replay of symbolic traces (:mod:`vcluster.runtime.tracing.ops`).

Every traced rank has a **compute stream** (one SimPy process running its ops in order)
and a **communication stream per group** (a FIFO of its asynchronous collectives on that
group, as each process group's NCCL communicator has a stream of its own: a tensor-parallel
reduction is not queued behind a data-parallel one; a cost model with
``comm_stream_per_group = False`` — the emulator's, whose devices run one FIFO
communication thread each — gets one stream per rank). Semantics:

* ``TraceCompute`` runs for ``costs.compute_time_s(op) * slowdown[rank]``; a cost model
  with ``rank_costs(rank)`` (a cluster of several GPU kinds,
  :class:`~vcluster.timing.cluster_cost.ClusterCostModel`) prices each rank's compute
  ops with the model it returns for that rank (its own device's).
* A collective call is matched across the members of ``op.group`` by its order among the
  member's calls on that group (the k-th call of a on G matches the k-th call of b on G).
  A member *arrives* at a blocking call when its compute stream reaches it, and at an
  asynchronous call (``handle`` set) when its communication stream for that group
  reaches it (the stream runs one collective at a time, in issue order). The collective
  starts when the last member arrives and lasts ``costs.collective_time_s(op,
  concurrent)``, ``concurrent`` being 1 + the most other collectives in flight at that
  instant on any one (traced) member; collectives starting at the same instant all count
  each other. A blocking call holds the compute stream until the end; ``TraceWait(handle)``
  holds it until that collective's end; collectives still un-waited when a trace ends are
  waited for there (a stream synchronise ends the step).
* ``TraceSend`` does not block: the transfer starts at ``max(send time, link free)`` on the
  link ``(src, dst)`` (one transfer at a time, FIFO) and lasts ``costs.p2p_time_s``. A
  cost model may name *ports* a transfer also occupies (``costs.p2p_ports(src, dst)``: the
  hardware model names the sender's NIC and the receiver's NIC when the two are on
  different nodes): transfers sharing a port run one after another, in the order of
  their send times (ties: the order the replay reaches them) — so W workers' messages to
  one parameter server queue at its NIC.
  ``TraceRecv`` completes at ``max(receive reached, transfer end)`` of the matching send
  (same ``(src, dst, tag)``, in order).
* **Symmetric mode**: a group may hold untraced ranks; they are assumed to mirror the
  traced members (to arrive when they arrive), so a collective waits only for its traced
  members. Sends to untraced ranks occupy their link and are dropped; receiving from an
  untraced rank is an error (trace one representative per pipeline stage) — but for a
  ring's steps (a tag of :func:`~vcluster.runtime.tracing.ops.is_ring_tag`: a
  tensor-parallel collective matmul, whose members all do what the traced one does,
  sending each step's chunk before receiving the next), where it mirrors this rank's own
  sends: the k-th receive with ring tag T from untraced ranks completes as this rank's
  k-th send with tag T to an untraced rank ends (with no such send before it, an error).

How time advances. A rank's process keeps a local clock ``t >= env.now`` and runs compute
ops, sends, and receives / waits whose data is already known without yielding: their
times follow from max-plus arithmetic. It yields only when it needs a fact not yet known
(a send not yet issued, a collective not yet started). A waiting rank goes on as soon as the
collective's end time is known — at its start, without a core pool: it resumes from the
event that starts the collective (or from the collective's ``done`` event, made only when
someone waits before the start is scheduled) with its local clock at the end; only
collectives issued asynchronously keep an event at their end (their streams' next
collective starts there). A blocking collective whose only traced member is this rank,
issued while the rank's communication streams are idle, starts at once with no event at
all: nothing else can start beside it on that rank, so its price is already known
(:meth:`~.replay_collectives.CollectiveReplayMixin._start_now`). Because a rank may thus
run far ahead of ``env.now``, a send on a cost model with shared *ports* first lets the
environment catch up with the rank's clock, so ports are claimed in send-time order, not
in the order the ranks happen to run. Every fact is registered at an
environment time no later than its own timestamp, so collective starts, which need the
set of collectives in flight, are processed at their exact instant: by one event of
priority :data:`LATE` per instant, after every other event of that instant.

If the environment runs out of events while a rank has ops left, :class:`ReplayDeadlock`
names every stuck rank and what it waits for.

**Core pool** (optional ``core_pool``, off by default): the devices share a few cores
(processor sharing) that serve compute, collective shares and send/receive copies as work,
so devices working at once slow each other down (:class:`~.core_pool.PooledReplayMixin`);
with a ``placement`` (the core of each rank) the cores keep per-core queues instead
(:mod:`.core_queues`).

The collective steps (matching, starting an instant's calls together, ending them) live
in :class:`~.replay_collectives.CollectiveReplayMixin`; this module holds the driver,
each rank's compute stream and the point-to-point links.
"""

from __future__ import annotations

from collections import deque

import simpy
from simpy.events import Event

from vcluster.runtime.tracing.ops import (TraceCollective, TraceCompute, TraceRecv, TraceSend,
                                          TraceWait, is_ring_tag)

from .core_pool import PooledReplayMixin
from .replay_collectives import CollectiveReplayMixin
from .replay_state import (LATE, Call, GroupInfo, ReplayDeadlock, cost_value, describe_call,
                           describe_recv)
from .results import Interval, Stream

__all__ = ["ReplayDeadlock", "Replay", "LATE"]

_COMPUTE, _P2P, _WAIT = Stream.COMPUTE, Stream.P2P, Stream.WAIT
_new = tuple.__new__                                       # Interval without its __new__ wrapper
_UNSEEN = object()
OTHER = "other"                    #: the kind of work before a rank's first compute op


class Replay(CollectiveReplayMixin, PooledReplayMixin):
    """One replay: its own ``simpy.Environment`` and all state (nothing is shared).

    ``traces`` maps rank -> op tuple; ``slowdown`` rank -> compute-time factor; ``record``
    whether to keep timelines; ``placement`` the core of each rank (per-core queues, with
    a ``core_pool``); ``op_kind`` name -> op kind and ``collective_kind`` collective ->
    its own kind or None (per-op accounting, see :mod:`vcluster.timing.results`). Call :meth:`run` once; it fills ``end_s``,
    ``compute_s``, ``exposed_s``, ``bubble_s`` (blocked part only), ``comm_s``,
    ``timelines``, ``last_s`` and, with ``op_kind``, ``kind_compute_s`` / ``kind_comm_s``.
    """

    def __init__(self, traces: dict, costs, *, symmetric: bool, slowdown: dict,
                 record: bool, limit: int | None = None, core_pool=None, op_kind=None,
                 collective_kind=None, placement=None):
        self.env = simpy.Environment()
        self._init_pool(core_pool, placement)
        self.traces, self.costs, self.symmetric = traces, costs, symmetric
        self.slowdown, self.limit = slowdown, limit
        ranks = list(traces)
        self.groups: dict[tuple, GroupInfo] = {}
        self.open_calls: dict[tuple, Call] = {}            # (group, k) -> call
        self.call_count = {r: {} for r in ranks}           # rank -> {group: calls so far}
        self.batches: dict[float, list[Call]] = {}         # start instant -> calls
        self.inflight = {r: [] for r in ranks}             # rank -> end times
        # a communication stream per rank and group: group -> FIFO of (call, issued at);
        # one per rank (key None) for a cost model whose devices run a single FIFO
        self.queue = {r: {} for r in ranks}
        self.stream_busy = {r: set() for r in ranks}      # rank -> streams running
        self.stream_per_group = bool(getattr(costs, "comm_stream_per_group", True))
        self.handles = {r: {} for r in ranks}              # rank -> {handle: call}
        self.links: dict[tuple, tuple] = {}                # (src, dst) -> (free, busy since)
        self.ports: dict = {}                              # port -> free (costs.p2p_ports)
        self._p2p_ports = getattr(costs, "p2p_ports", None)
        self.history = {r: deque() for r in ranks}         # async calls, issue order
        self.mail: dict[tuple, deque] = {}                 # (src, dst, tag) -> transfers
        # symmetric mode: (rank, tag) -> its transfers to untraced ranks, which the
        # receives from untraced ranks mirror (module docstring)
        self.mirrors: dict[tuple, deque] = {}
        self.recv_waiters: dict[tuple, Event] = {}
        self.waiting: dict[int, tuple] = {}                # rank -> (op index, op, call)
        self.compute_cache: dict = {}                      # id(op) -> seconds
        # a cost model per rank (costs.rank_costs): its compute prices, cached per model
        self._rank_costs = getattr(costs, "rank_costs", None)
        self.model_caches: dict = {}                       # id(model) -> (model, cache)
        self.p2p_cache: dict = {}
        self.comm_s = dict.fromkeys(ranks, 0.0)
        self.end_s, self.compute_s, self.exposed_s, self.bubble_s = {}, {}, {}, {}
        self.timelines = {r: [] for r in ranks} if record else None
        self.last_s = 0.0
        self.op_kind = op_kind                             # name -> kind (None: inherit)
        self.collective_kind = collective_kind             # collective -> kind or None
        self.kind_cache: dict = {}
        self.collective_kind_cache: dict = {}              # id(op) -> collective_kind(op)
        self.kind_compute_s = {r: {} for r in ranks} if op_kind is not None else None
        self.kind_comm_s = {r: {} for r in ranks} if op_kind is not None else None

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        procs = {r: self.env.process(self._rank(r)) for r in self.traces}
        try:
            self.env.run()
        except Exception as exc:                           # SimPy re-raises a copy of the
            original = exc.__cause__                       # process's error: raise the original
            if type(original) is type(exc):
                raise original from None
            raise
        stuck = {r: self._why_stuck(r) for r, p in procs.items() if p.is_alive}
        if stuck:
            raise ReplayDeadlock(self.env.now, stuck)

    # ------------------------------------------------------------------ compute stream
    def _rank(self, rank: int):
        ops = self.traces[rank]
        slow = self.slowdown.get(rank, 1.0)
        tl = self.timelines[rank] if self.timelines is not None else None
        cache, costs = self.compute_cache, self.costs
        if self._rank_costs is not None:                   # this rank's own device
            costs = self._rank_costs(rank)
            if costs is not self.costs:
                cache = self.model_caches.setdefault(id(costs), (costs, {}))[1]
        handles, mail, pool = self.handles[rank], self.mail, self.pool
        ports = self._p2p_ports is not None
        t = busy = exposed = bubble = 0.0
        i, n = 0, len(ops)
        drain = None
        kinds = None if self.kind_compute_s is None else self.kind_compute_s[rank]
        kind_comm = None if kinds is None else self.kind_comm_s[rank]
        kind, unclaimed = OTHER, 0.0       # the last compute op's kind; receive time ahead
        while True:
            if i < n:
                op = ops[i]
                cls = op.__class__
                if cls is TraceCompute:
                    d = cache.get(id(op))                  # ops outlive the replay
                    if d is None:
                        d = cache[id(op)] = cost_value(costs.compute_time_s(op), "compute_time_s",
                                                   op)
                    if slow != 1.0:
                        d *= slow
                    if pool is not None and d > 0.0:       # served by the shared cores
                        t, end = yield from self._serve(rank, t, d, None,
                                                        op.name in self.mobile_ops)
                        d = end - t
                    if tl is not None:
                        tl.append(_new(Interval, (i, op, t, t + d, _COMPUTE)))
                    t += d
                    busy += d
                    if kinds is not None:
                        kind = self._kind_of(op.name, kind)
                        kinds[kind] = kinds.get(kind, 0.0) + d
                        if unclaimed:                      # receives feed this op
                            kind_comm[kind] = kind_comm.get(kind, 0.0) + unclaimed
                            unclaimed = 0.0
                    i += 1
                    continue
                if cls is TraceSend:
                    if ports and t > self.env.now:
                        # ports are shared: claim them in send-time order (below)
                        yield self.env.timeout(t - self.env.now)
                    if pool is not None:                   # the sender's copy, then the send
                        share = self._p2p_shares(rank, op.peer, op.nbytes)[1]
                        t = (yield from self._serve(rank, t, share, (i, op)))[1]
                    d = self._send(rank, i, op, t)
                    if kinds is not None:
                        kind_comm[kind] = kind_comm.get(kind, 0.0) + d
                    i += 1
                    continue
                if cls is TraceRecv:
                    key = (op.peer, rank, op.tag)
                    mirrored = op.peer not in self.traces and is_ring_tag(op.tag)
                    q = self._mirror(rank, i, op) if mirrored else mail.get(key)
                    if q:
                        start, end, nbytes, since = q.popleft()
                        if not q and not mirrored:
                            del mail[key]
                    else:
                        self._check_peer(rank, i, op, sending=False)
                        ev = self.recv_waiters[key] = self.env.event()
                        self.waiting[rank] = (i, op, None)
                        start, end, nbytes, since = yield ev
                        del self.waiting[rank]
                    if nbytes != op.nbytes:
                        raise ValueError(
                            f"rank {rank} op #{i} {op!r}: the matching send of rank {op.peer} "
                            f"(tag {op.tag}) carries {nbytes} bytes, not {op.nbytes}")
                    if not is_ring_tag(op.tag):   # a ring's transfer counts at its sender
                        self.comm_s[rank] += end - start
                        if kinds is not None:
                            unclaimed += end - start
                    if tl is not None:
                        tl.append(_new(Interval, (i, op, start, end, _P2P)))
                elif cls is TraceCollective:
                    own = None
                    if kinds is not None:
                        own = None if self.collective_kind is None else \
                            self._collective_kind_of(op)
                        own = kind if own is None else own
                    call = self._issue(rank, i, op, t, own)
                    if op.handle is not None:
                        i += 1
                        continue
                elif cls is TraceWait:
                    call = handles.pop(op.handle, None)
                    if call is None:
                        raise ValueError(
                            f"rank {rank} op #{i} {op!r}: no asynchronous collective with "
                            f"handle {op.handle} is outstanding (outstanding: "
                            f"{sorted(handles)})")
                else:
                    raise TypeError(f"rank {rank} op #{i}: expected a trace op (TraceCompute, "
                                    f"TraceCollective, TraceSend, TraceRecv, TraceWait), got "
                                    f"{op!r}")
            else:                                          # end: wait for un-waited handles
                if drain is None:
                    drain = list(handles.values())
                    handles.clear()
                if not drain:
                    break
                cls, op, call = None, None, drain.pop(0)
            if cls is not TraceRecv:
                if call.end_s is None:
                    self.waiting[rank] = (i, op, call)
                    yield call.late if call.late is not None and pool is None else \
                        self._done(call)
                    del self.waiting[rank]
                since, end = call.start_s, call.end_s
            if end > t:                                    # blocked over [t, end]
                if cls is TraceCollective or cls is TraceRecv:
                    ex = end - (since if since > t else t)
                else:
                    ex = self._stream_overlap(rank, call, t, end)
                exposed += ex
                bubble += (end - t) - ex
                if tl is not None:
                    tl.append(_new(Interval, (i, op, t, end, _WAIT)))
                t = end
            if cls is TraceRecv and pool is not None:     # the receiver's copy out
                share = self._p2p_shares(op.peer, rank, op.nbytes)[2]
                t = (yield from self._serve(rank, t, share, (i, op)))[1]
            if i < n:
                i += 1
        if unclaimed:                                      # receives after the last compute
            kind_comm[kind] = kind_comm.get(kind, 0.0) + unclaimed
        self.end_s[rank], self.compute_s[rank] = t, busy
        self.exposed_s[rank], self.bubble_s[rank] = exposed, bubble

    # ------------------------------------------------------------------ point to point
    def _check_peer(self, rank: int, i: int, op, sending: bool) -> None:
        peer = op.peer
        if peer == rank:
            raise ValueError(f"rank {rank} op #{i} {op!r}: a rank cannot "
                             f"{'send to' if sending else 'receive from'} itself")
        if self.limit is not None and not 0 <= peer < self.limit:
            raise ValueError(f"rank {rank} op #{i} {op!r}: peer {peer} is outside the mesh "
                             f"(valid ranks 0..{self.limit - 1})")
        if peer not in self.traces and (not self.symmetric or not sending):
            hint = ("trace one representative per pipeline stage so that every receive's "
                    "peer is traced" if self.symmetric else
                    "pass every rank's trace, or symmetric=True to let untraced ranks mirror "
                    "traced ones")
            verb = "sends to" if sending else "receives from"
            raise ValueError(f"rank {rank} op #{i} {op!r} {verb} rank {peer}, which has no "
                             f"trace; {hint}")

    def _send(self, rank: int, i: int, op, t: float) -> float:
        dst = op.peer
        link = (rank, dst)
        state = self.links.get(link)
        if state is None:
            self._check_peer(rank, i, op, sending=True)
            state = (-1.0, 0.0)
        free, since = state
        d = self._p2p_duration(rank, dst, op)
        ports = self._p2p_ports(rank, dst) if self._p2p_ports is not None else ()
        port_free = max((self.ports.get(p, -1.0) for p in ports), default=-1.0)
        if t > free:
            since = t                                      # the link was idle: a new busy run
            start = max(t, port_free)                      # ... once its ports are free
        else:
            start = max(free, port_free)                   # queued: the link's busy run goes on
        end = start + d
        self.links[link] = (end, since)
        for p in ports:
            self.ports[p] = end
        self.comm_s[rank] += d
        if end > self.last_s:
            self.last_s = end
        if self.timelines is not None:
            self.timelines[rank].append(_new(Interval, (i, op, start, end, _P2P)))
        if dst in self.traces:
            key = (rank, dst, op.tag)
            ev = self.recv_waiters.pop(key, None)
            if ev is not None:
                ev.succeed((start, end, op.nbytes, since))
            else:
                self.mail.setdefault(key, deque()).append((start, end, op.nbytes, since))
        elif is_ring_tag(op.tag):                          # symmetric ring: the mirror
            self.mirrors.setdefault((rank, op.tag), deque()).append(
                (start, end, op.nbytes, since))
        return d

    def _mirror(self, rank: int, i: int, op):
        """The queue whose head is the transfer mirroring ``op``, a receive from an
        untraced rank (module docstring); ValueError when nothing mirrors it."""
        if not self.symmetric:
            self._check_peer(rank, i, op, sending=False)       # raises: no trace, not symmetric
        q = self.mirrors.get((rank, op.tag))
        if not q:
            raise ValueError(
                f"rank {rank} op #{i} {op!r} receives from rank {op.peer}, which has no trace, "
                f"before rank {rank} has sent a tag-{op.tag} message to an untraced rank: an "
                f"untraced peer mirrors the traced rank's own sends (a ring step sends before "
                f"it receives); trace rank {op.peer} too")
        return q

    def _collective_kind_of(self, op) -> str | None:
        """``collective_kind(op)``, asked once per op (ops outlive the replay; a stitched
        trace holds each template op many times)."""
        kind = self.collective_kind_cache.get(id(op), _UNSEEN)
        if kind is _UNSEEN:
            kind = self.collective_kind_cache[id(op)] = self.collective_kind(op)
        return kind

    def _kind_of(self, name: str, previous: str) -> str:
        """The kind of compute op ``name`` (``op_kind``; None: the previous op's kind)."""
        kind = self.kind_cache.get(name, _UNSEEN)
        if kind is _UNSEEN:
            kind = self.op_kind(name)
            if kind is not None and not isinstance(kind, str):
                raise TypeError(f"op_kind({name!r}) returned {kind!r}; expected a str or None")
            self.kind_cache[name] = kind
        return previous if kind is None else kind

    # ------------------------------------------------------------------ deadlock report
    def _why_stuck(self, rank: int) -> str:
        i, op, call = self.waiting.get(rank, (None, None, None))
        if i is None:
            return "stopped without waiting (internal error)"
        if call is None:
            return describe_recv(rank, i, op, self.traces, self.waiting)
        return describe_call(rank, i, op, call, self.queue, self.traces, self.waiting)
