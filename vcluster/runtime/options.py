"""``ClusterOptions``: a VirtualCluster's settings, validated where they enter."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from mesh import Mesh

from .algorithm import AlgorithmSettings

__all__ = ["ClusterOptions"]

_MiB = 1 << 20
DEFAULT_ARENA_BYTES = 512 * _MiB
MIN_ARENA_BYTES = 4 * _MiB
_ARRAY_MODULES = ("numpy", "cupy")
_WAITS = ("auto", "futex", "poll")


@dataclass(frozen=True)
class ClusterOptions:
    array_module: str
    timeout_s: float
    algorithm: str
    arena_bytes: int
    host_arena_bytes: int
    run_timeout_s: float
    wait: str
    startup_timeout_s: float = 60.0

    @classmethod
    def build(cls, mesh, array_module, timeout_s, algorithm, arena_bytes, run_timeout_s,
              wait, shm_free_bytes: int | None) -> "ClusterOptions":
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
        if arena_bytes is None:
            arena_bytes = DEFAULT_ARENA_BYTES
            if shm_free_bytes is not None:   # leave half of /dev/shm to everybody else
                arena_bytes = min(arena_bytes, shm_free_bytes // (2 * (n + 1)))
            arena_bytes = max(arena_bytes, MIN_ARENA_BYTES)
        elif not isinstance(arena_bytes, numbers.Integral) or arena_bytes < MIN_ARENA_BYTES:
            raise ValueError(f"VirtualCluster: arena_bytes must be an int >= {MIN_ARENA_BYTES} "
                             f"(4 MiB), got {arena_bytes!r}")
        if shm_free_bytes is not None and arena_bytes * (n + 1) > shm_free_bytes:
            raise ValueError(
                f"VirtualCluster: {n + 1} arenas of {arena_bytes} bytes do not fit the "
                f"{shm_free_bytes} bytes free in /dev/shm; pass a smaller arena_bytes= or "
                "enlarge /dev/shm (e.g. docker run --shm-size=2g)")
        return cls(array_module, float(timeout_s), algorithm, int(arena_bytes),
                   int(arena_bytes), float(run_timeout_s), wait)


def _check_cupy() -> None:
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or CUDA without a device
        raise ValueError("VirtualCluster: array_module='cupy' needs CuPy and a CUDA device "
                         f"({type(exc).__name__}: {exc}); use array_module='numpy'") from None
