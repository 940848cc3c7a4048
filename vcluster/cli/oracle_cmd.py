"""``vcluster oracle export`` / ``vcluster oracle check``: goldens for real backends.

    vcluster oracle export scenarios/matmul_policies.yaml --out goldens/matmul
    vcluster oracle export scenarios/matmul_policies.yaml --out actual/matmul --engine torch
    vcluster oracle check goldens/matmul --actual actual/matmul

``export`` writes per-rank inputs, outputs and gradients (.npz) and manifest.json (one
golden per sweep point, docs/oracle.md); with the default engine (the emulator, checked
against numpy first) these are the goldens. ``check`` compares an actual directory with
the goldens and prints every differing rank, tensor and element (absolute, relative and
ulps error). Exit codes: 0 match; 1 mismatch or a failed run; 2 bad file or argument.
"""

from __future__ import annotations

import sys

__all__ = ["add_parser"]


def add_parser(commands) -> None:
    oracle = commands.add_parser(
        "oracle", help="export golden per-rank results; check a backend's against them",
        description=__doc__.split("\n\n")[0])
    sub = oracle.add_subparsers(dest="oracle_command", required=True, metavar="SUBCOMMAND")
    export = sub.add_parser("export", help="run a scenario file and write its golden",
                            description="Run every sweep point of a scenario file and write "
                            "per-rank .npz files and manifest.json to DIR.")
    export.add_argument("file", metavar="FILE", help="a scenario YAML file (docs/scenario.md)")
    export.add_argument("--out", metavar="DIR", required=True, help="the golden directory")
    export.add_argument("--engine", choices=("emulator", "torch"), default="emulator",
                        help="emulator: the goldens; torch: the same files from local "
                        "torch.distributed ranks")
    export.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="override a scenario key (repeatable)")
    export.set_defaults(run=_export)
    check = sub.add_parser("check", help="compare results with goldens (exit 1 on mismatch)",
                           description="Compare the directory --actual (written by `oracle "
                           "export --engine ...` or any backend in the same format) with the "
                           "goldens in DIR.")
    check.add_argument("golden", metavar="DIR", help="the golden directory")
    check.add_argument("--actual", metavar="DIR2", required=True,
                       help="the directory of the results to check")
    check.set_defaults(run=_check)


def _export(args) -> int:
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.oracle_export import ExportError, describe_engine, export_scenario
    from vcluster.oracle import load_golden
    from vcluster.scenario import ScenarioError
    try:
        written = export_scenario(args.file, args.out, args.engine, args.overrides)
    except ScenarioError as exc:
        print(f"vcluster oracle export: error: {exc}", file=sys.stderr)
        return 2
    except ExportError as exc:
        print(f"vcluster oracle export: {exc}", file=sys.stderr)
        return 1
    for path in written:
        golden = load_golden(path, verify=False)
        n = sum(len(golden.results(r)) for r in range(golden.size))
        print(f"{path}: {golden.size} ranks, {n} (rank, tensor) results, engine "
              f"{describe_engine(golden.manifest)}")
    return 0


def _check(args) -> int:
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.oracle_export import check_dirs, describe_engine
    from vcluster.oracle import load_golden
    try:
        results = check_dirs(args.golden, args.actual)
    except (FileNotFoundError, ValueError) as exc:
        print(f"vcluster oracle check: error: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for g_path, a_path, result in results:
        engine = describe_engine(load_golden(a_path, verify=False).manifest)
        if result.ok:
            print(f"{a_path} ({engine}): OK, {result} in {g_path}")
        else:
            failed += 1
            print(f"{a_path} ({engine}): MISMATCH against {g_path}\n{result}")
    if failed:
        print(f"vcluster oracle check: {failed} of {len(results)} goldens differ",
              file=sys.stderr)
        return 1
    return 0
