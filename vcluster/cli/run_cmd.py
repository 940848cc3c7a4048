"""``vcluster run FILE``, ``vcluster validate FILE``, ``vcluster schema``: scenario files.

    vcluster run scenarios/quickstart.yaml [--out DIR] [--mode both] [--set parallel.tp=4]
    vcluster run scenarios/faults.yaml --resume runs/faults.checkpoints

runs the scenario (every sweep point), writes its report directory atomically (default
``runs/<name>``, or ``report.out``; ``--out`` wins) and prints the headline figures.
Exit codes: 0 ok; 1 the run failed or a ``check: true`` comparison failed (the report is
still written, with the failed checks); 2 the file, a ``--set`` or an argument is not
valid (nothing runs, nothing is written).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["add_parser"]

_SET_HELP = "override a key, the value parsed as YAML (repeatable): --set parallel.tp=4"


def add_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="run a scenario file and write its report",
        description=__doc__.split("\n\n")[0] + " Runs the scenario and writes its report "
        "(summary.md, report.html, results.json, CSV tables, PNG plots, trace.json).")
    run.add_argument("file", metavar="FILE", help="a scenario YAML file (docs/scenario.md)")
    run.add_argument("--out", metavar="DIR", help="report directory (default: report.out "
                     "of the file, else runs/<name>)")
    run.add_argument("--mode", choices=("emulate", "simulate", "both"),
                     help="override run.mode")
    run.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                     default=[], help=_SET_HELP)
    run.add_argument("--quiet", action="store_true", help="no progress bar, no figures")
    run.add_argument("--allow-oom", action="store_true",
                     help="exit 0 even when a predicted point does not fit the device memory")
    run.add_argument("--resume", metavar="DIR", help="continue a training run from the "
                     "newest checkpoint in DIR (checkpoint.dir of a run that stopped)")
    run.add_argument("--engine", choices=("emulator", "torch"), default="emulator",
                     help="emulation engine: the emulator's device processes, or local "
                     "torch.distributed ranks (gloo on CPU, NCCL on GPUs; docs/torch.md)")
    run.set_defaults(run=_run)

    validate = commands.add_parser(
        "validate", help="check a scenario file without running it",
        description="Validate a scenario file (schema, mesh sizes, divisibility, policies, "
                    "schedules, hardware) for every sweep point; exit 0 if valid, 2 if not.")
    validate.add_argument("file", metavar="FILE", help="a scenario YAML file")
    validate.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                          default=[], help=_SET_HELP)
    validate.set_defaults(run=_validate)

    schema = commands.add_parser(
        "schema", help="print the JSON Schema of scenario files",
        description="Print the JSON Schema of scenario files (for editor completion, "
                    "e.g. yaml-language-server).")
    schema.set_defaults(run=_schema)


def _load(args):
    # lazy: keeps vcluster --help fast
    from vcluster.scenario import ScenarioError, load_scenario
    try:
        return load_scenario(args.file, args.overrides), None
    except ScenarioError as exc:
        print(f"vcluster {args.command}: error: {exc}", file=sys.stderr)
        return None, 2


def _validate(args) -> int:
    # lazy: keeps vcluster --help fast
    from vcluster.scenario import resolve_mesh, sweep_points
    scenario, code = _load(args)
    if scenario is None:
        return code
    points = sweep_points(scenario)
    mesh = resolve_mesh(points[0][1])
    print(f"{args.file}: valid — {scenario.workload.kind} on {mesh}, mode "
          f"{scenario.run.mode}, {len(points)} point{'s' * (len(points) != 1)}")
    return 0


def _schema(args) -> int:
    # lazy: keeps vcluster --help fast
    from vcluster.scenario import scenario_schema
    print(json.dumps(scenario_schema(), indent=2))
    return 0


def _out_dir(args, scenario) -> Path:
    if args.out:
        return Path(args.out)
    if scenario.report.out:
        return Path(scenario.report.out)
    return Path("runs") / scenario.name


def _formats(scenario):
    """The report's files: ``report.formats``, else every format — except the per-op
    Perfetto trace of a simulate-only run (tens of MB at cluster scale, and seconds to
    write), which it writes only when ``report.formats`` names ``trace``."""
    if scenario.report.formats is not None:
        return scenario.report.formats
    # lazy: keeps vcluster --help fast (reports loads pandas)
    from reports.write import FORMATS
    return [f for f in FORMATS if f != "trace" or scenario.run.mode != "simulate"]


def _unwritable(out: Path) -> str | None:
    """Why the report directory ``out`` cannot be written, or None: a probe directory is
    made (and removed) in ``out`` or its nearest existing parent, where the report's own
    atomic write will put its files — before anything runs."""
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return f"{base} is not a directory"
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".vcluster-probe-", dir=base))
    except OSError as exc:
        return f"cannot create files in {base} ({exc.strerror or exc})"
    return None


def _run(args) -> int:
    # lazy: keeps vcluster --help fast
    from reports import write_report
    from vcluster.scenario import ScenarioError, run_scenario
    scenario, code = _load(args)
    if scenario is None:
        return code
    out_dir = _out_dir(args, scenario)
    why = _unwritable(out_dir)
    if why is not None:
        print(f"vcluster run: error: report directory {str(out_dir)!r} cannot be written: "
              f"{why} (--out or report.out)", file=sys.stderr)
        return 2
    try:
        record = run_scenario(scenario, mode=args.mode, progress=not args.quiet,
                              resume=args.resume, engine=args.engine)
    except ScenarioError as exc:
        print(f"vcluster run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # the run failed: say what, write nothing, exit 1
        print(f"vcluster run: {scenario.name} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    out = write_report(record, out_dir, _formats(scenario))
    if not args.quiet:
        _print_summary(record, out)
    if record.out_of_memory:
        print("vcluster run: does not fit the device memory: "
              + "; ".join(record.out_of_memory)
              + (" (--allow-oom: reported only)" if args.allow_oom else
                 "; the figures assume memory the devices do not have (--allow-oom to "
                 "exit 0 anyway)"), file=sys.stderr)
        if not args.allow_oom:
            return 1
    failed = [c for c in record.checks if not c["passed"]]
    if failed:
        names = ", ".join(c["name"] for c in failed[:5]) + (" ..." if len(failed) > 5 else "")
        print(f"vcluster run: {len(failed)} of {len(record.checks)} checks FAILED ({names}); "
              f"see {out}/summary.md", file=sys.stderr)
        return 1
    return 0


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _print_summary(record, out: Path) -> None:
    s = record.summary
    print(f"{record.name}: {s.get('workload', s.get('kind'))} on {s.get('mesh')} "
          f"({s.get('devices')} devices), mode {record.mode}")
    for key in ("measured_step_time_s", "predicted_step_time_s", "hardware",
                "compute_comm_ratio", "predicted_bubble_fraction", "traffic_matches",
                "final_loss", "checks_passed", "max_abs_error", "points",
                "final_params_sha256", "matches_fault_free",
                # an inference scenario's headline figures (vLLM bench serve's keys)
                "p90_ttft_ms", "p90_tpot_ms", "output_throughput", "fits"):
        if s.get(key) is not None:
            print(f"  {key:<26}{_fmt(s[key])}")
    print(f"report: {out}")
