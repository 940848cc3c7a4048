"""Sleeping on a word of shared memory until another process changes it.

Linux has futexes: ``FUTEX_WAIT(addr, v)`` sleeps only while ``*addr == v`` (the kernel
checks atomically, so a wake-up cannot be lost between the check and the sleep) and
``FUTEX_WAKE(addr)`` wakes the sleepers of that word. Waiting this way costs no CPU,
which matters when 8 virtual devices share 2 cores: busy polling there is catastrophic
(see shared/reference/transport-measurements.md).

Where futexes are not available (macOS, unknown architectures) :class:`PollWaker`
polls with an exponential back-off from 20 us to 1 ms; it is correct, just slower.
Both wait on the low 32 bits of an int64 word (little-endian), which changes whenever
the monotonically increasing counter does.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

__all__ = ["FutexWaker", "PollWaker", "make_waker", "futex_supported"]

# syscall numbers of futex(2) by machine (asm/unistd.h of each architecture)
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
              "ppc64le": 221, "ppc64": 221, "s390x": 238}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 2**31 - 1
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_supported() -> bool:
    return sys.platform.startswith("linux") and platform.machine().lower() in _SYS_FUTEX


class FutexWaker:
    """futex(2) through libc's ``syscall``; ctypes releases the GIL while it sleeps."""

    kind = "futex"

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._nr = _SYS_FUTEX[platform.machine().lower()]

    def sleep(self, address: int, value: int, timeout_s: float) -> None:
        """Sleep while the 32-bit word at ``address`` equals ``value`` (at most timeout_s)."""
        timeout_s = max(timeout_s, 0.0)
        ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        v = ctypes.c_int32(value & 0xFFFFFFFF).value
        self._syscall(self._nr, address, _FUTEX_WAIT, v, ctypes.addressof(ts), None, 0)

    def wake(self, address: int) -> None:
        self._syscall(self._nr, address, _FUTEX_WAKE, _INT_MAX, None, None, 0)


class PollWaker:
    """Portable fallback: the sleeper polls with back-off; waking is a no-op."""

    kind = "poll"

    def __init__(self) -> None:
        self._delay_s = _POLL_FIRST_S

    def sleep(self, address: int, value: int, timeout_s: float) -> None:
        word = ctypes.c_int32.from_address(address)
        if word.value != ctypes.c_int32(value & 0xFFFFFFFF).value:
            self._delay_s = _POLL_FIRST_S
            return
        time.sleep(min(self._delay_s, max(timeout_s, 0.0)))
        self._delay_s = min(self._delay_s * 2, _POLL_MAX_S)

    def wake(self, address: int) -> None:
        """Nothing to do: sleepers notice the change at their next poll."""


def make_waker(kind: str = "auto"):
    """``auto`` picks futexes where the platform has them, polling elsewhere."""
    if kind == "auto":
        kind = "futex" if futex_supported() else "poll"
    if kind == "futex":
        if not futex_supported():
            raise ValueError(f"wait='futex' is not supported on {sys.platform}/{platform.machine()}; "
                             "use wait='poll' or 'auto'")
        return FutexWaker()
    if kind == "poll":
        return PollWaker()
    raise ValueError(f"wait must be 'auto', 'futex' or 'poll', got {kind!r}")
