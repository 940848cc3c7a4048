"""``VirtualCluster``: N virtual devices on one machine, driven from the host process.

>>> from mesh import Mesh
>>> with VirtualCluster(Mesh((2, 4), ("dp", "tp"))) as cluster:   # doctest: +SKIP
...     results = cluster.run(step, [(x,) for x in shards])

The devices are persistent processes (see :mod:`vcluster.runtime.launcher`) that serve
``run`` calls until the cluster closes. Shared memory is created here, handed to the
launcher as file descriptors, and unlinked as soon as the launcher has mapped it, so no
segment can outlive the processes that use it.

Failures are reported, never hung on: a program error names the rank and carries its
traceback (the cluster stays usable); a dead device is named within a fraction of a
second (the cluster must then be restarted); a run that exceeds ``run_timeout_s`` or a
Ctrl-C aborts every device, and kills those that do not stop within a grace period.
"""

from __future__ import annotations

import selectors
import socket
import sys
import time
import weakref

from .arguments import check_run_args
from .channel import kind_text
from .errors import (ClusterBrokenError, DeviceLostError, HostTimeout, LeftoverMessagesError,
                     VClusterError, program_error)
from .events import CommEvent, ComputeEvent
from .fabric import ABORT_HOST, ABORT_LOST, fabric_from_segments
from .launcher_client import LauncherClient
from .layout import ControlLayout, S
from .options import ClusterOptions
from .segments import create_segment, shm_available_bytes, sweep_stale_segments
from .transfer import dumps, pack, unpack
from .wire import PeerClosed, recv_msg, send_msg

__all__ = ["VirtualCluster"]

_GRACE_S = 3.0          # how long aborted devices get to report before they are killed


def _cpus_text(cpu_sets) -> str:
    """The repr's ``cpus=``: ``any`` when not pinned, else per CPU set its ranks, e.g.
    ``0:r0-3,1:r4-7`` (ranks 0 to 3 on CPU 0, 4 to 7 on CPU 1)."""
    if cpu_sets is None:
        return "any"
    runs: list = []                      # [cpus, first rank, last rank]
    for r, cpus in enumerate(cpu_sets):
        if runs and runs[-1][0] == cpus:
            runs[-1][2] = r
        else:
            runs.append([cpus, r, r])
    return ",".join("+".join(map(str, cpus)) + (f":r{a}" if a == b else f":r{a}-{b}")
                    for cpus, a, b in runs)


class VirtualCluster:
    """A virtual GPU cluster of ``mesh.size`` device processes.

    Parameters
    ----------
    mesh : mesh.Mesh
        The device mesh; rank r is the device at ``mesh.index(r)``.
    array_module : "numpy" | "cupy" | "strict"
        What ``dev.xp`` is on the devices (:mod:`vcluster.runtime.arrays`): host arrays,
        CuPy arrays on the GPU, or ``strict`` — numpy math under CuPy's rules, which CI
        uses to catch host/device mixes without a GPU. On ``cupy`` and ``strict`` a
        program's array arguments arrive as device arrays and its results return as
        numpy arrays.
    timeout_s : float
        How long a device waits for a peer in any collective or receive before failing
        with :class:`CollectiveTimeout` (which names who waited for whom).
    algorithm : "auto" | "ring" | "tree" | "pairwise" | "shm"
        Cluster-wide algorithm preference (per call: ``algorithm=``).
    arena_bytes : int, optional
        The most shared memory one device may hold for resident arrays, staging and
        results. By default an arena grows on demand until the machine's shared memory
        (/dev/shm) is used up, and only then raises :class:`ArenaFullError` naming the
        bytes needed and free; pages are committed as allocations reach them, so an
        idle device costs nothing (:mod:`vcluster.runtime.arena`).
    run_timeout_s : float
        Upper bound of one ``run`` call.
    threads_per_device : int, optional
        Width of each device's BLAS/OpenMP thread pool. By default
        ``max(1, cores // devices)`` with the cores this process may use (affinity mask
        and cgroup quota), so the devices do not oversubscribe the machine; shown in the
        cluster's repr.
    transport : "auto" | "ipc" | "host"
        How collectives move device arrays (``cupy``, ``strict``): ``ipc`` keeps them in
        device memory that peers read in place (CUDA IPC on ``cupy``), ``host`` stages
        them through host shared memory. ``auto``: ``ipc`` on device modules, ``host`` on
        numpy. Each trace event says which ran (a group whose GPU refused IPC stages).
    device_arena_bytes : int, optional
        ``cupy`` with ``ipc``: the GPU memory each device exports to its peers
        (default: an eighth of the GPU's memory shared by the devices, at most 1 GiB
        each); buffers that do not fit are staged through the host.
    pin_devices : bool or None, optional
        Pin each device process to CPUs (Linux affinity masks), consecutive ranks
        sharing one (:func:`~vcluster.runtime.cores.device_cpu_sets`; ``options.cpu_sets``
        and the repr say which). False (the default) leaves them to the kernel's
        scheduler; None pins them when they outnumber the cores this process may use,
        where a pipeline or tensor-parallel group on one core hands work on without
        crossing cores (issue 32: the width-128 MLP step on 8 devices and 2 cores ran
        ~10% faster on a quiet machine, ~40% under other load); True pins them however
        many cores there are. Not the default because the ``localhost`` timing model
        prices devices the scheduler places and moves (docs/runtime.md).
    preload : sequence of str, optional
        Modules the launcher imports before it forks the devices, so that every device
        starts with them loaded instead of importing them at its first program (a
        program's module, e.g. a test module with pytest, or torch): paid once per
        cluster, not once per device. None (the default) takes the comma-separated names
        of the ``VCLUSTER_PRELOAD`` environment variable, or none. Each must be
        importable here; an import that fails in the launcher fails the start with its
        error. Shown in the repr.
    """

    def __init__(self, mesh, array_module: str = "numpy", timeout_s: float = 60.0,
                 algorithm: str = "auto", arena_bytes: int | None = None,
                 run_timeout_s: float = 3600.0, wait: str = "auto",
                 threads_per_device: int | None = None, transport: str = "auto",
                 device_arena_bytes: int | None = None, pin_devices: bool | None = False,
                 preload=None):
        self.options = ClusterOptions.build(mesh, array_module, timeout_s, algorithm,
                                            arena_bytes, run_timeout_s, wait,
                                            shm_available_bytes(), threads_per_device,
                                            transport, device_arena_bytes, pin_devices,
                                            preload)
        self.mesh = mesh
        self._state = None
        self._broken: str | None = None
        self._faults: tuple = ()          # injected slow devices / links (kept across restarts)
        self._start()

    def __repr__(self) -> str:
        status = "closed" if self._state is None else ("broken" if self._broken else "running")
        preload = self.options.preload
        preload_text = f", preload={','.join(preload)}" if preload else ""
        return (f"VirtualCluster({self.mesh}, {status}, "
                f"threads_per_device={self.options.threads_per_device}, "
                f"cpus={_cpus_text(self.options.cpu_sets)}{preload_text})")

    def __enter__(self) -> "VirtualCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- life cycle -----------------------------------------------------------------
    def _start(self) -> None:
        sweep_stale_segments()
        self._state = _ClusterState.start(self.mesh, self.options)
        self._broken = None
        # Close on garbage collection or interpreter exit, whatever the user forgets.
        self._finalizer = weakref.finalize(self, self._state.close)
        if self._faults:
            self._send_delays()

    def close(self) -> None:
        """Stop every device and release all shared memory (idempotent)."""
        if self._state is not None:
            self._finalizer()
            self._state = None

    def restart(self) -> None:
        """Replace every device with a fresh process (after a lost device or Ctrl-C)."""
        self.close()
        self._start()

    # --- injected faults --------------------------------------------------------------
    @property
    def faults(self) -> tuple:
        """The slow-device, slow-link and jitter faults in force (see :meth:`inject_faults`)."""
        return self._faults

    def inject_faults(self, faults) -> None:
        """Slow devices and links, or jitter, for every later run, until changed (``[]``:
        none).

        ``faults``: :class:`vcluster.runtime.faults.SlowFault` /
        :class:`~vcluster.runtime.faults.LinkFault` / :class:`~vcluster.runtime.faults.
        JitterFault` objects or their dict form (a jitter makes every device pause at
        random before and after its communication: a stress mode for programs whose
        results might depend on timing). They stay in force across :meth:`restart` (a
        replaced process on a slow card is still slow); on a broken cluster they take
        effect at the restart. Crashes are training-step events: give
        :class:`~vcluster.runtime.faults.CrashFault` to the trainer (``MLP.fit(faults=...)``).
        """
        from vcluster.runtime.faults import CrashFault, parse_faults
        parsed = parse_faults(faults, "faults", self.mesh.size)
        crash = [i for i, f in enumerate(parsed) if isinstance(f, CrashFault)]
        if crash:
            raise ValueError(f"faults[{crash[0]}]: a crash fault fires at a training step; "
                             "pass it to the trainer (MLP.fit(faults=...)); inject_faults "
                             "takes kinds slow, link and jitter")
        self._faults = parsed
        if self._state is not None and not self._broken:
            self._send_delays()             # else they apply from the next restart()

    def _send_delays(self) -> None:
        from vcluster.runtime.faults import delays_for
        state = self._state
        for r in range(self.mesh.size):
            state.send(r, ("set_delays", delays_for(r, self._faults)))
        state.gather(30.0)

    def _usable(self) -> "_ClusterState":
        if self._state is None:
            raise ClusterBrokenError("the cluster is closed; create a new VirtualCluster")
        if self._broken:
            raise ClusterBrokenError(f"the cluster must be restarted: {self._broken} "
                                     "(call cluster.restart())")
        return self._state

    @property
    def pids(self) -> list[int]:
        """Process ids of the devices, by rank."""
        return list(self._usable().pids)

    # --- running programs -----------------------------------------------------------
    def run(self, fn, args_per_rank=None, timeout_s: float | None = None) -> list:
        """Call ``fn(dev, *args_per_rank[r])`` on every rank r; return the results by rank."""
        state = self._usable()
        args_per_rank = check_run_args(fn, args_per_rank, self.mesh.size)
        fn_bytes = dumps(fn)
        keep: list = []
        placed: dict = {}          # an array shared by many ranks' arguments is copied once
        try:
            for r, args in enumerate(args_per_rank):
                data, locations = pack(tuple(args), state.fabric.host_arena, keep, placed)
                state.send(r, ("run", fn_bytes, data, locations))
            replies = self._collect(state, getattr(fn, "__name__", repr(fn)),
                                    timeout_s or self.options.run_timeout_s)
        finally:
            keep.clear()
            placed.clear()
        results = []
        for payload, locations in replies:
            value, _ = unpack(payload, locations, state.fabric.arenas_by_owner, None)
            results.append(value)
        return results

    def _collect(self, state: "_ClusterState", fn_name: str, timeout_s: float) -> list:
        """Wait for every device's reply; turn failures into errors that name ranks."""
        try:
            replies = state.gather(timeout_s)
        except DeviceLostError as exc:
            self._broken = str(exc)
            raise
        except HostTimeout as exc:
            if not state.abort_and_settle(ABORT_HOST):
                self._broken = str(exc)
            raise
        except KeyboardInterrupt:
            if not state.abort_and_settle(ABORT_HOST):
                self._broken = "interrupted while devices were busy"
            raise
        failed = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
        if failed:
            state.reset_comm()
            errors = {r: rep[1] for r, rep in failed.items() if rep[0] == "error"}
            if not errors:
                raise VClusterError("run aborted: " + "; ".join(rep[1] for rep in failed.values()))
            first = state.first_failure(errors)
            reply = failed[first]
            raise program_error(first, fn_name, reply[2], errors,
                                reply[3] if len(reply) > 3 else None)
        unreceived = state.unreceived()
        if unreceived:
            state.reset_comm()
            raise LeftoverMessagesError(
                f"{fn_name} ended with {len(unreceived)} message(s) that no receive took: "
                + "; ".join(unreceived[:8]) + ("; ..." if len(unreceived) > 8 else "")
                + " — every message must be received in the run that sends it (the next "
                "run would take it in place of its own); the cluster dropped them")
        return [replies[r][1] for r in range(self.mesh.size)]

    # --- statistics and trace -------------------------------------------------------
    def _ask_all(self, command: str) -> list:
        state = self._usable()
        for r in range(self.mesh.size):
            state.send(r, (command,))
        try:
            replies = state.gather(60.0)
        except DeviceLostError as exc:
            self._broken = str(exc)
            raise
        return [replies[r][1] for r in range(self.mesh.size)]

    def stats(self, per_peer: bool = False):
        """Traffic and work per device since the last reset, as a pandas DataFrame.

        Columns: rank, messages_sent, bytes_sent, messages_received, bytes_received,
        h2d_bytes, d2h_bytes, flops, arena_bytes_in_use (bytes of the device's arena
        allocated now, between runs), arena_peak_bytes (the most in use at any moment
        since the last :meth:`reset_stats`), arena_committed_bytes (the shared memory
        the arena holds: it grows to the high-water mark and keeps it), and the peaks of
        what the programs said they held (``dev.record_memory``): peak_params_bytes,
        peak_grads_bytes, peak_optimizer_bytes, peak_activations_bytes (0 where a
        program never said); with ``per_peer=True`` one row per (rank, peer), traffic only.
        """
        import pandas as pd
        from .recorder import PEER_COLUMNS, STAT_COLUMNS
        answers = self._ask_all("stats")
        if per_peer:
            rows = [row for _, peers in answers for row in peers]
            return pd.DataFrame(rows, columns=list(PEER_COLUMNS))
        return pd.DataFrame([totals for totals, _ in answers], columns=list(STAT_COLUMNS))

    def trace(self) -> list[CommEvent | ComputeEvent]:
        """Every event recorded since the last reset, ordered by start time."""
        events = [e for per_rank in self._ask_all("trace") for e in per_rank]
        return sorted(events, key=lambda e: (e.start, e.rank))

    def reset_stats(self) -> None:
        """Clear counters and trace on every device; the arena peak restarts at the bytes
        in use now."""
        self._ask_all("reset_stats")


class _ClusterState:
    """The resources of one incarnation of a cluster (what ``restart`` replaces)."""

    def __init__(self, mesh, options, segments, fabric, socks, launcher: LauncherClient, pids):
        self.mesh, self.options, self.segments, self.fabric = mesh, options, segments, fabric
        self.socks, self.launcher, self.pids = socks, launcher, pids
        self.selector = selectors.DefaultSelector()
        for r, s in enumerate(socks):
            self.selector.register(s, selectors.EVENT_READ, r)
        self.closed = False

    @classmethod
    def start(cls, mesh, options) -> "_ClusterState":
        n = mesh.size
        layout = ControlLayout(n, 1 << len(mesh.axes))
        segments = []
        try:
            control = create_segment("control", layout.size_bytes)
            segments.append(control)
            arenas = [create_segment(f"arena{r}", options.arena_bytes) for r in range(n)]
            segments.extend(arenas)
            host_arena = create_segment("host", options.host_arena_bytes)
            segments.append(host_arena)
            fabric = fabric_from_segments(-1, layout, control, arenas, host_arena, options.wait,
                                          options.timeout_s)
            pairs = [socket.socketpair() for _ in range(n)]
            config = {
                "layout": (layout.n_ranks, layout.n_slots, layout.mailbox_slots),
                "mesh": mesh, "array_module": options.array_module,
                "transport": options.transport,
                "device_arena_bytes": options.device_arena_bytes,
                "algorithm": options.algorithm, "wait": options.wait,
                "timeout_s": options.timeout_s, "sys_path": list(sys.path),
                "control": (control.name, control.fd, control.size_bytes),
                "arenas": [(a.name, a.fd, a.size_bytes) for a in arenas],
                "host_arena": (host_arena.name, host_arena.fd, host_arena.size_bytes),
                "device_fds": [b.fileno() for _, b in pairs],
                "cpu_sets": options.cpu_sets, "preload": options.preload,
            }
            launcher = LauncherClient.start(config, [s.fd for s in segments]
                                            + [b.fileno() for _, b in pairs],
                                            options.thread_environment())
            for _, b in pairs:
                b.close()
            socks = [a for a, _ in pairs]
            pids = launcher.wait_started(n, options.startup_timeout_s)
        except BaseException:
            for s in segments:
                s.unlink()
            raise
        for s in segments:        # every process has them mapped: drop the names now
            s.unlink()
            if s is not host_arena:   # the host's arena grows through its descriptor
                s.close_fd()
        state = cls(mesh, options, segments, fabric, socks, launcher, pids)
        state.await_ready(options.startup_timeout_s)
        return state

    # --- messaging ------------------------------------------------------------------
    def send(self, rank: int, msg) -> None:
        try:
            send_msg(self.socks[rank], msg)
        except PeerClosed:
            raise DeviceLostError(rank, self.launcher.exit_status(rank, 1.0)) from None

    def await_ready(self, timeout_s: float) -> None:
        replies = self.gather(timeout_s, expect_ready=True)
        bad = {r: rep[1] for r, rep in replies.items() if rep[0] != "ready"}
        if bad:
            self.close()
            r = min(bad)
            raise VClusterError(f"rank {r} could not start: {bad[r]}")

    def gather(self, timeout_s: float, expect_ready: bool = False) -> dict:
        """One reply from every device; raises DeviceLostError / HostTimeout."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        n = len(self.socks)
        while len(replies) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                late = [r for r in range(n) if r not in replies]
                raise HostTimeout(f"the host waited {timeout_s:g} s for rank(s) {late} to "
                                  "finish; raise run(timeout_s=...) or "
                                  "VirtualCluster(run_timeout_s=...) for longer runs")
            for key, _ in self.selector.select(timeout=min(left, 0.2)):
                rank = key.data
                if rank in replies:
                    continue
                try:
                    replies[rank] = recv_msg(self.socks[rank])
                except PeerClosed:
                    self.device_lost(rank, replies)
        return replies

    def device_lost(self, rank: int, replies: dict) -> None:
        """A device's socket closed: abort the others, collect them, raise."""
        self.fabric.abort(rank, ABORT_LOST)
        how = self.launcher.exit_status(rank, 1.0)
        n = len(self.socks)
        deadline = time.monotonic() + _GRACE_S
        pending = {r for r in range(n) if r not in replies and r != rank}
        while pending and time.monotonic() < deadline:
            for key, _ in self.selector.select(timeout=0.1):
                r = key.data
                if r in pending:
                    try:
                        recv_msg(self.socks[r])
                    except PeerClosed:
                        pass
                    pending.discard(r)
        raise DeviceLostError(rank, how)

    def abort_and_settle(self, why: int) -> bool:
        """Abort every device; True if all reported back (then the cluster is usable)."""
        self.fabric.abort(-1, why)
        try:
            self.gather(_GRACE_S)
        except (HostTimeout, DeviceLostError, KeyboardInterrupt):
            self.launcher.kill_devices()
            return False
        self.reset_comm()
        return True

    def unreceived(self) -> list[str]:
        """The messages still in a mailbox (sent, never received), oldest first per pair,
        in words; read once every device has finished its run."""
        box = self.fabric.mailbox
        found = []
        for src, dst, slot in zip(*(box[..., S.STATE] != 0).nonzero()):
            words = box[src, dst, slot]
            found.append((int(src), int(dst), int(words[S.SEQ]), int(words[S.KIND]),
                          int(words[S.TAG]), int(words[S.NBYTES])))
        return [f"rank {src} -> rank {dst}: {kind_text(kind)} #{seq} (tag {tag}, "
                f"{nbytes} bytes)" for src, dst, seq, kind, tag, nbytes in sorted(found)]

    def first_failure(self, errors: dict[int, str]) -> int:
        """The rank that raised first (it set the abort word), else the lowest."""
        from .layout import ABORT_RANK
        first = int(self.fabric.header[ABORT_RANK])
        return first if first in errors else min(errors)

    def reset_comm(self) -> None:
        """Zero the shared counters and mailboxes; every device forgets its call numbers."""
        f = self.fabric
        f.progress[...] = 0
        f.desc[...] = 0
        f.posted[...] = 0
        f.mailbox[...] = 0
        f.header[...] = 0
        for r in range(len(self.socks)):
            self.send(r, ("reset_comm",))
        self.gather(30.0)

    # --- shutdown -------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for r, s in enumerate(self.socks):
            try:
                send_msg(s, ("shutdown",))
            except (PeerClosed, OSError):
                pass
        self.launcher.finish(timeout_s=5.0)
        self.selector.close()
        for s in self.socks:
            s.close()
        for seg in self.segments:
            seg.unlink()
            seg.close_fd()
