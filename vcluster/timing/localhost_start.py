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
of one whose only op is a 4 KiB all_reduce over all ``D``; with ``c`` that call's CPU
per member (the call table) and ``T`` the pool's throughput, the first call's factor is
``f = 1 + max(0, W1 - W0 - D c / T(D)) T(D) / (D c)``. The ``localhost`` model charges
``W0`` as work every rank does at its start (``W0 T(D) / D`` each, so that the ``D``
ranks together take ``W0``) and ``(f - 1)`` times the CPU of each rank's first
collective or receive before it (:meth:`~vcluster.timing.localhost.LocalhostCostModel.prepare_traces`).
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["START_S", "SPIN_S", "timed_run", "measure_start", "RUN_START", "FIRST_CALL",
           "COLD_CALL"]

START_S = 0.01          # devices start their program this long after rank 0 announces it
SPIN_S = 0.002          # ... sleeping until this long before it, then spinning (a sleep's
#                         wake-up is ~0.25 ms late on a virtual machine)
START_REPS = 9          # runs of each start program per cluster size (median)
RUN_START = "run start"             #: the name of the op of a rank's start
FIRST_CALL = "first call (start)"   #: ... and of the extra work of its first synchronisation
COLD_CALL = "cold call"             #: ... and of a call's extra after other work


def timed_run(dev, program, *args) -> tuple[float, float]:
    """Run ``program(dev, *args)`` from an instant all devices agree on; (that instant,
    this device's end). After its end each device waits for the others in a barrier
    (a futex: no CPU) rather than reply to the host while they still run."""
    dev.barrier()
    start = float(dev.broadcast(np.array([time.perf_counter() + START_S]), root=0)[0])
    wait = start - SPIN_S - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    while time.perf_counter() < start:
        pass
    program(dev, *args)
    end = time.perf_counter()
    dev.barrier()
    return start, end


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
        walls = {}
        with VirtualCluster(Mesh((d,), ("x",))) as cluster:
            for name, program, args in (("empty", _empty_program, ()),
                                        ("call", _one_call_program, (x,))):
                cluster.run(timed_run, [(program,) + args] * d)              # warm-up
                runs = []
                for _ in range(START_REPS):
                    spans = cluster.run(timed_run, [(program,) + args] * d)
                    runs.append(max(e for _, e in spans) - min(s for s, _ in spans))
                walls[name] = float(np.median(runs))
        c, t = call_cpu_s(d), throughput(d)
        extra = max(0.0, walls["call"] - walls["empty"] - d * c / t)
        rows.append((d, walls["empty"], 1.0 + extra * t / (d * c)))
    return tuple(rows)
