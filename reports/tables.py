"""CSV tables of a report: devices.csv, collectives.csv, steps.csv, sweep.csv (and a served
model's requests.csv, engine_steps.csv).

Each is the :class:`~reports.RunRecord` DataFrame as is (its columns are documented in
``reports/record.py``); an empty table is written with its header only; ``sweep.csv``
only when the run was a sweep.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

__all__ = ["TABLE_NAMES", "record_tables", "write_tables", "sweep_keys"]

TABLE_NAMES = ("devices", "collectives", "steps", "sweep", "goodput", "requests",
               "engine_steps")        # the last two: a served model's (RunRecord)


def record_tables(record) -> dict[str, pd.DataFrame]:
    """``{table name: DataFrame}`` of the tables this record has (sweep, goodput, requests,
    engine_steps: when set)."""
    tables = {name: getattr(record, name, None) for name in TABLE_NAMES}
    return {name: t for name, t in tables.items() if t is not None}


def write_tables(record, directory: Path) -> dict[str, str]:
    """Write ``<name>.csv`` for each table into ``directory``; return ``{name: file name}``."""
    files = {}
    for name, frame in record_tables(record).items():
        file_name = f"{name}.csv"
        frame.to_csv(Path(directory) / file_name, index=False)
        files[name] = file_name
    return files


def sweep_keys(record) -> list[str]:
    """The varied key paths of a sweep: ``record.sweep_keys`` when the record has them,
    else the sweep table's dotted column names (``parallel.tp``); ``[]`` without a sweep."""
    given = list(getattr(record, "sweep_keys", ()) or ())
    if given or record.sweep is None:
        return given
    return [c for c in record.sweep.columns if "." in str(c)]
