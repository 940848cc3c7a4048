"""Where a reference GPT step's time goes on this GPU: kernel time by kind, the device's
idle time, and GEMM throughput sustained for seconds against a short burst.

    python benchmarks/gpu_step_profile.py --out profile.json [--micro-batch 1 4]
        [--hidden 2048 --layers 24 --heads 16 --seq 2048 --vocab 51200] [--no-sustained]
        [--llama KV_HEADS FFN_HIDDEN RECOMPUTE [--compile]]

1. The step of ``vcluster bench gpu-step`` (:func:`vcluster.gpu.gpt_step`'s model: bf16
   autocast, SDPA, fused AdamW; eager), three steps after three warm-ups under
   ``torch.profiler``: per step, the wall time, the summed duration of its CUDA kernels
   (busy), wall − busy (the device idle: waiting for the host), the kernel count, and the
   busy time by kind of kernel name (GEMM, flash attention, elementwise and the rest).
2. An 8192×8192×8192 bf16 GEMM run back to back for a 20 ms burst (what
   ``hardware calibrate --gpu`` times) and for 3 s (what a training run sustains), with
   the SM clock (NVML) read after each: is a calibrated rate a burst rate?
   (``--no-sustained`` skips it.)

``--llama``: the reference Llama of ``bench gpu-step --arch llama`` instead (SDPA pinned to
FlashAttention-2; ``--compile``: each block compiled). Needs CUDA (exits 2 without it).
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
import sys
import time

from vcluster.gpu.kernel_sweep import cuda_missing
from vcluster.runtime.files import write_text_atomic

# kernel-name fragments -> kind (first match wins; names as CUPTI reports them)
KINDS = (("flash", "attention"), ("fmha", "attention"), ("gemm", "gemm"), ("nvjet", "gemm"),
         ("sm90_xmma", "gemm"), ("cutlass", "gemm"), ("layer_norm", "norm"),
         ("LayerNorm", "norm"), ("adam", "optimizer"), ("softmax", "cross_entropy"),
         ("nll_loss", "cross_entropy"), ("reduce", "reduction"), ("elementwise", "elementwise"),
         ("copy", "elementwise"), ("embedding", "embedding"), ("index", "embedding"))


def kind_of(name: str) -> str:
    low = name.lower()
    for fragment, kind in KINDS:
        if fragment.lower() in low:
            return kind
    return "other"


def profile_step(torch, micro_batch: int, hidden=2048, layers=24, heads=16, seq=2048,
                 vocab=51200, steps: int = 3, llama: dict | None = None,
                 compiled: bool = False) -> dict:
    """``llama``: {"kv_heads", "ffn_hidden", "recompute"} profiles the reference Llama
    (:mod:`vcluster.gpu.llama_model`, SDPA pinned to FlashAttention-2) instead of the GPT;
    ``compiled``: its blocks ``torch.compile``d one by one, as torchtitan does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from vcluster.gpu.gpt_step import _model
    from vcluster.gpu.llama_model import llama_model
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = _model(torch, hidden, layers, heads, seq, vocab) if llama is None else \
            llama_model(torch, hidden, layers, heads, llama["kv_heads"], llama["ffn_hidden"],
                        seq, vocab, llama["recompute"])
    if compiled and llama is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (micro_batch, seq), device="cuda")
    targets = torch.randint(0, vocab, (micro_batch, seq), device="cuda")

    def one():
        with (nullcontext() if llama is None else sdpa_kernel(SDPBackend.FLASH_ATTENTION)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
        wall_s = (time.perf_counter() - t0) / steps
    by_kind: dict = {}
    busy_us, count = 0.0, 0
    cuda = torch.autograd.DeviceType.CUDA
    for e in prof.events():
        if e.device_type == cuda and e.device_time_total > 0:
            by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + e.device_time_total
            busy_us += e.device_time_total
            count += 1
    top = sorted(((e.key, e.device_time_total / steps / 1e3, e.count // steps)
                  for e in prof.key_averages()
                  if e.device_type == cuda and e.device_time_total > 0),
                 key=lambda r: -r[1])[:25]
    return {"micro_batch": micro_batch, "wall_ms": wall_s * 1e3,
            "busy_ms": busy_us / steps / 1e3, "idle_ms": wall_s * 1e3 - busy_us / steps / 1e3,
            "kernels_per_step": count // steps,
            "busy_ms_by_kind": {k: v / steps / 1e3 for k, v in sorted(by_kind.items())},
            "top_kernels_ms": [{"name": n[:120], "ms": ms, "calls": c} for n, ms, c in top]}


def sustained_gemm(torch, seconds: float, n: int = 8192) -> dict:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one_s = 2.0 * n ** 3 / 750e12
    reps = max(3, int(seconds / one_s))
    start.record()
    for _ in range(reps):
        torch.matmul(a, b, out=c)
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end) / 1e3
    return {"seconds": elapsed, "calls": reps, "tflops": 2.0 * n ** 3 * reps / elapsed / 1e12,
            "sm_clock_mhz": _sm_clock()}


def _sm_clock():
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {"sm": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "max_sm": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))}
    except Exception as exc:         # NVML is optional: say why it is missing
        return {"error": repr(exc)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[1, 4])
    for name, default in (("hidden", 2048), ("layers", 24), ("heads", 16), ("seq", 2048),
                          ("vocab", 51200)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--no-sustained", action="store_true",
                    help="skip the burst / sustained GEMM comparison")
    ap.add_argument("--llama", nargs=3, metavar=("KV_HEADS", "FFN_HIDDEN", "RECOMPUTE"),
                    help="profile the reference Llama (vcluster/gpu/llama_model.py) with these "
                         "K/V heads, SwiGLU width and checkpointing (none, op, full)")
    ap.add_argument("--compile", action="store_true",
                    help="with --llama: torch.compile each block, as torchtitan does")
    args = ap.parse_args(argv)
    if why := cuda_missing():
        print(f"gpu_step_profile needs CUDA: {why}", file=sys.stderr)
        return 2
    import torch
    shape = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "seq", "vocab")}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": shape, "steps": []}
    if not args.no_sustained:
        result.update(burst=sustained_gemm(torch, 0.02), sustained=sustained_gemm(torch, 3.0),
                      burst_after=sustained_gemm(torch, 0.02))
        print(json.dumps({k: result[k] for k in ("burst", "sustained", "burst_after")}),
              flush=True)
    llama = None if args.llama is None else {
        "kv_heads": int(args.llama[0]), "ffn_hidden": int(args.llama[1]),
        "recompute": args.llama[2]}
    result.update(llama=llama, compiled=args.compile)
    for mb in args.micro_batch:
        row = profile_step(torch, mb, **shape, llama=llama, compiled=args.compile)
        result["steps"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels_ms"}), flush=True)
        torch.cuda.empty_cache()
    write_text_atomic(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
