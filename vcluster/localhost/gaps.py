"""How a call's CPU on ``localhost`` grows with the work its caller did before it.

The call table (:mod:`vcluster.localhost.calls`) measures each call after a short
stretch of program-like work (~40-70 us). Programs do more between their calls: a
product, a layer, a pipeline action. The longer that stretch, the more the call costs
its members, on this 2-core machine about a third of the stretch on 8 devices:

==============  ========================  ========================
work before     4 KiB all_reduce over 8   over 2 (8 devices busy)
==============  ========================  ========================
~70 us          244 us                    137 us
~370 us         357 us                    156 us
~1 ms           537 us                    179 us
==============  ========================  ========================

(2026-11-24.) With more devices than cores the devices run in turns, so members that
worked longer arrive further apart, and the other devices' work in between evicts a
member's caches before its call runs (the interpreter's, the channel's).

:func:`measure_gap_cpu` measures it: every group of ``n`` members calling a 4 KiB
all_reduce at once, each call after the reference stretch plus ``p`` more passes of
pure-Python glue, for ``p`` in :data:`GAP_PASSES`, per cluster size and group size as
the call table (the rows' runs in turns, as the call table's); each row is ``(devices,
group, gap_s, seconds)``: the stretch's own CPU and the call's (medians over runs and
members). :class:`CallGap` turns the rows into a factor ``g(w) = seconds(w) /
seconds(shortest gap)`` for a stretch of ``w`` single-core seconds (linear between the
measured gaps, 1 below the first, the last beyond it; linear in the cluster size and in
the group size between the measured ones, the nearest outside). The ``localhost`` model
multiplies the program figure of a call's synchronisation by ``g`` of the work its caller
did since its previous communication (:func:`~.start.prepare_traces`).

The same runs time the stretch itself, and it too costs more than its warm price (the
numpy calls and Python passes at the rates measured in loops, ``numpy_call_s`` and
``python_unit_s``): after a blocking call a device resumes with the others' work in its
caches. On 2 cores the reference stretch (~44 us warm) measured 62-101 us, the longest
(~0.8 ms warm) ~55 us more (2026-11-24, six calibrations). :class:`ColdStretch` takes
``e(w)``, the measured CPU less the warm price, per cluster size (the median over
groups) at each stretch's warm price ``w``: proportional below the shortest, linear
between, the last beyond; the model charges ``e`` of the work a rank does between two
blocking calls (a collective or a receive; from its start to the first, from the last to
its end) as one more op (``cold stretch``), except a stretch from a receive to a receive
or to the end: between messages a rank runs warm. Timed inside the programs
(``benchmarks/stretch_cpu.py``: thread CPU at the blocking calls' edges, 2026-11-25),
the stretches after a receive cost their warm price in the 4-device pipelines
(``mlp_schedules/0`` 0.96-0.97 of it, ``/2`` 0.98-1.03, where the model used to charge
them 10-15% more), while in the programs whose receives lead into tensor-parallel
collectives they cost more (``faults/0`` ~1.0 ms over their warm price, 1.27 charged;
``mlp_dp_pp_tp/0`` 2.9-3.4 ms, 1.11 charged); stretches after the start and after
collectives cost more than their warm price everywhere (benchmarks/README.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .calls import (CALL_BYTES, GAP_REFERENCE_CALLS, cluster_sizes, linear_clamped,
                              measured_groups, program_gap, round_robin)
from .host_work import REFERENCE_CALLS, reference_arrays, reference_python

__all__ = ["GAP_PASSES", "measure_gap_cpu", "CallGap", "ColdStretch"]

GAP_PASSES = (0, 12, 40)        # more passes of reference_python before each call
GAP_RUNS, GAP_CALLS = 6, 6      # short runs per row, timed calls in each


def _gap_cpu(dev, active: int, axes: tuple, passes: int) -> list | None:
    """On ranks below ``active``: (CPU of the stretch, CPU of the call) of GAP_CALLS
    4 KiB all_reduces over ``axes``, each after the reference stretch and ``passes``."""
    if dev.rank >= active:
        return None
    arrays = reference_arrays()
    x = np.ones(CALL_BYTES // 8)
    out = []
    for _ in range(GAP_CALLS):
        w0 = time.process_time()
        program_gap(arrays)
        for _ in range(passes):
            reference_python()
        c0 = time.process_time()
        dev.all_reduce(x, axes)
        out.append((c0 - w0, time.process_time() - c0))
    return out


def measure_gap_cpu(cluster, shape: tuple, axes: tuple, cores: int) -> tuple:
    """``((devices, group, gap_s, seconds), ...)`` on ``cluster`` (mesh ``shape`` over
    ``axes``, prime factors of N), for the cluster and group sizes of the call table; the
    rows' runs taken in turns (:func:`~.calls.round_robin`)."""
    n_all = cluster.mesh.size
    keys, tasks = [], []
    for active in cluster_sizes(n_all, cores):
        for group, group_axes in measured_groups(shape, axes, active):
            for passes in GAP_PASSES:
                keys.append((active, group))
                tasks.append((_gap_cpu, [(active, group_axes, passes)] * n_all))
    return tuple((active, group, float(np.median([w for w, _ in pairs])),
                  float(np.median([c for _, c in pairs])))
                 for (active, group), pairs in zip(keys, round_robin(cluster, tasks, GAP_RUNS)))


@dataclass(frozen=True)
class CallGap:
    """Lookup of the rows :func:`measure_gap_cpu` measured (see the module docstring)."""

    rows: tuple

    def __post_init__(self) -> None:
        try:
            rows = tuple((int(d), int(g), float(w), float(s)) for d, g, w, s in self.rows)
        except (TypeError, ValueError):
            raise ValueError(f"call_gap_cpu_s: rows must be (devices, group, gap_s, "
                             f"seconds), got {self.rows!r}") from None
        for d, g, w, s in rows:
            if d < 2 or not 2 <= g <= d or not 0 <= w < math.inf or not 0 < s < math.inf:
                raise ValueError(f"call_gap_cpu_s: bad row ({d}, {g}, {w}, {s}); needs "
                                 f"2 <= group <= devices, gap_s >= 0, seconds > 0")
        table: dict = {}
        for d, g, w, s in rows:
            table.setdefault(d, {}).setdefault(g, []).append((w, s))
        if not table:
            raise ValueError("call_gap_cpu_s: no rows")
        for d, by_group in table.items():
            for g, points in by_group.items():
                gaps = [w for w, _ in sorted(points)]
                if len(set(gaps)) != len(gaps):
                    raise ValueError(f"call_gap_cpu_s: devices {d}, group {g} lists a gap "
                                     f"twice: {sorted(points)}")
                by_group[g] = tuple(sorted(points))
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "_table", table)

    def factor(self, devices: int, group: int, work_s: float) -> float:
        """``g``: the call's CPU after ``work_s`` of its caller's work over its CPU after
        the shortest measured stretch, on ``devices`` devices in a group of ``group``."""
        sizes = sorted(self._table)
        return linear_clamped(sizes, [self._in_group(self._table[d], group, work_s)
                                      for d in sizes], devices)

    @staticmethod
    def _in_group(by_group: dict, group: int, work_s: float) -> float:
        groups = sorted(by_group)
        values = []
        for g in groups:
            points = by_group[g]
            gaps, secs = [w for w, _ in points], [s for _, s in points]
            values.append(linear_clamped(gaps, secs, work_s) / secs[0])
        return linear_clamped(groups, values, group)


@dataclass(frozen=True)
class ColdStretch:
    """What a stretch of work costs more after a blocking call (module docstring):
    ``warm_s`` the warm price of each measured stretch (one per :data:`GAP_PASSES`),
    ``sizes`` the cluster sizes, ``extra_s`` per size the measured CPU less that price at
    each stretch (at least 0)."""

    warm_s: tuple
    sizes: tuple
    extra_s: tuple

    @classmethod
    def of_spec(cls, spec) -> "ColdStretch | None":
        """From a spec's gap rows and host rates; None when it lacks either, or a group's
        rows are not one per :data:`GAP_PASSES`."""
        if spec.call_gap_cpu_s is None or spec.numpy_call_s is None \
                or spec.python_unit_s is None:
            return None
        reference = GAP_REFERENCE_CALLS * REFERENCE_CALLS * spec.numpy_call_s \
            + spec.python_unit_s
        warm = tuple(reference + p * spec.python_unit_s for p in GAP_PASSES)
        table = CallGap(spec.call_gap_cpu_s)._table
        sizes, extras = [], []
        for d in sorted(table):
            per_group = [[max(0.0, w - price) for (w, _), price in zip(points, warm)]
                         for points in table[d].values() if len(points) == len(warm)]
            if not per_group:
                return None
            sizes.append(d)
            extras.append(tuple(float(v) for v in np.median(per_group, axis=0)))
        return cls(warm, tuple(sizes), tuple(extras))

    def extra(self, devices: int, work_s: float) -> float:
        """``e(work_s)`` on a cluster of ``devices`` (linear between the measured sizes,
        the nearest outside)."""
        if work_s <= 0.0:
            return 0.0
        e = linear_clamped(list(self.sizes), list(self.extra_s), devices)
        if work_s <= self.warm_s[0]:
            return e[0] * work_s / self.warm_s[0]
        return linear_clamped(list(self.warm_s), list(e), work_s)
