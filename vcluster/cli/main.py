"""The ``vcluster`` command line (also ``python -m vcluster``).

Each command lives in its own module with an ``add_parser(commands)`` function.
Exit codes: 0 success; 1 a run failed; 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from modeling import ConfigError

from .. import __version__
from . import (bench_cmd, hardware_cmd, model_cmd, oracle_cmd, plan_cmd, run_cmd,
               schedule_cmd, simulate_cmd, validate_model_cmd, validate_serving_cmd)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcluster", description="A virtual GPU cluster on one machine.")
    parser.add_argument("--version", action="version", version=f"vcluster {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (run_cmd, bench_cmd, hardware_cmd, model_cmd, plan_cmd, schedule_cmd,
                   simulate_cmd, validate_model_cmd, validate_serving_cmd, oracle_cmd):
        module.add_parser(commands)
    return parser


#: a plan field -> the flag a user types for it, where the two names differ
_FLAGS = {"zero_stage": "--zero", "microbatches": "--global-batch / (--dp x --micro-batch)",
          "model": "--model", "expert_weight_bytes": "--weight-dtype",
          "weight_bytes": "--weight-dtype", "kv_bytes": "--kv-cache-dtype"}


def flag_of(error: ConfigError) -> str | None:
    """The flag of a :class:`~modeling.ConfigError` about the plan (``zero_stage`` ->
    ``--zero``); None (the error's own name) for one about a model file."""
    if error.owner not in ("", "ParallelConfig", "GPT", "GPTConfig", "ServingPlan", "Workload"):
        return None
    return _FLAGS.get(error.field, "--" + error.field.replace("_", "-"))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that it unwinds like Ctrl-C: devices are
    aborted and stopped, shared memory released, a half-written report removed."""


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    received: list[int] = []          # SIGTERMs that arrived: the exit status says so

    def raise_terminated(signum, frame):
        received.append(signum)
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None
    try:
        try:
            status = args.run(args)
        except Exception as exc:
            if received:     # the unwinding surfaced as another error (a file's close)
                raise Terminated(f"signal {received[0]}") from exc
            raise
        if received:         # a command that caught the unwinding and reported a failure
            raise Terminated(f"signal {received[0]}")
        return status
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`vcluster plan ... | head`): stop quietly, as Unix tools
        # do, and keep the interpreter's final flush from failing on the closed pipe
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except ConfigError as exc:      # a rule of the model layer: say it in flags
        print(f"vcluster: error: {exc.describe(flag_of(exc))}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"vcluster: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a run failed: say what, exit 1
        print(f"vcluster: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
