"""Measuring a ``vcluster bench predict`` workload on its devices: the timed runs'
wall times and CPU, and the load the machine's other processes put on it meanwhile
(what ``measured`` spans: :mod:`vcluster.cli.bench_predict`)."""

from __future__ import annotations

import os
import time

from vcluster.localhost.start import run_wall_s, timed_run_cpu

__all__ = ["BackgroundLoad", "processes_cpu_s", "measure_workload", "QUIET_SAMPLE_S",
           "BUSY_MACHINE_CORES"]

QUIET_SAMPLE_S = 0.3                    # the background sample before the timed runs
BUSY_MACHINE_CORES = 0.1                # background load above which a row is flagged


def processes_cpu_s(pids) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used (Linux /proc; OSError,
    ValueError or IndexError elsewhere)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])                # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


class BackgroundLoad:
    """Cores the machine's *other* processes used meanwhile (Linux /proc; else None):
    all busy CPU time less this process's and the devices' over the elapsed time."""

    def __init__(self, pids):
        self.pids, self.cores = [os.getpid(), *pids], None

    @staticmethod
    def _busy_s() -> float:
        with open("/proc/stat") as f:                    # cpu user nice system idle ...
            ticks = [int(v) for v in f.readline().split()[1:9]]
        idle = ticks[3] + ticks[4]                            # idle + iowait
        return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")

    def _ours_s(self) -> float:
        return processes_cpu_s(self.pids)

    def __enter__(self) -> "BackgroundLoad":
        try:
            self._start = (time.perf_counter(), self._busy_s(), self._ours_s())
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None and exc[0] is None:
            try:
                t, busy, ours = time.perf_counter(), self._busy_s(), self._ours_s()
            except (OSError, ValueError, IndexError):
                return
            t0, busy0, ours0 = self._start
            self.cores = max(0.0, (busy - busy0) - (ours - ours0)) / (t - t0)


def measure_workload(cluster, wl, reps: int) -> tuple[list, list, float | None]:
    """Wall times of ``reps`` runs after one warm-up (:mod:`vcluster.cli.bench_predict`), the
    devices' CPU seconds in each (summed over the devices), and the cores other processes
    of the machine used meanwhile (None where unknown)."""
    per_rank = [(wl.program,) + tuple(a) for a in wl.args]
    cluster.run(timed_run_cpu, per_rank)
    walls, cpus = [], []
    with BackgroundLoad(cluster.pids) as background:
        time.sleep(QUIET_SAMPLE_S)                      # the devices idle: all load is others'
        for _ in range(reps):
            spans = cluster.run(timed_run_cpu, per_rank)
            walls.append(run_wall_s(spans))
            cpus.append(sum(c for _, _, c in spans))
    cluster.reset_stats()           # the devices' recorded events: not kept run after run
    return walls, cpus, background.cores
