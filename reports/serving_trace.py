"""A served model's simulation in Chrome trace-event format, beside the spans of
:mod:`reports.chrome_trace` in the same ``trace.json`` (Perfetto, chrome://tracing).

From the record's simulated ``engine_steps`` and ``requests`` (scenario kind
``inference``), per sweep point and pool one process (``"M"`` metadata: ``process_name``
``"serving simulation (name)"``, with the pool and the point when there are several) and
in it:

* one thread per replica (``tid`` = replica, ``thread_name`` ``"replica r"``), one complete
  event (``"ph": "X"``) per engine step, named by what it holds (``prefill``, ``decode``,
  ``prefill + decode``), ``args``: step, prefill_tokens, decode_seqs, num_seqs,
  kv_usage, preempted (and floor_ms where priced);
* every request's lifetime as a nestable asynchronous slice (``"ph": "b"`` / ``"e"``,
  ``cat`` ``request``, an ``id`` unique in the file) from its arrival to its last token,
  and inside it the wait for its first token (arrival to TTFT); ``args``: request,
  replica, prompt and output tokens, TTFT and TPOT (ms).

Times are microseconds from the simulation's start (``ts``, ``dur``). An emulated run's
engine steps have no clock of their own: its devices' spans are the trace's
``measured`` processes.
"""

from __future__ import annotations

import math

import pandas as pd

__all__ = ["serving_trace_events", "US_PER_S"]

US_PER_S = 1e6
_MS_PER_S = 1e3


def _simulated(frame):
    if frame is None or not len(frame) or "source" not in frame.columns:
        return None
    rows = frame[frame["source"] == "simulated"]
    return rows if len(rows) else None


def _key(rows, column: str, default):
    return rows[column] if column in rows.columns else pd.Series([default] * len(rows),
                                                                  index=rows.index)


def _step_name(prefill: int, decode: int) -> str:
    if prefill and decode:
        return "prefill + decode"
    return "prefill" if prefill else "decode"


def _number(value):
    """A JSON number (a float that is not finite: None)."""
    value = float(value)
    return value if math.isfinite(value) else None


def serving_trace_events(record, first_pid: int) -> list[dict]:
    """The trace events of ``record``'s serving simulation, processes numbered from
    ``first_pid`` ([] when it has none; module docstring)."""
    steps = _simulated(getattr(record, "engine_steps", None))
    requests = _simulated(getattr(record, "requests", None))
    if steps is None:
        return []
    steps = steps.assign(_point=_key(steps, "point", None), _pool=_key(steps, "pool", ""))
    keys = list(dict.fromkeys(zip(steps["_point"], steps["_pool"])))
    events, pid_of = [], {}
    for i, (point, pool) in enumerate(keys):
        pid = pid_of[(point, pool)] = first_pid + i
        where = ", ".join(w for w in (f"{pool} pool" if pool else "",
                                      "" if point is None or pd.isna(point)
                                      else f"point {point}") if w)
        name = f"serving simulation{' ' + where if where else ''} ({record.name})"
        events += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": name}},
                   {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}}]
        mine = steps[(steps["_point"] == point) if point is not None and not pd.isna(point)
                     else steps["_point"].isna()]
        for replica in sorted({int(r) for r in mine[mine["_pool"] == pool]["replica"]}):
            events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": replica,
                        "args": {"name": f"{pool + ' ' if pool else ''}replica {replica}"}},
                       {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": replica,
                        "args": {"sort_index": replica}}]
    for row in steps.to_dict("records"):
        args = {"step": int(row["step"]), "prefill_tokens": int(row["prefill_tokens"]),
                "decode_seqs": int(row["decode_seqs"]), "num_seqs": int(row["num_seqs"]),
                "kv_usage": float(row["kv_usage"]), "preempted": int(row["preempted"])}
        floor = row.get("floor_s")
        if floor is not None and not pd.isna(floor):
            args["floor_ms"] = float(floor) * _MS_PER_S
        events.append({"ph": "X", "name": _step_name(args["prefill_tokens"],
                                                       args["decode_seqs"]),
                       "cat": "engine step", "ts": float(row["start_s"]) * US_PER_S,
                       "dur": max(float(row["end_s"] - row["start_s"]), 0.0) * US_PER_S,
                       "pid": pid_of[(row["_point"], row["_pool"])],
                       "tid": int(row["replica"]), "args": args})
    if requests is not None:
        events += _request_events(requests, pid_of)
    return events


def _request_events(requests, pid_of: dict) -> list[dict]:
    """Each request's lifetime and its wait for the first token, as nestable async
    slices in the process of its (decode) replica's pool."""
    requests = requests.assign(_point=_key(requests, "point", None))
    out = []
    for row in requests.to_dict("records"):
        point = row["_point"]
        point = None if point is None or pd.isna(point) else point
        pid = next((p for (pt, pool), p in pid_of.items()
                    if (pt is None or pd.isna(pt)) == (point is None)
                    and (point is None or pt == point) and pool in ("", "decode")), None)
        if pid is None:
            continue
        rid, tid = int(row["request_id"]), int(row["replica"])
        ident = f"{pid}.{rid}"
        args = {"request": rid, "replica": tid, "prompt_len": int(row["prompt_len"]),
                "output_len": int(row["output_len"]),
                "ttft_ms": _number(row["ttft_s"] * _MS_PER_S),
                "tpot_ms": _number(row["tpot_s"] * _MS_PER_S)}
        common = {"cat": "request", "id": ident, "pid": pid, "tid": tid}
        arrival = float(row["arrival_s"]) * US_PER_S
        out += [{"ph": "b", "name": f"request {rid}", "ts": arrival, "args": args, **common},
                {"ph": "b", "name": "to first token", "ts": arrival, **common},
                {"ph": "e", "name": "to first token",
                 "ts": float(row["first_token_s"]) * US_PER_S, **common},
                {"ph": "e", "name": f"request {rid}",
                 "ts": float(row["finish_s"]) * US_PER_S, **common}]
    return out
