"""``vcluster bench collectives --mpi``: the same cases on real MPI ranks, in the same run.

The ranks are started once for all cases by the MPI's own launcher::

    mpiexec -n N <this python> -m mpi4py -m vcluster.cli.bench_mpi_rank SPEC.json OUT.json

with N = the emulator's device count. Each rank times every call as the emulator's
devices do (barrier, ``t0``, op, ``t1``; :mod:`vcluster.cli.bench_mpi_rank`), and
:func:`~vcluster.cli.bench_collectives.timed_record` turns the timings into the same
records: time of repetition i = max over ranks of t1 - min over ranks of t0, median over
the repetitions. ``algorithm`` and ``transport`` of an MPI record are the library's
name (``mpich``, ``open-mpi``).

The launcher is ``--mpiexec`` when given, else the ``mpiexec`` beside this interpreter
(where the ``mpich`` wheel puts it), else the first on ``PATH``. Missing mpi4py or
mpiexec is an error before anything runs.

MPICH runs with its defaults. With 8 ranks on 2 cores its 8 B all_reduce took 62–76 µs
with or without its progress throttle (``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1``, five
alternating runs each, 2026-11-26), so the command sets nothing; ``MPIR_CVAR_*`` in the
environment reach the ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

from .bench_collectives import (OPS, PATHS, BenchRecord, default_reps, memcpy_gbps,
                                message_bytes, timed_record)
from .bench_mpi_rank import FAILED_SUFFIX

__all__ = ["INSTALL_HINT", "MPI_RUN_TIMEOUT_S", "find_mpiexec", "run_mpi_bench"]

INSTALL_HINT = "pip install 'vcluster[mpi]'  (mpi4py and the mpich wheel, which has mpiexec)"

# The whole MPI run (every case), generous: 64 ranks x 64 MiB x 8 ops is minutes on 2 cores.
MPI_RUN_TIMEOUT_S = 1800.0

# How long the launcher may take to go after SIGTERM, and after SIGKILL.
_KILL_WAIT_S = 10.0
# How often the parent looks for a failed rank's flag while the ranks run.
_POLL_S = 0.1


def find_mpiexec(requested: str | None = None) -> str:
    """The MPI launcher to use, after checking that mpi4py is importable here.

    Raises ValueError naming what is missing (mpi4py, or the launcher and where it was
    looked for) and how to install it."""
    if importlib.util.find_spec("mpi4py") is None:
        raise ValueError(f"--mpi needs mpi4py, which is not installed for {sys.executable}; "
                         f"install it with: {INSTALL_HINT}")
    if requested is not None:
        found = shutil.which(requested)
        if found is None:
            raise ValueError(f"--mpiexec = {requested!r}: no such executable; give the path "
                             f"of an MPI launcher (mpiexec), or install one with: "
                             f"{INSTALL_HINT}")
        return found
    beside = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found is None:
        raise ValueError(f"--mpi needs an MPI launcher: no mpiexec in {os.path.dirname(beside)} "
                         f"nor on PATH; install one with: {INSTALL_HINT} (or name one with "
                         "--mpiexec PATH)")
    return found


def _library_name(version: str) -> str:
    """``MPICH Version: 5.0.2 ...`` -> ``mpich``; ``Open MPI v4.1.6 ...`` -> ``open-mpi``."""
    head = version.strip().lower()
    if head.startswith("open mpi"):
        return "open-mpi"
    return head.split()[0].rstrip(":") if head else "mpi"


def run_mpi_bench(devices: int, sizes, ops=OPS, paths=PATHS, dtype: str = "float32",
                  reps: int | None = None, warmup: int = 1, mpiexec: str | None = None,
                  timeout_s: float = MPI_RUN_TIMEOUT_S) -> tuple[dict, list[BenchRecord]]:
    """Every (op, size, path) on ``devices`` MPI ranks; (info, one record each).

    ``info`` has ``library`` (the first line of ``MPI_Get_library_version``), ``mpi4py``,
    ``mpiexec`` and ``ranks``. Sizes and repetitions follow the emulator's bench
    (:func:`message_bytes`, :func:`default_reps`). Raises TimeoutError naming the ranks
    and the launcher when the run exceeds ``timeout_s`` (every rank is killed), and
    RuntimeError with the ranks' stderr when they fail (a wrong result among them)."""
    if devices < 1:
        raise ValueError(f"devices = {devices}: must be a positive number of MPI ranks")
    for name, given, allowed in (("ops", ops, OPS), ("paths", paths, PATHS)):
        unknown = [v for v in given if v not in allowed]
        if unknown:
            raise ValueError(f"{name} = {list(given)!r}: {unknown} unknown; allowed: "
                             + ", ".join(allowed))
    launcher = find_mpiexec(mpiexec)
    itemsize = np.dtype(dtype).itemsize
    cases = []
    for op in ops:
        for requested in sizes:
            nbytes = message_bytes(op, requested, devices, itemsize)
            for path in paths:
                cases.append({"op": op, "path": path, "bytes": nbytes, "dtype": str(dtype),
                              "reps": reps or default_reps(nbytes), "warmup": warmup})
    with tempfile.TemporaryDirectory(prefix="vcluster-mpi-bench-") as tmp:
        spec, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec, "w") as f:
            json.dump({"cases": cases}, f)
        command = [launcher, "-n", str(devices), sys.executable, "-m", "mpi4py", "-m",
                   "vcluster.cli.bench_mpi_rank", spec, out]
        _run_ranks(command, devices, launcher, timeout_s, out + FAILED_SUFFIX)
        with open(out) as f:
            result = json.load(f)
    library = " ".join(result["library"].splitlines()[0].split())
    name = _library_name(library)
    records, memcpy = [], {}
    for case in result["cases"]:
        key = (case["bytes"], case["reps"])
        if key not in memcpy:
            memcpy[key] = memcpy_gbps(*key)
        records.append(timed_record(case["op"], case["path"], name, case["dtype"],
                                    case["bytes"], case["times"], memcpy[key], "mpi",
                                    "numpy", name))
    info = {"library": library, "mpi4py": result["mpi4py"], "mpiexec": launcher,
            "ranks": result["ranks"]}
    return info, records


def _run_ranks(command: list[str], ranks: int, launcher: str, timeout_s: float,
               failed_flag: str) -> None:
    """Run the launcher in its own process group until it ends, a rank creates
    ``failed_flag`` (it raised: :mod:`vcluster.cli.bench_mpi_rank`) or ``timeout_s``
    passes; in the last two cases stop it (:func:`_stop`)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if os.path.exists(failed_flag):
                    stdout, stderr = _stop(proc, launcher)
                    break
                if time.monotonic() >= deadline:
                    _stop(proc, launcher)
                    raise TimeoutError(
                        f"bench collectives --mpi: waited {timeout_s:g} s for {ranks} MPI "
                        f"ranks started by {launcher} to finish their cases; killed them"
                    ) from None
    except BaseException:
        if proc.poll() is None:
            _stop(proc, launcher)
        raise
    if proc.returncode != 0 or os.path.exists(failed_flag):
        raise RuntimeError(
            f"bench collectives --mpi: {ranks} MPI ranks ({' '.join(command[:3])} ...) "
            f"exited with status {proc.returncode}:\n{(stderr or stdout)[-4000:]}")


def _stop(proc: subprocess.Popen, launcher: str) -> tuple[str, str]:
    """Stop the launcher: SIGTERM first, so that it ends its ranks and removes its own
    files (MPICH's hydra leaves ``/tmp/hydra_hwloc_xmlfile_*`` when killed, and when a
    rank calls ``MPI_Abort``), then SIGKILL to its process group after
    :data:`_KILL_WAIT_S`. The shared-memory segments its ranks had mapped are removed
    after (MPICH unlinks its ``/dev/shm/mpich_shm_*`` only in ``MPI_Finalize``: ranks
    stopped in a collective leave theirs, 2 MB each, for good). Its output so far."""
    segments = _mapped_shm(proc.pid)
    try:
        return _terminate(proc, launcher)
    finally:
        for path in segments:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _mapped_shm(root_pid: int) -> set[str]:
    """The ``/dev/shm`` files mapped by ``root_pid`` and its descendants (the launcher, its
    proxy and the ranks, which MPICH's proxy starts in sessions of their own), read from
    ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:          # pid (comm) state ppid ...
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue                                      # gone meanwhile
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(None, 5)   # ... inode path
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/") \
                            and not fields[5].endswith(" (deleted)"):
                        out.add(fields[5])
        except OSError:
            continue                       # gone meanwhile, or not ours to read
    return out


def _terminate(proc: subprocess.Popen, launcher: str) -> tuple[str, str]:
    """SIGTERM, then SIGKILL to the process group: :func:`_stop`'s first part."""
    proc.terminate()
    try:
        return proc.communicate(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"bench collectives --mpi: {launcher} (pid {proc.pid}) still running "
            f"{2 * _KILL_WAIT_S:g} s after SIGTERM and SIGKILL") from None
