"""How ``vcluster bench predict`` prints (:mod:`vcluster.cli.bench_predict`): the
calibrated spec, one row per workload or scenario point, the rounds' drift, the record."""

from __future__ import annotations

import math

from .bench_predict_measure import BUSY_MACHINE_CORES
from .bench_predict_scenarios import GOAL

__all__ = ["spread", "print_drift", "print_header", "print_row", "write_record"]


def print_drift(record: dict) -> None:
    """With two rounds or more and three points or more: the rounds' median ratios (what
    moved every point alike) and the points' ratios relative to them."""
    rows, medians = record["workloads"], record["round_median_ratios"]
    if len(medians) < 2 or len(rows) < 3:
        return
    worst = max(rows, key=lambda r: abs(math.log(r["relative_ratio"])))
    within = sum(abs(r["relative_ratio"] - 1) <= GOAL for r in rows)
    print(f"rounds' median ratio {min(medians):.2f}-{max(medians):.2f} (the machine's drift "
          f"between a calibration and its round moves every point alike); relative to it: "
          f"{within} of {len(rows)} points within {GOAL:.0%}, furthest {worst['name']} "
          f"{worst['relative_ratio']:.2f}", flush=True)


def print_header(first: str, width: int, note: str = "") -> None:
    """The table's header; ``note``: the title of a last column (:func:`print_row`)."""
    print(f"{first:<{width}}{'devices':>8}{'measured':>12}{'spread':>8}{'predicted':>12}"
          f"{'ratio':>8}{'cpu ratio':>10}  {'by round':<16}{'other load':>10}"
          + (f"  {note}" if note else ""), flush=True)


def write_record(path, record: dict) -> None:
    if path:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(path, record)
        print(f"wrote {path}")


def print_row(r: dict, width: int = 22, note: str = "") -> None:
    """One workload's row; ``note`` goes in a last column (a repricing's recorded ratio)."""
    load = r["background_cores"]
    flag = f"{'-':>10}" if load is None else f"{load:>6.2f} cores"
    busy = "  (machine busy: measurement disturbed)" \
        if load is not None and load > BUSY_MACHINE_CORES else ""
    print(f"{r['name']:<{width}}{r['devices']:>8}{_ms(r['measured_s']):>12}"
          f"{'±' + format(spread(r), '.0%'):>8}{_ms(r['predicted_s']):>12}{r['ratio']:>8.2f}"
          f"{r['cpu_ratio']:>10.2f}  {_rounds(r):<16}{flag}"
          + (f"  {note:>8}" if note else "") + busy, flush=True)


def _rounds(row: dict) -> str:
    """The row's round ratios (up to three), the interval of their median (more), or
    '-' for one round."""
    ratios = row["round_ratios"]
    if len(ratios) < 2:
        return "-"
    if len(ratios) <= 3:
        return " ".join(f"{x:.2f}" for x in ratios)
    lo, hi = row["ratio_interval"]
    return f"{lo:.2f}-{hi:.2f} ({row['ratio_interval_level']:.0%})"


def spread(row: dict) -> float:
    """Half the interquartile range of a row's measured runs over their median."""
    q25, q75 = row["measured_iqr_s"]
    return (q75 - q25) / (2 * row["measured_s"])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
