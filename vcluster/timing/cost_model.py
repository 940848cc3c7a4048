"""What the replay asks a hardware model: the duration of one traced op.

:class:`CostModel` is the protocol the replay (:mod:`vcluster.timing.replay`) calls; the
real hardware model implements it, and :class:`SimpleCostModel` / :class:`ZeroCostModel`
are small closed-form models for tests and notebooks.

``SimpleCostModel`` (Thakur, Rabenseifner & Gropp 2005; NCCL's tuning model): with ``p``
group members, per-message latency ``alpha``, link bandwidth ``bw`` and ``n`` the size of
the collective in the nccl-tests convention (all_reduce / reduce_scatter / all_to_all /
broadcast / reduce / scatter: the input buffer; all_gather / gather: the output buffer,
``p`` times the local input that the trace records),

==========================================  ==========================================
collective (algorithm assumed)              time
==========================================  ==========================================
all_reduce (ring)                           ``2(p-1) alpha + 2(p-1)/p * n/bw``
all_gather, reduce_scatter (ring),          ``(p-1) alpha + (p-1)/p * n/bw``
all_to_all, scatter, gather (pairwise)
broadcast, reduce (binomial tree)           ``ceil(lg p) (alpha + n/bw)``
barrier                                     ``ceil(lg p) alpha``
point to point                              ``alpha + nbytes/bw``
compute                                     ``max(flops/flops_per_s, bytes/bytes_per_s)``
==========================================  ==========================================

A group of one member costs nothing. ``concurrent`` collectives sharing a device's links
divide its bandwidth: the ``n/bw`` terms are multiplied by ``concurrent``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from vcluster.runtime.tracing import trace_program
from vcluster.runtime.tracing.ops import TraceCollective, TraceCompute

__all__ = ["CostModel", "SimpleCostModel", "ZeroCostModel", "COLLECTIVES", "alpha_beta_terms",
           "model_traces", "core_pool_of", "for_many_programs"]

#: The collectives a cost model must price (torch.distributed names).
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                "broadcast", "reduce", "scatter", "gather", "barrier")


@runtime_checkable
class CostModel(Protocol):
    """Durations, in seconds, of the ops of a symbolic trace.

    Implementations must be pure (the replay memoises ``compute_time_s`` per distinct op)
    and return finite values ``>= 0``.
    """

    def compute_time_s(self, op: TraceCompute) -> float:
        """Duration of one compute op on its device's compute stream."""
        ...

    def collective_time_s(self, op: TraceCollective, concurrent: int) -> float:
        """Duration of one collective call over ``op.group``, from start to end.

        ``concurrent >= 1`` counts the collectives in flight at its start on the devices it
        uses, itself included (the replay's definition: 1 + the most other collectives in
        flight on any one member); a model may ignore it.
        """
        ...

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        """Duration of one point-to-point transfer of ``nbytes`` on the link ``src -> dst``."""
        ...


# --- what a cost model may say beyond durations ---------------------------------------------
# A model of datasheet hardware prices the plain trace of a program on devices of their
# own. A model of the machine the emulator itself runs on also prices the
# programs' host work and has its devices share a few cores, so it may define:
#
#   trace_program(mesh, program, meta_args, ranks=None) -> traces   how to trace for it
#   core_pool                                                       the replay's core pool
#   for_many_programs() -> model     the model to price many programs with (a ranking):
#                                    what every trace would measure, measured once
#
# Callers go through the three functions below and never ask which model they hold.

def model_traces(model, mesh, program, meta_args, ranks=None) -> list:
    """The traces of ``program`` that ``model`` prices: its own ``trace_program`` when it
    has one, else :func:`~vcluster.runtime.tracing.trace_program` (shape-only arrays)."""
    own = getattr(model, "trace_program", None)
    if own is not None:
        return own(mesh, program, meta_args, ranks=ranks)
    return trace_program(mesh, program, meta_args, ranks=ranks)


def core_pool_of(model):
    """The core pool ``model`` replays on (``simulate_trace(core_pool=...)``), or None
    (every device has cores of its own)."""
    return getattr(model, "core_pool", None)


def for_many_programs(model):
    """``model`` ready to price many programs in a row (a ranking of layouts): its own
    ``for_many_programs()`` when it has one, else ``model`` itself."""
    own = getattr(model, "for_many_programs", None)
    return model if own is None else own()


def alpha_beta_terms(collective: str, group_size: int, nbytes: int) -> tuple[int, float]:
    """``(latency_steps, busy_link_bytes)`` of one call: time = steps*alpha + bytes/bw.

    ``nbytes`` is a member's local input as the trace records it (for broadcast and scatter
    the root's); see the module table for the formulas.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; a cost model prices "
                         f"{', '.join(COLLECTIVES)}")
    p = group_size
    if p <= 1:
        return 0, 0.0
    lg = math.ceil(math.log2(p))
    if collective == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p * nbytes
    if collective in ("all_gather", "gather"):
        return p - 1, (p - 1) / p * (p * nbytes)   # n = output = p * local input
    if collective in ("reduce_scatter", "all_to_all", "scatter"):
        return p - 1, (p - 1) / p * nbytes
    if collective in ("broadcast", "reduce"):
        return lg, float(lg * nbytes)
    return lg, 0.0                                 # barrier


def _rate(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SimpleCostModel: {what} must be a positive number, got {value!r}")
    if not value > 0:
        raise ValueError(f"SimpleCostModel: {what} must be > 0 (math.inf allowed), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SimpleCostModel:
    """Roofline compute and ring/tree alpha-beta communication (see the module table)."""

    flops_per_s: float          # peak compute rate, FLOP/s
    bytes_per_s: float          # memory bandwidth, bytes/s (math.inf: compute-bound only)
    alpha_s: float              # latency of one message / algorithm step, s
    link_bytes_per_s: float     # bandwidth of one link, bytes/s (math.inf: free transfers)

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "bytes_per_s", "link_bytes_per_s"):
            object.__setattr__(self, name, _rate(getattr(self, name), name))
        a = self.alpha_s
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < math.inf:
            raise ValueError(f"SimpleCostModel: alpha_s must be a finite number >= 0, got {a!r}")
        object.__setattr__(self, "alpha_s", float(a))

    @classmethod
    def compute_only(cls, flops_per_s: float = 1.0) -> "SimpleCostModel":
        """Compute at ``flops_per_s`` (no memory bound); every communication takes 0 s."""
        return cls(flops_per_s, math.inf, 0.0, math.inf)

    def compute_time_s(self, op: TraceCompute) -> float:
        return max(op.flops / self.flops_per_s, op.bytes / self.bytes_per_s)

    def collective_time_s(self, op: TraceCollective, concurrent: int = 1) -> float:
        steps, wire_bytes = alpha_beta_terms(op.collective, len(op.group), op.nbytes)
        if wire_bytes == 0.0:
            return steps * self.alpha_s
        return steps * self.alpha_s + max(1, concurrent) * wire_bytes / self.link_bytes_per_s

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.link_bytes_per_s


@dataclass(frozen=True)
class ZeroCostModel:
    """Every op takes 0 s: replays only the order of events (deadlocks, matching)."""

    def compute_time_s(self, op: TraceCompute) -> float:
        return 0.0

    def collective_time_s(self, op: TraceCollective, concurrent: int = 1) -> float:
        return 0.0

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        return 0.0
