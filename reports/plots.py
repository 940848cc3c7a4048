"""PNG plots of a report (matplotlib, Agg canvas; no pyplot, so no global figure state).

* ``timeline.png`` — per source, one row per device: compute spans in the upper half
  (pipeline actions F / B / I / W in their own colours, drawn over the ops they enclose;
  a zero-cost action marker of a replay gets a thin visible width), communication
  (collectives and point-to-point) in the lower half, waits as a thin grey band (from
  ``record.spans``);
* ``time_breakdown.png`` — per device, stacked compute, exposed communication and bubble
  seconds, one panel per source (from ``record.devices``);
* ``predicted_vs_measured.png`` — when both sources are present: median step time and
  summed time per (collective, axis), measured beside predicted, log scale (they usually
  differ by orders of magnitude: an emulator on one CPU versus a model of a GPU cluster);
* ``latency_cdf.png``, ``kv_usage.png``, ``throughput_vs_rate.png`` — a served model's
  (:mod:`reports.serving_plots`);
* ``sweep.png`` — when the run was a sweep: the numeric headline figures that vary over
  the points (times, fractions and ratios first; at most six) against the first varied
  key, one line per value of the other varied keys.

In a sweep the tables carry a ``point`` column; the per-device plots show the last point.

Every function returns PNG bytes, or ``None`` when the record has nothing to draw.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from reports.serving_plots import SERVING_PLOT_NAMES, SERVING_PLOTS
from reports.tables import sweep_keys

__all__ = ["PLOT_NAMES", "timeline_png", "time_breakdown_png", "predicted_vs_measured_png",
           "sweep_png", "record_plots"]

PLOT_NAMES = ("timeline", "time_breakdown", "predicted_vs_measured", "sweep", "goodput",
              *SERVING_PLOT_NAMES)     # a served model's: reports/serving_plots.py
DPI = 100
MAX_SWEEP_PANELS = 6
MIN_ACTION_WIDTH = 0.002    # share of the time axis: the least width a pipeline action gets
PIPELINE_ACTIONS = ("F", "B", "I", "W")
_COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd18f", "W": "#dd8452",
            "compute": "#8c8c8c", "comm": "#c44e52", "p2p": "#8172b3", "wait": "#dddddd"}
_SEGMENTS = (("compute_s", "compute", "#4c72b0"), ("exposed_comm_s", "exposed comm", "#c44e52"),
             ("bubble_s", "bubble", "#cccccc"))


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


def _sources(frame: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(frame["source"])) if len(frame) else []


def _colour(stream: str, name: str) -> str:
    if stream == "compute":
        return _COLOURS.get(name, _COLOURS["compute"])
    return _COLOURS.get(stream, _COLOURS["comm"])


def _last_point(frame: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """A sweep's tables carry a ``point`` column: its per-device plots show the last point."""
    if "point" not in frame.columns or not len(frame):
        return frame, ""
    last = frame["point"].max()
    return frame[frame["point"] == last], f" (sweep point {last})"


def _draw_timeline(ax, spans: pd.DataFrame) -> None:
    ranks = sorted({int(r) for r in spans["rank"]})
    lane = {"compute": (0.05, 0.45), "comm": (0.5, 0.4), "p2p": (0.5, 0.4),
            "wait": (0.42, 0.16)}
    t_max = float(spans["end_s"].max()) if len(spans) else 0.0
    min_width = t_max * MIN_ACTION_WIDTH
    action = (spans["stream"] == "compute") & spans["name"].isin(PIPELINE_ACTIONS)
    colour = [_colour(st, nm) for st, nm in zip(spans["stream"], spans["name"])]
    frame = spans.assign(_action=action, _colour=colour)
    for (rank, stream, is_action, face), group in frame.groupby(
            ["rank", "stream", "_action", "_colour"], sort=False):
        y0, height = lane.get(stream, (0.5, 0.4))
        widths = (group["end_s"] - group["start_s"]).to_numpy(float)
        if is_action:       # over the ops it encloses; a zero-cost marker stays visible
            widths = np.maximum(widths, min_width)
        ax.broken_barh(list(zip(group["start_s"], widths)), (ranks.index(int(rank)) + y0, height),
                       facecolors=face, edgecolor="none",
                       zorder=1 if stream == "wait" else 3 if is_action else 2)
    ax.set_yticks([i + 0.5 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks), 0)
    ax.set_xlabel("time (s)")


def timeline_png(record) -> bytes | None:
    """Per source, a row per device: compute above, communication below."""
    spans, point = _last_point(record.spans)
    sources = _sources(spans)
    if not sources:
        return None
    n_ranks = max(spans.groupby("source")["rank"].nunique())
    fig = Figure(figsize=(11, 1.2 + 0.45 * n_ranks * len(sources)))
    axes = fig.subplots(len(sources), 1, squeeze=False)[:, 0]
    for ax, source in zip(axes, sources):
        _draw_timeline(ax, spans[spans["source"] == source])
        ax.set_title(f"{source} timeline{point}")
    present = [(k, c) for k, c in _COLOURS.items()
               if (k in set(spans["name"]) and k in PIPELINE_ACTIONS)
               or k in set(spans["stream"])]
    handles = [Patch(facecolor=c) for _, c in present]
    fig.legend(handles, [k for k, _ in present], loc="upper right", ncols=len(present))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _png(fig)


def time_breakdown_png(record) -> bytes | None:
    """Stacked compute / exposed communication / bubble seconds per device."""
    devices, point = _last_point(record.devices)
    sources = _sources(devices)
    if not sources:
        return None
    fig = Figure(figsize=(max(5.0, 0.5 * devices["rank"].nunique() + 3), 3.2 * len(sources)))
    axes = fig.subplots(len(sources), 1, squeeze=False)[:, 0]
    for ax, source in zip(axes, sources):
        rows = devices[devices["source"] == source].sort_values("rank")
        x = np.arange(len(rows))
        bottom = np.zeros(len(rows))
        for column, label, colour in _SEGMENTS:
            values = pd.to_numeric(rows[column], errors="coerce").fillna(0.0).to_numpy(float)
            ax.bar(x, values, bottom=bottom, color=colour, label=label)
            bottom += values
        ax.set_xticks(x, [str(int(r)) for r in rows["rank"]])
        ax.set_xlabel("rank")
        ax.set_ylabel("seconds")
        ax.set_title(f"{source}: compute vs communication vs bubble{point}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    return _png(fig)


def predicted_vs_measured_png(record) -> bytes | None:
    """Measured beside predicted: median step time (as ``measured_step_time_s``) and
    per-collective time (log scale); the bars of :func:`comparison_rows`."""
    rows = comparison_rows(record)
    return _predicted_vs_measured_figure(record, rows) if rows else None


def comparison_rows(record) -> list[tuple[str, float, float]]:
    """(label, measured, predicted) of each bar of ``predicted_vs_measured.png``, every
    one in seconds per step: the median step time of each source (the statistic of
    ``measured_step_time_s``), then the time per step of each (collective, axis) (its
    summed time over the steps its rows cover, ``steps_covered``), else the mean compute
    and communication per device and step; rows without both positive figures are
    dropped."""
    both = {"measured", "predicted"}
    rows: list[tuple[str, float, float]] = []
    steps = _last_point(record.steps)[0]
    if both <= set(steps["source"]):
        median = steps.groupby("source")["time_s"].median()   # the headline's statistic
        rows.append(("step (median)", float(median["measured"]), float(median["predicted"])))
    coll = _last_point(record.collectives)[0]
    if both <= set(coll["source"]):
        covered = coll["steps_covered"] if "steps_covered" in coll else 1
        table = (coll.assign(axis=coll["axis"].fillna("-"), per_step=coll["time_s"] / covered)
                 .groupby(["collective", "axis", "source"])["per_step"].sum()
                 .unstack("source"))
        for (collective, axis), row in table.iterrows():
            if not (pd.isna(row.get("measured")) or pd.isna(row.get("predicted"))):
                rows.append((f"{collective} [{axis}]", float(row["measured"]),
                             float(row["predicted"])))
    devices = _last_point(record.devices)[0]
    if not rows and both <= set(devices["source"]):
        covered = devices["steps_covered"] if "steps_covered" in devices else 1
        for column in ("compute_s", "comm_s"):
            mean = devices.assign(per_step=devices[column] / covered).groupby(
                "source")["per_step"].mean()
            rows.append((f"{column} (mean)", float(mean["measured"]),
                         float(mean["predicted"])))
    return [r for r in rows if r[1] > 0 and r[2] > 0 and math.isfinite(r[1] + r[2])]


def _predicted_vs_measured_figure(record, rows) -> bytes:
    point = _last_point(record.steps)[1]
    fig = Figure(figsize=(max(6.0, 1.1 * len(rows) + 2), 4))
    ax = fig.subplots()
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r[1] for r in rows], 0.4, label="measured (emulator)", color="#4c72b0")
    ax.bar(x + 0.2, [r[2] for r in rows], 0.4,
           label=f"predicted ({record.hardware or 'model'})", color="#dd8452")
    ax.set_yscale("log")
    ax.set_xticks(x, [r[0] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("seconds per step (log)")
    ax.set_title(f"predicted vs measured{point}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _png(fig)


def _sweep_figures(sweep: pd.DataFrame, keys: list[str]) -> list[str]:
    """Numeric figures that vary across the points; times, fractions, ratios first."""
    numeric = [c for c in sweep.columns if c not in keys and c != "point"
               and pd.api.types.is_numeric_dtype(sweep[c])
               and not pd.api.types.is_bool_dtype(sweep[c])
               and sweep[c].nunique(dropna=True) > 1]
    timing = [c for c in numeric if str(c).endswith(("_s", "fraction", "ratio"))]
    return (timing + [c for c in numeric if c not in timing])[:MAX_SWEEP_PANELS]


def _category(value) -> str:
    """A sweep value as a bar's label: a mapping as ``dp=8 pp=1 tp=8``."""
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def sweep_png(record) -> bytes | None:
    """Each numeric headline figure of the sweep against the first varied key: a line
    over a numeric key, labelled bars over configurations or names."""
    fig = sweep_figure(record)
    return None if fig is None else _png(fig)


def sweep_figure(record) -> Figure | None:
    """The figure of :func:`sweep_png` (None when there is nothing to draw)."""
    sweep = record.sweep
    if sweep is None or len(sweep) == 0:
        return None
    keys = sweep_keys(record)
    figures = _sweep_figures(sweep, keys)
    if not figures:
        return None
    x_key = keys[0] if keys else None
    x = sweep[x_key] if x_key is not None else pd.Series(range(len(sweep)))
    numeric_x = pd.api.types.is_numeric_dtype(x)
    others = keys[1:]
    groups = sweep.groupby(others, dropna=False, sort=False) if others else [((), sweep)]
    cols = min(3, len(figures))
    n_rows = math.ceil(len(figures) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * n_rows))
    axes = fig.subplots(n_rows, cols, squeeze=False).ravel()
    groups = list(groups)
    categories = [] if numeric_x else list(dict.fromkeys(_category(v) for v in x))
    for ax, figure in zip(axes, figures):
        for g, (label, rows) in enumerate(groups):
            xs = rows[x_key] if x_key is not None else rows.index
            name = ", ".join(f"{k}={v}" for k, v in zip(others, np.atleast_1d(label)))
            if numeric_x:
                ax.plot(xs, rows[figure], marker="o", label=name or None)
            else:                      # configurations, names: labelled bars, not a line
                width = 0.8 / len(groups)
                at = [categories.index(_category(v)) - 0.4 + width * (g + 0.5) for v in xs]
                ax.bar(at, rows[figure], width, label=name or None)
        if not numeric_x:
            ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right",
                          fontsize="small")
        ax.set_xlabel(x_key or "point")
        ax.set_title(figure)
        if others:
            ax.legend(fontsize="small")
    for ax in axes[len(figures):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def _goodput_png(record) -> bytes | None:
    from reports.goodput_plot import goodput_png
    return goodput_png(getattr(record, "goodput", None))


_MAKERS = {"timeline": timeline_png, "time_breakdown": time_breakdown_png,
           "predicted_vs_measured": predicted_vs_measured_png, "sweep": sweep_png,
           "goodput": _goodput_png, **SERVING_PLOTS}


def record_plots(record) -> dict[str, bytes]:
    """``{plot name: PNG bytes}`` for every plot this record has something to draw in."""
    plots = {}
    for name in PLOT_NAMES:
        png = _MAKERS[name](record)
        if png is not None:
            plots[name] = png
    return plots
