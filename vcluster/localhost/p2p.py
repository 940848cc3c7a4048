"""Ping-pongs between pairs of devices: the calibration's point-to-point programs.

:func:`exchange` is one pair's loop (the lower rank sends first, each round trip one
message each way); :func:`pair_cpu_s` runs it on every device at once (pairs ``rank ^
1``) and returns the CPU per message side; :func:`busy_copy_bytes_per_s` turns two sizes
of it into the copy rate of large messages with every device busy
(``p2p_busy_copy_bytes_per_s``: the slope of the CPU per side between CALL_BYTES and
:data:`LARGE_BYTES`). The alone round trips of two devices are timed by
:func:`~vcluster.localhost.calibrate.calibrate_localhost` with the same loop.
"""

from __future__ import annotations

import time

import numpy as np

from .calls import CALL_BYTES

__all__ = ["LARGE_BYTES", "BUSY_REPS", "exchange", "pair_cpu_s", "busy_copy_bytes_per_s"]

LARGE_BYTES = 4 << 20           # the large message of the copy rates
BUSY_REPS = 12                  # round trips per pair timed for the busy copy rate
_FLOOR = 0.1                    # a derived work is at least this fraction of its total


def exchange(dev, peer: int, x, reps: int) -> None:
    """``reps`` round trips of ``x`` with ``peer`` (the lower rank sends first)."""
    for k in range(reps):
        if dev.rank < peer:
            dev.send(x, peer, k)
            dev.recv(peer, k)
        else:
            dev.recv(peer, k)
            dev.send(x, peer, k)


def pair_cpu_s(dev, reps: int, nbytes: int = 8) -> float | None:
    """Every device in a pair (rank ^ 1) at once, ping-pongs of ``nbytes``: CPU seconds
    per message and side (each device sends one and receives one per round trip), after
    a warm-up of the same length."""
    peer = dev.rank ^ 1
    if peer >= dev.mesh.size:
        return None
    x = np.ones(max(nbytes // 8, 1))
    exchange(dev, peer, x, reps)
    dev.barrier()
    c0 = time.process_time()
    exchange(dev, peer, x, reps)
    return (time.process_time() - c0) / (2 * reps)


def busy_copy_bytes_per_s(cluster, devices: int) -> float:
    """Bytes one side of a large message copies per CPU second, every device in a
    ping-pong pair at once: the slope of the CPU per message side between CALL_BYTES
    and LARGE_BYTES messages."""
    def side_s(nbytes):
        got = cluster.run(pair_cpu_s, [(BUSY_REPS, nbytes)] * devices)
        return float(np.median([c for c in got if c is not None]))
    small, large = side_s(CALL_BYTES), side_s(LARGE_BYTES)
    return (LARGE_BYTES - CALL_BYTES) / max(large - small, _FLOOR * large)
