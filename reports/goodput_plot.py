"""``goodput.png``: goodput of a long run against the checkpoint interval, per MTBF.

Input: the table of :func:`vcluster.timing.faults.impact.goodput_table` (columns ``mtbf_s,
interval_s, goodput_expected, goodput_simulated, daly_interval_s``). One line per MTBF
for the closed form, markers for the SimPy Monte Carlo, a dotted vertical line at Daly's
optimum interval. Matplotlib's Agg canvas (no pyplot, no global figure state).
"""

from __future__ import annotations

import io

__all__ = ["goodput_png"]

DPI = 100


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"


def goodput_png(table) -> bytes | None:
    """PNG bytes of the plot, or ``None`` for an empty table."""
    if table is None or len(table) == 0:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (mtbf, rows) in enumerate(table.groupby("mtbf_s", sort=True)):
        rows = rows.sort_values("interval_s")
        colour = f"C{i}"
        ax.plot(rows.interval_s, rows.goodput_expected, color=colour,
                label=f"MTBF {_hours(mtbf)}: closed form")
        if "goodput_simulated" in rows:
            ax.plot(rows.interval_s, rows.goodput_simulated, "o", color=colour, ms=4,
                    label="  SimPy Monte Carlo")
        if "daly_interval_s" in rows:
            ax.axvline(rows.daly_interval_s.iloc[0], color=colour, ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("compute between checkpoints, K·t (s); dotted: Daly's optimum")
    ax.set_ylabel("goodput (useful fraction of wall time)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower center")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()
