"""``ClusterOptions``: a VirtualCluster's settings, validated where they enter."""

from __future__ import annotations

import importlib.util
import numbers
import os
from dataclasses import dataclass

from mesh import Mesh

from .algorithm import AlgorithmSettings
from .arrays import ARRAY_MODULES
from .capacity import check_capacity, memory_available_bytes, open_files_limit
from .cores import device_cpu_sets, usable_cores, usable_cpus
from .device_memory import TRANSPORTS

__all__ = ["ClusterOptions", "blas_thread_environment"]

_MiB = 1 << 20
# Without a shared-memory file system to ask (not Linux), arenas are fixed at this size.
DEFAULT_ARENA_BYTES = 512 * _MiB
MIN_ARENA_BYTES = 4 * _MiB
# Every process maps every arena, so the ranges of one cluster take (n + 1) x arena_bytes
# of each process's address space: keep that within 8 TiB of x86-64's 128 TiB. Ranges
# cost no memory until committed (vcluster.runtime.arena).
ADDRESS_BUDGET_BYTES = 8 << 40
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "BLIS_NUM_THREADS")
_ARRAY_MODULES = ARRAY_MODULES
_WAITS = ("auto", "futex", "poll")
# The modules every device starts with when VirtualCluster(preload=None): comma-separated
# names, e.g. VCLUSTER_PRELOAD=pytest,pipeline_parallel in a test suite's environment.
PRELOAD_VARIABLE = "VCLUSTER_PRELOAD"


@dataclass(frozen=True)
class ClusterOptions:
    array_module: str
    timeout_s: float
    algorithm: str
    arena_bytes: int
    host_arena_bytes: int
    run_timeout_s: float
    wait: str
    threads_per_device: int = 1
    startup_timeout_s: float = 60.0
    transport: str = "host"              # "ipc" | "host" (resolved from "auto")
    device_arena_bytes: int | None = None    # cupy + ipc: GPU memory each device exports
    cpu_sets: tuple | None = None        # per rank, the CPUs it is pinned to; None: not pinned
    preload: tuple[str, ...] = ()        # modules the launcher imports before the forks

    @classmethod
    def build(cls, mesh, array_module, timeout_s, algorithm, arena_bytes, run_timeout_s,
              wait, shm_free_bytes: int | None,
              threads_per_device: int | None = None, transport: str = "auto",
              device_arena_bytes: int | None = None,
              pin_devices: bool | None = False, preload=None) -> "ClusterOptions":
        """Validated options. Defaults derived from the machine:

        * ``arena_bytes``: the range each arena may grow to,
          ``min(free /dev/shm, ADDRESS_BUDGET_BYTES / (n + 1))``; pages are committed
          as allocations reach them, so every device may use all the free shared memory
          the others leave (:mod:`vcluster.runtime.arena`).
        * ``threads_per_device``: ``max(1, cores // n)`` BLAS/OpenMP threads per device,
          where ``cores`` is what this process may use (:func:`usable_cores`), so that
          the devices together start at most one pool thread per core — or one per device
          when there are more devices than cores (a device's own thread is the floor).
        * ``pin_devices``: False (the default) never pins, None pins the devices when
          there are more of them than cores (``cpu_sets``: consecutive ranks share a CPU,
          :func:`~.cores.device_cpu_sets`), True always; pinning needs
          affinity masks (Linux), without them None pins nothing and True is an error.
        * ``transport``: ``auto`` is ``ipc`` on the device modules (collectives on device
          arrays read peers' device memory in place) and ``host`` on numpy.
        * ``preload``: the modules named by the ``VCLUSTER_PRELOAD`` environment variable
          (comma-separated), none without it (:func:`_preload`).

        Before anything starts, the machine must hold ``mesh.size`` device processes
        (open files and memory: :func:`~.capacity.check_capacity`).
        """
        if not isinstance(mesh, Mesh):
            raise TypeError(f"VirtualCluster: mesh must be a mesh.Mesh, got {type(mesh).__name__}")
        if array_module not in _ARRAY_MODULES:
            raise ValueError(f"VirtualCluster: array_module must be one of {_ARRAY_MODULES}, "
                             f"got {array_module!r}")
        if array_module == "cupy":
            _check_cupy()
        for name, value in (("timeout_s", timeout_s), ("run_timeout_s", run_timeout_s)):
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"VirtualCluster: {name} must be a positive number of "
                                 f"seconds, got {value!r}")
        AlgorithmSettings(algorithm)   # validates the name
        if wait not in _WAITS:
            raise ValueError(f"VirtualCluster: wait must be one of {_WAITS}, got {wait!r}")
        n = mesh.size
        check_capacity(n, memory_available_bytes(), open_files_limit())
        if arena_bytes is None:
            arena_bytes = DEFAULT_ARENA_BYTES
            if shm_free_bytes is not None:
                arena_bytes = min(shm_free_bytes, ADDRESS_BUDGET_BYTES // (n + 1))
            arena_bytes = max(arena_bytes, MIN_ARENA_BYTES)
        elif (not isinstance(arena_bytes, numbers.Integral) or isinstance(arena_bytes, bool)
              or arena_bytes < MIN_ARENA_BYTES):
            raise ValueError(f"VirtualCluster: arena_bytes must be an int >= {MIN_ARENA_BYTES} "
                             f"(4 MiB), got {arena_bytes!r}")
        if threads_per_device is None:
            threads_per_device = max(1, usable_cores() // n)
        elif (not isinstance(threads_per_device, numbers.Integral)
              or isinstance(threads_per_device, bool) or threads_per_device < 1):
            raise ValueError("VirtualCluster: threads_per_device must be an int >= 1, got "
                             f"{threads_per_device!r}")
        transport = _transport(array_module, transport)
        cpu_sets = _cpu_sets(n, pin_devices)
        if device_arena_bytes is not None and (
                not isinstance(device_arena_bytes, numbers.Integral)
                or isinstance(device_arena_bytes, bool) or device_arena_bytes < MIN_ARENA_BYTES):
            raise ValueError(f"VirtualCluster: device_arena_bytes must be an int >= "
                             f"{MIN_ARENA_BYTES} (4 MiB) or None, got {device_arena_bytes!r}")
        return cls(array_module, float(timeout_s), algorithm, int(arena_bytes),
                   int(arena_bytes), float(run_timeout_s), wait, int(threads_per_device),
                   transport=transport, device_arena_bytes=device_arena_bytes,
                   cpu_sets=cpu_sets, preload=_preload(preload))

    def thread_environment(self) -> dict[str, str]:
        """The variables that size the devices' BLAS/OpenMP pools (set before numpy
        loads in the launcher, so every library reads them at start-up)."""
        return blas_thread_environment(self.threads_per_device)


def blas_thread_environment(threads: int) -> dict[str, str]:
    """:data:`THREAD_VARIABLES`, each set to ``threads``: what sizes the BLAS/OpenMP pools
    of a process started with them."""
    return {v: str(threads) for v in THREAD_VARIABLES}


def _preload(preload) -> tuple[str, ...]:
    """The modules to import in the launcher before it forks the devices: ``preload`` (a
    sequence of module names), or with None those of ``$VCLUSTER_PRELOAD``. Each must be
    importable from this process's ``sys.path`` (the launcher's); duplicates are dropped.

    A device imports a program's module when it first unpickles the program (functions
    travel by reference): a test module's ``pytest`` costs each device ~0.09 s of CPU,
    ``pipeline_parallel`` ~0.13 s (this 2-core machine). Imported once in the launcher,
    the forks share the loaded modules instead. Preload only modules whose import starts
    no thread: a process forked from a threaded one may deadlock.
    """
    where = "preload"
    if preload is None:
        text = os.environ.get(PRELOAD_VARIABLE, "")
        preload = [name.strip() for name in text.split(",") if name.strip()]
        where = f"preload (from ${PRELOAD_VARIABLE}={text!r})"
    elif isinstance(preload, str) or not all(isinstance(n, str) for n in preload):
        raise TypeError(f"VirtualCluster: preload must be a sequence of module names, "
                        f"got {preload!r}")
    names = tuple(dict.fromkeys(preload))
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"VirtualCluster: {where}: no module named {name!r} on this "
                             f"process's sys.path")
    return names


def _cpu_sets(n: int, pin_devices) -> tuple | None:
    """The CPUs of each rank, or None for devices free to run anywhere."""
    if pin_devices is not None and not isinstance(pin_devices, bool):
        raise ValueError(f"VirtualCluster: pin_devices must be None (pin when the devices "
                         f"outnumber the cores), True or False, got {pin_devices!r}")
    if pin_devices is False:
        return None
    cpus = usable_cpus()
    if not cpus:
        if pin_devices:
            raise ValueError("VirtualCluster: pin_devices=True needs CPU affinity masks "
                             "(os.sched_setaffinity, Linux), which this platform lacks; "
                             "use pin_devices=None or False")
        return None
    if pin_devices is None and n <= len(cpus):
        return None
    return device_cpu_sets(n, cpus)


def _transport(array_module: str, transport) -> str:
    """``transport`` resolved: ``ipc`` or ``host`` (see :mod:`vcluster.runtime.device_memory`)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"VirtualCluster: transport must be one of {TRANSPORTS}, "
                         f"got {transport!r}")
    if array_module == "numpy":
        if transport == "ipc":
            raise ValueError("VirtualCluster: transport='ipc' moves device arrays between "
                             "devices; with array_module='numpy' the arrays are host arrays "
                             "already: use transport='auto' or 'host', or "
                             "array_module='cupy' or 'strict'")
        return "host"
    return "ipc" if transport == "auto" else transport


def _check_cupy() -> None:
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or CUDA without a device
        raise ValueError("VirtualCluster: array_module='cupy' needs CuPy and a CUDA device "
                         f"({type(exc).__name__}: {exc}); use array_module='numpy'") from None
