"""Each kernel of the shipped ``h100_kernels.csv``, re-timed on this GPU two ways in the
same run: *alone* (the table's method: CUDA events around one call between
synchronisations, median of 20 after 3 warm-ups) and *in a stream* (the method of
``vcluster hardware calibrate --gpu``: back-to-back calls queued ahead of the device,
:mod:`vcluster.gpu.kernel_sweep`).

What it tells: (1) whether this GPU reproduces the table (alone / table), and (2) what a
lone call costs beyond the same call in a training step's stream, kind by kind — the
constant that moves the table's lone-call prices into a stream
(:mod:`vcluster.timing.kernel_profiles`), measured rather than assumed.

    python benchmarks/kernels_alone_vs_stream.py --out kernels.csv [--gemm-every 4]

Needs CUDA (exits 2 without it). Writes one CSV row per kernel: op, dims, table_s,
alone_s, stream_s.
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys

from vcluster.gpu.kernel_sweep import StreamTimer, cuda_missing, table_op
from vcluster.runtime.files import write_text_atomic
from vcluster.timing.kernel_profile import H100_KERNEL_TABLE, TABLE_OPS
from vcluster.timing.presets import read_data_csv


def alone_s(torch, fn, warmup: int = 3, reps: int = 20) -> float:
    """Median seconds of one call between synchronisations (the table's method)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the CSV to write")
    ap.add_argument("--gemm-every", type=int, default=4,
                    help="time every k-th GEMM row of the table (default 4: 40 of 160)")
    args = ap.parse_args(argv)
    if args.gemm_every < 1:
        raise SystemExit(f"--gemm-every must be >= 1, got {args.gemm_every}")
    if why := cuda_missing():
        print(f"kernels_alone_vs_stream needs CUDA: {why}", file=sys.stderr)
        return 2
    import torch
    timer = StreamTimer(torch, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    _, rows = read_data_csv(H100_KERNEL_TABLE)
    gemms = [r for r in rows if r["op"] == "gemm"][::args.gemm_every]
    out = []
    for r in gemms + [r for r in rows if r["op"] in TABLE_OPS]:
        if r["op"] == "gemm":
            m, k, n = (int(x) for x in r["dims"].split("x"))
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def fn(a=a, b=b, c=c):
                return torch.matmul(a, b, out=c)
            queued = 200
        else:
            fn = table_op(torch, r["op"], r["dims"], "cuda", torch.bfloat16, gen)
            queued = 40
        lone = alone_s(torch, fn)
        stream = timer.per_call(fn, queued)
        out.append((r["op"], r["dims"], float(r["seconds"]), lone, stream))
        print(f"{r['op']:<22}{r['dims']:<20} table {float(r['seconds']) * 1e6:9.1f} us  alone "
              f"{lone * 1e6:9.1f} us  stream {stream * 1e6:9.1f} us", flush=True)
        del fn
        torch.cuda.empty_cache()

    text = io.StringIO()
    text.write(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: kernels of "
               f"{H100_KERNEL_TABLE} timed alone and in a stream\n")
    w = csv.writer(text, lineterminator="\n")
    w.writerow(["op", "dims", "table_s", "alone_s", "stream_s"])
    w.writerows(out)
    write_text_atomic(args.out, text.getvalue())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
