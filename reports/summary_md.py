"""``summary.md``: the headline figures, checks and tables of a run as Markdown."""

from __future__ import annotations

import pandas as pd

from reports.format import MAX_ROWS, fmt, formatted, reading_notes, shown_checks, steps_overview
from reports.serving_summary import serving_sections
from reports.tables import record_tables

__all__ = ["markdown_table", "summary_markdown"]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of ``frame`` (formatted, first rows only)."""
    if len(frame.columns) == 0:
        return "_(no rows)_\n"
    if len(frame) == 0:
        return "_(no rows)_\n"
    shown = formatted(frame)
    lines = ["| " + " | ".join(_cell(c) for c in shown.columns) + " |",
             "|" + "---|" * len(shown.columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |"
              for row in shown.itertuples(index=False)]
    if len(frame) > MAX_ROWS:
        lines.append(f"\n_{len(frame) - MAX_ROWS} more rows in the CSV file._")
    return "\n".join(lines) + "\n"


def summary_markdown(record, files: dict) -> str:
    """The Markdown summary; ``files`` as in ``results.json`` (lists the report's files)."""
    if record.checks_status == "none":
        checks = "**none ran**"
    else:
        checks = (f"**{record.checks_status.upper()}** "
                  f"({sum(bool(c['passed']) for c in record.checks)}/{len(record.checks)})")
    description = str(record.scenario.get("description") or "").strip()
    out = [f"# {record.name}\n\n", *([f"{description}\n\n"] if description else []),
           f"mode: **{record.mode}** · hardware: **{record.hardware or '-'}** · "
           f"checks: {checks}\n",
           *([f"\n**Does not fit the device memory** (the figures assume memory the "
              f"devices do not have): {'; '.join(record.out_of_memory)}.\n"]
             if record.out_of_memory else []),
           *(f"\n_{note}_\n" for note in reading_notes(record.summary)),
           "\n## Headline figures\n\n"]
    if record.sweep is not None:
        out.append("_A sweep: these are the last point's figures; every point's are in "
                   "the Sweep table._\n\n")
    summary = pd.DataFrame({"figure": list(record.summary),
                            "value": [fmt(v) for v in record.summary.values()]})
    out.append(markdown_table(summary))
    if record.checks:
        shown, note = shown_checks(record.checks)
        out += ["\n## Checks\n\n", markdown_table(pd.DataFrame(shown))]
        if note:
            out.append(f"\n_{note}._\n")
    for title, frame in serving_sections(record):       # a served model's figures
        out += [f"\n## {title}\n\n", markdown_table(frame)]
    tables = record_tables(record)
    out += ["\n## Devices\n\n", markdown_table(tables["devices"]),
            "\n## Collectives\n\n", markdown_table(tables["collectives"]),
            "\n## Steps\n\n", markdown_table(steps_overview(tables["steps"]))]
    if "sweep" in tables:
        out += ["\n## Sweep\n\n", markdown_table(tables["sweep"])]
    listed = [*files.get("tables", {}).values(), *files.get("plots", {}).values(),
              *(files[k] for k in ("report_html", "trace") if k in files), "results.json"]
    out += ["\n## Files\n\n", "".join(f"* [{f}]({f})\n" for f in listed)]
    return "".join(out)
