"""Reports: plain run records turned into tables, plots, traces and summaries."""

from reports.record import RunRecord

__all__ = ["RunRecord"]
