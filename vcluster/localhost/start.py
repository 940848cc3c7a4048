"""Devices that start a program together, and what that start costs on ``localhost``.

The replay starts every rank at t = 0. To measure a program the same way, its devices
agree on a start instant (rank 0's clock + :data:`START_S`, broadcast; one clock serves
every process of the machine), sleep until :data:`SPIN_S` before it and spin the rest,
run the program, note its end and wait in a barrier until every device has ended
(:func:`timed_run`; ``vcluster bench predict`` measures with it).

Released at once, ``D`` devices on fewer cores pay twice:

* **getting going**: even an empty program takes the time for all ``D`` processes to
  get a core after the instant (context switches: ~0.5 ms on 8 devices and 2 cores);
* **the first synchronisation**: the devices reach their first collective or receive
  far apart, so the early arrivers yield the cores over and over before they sleep,
  and wake up in a queue — the call costs each member about twice its usual CPU.

:func:`measure_start` measures both for each cluster size ``D``, on a cluster of ``D``
devices: the median wall time ``W0`` of an empty program started together, and ``W1``
of one whose only op is a 4 KiB all_reduce over all ``D`` (the two run in turns, so
that the machine's drift — 2x within seconds — moves both alike); with ``c`` that call's CPU
per member (the call table) and ``T`` the pool's throughput, the first call's factor is
``f = 1 + max(0, W1 - W0 - D c / T(D)) T(D) / (D c)``. The ``localhost`` model charges
``W0`` as work every rank does at its start (``W0 T(D) / D`` each, so that the ``D``
ranks together take ``W0``) and ``(f - 1)`` times the CPU of each rank's first
collective or receive before it (:func:`prepare_traces`).

The same runs count how the ``D`` devices were spread over the cores at the instant
(the core each is on, ``sched_getcpu``): 8 devices on 2 cores split 4:4, 3:5 or 2:6.
A device keeps its core through a short program, so the split sets how long the
program's work takes (:mod:`.core_queues`).
"""

from __future__ import annotations

import ctypes
import time
from collections import Counter

import numpy as np

from mesh import Mesh
from vcluster.runtime.cluster import VirtualCluster
from vcluster.runtime.tracing.host import HOST_OP
from vcluster.runtime.tracing.ops import DeviceTrace, TraceCollective, TraceCompute, TraceRecv
from vcluster.timing.engine import simulate_trace

__all__ = ["START_S", "SPIN_S", "timed_run", "timed_run_cpu", "timed_run_core", "timed_call",
           "current_core",
           "run_wall_s", "measure_start", "start_figures", "core_split",
           "prepare_traces", "RUN_START", "FIRST_CALL", "COLD_CALL", "COLD_STRETCH",
           "MOBILE_OPS", "first_call_factor", "queue_start_figures"]

START_S = 0.01          # devices start their program this long after rank 0 announces it
SPIN_S = 0.002          # ... sleeping until this long before it, then spinning (a sleep's
#                         wake-up is ~0.25 ms late on a virtual machine)
CALL_BYTES_START = 4096  # the start program's all_reduce (512 float64)
START_REPS = 15         # runs of each start program per cluster size, alternating (median)
RUN_START = "run start"             #: the name of the op of a rank's start
FIRST_CALL = "first call (start)"   #: ... and of the extra work of its first synchronisation
COLD_CALL = "cold call"             #: ... and of a call's extra after other work
COLD_STRETCH = "cold stretch"       #: ... and of the extra of work after a blocking call
#: The ops above that per-core queues spread over the cores like the calls' own shares:
#: the start's context switches (W0 is the wall of all of them). A call's CPU charged
#: ahead of it is its member waiting (spinning, yielding) on its own core.
MOBILE_OPS = frozenset({RUN_START})


def timed_run(dev, program, *args) -> tuple[float, float]:
    """Run ``program(dev, *args)`` from an instant all devices agree on; (that instant,
    this device's end). After its end each device waits for the others in a barrier
    (a futex: no CPU) rather than reply to the host while they still run."""
    start, end, _ = timed_run_cpu(dev, program, *args)
    return start, end


def timed_run_cpu(dev, program, *args) -> tuple[float, float, float]:
    """:func:`timed_run`, and the process time this device spent in ``program``:
    (start, end, CPU seconds)."""
    return _timed(dev, program, args, False)[:3]


def timed_run_core(dev, program, *args) -> tuple[float, float, int | None]:
    """:func:`timed_run`, and the core this device was on at the instant (None where the
    platform cannot tell): (start, end, core)."""
    start, end, _, core, _, _ = _timed(dev, program, args, True)
    return start, end, core


def timed_call(dev, program, *args) -> tuple[float, float, object, float]:
    """:func:`timed_run`, what ``program`` returned, and when this device began it:
    (start, end, result, began) (``vcluster run`` measures its emulated runs with it where
    ``localhost`` predicts them). ``began`` >= the common ``start``: later where the
    device reached the start protocol late (a loaded machine), so that the protocol's
    own collectives end before it."""
    start, end, _, _, result, began = _timed(dev, program, args, False)
    return start, end, result, began


def _timed(dev, program, args, where: bool) -> tuple:
    """(start, end, CPU seconds, core at the start or None, result, the instant the
    program began) of one timed run."""
    dev.barrier()
    start = float(dev.broadcast(np.array([time.perf_counter() + START_S]), root=0)[0])
    wait = start - SPIN_S - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    while time.perf_counter() < start:
        pass
    core = current_core() if where else None
    cpu0, began = time.process_time(), time.perf_counter()
    result = program(dev, *args)
    end = time.perf_counter()
    cpu_s = time.process_time() - cpu0
    dev.barrier()
    return start, end, cpu_s, core, result, began


def current_core() -> int | None:
    """The core this process runs on (Linux ``sched_getcpu``), or None elsewhere."""
    try:
        core = ctypes.CDLL(None).sched_getcpu()
    except (AttributeError, OSError):
        return None
    return core if core >= 0 else None


def run_wall_s(spans) -> float:
    """The wall time of one timed run from its devices' :func:`timed_run` (or
    :func:`timed_run_cpu`) replies: the last end less the first start."""
    return max(span[1] for span in spans) - min(span[0] for span in spans)


def _empty_program(dev) -> None:
    pass


def _one_call_program(dev, x) -> None:
    dev.all_reduce(x)


def measure_start(sizes, call_cpu_s, pool) -> tuple[tuple, tuple | None]:
    """``(((devices, W0, f), ...), splits)`` for each cluster size of ``sizes`` (module
    docstring); ``call_cpu_s(d)``: CPU per member of a 4 KiB all_reduce over ``d``
    devices on ``d``; ``pool``: the machine's :class:`~.core_pool.CorePoolSpec`.
    ``splits``: rows ``(devices, devices per core, most first (pool.cores entries),
    runs)`` counted over the timed runs, or None where the platform cannot tell a
    process's core. ``f`` is one pool's (:func:`first_call_factor`); a model on per-core
    queues solves its own from the same walls (:func:`queue_start_figures`)."""
    walls, splits = {}, Counter()
    x = np.ones(CALL_BYTES_START // 8)
    for d in sizes:
        programs = {"empty": (_empty_program,), "call": (_one_call_program, x)}
        runs: dict = {name: [] for name in programs}
        with VirtualCluster(Mesh((d,), ("x",))) as cluster:
            for rep in range(START_REPS + 1):           # alternating: drift hits both alike
                for name, args in programs.items():
                    spans = cluster.run(timed_run_core, [args] * d)
                    if rep:                             # the first of each: a warm-up
                        runs[name].append(run_wall_s(spans))
                        splits[d, core_split([s[2] for s in spans], pool.cores)] += 1
        walls[d] = {name: float(np.median(r)) for name, r in runs.items()}
    counted = None if any(split is None for _, split in splits) else \
        tuple(sorted((d, split, n) for (d, split), n in splits.items()))
    return tuple((d, walls[d]["empty"], first_call_factor(
        walls[d]["empty"], walls[d]["call"], d, call_cpu_s(d), pool)) for d in sizes), counted


def core_split(where, cores: int) -> tuple | None:
    """Devices per core, most first, ``cores`` entries, of the cores in ``where`` (one
    per device; None if any is unknown or the cores outnumber ``cores``)."""
    if any(c is None for c in where):
        return None
    counts = sorted(Counter(where).values(), reverse=True)
    if len(counts) > cores:
        return None
    return tuple(counts) + (0,) * (cores - len(counts))


class _OneCall:
    """Costs of the start programs' replay: work ops their ``seconds``, the call ``c``."""

    def __init__(self, call_cpu_s: float):
        self.c = call_cpu_s

    def compute_time_s(self, op) -> float:
        return op.seconds

    def collective_time_s(self, op, concurrent: int = 1) -> float:
        return self.c

    def collective_cpu_s(self, op, position: int) -> float:
        return self.c

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        return 0.0


def first_call_factor(w0: float, w1: float, devices: int, call_cpu_s: float, pool) -> float:
    """``f`` such that the replay of the one-call program on ``pool`` ends at ``w1``: each
    of the ``devices`` ranks does its share of the empty start ``w0 T(D) / D``, then
    ``(f - 1) c`` of waiting on its own core (:data:`FIRST_CALL`), then the call's ``c``.
    One pool gives the closed form ``1 + max(0, w1 - w0 - D c / T) T / (D c)``; a pool with
    placements (per-core queues, :mod:`.core_queues`) the ``f`` found by bisection
    (the closed form its upper bound: uneven queues only lengthen the replay)."""

    d, c, t = devices, call_cpu_s, pool.throughput_at(devices)
    closed = 1.0 + max(0.0, w1 - w0 - d * c / t) * t / (d * c)
    if not pool.placements or closed == 1.0:
        return closed
    call = TraceCollective("all_reduce", tuple(range(d)), CALL_BYTES_START, 8, "shm")

    def wall(f: float) -> float:
        ops = (TraceCompute(RUN_START, 0.0, 0, seconds=w0 * t / d),
               TraceCompute(FIRST_CALL, 0.0, 0, seconds=(f - 1.0) * c), call)
        return simulate_trace([DeviceTrace(r, ops) for r in range(d)], _OneCall(c),
                              core_pool=pool, timeline=False).step_time_s

    lo, hi = 1.0, closed
    if wall(lo) >= w1:
        return 1.0
    for _ in range(40):                                 # to 1e-12 of the bracket
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if wall(mid) < w1 else (lo, mid)
    return (lo + hi) / 2


def queue_start_figures(model) -> tuple[float, float]:
    """(W0, f) for ``model``'s cluster on its per-core queues: the spec's ``f`` (one pool's)
    turned back into the measured one-call wall ``W1 = W0 + (D c / T) f`` and solved again
    on the model's placements (:func:`first_call_factor`); the spec's own figures when
    the model replays on one pool or lacks the call table."""
    wall, factor = start_figures(model.spec.start_s, model.n_devices)
    pool, n = model.core_pool, model.n_devices
    if not pool.placements or model.spec.call_cpu_s is None or factor == 1.0:
        return wall, factor
    if "start" not in model._memo:                     # ~0.1 s of replays: once a model
        c = model._calls.seconds("all_reduce", n, n)
        w1 = wall + n * c / pool.throughput_at(n) * factor
        model._memo["start"] = (wall, first_call_factor(wall, w1, n, c, pool))
    return model._memo["start"]


def start_figures(rows, devices: int) -> tuple[float, float]:
    """(W0, f) of a spec's ``start_s`` rows for a cluster of ``devices``: linear between
    its sizes, the nearest outside; (0, 1) without rows or for one device."""
    from .calls import linear_clamped
    if not rows or devices < 2:
        return 0.0, 1.0
    return linear_clamped([d for d, _, _ in rows], [(w, f) for _, w, f in rows], devices)


def prepare_traces(model, traces) -> list:
    """``traces`` with what their context costs the ``localhost`` ``model``, as work ops:

    * the start of a run on all devices at once: first on every rank its share of the
      empty start, ``W0 T(n) / n``; before its first collective or receive, ``(f - 1)``
      times that call's synchronisation CPU (``model.sync_cpu_s``);
    * before every collective that follows other work rather than another call on its
      group (array operations in between, or another op), its cold extra
      (``model.cold_call_s``), plus what the work its rank did since its previous
      communication adds (``model.gap_extra_s``, :mod:`.gaps`);
    * host-timed traces, before every blocking call (a collective or a receive) and at
      the end, what the work since the rank's previous blocking call (or its start) costs
      more for resuming cold (:class:`.gaps.ColdStretch`), except work from a
      receive to a receive or to the end (between messages a rank runs warm, as the
      pipelines measure in the programs themselves: see :mod:`.gaps`).
    """

    from .gaps import ColdStretch
    wall, factor = queue_start_figures(model)
    n = model.n_devices
    start = TraceCompute(RUN_START, 0.0, 0, seconds=wall * model.core_pool.throughput_at(n) / n)
    gap_extra = model.gap_extra_s if model.spec.call_gap_cpu_s is not None else None
    cold = ColdStretch.of_spec(model.spec) if model.host_timed and n > 1 else None
    out = []
    for t in traces:
        ops, first, previous = [start] if wall > 0.0 else [], True, None
        work = 0.0                               # since the rank's last communication
        stretch = 0.0                            # ... and its last blocking call
        resumed_cold = True                      # ... which was not a receive
        for op in t.ops:
            if isinstance(op, TraceCompute):
                if (gap_extra is not None or cold is not None) \
                        and (op.name != HOST_OP or model.host_timed):
                    w = model.compute_time_s(op)
                    work += w
                    stretch += w
                ops.append(op)
                if op.name != HOST_OP or op.array_calls:
                    previous = op                # a loop's bare glue keeps the rhythm
                continue
            collective = isinstance(op, TraceCollective) and len(op.group) > 1
            if cold is not None and (collective or isinstance(op, TraceRecv)):
                if resumed_cold or collective:
                    _add_work(ops, COLD_STRETCH, cold.extra(n, stretch))
                stretch, resumed_cold = 0.0, collective
            if first and (collective or isinstance(op, TraceRecv)):
                first = False
                if factor > 1.0:
                    ops.append(TraceCompute(FIRST_CALL, 0.0, 0,
                                            seconds=(factor - 1) * model.sync_cpu_s(t.rank, op)))
            if collective and not (isinstance(previous, TraceCollective)
                                   and previous.group == op.group):
                position = op.group.index(t.rank)
                extra = model.cold_call_s(op, position)
                if gap_extra is not None:
                    extra += gap_extra(op, position, work)
                if extra > 0.0:
                    ops.append(TraceCompute(COLD_CALL, 0.0, 0, seconds=extra))
            ops.append(op)
            previous, work = op, 0.0
        if cold is not None and resumed_cold:
            _add_work(ops, COLD_STRETCH, cold.extra(n, stretch))
        out.append(DeviceTrace(t.rank, tuple(ops)))
    return out


def _add_work(ops: list, name: str, seconds: float) -> None:
    """Append a work op of ``seconds`` named ``name`` to ``ops`` (nothing for 0)."""
    if seconds > 0.0:
        ops.append(TraceCompute(name, 0.0, 0, seconds=seconds))
