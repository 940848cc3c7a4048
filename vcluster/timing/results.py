"""What a replay returns: step time, per-rank time accounting and timelines.

Per traced rank ``r``, with ``T`` the step time (makespan: the end of the last op,
collective or transfer of any rank):

* ``compute_s`` — busy time of the compute stream on compute ops;
* ``comm_s`` — summed durations (start to end) of the collectives ``r`` is a member of
  (blocking and asynchronous) and of the transfers it sends or receives — but a ring
  step's receive (:func:`~vcluster.runtime.tracing.ops.is_ring_tag`: a collective matmul),
  which its sender counts while ``r``'s own send of that step runs beside it, as a ring
  collective counts once per member; these may overlap compute and each other, so
  ``comm_s`` is not a share of ``T``;
* the compute stream is *blocked* on a blocking collective from its arrival to the
  collective's end, on a ``TraceWait`` (or the implicit wait for un-waited asynchronous
  collectives at the end of the trace) from the wait to the collective's end, and on a
  receive from the receive to the transfer's end. For one blocked interval ``[b, e]``, the
  communication it awaits is *in progress* over

  - blocking collective: ``[start, e]`` (it starts when the last member arrives);
  - wait on asynchronous collective X: the running intervals of X and of the collectives
    ahead of X on the rank's communication stream (X cannot start before they end);
  - receive: ``[since, e]``, ``since`` the start of the link's back-to-back run of
    transfers that ends with this one (FIFO: earlier transfers hold the link);

  and then ``exposed_comm_s`` += the part of ``[b, e]`` in progress, ``bubble_s`` += the
  rest: blocked while nothing it awaits moves (waiting for a late peer, for a send not yet
  issued, or for a peer's communication stream);

  plus ``bubble_s`` += ``T - end_s``, the idle tail after the rank's own end ``end_s``;
* ``idle_s = T - compute_s`` (as in :func:`pipelining.simulate`), so
  ``compute_s + exposed_comm_s + bubble_s = idle_s + compute_s = T``.

``compute_comm_ratio`` = sum of ``compute_s`` / sum of ``comm_s`` over traced ranks.
Timelines list :class:`Interval` records per rank, sorted by start.

**Per op** (``simulate_trace(..., op_kind=f)``): ``f`` names the kind of each compute op
(``"attention"``, ``"mlp"``, ... or None: the kind of the rank's previous compute op, the
first such op of a rank is ``"other"``), and every communication op of a rank is charged
to the op kind adjacent to it in that rank's program order, the op whose data it carries:

* a collective (blocking or asynchronous) and a send: the kind of the last compute op
  before it (the producer of what it sends or reduces) — unless
  ``simulate_trace(..., collective_kind=g)`` gives the collective a kind of its own
  (``g(op)`` not None: the planner books data-parallel reductions to a row of theirs);
* a receive: the kind of the first compute op after it (the consumer of what it
  brings), or of the last one if none follows.

Each :class:`OpStats` holds, summed over the traced ranks, the busy time of the kind's
compute ops and the durations (as ``comm_s`` counts them) of the communication charged to
it; so the kinds' compute and comm add up to the step's, and
``compute_s / comm_s`` is the op's T_compute / T_comm.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple

__all__ = ["Stream", "Interval", "RankStats", "OpStats", "SimulationResult", "ratio"]


class Stream(enum.Enum):
    """Where an :class:`Interval` happened."""

    COMPUTE = "compute"   #: a compute op on the compute stream
    COMM = "comm"         #: a collective, start to end (blocking or on the comm stream)
    P2P = "p2p"           #: a transfer on a link (the send's or the receive's op)
    WAIT = "wait"         #: the compute stream blocked (collective, wait or receive)

    def __str__(self) -> str:
        return self.value


class Interval(NamedTuple):
    """``op`` (index ``op_index`` in the rank's trace) ran on ``stream`` over [start, end).

    ``op_index == len(trace)`` and ``op is None`` mark the implicit wait for un-waited
    asynchronous collectives at the end of the trace.
    """

    op_index: int
    op: object
    start_s: float
    end_s: float
    stream: Stream


@dataclass(frozen=True)
class RankStats:
    """Time accounting of one traced rank (see the module doc for the definitions)."""

    rank: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    idle_s: float
    end_s: float


def ratio(compute_s: float, comm_s: float) -> float:
    """``compute_s / comm_s``: ``inf`` without communication, ``nan`` with neither."""
    if comm_s == 0.0:
        return math.inf if compute_s > 0.0 else math.nan
    return compute_s / comm_s


@dataclass(frozen=True)
class OpStats:
    """One op kind: its compute time and the communication time charged to it, summed
    over the traced ranks (see "Per op" in the module doc)."""

    op: str
    compute_s: float
    comm_s: float

    @property
    def compute_comm_ratio(self) -> float:
        """T_compute / T_comm of this op (``inf`` without communication)."""
        return ratio(self.compute_s, self.comm_s)


_COLUMNS = ("compute_s", "comm_s", "exposed_comm_s", "bubble_s", "idle_s", "end_s")


@dataclass(frozen=True, repr=False)
class SimulationResult:
    """What :func:`vcluster.timing.engine.simulate_trace` returns.

    ``ranks`` are the traced ranks (sorted); ``stats[i]`` and ``timelines[i]`` belong to
    ``ranks[i]`` (timelines are empty when recording was off). ``devices`` is the number of
    devices the result stands for (the mesh's size when given, else ``len(ranks)``);
    ``symmetric`` says whether untraced ranks were assumed to mirror traced ones;
    ``op_stats`` the per-op accounting when the replay was given ``op_kind`` (else empty),
    the largest compute first; ``pool_work_s`` the single-core seconds of work the core
    pool served (every rank's compute, collective shares and message copies; None
    without a pool).
    """

    step_time_s: float
    ranks: tuple[int, ...]
    stats: tuple[RankStats, ...]
    timelines: tuple[tuple[Interval, ...], ...]
    devices: int
    symmetric: bool = False
    op_stats: tuple[OpStats, ...] = ()
    pool_work_s: float | None = None

    def _column(self, name: str) -> Mapping[int, float]:
        return MappingProxyType({s.rank: getattr(s, name) for s in self.stats})

    @property
    def compute_s(self) -> Mapping[int, float]:
        """``{rank: compute busy time}``."""
        return self._column("compute_s")

    @property
    def comm_s(self) -> Mapping[int, float]:
        """``{rank: summed collective and transfer durations}``."""
        return self._column("comm_s")

    @property
    def exposed_comm_s(self) -> Mapping[int, float]:
        """``{rank: time blocked while its awaited communication is in progress}``."""
        return self._column("exposed_comm_s")

    @property
    def bubble_s(self) -> Mapping[int, float]:
        """``{rank: time blocked before the awaited communication began, plus idle tail}``."""
        return self._column("bubble_s")

    @property
    def idle_s(self) -> Mapping[int, float]:
        """``{rank: step time - compute time}``."""
        return self._column("idle_s")

    @property
    def compute_comm_ratio(self) -> float:
        """Total compute time / total communication time (``inf`` without communication,
        ``nan`` with neither)."""
        return ratio(math.fsum(s.compute_s for s in self.stats),
                     math.fsum(s.comm_s for s in self.stats))

    def stats_of(self, rank: int) -> RankStats:
        """The :class:`RankStats` of a traced ``rank``."""
        return self.stats[self._position(rank)]

    def timeline(self, rank: int) -> tuple[Interval, ...]:
        """The intervals of a traced ``rank``, sorted by start."""
        return self.timelines[self._position(rank)]

    def _position(self, rank: int) -> int:
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank!r} was not traced; traced ranks are "
                             f"{list(self.ranks)}") from None

    @property
    def per_rank(self):
        """A pandas DataFrame indexed by rank with the :class:`RankStats` columns."""
        import pandas as pd
        rows = [[getattr(s, c) for c in _COLUMNS] for s in self.stats]
        return pd.DataFrame(rows, index=pd.Index(self.ranks, name="rank"), columns=_COLUMNS)

    def timeline_frame(self):
        """All intervals as a pandas DataFrame (rank, op_index, op, start_s, end_s, stream)."""
        import pandas as pd
        rows = [(r, iv.op_index, iv.op, iv.start_s, iv.end_s, iv.stream.value)
                for r, row in zip(self.ranks, self.timelines) for iv in row]
        return pd.DataFrame(rows, columns=["rank", "op_index", "op", "start_s", "end_s",
                                           "stream"])

    def summary(self) -> dict:
        """Headline numbers: step time, means / maxima over ranks, ratio."""
        n = len(self.stats) or 1
        mean = lambda name: math.fsum(getattr(s, name) for s in self.stats) / n  # noqa: E731
        top = lambda name: max((getattr(s, name) for s in self.stats), default=0.0)  # noqa: E731
        t = self.step_time_s
        return {
            "step_time_s": t,
            "traced_ranks": len(self.ranks),
            "devices": self.devices,
            "symmetric": self.symmetric,
            "compute_s_mean": mean("compute_s"),
            "comm_s_mean": mean("comm_s"),
            "exposed_comm_s_mean": mean("exposed_comm_s"),
            "exposed_comm_s_max": top("exposed_comm_s"),
            "bubble_s_mean": mean("bubble_s"),
            "bubble_fraction": mean("bubble_s") / t if t > 0 else 0.0,
            "idle_s_mean": mean("idle_s"),
            "compute_comm_ratio": self.compute_comm_ratio,
        }

    def _repr_html_(self) -> str:
        """Headline numbers and per-rank seconds for notebooks (see ``results_html``)."""
        from .results_html import simulation_html
        return simulation_html(self)

    def __repr__(self) -> str:
        return (f"SimulationResult(step_time_s={self.step_time_s:.6g}, "
                f"ranks={len(self.ranks)}, devices={self.devices}, symmetric={self.symmetric}, "
                f"compute_comm_ratio={self.compute_comm_ratio:.4g})")
