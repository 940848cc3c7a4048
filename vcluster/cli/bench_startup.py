"""``vcluster bench startup``: bring up N devices and run a first no-op, timed.

The baseline, measured in the same command, is starting one Python interpreter that
imports numpy (``python -c "import numpy"``): the least any process-based device can
cost. The figure of merit is the wall time from ``VirtualCluster(mesh)`` to the return
of the first ``run`` of a no-op program, median over ``repeat`` bring-ups.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

__all__ = ["measure_startup"]


def _noop(dev):
    return None


def measure_startup(devices: int, repeat: int) -> dict:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    from vcluster import VirtualCluster
    baseline, startup, first_run = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import numpy"], check=True)
        baseline.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with VirtualCluster(Mesh((devices,), ("x",))) as cluster:
            t1 = time.perf_counter()
            cluster.run(_noop)
            t2 = time.perf_counter()
        startup.append(t1 - t0)
        first_run.append(t2 - t0)
    return {"devices": devices, "repeat": repeat,
            "python_numpy_start_s": float(np.median(baseline)),
            "cluster_start_s": float(np.median(startup)),
            "start_and_first_run_s": float(np.median(first_run))}
