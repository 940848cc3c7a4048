"""The ``vcluster`` command line (also ``python -m vcluster``).

Exit codes: 0 success; 1 a run failed; 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys

from .bench_collectives import OPS, PATHS
from .schedule_cmd import add_parser as add_schedule_parser
from .units import parse_size

__all__ = ["main", "build_parser"]


def _csv(allowed=None, convert=str, what="value"):
    def parse(text: str):
        items = [convert(t.strip()) for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}s")
        if allowed is not None:
            bad = [i for i in items if i not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
        return items
    return parse


def _sizes(text: str):
    try:
        return [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcluster", description="A virtual GPU cluster on one machine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks of the emulator")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    coll = bench_kinds.add_parser(
        "collectives", help="time every collective (nccl-tests conventions)",
        description="Median time, algbw and busbw of each collective on N emulated devices, "
                    "beside a single-process memcpy measured in the same run.")
    coll.add_argument("--devices", type=_positive_int, default=8, help="number of devices (8)")
    coll.add_argument("--sizes", type=_sizes, default=[8, 1 << 20, 64 << 20],
                      help="message sizes, e.g. 8B,1MiB,64MiB (default)")
    coll.add_argument("--ops", type=_csv(OPS, what="op"), default=list(OPS),
                      help="collectives to run (default: all): " + ",".join(OPS))
    coll.add_argument("--paths", type=_csv(PATHS, what="path"), default=list(PATHS),
                      help="resident (dev.empty buffers, out=) and/or copy (default: both)")
    coll.add_argument("--dtype", default="float32", choices=["float32", "float64", "int64"])
    coll.add_argument("--algorithm", default="auto",
                      choices=["auto", "ring", "tree", "pairwise", "shm"],
                      help="algorithm for every op that has it (default auto)")
    coll.add_argument("--reps", type=_positive_int, default=None,
                      help="timed repetitions (default: 50 up to 1 MiB, 10 up to 16 MiB, else 5)")
    coll.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    coll.set_defaults(run=_bench_collectives)

    start = bench_kinds.add_parser(
        "startup", help="bring up N devices and run a first no-op",
        description="Median wall time to start N devices and finish a first no-op run, "
                    "beside the start of one Python interpreter importing numpy.")
    start.add_argument("--devices", type=_positive_int, default=8, help="number of devices (8)")
    start.add_argument("--repeat", type=_positive_int, default=3, help="bring-ups (3)")
    start.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    start.set_defaults(run=_bench_startup)

    mm = bench_kinds.add_parser(
        "matmul", help="emulated sharded MatMul vs one process's A @ B",
        description="Median wall time of MatMul (MatchedInnerSharding) on N emulated devices, "
                    "host transfers included, beside numpy's A @ B in this process.")
    mm.add_argument("--m", type=_positive_int, default=4096)
    mm.add_argument("--k", type=_positive_int, default=2048)
    mm.add_argument("--n", type=_positive_int, default=4096)
    mm.add_argument("--devices", type=_positive_int, default=8)
    mm.add_argument("--reps", type=_positive_int, default=3)
    mm.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    mm.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    mm.set_defaults(run=_bench_matmul)

    add_schedule_parser(commands)
    return parser


def _bench_matmul(args) -> int:
    import json
    from .bench_matmul import measure_matmul
    from .files import write_text_atomic
    if args.k % args.devices:
        raise ValueError(f"--k {args.k} must be divisible by --devices {args.devices}")
    r = measure_matmul(args.m, args.k, args.n, args.devices, args.reps, args.dtype)
    print(f"vcluster bench matmul: {r['m']}x{r['k']}x{r['n']} {r['dtype']}, {r['policy']} "
          f"on {r['devices']} devices, median of {r['reps']}")
    print(f"  single process A @ B (baseline)   {r['single_process_s']:.3f} s")
    print(f"  emulated MatMul.run               {r['emulated_s']:.3f} s "
          f"({r['ratio']:.2f}x baseline)   max rel. error {r['max_rel_error']:.1e}")
    if args.json:
        write_text_atomic(args.json, json.dumps(r, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _bench_startup(args) -> int:
    import json
    from .bench_startup import measure_startup
    from .files import write_text_atomic
    r = measure_startup(args.devices, args.repeat)
    print(f"vcluster bench startup: {r['devices']} devices, median of {r['repeat']}")
    print(f"  python -c 'import numpy' (baseline)   {r['python_numpy_start_s']:.3f} s")
    print(f"  VirtualCluster up                      {r['cluster_start_s']:.3f} s")
    print(f"  up + first no-op run                   {r['start_and_first_run_s']:.3f} s "
          f"({r['start_and_first_run_s'] / r['python_numpy_start_s']:.1f}x baseline)")
    if args.json:
        write_text_atomic(args.json, json.dumps(r, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _bench_collectives(args) -> int:
    from mesh import Mesh
    from vcluster import VirtualCluster
    from .bench_collectives import format_header, format_row, run_collectives_bench, write_json

    print(f"vcluster bench collectives: {args.devices} devices, dtype {args.dtype}, "
          f"algorithm {args.algorithm}", flush=True)
    print(format_header(), flush=True)
    with VirtualCluster(Mesh((args.devices,), ("x",))) as cluster:
        records = run_collectives_bench(
            cluster, args.sizes, args.ops, args.paths, args.dtype, args.algorithm, args.reps,
            progress=lambda rec: print(format_row(rec), flush=True))
    if args.json:
        write_json(records, args.json)
        print(f"wrote {args.json}")
    return 0


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
