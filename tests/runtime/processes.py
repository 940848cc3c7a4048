"""Shared by the runtime tests: is a device process still alive, and waiting until none is."""

import time


def alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):   # gone, or going while we read
        return False


def wait_dead(pids, timeout_s: float = 10.0) -> list[int]:
    """The pids still alive after up to ``timeout_s`` (empty once all are gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
