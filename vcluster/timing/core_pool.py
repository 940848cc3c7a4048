"""The host's cores as one pool that every device's CPU work shares (processor sharing).

Emulated devices are processes on a machine with few cores: when k of them have work, the
operating system time-slices the cores among them. :class:`CorePool` models that as an
egalitarian processor-sharing server: ``k`` jobs in progress each advance at

    rate(k) = T(k) / k   single-core seconds per second,

``T(k)`` being the pool's aggregate throughput with ``k`` busy jobs, in units of one
busy core. Ideal cores have ``T(k) = min(k, C)``: N equal jobs of ``w`` seconds started
together on C <= N cores all end at ``N w / C``. A measured pool gives ``T`` at a few
job counts (``throughput``: ``(k, T(k))`` points; ``T(1) = 1``); between them ``T`` is
linear in ``k``, beyond the last point constant (real cores lose a little to context
switches and caches when oversubscribed, and may share execution units).

A job is a number of *single-core seconds* (what the work takes alone on one otherwise
idle core). :class:`CorePoolSpec` is the pool's frozen description (what
:func:`~vcluster.timing.engine.simulate_trace` takes); :class:`CorePool` runs in one
replay's SimPy environment (nothing is shared between replays).

With ``placements`` the spec stands for the operating system's per-core run queues
instead (:mod:`.core_queues`): each placement (the core of every rank) is replayed
and the replay at the weighted median step time is the result; compute ops named in
``mobile_ops`` are a communication call's work charged ahead of it, spread over the
cores like the calls' own shares.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from mesh.arguments import as_int

from .replay_state import Call, cost_value
from .results import Interval, Stream

__all__ = ["CorePoolSpec", "CorePool", "as_core_pool", "PooledReplayMixin"]

# A job whose remaining work is below this fraction of its size when the pool's clock
# reaches its predicted end is done: float rounding of (work - elapsed * rate).
_DONE_REL = 1e-9


@dataclass(frozen=True)
class CorePoolSpec:
    """``cores`` cores; ``throughput`` the measured ``(jobs, T(jobs))`` points (default
    none: ideal cores, ``T(k) = min(k, cores)``). Each point needs ``jobs >= 2`` and
    ``0 < T <= min(jobs, cores)``. ``placements``: ``((core of each rank, ...), weight)``
    pairs, all of one length (default none: one pool); ``mobile_ops``: names of compute
    ops served as communication work (module docstring)."""

    cores: int
    throughput: tuple = ()
    placements: tuple = ()
    mobile_ops: frozenset = frozenset()

    def __post_init__(self) -> None:
        cores = as_int(self.cores, "CorePoolSpec: cores", 1)
        try:
            points = tuple(sorted((operator.index(k), float(t)) for k, t in self.throughput))
        except (TypeError, ValueError):
            raise TypeError(f"CorePoolSpec: throughput must be (jobs, T) pairs, got "
                            f"{self.throughput!r}") from None
        for k, t in points:
            if k < 2 or not 0 < t <= min(k, cores) or not math.isfinite(t):
                raise ValueError(f"CorePoolSpec: throughput point ({k}, {t}) needs jobs >= 2 "
                                 f"and 0 < T <= min(jobs, cores={cores})")
        if len({k for k, _ in points}) != len(points):
            raise ValueError(f"CorePoolSpec: throughput lists a job count twice: {points}")
        object.__setattr__(self, "cores", cores)
        object.__setattr__(self, "throughput", points)
        object.__setattr__(self, "placements", _placements(self.placements, cores))
        if isinstance(self.mobile_ops, str):
            raise TypeError(f"CorePoolSpec: mobile_ops must be a collection of op names, got "
                            f"{self.mobile_ops!r}")
        object.__setattr__(self, "mobile_ops", frozenset(self.mobile_ops))

    def throughput_at(self, k: int) -> float:
        """``T(k)``: single-core seconds of work done per second with ``k`` jobs in progress."""
        if k <= 0:
            return 0.0
        if not self.throughput:
            return float(min(k, self.cores))
        lo_k, lo_t = 1, 1.0
        for hi_k, hi_t in self.throughput:
            if k <= hi_k:
                return lo_t + (hi_t - lo_t) * (k - lo_k) / (hi_k - lo_k)
            lo_k, lo_t = hi_k, hi_t
        return lo_t


def _placements(value, cores: int) -> tuple:
    try:
        out = tuple((tuple(operator.index(c) for c in p), float(w)) for p, w in value)
    except (TypeError, ValueError):
        raise TypeError(f"CorePoolSpec: placements must be (cores of the ranks, weight) "
                        f"pairs, got {value!r}") from None
    for p, w in out:
        if not p or len(p) != len(out[0][0]) or not all(0 <= c < cores for c in p) \
                or not 0 < w < math.inf:
            raise ValueError(f"CorePoolSpec: placement {p} (weight {w}) needs one core in "
                             f"0..{cores - 1} per rank, as many ranks as the others, and a "
                             f"positive weight")
    return out


def as_core_pool(value) -> CorePoolSpec | None:
    """``None``, an int (ideal cores) or a :class:`CorePoolSpec`, as a spec or None."""
    if value is None or isinstance(value, CorePoolSpec):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"core_pool must be None, an int number of cores or a CorePoolSpec, "
                        f"got {value!r}")
    return CorePoolSpec(value)


class CorePool:
    """Processor sharing over ``spec`` in the SimPy environment ``env``.

    ``submit(work_s)`` returns an event that succeeds when ``work_s`` single-core seconds
    of work are done. Between two changes of the job set every job advances at
    ``rate(k)``; the next completion is rescheduled at every arrival and departure.
    """

    def __init__(self, env, spec: CorePoolSpec):
        self.env, self.spec = env, spec
        self._jobs: dict[int, list] = {}           # id -> [remaining_s, size_s, event]
        self._next_id = 0
        self._clock = env.now                      # when remaining_s were last updated
        self._version = 0                          # invalidates stale completion timers
        self.busy_s = 0.0                          # total single-core seconds served

    def __len__(self) -> int:
        return len(self._jobs)

    def rate(self) -> float:
        """Progress per second of each job in progress (single-core seconds / s)."""
        k = len(self._jobs)
        return self.spec.throughput_at(k) / k if k else 0.0

    def submit(self, work_s: float, rank=None, mobile: bool = True, wakes=None):
        """An event that succeeds once ``work_s`` single-core seconds have been served
        (whose work it is does not matter to one pool)."""
        event = self.env.event()
        if not work_s > 0.0:
            event.succeed()
            return event
        self._advance()
        self._jobs[self._next_id] = [float(work_s), float(work_s), event]
        self._next_id += 1
        self.busy_s += work_s
        self._reschedule()
        return event

    def _advance(self) -> None:
        now = self.env.now
        elapsed = now - self._clock
        if elapsed > 0.0 and self._jobs:
            done = elapsed * self.rate()
            for job in self._jobs.values():
                job[0] -= done
        self._clock = now

    def _reschedule(self) -> None:
        self._version += 1
        if not self._jobs:
            return
        first = min(job[0] for job in self._jobs.values())
        delay = max(first, 0.0) / self.rate()
        version = self._version
        self.env.timeout(delay).callbacks.append(lambda _ev: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:               # the job set changed since: stale timer
            return
        self._advance()
        first = min(job[0] for job in self._jobs.values())
        finished = [jid for jid, (left, size, _) in self._jobs.items()
                    if left <= first or left <= _DONE_REL * size]
        for jid in finished:
            self._jobs.pop(jid)[2].succeed()
        self._reschedule()


class PooledReplayMixin:
    """The core-pool steps of :class:`~vcluster.timing.replay.Replay`.

    With a pool, durations the cost model gives are single-core seconds of work:

    * ``TraceCompute``: its whole duration is served by the pool (it ends when served).
    * A collective, once started: each traced member's share ``collective_cpu_s(op,
      position)`` (0 when the model lacks the method) is served; the call ends when every
      share is, plus the rest of its duration, ``max(0, collective_time_s - max share)``,
      as wall time (so on idle cores it lasts exactly ``collective_time_s``).
    * Point to point: ``p2p_cpu_s(src, dst, nbytes) -> (sender, receiver)`` (default
      ``(0, 0)``): the sender's share blocks its stream before the transfer (the
      emulator's ``send`` copies the payload before it returns), the transfer lasts the
      rest of ``p2p_time_s``, and the receiver's share is served once the data is there.

    The pool sees only traced ranks, so it is not combined with symmetric mode.
    """

    def _init_pool(self, spec: CorePoolSpec | None, placement=None) -> None:
        if spec is None:
            self.pool = None
        elif placement is None:
            self.pool = CorePool(self.env, spec)
        else:
            from .core_queues import CoreQueues
            self.pool = CoreQueues(self.env, spec, placement)
        self.mobile_ops = frozenset() if spec is None else spec.mobile_ops
        self.pending: dict[Call, int] = {}          # call -> member shares not yet served
        self.p2p_parts: dict = {}                   # (src, dst, nbytes) -> shares

    def _serve(self, rank: int, t: float, work_s: float, p2p=None, mobile: bool = False):
        """Pool mode: from local time ``t``, have ``work_s`` of ``rank``'s work served
        (``mobile``: a call's work charged ahead of it, after which the rank has not
        blocked); -> (start, end). ``p2p`` = (op index, op) books the time as this rank's
        point-to-point copy."""
        env = self.env
        if work_s <= 0.0:
            return t, t
        if t > env.now:
            yield env.timeout(t - env.now)
        start = env.now
        yield self.pool.submit(work_s, rank, mobile, False)
        if p2p is not None:
            self.comm_s[rank] += env.now - start
            if self.timelines is not None:
                self.timelines[rank].append(Interval(*p2p, start, env.now, Stream.P2P))
        return start, env.now

    def _p2p_duration(self, src: int, dst: int, op) -> float:
        """How long the transfer of send ``op`` occupies its link (pool: the wall rest)."""
        if self.pool is not None:
            return self._p2p_shares(src, dst, op.nbytes)[0]
        key = (src, dst, op.nbytes)
        d = self.p2p_cache.get(key)
        if d is None:
            d = self.p2p_cache[key] = cost_value(self.costs.p2p_time_s(src, dst, op.nbytes),
                                                 "p2p_time_s", op)
        return d

    def _p2p_shares(self, src: int, dst: int, nbytes: int) -> tuple[float, float, float]:
        """Pool mode: (wall rest of the transfer, sender's work, receiver's work)."""
        key = (src, dst, nbytes)
        parts = self.p2p_parts.get(key)
        if parts is None:
            what = f"send {src}->{dst} of {nbytes} bytes"
            total = cost_value(self.costs.p2p_time_s(src, dst, nbytes), "p2p_time_s", what)
            split = getattr(self.costs, "p2p_cpu_s", None)
            shares = (0.0, 0.0) if split is None else split(src, dst, nbytes)
            snd, rcv = (cost_value(x, "p2p_cpu_s", what) for x in shares)
            parts = self.p2p_parts[key] = (max(0.0, total - snd - rcv), snd, rcv)
        return parts

    def _start_pooled(self, call: Call, t: float, d: float) -> None:
        """Pool mode: serve each traced member's share; then the wall rest of ``d``."""
        call.start_s = t
        split = getattr(self.costs, "collective_cpu_s", None)
        shares = {m: 0.0 if split is None else
                  cost_value(split(call.op, call.info.position[m]), "collective_cpu_s", call.op)
                  for m in call.info.traced}
        for m in call.info.traced:
            self.inflight[m].append(call)
        rest = max(0.0, d - max(shares.values(), default=0.0))
        busy = [m for m, w in shares.items() if w > 0.0]
        self.pending[call] = len(busy)
        for m in busy:
            self.pool.submit(shares[m], m, True).callbacks.append(
                lambda _ev, call=call, rest=rest: self._share_done(call, rest))
        if not busy:
            self._share_done(call, rest, counted=False)

    def _share_done(self, call: Call, rest: float, counted: bool = True) -> None:
        if counted:
            self.pending[call] -= 1
            if self.pending[call]:
                return
        del self.pending[call]
        t, end = call.start_s, self.env.now + rest
        call.end_s = end
        if end > self.last_s:
            self.last_s = end
        for m in call.info.traced:
            self.comm_s[m] += end - t
        if self.timelines is not None:
            for m, (i, op) in call.calls.items():
                self.timelines[m].append(Interval(i, op, t, end, Stream.COMM))
        self.env.timeout(rest, call).callbacks.append(self._end)
