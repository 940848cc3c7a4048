"""The launcher: a clean Python process that forks the cluster's devices.

``VirtualCluster`` starts it as ``python -m vcluster.runtime.launcher FD`` (its own
launcher, independent of multiprocessing's start method), hands it the shared-memory
file descriptors and one control socket per device, and it:

1. limits BLAS to one thread per device (the environment is set before numpy loads),
   and has freed memory kept for reuse (:func:`keep_freed_memory`);
2. maps the segments, imports the modules of the cluster's ``preload`` option (once, for
   every device), then forks one ``VirtualDevice`` per rank (pinned to its
   ``cpu_sets`` CPUs when the cluster pins devices) — forking a process
   that never ran user code is safe and fast (~30 ms for 8), unlike ``spawn`` (~0.85 s)
   which would also re-import the user's ``__main__``. What it imported is frozen
   out of the garbage collector's reach first (``gc.freeze``, as the ``gc`` docs advise
   before a fork): a device's full collections then skip the ~24,500 objects of numpy
   and the runtime (more with ``preload``) — a full collection took ~12 ms on the
   width-128 MLP, one per ~200 steps per device (issue 32) — and never write to their
   pages, which stay shared;
3. reports each device's exit to the host, restarts a rank on request, and kills every
   device if the host goes away (its socket closes), so no process is ever orphaned.
   Devices die with the launcher too (``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1
_REAP_INTERVAL_S = 0.05
# glibc mallopt(3) parameters, and what the devices use
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20     # glibc's largest: blocks below it come from the heap
TRIM_THRESHOLD_BYTES = 1 << 30      # free memory the top of a heap keeps before shrinking


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` (glibc) reuse freed memory instead of handing it
    back to the kernel; forks inherit it. True when set, False without glibc's mallopt.

    By default glibc serves blocks above a threshold that moves with the program
    (128 KiB at first) by ``mmap`` and unmaps them when freed, and gives the top of its
    heap back past twice that threshold; every new array of activation size then
    faults its pages in again (~2 us per 4 KiB page on a virtual machine: a float32
    ``x * y + z`` on 1 MiB runs at ~0.9 GFLOP/s on fresh pages, ~8 on reused ones).
    Devices instead keep what they freed, up to :data:`TRIM_THRESHOLD_BYTES` per heap,
    and get blocks below :data:`MMAP_THRESHOLD_BYTES` from it — as a GPU's caching
    allocator keeps its blocks — so a program's steps after the first reuse the pages
    of the one before.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _start_device(rank: int, config: dict, segments: dict, host_sock: socket.socket) -> int:
    pid = os.fork()
    if pid:
        return pid
    # --- child: the device --------------------------------------------------------------
    code = 0
    try:
        die_with_parent()
        if config.get("cpu_sets") is not None:   # before any thread: they inherit it
            os.sched_setaffinity(0, config["cpu_sets"][rank])
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # the host handles Ctrl-C
        gc.enable()
        host_sock.close()
        for r, fd in enumerate(config["device_fds"]):
            if r != rank:
                os.close(fd)
        from .algorithm import AlgorithmSettings
        from .device import VirtualDevice
        from .fabric import fabric_from_segments
        from .layout import ControlLayout
        layout = ControlLayout(*config["layout"])
        fabric = fabric_from_segments(rank, layout, segments["control"], segments["arenas"],
                                      segments["host"], config["wait"], config["timeout_s"],
                                      config.get("cpu_sets"))
        for seg in [segments["control"], segments["host"], *segments["arenas"]]:
            if seg is not segments["arenas"][rank]:
                seg.close_fd()      # mapped for good; only the own arena's grows
        sock = socket.socket(fileno=config["device_fds"][rank])
        try:
            device = VirtualDevice(rank, config["mesh"], sock, fabric, config["array_module"],
                                   AlgorithmSettings(config["algorithm"]),
                                   config["transport"], config["device_arena_bytes"])
        except BaseException as exc:
            from .wire import send_msg
            send_msg(sock, ("startup-error", f"{type(exc).__name__}: {exc}"))
            raise
        device.serve()
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def main() -> None:
    from .segments import map_segment_fd
    from .wire import PeerClosed, readable, recv_msg, send_msg

    gc.disable()        # until the forks: no collection leaves holes in shared pages
    host = socket.socket(fileno=int(sys.argv[1]))
    config = recv_msg(host)
    sys.path[:] = config["sys_path"]
    seg = lambda spec: map_segment_fd(*spec)  # noqa: E731  (name, fd, size)
    segments = {"control": seg(config["control"]), "host": seg(config["host_arena"]),
                "arenas": [seg(spec) for spec in config["arenas"]]}
    keep_freed_memory()
    import numpy  # noqa: F401  (loaded once here, shared by every fork)
    from . import device  # noqa: F401
    for name in config["preload"]:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            send_msg(host, ("preload-error", f"preload: importing {name!r} failed: "
                                             f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from None

    gc.freeze()
    pids = {}
    for rank in range(len(config["device_fds"])):
        pids[_start_device(rank, config, segments, host)] = rank
    gc.enable()
    send_msg(host, ("started", {r: p for p, r in pids.items()}))
    for fd in config["device_fds"]:
        os.close(fd)
    try:
        while pids:
            if readable(host, _REAP_INTERVAL_S):
                msg = recv_msg(host)
                if msg[0] == "kill":
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
            while pids:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                rank = pids.pop(pid, None)
                if rank is not None:
                    send_msg(host, ("exited", rank, status))
    except (PeerClosed, OSError):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(pids):
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
