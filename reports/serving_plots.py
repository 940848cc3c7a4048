"""PNG plots of a served model (scenario kind ``inference``; matplotlib's Agg canvas, no
pyplot, so no global figure state):

* ``latency_cdf.png`` — the empirical CDFs of the simulated requests' TTFT, TPOT and
  E2EL (ms): F(x) = #{requests with latency <= x} / #requests, a step of 1/n at
  each request; one line per sweep point (log axis when they span a decade); the dotted
  line marks P90 (vLLM's percentiles interpolate between these steps). TPOT leaves out
  requests of one output token, as vLLM does;
* ``kv_usage.png`` — the KV-cache usage (used / usable blocks, %) after each engine step's
  allocation: the simulation's over time, one line per replica (each step drawn from its
  start to its end), and the emulation's by engine step; the last sweep point;
* ``throughput_vs_rate.png`` — a sweep over ``workload.rate``: the throughput served
  (requests/s beside the offered rate, y = x; output tokens/s) and the P90 TTFT (log
  axis) and TPOT against the offered rate (an infinite rate left out), one line per
  value of the other varied keys. Below the knee
  the requests served per second follow the offered rate and the latencies stay flat;
  past it the throughput saturates and the queue, so TTFT, grows with every request.

Every function takes a :class:`~reports.RunRecord` (its ``requests``, ``engine_steps``,
``sweep``) and returns PNG bytes, or ``None`` when the record has nothing to draw.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd

from reports.tables import sweep_keys

__all__ = ["SERVING_PLOT_NAMES", "SERVING_PLOT_TITLES", "SERVING_PLOTS", "latency_cdf_png",
           "kv_usage_png", "throughput_vs_rate_png", "ecdf"]

DPI = 100
RATE_KEY = "workload.rate"
MAX_CDF_LINES = 8          # sweep points drawn in the CDFs (the first ones, in order)
P90 = 0.9
LOG_SPREAD = 10.0          # a CDF's latency axis is logarithmic when max >= 10 x min
_MS_PER_S = 1000.0
_LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT (excl. 1st token)"), ("e2el_s", "E2EL"))
_RATE_PANELS = (("request_throughput", "requests served (req/s)", False),
                ("output_throughput", "output throughput (tok/s)", False),
                ("p90_ttft_ms", "P90 TTFT (ms)", True), ("p90_tpot_ms", "P90 TPOT (ms)", False))

SERVING_PLOT_NAMES = ("latency_cdf", "kv_usage", "throughput_vs_rate")
SERVING_PLOT_TITLES = {"latency_cdf": "Latency CDFs (TTFT, TPOT, E2EL), simulated",
                       "kv_usage": "KV-cache usage over time, per replica",
                       "throughput_vs_rate": "Throughput and P90 latency vs request rate"}


def _figure(width: float, height: float):
    """A figure on its own Agg canvas (matplotlib imported only when a plot is drawn:
    report.html imports this module for its titles)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _plain_log(axis) -> None:
    """Log-scaled ``axis`` labelled in plain numbers (30, 100, 300; not 3x10^1)."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


def ecdf(values) -> tuple[np.ndarray, np.ndarray]:
    """(x sorted, F(x) = (i + 1) / n): the empirical CDF of the finite ``values``."""
    x = np.sort(np.asarray(values, dtype=float))
    x = x[np.isfinite(x)]
    return x, np.arange(1, x.size + 1) / max(x.size, 1)


def _rows(frame, source: str):
    if frame is None or not len(frame) or "source" not in frame.columns:
        return None
    rows = frame[frame["source"] == source]
    return rows if len(rows) else None


def _point_labels(record) -> dict:
    """Sweep point -> ``key=value, ...`` of its varied keys ({} without a sweep)."""
    if record.sweep is None:
        return {}
    keys = [k for k in sweep_keys(record) if k in record.sweep.columns]
    return {i: ", ".join(f"{k}={row[k]}" for k in keys)
            for i, (_, row) in enumerate(record.sweep.iterrows())}


def latency_cdf_png(record) -> bytes | None:
    """The simulated requests' TTFT, TPOT and E2EL CDFs (module docstring)."""
    requests = _rows(getattr(record, "requests", None), "simulated")
    if requests is None:
        return None
    labels = _point_labels(record)
    groups = (list(requests.groupby("point", sort=True)) if "point" in requests.columns
              else [(None, requests)])[:MAX_CDF_LINES]
    fig = _figure(13, 3.6)
    axes = fig.subplots(1, len(_LATENCIES))
    for ax, (column, title) in zip(axes, _LATENCIES):
        for point, rows in groups:
            x, y = ecdf(pd.to_numeric(rows[column], errors="coerce") * _MS_PER_S)
            if x.size:
                ax.step(x, y, where="post",
                        label=labels.get(point, f"point {point}") if point is not None
                        else None)
        ax.axhline(P90, color="#888888", ls=":", lw=1)
        values = pd.to_numeric(requests[column], errors="coerce")
        values = values[values > 0]
        if len(values) and values.max() >= LOG_SPREAD * values.min():
            ax.set_xscale("log")           # latencies across rates span decades
            _plain_log(ax.xaxis)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    if len(groups) > 1:
        axes[-1].legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    return _png(fig)


def _last(frame):
    if "point" not in frame.columns:
        return frame, ""
    last = frame["point"].max()
    return frame[frame["point"] == last], f" (sweep point {last})"


def kv_usage_png(record) -> bytes | None:
    """KV usage per step: simulated over time, emulated by step (module docstring)."""
    steps = getattr(record, "engine_steps", None)
    panels = [(source, _rows(steps, source)) for source in ("simulated", "emulated")]
    panels = [(source, rows) for source, rows in panels if rows is not None]
    if not panels:
        return None
    fig = _figure(11, 3.4 * len(panels))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (source, rows) in zip(axes, panels):
        rows, where = _last(rows)
        for (pool, replica), group in rows.groupby(["pool", "replica"], sort=True):
            usage = 100 * group["kv_usage"].to_numpy(float)
            name = f"{pool + ' ' if pool else ''}replica {replica}"
            if source == "simulated":        # each step from its start to its end
                x = np.column_stack([group["start_s"], group["end_s"]]).ravel()
                ax.plot(x, np.repeat(usage, 2), lw=1, label=name)
                ax.set_xlabel("simulated time (s)")
            else:
                ax.step(group["step"], usage, where="post", lw=1, label=name)
                ax.set_xlabel("engine step")
        ax.set_ylabel("KV blocks used (%)")
        ax.set_ylim(0, max(5.0, 1.1 * 100 * float(rows["kv_usage"].max())))
        ax.set_title(f"{source}: KV-cache usage after each step's allocation{where}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    return _png(fig)


def throughput_vs_rate_png(record) -> bytes | None:
    """Throughput and P90 latencies against the offered rate (module docstring)."""
    sweep = record.sweep
    keys = sweep_keys(record)
    if sweep is None or RATE_KEY not in keys or RATE_KEY not in sweep.columns:
        return None
    rate = pd.to_numeric(sweep[RATE_KEY], errors="coerce")
    sweep = sweep[np.isfinite(rate)].assign(_rate=rate[np.isfinite(rate)])
    panels = [p for p in _RATE_PANELS if p[0] in sweep.columns]
    if len(sweep) < 2 or not panels:
        return None
    others = [k for k in keys if k != RATE_KEY]
    groups = list(sweep.groupby(others, dropna=False, sort=False)) if others \
        else [((), sweep)]
    fig = _figure(4.2 * len(panels), 3.6)
    axes = fig.subplots(1, len(panels))
    axes = np.atleast_1d(axes)
    for ax, (column, title, log) in zip(axes, panels):
        for label, rows in groups:
            rows = rows.sort_values("_rate")
            name = ", ".join(f"{k}={v}" for k, v in zip(others, np.atleast_1d(label)))
            ax.plot(rows["_rate"], pd.to_numeric(rows[column], errors="coerce"), marker="o",
                    label=name or None)
        if column == "request_throughput":
            top = float(sweep["_rate"].max())
            ax.plot([0, top], [0, top], color="#888888", ls="--", lw=1, label="offered")
        if log:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if others or column == "request_throughput":
            ax.legend(fontsize="small")
    fig.tight_layout()
    return _png(fig)


#: plot name -> maker, in :data:`SERVING_PLOT_NAMES`' order (reports.plots draws them)
SERVING_PLOTS = {"latency_cdf": latency_cdf_png, "kv_usage": kv_usage_png,
                 "throughput_vs_rate": throughput_vs_rate_png}
