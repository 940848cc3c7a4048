"""The host's cores as one pool that every device's CPU work shares (processor sharing).

Emulated devices are processes on a machine with few cores: when k of them have work, the
operating system time-slices the cores among them. :class:`CorePool` models that as an
egalitarian processor-sharing server: ``k`` jobs in progress each advance at

    rate(k) = T(k) / k   single-core seconds per second,
    T(k)    = 1 + (S - 1) (min(k, C) - 1) / (C - 1)     (T = 1 when C = 1)

where ``C`` is the number of cores and ``S = T(C)`` the measured aggregate throughput of
all cores busy, in units of one busy core (``S = C`` for ideal cores; less when the
cores share execution units or memory bandwidth). With ``S = C``, ``T(k) = min(k, C)``:
N equal jobs of ``w`` seconds started together on C <= N cores all end at ``N w / C``.

A job is a number of *single-core seconds* (what the work takes on one otherwise idle
core). :class:`CorePoolSpec` is the pool's frozen description (what
:func:`~vcluster.timing.engine.simulate_trace` takes); :class:`CorePool` runs in one
replay's SimPy environment (nothing is shared between replays).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

__all__ = ["CorePoolSpec", "CorePool", "as_core_pool"]

# A job whose remaining work is below this fraction of its size when the pool's clock
# reaches its predicted end is done: float rounding of (work - elapsed * rate).
_DONE_REL = 1e-9


@dataclass(frozen=True)
class CorePoolSpec:
    """``cores`` cores whose aggregate throughput, all busy, is ``speedup`` single cores.

    ``speedup`` defaults to ``cores`` (ideal cores); it must lie in ``(0, cores]``.
    """

    cores: int
    speedup: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool):
            raise TypeError(f"CorePoolSpec: cores must be an int >= 1, got {self.cores!r}")
        try:
            cores = operator.index(self.cores)
        except TypeError:
            raise TypeError(f"CorePoolSpec: cores must be an int >= 1, "
                            f"got {self.cores!r}") from None
        if cores < 1:
            raise ValueError(f"CorePoolSpec: cores must be >= 1, got {cores}")
        s = float(cores) if self.speedup is None else self.speedup
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= cores \
                or not math.isfinite(s):
            raise ValueError(f"CorePoolSpec: speedup (aggregate throughput of all {cores} "
                             f"cores busy, in single cores) must lie in (0, {cores}], "
                             f"got {self.speedup!r}")
        object.__setattr__(self, "cores", cores)
        object.__setattr__(self, "speedup", float(s))

    def throughput(self, k: int) -> float:
        """``T(k)``: single-core seconds of work done per second with ``k`` jobs in progress."""
        if k <= 0:
            return 0.0
        c = self.cores
        if c == 1:
            return 1.0
        return 1.0 + (self.speedup - 1.0) * (min(k, c) - 1) / (c - 1)


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
        return self.spec.throughput(k) / k if k else 0.0

    def submit(self, work_s: float):
        """An event that succeeds once ``work_s`` single-core seconds have been served."""
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
