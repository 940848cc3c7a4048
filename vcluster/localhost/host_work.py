"""A program's own host work on ``localhost``: from the tracer's figures to the emulator's.

``trace_program(..., host_time=True)`` records each stretch of a program's own Python
between device calls as a host op with ``host_s`` (the tracer thread's CPU seconds) and
``array_calls`` (array operations it made on meta arrays); see
:mod:`vcluster.runtime.tracing.host`. The emulator runs the same Python, but its array
operations are numpy calls on real (mostly small) arrays, and its processes share the
host's cores with the other devices. One segment costs the emulator

    w = max(0, host_s - L - A) f  +  k c,      f = p_dev / p_tracer

with ``k = array_calls`` and ``A`` the tracer's CPU for those calls: ``array_s + k a``,
their own CPU as timed around each in this very trace plus what timing them costs
outside that (``a``); for traces without ``array_s``, ``k m`` at a rate measured apart
(which moved 2x within a minute, and a third of a segment's CPU with it). The rates,
each measured by a microbenchmark:

* tracer side, in the process that predicts (:class:`TracerRates`,
  :func:`measure_tracer_rates`, ~0.1 s), by tracing reference programs with host timing:
  ``L`` the tracer's own CPU charged to one segment (host timing's bookkeeping, the
  context manager of ``dev.compute``: the segments of a loop of empty blocks), ``m`` one
  meta-array call of :func:`reference_calls` (the same loop with those calls inside, less
  the empty one; ``a`` the same less the CPU timed inside the calls), and ``p_tracer``
  one pass of :func:`reference_python`;
* device side, in :func:`~vcluster.localhost.calibrate.calibrate_localhost` with
  every device busy (:func:`device_host_rates`): ``c`` = ``numpy_call_s``, CPU per numpy
  call of :func:`reference_calls` on small arrays; ``p_dev`` = ``python_unit_s``, one
  pass of :func:`reference_python`; and ``block_overhead_s``, the CPU of an empty
  ``dev.compute`` block, which the model charges every compute op of a host-timed trace
  (its kernel is priced from its flops and bytes; the numpy calls inside it are its own
  host segment).

The tracer measures pure Python at its own speed, the devices run it at theirs (busy,
sharing caches): ``f`` converts. Both sides measure at the moment they run, so a spec
calibrated earlier still sees the tracer's speed of now in ``p_tracer``.

:func:`localhost_traces` (also importable from :mod:`vcluster.localhost.cost_model`) takes
a program's host-timed traces for a localhost prediction, priced this way.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

import numpy as np

from mesh import Mesh
from vcluster.runtime.tracing import MetaArray, trace_program
from vcluster.runtime.tracing.host import HOST_OP

__all__ = ["TracerRates", "measure_tracer_rates", "reference_calls", "reference_arrays",
           "reference_python",
           "REFERENCE_CALLS", "device_host_rates", "host_work_s", "median_host_work",
           "localhost_traces", "HOST_TRACES"]

REFERENCE_CALLS = 11           # array operations in one reference_calls(...)
REFERENCE_SHAPES = ((8, 16), (16, 16), (16,))
_REPS = 400                    # reference segments traced per measurement
_TRIALS = 5                    # medians over this many measurements
_PYTHON_REPS = 20
HOST_TRACES = 3                #: host-timed traces a localhost prediction takes the median of


def reference_calls(x, w, b):
    """A typical mix of small array operations (REFERENCE_CALLS of them): a product, a
    bias, an in-place ReLU, a reshape, a reduction, a transpose, a slice, an exp, a
    scaling, a split and a concatenation."""
    z = x @ w
    z = z + b
    np.maximum(z, 0.0, out=z)
    z.reshape(-1)
    z.sum(axis=0)
    z.T
    z[1:3]
    np.exp(z)
    z * 2.0
    parts = np.split(z, 2, axis=1)
    return np.concatenate(parts, axis=1)


def reference_python() -> int:
    """Pure-Python glue: a loop of dictionary updates, attribute reads and calls (~20 us)."""
    table: dict = {}
    total = 0
    for i in range(200):
        key = i % 7
        table[key] = table.get(key, 0) + i
        total += len(table)
    return total


def reference_arrays(make=np.ones) -> tuple:
    """The operands of :func:`reference_calls`: ``make(shape)`` of each REFERENCE_SHAPES."""
    return tuple(make(shape) for shape in REFERENCE_SHAPES)


@dataclass(frozen=True)
class TracerRates:
    """The tracer's speed now, in this process (CPU seconds): ``segment_s`` (L),
    ``meta_call_s`` (m), ``python_unit_s`` (p_tracer) and ``array_overhead_s`` (a); see
    the module docstring."""

    segment_s: float
    meta_call_s: float
    python_unit_s: float
    array_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("segment_s", "meta_call_s", "python_unit_s", "array_overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and v < float("inf")):
                raise ValueError(f"TracerRates.{name}: must be a finite number >= 0, got {v!r}")
        if self.python_unit_s <= 0:
            raise ValueError(f"TracerRates.python_unit_s: must be > 0, got "
                             f"{self.python_unit_s!r}")


def _empty_blocks(dev, reps):
    for _ in range(reps):
        with dev.compute("reference"):
            pass


def _call_blocks(dev, reps, x, w, b):
    for _ in range(reps):
        with dev.compute("reference"):
            reference_calls(x, w, b)


def _segments(ops) -> tuple[float, int, int, float]:
    hosts = [op for op in ops if getattr(op, "name", None) == HOST_OP]
    return (sum(op.host_s for op in hosts), sum(op.array_calls for op in hosts), len(hosts),
            sum(op.array_s for op in hosts))


def measure_tracer_rates() -> TracerRates:
    """Measure :class:`TracerRates` here and now by tracing the reference programs."""
    mesh = Mesh((1,), ("x",))
    arrays = reference_arrays(lambda s: MetaArray(s, np.float64))
    segment, per_call, python, outside = [], [], [], []
    trace_program(mesh, _call_blocks, [(50,) + arrays], host_time=True)      # warm-up
    for _ in range(_TRIALS):
        (empty,) = trace_program(mesh, _empty_blocks, [(_REPS,)], host_time=True)
        (full,) = trace_program(mesh, _call_blocks, [(_REPS,) + arrays], host_time=True)
        e_s, _, e_n, _ = _segments(empty.ops)
        f_s, f_calls, f_n, f_inside = _segments(full.ops)
        leak = e_s / max(e_n, 1)
        segment.append(leak)
        per_call.append(max(0.0, f_s - leak * f_n) / max(f_calls, 1))
        outside.append(max(0.0, f_s - leak * f_n - f_inside) / max(f_calls, 1))
        t0 = time.thread_time()
        for _ in range(_PYTHON_REPS):
            reference_python()
        python.append((time.thread_time() - t0) / _PYTHON_REPS)
    return TracerRates(float(np.median(segment)), float(np.median(per_call)),
                       float(np.median(python)), float(np.median(outside)))


def device_host_rates(dev, reps: int = 400) -> tuple[float, float, float]:
    """On a device, all devices at once: CPU seconds of an empty ``dev.compute`` block,
    of one numpy call of :func:`reference_calls` on small float64 arrays, and of one
    :func:`reference_python`; each after a warm-up of the same loop."""
    arrays = reference_arrays()

    def empty():
        _empty_blocks(dev, reps)

    def calls():
        for _ in range(reps):
            reference_calls(*arrays)

    def python():
        for _ in range(reps // 10):
            reference_python()
    out = []
    for fn, per in ((empty, reps), (calls, reps * REFERENCE_CALLS), (python, reps // 10)):
        fn()
        dev.barrier()
        c0 = time.process_time()
        fn()
        out.append((time.process_time() - c0) / per)
    return tuple(out)


def host_work_s(op, spec, tracer: TracerRates) -> float:
    """Single-core seconds the emulator spends on host op ``op`` (module docstring)."""
    if spec.numpy_call_s is None or spec.python_unit_s is None:
        raise ValueError("localhost: this spec has no host-work rates (numpy_call_s, "
                         "python_unit_s); calibrate again to price host-timed traces")
    if op.array_s > 0.0:                 # the array calls' own CPU, timed in this trace
        arrays_s = op.array_s + op.array_calls * tracer.array_overhead_s
    else:                                # a trace that did not time them: the rate
        arrays_s = op.array_calls * tracer.meta_call_s
    python_s = max(0.0, op.host_s - tracer.segment_s - arrays_s)
    return python_s * spec.python_unit_s / tracer.python_unit_s \
        + op.array_calls * spec.numpy_call_s


def median_host_work(runs: list, prices: list | None = None) -> list:
    """One trace per rank from ``runs`` (lists of ``DeviceTrace``, one list per host-timed
    trace of the same program): the first run's ops with each host op's figures the
    median over the runs — with ``prices`` (one callable per run, host op -> single-core
    seconds, e.g. :func:`host_work_s` with the tracer rates measured just before that
    run) the median of the prices, set as the op's ``seconds``; without, the medians of
    ``host_s`` and ``array_s``.

    A host segment's thread CPU is one sample of a noisy machine: a trace the scheduler
    or a neighbour interrupts reads up to 2.5x its usual total (seen on this 2-core VM),
    and the machine runs Python 1.5x faster or slower from one second to the next, so a
    trace priced with tracer rates measured at another moment carried up to 2x into the
    prediction; pricing each trace with rates measured next to it and taking the median
    of three removes most of that. Runs whose ops differ from the first's in kind or name
    (a program that does not trace the same way twice) cannot be merged op by op: then
    the run whose total is the median is kept whole (priced, with ``prices``).
    """
    if not runs:
        raise ValueError("median_host_work: needs at least one run of traces")
    if prices is not None and len(prices) != len(runs):
        raise ValueError(f"median_host_work: {len(prices)} prices for {len(runs)} runs")

    def is_host(op) -> bool:
        return getattr(op, "name", None) == HOST_OP

    def priced(run, price):
        return [replace(t, ops=tuple(replace(op, seconds=price(op)) if is_host(op) else op
                                     for op in t.ops)) for t in run]

    def shape(traces):
        return [(t.rank, [(type(op), getattr(op, "name", None)) for op in t.ops])
                for t in traces]

    first = runs[0]
    if len(runs) == 1:
        return list(first) if prices is None else priced(first, prices[0])
    if any(shape(run) != shape(first) for run in runs[1:]):
        if prices is not None:
            runs = [priced(run, price) for run, price in zip(runs, prices)]

        def total(run):
            return sum(op.host_s if prices is None else op.seconds
                       for t in run for op in t.ops if is_host(op))
        return list(sorted(runs, key=total)[len(runs) // 2])
    merged = []
    for r, trace in enumerate(first):
        ops = list(trace.ops)
        for i, op in enumerate(ops):
            if is_host(op):
                same = [run[r].ops[i] for run in runs]
                host_s = float(np.median([o.host_s for o in same]))
                array_s = float(np.median([o.array_s for o in same]))
                seconds = None if prices is None else \
                    float(np.median([price(o) for o, price in zip(same, prices)]))
                ops[i] = replace(op, host_s=host_s, array_s=array_s, seconds=seconds)
        merged.append(replace(trace, ops=tuple(ops)))
    return merged


def localhost_traces(model, mesh, program, meta_args, ranks=None,
                     host_traces: int = HOST_TRACES, tracer_rates=None) -> list:
    """The traces a localhost prediction replays: ``program`` traced warm (a first trace
    fills this process's memoised plans, ``MatMulSharding.plan``, as a device's warm-up
    run fills its own), with its host work when ``model.host_timed`` — ``host_traces``
    host-timed traces, each priced with the tracer's rates measured just before it (or
    the sets of ``tracer_rates``, one per trace, measured once for many programs: a
    ranking of layouts), each host op's work the median
    (:func:`median_host_work`) — then
    :meth:`~vcluster.localhost.cost_model.LocalhostCostModel.prepare_traces` (``model``)."""
    if not model.host_timed:
        return model.prepare_traces(trace_program(mesh, program, meta_args, ranks=ranks))
    if tracer_rates is not None:
        host_traces = len(tracer_rates := tuple(tracer_rates))
        if not all(isinstance(r, TracerRates) for r in tracer_rates):
            raise ValueError(f"localhost_traces: tracer_rates must hold TracerRates, got "
                             f"{tracer_rates!r}")
    if isinstance(host_traces, bool) or not isinstance(host_traces, int) or host_traces < 1:
        raise ValueError(f"localhost_traces: host_traces (or len(tracer_rates)) must be an "
                         f"int >= 1, got {host_traces!r}")
    trace_program(mesh, program, meta_args, ranks=ranks)
    runs, prices = [], []
    for i in range(host_traces):
        rates = measure_tracer_rates() if tracer_rates is None else tracer_rates[i]
        runs.append(trace_program(mesh, program, meta_args, ranks=ranks, host_time=True))
        prices.append(functools.partial(host_work_s, spec=model.spec, tracer=rates))
    return model.prepare_traces(median_host_work(runs, prices))
