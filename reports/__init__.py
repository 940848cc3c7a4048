"""Reports: plain run records turned into tables, plots, traces and summaries.

``write_report(record, out_dir, formats=None)`` writes a whole report directory
atomically (see :mod:`reports.write` and docs/reports.md); :mod:`reports.frames` turns
engine records (emulator events, a timing-model ``SimulationResult``) into the
:class:`RunRecord` tables.
"""

from reports.frames import (collectives_from_events, devices_from_events,
                            collectives_from_simulation, devices_from_simulation,
                            spans_from_events, spans_from_simulation)
from reports.record import RunRecord
from reports.write import FORMATS, write_report

__all__ = ["RunRecord", "write_report", "FORMATS", "spans_from_events", "devices_from_events",
           "collectives_from_events", "spans_from_simulation", "devices_from_simulation",
           "collectives_from_simulation"]
