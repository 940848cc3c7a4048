"""``trace.json``: a record's spans in Chrome trace-event format (Perfetto, chrome://tracing).

Format (the Trace Event Format of the Chrome tracing project): ``{"traceEvents": [...],
"displayTimeUnit": "ms"}``. Each span is a complete event ``{"ph": "X", "name", "cat":
stream, "ts": start_us, "dur": dur_us, "pid", "tid": rank, "args"}``. One process per
source (pid 1 ``measured``, pid 2 ``predicted``, then others in order of appearance) and
one thread per device (``tid`` = rank), named by ``"M"`` metadata events
(``process_name``, ``thread_name`` = ``"rank r"``, ``thread_sort_index`` = r), so each
device is its own track.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

__all__ = ["chrome_trace", "write_chrome_trace", "US_PER_S"]

US_PER_S = 1e6
_KNOWN_PIDS = {"measured": 1, "predicted": 2}


def _pids(sources) -> dict[str, int]:
    pids = {s: _KNOWN_PIDS[s] for s in sources if s in _KNOWN_PIDS}
    for s in sources:
        if s not in pids:
            pids[s] = max([0, *pids.values(), *_KNOWN_PIDS.values()]) + 1
    return pids


def _args(row) -> dict:
    args = {}
    for column in ("stage", "microbatch"):
        value = row.get(column)
        if value is not None and not pd.isna(value):
            args[column] = int(value)
    return args


def chrome_trace(record) -> dict:
    """The trace-event JSON object of ``record.spans`` (empty spans -> metadata only)."""
    spans = record.spans
    sources = list(dict.fromkeys(spans["source"])) if len(spans) else []
    pids = _pids(sources)
    events = []
    for source, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{source} ({record.name})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for rank in sorted({int(r) for r in spans.loc[spans["source"] == source, "rank"]}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": rank,
                           "args": {"sort_index": rank}})
    # longer spans first at equal start, so that enclosing spans open before nested ones
    ordered = spans.assign(_dur=spans["end_s"] - spans["start_s"]).sort_values(
        ["source", "rank", "start_s", "_dur"], ascending=[True, True, True, False],
        kind="stable") if len(spans) else spans
    for row in ordered.to_dict("records"):
        events.append({"ph": "X", "name": str(row["name"]), "cat": str(row["stream"]),
                       "ts": float(row["start_s"]) * US_PER_S,
                       "dur": max(float(row["end_s"] - row["start_s"]), 0.0) * US_PER_S,
                       "pid": pids[row["source"]], "tid": int(row["rank"]),
                       "args": {"stream": str(row["stream"]), **_args(row)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(record, directory: Path) -> str:
    """Write ``trace.json`` into ``directory``; return its file name."""
    (Path(directory) / "trace.json").write_text(json.dumps(chrome_trace(record)) + "\n")
    return "trace.json"
