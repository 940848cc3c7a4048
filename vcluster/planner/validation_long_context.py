"""The timing model against published long-context and overlapped training runs.

``torchtitan_long_context.csv`` (its header gives every source, commit and doubt): the
torchtitan paper's (Liang et al., arXiv 2410.06511, ICLR 2025) and the torchtitan
repository's measured Llama 3.1 8B/70B/405B throughput on H100s — FSDP2, tensor parallelism
with and without asynchronous TP, pipelines, and context parallelism at 32K to 262K tokens
— and one H200 run. Every row is ``held_out``: no constant was chosen on it.

Each row is simulated as the source states it (:func:`row_config`), with what torchtitan
runs where the row is silent, the same for every row:

* FSDP2 over the data-parallel ranks (ZeRO-3), its gradients reduced in fp32
  (torchtitan's ``mixed_precision_reduce``), with tensor parallelism too, beside sequence
  parallelism (torchtitan's 2D; since 2026-11-30: before, ZeRO-1 stood in for it, its
  gradients reduce-scattered and parameters gathered once per step instead of per layer);
  with a pipeline ZeRO-1 (ZeRO-2/3 are refused with pp > 1); FSDP2's copies around its
  gathers and reduce-scatters (``fsdp2_copies``, :mod:`.fsdp2_copies`, since 2026-11-30;
  before, and in the first run, none);
* attention ``flash2``: PyTorch's SDPA tries FlashAttention(-2) first on H100 and H200
  (torchtitan selected cuDNN only on B200: github.com/pytorch/torchtitan pull 1196);
* context parallelism as PyTorch's experimental ``context_parallel`` runs it
  (``torch_cp``, :mod:`.torch_context_parallel`, since 2026-12-01: float32 merges and
  accumulators, K and V repeated to the query heads, its buffer copies; before, and in
  the first run, Megatron's ring as the program traces it);
* ``tp_overlap="te"`` where the row ran asynchronous TP (torchtitan's
  ``enable_async_tensor_parallel``: the same decomposition of the sequence-parallel
  gathers and reduce-scatters, :mod:`tensor_parallel.collective_matmul`);
* Float8 rows with their linear GEMMs in FP8 (``fp8``) and torchao's cast kernels of the
  row's scaling recipe beside them (``fp8_casts``, the ``float8_recipe`` column:
  ``torchao-tensorwise`` or ``torchao-rowwise``, :mod:`.float8_casts`, since 2026-11-30;
  before, and in the first run, the GEMMs alone); the row-wise rows' GEMMs PyTorch's
  row-scaled kernel (``fp8-row``, since 2026-12-01: its share of the FP8 rate chosen on
  torchao's README, no row of this table, :mod:`vcluster.timing.gemm_formats`; before,
  and in the first run, as fast as the tensor-wise one);
* activation checkpointing ``full`` as PyTorch's non-reentrant full recomputation, which
  stops before W_down (``full-torch``, since 2026-11-30; before, and in the first run, the
  program's ``full``), torchtitan's per-op selective policy as the program's ``op``
  (:mod:`tensor_parallel.llama`; before it existed these rows ran as ``selective``, and
  their first-run prediction still does);
* rows without ``torch.compile`` with eager PyTorch's unfused kernels of the Llama layer
  (``eager_kernels``: :mod:`.eager_kernels`, since 2026-11-30; the first run prices them
  as the compiled rows).

Meta's H100s (the paper's §3.1; "the default 500W power limit", torchtitan's async-TP
benchmark document) are the DGX H100's die with 96 GB of HBM2e at 2.4 TB/s
(:data:`META_H100_MEMORY`, since 2026-11-30; before, the DGX H100's 3.35 TB/s of HBM3)
that computes at the speed its 500 W limit leaves (:func:`meta_h100_device`, since
2026-12-01; before, the 700 W part's): BF16 GEMMs and the attention curves at 0.719 of
the 700 W part's price, FP8 GEMMs at 0.798 — the mean ratios of GEMMs measured on a 500 W
H100 at Meta (:data:`META_H100_GEMMS`, FBGEMM pull request 2546) to this model's price
of the same GEMMs on the 700 W part. A hardware measurement, not a fit: no row of the
table set it, though the rows had been seen (docs/timing.md, "Power-limited parts", says
what else was tried on them). Rows whose source leaves the micro-batch or the
interleaving unstated are ``refused``. Not modelled, and in the signed errors: eager PyTorch's per-kernel host cost
(its unfused kernels are priced), Float8's all-gather of FSDP2 (the FP8 ratio of Meta's
H100 is FBGEMM's row-wise kernel's, a lower bound for cuBLAS's tensor-wise one), and what
:mod:`.torch_context_parallel` leaves out of PyTorch's context-parallel attention.

Each row is also simulated as the model stood before issue 54 (``first_run``: fused
attention at the device's achieved GEMM rate, no TE overlap, ``op`` as ``selective``) so
both errors print side by side, and the signed errors are summarised by sequence band
(:data:`BANDS`).

:data:`GPU_SWEEP_TABLE` is this project's own sequence sweep of one model on one real GPU
(``benchmarks/gpu_llama_sweep.py``: Llama 3.1 8B's layer shapes, 4 or 8 layers, and 70B's,
2 layers, 2K to 32K tokens, eager and compiled, torchtitan's three checkpointing modes, on
an H200): no
network, no power cap, no FSDP — the kernels and the host alone.
:func:`validate_gpu_sweep` predicts each row's step on the ``h200-dgx`` preset with the
attention kernel it ran (``flash2``) — its eager rows with eager PyTorch's unfused kernels
(``eager_kernels``: derived for torchtitan's bf16 model; the sweep's step is PyTorch AMP,
whose casts and fp32 residual stream differ: said so where its errors are reported) —
in tokens/s, beside its first-run prediction.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from types import MappingProxyType

from modeling import ConfigError
from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.timing import read_data_csv
from vcluster.timing.presets import hardware_from_dict, preset

from .simulation import simulate_gpt

__all__ = ["LONG_CONTEXT_TABLE", "GPU_PRESETS", "BANDS", "row_config", "validate_long_context",
           "band_of", "summary_by_band", "GPU_SWEEP_TABLE", "GPU_SWEEP_SHAPES",
           "validate_gpu_sweep", "META_H100_MEMORY", "META_H100_GEMMS", "meta_h100_device",
           "fp8_casts_of"]

LONG_CONTEXT_TABLE = "torchtitan_long_context.csv"
#: a row's GPU -> the preset it is simulated on (module docstring: Meta's HBM2e H100 on
#: the DGX H100's, its memory replaced: :data:`META_H100_MEMORY`)
GPU_PRESETS = {"h100-sxm-hbm2e": "h100-dgx", "h200-sxm": "h200-dgx"}
#: GEMMs measured on a 500 W H100 at Meta (FBGEMM pull request 2546, 2024-04-29, "H100
#: 500W", benchmark output in its description): (m, k, n, dtype, TFLOP/s) — cuBLAS BF16
#: (``torch.mm``) and FBGEMM's row-wise scaled FP8 GEMM alone ("fp8 row gemm only", its
#: casts not counted). The sources of Meta's H100 compute speed (:func:`meta_h100_device`)
META_H100_GEMMS = (
    (8192, 8192, 8192, "bf16", 585.23), (65536, 8192, 7168, "bf16", 575.12),
    (65536, 3584, 8192, "bf16", 546.31), (8192, 8192, 8192, "fp8", 1125.51),
    (65536, 8192, 7168, "fp8", 1082.75), (65536, 3584, 8192, "fp8", 1141.38))
_META_H100_GEMMS_SOURCE = ("FBGEMM pull request 2546 (github.com/pytorch/FBGEMM/pull/2546, "
                           "'H100 500W'): {dtype} GEMMs {shapes} measured at {measured} "
                           "TFLOP/s, which this model prices on the 700 W DGX H100 at "
                           "{priced}: their mean ratio")
#: the memory of Meta's H100 (``h100-sxm-hbm2e``), over the DGX H100 preset's 80 GB of
#: HBM3 at 3.35 TB/s; same die, NVLink and 400 Gb/s per GPU otherwise
META_H100_MEMORY = MappingProxyType({
    "hbm_bytes": {"value": 96e9, "source": "torchtitan_long_context.csv header, from the "
                  "torchtitan paper (arXiv 2410.06511) section 3.1: 96 GB HBM2e H100 SXM "
                  "parts (95 GiB visible)"},
    "hbm_bandwidth_gbps": {"value": 2400.0, "source": "the same header: HBM2e at 2.4 TB/s; "
                           "2.41 TB/s for the 94 GiB HBM2e H100 in Ujeniya et al. 2026, "
                           "arXiv 2604.11391 (power-capping study of H100 and H200)"}})


def meta_h100_device() -> dict:
    """The device fields of Meta's H100 over the DGX H100 preset's: its memory
    (:data:`META_H100_MEMORY`) and the compute speed its 500 W power limit leaves
    (``sustained_compute_ratio``: BF16, and the attention curves' BF16 kernels;
    ``sustained_compute_ratio_by_dtype``: FP8), each the mean over
    :data:`META_H100_GEMMS` of measured / this model's price of the same GEMM on the 700 W
    part — a hardware measurement, no row of the table consulted. Row-wise FP8 is a
    CUTLASS kernel no faster than cuBLAS's tensor-wise one (github.com/pytorch/pytorch
    issue 147971), so the FP8 ratio is a lower bound for the tensor-wise runs."""
    device = preset(GPU_PRESETS["h100-sxm-hbm2e"]).device
    ratios = {}
    for dtype in ("bf16", "fp8"):
        rows = [(m, k, n, t) for m, k, n, d, t in META_H100_GEMMS if d == dtype]
        priced = [2 * m * k * n / device.matmul_time_s(m, k, n, dtype) / 1e12
                  for m, k, n, _ in rows]
        ratio = statistics.fmean(t / p for (*_, t), p in zip(rows, priced))
        ratios[dtype] = {"value": round(ratio, 4), "source": _META_H100_GEMMS_SOURCE.format(
            dtype=dtype.upper(), shapes=", ".join(f"{m}x{k}x{n}" for m, k, n, _ in rows),
            measured=", ".join(f"{t:g}" for *_, t in rows),
            priced=", ".join(f"{p:.1f}" for p in priced))}
    return {"name": "H100-SXM5-96GB-HBM2e-500W", **META_H100_MEMORY,
            "sustained_compute_ratio": ratios["bf16"],
            "sustained_compute_ratio_by_dtype": {"fp8": ratios["fp8"]}}


#: the sequence bands of the benchmark goal: (label, lowest, highest) in tokens
BANDS = (("<=4K", 0, 4096), ("8-16K", 8192, 16384), ("32K", 32768, 32768),
         (">=64K", 65536, math.inf))
#: the one-GPU sequence sweep (module docstring) and the preset its rows run on
GPU_SWEEP_TABLE = "h200_llama_steps.csv"
GPU_SWEEP_HARDWARE = "h200-dgx"
#: the columns of a :data:`GPU_SWEEP_TABLE` row that give its model's layer shapes
GPU_SWEEP_SHAPES = ("hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "layers")


def band_of(seq: int) -> str:
    """The label of the :data:`BANDS` band ``seq`` falls in ("" between bands)."""
    return next((label for label, lo, hi in BANDS if lo <= seq <= hi), "")


#: torchtitan's activation checkpointing -> the program's recompute: ``full`` is PyTorch's
#: non-reentrant checkpoint, which stops before W_down (``full-torch``, since 2026-11-30)
_TORCH_AC = MappingProxyType({"none": "none", "op": "op", "full": "full-torch"})


#: a row's ``float8_recipe`` -> the cast kernels priced beside its FP8 GEMMs
_FP8_CASTS = MappingProxyType({"tensorwise": "torchao-tensorwise",
                               "rowwise": "torchao-rowwise"})


def fp8_casts_of(r: dict) -> str | None:
    """The ``fp8_casts`` of a row (:mod:`.float8_casts`): its Float8 recipe's cast
    kernels, None without Float8."""
    return _FP8_CASTS[r["float8_recipe"]] if r["float8"] == "1" else None


def row_config(r: dict) -> tuple:
    """(config, parallel, fp8, refusals) of a row (module docstring); with refusals the
    row is not simulated."""
    refusals = []
    for key, what in (("micro_batch", "the micro-batch"), ("vp", "the interleaving"),
                      ("compiled", "whether torch.compile ran")):
        if not r[key]:
            refusals.append(f"{key}='': the source does not state {what}")
    cfg = GPTConfig(hidden=int(r["hidden"]), layers=int(r["layers"]), heads=int(r["heads"]),
                    seq=int(r["seq"]), vocab=int(r["vocab"]), arch=r["arch"],
                    kv_heads=int(r["kv_heads"]), ffn_hidden=int(r["ffn_hidden"]))
    if refusals:
        return cfg, None, False, refusals
    tp, pp, cp, dp, vp = (int(r[k]) for k in ("tp", "pp", "cp", "fsdp", "vp"))
    try:
        par = ParallelConfig(
            global_batch=int(r["global_batch"]), micro_batch=int(r["micro_batch"]), dp=dp,
            tp=tp, pp=pp, cp=cp, schedule="interleaved_1f1b" if vp > 1 else "1f1b",
            virtual_stages=vp if vp > 1 else None, sequence_parallel=tp > 1,
            zero_stage=3 if pp == 1 else 1,
            recompute=_TORCH_AC[r["activation_checkpointing"]], grad_reduce_dtype="fp32",
            attention="flash2", tp_overlap="te" if r["tp_overlap"] == "1" else "backward")
    except ConfigError as e:
        return cfg, None, False, [str(e)]
    return cfg, par, r["float8"] == "1", []


def _hardware(gpu: str):
    """The hardware a row's ``gpu`` is simulated on: its :data:`GPU_PRESETS` preset, with
    Meta's H100 (:func:`meta_h100_device`) on ``h100-sxm-hbm2e``."""
    if gpu != "h100-sxm-hbm2e":
        return GPU_PRESETS[gpu]
    return hardware_from_dict({"base": GPU_PRESETS[gpu], "device": meta_h100_device()})


def _first_run_hardware(name: str):
    """Preset ``name`` as the model priced it before issue 54: fused attention at the
    device's achieved GEMM rate (no published curves), the preset's own memory."""
    return hardware_from_dict({"base": name, "device": {"attention_gpu": "",
                                                         "attention_kernel": ""}})


def _first_run_parallel(par):
    """``par`` as the model ran it before issue 54: the device's default fused attention,
    no TE overlap, torchtitan's ``op`` checkpointing as ``selective``, ZeRO-1 beside
    tensor parallelism."""
    return dataclasses.replace(par, attention="flash", tp_overlap="backward",
                               zero_stage=1 if par.tp > 1 else par.zero_stage,
                               recompute={"op": "selective", "full-torch": "full"}.get(
                                   str(par.recompute), par.recompute))


def _case(r: dict) -> str:
    how = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "cp") if r[k] not in ("1", ""))
    extra = [x for x, on in (("compile", r["compiled"] == "1"), ("float8", r["float8"] == "1"),
                             ("asyncTP", r["tp_overlap"] == "1")) if on]
    return (f"{r['model']} s={int(r['seq']) // 1024}K {r['gpus']}x{r['gpu']} fsdp={r['fsdp']}"
            f"{' ' + how if how else ''} AC={r['activation_checkpointing']}"
            f"{' ' + '+'.join(extra) if extra else ''}")


def validate_long_context(on_row=None, rows_of=None) -> list[dict]:
    """Every row of :data:`LONG_CONTEXT_TABLE` (``rows_of``: a predicate on the table's
    rows, as :func:`~vcluster.timing.read_data_csv` reads them, keeping only some):
    ``predicted`` (tokens/s per GPU), its ``rel_error``, the ``first_run`` prediction and
    error, the row's sequence ``band``; ``status`` predicted or refused (with ``reason``).
    ``on_row``: called after each."""
    rows = []
    for i, r in enumerate(read_data_csv(LONG_CONTEXT_TABLE)[1]):
        if rows_of is not None and not rows_of(r):
            continue
        cfg, par, fp8, refusals = row_config(r)
        out = {"table": LONG_CONTEXT_TABLE, "row": i + 1, "case": _case(r),
               "source_row": r["source_row"], "seq": cfg.seq, "band": band_of(cfg.seq),
               "metric": "tokens_per_s_per_gpu", "published": float(r["tokens_per_s_per_gpu"]),
               "role": "held_out"}
        if refusals:
            rows.append(out | {"status": "refused", "reason": "; ".join(refusals)})
        else:
            preset = GPU_PRESETS[r["gpu"]]
            tokens = par.global_batch * cfg.seq / par.gpus
            sim = simulate_gpt(cfg, par, _hardware(r["gpu"]), fp8=fp8,
                               eager_kernels=r["compiled"] == "0", fp8_casts=fp8_casts_of(r),
                               fsdp2_copies=par.zero_stage >= 2, torch_cp=par.cp > 1)
            first = simulate_gpt(cfg, _first_run_parallel(par), _first_run_hardware(preset),
                                 fp8=fp8)
            predicted, before = tokens / sim.step_time_s, tokens / first.step_time_s
            rows.append(out | {"status": "predicted", "hardware": preset,
                               "predicted": predicted,
                               "rel_error": predicted / out["published"] - 1,
                               "first_run": before,
                               "first_run_error": before / out["published"] - 1,
                               "fits": sim.fits})
        if on_row is not None:
            on_row()
    return rows


def summary_by_band(rows: list[dict], key: str = "rel_error") -> dict:
    """Per :data:`BANDS` label: rows, mean signed error, mean |error| of the predicted rows
    (``key``: rel_error, or first_run_error)."""
    out = {}
    for label, _, _ in BANDS:
        errs = [r[key] for r in rows if r["status"] == "predicted" and r["band"] == label]
        out[label] = None if not errs else {
            "rows": len(errs), "mean_signed": statistics.fmean(errs),
            "mean_abs": statistics.fmean(abs(e) for e in errs)}
    return out


def validate_gpu_sweep(on_row=None) -> list[dict]:
    """Every row of :data:`GPU_SWEEP_TABLE` (module docstring), in the rows' form of
    :func:`validate_long_context` (``metric`` tokens_per_s_per_gpu: tokens per step over
    the step time) with the measured ``step_ms`` and ``predicted_step_ms`` beside it.
    ``on_row``: called after each."""
    rows = []
    for i, r in enumerate(read_data_csv(GPU_SWEEP_TABLE)[1]):
        seq, b, layers = int(r["seq"]), int(r["micro_batch"]), int(r["layers"])
        cfg = GPTConfig(seq=seq, arch="llama", **{k: int(r[k]) for k in GPU_SWEEP_SHAPES})
        par = ParallelConfig(global_batch=b, micro_batch=b,
                             recompute=_TORCH_AC[r["recompute"]], attention="flash2")
        compiled = r["compiled"] == "1"
        # the step's memory is PyTorch AMP's, which the torch_amp count prices for the GPT
        # alone: step time is what is compared (Megatron's bytes, the default policy: its
        # optimizer step moves 30 bytes a parameter where AMP's fused AdamW moves 28)
        sim = simulate_gpt(cfg, par, GPU_SWEEP_HARDWARE, eager_kernels=not compiled)
        first = simulate_gpt(cfg, _first_run_parallel(par),
                             _first_run_hardware(GPU_SWEEP_HARDWARE))
        tokens, measured_s = b * seq, float(r["step_ms"]) / 1e3
        published = tokens / measured_s
        predicted, before = tokens / sim.step_time_s, tokens / first.step_time_s
        rows.append({
            "table": GPU_SWEEP_TABLE, "row": i + 1, "seq": seq, "band": band_of(seq),
            "case": f"llama3.1-{r['model']} shapes, {layers} layers, s={seq // 1024}K b={b} "
                    f"{'compiled' if compiled else 'eager'} AC={r['recompute']}",
            "metric": "tokens_per_s_per_gpu", "published": published, "role": "held_out",
            "status": "predicted", "hardware": GPU_SWEEP_HARDWARE, "compiled": compiled,
            "step_ms": float(r["step_ms"]), "predicted_step_ms": sim.step_time_s * 1e3,
            "predicted": predicted, "rel_error": predicted / published - 1,
            "first_run": before, "first_run_error": before / published - 1, "fits": sim.fits})
        if on_row is not None:
            on_row()
    return rows
