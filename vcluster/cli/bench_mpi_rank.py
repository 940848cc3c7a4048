"""The MPI side of ``vcluster bench collectives --mpi``: one rank of the benchmark.

Started by :mod:`vcluster.cli.bench_mpi` as::

    mpiexec -n N python -m mpi4py -m vcluster.cli.bench_mpi_rank SPEC.json OUT.json

A rank that raises prints its traceback, creates ``OUT.json.failed``
(:data:`FAILED_SUFFIX`) and waits up to :data:`ABORT_AFTER_S` for the parent, which polls
for that file, to stop the launcher with SIGTERM. MPICH's launcher then ends every rank
and removes its ``/tmp/hydra_hwloc_xmlfile_*``, which ``MPI_Abort`` leaves behind. Only
if nobody stops it does the exception go on to ``-m mpi4py``, which aborts every rank, so
a failing rank never leaves the others waiting.

SPEC holds the cases ``{op, path, bytes, dtype, reps, warmup}``; for each one every rank
first checks the op's result once against its closed form, then times ``warmup + reps``
iterations of::

    comm.Barrier(); t0 = perf_counter(); <MPI op>; t1 = perf_counter()

exactly as the emulator's ``_bench_program`` does. Rank 0 gathers every rank's
``[(t0, t1), ...]`` and writes OUT atomically; the parent turns them into records with
:func:`vcluster.cli.bench_collectives.timed_record`.

The ops (torch.distributed names -> MPI): all_reduce -> Allreduce(SUM), all_gather ->
Allgather, reduce_scatter -> Reduce_scatter_block(SUM), all_to_all -> Alltoall,
broadcast -> Bcast, reduce -> Reduce(SUM), gather -> Gather, scatter -> Scatter; the
rooted ones at root 0. Paths as the emulator's: ``resident`` reuses buffers allocated
once (all_reduce in place, ``MPI.IN_PLACE``); ``copy`` sends an array made once and
receives into a new array every call.

Closed forms of the check, with rank r of n sending (r + 1) (the root's data for
broadcast and scatter: piece j = j + 1): all_reduce, reduce (at root) and reduce_scatter
give n(n+1)/2 everywhere; all_gather and gather (at root) give piece j = j + 1;
all_to_all gives piece j = j + 1 on every rank; broadcast gives 1; scatter gives r + 1.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

from vcluster.cli.bench_collectives import message_shapes
from vcluster.runtime.files import write_json

__all__ = ["main", "run_case", "FAILED_SUFFIX", "ABORT_AFTER_S"]

# A failing rank's flag for the parent: OUT.json + this.
FAILED_SUFFIX = ".failed"
# How long a failing rank waits to be stopped before it lets mpi4py abort: the parent
# polls every 0.1 s (vcluster.cli.bench_mpi), so this is only for runs without it.
ABORT_AFTER_S = 10.0


def _buffers(op: str, path: str, n_in: int, n_out: int, dtype, rank: int):
    """(input, output) of one rank before the first call; None where the op takes none."""
    root = rank == 0
    x = np.zeros(n_in, dtype) if path == "resident" else np.full(n_in, rank + 1, dtype)
    in_place = op == "broadcast" and root or op == "all_reduce" and path == "resident"
    out = x if in_place else np.empty(n_out, dtype)
    if op in ("gather", "reduce") and not root:
        out = None
    if op == "scatter" and not root:
        x = None
    return x, out


def _call(comm, MPI, op: str, x, out):
    """One collective; returns the array that holds its result on this rank (or None)."""
    if op == "all_reduce":
        if out is x:
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        else:
            comm.Allreduce(x, out, op=MPI.SUM)
    elif op == "all_gather":
        comm.Allgather(x, out)
    elif op == "reduce_scatter":
        comm.Reduce_scatter_block(x, out, op=MPI.SUM)
    elif op == "all_to_all":
        comm.Alltoall(x, out)
    elif op == "broadcast":
        comm.Bcast(out, root=0)
    elif op == "reduce":
        comm.Reduce(x, out, op=MPI.SUM, root=0)
    elif op == "gather":
        comm.Gather(x, out, root=0)
    elif op == "scatter":
        comm.Scatter(x, out, root=0)
    else:
        raise ValueError(f"op = {op!r}: MPI benchmark ops are all_reduce, all_gather, "
                         "reduce_scatter, all_to_all, broadcast, reduce, gather, scatter")
    return out


def _expected(op: str, rank: int, n: int, n_out: int) -> np.ndarray | None:
    """The closed form of the check's result on ``rank`` (see the module docstring)."""
    total = n * (n + 1) / 2
    pieces = np.repeat(np.arange(1, n + 1), n_out // n) if n_out % n == 0 else None
    if op in ("all_reduce", "reduce_scatter"):
        return np.full(n_out, total)
    if op == "reduce":
        return np.full(n_out, total) if rank == 0 else None
    if op in ("all_gather", "all_to_all"):
        return pieces
    if op == "gather":
        return pieces if rank == 0 else None
    if op == "broadcast":
        return np.ones(n_out)
    return np.full(n_out, rank + 1)                       # scatter


def _check(comm, MPI, op: str, n_in: int, n_out: int, dtype) -> None:
    """One call on known data; raises (naming rank, op and the closed form) if MPI's
    result differs from :func:`_expected`."""
    rank, n = comm.Get_rank(), comm.Get_size()
    x, out = _buffers(op, "copy", n_in, n_out, dtype, rank)
    if op == "broadcast":
        out[...] = 1 if rank == 0 else 0
    if op == "scatter" and rank == 0:
        x[...] = np.repeat(np.arange(1, n + 1), n_in // n)
    got = _call(comm, MPI, op, x, out)
    want = _expected(op, rank, n, n_out)
    if want is not None and not np.array_equal(got, want.astype(dtype)):
        raise RuntimeError(
            f"MPI {op} on rank {rank} of {n}: got {got[:8]}..., expected the closed form "
            f"{want[:8]}... (rank r sends r + 1; see vcluster.cli.bench_mpi_rank)")


def run_case(comm, MPI, case: dict) -> list[tuple[float, float]]:
    """Check one (op, path, bytes) once, then time it; this rank's [(t0, t1), ...]."""
    op, path, nbytes = case["op"], case["path"], case["bytes"]
    dtype = np.dtype(case["dtype"])
    rank, n = comm.Get_rank(), comm.Get_size()
    n_in, n_out = message_shapes(op, nbytes, n, dtype.itemsize)
    _check(comm, MPI, op, n_in, n_out, dtype)
    x, out = _buffers(op, path, n_in, n_out, dtype, rank)
    fresh = path == "copy" and out is not None and out is not x
    times = []
    for i in range(case["warmup"] + case["reps"]):
        if fresh:
            out = np.empty(n_out, dtype)
        comm.Barrier()
        t0 = time.perf_counter()
        _call(comm, MPI, op, x, out)
        t1 = time.perf_counter()
        if i >= case["warmup"]:
            times.append((t0, t1))
    return times


def main(argv: list[str]) -> int:
    from mpi4py import MPI

    import mpi4py
    if len(argv) != 2:
        raise ValueError(f"arguments = {argv!r}: expected SPEC.json OUT.json")
    with open(argv[0]) as f:
        spec = json.load(f)
    comm = MPI.COMM_WORLD
    results = []
    try:
        for case in spec["cases"]:
            times = comm.gather(run_case(comm, MPI, case), root=0)
            results.append(dict(case, times=times))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        with open(argv[1] + FAILED_SUFFIX, "w") as f:
            f.write(f"rank {comm.Get_rank()}\n")
        time.sleep(ABORT_AFTER_S)               # the parent stops the launcher meanwhile
        raise
    if comm.Get_rank() == 0:
        write_json(argv[1], {"library": MPI.Get_library_version().strip(),
                             "mpi4py": mpi4py.__version__, "ranks": comm.Get_size(),
                             "cases": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
