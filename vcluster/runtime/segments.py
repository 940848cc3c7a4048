"""POSIX shared-memory segments: create, map, unlink, and sweep leaks.

Every segment this project creates is named ``vcluster-<creator pid>-<token>-<role>``
(``/dev/shm/vcluster-...`` on Linux), so a leak is easy to find and to attribute.

A cluster creates its segments in the host process, hands their file descriptors to the
launcher, and unlinks the names as soon as every process has mapped them: from then on
the memory lives exactly as long as the processes that map it, so even a ``kill -9`` of
everything cannot leave a segment behind. ``sweep_stale_segments`` removes names whose
creator died in the short window before that unlink.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from dataclasses import dataclass

import _posixshmem  # CPython's own binding of shm_open/shm_unlink (used by multiprocessing)

__all__ = ["PREFIX", "Segment", "create_segment", "map_segment_fd", "sweep_stale_segments",
           "list_segments", "shm_available_bytes"]

PREFIX = "vcluster"
_SHM_DIR = "/dev/shm"


@dataclass(eq=False)
class Segment:
    """A mapped shared-memory segment.

    ``buf`` is the mmap; ``address`` the address of its first byte in this process.
    ``fd`` stays open until :meth:`close` so that it can be passed to a child process.
    """

    name: str
    size_bytes: int
    fd: int
    buf: mmap.mmap
    address: int

    def __repr__(self) -> str:
        return f"Segment(name={self.name!r}, size_bytes={self.size_bytes})"

    def unlink(self) -> None:
        """Remove the name; the mapping stays valid in every process that has it."""
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map(fd: int, size_bytes: int) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # The address pins an export on the mmap, so it is never unmapped while arrays use it;
    # the mapping goes away with the process (or when the last reference is dropped).
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, address


def create_segment(role: str, size_bytes: int) -> Segment:
    """Create and map a new zero-filled segment of ``size_bytes`` (rounded up to a page)."""
    if size_bytes <= 0:
        raise ValueError(f"size_bytes must be positive, got {size_bytes}")
    size_bytes = -(-size_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}-{role}"
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size_bytes)
        buf, address = _map(fd, size_bytes)
    except BaseException:
        os.close(fd)
        _posixshmem.shm_unlink("/" + name)
        raise
    return Segment(name, size_bytes, fd, buf, address)


def map_segment_fd(name: str, fd: int, size_bytes: int) -> Segment:
    """Map a segment from an inherited file descriptor (in the launcher or a device)."""
    buf, address = _map(fd, size_bytes)
    return Segment(name, size_bytes, fd, buf, address)


def list_segments() -> list[str]:
    """Names of this project's segments that currently exist (Linux; [] elsewhere)."""
    try:
        return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(PREFIX + "-"))
    except FileNotFoundError:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Unlink segments whose creating process no longer exists; returns their names."""
    removed = []
    for name in list_segments():
        parts = name.split("-")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        if not _pid_alive(int(parts[1])):
            try:
                _posixshmem.shm_unlink("/" + name)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def shm_available_bytes() -> int | None:
    """Free bytes in the shared-memory file system, or None where it cannot be told."""
    try:
        st = os.statvfs(_SHM_DIR)
    except (FileNotFoundError, OSError):
        return None
    return st.f_bavail * st.f_frsize
