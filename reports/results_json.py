"""``results.json``: every figure of the report as strict JSON (keys in docs/reports.md).

Top-level keys: ``name, mode, hardware, passed, summary, checks, scenario, devices,
collectives, steps, sweep, sweep_keys, goodput, files``. The tables appear as lists of row
objects (``sweep`` is ``null`` without a sweep, ``goodput`` without
``checkpoint.mtbf_s``); ``files`` maps each written file's role to its name in the
report directory (``{"tables": {"devices": "devices.csv", ...}, "plots":
{"timeline": "timeline.png", ...}, "summary_md", "report_html", "trace"}``; a file not
written is absent). Strict JSON has no NaN or infinity: such numbers are written as
``null``; numpy scalars become plain numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from reports.tables import record_tables, sweep_keys

__all__ = ["json_safe", "results_dict", "RESULT_KEYS"]

RESULT_KEYS = ("name", "mode", "hardware", "passed", "checks_status", "summary", "checks",
               "scenario", "devices", "collectives", "steps", "sweep", "sweep_keys", "goodput", "files")


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON data: non-finite floats and missing values become ``None``."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset, np.ndarray)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, str):
        return value
    return str(value)


def _rows(frame: pd.DataFrame) -> list[dict]:
    return json_safe(frame.to_dict("records"))


def results_dict(record, files: dict) -> dict:
    """The ``results.json`` object of ``record``; ``files`` as described above."""
    tables = record_tables(record)
    return {
        "name": record.name,
        "mode": record.mode,
        "hardware": record.hardware,
        "passed": record.passed,
        "checks_status": record.checks_status,
        "summary": json_safe(dict(record.summary)),
        "checks": json_safe([dict(c) for c in record.checks]),
        "scenario": json_safe(dict(record.scenario)),
        "devices": _rows(tables["devices"]),
        "collectives": _rows(tables["collectives"]),
        "steps": _rows(tables["steps"]),
        "sweep": _rows(tables["sweep"]) if "sweep" in tables else None,
        "sweep_keys": sweep_keys(record),
        "goodput": _rows(tables["goodput"]) if "goodput" in tables else None,
        "files": json_safe(files),
    }
