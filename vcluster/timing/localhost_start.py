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
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["START_S", "SPIN_S", "timed_run", "timed_run_cpu", "run_wall_s", "measure_start",
           "start_figures",
           "prepare_traces", "RUN_START", "FIRST_CALL", "COLD_CALL", "COLD_STRETCH"]

START_S = 0.01          # devices start their program this long after rank 0 announces it
SPIN_S = 0.002          # ... sleeping until this long before it, then spinning (a sleep's
#                         wake-up is ~0.25 ms late on a virtual machine)
START_REPS = 15         # runs of each start program per cluster size, alternating (median)
RUN_START = "run start"             #: the name of the op of a rank's start
FIRST_CALL = "first call (start)"   #: ... and of the extra work of its first synchronisation
COLD_CALL = "cold call"             #: ... and of a call's extra after other work
COLD_STRETCH = "cold stretch"       #: ... and of the extra of work after a blocking call


def timed_run(dev, program, *args) -> tuple[float, float]:
    """Run ``program(dev, *args)`` from an instant all devices agree on; (that instant,
    this device's end). After its end each device waits for the others in a barrier
    (a futex: no CPU) rather than reply to the host while they still run."""
    start, end, _ = timed_run_cpu(dev, program, *args)
    return start, end


def timed_run_cpu(dev, program, *args) -> tuple[float, float, float]:
    """:func:`timed_run`, and the process time this device spent in ``program``:
    (start, end, CPU seconds)."""
    dev.barrier()
    start = float(dev.broadcast(np.array([time.perf_counter() + START_S]), root=0)[0])
    wait = start - SPIN_S - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    while time.perf_counter() < start:
        pass
    cpu0 = time.process_time()
    program(dev, *args)
    end = time.perf_counter()
    cpu_s = time.process_time() - cpu0
    dev.barrier()
    return start, end, cpu_s


def run_wall_s(spans) -> float:
    """The wall time of one timed run from its devices' :func:`timed_run` (or
    :func:`timed_run_cpu`) replies: the last end less the first start."""
    return max(span[1] for span in spans) - min(span[0] for span in spans)


def _empty_program(dev) -> None:
    pass


def _one_call_program(dev, x) -> None:
    dev.all_reduce(x)


def measure_start(sizes, call_cpu_s, throughput) -> tuple:
    """``((devices, W0, f), ...)`` for each cluster size of ``sizes`` (module docstring);
    ``call_cpu_s(d)``: CPU per member of a 4 KiB all_reduce over ``d`` devices on ``d``;
    ``throughput(d)``: the pool's ``T(d)``."""
    from mesh import Mesh
    from vcluster.runtime.cluster import VirtualCluster
    rows = []
    x = np.ones(512)
    for d in sizes:
        programs = {"empty": (_empty_program,), "call": (_one_call_program, x)}
        runs: dict = {name: [] for name in programs}
        with VirtualCluster(Mesh((d,), ("x",))) as cluster:
            for rep in range(START_REPS + 1):           # alternating: drift hits both alike
                for name, args in programs.items():
                    spans = cluster.run(timed_run, [args] * d)
                    if rep:                             # the first of each: a warm-up
                        runs[name].append(run_wall_s(spans))
        walls = {name: float(np.median(r)) for name, r in runs.items()}
        c, t = call_cpu_s(d), throughput(d)
        extra = max(0.0, walls["call"] - walls["empty"] - d * c / t)
        rows.append((d, walls["empty"], 1.0 + extra * t / (d * c)))
    return tuple(rows)


def start_figures(rows, devices: int) -> tuple[float, float]:
    """(W0, f) of a spec's ``start_s`` rows for a cluster of ``devices``: linear between
    its sizes, the nearest outside; (0, 1) without rows or for one device."""
    from .localhost_calls import linear_clamped
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
      communication adds (``model.gap_extra_s``, :mod:`.localhost_gap`);
    * host-timed traces, before every blocking call (a collective or a receive) and at
      the end, what the work since the rank's previous blocking call (or its start) costs
      more for resuming cold (:class:`.localhost_gap.ColdStretch`).
    """
    from vcluster.runtime.tracing.host import HOST_OP
    from vcluster.runtime.tracing.ops import DeviceTrace, TraceCollective, TraceCompute, TraceRecv

    from .localhost_gap import ColdStretch
    wall, factor = start_figures(model.spec.start_s, model.n_devices)
    n = model.n_devices
    start = TraceCompute(RUN_START, 0.0, 0, seconds=wall * model.core_pool.throughput_at(n) / n)
    gap_extra = model.gap_extra_s if model.spec.call_gap_cpu_s is not None else None
    cold = ColdStretch.of_spec(model.spec) if model.host_timed and n > 1 else None
    out = []
    for t in traces:
        ops, first, previous = [start] if wall > 0.0 else [], True, None
        work = 0.0                               # since the rank's last communication
        stretch = 0.0                            # ... and its last blocking call
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
                _add_work(ops, COLD_STRETCH, cold.extra(n, stretch))
                stretch = 0.0
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
        if cold is not None:
            _add_work(ops, COLD_STRETCH, cold.extra(n, stretch))
        out.append(DeviceTrace(t.rank, tuple(ops)))
    return out


def _add_work(ops: list, name: str, seconds: float) -> None:
    """Append a work op of ``seconds`` named ``name`` to ``ops`` (nothing for 0)."""
    from vcluster.runtime.tracing.ops import TraceCompute
    if seconds > 0.0:
        ops.append(TraceCompute(name, 0.0, 0, seconds=seconds))
