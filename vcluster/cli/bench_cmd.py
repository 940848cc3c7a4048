"""``vcluster bench collectives | startup | matmul | emulation | predict | simulate-scale``:
the benchmarks."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from types import MappingProxyType

from .args import csv_of, positive_int, sizes
from .bench_collectives import OPS, PATHS

__all__ = ["add_parser"]


# --pin-devices: VirtualCluster(pin_devices=...)
_PIN_CHOICES = MappingProxyType({"auto": None, "on": True, "off": False})

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
    coll.add_argument("--dtype", default="float32", choices=["float32", "float64", "int64"],
                      help="element type of the buffers (default float32)")
    coll.add_argument("--algorithm", default="auto",
                      choices=["auto", "ring", "tree", "pairwise", "shm"],
                      help="algorithm for every op that has it (default auto)")
    coll.add_argument("--reps", type=positive_int, default=None,
                      help="timed repetitions (default: 50 up to 1 MiB, 10 up to 16 MiB, else 5)")
    coll.add_argument("--engine", choices=["emulator", "torch"], default="emulator",
                      help="torch: also run on local torch.distributed ranks (NCCL when "
                      "every rank can have its own GPU, else gloo on CPU) and print both "
                      "engines' figures side by side")
    coll.add_argument("--mpi", action="store_true",
                      help="also run on as many MPI ranks (mpi4py + mpiexec; install: pip "
                      "install 'vcluster[mpi]') and print both engines' figures side by side")
    coll.add_argument("--mpiexec", metavar="PATH", default=None,
                      help="the MPI launcher for --mpi (default: the mpiexec beside this "
                      "python, else the first on PATH)")
    coll.add_argument("--rounds", type=positive_int, default=1,
                      help="measure everything N times, the emulator and --mpi taking turns "
                      "round by round (a noisy machine hits both alike); then print, per "
                      "case, the median over rounds [range] of each and of the per-round "
                      "ratio (default 1)")
    coll.add_argument("--array-module", default="numpy", choices=["numpy", "cupy", "strict"],
                      help="what the devices' arrays are (default numpy; cupy: GPU arrays)")
    coll.add_argument("--transport", type=csv_of(("auto", "ipc", "host"), "transport"),
                      default=["auto"],
                      help="how collectives move device arrays, one run each: ipc (peers "
                      "read device memory in place), host (staged through host memory); "
                      "default auto (ipc on cupy/strict, host on numpy)")
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
    mm.add_argument("--m", type=positive_int, default=4096, help="rows of A and C (default 4096)")
    mm.add_argument("--k", type=positive_int, default=2048,
                    help="columns of A, rows of B: the summed dimension (default 2048)")
    mm.add_argument("--n", type=positive_int, default=4096, help="columns of B and C (default 4096)")
    mm.add_argument("--devices", type=positive_int, default=8,
                    help="emulated devices the product is sharded over (default 8)")
    mm.add_argument("--reps", type=positive_int, default=3,
                    help="timed repetitions; the median is reported (default 3)")
    mm.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="element type (default float32)")
    mm.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    mm.set_defaults(run=_matmul)

    emu = kinds.add_parser(
        "emulation", help="an emulated training step vs the same math in one process",
        description="Per-step wall time of MLP (dp 2 x pp 4, 1F1B) and tiny-GPT (tp 2 x pp 2 "
                    "x dp 2) training on emulated devices, beside fit_reference in this "
                    "process, measured in the same run; the ratio, and the emulated losses' "
                    "error against the reference.")
    emu.add_argument("--mlp", type=_width_batch_list, default=[(128, 256), (1024, 1024)],
                     metavar="WIDTHxBATCH,...",
                     help="MLP cases (default 128x256,1024x1024; 'none' for none)")
    emu.add_argument("--gpt", action=argparse.BooleanOptionalAction, default=True,
                     help="include the tiny-GPT case (default: yes)")
    emu.add_argument("--steps", type=positive_int, default=3,
                     help="steps timed beyond the first (3)")
    emu.add_argument("--reps", type=positive_int, default=3, help="runs of each length (3)")
    emu.add_argument("--threads-per-device", type=positive_int, default=None,
                     help="each device's BLAS threads (default: cores // devices, at least 1)")
    emu.add_argument("--pin-devices", choices=tuple(_PIN_CHOICES), default="off",
                     help="pin the devices to CPUs: off (VirtualCluster's default), auto "
                          "(when they outnumber the cores), on")
    emu.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    emu.set_defaults(run=_emulation)

    from . import bench_gpu_decode, bench_gpu_step, bench_predict, bench_simulate
    bench_predict.add_parser(kinds)
    bench_simulate.add_parser(kinds)
    bench_gpu_step.add_parser(kinds)
    bench_gpu_decode.add_parser(kinds)


def _width_batch_list(text: str) -> list[tuple[int, int]]:
    """``128x256,1024x1024`` -> [(128, 256), (1024, 1024)]; ``none`` -> []."""
    if text.strip().lower() == "none":
        return []
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.lower().split("x")
        try:
            width, batch = (int(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected WIDTHxBATCH (e.g. 1024x1024), got {item!r}") from None
        if width < 8 or batch < 8 or batch % 8:
            raise argparse.ArgumentTypeError(
                f"{item!r}: width must be >= 8 and batch a positive multiple of 8 (dp 2 x 4 "
                "micro-batches)")
        out.append((width, batch))
    return out


def _maybe_json(path, obj) -> None:
    if path:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(path, obj)
        print(f"wrote {path}")


def _collectives(args) -> int:
    # lazy: keeps vcluster --help fast
    from .bench_collectives import format_header
    print(f"vcluster bench collectives: {args.devices} devices, dtype {args.dtype}, "
          f"algorithm {args.algorithm}, array module {args.array_module}", flush=True)
    if args.rounds > 1 and args.engine == "torch":
        raise ValueError(f"--rounds = {args.rounds} with --engine torch: rounds alternate the "
                         "emulator with --mpi only; use --rounds 1 with --engine torch")
    backend = _torch_backend(args.devices) if args.engine == "torch" else None
    mpiexec = _mpi_launcher(args) if args.mpi else None
    print(format_header(), flush=True)
    records, theirs = [], []
    for r in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"round {r}/{args.rounds}: emulator", flush=True)
        ours = _emulator_round(args, r)
        records += ours
        if args.mpi:
            if args.rounds > 1:
                print(f"round {r}/{args.rounds}: mpi", flush=True)
            theirs += _mpi_side(args, mpiexec, ours, r)
    if len(args.transport) > 1:
        # lazy: keeps vcluster --help fast
        from .bench_collectives import format_transports
        print("\n" + format_transports(records))
    if args.engine == "torch":
        # lazy: keeps vcluster --help fast
        from mesh import Mesh
        from vcluster.torchdist import TorchCluster
        from .bench_collectives import format_comparison, format_row, run_collectives_bench
        with TorchCluster(Mesh((args.devices,), ("x",)), backend=backend) as cluster:
            print(f"torch {cluster.info['torch_version']} ({cluster.info['torch_backend']}), "
                  "same sizes:", flush=True)
            torch_records = run_collectives_bench(
                cluster, args.sizes, args.ops, args.paths, args.dtype, "auto", args.reps,
                progress=lambda rec: print(format_row(rec), flush=True))
        print("\nemulator beside torch (median time per call, same run):")
        print(format_comparison(records, torch_records))
        records += torch_records
    if args.mpi and args.rounds > 1:
        # lazy: keeps vcluster --help fast
        from .bench_collectives import format_rounds
        print(f"\nemulator beside mpi over {args.rounds} alternating rounds (median of the "
              "rounds' medians [range]; ratio taken per round):")
        print(format_rounds(records, theirs))
    _maybe_json(args.json, [asdict(r) for r in records + theirs])
    return 0


def _emulator_round(args, round_number: int) -> list:
    """One round of every case on the emulator (a cluster per transport, brought up for
    the round), printed as it goes; records numbered ``round_number``."""
    # lazy: keeps vcluster --help fast
    from dataclasses import replace
    from mesh import Mesh
    from vcluster import VirtualCluster
    from .bench_collectives import format_row, run_collectives_bench
    records = []
    for transport in args.transport:
        with VirtualCluster(Mesh((args.devices,), ("x",)), array_module=args.array_module,
                            transport=transport) as cluster:
            records += run_collectives_bench(
                cluster, args.sizes, args.ops, args.paths, args.dtype, args.algorithm,
                args.reps, progress=lambda rec: print(format_row(rec), flush=True))
    return [replace(rec, round=round_number) for rec in records]


def _mpi_launcher(args) -> str:
    """``--mpi``'s launcher, found before anything runs (exit 2 when MPI is missing)."""
    # lazy: keeps vcluster --help fast
    from .bench_mpi import find_mpiexec
    if args.array_module != "numpy":
        raise ValueError(f"--array-module = {args.array_module!r} with --mpi: the MPI ranks "
                         "move numpy host arrays, so --mpi compares only --array-module numpy")
    return find_mpiexec(args.mpiexec)


def _mpi_side(args, mpiexec: str, emulator: list, round_number: int = 1) -> list:
    """The same cases on MPI ranks, printed, then beside the emulator's rows of the same
    round; records numbered ``round_number``."""
    # lazy: keeps vcluster --help fast
    from dataclasses import replace
    from .bench_collectives import format_comparison, format_row
    from .bench_mpi import run_mpi_bench
    info, theirs = run_mpi_bench(args.devices, args.sizes, args.ops, args.paths, args.dtype,
                                 args.reps, mpiexec=mpiexec)
    theirs = [replace(rec, round=round_number) for rec in theirs]
    print(f"mpi: {info['library']} (mpi4py {info['mpi4py']}), {info['ranks']} ranks by "
          f"{info['mpiexec']}, same sizes:", flush=True)
    for rec in theirs:
        print(format_row(rec), flush=True)
    print("\nemulator beside mpi (median time per call, same run):")
    print(format_comparison([r for r in emulator if r.engine == "emulator"], theirs))
    return theirs


def _torch_backend(devices: int) -> str:
    """The torch engine's backend for ``devices`` local ranks, chosen before anything
    runs (a missing torch fails at once); when GPUs are present but too few for NCCL,
    one line says that gloo was chosen and why."""
    # lazy: keeps vcluster --help fast
    from vcluster.torchdist import backend_choice
    backend, note = backend_choice("auto", devices)
    if note:
        print(f"torch engine: {note}", flush=True)
    return backend


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


def _emulation(args) -> int:
    from .bench_emulation import format_table, measure_gpt, measure_mlp
    pin = _PIN_CHOICES[args.pin_devices]
    print(f"vcluster bench emulation: per-step time after the first step, median of "
          f"{args.reps} runs of 1 and {1 + args.steps} steps each side, same run; "
          f"devices pinned: {args.pin_devices}", flush=True)
    cases = []
    for width, batch in args.mlp:
        cases.append(measure_mlp(width, batch, args.steps, args.reps, args.threads_per_device,
                                 pin))
        print(f"  {cases[-1].name}: {cases[-1].ratio:.2f}x", flush=True)
    if args.gpt:
        cases.append(measure_gpt(args.steps, args.reps, args.threads_per_device, pin))
    print(format_table(cases))
    _maybe_json(args.json, [c.as_dict() for c in cases])
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
