"""Shared fixtures; how tests share the machine on several workers (tests/machine_share.py)."""

import os

import pytest

from threadpoolctl import threadpool_limits

from vcluster.runtime.cores import usable_cores
from vcluster.runtime.options import PRELOAD_VARIABLE, blas_thread_environment

from .machine_share import MachineSharePlugin

# Most workers ``-n auto`` starts (the test command's default): the suite's tests start
# device processes of their own, so more workers than this add memory, not speed.
MAX_WORKERS = 4


# What the suite's device processes start with (VirtualCluster's preload, through the
# environment, so the CLI's subprocesses get it too): device programs defined in a test
# module make each device import that module, and with it pytest (~0.09 s of CPU), and
# most programs run pipeline_parallel's layers (~0.13 s with tensor_parallel). Imported
# once in each cluster's launcher instead of in each of its devices, the suite's CPU
# time (user + sys) fell from ~1135 to ~996 s on the 2-core development machine
# (benchmarks/README.md, "The test suite's time").
SUITE_PRELOAD = "pytest,pipeline_parallel"


def pytest_configure(config):
    os.environ.setdefault(PRELOAD_VARIABLE, SUITE_PRELOAD)
    config.pluginmanager.register(MachineSharePlugin(), "vcluster-machine-share")
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        _share_blas_threads(max(1, usable_cores() // workers))


def _share_blas_threads(threads: int) -> None:
    """On a pytest-xdist worker: at most ``threads`` BLAS/OpenMP threads in this process
    (threadpoolctl: numpy is loaded already) and in the processes it starts (the
    variables, unless set; a cluster's launcher sets its devices' own), as
    VirtualCluster sizes its devices' pools. With each worker's references on every core,
    OpenBLAS's threads spun while the other workers' tests held the cores: the suite took
    548 s and 996 s of CPU, 520 s and 941 s with one thread per worker (2 cores,
    benchmarks/README.md, "The test suite's time")."""
    threadpool_limits(threads)
    for name, value in blas_thread_environment(threads).items():
        os.environ.setdefault(name, value)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may use (its affinity mask and cgroup
    quota: ``usable_cores``), at most MAX_WORKERS."""
    return min(usable_cores(), MAX_WORKERS)


@pytest.fixture(scope="module")
def cluster_of():
    """``cluster_of(mesh, algorithm=None)``: one VirtualCluster per mesh (and collective
    algorithm, None: the default), started on first use and kept for the test module (a
    run costs milliseconds, a start ~0.2-0.4 s)."""
    from vcluster import VirtualCluster

    clusters = {}

    def get(mesh, algorithm=None):
        key = (mesh, algorithm)
        if key not in clusters:
            extra = {} if algorithm is None else {"algorithm": algorithm}
            clusters[key] = VirtualCluster(mesh, timeout_s=30.0, run_timeout_s=300.0, **extra)
        return clusters[key]

    yield get
    for cluster in clusters.values():
        cluster.close()
