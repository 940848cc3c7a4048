"""``trace.json``: a record's spans in Chrome trace-event format (Perfetto, chrome://tracing).

Format (the Trace Event Format of the Chrome tracing project): ``{"traceEvents": [...],
"displayTimeUnit": "ms"}``. Each span is a complete event ``{"ph": "X", "name", "cat":
stream, "ts": start_us, "dur": dur_us, "pid", "tid": rank, "args": {"stream", "stage",
"microbatch"}}``. One process per source — and per sweep point when the spans have a
``point`` column — numbered from 1 (``measured`` before ``predicted``, points in order),
and one thread per device (``tid`` = rank), named by ``"M"`` metadata events
(``process_name`` such as ``"measured (quickstart)"``, ``thread_name`` = ``"rank r"``,
sort indexes), so each device is its own track.

A served model's simulation (scenario kind ``inference``) follows in processes of its own:
one track per replica with a slice per engine step, and every request's lifetime as an
asynchronous slice (:mod:`reports.serving_trace`).

Spans of one device that overlap without nesting (an asynchronous collective running
beside compute) share the device's track; viewers draw them as well as the format allows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from reports.serving_trace import serving_trace_events

__all__ = ["chrome_trace", "write_chrome_trace", "US_PER_S"]

US_PER_S = 1e6
_SOURCE_ORDER = {"measured": 0, "predicted": 1}


def _processes(spans: pd.DataFrame, run_name: str) -> dict[tuple, tuple[int, str]]:
    """``{(point, source): (pid, process name)}``; point is None outside sweeps."""
    points = spans["point"] if "point" in spans.columns else pd.Series([None] * len(spans))
    keys = set(zip(points.tolist(), spans["source"].tolist()))
    ordered = sorted(keys, key=lambda k: (-1 if k[0] is None else k[0],
                                          _SOURCE_ORDER.get(k[1], 2), str(k[1])))
    return {k: (i + 1, f"{k[1]} ({run_name})" if k[0] is None else
                f"{k[1]}, point {k[0]} ({run_name})") for i, k in enumerate(ordered)}


def _args(row) -> dict:
    args = {"stream": str(row["stream"])}
    for column in ("stage", "microbatch"):
        value = row.get(column)
        if value is not None and not pd.isna(value):
            args[column] = int(value)
    return args


def chrome_trace(record) -> dict:
    """The trace-event JSON object of ``record.spans`` (empty spans -> no events), then a
    served model's simulated engine steps and requests in processes of their own
    (:mod:`reports.serving_trace`)."""
    events = _span_events(record)
    first_pid = max((e["pid"] for e in events), default=0) + 1
    events += serving_trace_events(record, first_pid)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _span_events(record) -> list[dict]:
    """The events of ``record.spans`` (module docstring)."""
    spans = record.spans
    if not len(spans):
        return []
    spans = spans.assign(_point=spans["point"] if "point" in spans.columns else None)
    processes = _processes(spans, record.name)
    events = []
    for (point, source), (pid, name) in processes.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        mine = spans[(spans["source"] == source)
                     & (spans["_point"].isna() if point is None else spans["_point"] == point)]
        for rank in sorted({int(r) for r in mine["rank"]}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": rank,
                           "args": {"sort_index": rank}})
    # longer spans first at equal start, so that enclosing spans open before nested ones
    ordered = spans.assign(_dur=spans["end_s"] - spans["start_s"]).sort_values(
        ["source", "rank", "start_s", "_dur"], ascending=[True, True, True, False],
        kind="stable")
    for row in ordered.to_dict("records"):
        point = None if pd.isna(row["_point"]) else row["_point"]
        events.append({"ph": "X", "name": str(row["name"]), "cat": str(row["stream"]),
                       "ts": float(row["start_s"]) * US_PER_S,
                       "dur": max(float(row["end_s"] - row["start_s"]), 0.0) * US_PER_S,
                       "pid": processes[(point, row["source"])][0], "tid": int(row["rank"]),
                       "args": _args(row)})
    return events


def write_chrome_trace(record, directory: Path) -> str:
    """Write ``trace.json`` into ``directory``; return its file name."""
    (Path(directory) / "trace.json").write_text(json.dumps(chrome_trace(record)) + "\n")
    return "trace.json"
