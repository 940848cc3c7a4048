"""``TorchCluster``: run per-device programs as local torch.distributed ranks.

>>> with TorchCluster(Mesh((2, 4), ("dp", "tp"))) as cluster:     # doctest: +SKIP
...     results = cluster.run(step, [(x,) for x in shards])

The same interface as :class:`~vcluster.VirtualCluster` (``mesh``, ``run``, ``close``),
so host conveniences such as ``MatMul.run(cluster, A, B)`` or ``MLP.fit`` work unchanged.
The ranks are persistent processes forked by a launcher that imported torch once
(:mod:`vcluster.torchdist.launcher`: a start costs one import and N forks). They meet through a
file store in a private temporary directory (no port to race for), create every axis
group once, and then serve ``run`` calls: the function is sent with cloudpickle, its
per-rank arguments and results by pickle.

Never a hang: the start waits at most ``start_timeout_s`` and names the ranks that did
not come up; a run waits at most ``run_timeout_s`` and names the ranks still busy; a
rank that dies is named by its exit code. After such a failure, or when a program fails
on some ranks while others are stuck in a collective, the ranks are killed and the
cluster must be restarted (``restart()``). ``close()`` stops and joins every rank
(killing stragglers), so no process outlives the cluster.
"""

from __future__ import annotations

import base64
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import weakref

from vcluster.runtime.arguments import check_run_args
from vcluster.runtime.transfer import dumps
from vcluster.runtime.errors import (ClusterBrokenError, DeviceLostError, DeviceProgramError,
                                     HostTimeout)
from .rank import backend_choice, require_torch

__all__ = ["TorchCluster"]

_GRACE_S = 3.0        # how long the other ranks get to report after one rank failed
_STOP_S = 5.0         # how long a rank gets to leave the process group on close


class TorchCluster:
    """``mesh.size`` local torch.distributed ranks serving per-device programs.

    Parameters
    ----------
    mesh : mesh.Mesh
        Rank r runs at ``mesh.index(r)``; every axis group becomes a process group.
    backend : "auto" | "gloo" | "nccl"
        ``auto``: NCCL when every rank can have its own GPU (``torch.cuda.device_count()
        >= mesh.size``), else gloo; when GPUs are present but too few, one warning says
        so. ``nccl`` with fewer GPUs than ranks (or no CUDA) raises a ValueError here,
        before any process starts. Decided once on the host; ``self.backend`` is the
        choice, which every rank (and every ``restart()``) uses.
    timeout_s : float
        The process groups' timeout: how long a rank waits for a peer in a collective.
    run_timeout_s, start_timeout_s : float
        Upper bounds of one ``run`` call and of the start.
    """

    def __init__(self, mesh, backend: str = "auto", timeout_s: float = 60.0,
                 run_timeout_s: float = 3600.0, start_timeout_s: float = 120.0):
        for name, value in (("timeout_s", timeout_s), ("run_timeout_s", run_timeout_s),
                            ("start_timeout_s", start_timeout_s)):
            if not value > 0:
                raise ValueError(f"TorchCluster: {name} must be > 0 seconds, got {value!r}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"TorchCluster: backend must be auto, gloo or nccl, got {backend!r}")
        require_torch()
        self.mesh, self.backend = mesh, _host_backend(backend, mesh.size)
        self.timeout_s, self.run_timeout_s = float(timeout_s), float(run_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.info: dict = {}
        self._conns: list = []
        self._broken: str | None = None
        self._start()

    def __repr__(self) -> str:
        status = "closed" if not self._conns else ("broken" if self._broken else "running")
        return f"TorchCluster({self.mesh}, backend={self.info.get('torch_backend')}, {status})"

    def __enter__(self) -> "TorchCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- life cycle -----------------------------------------------------------------
    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="vcluster-torch-")
        pairs = [socket.socketpair() for _ in range(self.mesh.size)]
        config = {"mesh": self.mesh, "backend": self.backend, "timeout_s": self.timeout_s,
                  "init_method": "file://" + os.path.join(self._tmp, "store"),
                  "sys_path": list(sys.path), "fds": [theirs.fileno() for _, theirs in pairs]}
        arg = base64.b64encode(pickle.dumps(config)).decode()
        self._launcher = subprocess.Popen(
            [sys.executable, "-m", "vcluster.torchdist.launcher", arg], stdin=subprocess.PIPE,
            pass_fds=config["fds"], env={**os.environ, "OMP_NUM_THREADS": "1"})
        for _, theirs in pairs:
            theirs.close()
        self._conns = [mpc.Connection(mine.detach()) for mine, _ in pairs]
        self._pids: list[int] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._launcher, self._conns,
                                           self._pids, self._tmp)
        self._broken = None
        try:
            replies = self._gather(self.start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        self._pids[:] = [rep[1].get("pid") for rep in replies.values() if rep[0] == "ready"]
        failed = {r: rep for r, rep in replies.items() if rep[0] != "ready"}
        if failed:
            rank = min(failed)
            self.close()
            raise DeviceProgramError(rank, "TorchCluster start", failed[rank][2],
                                     {r: rep[1] for r, rep in failed.items()})
        self.info = {k: v for k, v in replies[0][1].items() if k != "pid"}

    def close(self) -> None:
        """Stop every rank (killing any that do not stop) and remove the store (idempotent)."""
        if self._conns:
            self._finalizer()
            self._conns = []

    def restart(self) -> None:
        """Replace every rank with a fresh process (after a failure or a timeout)."""
        self.close()
        self._start()

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    # --- running programs -----------------------------------------------------------
    def run(self, fn, args_per_rank=None, timeout_s: float | None = None) -> list:
        """Call ``fn(dev, *args_per_rank[r])`` on every rank r; return the results by rank."""
        self._usable()
        args_per_rank = check_run_args(fn, args_per_rank, self.mesh.size)
        fn_bytes = dumps(fn)
        for conn, args in zip(self._conns, args_per_rank):
            conn.send(("run", fn_bytes, tuple(args)))
        name = getattr(fn, "__name__", repr(fn))
        replies = self._gather(timeout_s or self.run_timeout_s, name)
        failed = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
        if failed:
            rank = min(r for r, rep in failed.items() if rep[0] == "error")
            raise DeviceProgramError(rank, name, failed[rank][2],
                                     {r: rep[1] for r, rep in failed.items()})
        return [replies[r][1] for r in range(self.mesh.size)]

    def trace(self) -> list:
        """Every event recorded since the last ``reset_stats``, ordered by start time:
        ComputeEvents of ``dev.compute`` blocks and one CommEvent per call (algorithm =
        the backend; per-peer bytes are not reported by torch, so ``sent``/``received``
        are empty)."""
        events = [e for per_rank in self._ask_all("trace") for e in per_rank]
        return sorted(events, key=lambda e: (e.start, e.rank))

    def reset_stats(self) -> None:
        """Forget every rank's recorded events."""
        self._ask_all("reset_stats")

    def _ask_all(self, what: str) -> list:
        self._usable()
        for conn in self._conns:
            conn.send((what,))
        replies = self._gather(60.0, what)
        return [replies[r][1] for r in range(self.mesh.size)]

    def _usable(self) -> None:
        if not self._conns:
            raise ClusterBrokenError("the TorchCluster is closed; create a new one")
        if self._broken:
            raise ClusterBrokenError(f"the TorchCluster must be restarted: {self._broken} "
                                     "(call cluster.restart())")

    def _gather(self, timeout_s: float, what: str) -> dict:
        """Every rank's reply, or an error naming the ranks that died or are still busy.

        Once a rank has failed, the others get ``_GRACE_S`` (they may be waiting for it
        in a collective); ranks still busy then are killed and the cluster is broken.
        """
        replies: dict = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {c: r for r, c in enumerate(self._conns)}
        while len(replies) < len(self._conns):
            failed = any(rep[0] == "error" for rep in replies.values())
            if failed:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            pending = [c for c, r in by_conn.items() if r not in replies]
            ready = mpc.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                busy = sorted(by_conn[c] for c in pending)
                self._break(f"ranks {busy} still busy in {what}")
                if failed:
                    return {**replies, **{r: ("killed", "killed: stuck after another rank "
                                              "failed", "") for r in busy}}
                raise HostTimeout(f"TorchCluster: ranks {busy} did not finish {what} within "
                                  f"{timeout_s:g} s; the ranks were killed (call restart())")
            for conn in ready:
                try:
                    replies[by_conn[conn]] = conn.recv()
                except (EOFError, OSError):
                    rank = by_conn[conn]
                    self._break(f"rank {rank} died")
                    raise DeviceLostError(rank, f"its connection closed during {what}") from None
        return replies

    def _break(self, why: str) -> None:
        self._broken = why
        _kill(self._pids)


def _host_backend(backend: str, ranks: int) -> str:
    """The backend all ``ranks`` will use, decided before any of them starts: an error
    for NCCL without a GPU per rank, a warning (once per call site) when ``auto`` falls
    back to gloo because the GPUs are too few. ``gloo`` never imports torch here."""
    try:
        chosen, note = backend_choice(backend, ranks)
    except ValueError as exc:
        raise ValueError(f"TorchCluster: {exc}") from None
    if note:
        warnings.warn(f"TorchCluster: {note}", stacklevel=3)
    return chosen


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _shutdown(launcher, conns, pids, tmp) -> None:
    """Ask every rank to stop, close the launcher's stdin, and kill what is left."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    try:
        launcher.stdin.close()    # the launcher kills the ranks that are still running
    except OSError:
        pass
    try:
        launcher.wait(_STOP_S)
    except subprocess.TimeoutExpired:
        _kill(pids)
        launcher.kill()
        launcher.wait(_STOP_S)
    for conn in conns:
        conn.close()
    shutil.rmtree(tmp, ignore_errors=True)
