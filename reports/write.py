"""``write_report``: a whole report directory, written atomically.

The files go into a fresh temporary directory beside ``out_dir`` (``.<name>.tmp-*``);
only when every file is written is it renamed to ``out_dir``. An exception on the way
removes the temporary directory and leaves an existing ``out_dir`` untouched. An existing
``out_dir`` is first renamed aside (``.<name>.old-*``), the new one renamed into place,
then the old one removed (if the second rename fails, the old one is put back).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from reports.chrome_trace import write_chrome_trace
from reports.html import report_html
from reports.results_json import results_dict
from reports.summary_md import summary_markdown
from reports.tables import write_tables

__all__ = ["write_report", "FORMATS"]

FORMATS = ("md", "html", "json", "csv", "png", "trace")
DIR_MODE = 0o755       # mkdtemp makes 0700 directories; a report is meant to be shared


def _formats(formats) -> frozenset[str]:
    if formats is None:
        return frozenset(FORMATS)
    if isinstance(formats, str):
        formats = [f.strip() for f in formats.split(",") if f.strip()]
    try:
        chosen = [str(f) for f in formats]
    except TypeError:
        raise TypeError(f"write_report: formats must be a list of names from {list(FORMATS)} "
                        f"(or None for all), got {formats!r}") from None
    bad = [f for f in chosen if f not in FORMATS]
    if bad:
        raise ValueError(f"write_report: formats has unknown {bad}; allowed: {list(FORMATS)}")
    return frozenset(chosen) | {"json"}


def _write_files(record, directory: Path, formats: frozenset[str]) -> dict:
    files: dict = {}
    if "csv" in formats:
        files["tables"] = write_tables(record, directory)
    plots = {}
    if formats & {"png", "html"}:
        from reports.plots import record_plots      # matplotlib: only when plots are drawn
        plots = record_plots(record)
    if "png" in formats:
        files["plots"] = {}
        for name, png in plots.items():
            (directory / f"{name}.png").write_bytes(png)
            files["plots"][name] = f"{name}.png"
    if "trace" in formats:
        files["trace"] = write_chrome_trace(record, directory)
    if "md" in formats:
        files["summary_md"] = "summary.md"
    if "html" in formats:
        files["report_html"] = "report.html"
    if "md" in formats:
        (directory / "summary.md").write_text(summary_markdown(record, files))
    if "html" in formats:
        (directory / "report.html").write_text(report_html(record, plots, files))
    results = results_dict(record, files)
    (directory / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return files


def _swap_into_place(new: Path, out: Path) -> None:
    if not out.exists():
        os.rename(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_report(record, out_dir, formats=None) -> Path:
    """Write the report of ``record`` (a :class:`~reports.RunRecord`) into ``out_dir``.

    ``formats``: a subset of :data:`FORMATS` (``md`` summary.md, ``html`` report.html,
    ``json`` results.json, ``csv`` tables, ``png`` plots, ``trace`` trace.json), default
    all; results.json is always written. Returns ``out_dir`` as a :class:`~pathlib.Path`.
    """
    chosen = _formats(formats)
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"write_report: out_dir {str(out_dir)!r} exists and is not a "
                              f"directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, DIR_MODE)
        _write_files(record, tmp, chosen)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir)
