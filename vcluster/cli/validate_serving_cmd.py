"""``vcluster validate-serving``: the serving simulator against published serving
measurements (``serving_measured.csv``, shipped as package data; docs/serving_validation.md).

Every row of the table is either refused — its reason printed (an engine, GPU, model or
dtype without a preset, a dataset that is not fixed-length, outputs that stopped early) —
or simulated as ``vcluster simulate serve`` runs it
(:func:`~vcluster.timing.serving.validation.simulate_row_default`) and compared with what
was published: rel_error = predicted / published − 1 per metric. The report gives, per
table and role (``fit``: a constant was chosen on the row; ``held_out``: none was), the
mean |error| of TTFT, TPOT, throughput and batch latency, and every simulated row's signed
errors. ``--json PATH`` writes the rows (published, predicted, error, role, refusal) and
the summaries.
"""

from __future__ import annotations

__all__ = ["add_parser"]


def add_parser(commands) -> None:
    cmd = commands.add_parser("validate-serving",
                              help="the serving simulator against published measurements",
                              description=__doc__.split("\n\n")[0])
    cmd.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    cmd.set_defaults(run=_run)


def _run(args) -> int:
    # lazy: keeps vcluster --help fast (the simulator loads simpy and the hardware model)
    from vcluster.timing.serving.validation import (format_report, serving_rows,
                                                    simulate_row_default, validate_serving)
    report = validate_serving(serving_rows(), simulate_row=simulate_row_default)
    print(format_report(report))
    if args.json:
        # lazy: keeps vcluster --help fast; written atomically, never half a file
        from vcluster.runtime.files import write_json
        write_json(args.json, {
            "rows": [{"row": str(r.row), "table": r.row.table, "role": r.row.role.value,
                      "refused": r.refused,
                      "errors": [{"metric": e.metric, "published": e.published,
                                  "predicted": e.predicted, "rel_error": e.rel_error}
                                 for e in r.errors]} for r in report.rows],
            "groups": [{"table": g.table, "role": g.role.value, "simulated": g.simulated,
                        "refused": g.refused,
                        "mean_abs_error": {f.family: f.mean_abs_error for f in g.families},
                        "n": {f.family: f.n for f in g.families}} for g in report.groups]})
    return 0
