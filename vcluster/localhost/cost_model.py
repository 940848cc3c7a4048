"""The ``localhost`` hardware: this machine, so the simulator predicts the emulator itself.

:class:`LocalhostSpec` holds microbenchmarks of the machine the emulator runs on
(:func:`~vcluster.localhost.calibrate.calibrate_localhost` measures them);
:class:`LocalhostCostModel` prices a trace of emulated programs from them. The devices
are processes sharing ``cores`` cores, so every duration below is **work in single-core
seconds**, which the replay serves from the cores
(:class:`~vcluster.timing.core_pool.CorePool`: processor sharing, aggregate
throughput ``T(k)`` with ``k`` busy devices, measured with float32 GEMMs; with counted
start splits, per-core queues: :mod:`.core_queues`)::

    simulate_trace(traces, model, core_pool=model.core_pool)

Kinds of work that scale worse than GEMMs when all ``N`` calibration devices run at once
(numpy elementwise passes, copies: memory bandwidth, caches) are charged
``f = T(N) / s`` times their time alone, ``s`` being their own measured speedup, so that
with every device busy they take what they were measured to take. Work of one op:

* compute: ``overhead + flops / F_gemm + bytes f_copy / B_copy`` when the op does at
  least :data:`BLAS_MIN_FLOPS_PER_ELEMENT` flops per element it touches (``bytes /
  itemsize`` of the workload's dtype: a BLAS product, its flops at the GEMM's peak plus
  streaming its operands once, memory traffic that scales like a copy when every device
  is busy; skinny products are slower per flop than square ones), else ``overhead +
  max(flops f_vec / F_vec, bytes f_copy / B_iadd)`` (an elementwise numpy expression:
  each declared flop one ufunc pass over one element; devices reuse freed pages);
  ``overhead`` is the host work of one op of a program (``compute_overhead_s``: a
  ``dev.compute`` block around three numpy calls on tiny arrays, CPU time per op with
  every device busy);
* collective over ``n`` members with the emulator's default algorithm, shm: the host
  CPU a member spends per call, ``c(n)``, measured as process time with every group of
  ``n`` calling at once (``barrier_cpu_s``, ...: robust to how late sleeping processes
  are woken, which moves wall times 2-3x from one minute to the next on a virtual
  machine; specs without them fall back to a share of the wall time of one group alone,
  ``c(n) = L(n) T(n) / n``), plus the work of the bytes the member moves as
  :func:`~vcluster.runtime.traffic.collective_traffic` counts them, its own piece
  included, at ``B_chan`` rates measured with all devices busy
  (:mod:`.bytes`)::

      barrier             c_barrier(n)
      inline (<= 512 B)   c_inline(n)              (8-byte all_reduce: one phase)
      larger              f c_large(n) + its bytes' work

  ``c_large`` from a 4 KiB all_reduce (two phases); ``B_*`` from all_gather,
  reduce_scatter and all_reduce on all N devices (the slope of their time in the bytes
  moved), and for those three ``f`` = their time at 0 bytes over the 4 KiB all_reduce's
  (both on N devices; ``f = 1`` for the others). Message algorithms (ring, tree,
  pairwise) are priced as their messages (below);
* point to point: sender and receiver each ``p2p_message_cpu_s`` (CPU per side of an
  8-byte message, every device in a ping-pong pair; older specs: ``p2p_latency / 2``)
  plus, above 512 B, one copy of the payload (the sender stages it, the receiver copies
  it out).

Assumptions: large collective inputs are resident (in the device's arena, as products and
collective results are), and send payloads are not.

Specs calibrated since host work and per-call figures were measured price more
(docs/timing.md): the programs' own host work (:mod:`.host_work`; a compute op then
costs an empty block plus its kernel), calls at their CPU inside programs
(:mod:`.calls`), the start of a run and the cold extras of calls and work
(:mod:`.start`, :mod:`.gaps`); :func:`localhost_traces`
(:mod:`.host_work`) has it all.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from vcluster.runtime.layout import INLINE_BYTES
from vcluster.runtime.tracing.host import HOST_OP
from vcluster.runtime.tracing.ops import TraceCollective, TraceRecv
from vcluster.runtime.traffic import collective_traffic
from vcluster.timing.core_pool import CorePoolSpec
from vcluster.timing.core_queues import start_placements

from .bytes import bytes_work, message_work, p2p_copy_s_per_byte
from .calls import CALL_BYTES, CallCpu, log_log
from .gaps import CallGap
from .host_work import (HOST_TRACES, TracerRates, host_work_s, localhost_traces,
                        measure_tracer_rates)
from .messages import working_copy_bytes
from .spec import (_CALIBRATED, _HOST_RATES, LocalhostSpec, _dtype, load_localhost_spec,
                   save_localhost_spec)
from .start import MOBILE_OPS

__all__ = ["LocalhostSpec", "LocalhostCostModel", "BLAS_MIN_FLOPS_PER_ELEMENT",
           "load_localhost_spec", "save_localhost_spec", "localhost_model", "localhost_traces"]

#: Declared flops per element touched (declared bytes / itemsize) from which a compute op
#: is a BLAS product priced at the GEMM rate. numpy elementwise expressions declare at
#: most ~20 flops per element over >= 2 operands (<= 10 per element touched: gelu' about
#: 6); a product (m, k) @ (k, n) has 2mkn / (mk + kn + mn), which passes 12 once every
#: dimension is >= 18 — whatever the dtype (a per-byte bound priced float64 products,
#: and float32 ones with a micro-batch of 8 rows, as elementwise work, 40x too slow).
BLAS_MIN_FLOPS_PER_ELEMENT = 12.0

_FLOOR = 0.1                 # a call's fixed CPU is at least this share of its measured CPU
_UNSEEN = object()


def _interpolate(sizes: tuple, values: tuple, n: int) -> float:
    """``values`` at group size ``n``: log-log linear between (and beyond) the table; a
    table of one size scales in proportion."""
    return values[0] * (n / sizes[0]) if len(sizes) == 1 else log_log(sizes, values, n)


@dataclass(frozen=True)
class LocalhostCostModel:
    """The replay's cost model for a cluster of ``n_devices`` emulated devices here.

    Durations are single-core seconds (see the module docstring); replay every device's
    trace with ``core_pool=model.core_pool``. ``dtype`` picks the GEMM and elementwise
    rates; a collective's group must fit in the ``n_devices``.

    ``tracer``: for traces recorded with ``trace_program(..., host_time=True)``, the
    :class:`~vcluster.localhost.host_work.TracerRates` of the process that traced them
    (:func:`localhost_model` measures them). Their host ops are then priced as the
    programs' own host work, and a compute op costs ``block_overhead_s`` plus its kernel
    (its numpy calls are in the host op before it) instead of ``compute_overhead_s``
    plus its kernel. Without ``tracer`` a host op is an error. ``core_queues``: replay
    on per-core queues (:mod:`.core_queues`) where the spec counted start splits.
    """

    spec: LocalhostSpec
    n_devices: int
    dtype: str = "float64"
    # an emulated device runs all its asynchronous collectives on one FIFO communication
    # thread (vcluster/runtime/work.py), not a stream per group as NCCL does: the replay
    # queues them so (Replay, "a communication stream per group")
    comm_stream_per_group = False
    tracer: object = None
    core_queues: bool = False
    shared_tracer_rates: tuple = ()
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, LocalhostSpec):
            raise TypeError(f"LocalhostCostModel: spec must be a LocalhostSpec, got "
                            f"{self.spec!r}")
        if isinstance(self.n_devices, bool) or not isinstance(self.n_devices, int) \
                or self.n_devices < 1:
            raise ValueError(f"LocalhostCostModel: n_devices must be an int >= 1, got "
                             f"{self.n_devices!r}")
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        if self.tracer is not None:
            if not isinstance(self.tracer, TracerRates):
                raise TypeError(f"LocalhostCostModel: tracer must be TracerRates or None, got "
                                f"{self.tracer!r}")
            missing = ", ".join(n for n in _HOST_RATES if getattr(self.spec, n) is None)
            if missing:
                raise ValueError(f"LocalhostCostModel: the spec lacks {missing} (calibrated "
                                 "before host work was measured); calibrate again")

    def trace_program(self, mesh, program, meta_args, ranks=None) -> list:
        """The traces this model prices (the cost-model hook of
        :func:`vcluster.timing.model_traces`): warm, with their host work when
        ``host_timed``, and what their context costs here
        (:func:`~.host_work.localhost_traces`); with ``shared_tracer_rates`` (see
        :meth:`for_many_programs`) the host work is priced with those rates."""
        return localhost_traces(self, mesh, program, meta_args, ranks=ranks,
                                tracer_rates=self.shared_tracer_rates or None)

    def for_many_programs(self) -> "LocalhostCostModel":
        """This model with the tracer's rates measured once for many programs (a ranking of
        layouts: ``HOST_TRACES`` sets now, not before each of up to ~100 candidates, ~1 s
        each); itself when it does not time host work."""
        if not self.host_timed:
            return self
        rates = tuple(measure_tracer_rates() for _ in range(HOST_TRACES))
        return dataclasses.replace(self, shared_tracer_rates=rates)

    def _start_figures(self) -> tuple[float, float]:
        """(W0, f) for ``n_devices`` (:func:`.start.queue_start_figures`)."""
        from .start import queue_start_figures
        return queue_start_figures(self)

    def prepare_traces(self, traces) -> list:
        """``traces`` with what their context costs on this machine, as work ops: the
        start of a run on all devices at once, the cold extra of every collective that
        follows other work and of the work between blocking calls
        (:func:`.start.prepare_traces`). Localhost predictions replay them."""
        from .start import prepare_traces
        return prepare_traces(self, traces)

    def sync_cpu_s(self, rank: int, op) -> float:
        """A synchronising call's CPU as programs make it (cold), at no more than
        CALL_BYTES: what waiting for the others costs, not the bytes."""
        if isinstance(op, TraceRecv):
            return self.p2p_cpu_s(op.peer, rank, min(op.nbytes, CALL_BYTES))[1]
        sync = dataclasses.replace(op, nbytes=min(op.nbytes, CALL_BYTES))
        position = op.group.index(rank)
        return self.collective_cpu_s(sync, position) + self.cold_call_s(sync, position)

    @property
    def host_timed(self) -> bool:
        """Whether to trace with ``host_time=True`` for this model (it has tracer rates)."""
        return self.tracer is not None

    @property
    def _itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 8

    @functools.cached_property
    def core_pool(self) -> CorePoolSpec:
        """The spec's cores and speedup; per-core queues with ``core_queues`` (built once)."""
        s, queues = self.spec, self.core_queues
        where = start_placements(s.start_split, self.n_devices, s.cores) if queues else ()
        return dataclasses.replace(s.core_pool, mobile_ops=MOBILE_OPS, placements=where)

    # --- synchronisation shares ---------------------------------------------------------
    def _share(self, table: tuple, cpu_table: tuple | None, n: int) -> float:
        """Single-core seconds one member spends: the busy CPU per call (interpolated)
        when the spec has it, else ``L(n) T(n) / n`` from the wall time alone."""
        if n <= 1:
            return 0.0
        s = self.spec
        if cpu_table is not None:
            return _interpolate(s.group_sizes, cpu_table, n)
        wall = _interpolate(s.group_sizes, table, n)
        return wall * s.core_pool.throughput_at(n) / n

    def barrier_share_s(self, n: int) -> float:
        return self._share(self.spec.barrier_s, self.spec.barrier_cpu_s, n)

    def inline_share_s(self, n: int) -> float:
        return self._share(self.spec.small_all_reduce_s, self.spec.small_all_reduce_cpu_s, n)

    def large_share_s(self, n: int) -> float:
        return self._share(self.spec.large_all_reduce_s, self.spec.large_all_reduce_cpu_s, n)

    def _fixed_ratio(self, collective: str) -> float:
        """A calibrated collective's intercept over the 4 KiB all_reduce's, both on N
        devices (1 for the others): scales ``c_large(n)`` to that collective."""
        if collective not in _CALIBRATED:
            return 1.0
        s = self.spec
        intercept = s.channel_fixed_s[_CALIBRATED.index(collective)]
        return intercept / _interpolate(s.group_sizes, s.large_all_reduce_s,
                                        s.calibration_devices)

    # --- the cost protocol ----------------------------------------------------------------
    def compute_time_s(self, op) -> float:
        if getattr(op, "seconds", None) is not None:
            return op.seconds
        if op.name == HOST_OP and (op.host_s or op.array_calls):
            if self.tracer is None:
                raise ValueError("LocalhostCostModel: a host op (a trace recorded with "
                                 "host_time=True) needs the model's tracer rates; build "
                                 "the model with localhost_model(...)")
            return host_work_s(op, self.spec, self.tracer)
        s = self.spec
        copy = s.busy_factor(s.memcpy_busy_speedup)
        if op.flops * self._itemsize >= BLAS_MIN_FLOPS_PER_ELEMENT * op.bytes:
            kernel = op.flops / s.gemm_flops_per_s(self.dtype) + op.bytes * copy / s.memcpy_bytes_per_s
        else:
            kernel = max(op.flops * s.busy_factor(s.vector_busy_speedup)
                         / s.vector_flops_per_s(self.dtype), op.bytes * copy / s.iadd_bytes_per_s)
        overhead = s.compute_overhead_s if self.tracer is None else s.block_overhead_s
        return overhead + kernel

    def collective_cpu_s(self, op, position: int) -> float:
        """Single-core seconds member ``position`` of ``op.group`` spends on the call."""
        if len(op.group) > self.n_devices:
            raise ValueError(f"LocalhostCostModel: {op.collective} over {len(op.group)} "
                             f"members on a cluster of {self.n_devices} devices")
        sync, moved, _ = self._parts(op, position)
        return sync + moved

    def collective_time_s(self, op, concurrent: int = 1) -> float:
        """The call's duration when every member has a core of its own."""
        return max(self.collective_cpu_s(op, p) for p in range(len(op.group)))

    @property
    def _calls(self):
        """The spec's per-call CPU table (:class:`~.calls.CallCpu`), or None."""
        calls = self._memo.get("calls", _UNSEEN)
        if calls is _UNSEEN:
            rows = self.spec.call_cpu_s
            calls = self._memo["calls"] = None if rows is None else CallCpu(rows)
        return calls

    def p2p_cpu_s(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(sender, receiver) single-core seconds of one message."""
        s = self.spec
        calls = self._calls
        if calls is not None:
            if nbytes <= INLINE_BYTES:
                return (calls.seconds("send_inline", self.n_devices, 2),
                        calls.seconds("recv_inline", self.n_devices, 2))
            more = max(0, nbytes - CALL_BYTES) * p2p_copy_s_per_byte(s)
            return (calls.seconds("send", self.n_devices, 2) + more,
                    calls.seconds("recv", self.n_devices, 2) + more)
        copy = nbytes * p2p_copy_s_per_byte(s) if nbytes > INLINE_BYTES else 0.0
        fixed = s.p2p_latency_s / 2 if s.p2p_message_cpu_s is None else s.p2p_message_cpu_s
        return fixed + copy, fixed + copy

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        return 0.0 if src == dst else sum(self.p2p_cpu_s(src, dst, nbytes))

    # --- one member's work in a collective ------------------------------------------------
    def cold_call_s(self, op, position: int) -> float:
        """What the call costs member ``position`` more when it follows other work than
        when it follows another call on its group: its synchronisation as measured in
        programs (:mod:`.calls`) less the back-to-back figure of the same call
        (``barrier_cpu_s``, ``small_all_reduce_cpu_s``, ``large_all_reduce_cpu_s``:
        every group calling, one call after another); 0 for message algorithms (their
        messages follow each other) and for specs without the call table."""
        sync, _, program_sync = self._parts(op, position)
        return max(0.0, program_sync - sync)

    def gap_extra_s(self, op, position: int, work_s: float) -> float:
        """What the call costs member ``position`` more after ``work_s`` single-core
        seconds of its own work since its previous communication than after the call
        table's short stretch: ``(g(work_s) - 1)`` times its synchronisation CPU as
        programs make it (:mod:`.gaps`); 0 without the gap table and for
        message algorithms (their figure is the messages')."""
        gaps = self._memo.get("gaps", _UNSEEN)
        if gaps is _UNSEEN:
            rows = self.spec.call_gap_cpu_s
            gaps = self._memo["gaps"] = None if rows is None else CallGap(rows)
        if gaps is None or len(op.group) < 2:
            return 0.0
        program = self._parts(op, position)[2]
        if program <= 0.0:
            return 0.0
        return max(0.0, gaps.factor(self.n_devices, len(op.group), work_s) - 1.0) * program

    def _parts(self, op, position: int) -> tuple[float, float, float]:
        """:meth:`_collective_parts`, once per distinct call (a replay asks many times)."""
        key = (op.collective, op.algorithm, len(op.group), position, op.nbytes, op.itemsize,
               op.root)
        parts = self._memo.get(key)
        if parts is None:
            parts = self._memo[key] = self._collective_parts(op, position)
        return parts

    def _collective_parts(self, op, position: int) -> tuple[float, float, float]:
        """(synchronisation CPU back to back, CPU of the bytes, synchronisation CPU in a
        program) of one member in ``op``; its price in a trace is the first two (the
        cold extra is added by :meth:`prepare_traces`)."""
        s, n, name = self.spec, len(op.group), op.collective
        calls = self._calls
        if name == "barrier":
            if calls is None:
                w = self.barrier_share_s(n)
                return w, 0.0, w
            program = calls.seconds("barrier", self.n_devices, n)
            return self._in_rhythm(program, s.barrier_cpu_s, "barrier", n), 0.0, program
        if n <= 1 or op.algorithm == "local":                # a group of one copies x
            return 0.0, op.nbytes * s.busy_factor(s.memcpy_busy_speedup) \
                / s.memcpy_bytes_per_s, 0.0
        members = tuple(range(n))
        t = collective_traffic(name, op.algorithm, members, position, op.nbytes,
                               op.itemsize or 1, op.root)
        if op.algorithm != "shm":                            # messages through the channel
            w = message_work(s, t, working_copy_bytes(name, op.algorithm, n, op.nbytes))
            return 0.0, w, 0.0
        if op.nbytes <= INLINE_BYTES:
            if calls is None:
                w = self.inline_share_s(n)
                return w, 0.0, w
            program = calls.seconds("all_reduce_inline", self.n_devices, n)
            return (self._in_rhythm(program, s.small_all_reduce_cpu_s, "all_reduce_inline", n),
                    0.0, program)
        moved = bytes_work(s, name, n, position, op, t)
        if calls is None:
            w = self.large_share_s(n) * self._fixed_ratio(name)
            return w, moved, w
        # the call's CPU as measured at CALL_BYTES, less the bytes it moved there
        kind = name if name in _CALIBRATED else ("reduce_scatter" if name == "reduce"
                                                 else "all_gather")
        at = TraceCollective(kind, members, CALL_BYTES, 8, "shm")
        measured = calls.seconds(kind, self.n_devices, n)
        at_moved = bytes_work(s, kind, n, 0, at, collective_traffic(
            kind, "shm", members, 0, CALL_BYTES, 8))
        program = max(_FLOOR * measured, measured - at_moved)
        return (self._in_rhythm(program, s.large_all_reduce_cpu_s, "all_reduce", n), moved,
                program)

    def _in_rhythm(self, program: float, b2b_table: tuple | None, call: str, n: int) -> float:
        """``program`` scaled by the ratio of the back-to-back to the program figure of
        ``call`` over ``n`` on all N calibration devices (at most 1)."""
        s = self.spec
        if b2b_table is None:
            return program
        b2b = _interpolate(s.group_sizes, b2b_table, n)
        ratio = b2b / self._calls.seconds(call, s.calibration_devices, n)
        return program * min(1.0, ratio)


def localhost_model(spec: LocalhostSpec, n_devices: int, dtype: str = "float64",
                    core_queues: bool = False):
    """The model to predict emulated programs with: ``LocalhostCostModel(spec, n_devices,
    dtype, tracer=<this process's tracer rates, measured now>, core_queues=core_queues)``
    (~0.1 s), for traces recorded with ``trace_program(..., host_time=model.host_timed)``.
    A spec calibrated before host-work rates existed gives the model without them."""
    rates = None if any(getattr(spec, n) is None for n in _HOST_RATES) else \
        measure_tracer_rates()
    return LocalhostCostModel(spec, n_devices, dtype, tracer=rates, core_queues=core_queues)
