"""The ``vcluster`` command line (also ``python -m vcluster``).

Each command lives in its own module with an ``add_parser(commands)`` function.
Exit codes: 0 success; 1 a run failed; 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys

from . import (bench_cmd, hardware_cmd, plan_cmd, run_cmd, schedule_cmd, simulate_cmd,
               validate_cmd)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcluster", description="A virtual GPU cluster on one machine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (run_cmd, bench_cmd, hardware_cmd, plan_cmd, schedule_cmd, simulate_cmd,
                   validate_cmd):
        module.add_parser(commands)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError) as exc:
        print(f"vcluster: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a run failed: say what, exit 1
        print(f"vcluster: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
