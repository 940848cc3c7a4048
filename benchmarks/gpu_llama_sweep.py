"""One GPU, torchtitan's Llama 3.1 8B layer shapes (h 4096, 32 heads, 8 K/V heads, SwiGLU
14,336, vocabulary 128,256) trained at sequence lengths 2K to 32K (issue 54: a sequence
sweep of one model on a real GPU): eager and ``torch.compile``, activation checkpointing
none / op / full as torchtitan's, SDPA pinned to FlashAttention-2; and that kernel alone,
causal forward and forward + backward, by sequence.

Measures only (no simulator on the GPU machine): every result is one JSON line appended to
``--out`` as it is measured, so a run stopped midway keeps what it measured. The
predictions beside them come from ``benchmarks/gpu_llama_sweep_predict.py`` (any machine).

    python benchmarks/gpu_llama_sweep.py --out sweep.jsonl [--model 70b] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

MODEL = dict(hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256)
#: ``--model 70b``: Llama 3.1 70B's layer shapes (its vocabulary too)
MODEL_70B = dict(hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256)
#: (layers, seq, micro_batch, compile, recompute), in the order they run: the eager
#: sequence sweep first, then the policies, then the compiled steps (tens of seconds each)
STEPS = [(4, 2048, 4, False, "none"), (4, 4096, 2, False, "none"), (4, 8192, 1, False, "none"),
         (4, 16384, 1, False, "none"), (4, 32768, 1, False, "none"),
         (4, 8192, 1, False, "op"), (4, 8192, 1, False, "full"), (4, 32768, 1, False, "op"),
         (8, 8192, 1, False, "none"),
         (4, 8192, 1, True, "none"), (4, 2048, 4, True, "none"), (4, 32768, 1, True, "none"),
         (4, 8192, 1, True, "op")]
#: ``--model 70b``'s steps (2 layers; fixed before its run, as STEPS)
STEPS_70B = [(2, 8192, 1, False, "none"), (2, 8192, 1, False, "op"), (2, 8192, 1, False, "full"),
             (2, 16384, 1, False, "none"), (2, 32768, 1, False, "op"),
             (2, 32768, 1, False, "full"), (2, 2048, 4, False, "none"),
             (2, 8192, 1, True, "none"), (2, 8192, 1, True, "op"), (2, 16384, 1, True, "none")]
ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def attention_times(torch, seq: int, heads: int = 32, head_dim: int = 128, reps: int = 10):
    """Median ms of SDPA's FlashAttention-2 kernel, causal, bf16, batch 1: (forward,
    forward + backward), CUDA events around each call after three warm-ups."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    q, k, v = (torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    g = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    out = {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for what in ("forward", "forward_backward"):
            times = []
            for i in range(3 + reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                if what == "forward_backward":
                    o.backward(g)
                end.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(end))
            out[what] = statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON-lines file results are appended to")
    ap.add_argument("--no-attention", action="store_true", help="the steps only")
    ap.add_argument("--model", choices=("8b", "70b"), default="8b",
                    help="the layer shapes: Llama 3.1 8B's (default) or 70B's")
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU: the path only")
    args = ap.parse_args(argv)
    import torch
    from vcluster.gpu.gpt_step import measure_gpt_step
    cuda = torch.cuda.is_available() and not args.quick
    big = MODEL_70B if args.model == "70b" else MODEL
    model = big if cuda else dict(hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=256)
    steps = STEPS_70B if args.model == "70b" else STEPS
    rc = 0

    def emit(row):
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for layers, seq, mb, compiled, recompute in steps:
        if not cuda:
            seq, mb = seq // 256, mb
        t0 = time.perf_counter()
        try:
            m = measure_gpt_step(model["hidden"], layers, model["heads"], seq, model["vocab"],
                                 mb, steps=8 if cuda else 2, warmup=3 if cuda else 1,
                                 compile=compiled and cuda, device="cuda" if cuda else "cpu",
                                 arch="llama", kv_heads=model["kv_heads"],
                                 ffn_hidden=model["ffn_hidden"], recompute=recompute,
                                 flash=cuda)
            emit({"kind": "step", **model, "layers": layers, "seq": seq, "micro_batch": mb,
                  "compiled": m.compiled, "recompute": recompute,
                  "attention_backend": m.attention_backend,
                  "step_time_s": m.step_time_s, "step_times_s": list(m.step_times_s),
                  "peak_memory_bytes": m.peak_memory_bytes, "losses": list(m.losses),
                  "parameters": m.parameters, "device": m.device_name,
                  "torch": m.torch_version, "wall_s": time.perf_counter() - t0})
        except Exception as e:          # one failed shape (memory, say) is reported, not fatal
            rc = 1
            emit({"kind": "step", "layers": layers, "seq": seq, "micro_batch": mb,
                  "compiled": compiled, "recompute": recompute,
                  "error": f"{type(e).__name__}: {e}"[:500]})
            traceback.print_exc()
        if cuda:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    if cuda and not args.no_attention:
        for seq in ATTENTION_SEQS:
            emit({"kind": "attention", "kernel": "flash2", "causal": True, "batch": 1,
                  "heads": 32, "head_dim": 128, "seq": seq, "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, **attention_times(torch, seq)})
    return rc


if __name__ == "__main__":
    sys.exit(main())
