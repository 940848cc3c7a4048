"""Emulated runs measured the way the ``localhost`` model predicts them.

With ``hardware: localhost`` and ``run.mode: both``, ``vcluster run`` puts the emulator's
measured step time beside the model's prediction of this very machine
(``summary.predicted_over_measured``). The model replays a program whose devices all
start at t = 0, on warm processes (docs/timing.md), so the emulation is measured as
``vcluster bench predict`` measures it:

* **one warm-up run** first, untimed and discarded: the first run of a program on fresh
  device processes pays for imports, first numpy calls and cold caches — tens of ms on
  8 devices and 2 cores, more than many whole steps;
* then every run **starts at an instant all devices agree on**
  (:func:`~vcluster.localhost.start.timed_call`) and is timed from that instant
  to the last device's end. Timed from the first recorded event instead, a run would
  count the milliseconds over which the host's dispatch wakes the devices one by one.

Each measured run is **the median of** :data:`TIMED_REPEATS` timed runs (the one whose
total is the median; its step times, events and outputs are kept): one run of a few ms
carries this machine's noise, ±10–20% from one run to the next.

The events the start and end protocol itself records (a barrier and a broadcast before
the instant, a barrier after each device's end) are dropped, so the run's traffic is
the program's alone and still equals the trace's.

Every other emulator run is measured the same way but once (no median of repeats), after
``run.warmup`` untimed runs (default 1), and a training run's steps from the instant every
device is running (:func:`all_running`, ``emulate_timed(steady=True)``); the torch engine
keeps the plain runs of :mod:`vcluster.scenario.runner`, after the same warm-up, its
training steps timed from that instant too. So a report's first step is a step, not the
start-up: a quick start's step 0 took 0.12 s against 0.025 s for the others when it was
timed from the first event of the first run, and after the warm-up run still 1.2-1.5x
the others (2026-11-27, steps of 8-9 ms) while it was timed from the common start, which
each device leaves 2.5-4 ms apart on 8 devices and 2 cores.
"""

from __future__ import annotations

__all__ = ["measures_like_localhost", "emulate_timed", "step_times", "within_run",
           "is_update", "all_running", "WARMUP_RUNS", "TIMED_REPEATS"]

WARMUP_RUNS = 1          # untimed runs before the measured ones (as bench predict)
TIMED_REPEATS = 3        # timed runs per measured one, the median kept (bench predict: 3)


def measures_like_localhost(point, engine_name: str) -> bool:
    """Whether ``point``'s emulation is measured with warm-up and a common start: its
    hardware is ``localhost``, it emulates and simulates, on the emulator's devices."""
    from .hardware import LOCALHOST
    return (point.hardware.name == LOCALHOST and point.run.mode == "both"
            and engine_name == "emulator")


def is_update(name) -> bool:
    """Whether a compute event of this name is an optimizer update, which ends a training
    step: ``optimizer``, or ZeRO's ``optimizer (shard)``."""
    return name == "optimizer" or (isinstance(name, str) and name.startswith("optimizer ("))


def step_times(events, training: bool, steps: int, start: float | None = None,
               end: float | None = None, updates_per_step: int = 1) -> list[float]:
    """A run's step times from its events, the first step starting at ``start`` (default:
    the first event): an op's run is one step; a training run's step k ends at the last
    rank's k-th ``optimizer`` event (:func:`is_update`; its ((k + 1)·u)-th with
    ``updates_per_step`` u, as an asynchronous parameter server records one per worker).
    Given the run's ``end``, the last step ends there (what follows the last update is
    the last step's, as in the replay's ``step_time_s``); by default at its last
    optimizer event (op: its last event)."""
    if not events:
        return []
    if start is None:
        start = min(e.start for e in events)
    if not training:
        return [(max(e.end for e in events) if end is None else end) - start]
    ends_by_rank: dict = {}
    for e in sorted((e for e in events if is_update(getattr(e, "name", None))),
                    key=lambda e: e.start):
        ends_by_rank.setdefault(e.rank, []).append(e.end)
    u = updates_per_step
    ends = [max(v[(k + 1) * u - 1] for v in ends_by_rank.values() if len(v) >= (k + 1) * u)
            for k in range(steps)]
    if end is not None and ends:
        ends[-1] = end
    return [b - a for a, b in zip([start] + ends[:-1], ends)]


def all_running(events) -> float | None:
    """The instant every rank of a run is running its program: the latest of the ranks'
    first events (a rank's first event starts as its program does: a compute op, or the
    wait of its first receive or collective). The host wakes the devices one after
    another, 2.5-4 ms apart from first to last for the quick start's 8 devices on 2 cores
    (2026-11-27, steps of 8-9 ms): timed from the first rank's first event, step 0 would
    carry that start-up (max/median of 3 steps 1.12-1.42 over 8 runs; from this instant
    1.01-1.29). None without events."""
    first: dict = {}
    for e in events:
        if e.rank not in first or e.start < first[e.rank]:
            first[e.rank] = e.start
    return max(first.values()) if first else None


def within_run(events, spans) -> list:
    """The events of each rank that lie inside its timed run ``spans[rank]`` =
    (start, end, result, began): the program's own, not the start and end protocol's.
    A rank's run begins at ``began`` (the common start, or later on a rank that reached
    the start protocol late: its broadcast of the start instant then ends after that
    instant, and is still the protocol's)."""
    return [e for e in events if spans[e.rank][3] <= e.start and e.end <= spans[e.rank][1]]


def emulate_timed(workload, point, engine, bar, warmup: int = WARMUP_RUNS,
                  repeats: int = TIMED_REPEATS, steady: bool = False) -> dict:
    """The runner's emulation record (``outputs``, ``events``, ``first_events``,
    ``step_times``, ``records_traffic``) of ``warmup`` untimed runs then timed ones: one
    for a training program (its steps inside, split by :func:`step_times`), ``run.steps``
    for an op, each timed from its common start to the last device's end and each the
    median of ``repeats`` runs. ``steady``: a training program's first step starts when
    every device runs (:func:`all_running`), not at the common start — the devices'
    getting going (2.5-4 ms for 8 devices on 2 cores) is start-up, which the ``localhost``
    model prices (its run-start cost) but a hardware model's steps do not contain."""
    # lazy: keeps vcluster --help fast
    from vcluster.localhost.start import timed_call
    steps, training = point.run.steps, workload.training
    args = list(workload.args_by_rank)
    for k in range(warmup):
        engine.run(workload.program, args)
        bar.advance(f"emulate warm-up {k + 1}")
    timed_args = [(workload.program,) + tuple(a) for a in args]
    events, first_events, times, outputs = [], None, [], None
    for step in range(1 if training else steps):
        runs = []
        for _ in range(repeats):
            engine.reset_stats()
            spans = engine.run(timed_call, timed_args)
            got = within_run(engine.trace(), spans)
            start = min(s for s, _, _, _ in spans)
            if steady and training:
                start = max(start, all_running(got) or start)
            runs.append((step_times(got, training, steps, start=start,
                                    end=max(e for _, e, _, _ in spans),
                                    updates_per_step=getattr(workload, "updates_per_step", 1)),
                         got, [result for _, _, result, _ in spans]))
        runs.sort(key=lambda r: sum(r[0]))
        run_times, got, outputs = runs[len(runs) // 2]
        times += run_times
        events += got
        first_events = got if first_events is None else first_events
        bar.advance(f"emulate step {step + 1}")
    return {"outputs": outputs, "events": events, "first_events": first_events,
            "step_times": times, "records_traffic": True}
