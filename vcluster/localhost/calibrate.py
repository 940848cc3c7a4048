"""``calibrate_localhost``: measure this machine for the ``localhost`` hardware.

Every microbenchmark runs as a device program on one :class:`~vcluster.VirtualCluster`
(devices run BLAS with one thread, as emulated programs do), so the numbers are those of
the processes the emulator really uses. Each figure is a median over repetitions after a
warm-up; nothing is cached. Derived figures (see :mod:`vcluster.localhost.cost_model`):

* (the figures of one device alone and the host-work rates are each the median of three
  trials spread over the calibration: this machine's speed drifts within seconds)
* the GEMM rate ``F = 2 n^3 / (t - 3 n^2 e / B_copy)`` from the time ``t`` of a
  (n, n) @ (n, n) product alone (the model adds the streaming of its operands back);
* the pool's throughput ``T(k) = k W1 / W_k``: ``W1`` the time of a few float32 GEMMs
  on one device alone, ``W_k`` the wall time of ``k`` devices doing them at once (the
  median of ``BUSY_TRIALS`` alternations), for ``k = cores`` and ``k = N``; likewise the
  busy speedups of ``a * b + c`` and of a 16 MiB copy with all N devices at once;
* per-member synchronisation shares ``c(n) = L(n) T(n) / n`` from the wall times ``L(n)``
  of a barrier, an 8-byte and a 4 KiB all_reduce, one group of ``n`` busy;
* channel rates from the wall times ``W`` of one call on all N devices (back to back, as
  programs issue them) at 256 KiB, 2 and 32 MiB: a member's work is ``W T(N) / N``,
  and the rate is the slope, (bytes moved at 32 MiB - at 2 MiB) / (work at 32 MiB - at
  2 MiB), for all_gather (``copy``), reduce_scatter (``reduce``) and all_reduce; the
  fixed cost of each is its wall time at 256 KiB less those bytes at that slope;
* the host work of one compute op (``compute_overhead_s``): CPU time per op of a loop of
  tiny ops (a ``dev.compute`` block around three numpy calls on tiny arrays, fresh
  result), on all N devices at once (:data:`OP_HOST_SHAPE`);
* the host work of programs (:func:`~vcluster.localhost.host_work.device_host_rates`,
  all N devices at once): CPU of an empty ``dev.compute`` block, of a numpy call on small
  arrays and of a pass of pure-Python glue;
* the host CPU per call with every device busy: each member's process time per barrier,
  8-byte and 4 KiB all_reduce with every group of that size calling at once, and per
  8-byte message and side with every device in a ping-pong pair; these, not the wall
  times alone, are the members' shares of small calls (:data:`BUSY_CALLS`);
* the CPU of a communication call as programs make them, per cluster size, call and
  group size (:func:`~vcluster.localhost.calls.measure_call_cpu`): the figures
  the model prices calls with (the back-to-back ones above remain for older specs);
* how a call's CPU grows with the work before it (a 4 KiB all_reduce after longer
  stretches of program-like work, per cluster and group size:
  :func:`~vcluster.localhost.gaps.measure_gap_cpu`);
* the start of a run on all devices at once (:mod:`~vcluster.localhost.start`):
  per cluster size, an empty program's wall time and the factor of the first call's CPU;
* p2p from ping-pongs of two devices: ``latency = RTT(8 B) / 2``, and with one copy on
  each side of every one-way message, ``copy = 4 S / (RTT(S) - RTT(8 B))``;
* one message side inside a message algorithm, per message size
  (:func:`~vcluster.localhost.messages.measure_message_sides`): every device in
  back-to-back ring all_gathers of 256 B, 4 KiB, 64 KiB and 1 MiB per member, the
  process time per call over its ``2 (N - 1)`` sides;
* the copy rate of large messages as programs meet it (``p2p_busy_copy_bytes_per_s``,
  one of the quick figures): every device in a ping-pong pair at once, the process time
  per message side at 4 KiB and at 4 MiB, ``(4 MiB - 4 KiB) / (c(4 MiB) - c(4 KiB))``.
  One busy figure: the alone rate above times the memcpy busy speedup multiplied two
  noisy figures (each moved 1.7x between calibrations minutes apart).
"""

from __future__ import annotations

import time
from functools import reduce as _fold

import numpy as np

from mesh import Mesh
from vcluster.runtime.cluster import VirtualCluster
from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.runtime.traffic import collective_traffic
from vcluster.timing.core_pool import CorePoolSpec

from .bytes import moved_bytes
from .calls import CallCpu, cluster_sizes, measure_call_cpu
from vcluster.runtime.cores import usable_cores
from .cost_model import LocalhostSpec
from .gaps import measure_gap_cpu
from .host_work import device_host_rates
from .messages import measure_message_sides
from .p2p import LARGE_BYTES, busy_copy_bytes_per_s, exchange, pair_cpu_s
from .start import measure_start

__all__ = ["calibrate_localhost", "DEFAULT_MESSAGE_BYTES"]

# per-device sizes of the channel calibration: the intercept's, then the slope's two
DEFAULT_MESSAGE_BYTES = (256 << 10, 2 << 20, 32 << 20)
GEMM_SIZE = 1024                    # (n, n) @ (n, n): the workloads' products are ~1e9 flop
GEMM_REPS = 3                       # timed products alone (median), per dtype
# kernels per device in the busy-speedup runs: ~0.06 s alone each, so that the devices'
# staggered exits from the barrier before them (up to ~1 ms) do not count
KERNEL_REPS = {"gemm": 4, "vector": 80, "memcpy": 50}
BUSY_TRIALS = 5
LARGE_CALL_BYTES = 4096             # a collective just past inline: two phases, no bulk
# a * b + c over this many elements (1 MiB of float32, 2 MiB of float64: a program's
# activation-sized arrays, below numpy's 4 MiB huge-page threshold), each result freed:
# devices keep freed memory (vcluster.runtime.launcher.keep_freed_memory), so a
# program's arrays after its first step land on pages it already touched, as these do
VECTOR_ELEMENTS = 1 << 18
MEMCPY_BYTES = 16 << 20
LATENCY_REPS = 50                   # back-to-back barriers / all_reduces per group size
# the host CPU per call with every device busy (barrier_cpu_s, ..., p2p_message_cpu_s):
# calls timed by process time (robust to how late a sleeping process is woken, which
# varies 2-3x from minute to minute on a virtual machine, unlike the CPU a call burns)
BUSY_CALLS = 200
BANDWIDTH_BYTES, BANDWIDTH_MIN_CALLS, BANDWIDTH_TRIALS = 16 << 20, 4, 3   # calls per trial
P2P_SMALL_REPS, P2P_LARGE_REPS = 100, 8
_FLOOR = 0.1                        # a derived work is at least this fraction of its total
# compute_overhead_s: the host work of one op as the project's programs issue them, a
# `dev.compute` block (event recorded) around a product of (m, k) @ (k, k) float64 with a
# fresh result, a bias add and a ReLU (three numpy calls on tiny arrays: their kernels
# take ~1 us of it), timed as CPU time per op on all N devices at once (caches shared,
# as in a run); OP_HOST_REPS ops per device
OP_HOST_SHAPE, OP_HOST_REPS = (8, 16), 2000


def median_time_s(fn, reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls, after one warm-up call."""
    fn()                                           # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# --- device programs ---------------------------------------------------------------------
def _kernels(dtype: str) -> dict:
    """The three busy-speedup kernels of ``dtype``: name -> thunk."""
    a = np.ones((GEMM_SIZE, GEMM_SIZE), dtype)
    c = np.empty_like(a)
    x, y, z = (np.full(VECTOR_ELEMENTS, v, dtype) for v in (1.0, 2.0, 3.0))
    src, dst = np.ones(MEMCPY_BYTES, np.uint8), np.empty(MEMCPY_BYTES, np.uint8)
    return {"gemm": lambda: np.matmul(a, a, out=c), "vector": lambda: x * y + z,
            "memcpy": lambda: np.copyto(dst, src)}


def _alone(dev) -> dict | None:
    """One device's rates, the others idle."""
    if dev.rank != 0:
        return None
    out = {}
    out["memcpy_bytes_per_s"] = MEMCPY_BYTES / median_time_s(_kernels("float32")["memcpy"], 5)
    for dtype in ("float32", "float64"):
        k = _kernels(dtype)
        t = median_time_s(k["gemm"], GEMM_REPS)
        streamed = 3 * GEMM_SIZE ** 2 * np.dtype(dtype).itemsize / out["memcpy_bytes_per_s"]
        out[f"gemm_{dtype}_flops_per_s"] = 2 * GEMM_SIZE ** 3 / max(t - streamed, _FLOOR * t)
        out[f"vector_{dtype}_flops_per_s"] = 2 * VECTOR_ELEMENTS / median_time_s(k["vector"], 15)
    a, b = np.ones(MEMCPY_BYTES // 8), np.ones(MEMCPY_BYTES // 8)
    out["iadd_bytes_per_s"] = MEMCPY_BYTES / median_time_s(lambda: np.add(a, b, out=a), 5)
    return out


def _op_host(dev, reps: int) -> float:
    """All devices at once: CPU seconds per op of a loop of tiny program ops (see
    :data:`OP_HOST_SHAPE`), after a warm-up of the same length."""
    m, k = OP_HOST_SHAPE
    x, w, b = np.ones((m, k)), np.ones((k, k)), np.ones(k)
    flops, nbytes = 2 * m * k * k + 2 * m * k, 8 * (2 * m * k + k * k + k)

    def ops():
        for _ in range(reps):
            with dev.compute("calibration", flops=flops, bytes=nbytes):
                z = x @ w                          # a fresh result, as programs allocate
                z += b
                np.maximum(z, 0.0, out=z)
    ops()
    dev.barrier()
    c0 = time.process_time()
    ops()
    return (time.process_time() - c0) / reps


def _quick_figures(cluster, devices: int) -> dict:
    """One trial of the figures that take a fraction of a second: the rates of one
    device alone, the host work of a compute op, the host-work rates of programs, and
    the copy rate of large messages with every device busy."""
    out = cluster.run(_alone)[0]
    out["compute_overhead_s"] = float(np.median(
        cluster.run(_op_host, [(OP_HOST_REPS,)] * devices)))
    host = np.median(cluster.run(device_host_rates), axis=0)
    out.update(block_overhead_s=float(host[0]), numpy_call_s=float(host[1]),
               python_unit_s=float(host[2]))
    out["p2p_busy_copy_bytes_per_s"] = busy_copy_bytes_per_s(cluster, devices)
    return out


def _repeat(fn, reps: int) -> None:
    for _ in range(reps):
        fn()


def _busy(dev, active: int, kinds: tuple) -> dict:
    """BUSY_TRIALS times, each kernel on rank 0 alone, then on the devices below ``active``
    at once: kind -> [(time alone, (start, end))] (time alone on rank 0 only)."""
    kernels, out = _kernels("float32"), {k: [] for k in kinds}
    for name in kinds:
        fn, reps = kernels[name], KERNEL_REPS[name]
        fn()
        for _ in range(BUSY_TRIALS):
            dev.barrier()
            alone = median_time_s(lambda: _repeat(fn, reps), 1) if dev.rank == 0 else None
            dev.barrier()
            t0 = time.perf_counter()
            if dev.rank < active:
                _repeat(fn, reps)
            out[name].append((alone, (t0, time.perf_counter())))
    return out


def _speedups(cluster, active: int, kinds: tuple) -> dict:
    """kind -> aggregate throughput of ``active`` busy devices over one device alone
    (the median over BUSY_TRIALS of ``active * alone / wall``)."""
    runs = cluster.run(_busy, [(active, kinds)] * cluster.mesh.size)[:active]
    out = {}
    for k in kinds:
        ratios = []
        for i in range(BUSY_TRIALS):
            wall = max(r[k][i][1][1] for r in runs) - min(r[k][i][1][0] for r in runs)
            ratios.append(active * runs[0][k][i][0] / wall)
        out[k] = float(np.median(ratios))
    return out


def _latency(dev, axes) -> tuple[float, float, float] | None:
    """Rank 0's group over ``axes`` alone: barrier, 8-byte and 4 KiB all_reduce times."""
    if dev.rank not in dev.mesh.group(axes, 0):
        return None
    small, large = np.ones(1, np.float64), np.ones(LARGE_CALL_BYTES // 8, np.float64)
    out = []
    for call in (lambda: dev.barrier(axes), lambda: dev.all_reduce(small, axes),
                 lambda: dev.all_reduce(large, axes)):
        out.append(median_time_s(lambda: _repeat(call, LATENCY_REPS), 5) / LATENCY_REPS)
    return tuple(out)


def _latency_cpu(dev, axes) -> tuple[float, float, float]:
    """Every group over ``axes`` at once: CPU seconds this member spends per barrier,
    8-byte and 4 KiB all_reduce (process time over BUSY_CALLS calls, after a warm-up)."""
    small, large = np.ones(1, np.float64), np.ones(LARGE_CALL_BYTES // 8, np.float64)
    out = []
    for call in (lambda: dev.barrier(axes), lambda: dev.all_reduce(small, axes),
                 lambda: dev.all_reduce(large, axes)):
        _repeat(call, LATENCY_REPS)
        dev.barrier()
        c0 = time.process_time()
        _repeat(call, BUSY_CALLS)
        out.append((time.process_time() - c0) / BUSY_CALLS)
    return tuple(out)


def _bandwidth(dev, op: str, nbytes: int, calls: int) -> list[tuple[float, float]]:
    """All devices: BANDWIDTH_TRIALS runs of ``calls`` back-to-back calls of ``op`` (as
    programs issue them), each timed from the end of one more call after a barrier (which
    absorbs the devices' staggered start): (start, end) of each run."""
    n = dev.mesh.size
    x = dev.empty((nbytes // 4 // (n if op == "all_gather" else 1),), np.float32)
    x[...] = 0
    call = getattr(dev, op)
    spans = []
    for _ in range(BANDWIDTH_TRIALS):
        dev.barrier()
        call(x)
        t0 = time.perf_counter()
        for _ in range(calls):
            call(x)
        spans.append((t0, time.perf_counter()))
    return spans


def _ping_pong(dev, nbytes: int, reps: int) -> float | None:
    """Ranks 0 and 1: round-trip time of ``nbytes`` (private arrays: copied each way)."""
    if dev.rank > 1:
        return None
    x = np.ones(max(nbytes // 8, 1))
    return median_time_s(lambda: exchange(dev, 1 - dev.rank, x, reps), 3) / reps


# --- driver ------------------------------------------------------------------------------
def _prime_factors(n: int) -> tuple[int, ...]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out)


def calibrate_localhost(devices: int = 8, message_bytes: tuple = DEFAULT_MESSAGE_BYTES,
                        cores: int | None = None) -> LocalhostSpec:
    """Measure this machine on a cluster of ``devices`` (>= 2) devices (~10 s).

    ``message_bytes``: the per-device sizes of the channel collectives (the intercept's,
    then the slope's two);
    ``cores`` defaults to the cores this process may use (its affinity mask and cgroup
    quota: :func:`~vcluster.localhost.cores.usable_cores`). See the module docstring
    for each figure.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
        raise ValueError(f"calibrate_localhost: devices must be an int >= 2, got {devices!r}")
    sizes = tuple(message_bytes)
    if len(sizes) != 3 or list(sizes) != sorted(set(sizes)) or sizes[0] < 64 * devices \
            or any(b % (4 * devices) for b in sizes):
        raise ValueError(f"calibrate_localhost: message_bytes must be 3 increasing sizes, "
                         f"multiples of 4 x devices ({4 * devices}), the first at least "
                         f"{64 * devices}, got {message_bytes}")
    cores = usable_cores() if cores is None else int(cores)
    shape = _prime_factors(devices)
    axes = tuple(f"a{i}" for i in range(len(shape)))
    with VirtualCluster(Mesh(shape, axes)) as cluster:
        # The quick figures are taken in ALONE_TRIALS trials spread over the calibration
        # (this machine's speed drifts within seconds): the median of each.
        trials = [_quick_figures(cluster, devices)]
        busy = _speedups(cluster, devices, ("gemm", "vector", "memcpy"))
        points = {devices: busy["gemm"]}
        if 2 <= cores < devices:
            points[cores] = _speedups(cluster, cores, ("gemm",))["gemm"]
        trials.append(_quick_figures(cluster, devices))
        tables = _latency_tables(cluster, shape, axes)
        call_rows = measure_call_cpu(cluster, shape, axes, cores)
        gap_rows = measure_gap_cpu(cluster, shape, axes, cores)
        trials.append(_quick_figures(cluster, devices))
        alone = {k: float(np.median([t[k] for t in trials])) for k in trials[0]}
        p2p_cpu = [c for c in cluster.run(pair_cpu_s, [(BUSY_CALLS,)] * devices)
                   if c is not None]
        sides = measure_message_sides(cluster)
        walls = {(op, nbytes): _call_wall_s(cluster, op, nbytes)
                 for op, _ in _CHANNEL for nbytes in sizes}
        rtt_small = cluster.run(_ping_pong, [(8, P2P_SMALL_REPS)] * devices)[0]
        rtt_large = cluster.run(_ping_pong, [(LARGE_BYTES, P2P_LARGE_REPS)] * devices)[0]
    pool = tuple((k, min(t, k, cores)) for k, t in sorted(points.items()))
    calls = CallCpu(call_rows)
    start_rows, splits = measure_start(cluster_sizes(devices, cores),
                                       lambda d: calls.seconds("all_reduce", d, d),
                                       CorePoolSpec(cores, pool))
    provisional = LocalhostSpec(
        cores=cores, pool_throughput=pool, **alone, vector_busy_speedup=busy["vector"],
        memcpy_busy_speedup=busy["memcpy"], **tables,
        **{f"channel_{name}_bytes_per_s": 1.0 for _, name in _CHANNEL},
        channel_fixed_s=(1.0,) * len(_CHANNEL),
        p2p_latency_s=rtt_small / 2,
        p2p_copy_bytes_per_s=4 * LARGE_BYTES / max(rtt_large - rtt_small,
                                                       _FLOOR * rtt_large),
        calibration_devices=devices, message_bytes=sizes,
        p2p_message_cpu_s=float(np.median(p2p_cpu)), call_cpu_s=call_rows,
        call_gap_cpu_s=gap_rows, message_side_cpu_s=sides,
        start_s=start_rows, start_split=splits)
    return LocalhostSpec(**dict(provisional.to_dict(), **_channel_rates(provisional, walls)))


# (collective, its rate's name), in the order of LocalhostSpec.channel_fixed_s
_CHANNEL = (("all_gather", "copy"), ("reduce_scatter", "reduce"), ("all_reduce", "all_reduce"))


def _latency_tables(cluster, shape: tuple, axes: tuple) -> dict:
    """Group sizes (products of the mesh's last axes) and their three latency columns."""
    names = ("barrier_s", "small_all_reduce_s", "large_all_reduce_s")
    tables = {k: [] for k in ("group_sizes",) + names + tuple(n[:-2] + "_cpu_s" for n in names)}
    for j in range(len(shape) - 1, -1, -1):         # smallest group first
        times = cluster.run(_latency, [(axes[j:],)] * cluster.mesh.size)[0]
        cpu = np.median(cluster.run(_latency_cpu, [(axes[j:],)] * cluster.mesh.size), axis=0)
        tables["group_sizes"].append(_fold(lambda u, v: u * v, shape[j:]))
        for name, t, c in zip(names, times, cpu):
            tables[name].append(t)
            tables[name[:-2] + "_cpu_s"].append(float(c))
    return tables


def _call_wall_s(cluster, op: str, nbytes: int) -> float:
    """Wall time of one call of ``op`` on every device, back to back (median of trials)."""
    calls = max(BANDWIDTH_MIN_CALLS, BANDWIDTH_BYTES // nbytes)
    runs = cluster.run(_bandwidth, [(op, nbytes, calls)] * cluster.mesh.size)
    return float(np.median([max(r[i][1] for r in runs) - min(r[i][0] for r in runs)
                            for i in range(BANDWIDTH_TRIALS)])) / calls


def _channel_rates(spec: LocalhostSpec, walls: dict) -> dict:
    """Each channel rate from the slope of the member's work between the two larger sizes:
    the bytes one member moves more at the largest over its work more, ``dW T(N) / N``
    (the fixed part of a call cancels); and each collective's wall time at 0 bytes, the
    smallest size's less its bytes at that slope."""
    n, members = spec.calibration_devices, tuple(range(spec.calibration_devices))
    share = spec.core_pool.throughput_at(n) / n
    rates, fixed = {}, []
    for op, name in _CHANNEL:
        moved = []
        for size in spec.message_bytes:             # (intercept, small, large)
            nbytes = size // (n if op == "all_gather" else 1)
            op_ = TraceCollective(op, members, nbytes, 4, "shm")
            moved.append(sum(moved_bytes(op, n, 0, op_, collective_traffic(
                op, "shm", members, 0, nbytes, 4))))
        tiny, small, large = (walls[(op, size)] for size in spec.message_bytes)
        slope = max(large - small, _FLOOR * large) / (moved[2] - moved[1])   # wall s / byte
        rates[f"channel_{name}_bytes_per_s"] = 1 / (slope * share)
        fixed.append(max(tiny - slope * moved[0], _FLOOR * tiny))
    return dict(rates, channel_fixed_s=tuple(fixed))
