"""Engine records to :class:`~reports.RunRecord` tables (devices, collectives, spans).

Two sources, duck-typed so that this layer imports no engine:

* **measured** — the emulator's events (``cluster.trace()``): ``ComputeEvent`` (``rank,
  name, flops, bytes, start, end``) and ``CommEvent`` (``rank, collective, group,
  algorithm, nbytes, sent, received, tag, start, end``), wall-clock seconds;
* **predicted** — a timing-model ``SimulationResult`` (``ranks``, ``stats``,
  ``timelines`` of ``Interval(op_index, op, start_s, end_s, stream)``).

Time accounting of a measured rank, with ``T`` the span of the whole run (first start
to last end over every rank) and ``U(·)`` the length of a union of intervals:

* ``compute_s = U(compute events)`` (nested compute events count once);
* ``comm_s`` = summed durations of its communication events (they may overlap compute);
* ``exposed_comm_s = U(comm events) - U(comm ∩ compute)``: communication not hidden
  behind compute;
* ``bubble_s = T - compute_s - exposed_comm_s``: neither computing nor communicating
  (waiting for a peer, the idle head and tail),

so ``compute_s + exposed_comm_s + bubble_s = T`` per rank, as in the timing model.

Pipeline actions are compute events named ``"<stage><F|B|I|W><microbatch>"`` (the
executor's ``str(Action)``); their spans get ``name`` = the letter and ``stage`` /
``microbatch`` columns.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable, Sequence

import pandas as pd

from reports.record import COLLECTIVE_COLUMNS, DEVICE_COLUMNS, SPAN_COLUMNS

__all__ = ["spans_from_events", "devices_from_events", "collectives_from_events",
           "spans_from_simulation", "devices_from_simulation",
           "collectives_from_simulation", "union_length_s"]

# The name of the tracer's host ops (vcluster.runtime.tracing.host.HOST_OP; reports read
# plain records and import no engine: tests/reports/test_predicted_actions.py checks the two
# agree).
HOST_OP = "host"
_ACTION = re.compile(r"^([0-9]+)([FBIW])([0-9]+)$")
_P2P = frozenset({"send", "recv", "isend", "irecv"})
_SPAN_EXTRA = ("stage", "microbatch")


def union_length_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _intersections(a: list[tuple[float, float]], b: list[tuple[float, float]]):
    """Pairwise intersections of two interval lists (inputs are small per rank)."""
    out = []
    for s1, e1 in a:
        for s2, e2 in b:
            s, e = max(s1, s2), min(e1, e2)
            if e > s:
                out.append((s, e))
    return out


def _is_compute(event) -> bool:
    return hasattr(event, "flops")


def _action_parts(name: str):
    """``"1F3"`` -> ``("F", 1, 3)``; any other name -> ``(name, None, None)``."""
    m = _ACTION.match(str(name))
    if m is None:
        return str(name), None, None
    return m.group(2), int(m.group(1)), int(m.group(3))


def _span_row(source, rank, stream, name, start_s, end_s):
    kind, stage, microbatch = _action_parts(name) if stream == "compute" else (name, None, None)
    return (source, rank, stream, kind, start_s, end_s, stage, microbatch)


def _span_frame(rows) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=list(SPAN_COLUMNS) + list(_SPAN_EXTRA))
    for column in _SPAN_EXTRA:
        frame[column] = frame[column].astype("Int64")
    return frame.sort_values(["source", "rank", "start_s"], kind="stable",
                             ignore_index=True)


def spans_from_events(events: Sequence, source: str = "measured") -> pd.DataFrame:
    """One span per event; starts relative to the first event's start."""
    if not events:
        return _span_frame([])
    t0 = min(e.start for e in events)
    rows = []
    for e in events:
        if _is_compute(e):
            stream = "compute"
        else:
            stream = "p2p" if e.collective in _P2P else "comm"
        name = e.name if _is_compute(e) else e.collective
        rows.append(_span_row(source, e.rank, stream, name, e.start - t0, e.end - t0))
    return _span_frame(rows)


def _coords(mesh, rank):
    if mesh is None:
        return None
    return str(tuple(mesh.index(rank)))


def devices_from_events(events: Sequence, mesh=None, ranks: Iterable[int] | None = None,
                        source: str = "measured") -> pd.DataFrame:
    """Per-rank time accounting and traffic of emulator events (see the module doc).

    ``ranks`` (default: the ranks that have events, or every rank of ``mesh``) lists the
    rows; ``mesh`` fills ``coords``.
    """
    if ranks is None:
        ranks = range(mesh.size) if mesh is not None else sorted({e.rank for e in events})
    ranks = list(ranks)
    t_total = (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0
    compute, comm = defaultdict(list), defaultdict(list)
    traffic = defaultdict(lambda: [0, 0, 0])
    for e in events:
        (compute if _is_compute(e) else comm)[e.rank].append((e.start, e.end))
        if not _is_compute(e):
            t = traffic[e.rank]
            t[0] += e.bytes_sent
            t[1] += e.bytes_received
            t[2] += e.messages_sent
    rows = []
    for r in ranks:
        compute_s = union_length_s(compute[r])
        comm_union = union_length_s(comm[r])
        hidden = union_length_s(_intersections(comm[r], compute[r]))
        exposed = comm_union - hidden
        comm_s = sum(end - start for start, end in comm[r])
        bubble = max(t_total - compute_s - exposed, 0.0)
        sent, received, messages = traffic[r]
        rows.append((source, r, _coords(mesh, r), compute_s, comm_s, exposed, bubble,
                     sent, received, messages))
    return pd.DataFrame(rows, columns=list(DEVICE_COLUMNS))


def _axis_of(mesh, group) -> str | None:
    """The mesh axes along which the members of ``group`` differ (``"dp,tp"``)."""
    if mesh is None or len(group) < 2:
        return None
    coords = [tuple(mesh.index(r)) for r in group]
    varying = [name for i, name in enumerate(mesh.axes)
               if len({c[i] for c in coords}) > 1]
    return ",".join(varying)


def collectives_from_events(events: Sequence, mesh=None,
                            source: str = "measured") -> pd.DataFrame:
    """One row per (collective, group, algorithm) of the emulator's communication events.

    ``calls`` counts the calls (events of one member); ``bytes`` is the traffic between
    members: the bytes they sent, plus for the ``shm`` algorithm the bytes they read from a
    peer's buffer (see ``vcluster.runtime.events``: a shared-memory read counts only as
    received, a write only as sent); ``time_s`` sums, over calls, the call's span (first member's start to
    last member's end). Point-to-point events are grouped by their (sender, receiver) pair.
    """
    calls = defaultdict(lambda: defaultdict(list))    # key -> call id -> events
    for e in events:
        if _is_compute(e):
            continue
        key = (e.collective, tuple(e.group), e.algorithm)
        calls[key][(e.tag, e.rank) if e.collective in _P2P else e.tag].append(e)
    rows = []
    for (collective, group, algorithm), by_call in sorted(calls.items(), key=str):
        member_events = [e for evs in by_call.values() for e in evs]
        time_s = sum(max(e.end for e in evs) - min(e.start for e in evs)
                     for evs in by_call.values())
        moved = sum(e.bytes_sent + (e.bytes_received if algorithm == "shm" else 0)
                    for e in member_events)
        rows.append((source, collective, _axis_of(mesh, group), str(list(group)), algorithm,
                     len(by_call), moved, time_s))
    return pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS))


def _op_name(op) -> str:
    """A readable name for a traced op (``TraceCompute.name``, a collective's name, ...)."""
    if op is None:
        return "wait (end)"
    for attr in ("name", "collective"):
        value = getattr(op, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(op).__name__.removeprefix("Trace").lower()


def _enclosed(timeline) -> dict:
    """Per op index of a compute block that holds other ops (``TraceCompute.contains``:
    that many ops before it, host ops not counted): the (start, end) from the first of its
    ops' start to its own end."""
    first, ops = {}, {}
    for iv in timeline:
        i = iv.op_index
        ops[i] = iv.op
        if i not in first or iv.start_s < first[i]:
            first[i] = iv.start_s
    out = {}
    for iv in timeline:
        held = getattr(iv.op, "contains", 0)
        if not held or str(iv.stream) != "compute":
            continue
        start, k = iv.start_s, iv.op_index - 1
        while held and k >= 0:
            if getattr(ops.get(k), "name", None) != HOST_OP:
                held -= 1
            start = min(start, first.get(k, start))
            k -= 1
        out[iv.op_index] = (start, iv.end_s)
    return out


def spans_from_simulation(result, source: str = "predicted") -> pd.DataFrame:
    """One span per timeline interval of a timing-model ``SimulationResult``.

    A compute block recorded around other ops (a pipeline action ``0F1`` around its
    matmuls: ``TraceCompute.contains``) spans from the start of the first op it holds to
    its own end, so that the predicted timeline shows each action over its work, as the
    measured one does."""
    rows = []
    for rank, timeline in zip(result.ranks, result.timelines):
        blocks = _enclosed(timeline)
        for iv in timeline:
            start_s, end_s = blocks.get(iv.op_index, (iv.start_s, iv.end_s))
            rows.append(_span_row(source, rank, str(iv.stream), _op_name(iv.op), start_s,
                                  end_s))
    return _span_frame(rows)


def collectives_from_simulation(result, mesh=None, source: str = "predicted",
                                algorithm_of=None) -> pd.DataFrame:
    """One row per (collective, group, algorithm) of a replay's communication intervals.

    Counted on the group's first traced member: ``calls`` its intervals, ``time_s`` their
    summed durations. Sends are grouped by (sender, receiver) as ``send`` rows with
    algorithm ``p2p``. ``bytes`` is left empty (the replay times bytes, it does not move
    them; the measured rows hold the traffic). ``algorithm_of(op)``: the algorithm the
    cost model priced the op with (a hardware model's NCCL choice) instead of the one the
    trace recorded (the emulator's).
    """
    traced = set(result.ranks)
    found = defaultdict(list)                      # key -> durations
    for rank, timeline in zip(result.ranks, result.timelines):
        for iv in timeline:
            op = iv.op
            if str(iv.stream) == "comm" and hasattr(op, "group"):
                group = tuple(op.group)
                if rank != min(traced.intersection(group), default=rank):
                    continue
                key = (op.collective, group,
                       op.algorithm if algorithm_of is None else algorithm_of(op))
            elif str(iv.stream) == "p2p" and type(op).__name__ == "TraceSend":
                key = ("send", (rank, op.peer), "p2p")
            else:
                continue
            found[key].append(iv.end_s - iv.start_s)
    rows = [(source, collective, _axis_of(mesh, group), str(list(group)), algorithm,
             len(durations), float("nan"), sum(durations))
            for (collective, group, algorithm), durations in sorted(found.items(), key=str)]
    return pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS))


def devices_from_simulation(result, mesh=None, source: str = "predicted") -> pd.DataFrame:
    """Per traced rank: the replay's compute / comm / exposed / bubble accounting.

    Traffic columns are not predicted per rank by the replay and are left empty (NaN).
    """
    nan = float("nan")
    rows = [(source, s.rank, _coords(mesh, s.rank), s.compute_s, s.comm_s, s.exposed_comm_s,
             s.bubble_s, nan, nan, nan) for s in result.stats]
    return pd.DataFrame(rows, columns=list(DEVICE_COLUMNS))
