"""How figures read in summary.md and report.html: one formatting rule for both."""

from __future__ import annotations

import math
import numbers

import pandas as pd

__all__ = ["fmt", "formatted", "steps_overview", "shown_checks", "reading_notes", "MAX_ROWS",
           "MAX_CHECK_ROWS"]

MAX_ROWS = 64          # longer tables are shown in part; the CSV holds every row
MAX_CHECK_ROWS = 12    # more checks than this: the failed ones are listed, then a count


def fmt(value) -> str:
    """Numbers with 4 significant digits, booleans as yes/no, missing values as ``-``."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        v = float(value)
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v != 0 and v == int(v) and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(value)


def formatted(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (its first :data:`MAX_ROWS` rows) with every cell formatted by :func:`fmt`."""
    head = frame.head(MAX_ROWS)
    return pd.DataFrame({c: [fmt(v) for v in head[c]] for c in head.columns},
                        index=range(len(head)))


def steps_overview(steps: pd.DataFrame) -> pd.DataFrame:
    """Per source: number of steps, mean / min / max step time, last loss when known."""
    rows = []
    for source, group in steps.groupby("source", sort=False):
        times = pd.to_numeric(group["time_s"], errors="coerce")
        row = {"source": source, "steps": len(group), "mean_time_s": times.mean(),
               "min_time_s": times.min(), "max_time_s": times.max()}
        if "loss" in group:
            row["last_loss"] = group.sort_values("step")["loss"].iloc[-1]
        rows.append(row)
    return pd.DataFrame(rows)


def shown_checks(checks) -> tuple[list, str]:
    """The checks to list and a note on the others: all of them when there are at most
    :data:`MAX_CHECK_ROWS`; else every failed check (at least the first few), and the
    note says how many passed checks are not listed (results.json holds every check)."""
    checks = [dict(c) for c in checks]
    if len(checks) <= MAX_CHECK_ROWS:
        return checks, ""
    failed = [c for c in checks if not bool(c["passed"])]
    shown = failed or checks[:MAX_CHECK_ROWS]
    hidden = len(checks) - len(shown)
    return shown, (f"{hidden} more checks, all passed, are listed in results.json"
                   if hidden else "")


def reading_notes(summary: dict) -> list[str]:
    """How to read a run's figures, one line each: what *measured* and *predicted* are
    (and what exposed communication means on the emulator), and why the measured and
    predicted bytes differ — only the lines whose figures the summary holds."""
    notes = []
    if summary.get("measured_step_time_s") is not None:
        notes.append(
            f"Measured: the program run by {summary.get('devices', 'the')} emulated devices, "
            "processes on this machine's CPU cores. A device waiting for a core, or for a "
            "peer that waits for one, is waiting in a receive or collective, so its "
            "measured communication and exposed communication are mostly waiting, not "
            "network time; measured steps test the program, not the hardware.")
    if summary.get("predicted_step_time_s") is not None:
        notes.append(
            f"Predicted: the same program traced and replayed on the timing model of "
            f"{summary.get('hardware') or 'the hardware'}: its exposed communication is "
            "the time the model's devices wait on links.")
    if summary.get("traced_bytes_sent") is not None or (
            summary.get("measured_bytes_sent") is not None
            and summary.get("predicted_bytes_sent") is not None):
        notes.append(
            "Bytes: measured and traced count what the emulator's collective algorithms "
            "move (shm reads peers' buffers in place: its all_gather and reduce_scatter "
            "send nothing), and traffic_matches compares those two; predicted counts what "
            "the hardware's collectives put on its links, so it differs by design.")
    return notes
