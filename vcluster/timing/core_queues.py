"""The host's cores as per-core run queues: where each device runs, not only how many.

:class:`~.core_pool.CorePool` shares the cores among every job (processor sharing
over the pool): on 2 cores, 8 busy devices always get 2 cores. The operating system keeps
a run queue per core instead, and a device stays on its core (its caches are there):

* **Devices released together split unevenly.** Measured on 2 cores, 8 devices start
  4:4 in about half the runs, 3:5 in most others and 2:6 in a few; 4 devices 2:2 in 85%,
  1:3 in 15% (:func:`~.start.measure_start` counts the splits at every
  calibration). A program of independent work then takes ``max_c n_c w``, not ``N w /
  C``: the 2 x 2 x 2 MatMul without communication took 2.85, 3.49 and 3.75 ms from 4:4,
  3:5 and 2:6.
* **Inside a communication call, members move.** Each member blocks and wakes at every
  message, and a waking task goes to an idle core (Linux ``select_idle_sibling``); a
  collective sweep from 3:5 still reached 1.58–1.87 cores. So a call's work is *mobile*:
  its jobs fill the cores' queues to even lengths (water-filling), and share what they
  get equally.
* **Program work stays put** (*pinned* to its rank's core), and so does what a call
  costs its member before it starts (waiting: spinning and yielding on its own core;
  compute ops not named in the pool's ``mobile_ops``). A rank that resumes after a
  wait moves to an idle core when its own is busy; a core idle beside another that holds
  two ranks' pinned jobs pulls one after :data:`BALANCE_S` (the busy core's scheduler
  tick; a task that just ran is cache-hot for 0.5 ms), which short programs rarely see.

With ``k`` jobs in all, a core holding ``n_c`` of them gives each ``T(k) / min(k, C) /
n_c`` single-core seconds per second (the pool's measured loss to oversubscription,
:class:`~.core_pool.CorePoolSpec`); a mobile job gets the mean rate of the mobile
slots. With every job mobile this is the pool's ``T(k) / k`` exactly.

:func:`start_placements` turns a spec's counted splits into placements (the core of
each rank) with their weights; :func:`~vcluster.timing.engine.simulate_trace` replays
each and reports the replay at the weighted median step time, as a measurement takes the
median of its runs. A cost model asks for per-core queues by giving its ``core_pool``
placements; by default one pool serves every core.
"""

from __future__ import annotations

import random

__all__ = ["CoreQueues", "BALANCE_S", "PLACEMENTS_PER_SPLIT", "start_placements"]

#: How long a core stays idle beside a core with two or more pinned jobs before it pulls
#: one: the kernel's migration cost (0.5 ms, a task that just ran is cache-hot) and about
#: half of the busy core's scheduler tick (CONFIG_HZ=250: 4 ms).
BALANCE_S = 0.5e-3 + 2e-3
#: Random placements replayed per counted split (which ranks share a core matters).
PLACEMENTS_PER_SPLIT = 4

_DONE_REL = 1e-9        # a job this close to done at its predicted end is done: rounding


def start_placements(splits, devices: int, cores: int,
                     per_split: int = PLACEMENTS_PER_SPLIT) -> tuple:
    """``((placement, weight), ...)`` for a cluster of ``devices`` on ``cores`` from the
    spec's ``start_split`` rows ``(devices, counts, runs)``: for each split of this size,
    ``per_split`` placements (``placement[r]`` the core of rank ``r``; the ranks drawn
    at random for each core's count, seeded by the split: the same placements every
    time), each weighing ``runs / per_split``. Empty when no row has this size or the
    machine has one core (then the pool shares every core among every job)."""
    rows = [(tuple(counts), runs) for d, counts, runs in splits or () if d == devices]
    if cores < 2 or not rows:
        return ()
    out = []
    for counts, runs in rows:
        rng = random.Random(f"{devices}:{counts}")
        for _ in range(per_split):
            ranks = list(range(devices))
            rng.shuffle(ranks)
            placement = [0] * devices
            at = 0
            for core, n in enumerate(counts):
                for r in ranks[at:at + n]:
                    placement[r] = core % cores
                at += n
            out.append((tuple(placement), runs / per_split))
    return tuple(out)


class CoreQueues:
    """Per-core run queues over the pool ``spec`` in the SimPy ``env``, ranks starting on
    the cores of ``placement`` (module docstring).

    ``submit(work_s, rank, mobile, wakes)`` returns an event that succeeds once ``work_s``
    single-core seconds of ``rank``'s work are done; ``mobile`` work (a communication
    call's) is spread over the cores, the rest runs on the rank's core; after a job that
    ``wakes`` (a call's share: its member blocked in it; default: ``mobile``) the rank's
    next pinned job may move (a wake-up).
    """

    def __init__(self, env, spec, placement):
        self.env, self.spec, self.cores = env, spec, spec.cores
        self.core_of = dict(enumerate(placement))      # rank -> the core it is on
        self._jobs: dict[int, list] = {}    # id -> [remaining_s, size_s, event, rank,
        #                                     core (None: mobile), wakes]
        self._next_id = 0
        self._clock = env.now
        self._version = 0
        self._last = {}                     # rank -> (end of its last job, did it wake)
        self._stranded_since = None         # since when a core idles beside a queue
        self.busy_s = 0.0
        self.moves = 0                      # ranks moved to another core

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, work_s: float, rank=None, mobile: bool = True, wakes=None):
        event = self.env.event()
        if not work_s > 0.0:
            event.succeed()
            return event
        self._advance()
        core = None if mobile or rank is None else self._place(rank)
        wakes = mobile if wakes is None else bool(wakes)
        self._jobs[self._next_id] = [float(work_s), float(work_s), event, rank, core, wakes]
        self._next_id += 1
        self.busy_s += work_s
        self._reschedule()
        return event

    # --- placement ----------------------------------------------------------------------
    def _loads(self) -> tuple[list, list]:
        """(pinned jobs per core, mobile jobs per core after water-filling)."""
        pinned, mobile = [0] * self.cores, 0
        for job in self._jobs.values():
            if job[4] is None:
                mobile += 1
            else:
                pinned[job[4]] += 1
        filled = [0] * self.cores
        for _ in range(mobile):
            c = min(range(self.cores), key=lambda c: pinned[c] + filled[c])
            filled[c] += 1
        return pinned, filled

    def _place(self, rank) -> int:
        """The core of ``rank``'s new pinned job: its own, unless it resumes after a wait
        (a call, or time without work) while its core is busy and another stands idle."""
        home = self.core_of.setdefault(rank, rank % self.cores)
        last = self._last.get(rank)
        resumes = self.env.now > 0.0 if last is None else last[1] or self.env.now > last[0]
        if not resumes or any(j[3] == rank and j[4] is not None for j in self._jobs.values()):
            return home
        pinned, filled = self._loads()
        if pinned[home] + filled[home]:
            idle = [c for c in range(self.cores) if pinned[c] + filled[c] == 0]
            if idle:
                self.core_of[rank] = home = idle[0]
                self.moves += 1
        return home

    # --- processor sharing per core -----------------------------------------------------
    def _rates(self) -> tuple[list, float]:
        """(progress per second of a pinned job on each core, of a mobile job)."""
        total = len(self._jobs)
        pinned, filled = self._loads()
        each = self.spec.throughput_at(total) / min(total, self.cores)
        per_core = [each / (p + f) if p + f else 0.0 for p, f in zip(pinned, filled)]
        mobile = sum(filled)
        rate = sum(r * f for r, f in zip(per_core, filled)) / mobile if mobile else 0.0
        return per_core, rate

    def _advance(self) -> None:
        now = self.env.now
        elapsed = now - self._clock
        if elapsed > 0.0 and self._jobs:
            per_core, mobile = self._rates()
            for job in self._jobs.values():
                job[0] -= elapsed * (mobile if job[4] is None else per_core[job[4]])
        self._clock = now

    def _times_left(self) -> dict:
        per_core, mobile = self._rates()
        return {jid: max(job[0], 0.0) / (mobile if job[4] is None else per_core[job[4]])
                for jid, job in self._jobs.items()}

    def _reschedule(self) -> None:
        self._version += 1
        if not self._jobs:
            return
        version = self._version
        self.env.timeout(min(self._times_left().values())).callbacks.append(
            lambda _ev: self._wake(version))
        self._arm_balance()

    def _wake(self, version: int) -> None:
        if version != self._version:               # the job set changed since: stale timer
            return
        self._advance()
        left = self._times_left()
        first = min(left.values())
        for jid in [j for j, s in left.items()
                    if s <= first or self._jobs[j][0] <= _DONE_REL * self._jobs[j][1]]:
            job = self._jobs.pop(jid)
            self._last[job[3]] = (self.env.now, job[5])
            job[2].succeed()
        self._reschedule()

    # --- the load balancer --------------------------------------------------------------
    def _stranded(self) -> bool:
        """Whether a core stands idle while another holds pinned jobs of two ranks."""
        pinned, filled = self._loads()
        if all(p + f for p, f in zip(pinned, filled)):
            return False
        ranks = [set() for _ in range(self.cores)]
        for job in self._jobs.values():
            if job[4] is not None:
                ranks[job[4]].add(job[3])
        return max(len(r) for r in ranks) >= 2

    def _arm_balance(self) -> None:
        """Note when a core became stranded-idle; a balance follows if it stays so."""
        if not self._stranded():
            self._stranded_since = None
        elif self._stranded_since is None:
            since = self._stranded_since = self.env.now
            self.env.timeout(BALANCE_S).callbacks.append(lambda _ev: self._balance(since))

    def _balance(self, since: float) -> None:
        """Each idle core pulls the latest-arrived rank of the core with most ranks'
        pinned jobs, if a core has stood idle beside it since ``since``."""
        if self._stranded_since != since:
            return
        self._stranded_since = None
        self._advance()
        while self._stranded():
            pinned, filled = self._loads()
            idle = next(c for c in range(self.cores) if pinned[c] + filled[c] == 0)
            busiest = max(range(self.cores), key=lambda c: len(
                {job[3] for job in self._jobs.values() if job[4] == c}))
            rank = self._jobs[max(j for j, job in self._jobs.items()
                                  if job[4] == busiest)][3]
            for job in self._jobs.values():
                if job[3] == rank and job[4] == busiest:
                    job[4] = idle
            self.core_of[rank] = idle
            self.moves += 1
        self._reschedule()
