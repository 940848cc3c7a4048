"""``calibrate_localhost``: measure this machine for the ``localhost`` hardware.

Every microbenchmark runs as a device program on one :class:`~vcluster.VirtualCluster`
(devices run BLAS with one thread, as emulated programs do), so the numbers are those of
the processes the emulator really uses. Each figure is a median over repetitions after a
warm-up; nothing is cached. Derived rates (see :mod:`vcluster.timing.localhost`):

* ``core_speedup = N W1 / W_N``: W1 the time of ``GEMM_REPS`` float32 GEMMs on one device
  alone, W_N the wall time of all N devices doing them at once; kept in ``(0, cores]``;
* per-member synchronisation shares ``c(n) = L(n) T(n) / n`` (``T`` the pool's
  throughput) from the barrier and 8-byte all_reduce wall times ``L(n)``, one group busy;
* channel rates from the wall time ``W`` of one large call on all N devices: each
  member's work ``W T(N) / N`` less its synchronisation share ``c_i(N) + c_b(N)`` is its
  bytes' work: ``copy = read / work(all_gather)``, ``reduce = read / work(reduce_scatter)``,
  ``write = written / (work(all_reduce) - read / reduce)``;
* p2p from ping-pongs of two devices: ``latency = RTT(8 B) / 2``, and with one copy on
  each side of every one-way message, ``copy = 4 S / (RTT(S) - RTT(8 B))``.
"""

from __future__ import annotations

import os
import time
from functools import reduce as _fold

import numpy as np

from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.runtime.traffic import collective_traffic

from .localhost import LocalhostCostModel, LocalhostSpec, _moved_bytes

__all__ = ["calibrate_localhost", "DEFAULT_MESSAGE_BYTES"]

DEFAULT_MESSAGE_BYTES = 8 << 20     # per-device bytes of the bandwidth collectives
GEMM_SIZE = 1024                    # (n, n) @ (n, n): the workloads' products are ~1e9 flop
GEMM_REPS = 3
VECTOR_ELEMENTS = 1 << 20           # a * b + c over this many elements
MEMCPY_BYTES = 16 << 20
LATENCY_REPS = 40                   # back-to-back barriers / all_reduces per group size
BANDWIDTH_REPS = 5
P2P_SMALL_REPS, P2P_LARGE_BYTES, P2P_LARGE_REPS = 100, 4 << 20, 8
_FLOOR = 0.1                        # a derived work is at least this fraction of its total


def _median_s(fn, reps: int) -> float:
    fn()                                           # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# --- device programs ---------------------------------------------------------------------
def _alone(dev) -> dict | None:
    """One device's rates, the others idle."""
    if dev.rank != 0:
        return None
    out = {}
    for dtype in ("float32", "float64"):
        a = np.ones((GEMM_SIZE, GEMM_SIZE), dtype)
        c = np.empty_like(a)
        t = _median_s(lambda: np.matmul(a, a, out=c), GEMM_REPS)
        out[f"gemm_{dtype}_flops_per_s"] = 2 * GEMM_SIZE ** 3 / t
        x, y, z = (np.full(VECTOR_ELEMENTS, v, dtype) for v in (1.0, 2.0, 3.0))
        t = _median_s(lambda: x * y + z, 5)
        out[f"vector_{dtype}_flops_per_s"] = 2 * VECTOR_ELEMENTS / t
    src, dst = np.ones(MEMCPY_BYTES, np.uint8), np.empty(MEMCPY_BYTES, np.uint8)
    out["memcpy_bytes_per_s"] = MEMCPY_BYTES / _median_s(lambda: np.copyto(dst, src), 5)
    a, b = np.ones(MEMCPY_BYTES // 8), np.ones(MEMCPY_BYTES // 8)
    out["iadd_bytes_per_s"] = MEMCPY_BYTES / _median_s(lambda: np.add(a, b, out=a), 5)

    def blocks():
        for _ in range(200):
            with dev.compute("calibration", flops=1, bytes=1):
                pass
    out["compute_overhead_s"] = _median_s(blocks, 3) / 200
    a = np.ones((GEMM_SIZE, GEMM_SIZE), np.float32)
    c = np.empty_like(a)
    out["gemm_reps_alone_s"] = _median_s(
        lambda: [np.matmul(a, a, out=c) for _ in range(GEMM_REPS)], 1)
    return out


def _together(dev) -> tuple[float, float]:
    """Every device does GEMM_REPS float32 GEMMs at once: (start, end)."""
    a = np.ones((GEMM_SIZE, GEMM_SIZE), np.float32)
    c = np.empty_like(a)
    np.matmul(a, a, out=c)
    dev.barrier()
    t0 = time.perf_counter()
    for _ in range(GEMM_REPS):
        np.matmul(a, a, out=c)
    return t0, time.perf_counter()


def _latency(dev, axes) -> tuple[float, float] | None:
    """Rank 0's group over ``axes`` alone: (barrier, 8-byte all_reduce) wall times."""
    if dev.rank not in dev.mesh.group(axes, 0):
        return None
    x = np.ones(1, np.float64)
    out = []
    for call in (lambda: dev.barrier(axes), lambda: dev.all_reduce(x, axes)):
        out.append(_median_s(lambda: [call() for _ in range(LATENCY_REPS)], 3) / LATENCY_REPS)
    return tuple(out)


def _bandwidth(dev, op: str, nbytes: int) -> list[tuple[float, float]]:
    """All devices: BANDWIDTH_REPS barrier-aligned calls of ``op``: (start, end) each."""
    n = dev.mesh.size
    x = dev.empty((nbytes // 4 // (n if op == "all_gather" else 1),), np.float32)
    x[...] = 0
    times = []
    for i in range(BANDWIDTH_REPS + 1):
        dev.barrier()
        t0 = time.perf_counter()
        result = getattr(dev, op)(x)
        times.append((t0, time.perf_counter()))
        del result
    return times[1:]


def _ping_pong(dev, nbytes: int, reps: int) -> float | None:
    """Ranks 0 and 1: round-trip time of ``nbytes`` (private arrays: copied each way)."""
    if dev.rank > 1:
        return None
    peer, x = 1 - dev.rank, np.ones(max(nbytes // 8, 1))

    def rounds():
        for k in range(reps):
            if dev.rank == 0:
                dev.send(x, peer, k)
                dev.recv(peer, k)
            else:
                dev.recv(peer, k)
                dev.send(x, peer, k)
    return _median_s(rounds, 3) / reps


# --- driver ------------------------------------------------------------------------------
def _prime_factors(n: int) -> tuple[int, ...]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out)


def calibrate_localhost(devices: int = 8, message_bytes: int = DEFAULT_MESSAGE_BYTES,
                        cores: int | None = None) -> LocalhostSpec:
    """Measure this machine on a cluster of ``devices`` (>= 2) devices (a few seconds).

    ``cores`` defaults to ``os.cpu_count()``. See the module docstring for each figure.
    """
    from mesh import Mesh
    from vcluster.runtime.cluster import VirtualCluster
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
        raise ValueError(f"calibrate_localhost: devices must be an int >= 2, got {devices!r}")
    if message_bytes < 64 * devices or message_bytes % (4 * devices):
        raise ValueError(f"calibrate_localhost: message_bytes must be a multiple of 4 x "
                         f"devices ({4 * devices}) of at least {64 * devices}, got "
                         f"{message_bytes}")
    cores = (os.cpu_count() or 1) if cores is None else int(cores)
    shape = _prime_factors(devices)
    axes = tuple(f"a{i}" for i in range(len(shape)))
    mesh = Mesh(shape, axes)
    with VirtualCluster(mesh) as cluster:
        alone = cluster.run(_alone)[0]
        spans = cluster.run(_together)
        wall = max(e for _, e in spans) - min(s for s, _ in spans)
        speedup = min(float(cores), devices * alone.pop("gemm_reps_alone_s") / wall)
        sizes, barrier, small = [], [], []
        for j in range(len(shape) - 1, -1, -1):     # groups over the last axes: smallest first
            b, s = cluster.run(_latency, [(axes[j:],)] * devices)[0]
            sizes.append(_fold(lambda u, v: u * v, shape[j:]))
            barrier.append(b)
            small.append(s)
        walls = {}
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            runs = cluster.run(_bandwidth, [(op, message_bytes)] * devices)
            walls[op] = float(np.median([max(r[i][1] for r in runs) - min(r[i][0] for r in runs)
                                         for i in range(BANDWIDTH_REPS)]))
        rtt_small = cluster.run(_ping_pong, [(8, P2P_SMALL_REPS)] * devices)[0]
        rtt_large = cluster.run(_ping_pong, [(P2P_LARGE_BYTES, P2P_LARGE_REPS)] * devices)[0]
    provisional = LocalhostSpec(
        cores=cores, core_speedup=speedup, **alone, group_sizes=tuple(sizes),
        barrier_s=tuple(barrier), small_all_reduce_s=tuple(small),
        channel_copy_bytes_per_s=1.0, channel_reduce_bytes_per_s=1.0,
        channel_write_bytes_per_s=1.0, p2p_latency_s=rtt_small / 2,
        p2p_copy_bytes_per_s=4 * P2P_LARGE_BYTES / max(rtt_large - rtt_small,
                                                       _FLOOR * rtt_large),
        calibration_devices=devices, message_bytes=message_bytes)
    rates = _channel_rates(provisional, walls)
    return LocalhostSpec(**dict(provisional.to_dict(), **rates))


def _channel_rates(spec: LocalhostSpec, walls: dict) -> dict:
    """The three channel rates from the large calls' wall times (module docstring)."""
    n, model = spec.calibration_devices, LocalhostCostModel(spec, spec.calibration_devices)
    fixed = model.inline_share_s(n) + model.barrier_share_s(n)
    members = tuple(range(n))

    def work_and_bytes(op: str):
        nbytes = spec.message_bytes // (n if op == "all_gather" else 1)
        total = walls[op] * spec.core_pool.throughput(n) / n
        t = collective_traffic(op, "shm", members, 0, nbytes, 4)
        read, written = _moved_bytes(op, n, 0, TraceCollective(op, members, nbytes, 4, "shm"), t)
        return max(total - fixed, _FLOOR * total), read, written

    work, read, _ = work_and_bytes("all_gather")
    copy = read / work
    work, read, _ = work_and_bytes("reduce_scatter")
    reduce_rate = read / work
    work, read, written = work_and_bytes("all_reduce")
    write = written / max(work - read / reduce_rate, _FLOOR * work)
    return {"channel_copy_bytes_per_s": copy, "channel_reduce_bytes_per_s": reduce_rate,
            "channel_write_bytes_per_s": write}
