"""How many device processes this machine can hold, checked before any starts.

A cluster of n devices needs, beyond its arenas (committed only as arrays reach them):

* **open files** in the host process: about two per device (its control socket and its
  result pipe; 2.08 per device measured at 256 devices, docs/runtime.md) plus the
  host's own — ``FILES_PER_DEVICE · n + FILES_RESERVE`` must stay within the soft
  ``RLIMIT_NOFILE`` (``ulimit -n``);
* **memory**: a device forked from the launcher shares its Python and numpy pages; its
  own pages before any array are ~4 MB (measured on 16 devices, docs/runtime.md; the
  system's available memory fell by 0.4–1.9 MB per device starting 64 and 256 devices on
  2026-11-27) — ``BYTES_PER_DEVICE · n`` (twice the measured 4 MB) must stay within
  ``MemAvailable``.

A request beyond either fails at once, naming the number of devices that fits, instead
of failing midway (a launcher ``PeerClosed`` or a device killed for memory).
"""

from __future__ import annotations

__all__ = ["check_capacity", "memory_available_bytes", "open_files_limit",
           "FILES_PER_DEVICE", "FILES_RESERVE", "BYTES_PER_DEVICE"]

FILES_PER_DEVICE = 3          # 2.08 measured; one spare for the launcher's bookkeeping
FILES_RESERVE = 64            # the host's own: stdio, the launcher socket, segments, imports
BYTES_PER_DEVICE = 8 << 20    # 2 x the ~4 MB of a device's own pages


def memory_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_files_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE`` of this process (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:             # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def check_capacity(devices: int, available_bytes: int | None,
                   open_files: int | None) -> None:
    """Raise ``ValueError`` when ``devices`` processes would not fit (module docstring),
    naming what limits them and how many fit; None for a reading: not checked."""
    if open_files is not None:
        fit = max(0, (open_files - FILES_RESERVE) // FILES_PER_DEVICE)
        if devices > fit:
            raise ValueError(
                f"VirtualCluster: {devices} devices need about "
                f"{FILES_PER_DEVICE * devices + FILES_RESERVE} open files in this process "
                f"({FILES_PER_DEVICE} per device + {FILES_RESERVE}), but its limit "
                f"(ulimit -n) is {open_files}: at most {fit} devices fit; raise the limit "
                f"(ulimit -n {FILES_PER_DEVICE * devices + FILES_RESERVE}) for more")
    if available_bytes is not None:
        fit = available_bytes // BYTES_PER_DEVICE
        if devices > fit:
            raise ValueError(
                f"VirtualCluster: {devices} devices need about "
                f"{devices * BYTES_PER_DEVICE / 2**30:.1f} GiB of memory "
                f"({BYTES_PER_DEVICE >> 20} MiB per device process before its arrays), but "
                f"{available_bytes / 2**30:.1f} GiB is available: at most {fit} devices fit")
