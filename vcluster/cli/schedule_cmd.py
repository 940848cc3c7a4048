"""``vcluster schedule NAME``: print a pipeline schedule's step grid and its bubble.

    vcluster schedule 1f1b --ranks 4 --microbatches 8
    vcluster schedule interleaved_1f1b --ranks 4 --microbatches 8 --virtual-stages 2
    vcluster schedule zero_bubble --ranks 4 --microbatches 8 --costs 1,2,1

The grid is a unit-cost run (every action one step); the bubble fraction is
simulated with ``--costs F,B,W`` (B = I + W) and printed beside its closed form.
"""

from __future__ import annotations

import argparse

from pipelining import (SCHEDULE_NAMES, bubble_fraction_closed_form, format_grid,
                        make_schedule, peak_in_flight, simulate)

from .args import positive_int

__all__ = ["add_parser", "run_schedule", "parse_costs"]

_FORMULAS = {
    "gpipe": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved_1f1b": "(p-1)/(v*m+p-1)",
    "zero_bubble": "b/(b+m(F+B)), b = (p-1)max(F, I, F+I-W)",
}


def parse_costs(text: str) -> tuple[float, float, float]:
    """``"F,B,W"`` -> three positive floats with ``W < B`` (argparse type)."""
    parts = [t.strip() for t in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(
            f"expected three comma-separated costs F,B,W (e.g. 1,2,1), got {text!r}")
    try:
        f, b, w = (float(t) for t in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected three numbers F,B,W (e.g. 1,2,1), got {text!r}") from None
    if not all(0 < c < float("inf") for c in (f, b, w)):
        raise argparse.ArgumentTypeError(f"costs must be positive finite numbers, got {text!r}")
    if w >= b:
        raise argparse.ArgumentTypeError(
            f"the W cost must be smaller than the B cost (B = I + W), got B={b:g}, W={w:g}")
    return f, b, w


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``schedule`` on ``subparsers`` (the result of ``add_subparsers``)."""
    parser = subparsers.add_parser(
        "schedule", help="print a pipeline schedule's grid and bubble fraction",
        description="Print the steps x ranks grid of a pipeline schedule (unit-cost steps, "
                    "'.' = idle) and its bubble fraction: simulated with --costs, and the "
                    "closed form beside it.")
    parser.add_argument("name", choices=SCHEDULE_NAMES, help="the schedule")
    parser.add_argument("--ranks", "-p", type=positive_int, default=4,
                        help="pipeline ranks p (4)")
    parser.add_argument("--microbatches", "-m", type=positive_int, default=8,
                        help="micro-batches m (8)")
    parser.add_argument("--virtual-stages", "-v", type=positive_int, default=None,
                        help="chunks per rank v, interleaved_1f1b only (2)")
    parser.add_argument("--costs", type=parse_costs, default=(1.0, 2.0, 1.0), metavar="F,B,W",
                        help="forward, full backward and weight-gradient cost of one "
                             "micro-batch per rank, B = I + W (default 1,2,1)")
    parser.set_defaults(run=run_schedule)
    return parser


def run_schedule(args) -> int:
    """Print the grid and the bubble; raises ValueError on bad sizes (exit 2 in main)."""
    schedule = make_schedule(args.name, args.ranks, args.microbatches, args.virtual_stages)
    p, m, v = schedule.ranks, schedule.microbatches, schedule.virtual_stages
    f, b, w = args.costs
    result = simulate(schedule, f, b, w)
    print(f"vcluster schedule {schedule.name}: p={p} ranks, m={m} micro-batches, v={v} "
          f"chunk(s) per rank, {schedule.stages} stages")
    print("grid: unit-cost steps (every action takes 1 step), '.' = idle")
    print(format_grid(schedule))
    print()
    print(f"costs per micro-batch per rank: F={f:g} B={b:g} W={w:g} (I={b - w:g})"
          + (f", each chunk 1/{v} of that" if v > 1 else ""))
    print(f"makespan {result.makespan:g}, busy {result.busy[0]:g} and idle "
          f"{result.idle[0]:g} per rank")
    print(f"bubble fraction (simulated)    {result.bubble_fraction:.4f}")
    try:
        closed = bubble_fraction_closed_form(schedule.name, p, m, v, f, b, w)
        closed_text = f"{closed:.4f}  {_FORMULAS[schedule.name]}"
    except ValueError as exc:
        closed_text = f"n/a ({str(exc).removeprefix('closed form: ')})"
    print(f"bubble fraction (closed form)  {closed_text}")
    peaks = " ".join(str(peak_in_flight(schedule, r)) for r in range(p))
    print(f"peak in-flight activations per rank: {peaks}")
    return 0
