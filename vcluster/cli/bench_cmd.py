"""``vcluster bench collectives | startup | matmul | predict | simulate-scale``: the
benchmarks."""

from __future__ import annotations

from dataclasses import asdict

from .args import csv_of, positive_int, sizes
from .bench_collectives import OPS, PATHS

__all__ = ["add_parser"]


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks of the emulator")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    coll = kinds.add_parser(
        "collectives", help="time every collective (nccl-tests conventions)",
        description="Median time, algbw and busbw of each collective on N emulated devices, "
                    "beside a single-process memcpy measured in the same run.")
    coll.add_argument("--devices", type=positive_int, default=8, help="number of devices (8)")
    coll.add_argument("--sizes", type=sizes, default=[8, 1 << 20, 64 << 20],
                      help="message sizes, e.g. 8B,1MiB,64MiB (default)")
    coll.add_argument("--ops", type=csv_of(OPS, "op"), default=list(OPS),
                      help="collectives to run (default: all): " + ",".join(OPS))
    coll.add_argument("--paths", type=csv_of(PATHS, "path"), default=list(PATHS),
                      help="resident (dev.empty buffers, out=) and/or copy (default: both)")
    coll.add_argument("--dtype", default="float32", choices=["float32", "float64", "int64"])
    coll.add_argument("--algorithm", default="auto",
                      choices=["auto", "ring", "tree", "pairwise", "shm"],
                      help="algorithm for every op that has it (default auto)")
    coll.add_argument("--reps", type=positive_int, default=None,
                      help="timed repetitions (default: 50 up to 1 MiB, 10 up to 16 MiB, else 5)")
    coll.add_argument("--engine", choices=["emulator", "torch"], default="emulator",
                      help="torch: also run on local torch.distributed ranks (gloo on CPU) "
                      "and print both engines' figures side by side")
    coll.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    coll.set_defaults(run=_collectives)

    start = kinds.add_parser(
        "startup", help="bring up N devices and run a first no-op",
        description="Median wall time to start N devices and finish a first no-op run, "
                    "beside the start of one Python interpreter importing numpy.")
    start.add_argument("--devices", type=positive_int, default=8, help="number of devices (8)")
    start.add_argument("--repeat", type=positive_int, default=3, help="bring-ups (3)")
    start.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    start.set_defaults(run=_startup)

    mm = kinds.add_parser(
        "matmul", help="emulated sharded MatMul vs one process's A @ B",
        description="Median wall time of MatMul (MatchedInnerSharding) on N emulated devices, "
                    "host transfers included, beside numpy's A @ B in this process.")
    mm.add_argument("--m", type=positive_int, default=4096)
    mm.add_argument("--k", type=positive_int, default=2048)
    mm.add_argument("--n", type=positive_int, default=4096)
    mm.add_argument("--devices", type=positive_int, default=8)
    mm.add_argument("--reps", type=positive_int, default=3)
    mm.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    mm.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    mm.set_defaults(run=_matmul)

    from . import bench_predict, bench_simulate
    bench_predict.add_parser(kinds)
    bench_simulate.add_parser(kinds)


def _maybe_json(path, obj) -> None:
    if path:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(path, obj)
        print(f"wrote {path}")


def _collectives(args) -> int:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    from vcluster import VirtualCluster
    from .bench_collectives import format_header, format_row, run_collectives_bench
    print(f"vcluster bench collectives: {args.devices} devices, dtype {args.dtype}, "
          f"algorithm {args.algorithm}", flush=True)
    print(format_header(), flush=True)
    with VirtualCluster(Mesh((args.devices,), ("x",))) as cluster:
        records = run_collectives_bench(
            cluster, args.sizes, args.ops, args.paths, args.dtype, args.algorithm, args.reps,
            progress=lambda rec: print(format_row(rec), flush=True))
    if args.engine == "torch":
        # lazy: keeps vcluster --help fast
        from vcluster.torchdist import TorchCluster
        from .bench_collectives import format_comparison
        with TorchCluster(Mesh((args.devices,), ("x",))) as cluster:
            print(f"torch {cluster.info['torch_version']} ({cluster.info['torch_backend']}), "
                  "same sizes:", flush=True)
            theirs = run_collectives_bench(
                cluster, args.sizes, args.ops, args.paths, args.dtype, "auto", args.reps,
                progress=lambda rec: print(format_row(rec), flush=True))
        print("\nemulator beside torch (median time per call, same run):")
        print(format_comparison(records, theirs))
        records += theirs
    _maybe_json(args.json, [asdict(r) for r in records])
    return 0


def _startup(args) -> int:
    from .bench_startup import measure_startup
    r = measure_startup(args.devices, args.repeat)
    print(f"vcluster bench startup: {r['devices']} devices, median of {r['repeat']}")
    print(f"  python -c 'import numpy' (baseline)   {r['python_numpy_start_s']:.3f} s")
    print(f"  VirtualCluster up                      {r['cluster_start_s']:.3f} s")
    print(f"  up + first no-op run                   {r['start_and_first_run_s']:.3f} s "
          f"({r['start_and_first_run_s'] / r['python_numpy_start_s']:.1f}x baseline)")
    _maybe_json(args.json, r)
    return 0


def _matmul(args) -> int:
    from .bench_matmul import measure_matmul
    if args.k % args.devices:
        raise ValueError(f"--k {args.k} must be divisible by --devices {args.devices}")
    r = measure_matmul(args.m, args.k, args.n, args.devices, args.reps, args.dtype)
    print(f"vcluster bench matmul: {r['m']}x{r['k']}x{r['n']} {r['dtype']}, {r['policy']} "
          f"on {r['devices']} devices, median of {r['reps']}")
    print(f"  single process A @ B (baseline)   {r['single_process_s']:.3f} s")
    print(f"  emulated MatMul.run               {r['emulated_s']:.3f} s "
          f"({r['ratio']:.2f}x baseline)   max rel. error {r['max_rel_error']:.1e}")
    _maybe_json(args.json, r)
    return 0
