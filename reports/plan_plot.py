"""``plan_png``: the planner's candidates as step time against peak memory per device.

One point per candidate that fits (the DataFrame of
:func:`vcluster.planner.search.plan_gpt`), coloured by schedule; replayed candidates
are drawn as filled circles with a black edge, screened ones as small crosses; the best
is annotated with its split. The device memory, when given, is a vertical line.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plan_png"]

DPI = 100
_COLOURS = {"1f1b": "#4c72b0", "interleaved_1f1b": "#55a868", "zero_bubble": "#dd8452",
            "gpipe": "#8172b3"}


def plan_png(df, title: str = "", hbm_gb: float | None = None) -> bytes | None:
    """PNG bytes of the plot (``None`` when ``df`` is empty)."""
    if not len(df):
        return None
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, group in df.groupby("schedule", sort=True):
        colour = _COLOURS.get(name, "#8c8c8c")
        screened = group[~group["replayed"]]
        replayed = group[group["replayed"]]
        ax.scatter(screened["peak_memory_gb"], screened["step_time_s"], marker="x", s=14,
                   color=colour, alpha=0.6, label=f"{name} (screened)")
        if len(replayed):
            ax.scatter(replayed["peak_memory_gb"], replayed["step_time_s"], marker="o", s=40,
                       color=colour, edgecolors="black", label=f"{name} (replayed)")
    best = df.iloc[0]
    ax.annotate(f"best: tp={best['tp']} pp={best['pp']} dp={best['dp']} b={best['micro_batch']}"
                f" {best['schedule']} v={best['virtual_stages']}",
                (best["peak_memory_gb"], best["step_time_s"]), xytext=(10, 10),
                textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "->"})
    if hbm_gb:
        ax.axvline(hbm_gb, color="#c44e52", linestyle="--", linewidth=1, label="device memory")
    ax.set_xlabel("peak memory per device (GB)")
    ax.set_ylabel("step time (s)")
    ax.set_title(title or "candidate configurations")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()
