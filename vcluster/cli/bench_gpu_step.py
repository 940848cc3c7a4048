"""``vcluster bench gpu-step``: a real PyTorch GPT (or, ``--arch llama``, torchtitan's
Llama 3) training step on this machine's GPU, beside what ``vcluster simulate gpt``
predicts for it on one GPU.

The step is :func:`vcluster.gpu.measure_gpt_step` (plain PyTorch: bf16 autocast, flash
attention through SDPA, fused AdamW; optionally ``torch.compile``; median of the timed
steps). The prediction is :func:`vcluster.planner.simulate_gpt` of the same model on
tp = pp = dp = 1 with global batch = micro-batch, on ``--hardware`` (default: the preset
of the GPU's name; a file from ``vcluster hardware calibrate --gpu`` works too), with the
memory model of ``--precision`` (default the step's own policy: ``torch_amp``, fp32
parameters, gradients and Adam state under bf16 autocast, 16 bytes per parameter, or with
``--compile`` ``torch_compile``, the same step as ``torch.compile`` saves and fuses it).
The Llama is priced on the program's own kernels (plain PyTorch's autocast kernel list is
the GPT's) with its memory under ``--precision megatron`` by default (the ``torch_amp``
count is the GPT's), and torchtitan's ``op`` checkpointing as the program's ``op``.
``--flash`` pins SDPA to FlashAttention-2 and prices ``flash2``. Errors are predicted / measured - 1. Without CUDA
it exits 2 and says so.
"""

from __future__ import annotations

import sys

from vcluster.runtime.files import write_json

from .args import positive_int, precision_name

__all__ = ["add_parser", "run_gpu_step"]


def add_parser(kinds) -> None:
    gs = kinds.add_parser(
        "gpu-step", help="a real PyTorch GPT step on this GPU beside the simulator's prediction",
        description="Median wall time and peak memory of a reference PyTorch GPT training "
                    "step on the local CUDA GPU (bf16 autocast, SDPA flash attention, fused "
                    "AdamW; --compile: torch.compile), beside vcluster's one-GPU prediction "
                    "of the same step, with the errors. Needs CUDA.")
    for name, what in (("hidden", "the model width h"), ("layers", "transformer layers"),
                       ("heads", "attention heads (head dim = hidden/heads)"),
                       ("seq", "tokens per sequence"), ("vocab", "vocabulary size")):
        gs.add_argument(f"--{name}", type=positive_int, required=True, help=what)
    gs.add_argument("--micro-batch", type=positive_int, required=True,
                    help="sequences per step (the global batch of the one GPU)")
    gs.add_argument("--tie-embeddings", action="store_true",
                    help="the head is the token embedding's weight (nanoGPT, GPT-2)")
    gs.add_argument("--arch", choices=("gpt", "llama"), default="gpt",
                    help="gpt (default) or llama: torchtitan's Llama 3 (RMSNorm, RoPE, "
                    "grouped-query attention, SwiGLU)")
    gs.add_argument("--kv-heads", type=positive_int, default=None,
                    help="the Llama's K/V heads (default: --heads)")
    gs.add_argument("--ffn-hidden", type=positive_int, default=None,
                    help="the Llama's SwiGLU width (required with --arch llama)")
    gs.add_argument("--recompute", choices=("none", "op", "full"), default="none",
                    help="the Llama's activation checkpointing, as torchtitan's mode: none "
                    "(default), op (its per-op selective policy), full (PyTorch's "
                    "non-reentrant checkpoint: predicted as recompute full-torch)")
    gs.add_argument("--flash", action="store_true",
                    help="pin PyTorch's SDPA to its FlashAttention-2 backend and price "
                    "flash2 (default: PyTorch's choice, priced as the preset's kernel)")
    gs.add_argument("--compile", action="store_true", help="torch.compile the model")
    gs.add_argument("--steps", type=positive_int, default=8, help="timed steps (8)")
    gs.add_argument("--warmup", type=positive_int, default=3, help="steps before timing (3)")
    gs.add_argument("--hardware", default=None,
                    help="what to predict on: a preset or a YAML file (default: the preset "
                    "of this GPU's name)")
    gs.add_argument("--precision", default=None, metavar="POLICY",
                    help="the memory model's bytes per parameter and activation: torch_amp "
                    "(default: the reference step is PyTorch AMP over fp32 parameters), "
                    "torch_compile (the default with --compile), megatron, fp64, fp32")
    gs.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    gs.set_defaults(run=run_gpu_step)


def run_gpu_step(args) -> int:
    # lazy: keeps vcluster --help fast (torch)
    from modeling import LLAMA_BLOCK, block_named
    from pipeline_parallel.gpt import GPTConfig, ParallelConfig, model_flops
    from vcluster.gpu import cuda_missing, default_base, measure_gpt_step
    from vcluster.planner.simulation import simulate_gpt
    from vcluster.timing import load_hardware
    llama = block_named(args.arch) is LLAMA_BLOCK
    if llama and args.ffn_hidden is None:
        raise ValueError("--arch llama needs --ffn-hidden (the SwiGLU width)")
    if not llama and (args.kv_heads, args.ffn_hidden, args.recompute) != (None, None, "none"):
        raise ValueError("--kv-heads, --ffn-hidden and --recompute are the Llama's: add "
                         "--arch llama")
    extra = dict(arch="llama", kv_heads=args.kv_heads or args.heads,
                 ffn_hidden=args.ffn_hidden) if llama else {}
    config = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
                       vocab=args.vocab, tie_embeddings=args.tie_embeddings,
                       **extra)                                                # checks first
    precision = precision_name(args.precision or ("megatron" if llama else
                                                  "torch_compile" if args.compile else
                                                  "torch_amp"))
    if why := cuda_missing():
        print(f"vcluster bench gpu-step needs a CUDA GPU: {why}", file=sys.stderr)
        return 2
    import torch
    name = torch.cuda.get_device_name()
    hardware = args.hardware or default_base(name)
    if hardware is None:
        raise ValueError(f"no preset is a {name!r}: say what to predict on with --hardware "
                         "(a preset, or a file from vcluster hardware calibrate --gpu)")
    hw = load_hardware(hardware)
    # the reference step's full checkpointing is PyTorch's non-reentrant one: full-torch
    parallel = ParallelConfig(global_batch=args.micro_batch, micro_batch=args.micro_batch,
                              recompute="full-torch" if args.recompute == "full"
                              else args.recompute,
                              **({"attention": "flash2"} if args.flash else {}))
    # plain PyTorch's autocast kernel list is the GPT's: the Llama is priced on its own,
    # eager with eager PyTorch's unfused kernels (planner.eager_kernels)
    predicted = simulate_gpt(config, parallel, hw, precision=precision,
                             **({"autocast_kernels": False, "eager_kernels": not args.compile}
                                if llama else {}))
    print(f"vcluster bench gpu-step: {name}, torch {torch.__version__}, "
          f"{'compiled' if args.compile else 'eager'}; {args.arch} hidden {args.hidden}, layers "
          f"{args.layers}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}, "
          f"micro-batch {args.micro_batch} ...", file=sys.stderr, flush=True)
    measured = measure_gpt_step(args.hidden, args.layers, args.heads, args.seq, args.vocab,
                                args.micro_batch, steps=args.steps, warmup=args.warmup,
                                compile=args.compile, tie_embeddings=args.tie_embeddings,
                                recompute=args.recompute, flash=args.flash,
                                **{k: v for k, v in extra.items() if k != "arch"},
                                **({"arch": "llama"} if llama else {}))
    flops = model_flops(config, args.micro_batch)
    peak_gb = measured.peak_memory_bytes / 1e9
    rows = {
        "step_time_s": (measured.step_time_s, predicted.step_time_s),
        "peak_memory_gb": (peak_gb, predicted.peak_memory_gb),
    }
    label = (str(hardware) if isinstance(hardware, str) else hw.device.name) + \
        (", autocast's kernels priced" if predicted.autocast_kernels else "") + \
        (", eager PyTorch's unfused kernels priced" if predicted.eager_kernels else "") + \
        (", fused as torch.compile fuses them" if predicted.inductor_fusion else "")
    print(f"{name}, {measured.parameters / 1e9:.2f}B parameters, "
          f"{'compiled' if args.compile else 'eager'}: {flops / measured.step_time_s / 1e12:.0f} "
          f"model TFLOP/s measured")
    print(f"{'':<14}{'measured':>12}{'predicted':>12}{'error':>9}   (predicted on {label})")
    for key, (got, want) in rows.items():
        unit, scale = ("ms", 1e3) if key == "step_time_s" else ("GB", 1.0)
        print(f"{key.split('_')[0] + ' ' + key.split('_')[1]:<14}{got * scale:>9.1f} {unit}"
              f"{want * scale:>9.1f} {unit}{100 * (want / got - 1):>+8.1f}%")
    if args.json:
        write_json(args.json, {
            "gpu": name, "torch": torch.__version__, "compiled": args.compile,
            "model": {"arch": args.arch, "hidden": args.hidden, "layers": args.layers,
                      "heads": args.heads, "kv_heads": config.kv_heads,
                      "ffn_hidden": config.ffn_hidden if llama else 4 * args.hidden,
                      "seq": args.seq, "vocab": args.vocab, "micro_batch": args.micro_batch,
                      "tie_embeddings": args.tie_embeddings,
                      "parameters": measured.parameters},
            "recompute": args.recompute, "attention": "flash2" if args.flash else "",
            "model_flops": flops,
            "hardware": label, "precision": precision,
            "autocast_kernels": predicted.autocast_kernels,
            "eager_kernels": predicted.eager_kernels,
            "inductor_fusion": predicted.inductor_fusion,
            "measured_step_times_s": list(measured.step_times_s),
            "losses": list(measured.losses),
            **{k: {"measured": g, "predicted": w, "error": w / g - 1}
               for k, (g, w) in rows.items()}})
        print(f"wrote {args.json}")
    return 0
