"""The CPU of one message side inside a message algorithm (ring, tree, pairwise).

A message algorithm's member sends and receives ``2 (n - 1)`` messages per ring call,
one after another, with the other members doing the same at once. What one side of such
a message costs is not what a ping-pong pair's does, whose sender waits out each copy
alone: measured on 8 devices and 2 cores, a ring all_gather's side grows 1.3–2x less per
byte (1 MiB sides 105–150 us; the ping-pong pricing, an 8-byte side plus the bytes at the
4 KiB–4 MiB slope, gave 130–170 over four calibrations). And the curve moves with the
machine: within twenty minutes, 16 and 64 KiB sides measured 52–60 us, then 29–42 us,
while 4 KiB ones stayed at ~30.

So the calibration measures the curve in the algorithm itself
(:func:`measure_message_sides`): every device of the calibration cluster in one ring
all_gather of ``s`` bytes per member, back to back, at each size of
:data:`SIDE_BYTES`; the figure is the process time per call over the ``2 (N - 1)``
message sides, the median over members and trials. :class:`MessageSides` prices a side
of ``b`` bytes from those rows:

* an eager message (``b <= INLINE_BYTES``, carried in the mailbox slot): the eager row;
* a rendezvous message (the sender waits for the receiver's copy): linear in its bytes
  between the rendezvous rows (a side is a fixed cost plus its bytes at a copy rate that
  falls once the messages outgrow the caches: each segment has its own rate), the
  smallest's value below it, and beyond the largest its value plus the bytes more at the
  per-byte slope between the two largest.

The curve is flat to ~128 KiB and bends up past it. Measured on 8 devices and 2 cores
(2026-11-25, medians of four runs, :func:`ring_side_cpu_s`): 4 KiB 19.2 us, 16 KiB 19.6,
64 KiB 21.5, 128 KiB 21.6, 256 KiB 26.9, 512 KiB 34.1, 1 MiB 69.0; in a second run 64 KiB
20.9, 256 KiB 27.1, 512 KiB 33.2, 1 MiB 57.6, 2 MiB 98, 4 MiB 168. Between 64 KiB and
1 MiB alone a log-log chord priced a 256 KiB side at 38.5 us (+43%: the 256 KiB ring
all_gather of the bundled sweep was over-predicted 1.20-1.42 in three 8-round runs),
a straight line in bytes at 31.0: the curve is convex, and a chord over it lies above
it. So the calibration measures 256 KiB as well, and interpolates in bytes.

The figure is pool work (single-core seconds with every device busy), like the rest of
the spec's busy figures. Reducing algorithms also copy their input into a working buffer
first (:func:`working_copy_bytes`), which the model prices as a local copy. Measured back
to back over groups of 4 (8 devices), model over measured: ring all_gather 1 MiB
0.95–1.04, ring all_reduce 256 KiB 0.97–1.11, ring reduce_scatter 4 MiB 1.01 (0.52
without the working copy), tree all_reduce 1 MiB 1.30 (0.73 without), ring all_reduce
4 MiB 1.2–1.8 (the model 1.8–1.9 ms; measured 1.0–1.6 ms of CPU per member over three
runs, 2.0 ms per call inside its scenario).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from vcluster.runtime.layout import INLINE_BYTES

__all__ = ["SIDE_BYTES", "MessageSides", "measure_message_sides", "ring_side_cpu_s",
           "working_copy_bytes"]

#: message sizes of the calibration: one eager, four rendezvous (4 KiB to 1 MiB; not
#: 512 KiB: beyond 1 MiB a side grows at the slope of the two largest rows, and from
#: 512 KiB to 1 MiB it is steeper, 47-67 ps/B, than it goes on, 35 ps/B from 1 to 4 MiB;
#: from 256 KiB to 1 MiB, 39-54 ps/B)
SIDE_BYTES = (256, 4 << 10, 64 << 10, 256 << 10, 1 << 20)
_RING_BYTES = 4 << 20           # bytes each member receives per timed run, in ...
_RING_CALLS = (6, 40)           # ... at least and at most this many calls
_TRIALS = 3                     # timed runs per size (median)


@dataclass(frozen=True)
class MessageSides:
    """Rows ``(message bytes, CPU seconds of one side)`` at increasing sizes: one eager
    size (``<= INLINE_BYTES``) and at least two rendezvous sizes."""

    rows: tuple

    def __post_init__(self) -> None:
        try:
            rows = tuple(sorted((int(b), float(s)) for b, s in self.rows))
        except (TypeError, ValueError):
            raise ValueError(f"MessageSides (message_side_cpu_s): rows must be (bytes, "
                             f"seconds) pairs, got {self.rows!r}") from None
        eager = [r for r in rows if r[0] <= INLINE_BYTES]
        if len(eager) != 1 or len(rows) - 1 < 2 or len({b for b, _ in rows}) != len(rows) \
                or any(b < 1 or not 0 < s < math.inf for b, s in rows):
            raise ValueError(f"MessageSides (message_side_cpu_s): rows need distinct sizes "
                             f">= 1 byte, positive finite seconds, one size <= "
                             f"{INLINE_BYTES} bytes (eager) and at least two above it, got "
                             f"{self.rows!r}")
        object.__setattr__(self, "rows", rows)

    def seconds(self, nbytes: float) -> float:
        """CPU seconds of one side of a message of ``nbytes`` bytes."""
        if nbytes <= INLINE_BYTES:
            return self.rows[0][1]
        sizes, values = zip(*self.rows[1:])
        if nbytes <= sizes[0]:
            return values[0]
        if nbytes >= sizes[-1]:
            slope = max(0.0, (values[-1] - values[-2]) / (sizes[-1] - sizes[-2]))
            return values[-1] + (nbytes - sizes[-1]) * slope
        return float(np.interp(nbytes, sizes, values))

    def work(self, messages: int, nbytes: int) -> float:
        """``messages`` sides carrying ``nbytes`` in all (each of the mean size)."""
        return messages * self.seconds(nbytes / messages) if messages else 0.0


def working_copy_bytes(name: str, algorithm: str, n: int, nbytes: int) -> int:
    """Bytes a member of a reducing message algorithm copies locally besides its messages
    (:mod:`vcluster.runtime.collectives.messages`): ring and tree all_reduce, tree reduce
    and ring reduce_scatter first copy the input (``nbytes``) into a working buffer in the
    arena, which they combine into; ring reduce_scatter then copies its chunk
    (``nbytes // n``) out into the result. A copying algorithm's own piece (ring
    all_gather's) is in the measured sides already; the others copy nothing more."""
    if n < 2 or (name, algorithm) not in _WORKING_COPY:
        return 0
    return nbytes + (nbytes // n if name == "reduce_scatter" else 0)


_WORKING_COPY = {("all_reduce", "ring"), ("all_reduce", "tree"), ("reduce", "tree"),
                 ("reduce_scatter", "ring")}


def ring_side_cpu_s(dev, nbytes: int, calls: int) -> float:
    """All devices: ``_TRIALS`` runs of ``calls`` back-to-back ring all_gathers of
    ``nbytes`` per member (private input, as programs pass) after a barrier and one more
    call; the median CPU per message side (``2 (n - 1)`` per call)."""
    n = dev.mesh.size
    x = np.zeros(max(nbytes // 4, 1), np.float32)
    per_call = []
    for _ in range(_TRIALS):
        dev.barrier()
        dev.all_gather(x, algorithm="ring")
        c0 = time.process_time()
        for _ in range(calls):
            dev.all_gather(x, algorithm="ring")
        per_call.append((time.process_time() - c0) / calls)
    return float(np.median(per_call)) / (2 * (n - 1))


def measure_message_sides(cluster) -> tuple:
    """Rows ``(message bytes, seconds)`` of :class:`MessageSides` on ``cluster`` (every
    device busy), at each of :data:`SIDE_BYTES`."""
    n = cluster.mesh.size
    rows = []
    for nbytes in SIDE_BYTES:
        lo, hi = _RING_CALLS
        calls = min(hi, max(lo, _RING_BYTES // (nbytes * (n - 1))))
        got = cluster.run(ring_side_cpu_s, [(nbytes, calls)] * n)
        rows.append((nbytes, float(np.median(got))))
    return tuple(rows)
