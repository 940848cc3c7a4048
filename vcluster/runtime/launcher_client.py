"""The host's handle on the launcher process (see :mod:`vcluster.runtime.launcher`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from .errors import VClusterError
from .wire import PeerClosed, readable, recv_msg, send_msg

__all__ = ["LauncherClient", "describe_status"]


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


class LauncherClient:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc, self.sock = proc, sock
        self.exits: dict[int, int] = {}

    @classmethod
    def start(cls, config: dict, fds: list[int], thread_env: dict[str, str]) -> "LauncherClient":
        """Start the launcher with ``fds`` open and ``thread_env`` (the thread-pool sizes,
        :meth:`ClusterOptions.thread_environment`) in its environment."""
        mine, theirs = socket.socketpair()
        env = dict(os.environ, **thread_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "vcluster.runtime.launcher", str(theirs.fileno())],
            pass_fds=fds + [theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            start_new_session=True)   # Ctrl-C in a terminal reaches only the host
        theirs.close()
        client = cls(proc, mine)
        send_msg(mine, config)
        return client

    def _read(self, timeout_s: float):
        if not readable(self.sock, timeout_s):
            return None
        msg = recv_msg(self.sock)
        if msg[0] == "exited":
            self.exits[msg[1]] = msg[2]
        return msg

    def wait_started(self, n: int, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self._read(0.1)
            except PeerClosed:
                break
            if msg is not None and msg[0] == "started":
                return [msg[1][r] for r in range(n)]
            if msg is not None and msg[0] == "preload-error":
                self.finish(5.0)
                raise VClusterError(f"the device launcher did not start: {msg[1]}")
            if self.proc.poll() is not None:
                break
        self.finish(1.0)
        raise VClusterError(f"the device launcher did not start (exit code "
                            f"{self.proc.returncode}); see its error output above")

    def exit_status(self, rank: int, timeout_s: float) -> str:
        """How ``rank`` ended, as the launcher saw it (waits up to timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while rank not in self.exits and time.monotonic() < deadline:
            try:
                self._read(deadline - time.monotonic())
            except PeerClosed:
                break
        if rank in self.exits:
            return describe_status(self.exits[rank])
        return "its process ended; exit status unknown"

    def kill_devices(self) -> None:
        try:
            send_msg(self.sock, ("kill",))
        except PeerClosed:
            pass

    def finish(self, timeout_s: float) -> None:
        """Wait for the launcher to exit after its devices; kill what lingers.

        Devices die with the launcher (PR_SET_PDEATHSIG), and the launcher kills them
        when this socket closes, so killing the launcher leaves no device behind.
        """
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_devices()
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
