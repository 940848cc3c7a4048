"""``report.html``: one self-contained page (inline CSS, plots as base64 PNG, no scripts,
no network) with the headline figures, checks, plots and tables of a run."""

from __future__ import annotations

import base64
from html import escape

import pandas as pd

from reports.format import MAX_ROWS, fmt, formatted, reading_notes, shown_checks, steps_overview
from reports.serving_plots import SERVING_PLOT_TITLES
from reports.serving_summary import serving_sections
from reports.tables import record_tables

__all__ = ["html_table", "report_html", "record_html", "PLOT_TITLES"]

PLOT_TITLES = {"timeline": "Timeline per device (F/B/W compute, communication)",
               "time_breakdown": "Compute vs communication vs bubble per device",
               "predicted_vs_measured": "Predicted vs measured",
               "sweep": "Sweep",
               "goodput": "Goodput under failures vs checkpoint interval",
               **SERVING_PLOT_TITLES}

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;
background:#fff}
h1{margin:0 0 4px}h2{border-bottom:2px solid #4c72b0;padding-bottom:2px;margin-top:28px}
.meta{color:#555;margin-bottom:16px}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}
.pass{background:#2e7d32}.fail{background:#c62828}.none{background:#757575}
.oom{color:#c62828}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #cfd8e3;border-radius:8px;padding:8px 12px;min-width:150px;
background:#f3f6fb}
.card .k{font-size:12px;color:#555}.card .v{font-size:20px;font-weight:600;color:#1f3b63}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:right}
th{background:#e8eef7}tr:nth-child(even) td{background:#f7f9fc}
td.ok{background:#c8e6c9 !important}td.bad{background:#ffcdd2 !important}
img{max-width:100%;border:1px solid #ddd;margin:6px 0}
.note{color:#666;font-size:12px}.wide{overflow-x:auto;max-width:100%}
"""


def html_table(frame: pd.DataFrame) -> str:
    """An HTML table of ``frame`` (formatted, escaped, first rows only)."""
    if len(frame) == 0:
        return '<p class="note">(no rows)</p>'
    table = ('<div class="wide">' + formatted(frame).to_html(index=False, border=0, escape=True)
             + "</div>")
    if len(frame) > MAX_ROWS:
        table += f'<p class="note">{len(frame) - MAX_ROWS} more rows in the CSV file.</p>'
    return table


def _cards(summary) -> str:
    cards = "".join(f'<div class="card"><div class="k">{escape(str(k))}</div>'
                    f'<div class="v">{escape(fmt(v))}</div></div>' for k, v in summary.items())
    return f'<div class="cards">{cards}</div>' if cards else '<p class="note">(none)</p>'


def _checks(checks) -> str:
    shown, note = shown_checks(checks)
    rows = []
    for c in shown:
        ok = bool(c["passed"])
        rows.append(f'<tr><td style="text-align:left">{escape(str(c["name"]))}</td>'
                    f'<td class="{"ok" if ok else "bad"}">{"pass" if ok else "FAIL"}</td>'
                    f'<td>{escape(fmt(c.get("max_abs_error")))}</td>'
                    f'<td>{escape(fmt(c.get("tolerance")))}</td></tr>')
    note = f'<p class="note">{escape(note)}</p>' if note else ""
    return ("<table><tr><th>check</th><th>result</th><th>max abs error</th>"
            f"<th>tolerance</th></tr>{''.join(rows)}</table>{note}")


def _sweep_note(record) -> str:
    if record.sweep is None:
        return ""
    return ('<p class="note">A sweep: these are the last point\'s figures; every point\'s '
            'are in the Sweep table.</p>')


def _head(record) -> list[str]:
    badge, text = {"passed": ("pass", "checks passed"), "failed": ("fail", "checks FAILED"),
                   "none": ("none", "no checks ran")}[record.checks_status]
    description = str(record.scenario.get("description") or "").strip()
    parts = [f"<h1>{escape(record.name)}</h1>",
             *([f'<p class="description">{escape(description)}</p>'] if description else []),
             f'<div class="meta">mode <b>{escape(record.mode)}</b> · hardware '
             f'<b>{escape(record.hardware or "-")}</b> · '
             f'<span class="badge {badge}">{text}</span></div>',
             *([f'<p class="oom"><b>Does not fit the device memory</b> (the figures assume '
                f'memory the devices do not have): '
                f'{escape("; ".join(record.out_of_memory))}.</p>']
               if record.out_of_memory else []),
             *(f'<p class="note">{escape(note)}</p>' for note in reading_notes(record.summary)),
             "<h2>Headline figures</h2>", _sweep_note(record), _cards(record.summary)]
    if record.checks:
        parts += ["<h2>Checks</h2>", _checks(record.checks)]
    return parts


def record_html(record) -> str:
    """A compact view of a record for notebooks: headline figures, checks, devices."""
    parts = _head(record) + ["<h2>Devices</h2>", html_table(record.devices)]
    return (f'<div class="vcluster-record"><style>{_scoped_css()}</style>'
            f'{"".join(parts)}</div>')


def _scoped_css() -> str:
    """The page's rules, each prefixed by ``.vcluster-record`` so a notebook's own
    styles are left alone."""
    rules = [r for r in _CSS.replace("\n", "").split("}") if r.strip()]
    return "".join(",".join(f".vcluster-record {sel.strip()}" if sel.strip() != "body"
                            else ".vcluster-record" for sel in rule.split("{")[0].split(","))
                   + "{" + rule.split("{", 1)[1] + "}" for rule in rules)


def report_html(record, plots: dict[str, bytes], files: dict) -> str:
    """The page; ``plots`` maps plot names to PNG bytes (embedded), ``files`` as in
    ``results.json`` (linked)."""
    parts = _head(record)
    for title, frame in serving_sections(record):       # a served model's figures
        parts += [f"<h2>{escape(title)}</h2>", html_table(frame)]
    for name, png in plots.items():
        data = base64.b64encode(png).decode("ascii")
        parts += [f"<h2>{escape(PLOT_TITLES.get(name, name))}</h2>",
                  f'<img alt="{escape(name)}" src="data:image/png;base64,{data}">']
    tables = record_tables(record)
    parts += ["<h2>Devices</h2>", html_table(tables["devices"]),
              "<h2>Collectives</h2>", html_table(tables["collectives"]),
              "<h2>Steps</h2>", html_table(steps_overview(tables["steps"]))]
    if "sweep" in tables:
        parts += ["<h2>Sweep</h2>", html_table(tables["sweep"])]
    listed = [*files.get("tables", {}).values(),
              *(files[k] for k in ("summary_md", "trace") if k in files), "results.json"]
    parts += ["<h2>Files</h2><ul>",
              "".join(f'<li><a href="{escape(f)}">{escape(f)}</a></li>' for f in listed),
              "</ul>"]
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(record.name)} - vcluster report</title><style>{_CSS}</style>"
            f"</head><body>\n{body}\n</body></html>\n")
