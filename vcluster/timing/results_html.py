"""A :class:`~vcluster.timing.results.SimulationResult` as HTML, for notebooks: the
headline numbers of ``summary()`` and the per-rank time accounting (first
:data:`MAX_HTML_RANKS` traced ranks)."""

from __future__ import annotations

import html
import math

__all__ = ["simulation_html", "MAX_HTML_RANKS"]

MAX_HTML_RANKS = 32
_TABLE = ('<table class="vcluster-simulation" style="border-collapse:collapse;'
          'font-family:monospace;font-size:12px;display:inline-table;vertical-align:top;'
          'margin-right:16px">')
_CELL = 'style="border:1px solid #bbb;padding:2px 6px;text-align:right"'


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _row(cells, tag="td") -> str:
    return "<tr>" + "".join(f"<{tag} {_CELL}>{html.escape(_fmt(c))}</{tag}>"
                            for c in cells) + "</tr>"


def simulation_html(result) -> str:
    """Two tables side by side: headline numbers, then seconds per traced rank."""
    summary = [_row(("figure", "value"), "th")]
    summary += [_row((k, v)) for k, v in result.summary().items()]
    columns = ("rank", "compute_s", "comm_s", "exposed_comm_s", "bubble_s", "end_s")
    ranks = [_row(columns, "th")]
    ranks += [_row([getattr(s, c) for c in columns]) for s in result.stats[:MAX_HTML_RANKS]]
    more = len(result.stats) - MAX_HTML_RANKS
    note = f"<div>... {more} more traced ranks in .per_rank</div>" if more > 0 else ""
    return (f"<div><b>{html.escape(repr(result))}</b></div>"
            f"{_TABLE}{''.join(summary)}</table>{_TABLE}{''.join(ranks)}</table>{note}")
