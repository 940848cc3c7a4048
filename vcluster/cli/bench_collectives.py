"""``vcluster bench collectives``: time every collective on the emulator, nccl-tests style.

For each op, size and path, the devices run ``warmup + reps`` iterations of::

    dev.barrier(); t0 = perf_counter(); <collective>; t1 = perf_counter()

and the time of one iteration is ``max(t1 over ranks) - min(t0 over ranks)``: from the
barrier's release (no rank leaves it earlier than the first) to the last rank's finish.
``median_s`` is the median over the reps. Host transfers are excluded.

``bytes`` is the message size S as nccl-tests defines it: the buffer for all_reduce,
broadcast and reduce; the gathered output for all_gather and gather; the input for
reduce_scatter and scatter; the send buffer for all_to_all. It is rounded up so that
every rank's piece is a whole number of elements. algbw = S / median_s and
busbw = algbw x factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all,
gather, scatter (n-1)/n; broadcast, reduce 1), in GB/s (1e9 bytes).

Paths: ``resident`` — buffers from ``dev.empty`` and ``out=`` (all_reduce in place);
``copy`` — a plain ``dev.xp`` array in, a new array out. ``memcpy_gbps`` is a
single-process host ``np.copyto`` of S bytes measured in the same run, the bandwidth
reference.

Array modules (``--array-module``): on ``cupy`` the buffers are GPU arrays (each timed
call ends with a stream synchronisation), on ``strict`` CuPy-ruled host arrays.
``transport`` says how the call moved them, read from the trace: ``ipc`` (device
memory read in place by peers, CUDA IPC on cupy), ``host`` (staged through host shared
memory: numpy's own arrays, the message algorithms, and ``--transport host``).

``--engine torch`` runs the same program on local torch.distributed ranks too (NCCL when
every rank can have its own GPU, else gloo on CPU, with one line saying why when GPUs are
present but too few; ``algorithm`` is then the backend's name) and prints both engines'
figures side by side (:func:`format_comparison`), measured in the same run. ``--mpi``
does the same on MPI ranks started by ``mpiexec`` (:mod:`vcluster.cli.bench_mpi`), timed
the same way and turned into records by the same :func:`timed_record`. ``--rounds N``
repeats everything N times, the emulator and MPI taking turns round by round, and closes
with :func:`format_rounds`: per case the median over rounds [range] of both engines and of
the per-round ratio (MPICH's own latency moves 20x and more when anything else runs on
the machine, so only ratios taken back to back compare).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["BenchRecord", "OPS", "PATHS", "run_collectives_bench", "format_table", "busbw_factor",
           "format_comparison", "format_transports", "message_bytes", "message_shapes",
           "timed_record", "memcpy_gbps", "default_reps", "format_rounds"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
       "gather", "scatter")
PATHS = ("resident", "copy")
_SPLIT_OPS = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


@dataclass(frozen=True)
class BenchRecord:
    op: str
    path: str
    algorithm: str
    dtype: str
    devices: int
    bytes: int
    median_s: float
    algbw_gbps: float
    busbw_gbps: float
    memcpy_gbps: float
    engine: str = "emulator"
    array_module: str = "numpy"
    transport: str = "host"
    round: int = 1              # which round of ``--rounds`` measured it


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


def message_bytes(op: str, requested: int, n: int, itemsize: int) -> int:
    """S rounded up to whole elements (and whole pieces for the ops that split)."""
    unit = itemsize * (n if op in _SPLIT_OPS else 1)
    return max(unit, -(-requested // unit) * unit)


def message_shapes(op: str, nbytes: int, n: int, itemsize: int) -> tuple[int, int]:
    """(input elements, output elements) per rank (root's for rooted ops)."""
    total = nbytes // itemsize
    return {"all_reduce": (total, total), "all_gather": (total // n, total),
            "reduce_scatter": (total, total // n), "all_to_all": (total, total),
            "broadcast": (total, total), "reduce": (total, total),
            "gather": (total // n, total), "scatter": (total, total // n)}[op]


def _bench_program(dev, op, path, nbytes, dtype, reps, warmup, algorithm):
    """The per-device program: time `reps` barrier-aligned iterations of one collective."""
    n = dev.mesh.size
    dtype = np.dtype(dtype)
    n_in, n_out = message_shapes(op, nbytes, n, dtype.itemsize)
    root = dev.rank == 0
    xp = dev.xp
    sync = xp.cuda.get_current_stream().synchronize if hasattr(xp, "cuda") else _nothing
    if path == "resident":
        x = dev.empty((n_in,), dtype)
        x[...] = 0          # in-place all_reduce repeats: zeros never overflow
        out = x if op == "all_reduce" else dev.empty((n_out,), dtype)
        if op in ("gather", "reduce") and not root:
            out = None
    else:
        x = xp.full(n_in, dev.rank + 1, dtype)
        out = None
    if op in ("broadcast", "scatter") and not root:
        x = None
    call = getattr(dev, op)
    times = []
    for i in range(warmup + reps):
        dev.barrier()
        t0 = time.perf_counter()
        result = call(x, out=out, algorithm=algorithm)
        sync()
        t1 = time.perf_counter()
        del result
        if i >= warmup:
            times.append((t0, t1))
    return times


def _nothing() -> None:
    """No device queue to wait for (numpy, strict)."""


def _traced_transport(cluster, op: str, backend) -> str:
    """How the last run moved data (``ipc`` | ``host``; torch: its backend's name)."""
    if backend:
        return backend
    seen = {getattr(e, "transport", "host") for e in cluster.trace()
            if getattr(e, "collective", None) == op}
    return "+".join(sorted(seen)) or "host"


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.ones(max(nbytes, 1), np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


def default_reps(nbytes: int) -> int:
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 16 << 20:
        return 10
    return 5


def timed_record(op: str, path: str, algorithm: str, dtype: str, nbytes: int, times,
                 memcpy: float, engine: str, array_module: str = "numpy",
                 transport: str = "host") -> BenchRecord:
    """One record from every rank's ``[(t0, t1), ...]`` over the same timed repetitions.

    Repetition i takes ``max_r t1[r][i] - min_r t0[r][i]`` (first member's start to the
    last member's end); ``median_s`` is the median over i, algbw = bytes / median_s and
    busbw = algbw x :func:`busbw_factor`. ``times`` holds one list per rank, in rank
    order; the clocks are ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every
    process of the machine)."""
    n = len(times)
    per_rep = [max(rank[i][1] for rank in times) - min(rank[i][0] for rank in times)
               for i in range(len(times[0]))]
    median_s = float(np.median(per_rep))
    algbw = nbytes / median_s / 1e9
    return BenchRecord(op, path, algorithm, dtype, n, nbytes, median_s, algbw,
                       algbw * busbw_factor(op, n), memcpy, engine, array_module, transport)


def run_collectives_bench(cluster, sizes, ops=OPS, paths=PATHS, dtype="float32",
                          algorithm="auto", reps=None, warmup=1, progress=None) -> list[BenchRecord]:
    """Measure every (op, size, path) on ``cluster``; returns one record each."""
    # lazy: keeps vcluster --help fast
    from vcluster.runtime.algorithm import choose_algorithm
    n = cluster.mesh.size
    backend = (getattr(cluster, "info", None) or {}).get("torch_backend")   # torch engine
    itemsize = np.dtype(dtype).itemsize
    records = []
    for op in ops:
        for requested in sizes:
            nbytes = message_bytes(op, requested, n, itemsize)
            r = reps or default_reps(nbytes)
            memcpy = memcpy_gbps(nbytes, r)
            for path in paths:
                cluster.reset_stats()
                results = cluster.run(_bench_program,
                                      [(op, path, nbytes, dtype, r, warmup, algorithm)] * n)
                transport = _traced_transport(cluster, op, backend)
                alg = backend or choose_algorithm(op, nbytes, n, requested=algorithm)
                module = getattr(getattr(cluster, "options", None), "array_module", "numpy")
                records.append(timed_record(
                    op, path, alg, str(dtype), nbytes, results, memcpy,
                    "torch" if backend else "emulator", module, transport))
                if progress is not None:
                    progress(records[-1])
    return records


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def format_row(rec: BenchRecord) -> str:
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.units import format_size
    return (f"{rec.op:<15}{rec.path:<10}{rec.algorithm:<10}{rec.transport:<10}"
            f"{format_size(rec.bytes):>9}"
            f"{_fmt_time(rec.median_s):>12}{rec.algbw_gbps:>10.3f}{rec.busbw_gbps:>10.3f}"
            f"{rec.memcpy_gbps:>10.2f}")


def format_header() -> str:
    return (f"{'op':<15}{'path':<10}{'algorithm':<10}{'transport':<10}{'bytes':>9}"
            f"{'median':>12}{'algbw':>10}{'busbw':>10}{'memcpy':>10}\n"
            + " " * 66 + "(GB/s)    (GB/s)    (GB/s)")


def format_table(records: list[BenchRecord]) -> str:
    return "\n".join([format_header()] + [format_row(r) for r in records])


def format_transports(records: list[BenchRecord]) -> str:
    """busbw of each (op, path, bytes) per transport, and its ratio to the host-staged
    one (or to the first transport's), all measured in the same command."""
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.units import format_size
    runs: dict[tuple, dict[str, float]] = {}
    for r in records:
        runs.setdefault((r.op, r.path, r.bytes), {})[r.transport] = r.busbw_gbps
    names = list(dict.fromkeys(r.transport for r in records))
    if "host" in names:                       # the staged path is the natural baseline
        names.remove("host")
        names.insert(0, "host")
    lines = [f"busbw by transport (GB/s; x = relative to {names[0]}), same run:",
             f"{'op':<15}{'path':<10}{'bytes':>9}" + "".join(f"{t:>16}" for t in names)]
    for (op, path, nbytes), by in runs.items():
        base = by.get(names[0])
        cells = "".join(
            f"{by[t]:>9.3f}{'' if not base else f' ({by[t] / base:.1f}x)':>7}" if t in by
            else f"{'-':>16}" for t in names)
        lines.append(f"{op:<15}{path:<10}{format_size(nbytes):>9}{cells}")
    return "\n".join(lines)


def format_comparison(emulator: list[BenchRecord], theirs: list[BenchRecord]) -> str:
    """The emulator's and another engine's figures (torch, mpi: named by the records'
    ``engine``) for the same (op, path, bytes), side by side."""
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.units import format_size
    name = theirs[0].engine if theirs else "other"
    other = {(r.op, r.path, r.bytes): r for r in theirs}
    lines = [f"{'op':<15}{'path':<10}{'bytes':>9}{'emulator':>12}{'busbw':>9}"
             f"{name:>12}{'busbw':>9}{name + '/emulator':>16}",
             f"{'':<34}{'(' + (emulator[0].algorithm if emulator else '') + ')':>12}"
             f"{'(GB/s)':>9}{'(' + (theirs[0].algorithm if theirs else '') + ')':>12}{'(GB/s)':>9}"]
    for e in emulator:
        t = other.get((e.op, e.path, e.bytes))
        if t is None:
            continue
        lines.append(f"{e.op:<15}{e.path:<10}{format_size(e.bytes):>9}{_fmt_time(e.median_s):>12}"
                     f"{e.busbw_gbps:>9.3f}{_fmt_time(t.median_s):>12}{t.busbw_gbps:>9.3f}"
                     f"{t.median_s / e.median_s:>15.2f}x")
    return "\n".join(lines)


def format_rounds(emulator: list[BenchRecord], theirs: list[BenchRecord]) -> str:
    """Per (op, path, bytes): the median over rounds of each engine's per-round median time
    [min-max], and of the per-round ratio theirs / emulator [min-max].

    The ratio is taken round by round, each round's two figures measured back to back, so
    a burst of load from elsewhere on the machine weighs on both sides of the same ratio
    (``vcluster bench collectives --rounds N --mpi``)."""
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.units import format_size
    name = theirs[0].engine if theirs else "other"
    ours: dict[tuple, dict[int, float]] = {}
    other: dict[tuple, dict[int, float]] = {}
    for table, records in ((ours, emulator), (other, theirs)):
        for r in records:
            table.setdefault((r.op, r.path, r.bytes), {})[r.round] = r.median_s
    lines = [f"{'op':<15}{'path':<10}{'bytes':>9}{'rounds':>7}{'emulator':>30}"
             f"{name:>30}{name + '/emulator':>26}"]
    for key, by_round in ours.items():
        rounds = sorted(set(by_round) & set(other.get(key, {})))
        if not rounds:
            continue
        e = [by_round[r] for r in rounds]
        t = [other[key][r] for r in rounds]
        ratio = [b / a for a, b in zip(e, t)]
        op, path, nbytes = key
        lines.append(f"{op:<15}{path:<10}{format_size(nbytes):>9}{len(rounds):>7}"
                     f"{_spread(e, _fmt_time):>30}{_spread(t, _fmt_time):>30}"
                     f"{_spread(ratio, lambda v: f'{v:.2f}x'):>26}")
    return "\n".join(lines)


def _spread(values: list[float], fmt) -> str:
    """``median [min-max]`` of ``values``, each written by ``fmt``."""
    return f"{fmt(float(np.median(values)))} [{fmt(min(values))}-{fmt(max(values))}]"
