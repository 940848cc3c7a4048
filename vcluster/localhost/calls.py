"""The CPU one communication call costs inside a program on ``localhost``.

A collective or a send/receive costs its caller host CPU besides the bytes it moves:
Python on both sides, futex waits and wake-ups, cold caches. Measured back to back
(one call after another, members in step), that is its cheapest; inside a program each
call follows the program's own work, its members arrive apart and sleep before the last
one comes, and it costs up to twice as much. It also depends on how many devices share
the cores: with more devices than cores a waiting member yields its core to a runnable
one; with fewer, it spins through its yields alone.

So :func:`measure_call_cpu` measures calls as programs make them — a few per run, in
many short runs (the first calls of a run are the coldest) — on the first ``D``
devices of the calibration cluster (``D`` = 2, the number of cores, twice that, and all
``N``: :func:`cluster_sizes`), every group of ``n`` members calling at once, each call
after a stretch of program-like work (:data:`GAP_REFERENCE_CALLS` small numpy calls and
one pure-Python pass of :mod:`vcluster.localhost.host_work`), inputs in private memory
(products and activations are, so the emulator stages them into its arena); the figure is
the process time of the call alone, per member, the median over members. The figures'
runs are taken in turns (:func:`round_robin`), so that all of them sample the same
stretch of the machine's drift. Rows:

==================  ==============================================================
call                what
==================  ==============================================================
barrier             ``dev.barrier``
all_reduce_inline   an 8-byte all_reduce (inline: one phase, no arena)
all_reduce          a :data:`CALL_BYTES` all_reduce (two phases, staged input)
all_gather          a :data:`CALL_BYTES` all_gather (input of that size)
reduce_scatter      a :data:`CALL_BYTES` reduce_scatter
send_inline         ``dev.send`` of 8 bytes (eager, in the mailbox slot)
recv_inline         the matching ``dev.recv`` (waits for it: ping-pong pairs)
send                ``dev.send`` of :data:`CALL_BYTES` (staged copy)
recv                the matching ``dev.recv`` (copies it out)
==================  ==============================================================

(group 2 for the point-to-point rows.) :class:`CallCpu` looks a figure up for a
cluster of any size (linear in ``D`` between the measured sizes, the nearest outside) and
a group of any size (log-log between the measured ones).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import reduce as _fold

import numpy as np

from .host_work import reference_arrays, reference_calls, reference_python

__all__ = ["CALLS", "CALL_BYTES", "GAP_REFERENCE_CALLS", "CallCpu", "cluster_sizes",
           "measure_call_cpu", "round_robin", "measured_groups", "log_log", "linear_clamped",
           "program_gap"]

CALL_BYTES = 4096              # the non-inline calls' payload (per member input)
GAP_REFERENCE_CALLS = 2        # reference_calls(...) before each timed call, plus one
#                                reference_python(): ~40 us of a program's work
RUNS, CALLS_PER_RUN = 10, 6    # short runs per figure, timed calls in each (programs are
#                                short: their calls run colder than a long loop's)
COLLECTIVE_CALLS = ("barrier", "all_reduce_inline", "all_reduce", "all_gather",
                    "reduce_scatter")
P2P_CALLS = ("send_inline", "recv_inline", "send", "recv")
CALLS = COLLECTIVE_CALLS + P2P_CALLS


def measured_groups(shape: tuple, axes: tuple, active: int):
    """The (group size, group's axes) the call tables measure with ``active`` devices on a
    mesh of ``shape`` over ``axes`` (prime factors of N): every group of the mesh's last
    axes that divides ``active``, smallest first."""
    for j in range(len(shape) - 1, -1, -1):
        group = _fold(lambda u, v: u * v, shape[j:])
        if group <= active and active % group == 0:
            yield group, axes[j:]


def cluster_sizes(devices: int, cores: int) -> tuple[int, ...]:
    """The cluster sizes measured: 2, ``cores``, ``2 cores`` and ``devices`` (within 2..N)."""
    return tuple(sorted({d for d in (2, cores, 2 * cores, devices) if 2 <= d <= devices}))


def program_gap(arrays) -> None:
    for _ in range(GAP_REFERENCE_CALLS):
        reference_calls(*arrays)
    reference_python()


def _collective_cpu(dev, active: int, axes: tuple, call: str) -> list | None:
    """On ranks below ``active``: CPU seconds of each of CALLS_PER_RUN calls of ``call``
    over ``axes``, each after program-like work (one short run)."""
    if dev.rank >= active:
        return None
    arrays = reference_arrays()
    n = len(dev.mesh.group(axes, dev.rank))
    small = np.ones(1)
    x = np.ones(CALL_BYTES // 8)
    fn = {"barrier": lambda: dev.barrier(axes),
          "all_reduce_inline": lambda: dev.all_reduce(small, axes),
          "all_reduce": lambda: dev.all_reduce(x, axes),
          "all_gather": lambda: dev.all_gather(x, axes),
          "reduce_scatter": lambda: dev.reduce_scatter(x[:x.size - x.size % n], axes)}[call]
    out = []
    for _ in range(CALLS_PER_RUN):
        program_gap(arrays)
        c0 = time.process_time()
        fn()
        out.append(time.process_time() - c0)
    return out


def _p2p_cpu(dev, active: int, nbytes: int) -> list | None:
    """Ranks below ``active`` in pairs (rank ^ 1), ping-pong with program work before
    each send: [(CPU of the send, CPU of the receive)] of CALLS_PER_RUN rounds."""
    peer = dev.rank ^ 1
    if dev.rank >= active or peer >= active:
        return None
    arrays = reference_arrays()
    x = np.ones(max(1, nbytes // 8))
    out = []
    for tag in range(CALLS_PER_RUN):
        spent = [0.0, 0.0]
        for first in (dev.rank < peer, dev.rank > peer):
            if first:
                program_gap(arrays)
                c0 = time.process_time()
                dev.send(x, peer, tag)
                spent[0] = time.process_time() - c0
            else:
                c0 = time.process_time()
                dev.recv(peer, tag)
                spent[1] = time.process_time() - c0
        out.append(tuple(spent))
    return out


def round_robin(cluster, tasks: list, runs: int) -> list:
    """Run each of ``tasks`` (``(fn, per-rank args)`` for ``cluster.run``) ``runs`` times,
    in turns: one warm-up pass over all of them, then ``runs`` passes that run every task
    once, in order. Per task: the results of its ranks that are not None, concatenated
    over the passes (each result a list of samples).

    Turns rather than each figure's runs back to back: this machine's speed moves 1.5x
    from one second to the next, so figures measured one after the other each sample a
    different stretch of it and disagree by as much; taken in turns, every figure samples
    the same stretch (six calibrations each way: the spread of the 27 scenario points'
    predictions left when the calibration's common factor is taken out, log-sd, 0.110
    back to back, 0.083 in turns; benchmarks/README.md)."""
    for fn, args in tasks:
        cluster.run(fn, args)                                                   # warm-up
    samples: list = [[] for _ in tasks]
    for _ in range(runs):
        for got, (fn, args) in zip(samples, tasks):
            for per in cluster.run(fn, args):
                if per is not None:
                    got.extend(per)
    return samples


def measure_call_cpu(cluster, shape: tuple, axes: tuple, cores: int) -> tuple:
    """Every row of the module docstring on ``cluster`` (mesh ``shape`` over ``axes``,
    prime factors of N): ``((devices, call, group, seconds), ...)``; each figure the
    median over RUNS short runs of CALLS_PER_RUN calls and over the members, the figures'
    runs taken in turns (:func:`round_robin`)."""
    n_all = cluster.mesh.size
    keys, tasks = [], []
    for active in cluster_sizes(n_all, cores):
        for group, group_axes in measured_groups(shape, axes, active):
            for call in COLLECTIVE_CALLS:
                keys.append((active, call, group))
                tasks.append((_collective_cpu, [(active, group_axes, call)] * n_all))
        for nbytes, suffix in ((8, "_inline"), (CALL_BYTES, "")):
            keys.append((active, suffix, None))
            tasks.append((_p2p_cpu, [(active, nbytes)] * n_all))
    rows = []
    for (active, call, group), got in zip(keys, round_robin(cluster, tasks, RUNS)):
        if group is not None:
            rows.append((active, call, group, float(np.median(got))))
        else:                                       # (send, receive) pairs of one size
            rows.append((active, "send" + call, 2, float(np.median([s for s, _ in got]))))
            rows.append((active, "recv" + call, 2, float(np.median([r for _, r in got]))))
    return tuple(rows)


@dataclass(frozen=True)
class CallCpu:
    """Lookup of the rows :func:`measure_call_cpu` measured (see the module docstring)."""

    rows: tuple

    def __post_init__(self) -> None:
        rows = tuple((int(d), str(c), int(g), float(s)) for d, c, g, s in self.rows)
        for d, c, g, s in rows:
            if c not in CALLS or d < 2 or g < 2 or g > d or not 0 < s < math.inf:
                raise ValueError(f"call_cpu_s: bad row ({d}, {c!r}, {g}, {s}); calls are "
                                 f"{', '.join(CALLS)}, 2 <= group <= devices, seconds > 0")
        object.__setattr__(self, "rows", rows)
        table: dict = {}
        for d, c, g, s in rows:
            table.setdefault(c, {}).setdefault(d, {})[g] = s
        missing = [c for c in CALLS if c not in table]
        if missing:
            raise ValueError(f"call_cpu_s: no rows for {', '.join(missing)}")
        object.__setattr__(self, "_table", table)

    def seconds(self, call: str, devices: int, group: int) -> float:
        """CPU per member of ``call`` over ``group`` members on a cluster of ``devices``."""
        by_devices = self._table[call]
        sizes = sorted(by_devices)
        return linear_clamped(sizes, [self._in_group(by_devices[d], group) for d in sizes],
                              devices)

    @staticmethod
    def _in_group(by_group: dict, group: int) -> float:
        sizes = sorted(by_group)
        if len(sizes) == 1:
            return by_group[sizes[0]]
        return log_log(sizes, [by_group[g] for g in sizes], group)


def log_log(sizes, values, x: float) -> float:
    """``values`` (at increasing ``sizes``, at least two) at ``x``: linear in log-log
    between the two nearest sizes, extrapolated from the end pairs beyond them."""
    if x in sizes:
        return values[list(sizes).index(x)]
    j = 1
    while j < len(sizes) - 1 and sizes[j] < x:
        j += 1
    (x0, x1), (y0, y1) = sizes[j - 1:j + 1], values[j - 1:j + 1]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * math.exp(slope * math.log(x / x0))


def linear_clamped(sizes, values, x: float):
    """``values`` (numbers or tuples of numbers, at increasing ``sizes``) at ``x``: linear
    between the two nearest sizes, the nearest end's value outside them."""
    if x <= sizes[0]:
        return values[0]
    if x >= sizes[-1]:
        return values[-1]
    j = next(i for i, d in enumerate(sizes) if d >= x)
    a = (x - sizes[j - 1]) / (sizes[j] - sizes[j - 1])
    lo, hi = values[j - 1], values[j]
    if isinstance(lo, tuple):
        return tuple(u + (v - u) * a for u, v in zip(lo, hi))
    return lo + (hi - lo) * a
