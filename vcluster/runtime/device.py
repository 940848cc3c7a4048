"""``VirtualDevice``: one virtual GPU, a real process serving its host.

The launcher forks it with the cluster's shared memory already mapped; it then answers
commands on its control socket until told to stop or until the host goes away:

* ``run``: unpack the program and its arguments (large arrays land in this device's
  arena), call ``fn(dev, *args)``, wait for queued communication, send the result back;
* ``stats`` / ``trace`` / ``reset_stats``: read or clear the recorder (and the arena's
  bytes in use and peak; a reset starts a new peak window);
* ``set_delays``: slow this device or its links (injected faults, :mod:`vcluster.runtime.faults`);
* ``reset_comm``: forget call numbers and message state after a failed run (the host
  zeroes the shared counters while every device is idle);
* ``shutdown``.

When the program raises, the device sets the cluster's abort word first, so peers that
wait for it in a collective stop within one nap instead of timing out.
"""

from __future__ import annotations

import os
import socket
import traceback

from .algorithm import AlgorithmSettings
from .arrays import ArrayModule, array_module as array_module_named
from .channel import VirtualChannel
from .device_memory import CudaIpcSpace, StrictSpace
from .emulated_device import EmulatedDevice
from .errors import DeviceAborted, error_kind
from .fabric import ABORT_ERROR, Fabric
from .recorder import Recorder
from .transfer import pack, unpack
from .wire import PeerClosed, recv_msg, send_msg

__all__ = ["VirtualDevice"]

_MAX_DEVICE_ARENA_BYTES = 1 << 30     # cupy + ipc: GPU memory a device exports, at most


def _resident_space(rank: int, n: int, fabric: Fabric, arrays: ArrayModule, transport: str,
                    device_arena_bytes: int | None):
    """Where this device's collectives keep device arrays (None: staged through the host)."""
    if not arrays.device or transport != "ipc":
        return None
    if arrays.name == "strict":
        return StrictSpace(fabric.arenas)
    cp = arrays.xp
    if device_arena_bytes is None:
        total = cp.cuda.Device().mem_info[1]
        device_arena_bytes = min(_MAX_DEVICE_ARENA_BYTES, total // (8 * n))
    return CudaIpcSpace(rank, fabric.arenas, int(device_arena_bytes), cp)


class VirtualDevice:
    """The device process: its fabric view, channel, recorder and program context."""

    def __init__(self, rank: int, mesh, sock: socket.socket, fabric: Fabric,
                 array_module: str, settings: AlgorithmSettings, transport: str = "host",
                 device_arena_bytes: int | None = None):
        self.rank, self.sock, self.fabric = rank, sock, fabric
        self.arrays = array_module_named(array_module)
        self.xp = self.arrays.xp
        # first, so that a CUDA IPC handle takes the first block of the host arena
        self.space = _resident_space(rank, mesh.size, fabric, self.arrays, transport,
                                     device_arena_bytes)
        self.channel = VirtualChannel(fabric)
        self.recorder = Recorder(rank)
        self.context = EmulatedDevice(rank, mesh, fabric, self.channel, self.recorder,
                                      self.arrays, settings, self.space)
        self._results: list = []     # result buffers the host copies before its next command

    def __repr__(self) -> str:
        return f"VirtualDevice(rank={self.rank}, pid={os.getpid()})"

    def serve(self) -> None:
        send_msg(self.sock, ("ready", os.getpid()))
        while True:
            try:
                msg = recv_msg(self.sock)
            except PeerClosed:
                return                     # the host is gone
            self._results.clear()          # the host has copied the last results
            self.channel.release_taken()   # and every receive of the last run is done
            kind = msg[0]
            if kind == "shutdown":
                self.context.close()
                if self.space is not None:
                    self.space.close()
                send_msg(self.sock, ("ok", None))
                return
            try:
                reply = self._handle(kind, msg)
            except PeerClosed:
                return
            send_msg(self.sock, reply)

    def _handle(self, kind: str, msg: tuple):
        if kind == "run":
            return self._run(*msg[1:])
        if kind == "stats":
            return ("ok", (self._totals(), self.recorder.per_peer()))
        if kind == "trace":
            return ("ok", list(self.recorder.events))
        if kind == "reset_stats":
            self.recorder.reset()
            self.fabric.arenas[self.rank].reset_peak()
            return ("ok", None)
        if kind == "reset_comm":
            self.channel.reset()
            self.context.reset()
            return ("ok", None)
        if kind == "set_delays":
            self.context.set_delays(msg[1])
            return ("ok", None)
        if kind == "ping":
            return ("ok", os.getpid())
        return ("error", f"unknown command {kind!r}", "")

    def _totals(self) -> dict:
        """One row of ``cluster.stats()``: the recorder's counters and this arena's use.

        Read between runs, after the last run's result buffers were released (``serve``
        clears them before each command): ``arena_bytes_in_use`` is what stays allocated
        from one run to the next, ``arena_peak_bytes`` the most in use at any moment since
        the last ``reset_stats`` (or the start), ``arena_committed_bytes`` the shared
        memory the arena holds (its high-water mark, kept for reuse until the cluster
        closes).
        """
        arena = self.fabric.arenas[self.rank]
        return dict(self.recorder.totals(), arena_bytes_in_use=arena.used_bytes,
                    arena_peak_bytes=arena.peak_bytes,
                    arena_committed_bytes=arena.committed_bytes)

    def _run(self, fn_bytes: bytes, data: bytes, locations) -> tuple:
        f = self.fabric
        try:
            adopt = self.arrays.adopt if self.arrays.device else None
            fn, (args, h2d) = unpack(fn_bytes, [], f.arenas_by_owner, None, adopt)[0], \
                unpack(data, locations, f.arenas_by_owner, f.arenas[self.rank], adopt)
            self.recorder.add_transfer(h2d_bytes=h2d)
            self.context.begin_run()
            result = fn(self.context, *args)
            self.context.synchronize()
            self.context.check_clean()
            to_host = self._result_to_host if self.arrays.device else None
            payload, result_locations = pack(result, f.arenas[self.rank], self._results,
                                             to_host=to_host)
            self.recorder.add_transfer(d2h_bytes=sum(n for _, _, n in result_locations))
            return ("ok", (payload, result_locations))
        except DeviceAborted as exc:
            self._settle()
            return ("aborted", str(exc))
        except BaseException as exc:  # the program's error travels to the host
            f.abort(self.rank, ABORT_ERROR)
            self._settle()
            return ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                    error_kind(exc))

    def _result_to_host(self, x):
        """A result's device array as a host array (None for anything else)."""
        return self.arrays.to_host(x) if self.arrays.is_device(x) else None

    def _settle(self) -> None:
        """Let queued communication finish aborting before reporting."""
        try:
            self.context.synchronize()
        except BaseException:
            pass
