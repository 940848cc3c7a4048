"""``vcluster validate-model``: the timing model against published measurements.

Rows: bus bandwidth of every row of nccl_a100.csv, iteration time of every row of
megatron_2020_a100.csv and TFLOP/s per GPU of every row of megatron_sc21_table1.csv
(copies ship with vcluster as package data), each with published, predicted and
rel_error = predicted / published - 1, then the mean and max absolute error.
"""

from __future__ import annotations

__all__ = ["add_parser", "validation_rows"]


def add_parser(commands) -> None:
    cmd = commands.add_parser("validate-model", help="predicted vs published figures",
                              description=__doc__.split("\n\n")[0])
    cmd.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    cmd.set_defaults(run=_run)


def validation_rows() -> dict:
    # lazy: keeps vcluster --help fast
    from vcluster.planner.validation import validate_megatron
    from vcluster.timing import validate_nccl
    keys = ("source", "case", "metric", "published", "predicted", "rel_error")
    rows = [{k: r[k] for k in keys} for r in validate_nccl()] + validate_megatron()
    errors = [abs(r["rel_error"]) for r in rows]
    return {"rows": rows, "mean_abs_rel_error": sum(errors) / len(errors),
            "max_abs_rel_error": max(errors)}


def _run(args) -> int:
    result = validation_rows()
    print(f"{'case':<58}{'metric':<16}{'published':>10}{'predicted':>11}{'error':>8}")
    for r in result["rows"]:
        print(f"{r['case'][:57]:<58}{r['metric']:<16}{r['published']:>10.1f}"
              f"{r['predicted']:>11.1f}{100 * r['rel_error']:>+7.1f}%")
    print(f"mean |error| {100 * result['mean_abs_rel_error']:.1f}%   "
          f"max |error| {100 * result['max_abs_rel_error']:.1f}%")
    if args.json:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
