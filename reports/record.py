"""The plain record a run hands to the report writers.

``reports/`` never starts a process and never imports the engines' run machinery: the
front door (``vcluster run``) runs a scenario and fills one :class:`RunRecord`; the
writers in this package turn it into files (``summary.md``, ``report.html``,
``results.json``, CSV tables, PNG plots, ``trace.json``).

Tables are pandas DataFrames with the columns listed below (a writer tolerates extra
columns and empty tables). Times are seconds, sizes bytes, unless a column's name says
otherwise. ``source`` is ``"measured"`` (the emulator's wall clock) or ``"predicted"``
(the SimPy replay on ``hardware``).

* ``devices`` — one row per (source, rank): ``source, rank, coords, compute_s, comm_s,
  exposed_comm_s, bubble_s, bytes_sent, bytes_received, messages_sent``.
* ``collectives`` — one row per (source, collective, group, algorithm): ``source,
  collective, axis, group, algorithm, calls, bytes, time_s``.
* ``steps`` — one row per (source, step): ``source, step, time_s`` (and ``loss`` for
  training workloads).
* ``sweep`` — one row per sweep point: the varied key paths as columns plus the point's
  headline figures; ``None`` when the scenario has no sweep.
* ``goodput`` — with ``checkpoint.mtbf_s`` (docs/faults.md): one row per (MTBF,
  checkpoint interval), the columns of :func:`vcluster.timing.faults.impact.goodput_table`;
  ``None`` otherwise.
* ``requests`` / ``engine_steps`` — a served model (scenario kind ``inference``): one row
  per request, one per engine step, each tagged ``source`` ``emulated`` (counted in engine
  steps) or ``simulated`` (seconds); the columns in docs/scenario.md ("kind: inference")
  (:mod:`vcluster.scenario.serving_records`). ``None`` for every other run.
* ``spans`` — one row per timeline interval: ``source, rank, stream`` (``compute`` |
  ``comm`` | ``p2p`` | ``wait``), ``name`` (op or collective name; pipeline actions as
  ``F``/``B``/``W`` with ``stage`` and ``microbatch`` columns where known), ``start_s,
  end_s``. Starts are relative to the run's first event of that source.

``summary`` is a flat ``{name: number | str | bool | None}`` of the headline figures
(the same names appear in ``results.json`` under ``"summary"`` and in ``summary.md``);
``checks`` lists ``{"name", "passed", "max_abs_error", "tolerance"}`` for ``check: true``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import pandas as pd

from reports import tables

__all__ = ["RunRecord", "SPAN_COLUMNS", "DEVICE_COLUMNS", "COLLECTIVE_COLUMNS",
           "STEP_COLUMNS"]

DEVICE_COLUMNS = ("source", "rank", "coords", "compute_s", "comm_s", "exposed_comm_s",
                  "bubble_s", "bytes_sent", "bytes_received", "messages_sent")
COLLECTIVE_COLUMNS = ("source", "collective", "axis", "group", "algorithm", "calls",
                      "bytes", "time_s")
STEP_COLUMNS = ("source", "step", "time_s")
SPAN_COLUMNS = ("source", "rank", "stream", "name", "start_s", "end_s")


def _empty(columns) -> pd.DataFrame:
    return pd.DataFrame(columns=list(columns))


@dataclass(frozen=True, repr=False)
class RunRecord:
    """Everything one scenario run (or sweep) produced, as plain data.

    ``scenario`` is the validated scenario as a plain mapping (after ``--set``), ``name``
    its name, ``mode`` one of ``emulate`` | ``simulate`` | ``both``, ``hardware`` the
    hardware preset or file name the prediction used (``None`` without simulation).
    """

    name: str
    mode: str
    scenario: Mapping[str, Any]
    summary: Mapping[str, Any]
    hardware: str | None = None
    checks: tuple[Mapping[str, Any], ...] = ()
    devices: pd.DataFrame = field(default_factory=lambda: _empty(DEVICE_COLUMNS))
    collectives: pd.DataFrame = field(default_factory=lambda: _empty(COLLECTIVE_COLUMNS))
    steps: pd.DataFrame = field(default_factory=lambda: _empty(STEP_COLUMNS))
    spans: pd.DataFrame = field(default_factory=lambda: _empty(SPAN_COLUMNS))
    sweep: pd.DataFrame | None = None
    goodput: pd.DataFrame | None = None
    sweep_keys: tuple[str, ...] = ()      # the varied key paths, in the sweep's order
    requests: pd.DataFrame | None = None      # a served model's requests (see above)
    engine_steps: pd.DataFrame | None = None  # a served model's engine steps (see above)

    @property
    def passed(self) -> bool:
        """True when every check passed (and when there were none)."""
        return all(bool(c["passed"]) for c in self.checks)

    @property
    def checks_status(self) -> str:
        """``"passed"``, ``"failed"``, or ``"none"`` when no check ran — never shown as
        passed (a simulate-only run checks nothing)."""
        if not self.checks:
            return "none"
        return "passed" if self.passed else "failed"

    @property
    def out_of_memory(self) -> list[str]:
        """One line per point whose prediction does not fit the device memory
        (``fits`` false: the summary's, or each sweep point's), e.g.
        ``"parallel.tp=1: 1690.6 GB per device > 76.0 GB usable"``; [] when all fit or
        nothing was said."""
        def line(row, label):
            return (f"{label}{float(row['predicted_peak_memory_gb']):.1f} GB per device > "
                    f"{float(row['memory_limit_gb']):.1f} GB usable")
        if self.sweep is not None and "fits" in self.sweep.columns:
            keys = [k for k in tables.sweep_keys(self) if k in self.sweep.columns]
            return [line(r, ", ".join(f"{k}={r[k]}" for k in keys) + ": " if keys else "")
                    for _, r in self.sweep.iterrows()
                    if not pd.isna(r["fits"]) and not bool(r["fits"])]
        if self.summary.get("fits") is False:
            return [line(self.summary, "")]
        return []

    def _repr_html_(self) -> str:
        """Headline figures, checks and the per-device table for notebooks (no plots:
        ``write_report`` draws those)."""
        from reports.html import record_html
        return record_html(self)

    def __repr__(self) -> str:
        checks = ("none ran" if not self.checks else
                  f"{sum(bool(c['passed']) for c in self.checks)}/{len(self.checks)} passed")
        sweep = "" if self.sweep is None else f", sweep={len(self.sweep)} points"
        return (f"RunRecord(name={self.name!r}, mode={self.mode!r}, "
                f"hardware={self.hardware!r}, checks={checks}, "
                f"devices={len(self.devices)} rows, spans={len(self.spans)} rows{sweep})")
