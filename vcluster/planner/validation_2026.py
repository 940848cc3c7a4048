"""The timing model against published training throughput on the hardware of 2026.

Two shipped tables (their header lines give every source, commit and doubt):

* ``megatron_bridge_blackwell.csv``: NVIDIA Megatron-Bridge's and NeMo 2.0's pre-training
  rows on DGX-B200, DGX-B300, DGX-GB200 and DGX-GB300 (Llama 3/3.1 8B-405B, GPT-3 175B,
  DeepSeek-V3, Qwen3, GPT-OSS, Mixtral), 25.02 to 26.08 containers, in BF16, FP8 (tensor
  scaling), MXFP8 and NVFP4;
* ``amd_instinct_training.csv``: AMD's published 8-node rows on MI325X and MI355X (as
  AMD's Primus team quotes them: no global batch stated).

Each row is simulated (:func:`row_config`) on the preset of its system
(:data:`SYSTEM_PRESETS`) with its linear GEMMs in its precision's format
(:data:`PRECISION_FORMATS`, priced by :mod:`vcluster.timing.gemm_formats` at that dtype's
measured share of the peak) and compared on tokens/s per GPU. Every row is ``held_out``
but those of :data:`FIT_ROWS`: the rows seen before a preset constant was chosen (the
GB300's GEMM efficiencies were taken from the B300's measurements after one GB300 row's
error was seen; nothing was tuned on any other row). A row the program cannot run yet is
``refused`` with every ConfigError's message; one it accepts and cannot trace ``failed``.

Each predicted row also carries the memory model's verdict (``fits``, ``peak_memory_gb``,
``memory_limit_gb``): every row is a configuration that ran, so a row the model says does
not fit is a miss of the memory model, counted per GPU kind (:func:`summary_by_kind`).
Its bytes are the row's recipe's (:func:`row_precision`): Megatron-Bridge's performance
recipes keep bf16 main gradients (``megatron_bf16``), the others Megatron's default fp32
ones (not read: NeMo 2.0's recipes, AMD's); with low-precision GEMMs on NVIDIA's systems
Transformer Engine keeps its GEMMs' quantised inputs.

A Blackwell row's fused attention is priced by the cuDNN curves its container's cuDNN
release is nearest to (:func:`row_attention`): the release each NeMo container ships
(:data:`CONTAINER_CUDNN`) against the releases published on the same GPU silicon
(:data:`SAME_SILICON`: a GB200's GPUs are B200s, a GB300's B300s); 9.13.1's B200 curves
for a 25.11 row, GB200's 9.19.1 for a 26.04 one. Written after one run that put the GB200
25.x rows on B200's 9.13.1 curves (GB200 mean |error| 18.3% to 16.9%): stated as such in
docs/hardware.md ("Attention at each row's cuDNN release").
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from types import MappingProxyType

from modeling import ConfigError, padded_vocab
from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.runtime.tracing import TraceError
from vcluster.timing import read_data_csv
from vcluster.timing.attention_kernels import cudnn_releases
from vcluster.timing.presets import preset

from .candidates import stage_split, with_node_ranks
from .precision import PrecisionPolicy, precision_policy
from .search import REPLAY_TIMEOUT_S, process_pool
from .simulation import simulate_gpt
from .validation import MOE_DEFAULT_ETP, recipe_dispatcher, recipe_recompute

__all__ = ["TABLES_2026", "SYSTEM_PRESETS", "PRECISION_FORMATS", "FIT_ROWS", "row_config",
           "validate_2026", "summary_by_kind", "CONTAINER_CUDNN", "SAME_SILICON",
           "row_attention", "row_precision"]

TABLES_2026 = ("megatron_bridge_blackwell.csv", "amd_instinct_training.csv")
SYSTEM_PRESETS: Mapping[str, str] = MappingProxyType({
    "DGX-B200": "b200-dgx", "DGX-B300": "b300-dgx", "DGX-GB200": "gb200-nvl72",
    "DGX-GB300": "gb300-nvl72", "MI300X": "mi300x", "MI325X": "mi325x", "MI355X": "mi355x"})
# a row's precision as published -> the GEMM format its linear layers are priced in
# (None: BF16); FP8-CS / FP8-DS are Transformer Engine's current / delayed tensor scaling
PRECISION_FORMATS: Mapping[str, str | None] = MappingProxyType({
    "BF16": None, "FP8": "fp8", "FP8-CS": "fp8", "FP8-DS": "fp8", "FP8-MX": "mxfp8",
    "MXFP8": "mxfp8", "NVFP4": "nvfp4"})
# (table, model, system, precision, release) of the rows seen before a constant was chosen
FIT_ROWS = frozenset({
    ("megatron_bridge_blackwell.csv", "LLAMA3_8B", "DGX-GB300", "FP8-CS",
     "25.11 NeMo container (Megatron-Bridge)"),
})


#: a NeMo container (YY.MM; its patch releases YY.MM.NN assumed the same) -> the cuDNN
#: release it ships (github.com/NVIDIA-NeMo/Megatron-Bridge docs/releases/
#: software-versions.md at 067f987df: 25.09 9.11.0.98, 25.11 9.13.1.26, 26.02 9.18.0.50,
#: 26.04 9.20.0.48, 26.06 9.21.1.3; 26.08 and the NeMo 2.0 containers are not listed)
CONTAINER_CUDNN: Mapping[str, str] = MappingProxyType({
    "25.09": "9.11.0", "25.11": "9.13.1", "26.02": "9.18.0", "26.04": "9.20.0",
    "26.06": "9.21.1"})
#: a preset -> the GPUs of attention_benchmarks.csv measured on the same silicon (GB200's
#: GPUs are B200 dies, GB300's B300: NVIDIA's GB200/GB300 NVL72 pages)
SAME_SILICON: Mapping[str, tuple] = MappingProxyType({
    "b200-dgx": ("b200", "gb200"), "gb200-nvl72": ("b200", "gb200"),
    "b300-dgx": ("gb300",), "gb300-nvl72": ("gb300",)})


@functools.lru_cache(maxsize=None)
def _attention_gpu(preset_name: str) -> str:
    """The preset's own attention curves' GPU (built once per preset, not once per row)."""
    return preset(preset_name).device.attention_gpu


def row_attention(r: dict, preset_name: str) -> tuple:
    """(the device fields that price a row's cuDNN attention, a note for ``assumed``):
    the published cuDNN release nearest the row's container's (:data:`CONTAINER_CUDNN`;
    nearest in minor version, the lower on a tie, the preset's own curves on an exact
    tie) among the GPUs of the same silicon (:data:`SAME_SILICON`); ({}, "") where the
    container's release or the silicon's curves are not known (the preset's default)."""
    container = ".".join(r.get("release", "").split(" ")[0].split(".")[:2])
    want, gpus = CONTAINER_CUDNN.get(container), SAME_SILICON.get(preset_name)
    if not want or not gpus:
        return {}, ""
    own = _attention_gpu(preset_name)

    def distance(option):
        gpu, release = option
        minor, want_minor = (int(v.split(".")[1]) for v in (release, want))
        return (abs(minor - want_minor), minor > want_minor, gpu != own)

    gpu, release = min(((g, c) for g in gpus for c in cudnn_releases(g)), key=distance)
    return ({"attention_gpu": gpu, "attention_kernel": "cudnn", "attention_cudnn": release},
            f"attention: cuDNN {release}'s {gpu} curves (the {container} container ships "
            f"cuDNN {want})")


#: the systems whose rows ran Megatron-Bridge / NeMo with Transformer Engine's TP overlap
#: where tp > 1 (the recipes keep CommOverlapConfig(tp_comm_overlap=True) with sequence
#: parallelism: github.com/NVIDIA-NeMo/Megatron-Bridge scripts/performance, tags v0.1.0rc4
#: to v0.5.0; NeMo 2.0's recipes likewise)
_TE_SYSTEMS = frozenset({"DGX-B200", "DGX-B300", "DGX-GB200", "DGX-GB300"})


def _key(table: str, r: dict) -> tuple:
    return (table, r["model"], r["system"], r["precision"], r["release"])


def row_config(r: dict) -> tuple:
    """(config, parallel, gemm_format, assumed, refusals) of a row: its GPTConfig (from its
    model preset, ``GPTConfig.of_model(preset, seq, timing_only=True)``), its
    ParallelConfig, the GEMM format of its precision, what was assumed where the source is
    silent, and every ConfigError's message (a row with refusals is not simulated).

    The model's vocabulary padded as Megatron pads it (:func:`modeling.padded_vocab`: a
    multiple of 128·tp; both tables' frameworks are Megatron's). The plan as published:
    dp = GPUs / (tp·pp·cp), tp, pp, cp, ep (MoE: etp
    :data:`~.validation.MOE_DEFAULT_ETP`); the interleaved 1F1B schedule with ``vp``
    virtual stages where vp > 1; sequence parallelism where tp > 1; the recomputation the
    row's Megatron-Bridge recipe sets (:func:`~.validation.recipe_recompute`: the
    ``recompute_granularity`` and ``recompute_modules`` columns; none where not known, as
    the published tables state none; since 2026-11-30); a layer count pp·vp does not
    divide split as Megatron-Core's embedding- and loss-accounting split, or as the
    recipe's layout leaves an end stage the embedding or the head alone
    (:func:`~.candidates.stage_split` with ``empty_ends``; since 2026-12-01: Llama 3.1
    405B on pp 16 × vp 8, DeepSeek-V3 on pp 8 × vp 4, refused before). The
    optimizer: Megatron FSDP (``fsdp`` 1) is ZeRO-3; Transformer Engine's tensor-parallel
    overlap (``tp_overlap="te"``) on NVIDIA systems where tp > 1 (since issue 54; the
    recipes keep it on, :data:`_TE_SYSTEMS`); otherwise Megatron's distributed
    optimizer (ZeRO-1; with ep > 1 the experts' state over the expert-data-parallel ranks,
    since 2026-11-30 — before, plain data-parallel gradients:
    :func:`~.validation.moe_row_config`). Megatron-Core's MoE all-to-all overlap
    (``moe_comm_overlap``, the combined 1F1B) where the row's recipe turned it on (the
    table's ``moe_a2a_overlap`` column, read from the Megatron-Bridge recipe of the row's
    release, ``recipe_source``; empty: not known, simulated without) and the recipe's token
    dispatcher (:func:`~.validation.recipe_dispatcher`: DeepEP and HybridEP run as
    ``flex``; empty: Megatron-Core's default ``alltoall``), and its activation offloading
    to host memory (``activation_offload``: the recipe's ``cpu_offloading_num_layers`` over
    the model's layers, the ``activation_offload_layers`` column), all since 2026-11-30;
    a flex row whose expert group spans several scale-up domains of its system's preset
    runs DeepEP's internode path, each token once per destination domain
    (``moe_ep_node_ranks``, :func:`~.candidates.with_node_ranks`; since 2026-11-30);
    where the group does not split into whole domains (256 GPUs over 72-GPU NVL72
    racks) it keeps the one-hop flex, and ``assumed`` says so.
    A row with no global batch (AMD's) and no pipeline is simulated with one
    micro-batch per step (``assumed``); with a pipeline it is refused (its bubble depends
    on the batch)."""
    refusals, assumed = [], []
    tp, pp, cp, vp = (int(r[k]) for k in ("tp", "pp", "cp", "vp"))
    try:
        cfg = GPTConfig.of_model(r["preset"], seq=int(r["seq"]), timing_only=True)
    except ConfigError as e:
        return None, None, None, assumed, [str(e)]
    # Megatron pads the vocabulary to a multiple of 128·tp (padded_vocab; since
    # 2026-11-30: GPT-3's 50,257 tokens did not split over tp 4, and its rows were refused)
    cfg = dataclasses.replace(cfg, vocab=padded_vocab(cfg.vocab, tp))
    precision = r["precision"]
    if precision not in PRECISION_FORMATS:
        refusals.append(str(ConfigError("precision", precision, ", ".join(PRECISION_FORMATS),
                                        "not a precision this validation maps to a format")))
    ep = int(r["ep"] or 1)
    dp = int(r["gpus"]) // (tp * pp * cp)
    micro = int(r["micro_batch"])
    if r["global_batch"]:
        global_batch = int(r["global_batch"])
    elif pp == 1:
        global_batch = micro * dp
        assumed.append("global batch not published: one micro-batch per step")
    else:
        return cfg, None, None, assumed, refusals + [str(ConfigError(
            "global_batch", "", "a published global batch", "a pipeline's bubble depends on "
            "the micro-batches per step, which the source does not state"))]
    ends = stage_split(cfg.layers, pp * vp, empty_ends=True) or ()
    zero = 3 if r["fsdp"] == "1" else 1
    try:
        recompute, modules = recipe_recompute(r) or ("none", None)
        par = ParallelConfig(recompute=recompute,
                             **({"recompute_modules": modules} if modules else {}),
                             global_batch=global_batch, micro_batch=micro, dp=dp, pp=pp, tp=tp,
                             cp=cp, ep=ep, etp=MOE_DEFAULT_ETP if ep > 1 else None,
                             first_stage_layers=ends[0] if ends else None,
                             last_stage_layers=ends[1] if ends else None,
                             schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                             virtual_stages=vp if vp > 1 else None, sequence_parallel=tp > 1,
                             zero_stage=zero,
                             tp_overlap="te" if tp > 1 and r["system"] in _TE_SYSTEMS
                             else "backward",
                             moe_comm_overlap=r.get("moe_a2a_overlap") == "1",
                             moe_dispatcher=recipe_dispatcher(r),
                             activation_offload=int(r.get("activation_offload_layers") or 0)
                             / cfg.layers)
    except ConfigError as e:
        return cfg, None, None, assumed, refusals + [str(e)]
    if r["system"] in SYSTEM_PRESETS:            # DeepEP / HybridEP across domains
        try:
            par = with_node_ranks(par, SYSTEM_PRESETS[r["system"]])
        except ConfigError as e:                 # e.g. 256 GPUs over NVL72 racks
            assumed.append(f"the flex dispatcher in one hop: {e}")
    for check in (par.check_microbatches, lambda: par.check(cfg, par.mesh())):
        try:
            check()
        except ConfigError as e:
            refusals.append(str(e))
    return cfg, par, PRECISION_FORMATS.get(precision), assumed, refusals


def row_precision(r: dict) -> PrecisionPolicy:
    """The memory model's precision policy (:mod:`.precision`) of a row: ``megatron_bf16``
    for a Megatron-Bridge release, whose performance recipes set ``grad_reduce_in_fp32 =
    False`` in every tag from v0.1.0rc3 (the 25.09 container) to v0.6.0 (26.08) — bf16
    main gradients; ``megatron`` (fp32 main gradients, Megatron-LM's default) for the
    others, whose recipes were not read. On NVIDIA's systems (Megatron with Transformer
    Engine, NeMo 2.0's too) a row with low-precision GEMMs keeps their quantised inputs
    (:meth:`~.precision.PrecisionPolicy.with_quantised_gemm_inputs`: ``+fp8``, ``+mxfp8``,
    ``+nvfp4``; counted for the Llama block, which every such row but GPT-3's runs: GPT-3
    175B keeps the bf16 count); AMD's rows keep the bf16 count (their recipes were not
    read)."""
    policy = precision_policy("megatron_bf16" if "(Megatron-Bridge)" in r["release"]
                              else "megatron")
    fmt = PRECISION_FORMATS.get(r["precision"])
    if fmt is not None and r["system"] in _TE_SYSTEMS and r["arch"] != "gpt":
        policy = policy.with_quantised_gemm_inputs(fmt)
    return policy


def _case(r: dict) -> str:
    how = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "cp", "vp", "ep") if r[k] not in ("", "1"))
    return (f"{r['model']} {r['precision']} {r['gpus']}x{r['system']} {how or 'dp only'}"
            f"{' fsdp' if r['fsdp'] == '1' else ''} mb={r['micro_batch']} "
            f"B={r['global_batch'] or '?'} ({r['release']})")


def _predict(args) -> tuple:
    """Worker: (tokens/s per GPU, None, the memory model's verdict) of one row's plan, or
    (None, the TraceError's text, None): a defect, not a limit (top-level so that a
    process pool can pickle it)."""
    cfg, par, hardware, fmt, precision = args
    try:
        sim = simulate_gpt(cfg, par, hardware, fp8=fmt is not None, gemm_format=fmt or "fp8",
                           precision=precision)
    except TraceError as e:
        return None, f"{type(e).__name__}: {e}", None
    return sim.tokens_per_s_per_gpu, None, {"fits": sim.fits,
                                            "peak_memory_gb": sim.peak_memory_gb,
                                            "memory_limit_gb": sim.memory_limit_gb}


def validate_2026(tables=TABLES_2026, latest_only: bool = False, on_row=None,
                  select=None, workers: int = 1) -> list[dict]:
    """One result per row of ``tables`` (module docstring), in order: ``source``,
    ``case``, ``system``, ``hardware`` (the preset), ``metric`` (tokens_per_s_per_gpu),
    ``family`` (``dense`` or ``moe``: the row's experts), ``published``, ``predicted`` and
    ``rel_error`` (None unless ``status`` is
    ``predicted``), ``role``, ``status`` (``predicted``, ``refused``, ``failed``),
    ``reason``, ``assumed``, ``precision`` (:func:`row_precision`) and, predicted,
    ``fits``, ``peak_memory_gb``, ``memory_limit_gb``. ``latest_only``: the rows the
    sources mark as their latest release of each configuration. ``on_row``: called after each row (progress).
    ``select``: a predicate on the table's row (a dict of its columns): only those.
    ``workers``: processes that simulate the rows (default 1: this one; the rows are
    independent, so more give the same results sooner — :func:`~.search.process_pool`)."""
    out, jobs = [], []            # jobs: (index in out, what _predict takes)
    for table in tables:
        for r in read_data_csv(table)[1]:
            if (latest_only and r.get("latest") != "1") or (select and not select(r)):
                continue
            cfg, par, fmt, assumed, refusals = row_config(r)
            hardware = SYSTEM_PRESETS.get(r["system"])
            result = {"source": table, "case": _case(r), "system": r["system"],
                      "family": "moe" if int(r["experts"] or 0) > 0 else "dense",
                      "hardware": hardware, "metric": "tokens_per_s_per_gpu",
                      "published": float(r["tokens_per_s_per_gpu"]), "predicted": None,
                      "rel_error": None, "role": "fit" if _key(table, r) in FIT_ROWS
                      else "held_out", "status": "predicted", "reason": "",
                      "assumed": "; ".join(assumed)}
            precision = row_precision(r)
            result["precision"] = precision.name
            if hardware is None:
                refusals.append(f"system {r['system']!r} has no preset; known: "
                                f"{', '.join(SYSTEM_PRESETS)}")
            if refusals:
                result.update(status="refused", reason="; ".join(refusals))
                if on_row is not None:
                    on_row()
            else:
                device, note = row_attention(r, hardware)
                if note:
                    result["assumed"] = "; ".join(x for x in (result["assumed"], note) if x)
                jobs.append((len(out), (cfg, par, {"base": hardware, "device": device}
                                        if device else hardware, fmt, precision)))
            out.append(result)

    def record(i: int, predicted, failure, memory) -> None:
        if failure is not None:
            out[i].update(status="failed", reason=failure)
        else:
            out[i].update(predicted=predicted, rel_error=predicted / out[i]["published"] - 1,
                          **memory)
        if on_row is not None:
            on_row()

    pool = process_pool(workers, len(jobs), "validate-model")
    if pool is None:
        for i, args in jobs:
            record(i, *_predict(args))
        return out
    with pool:
        futures = [(i, pool.submit(_predict, args)) for i, args in jobs]
        for i, fut in futures:
            try:
                record(i, *fut.result(timeout=REPLAY_TIMEOUT_S))
            except FutureTimeout:
                for _, f in futures:
                    f.cancel()
                raise TimeoutError(f"validate-model: waited {REPLAY_TIMEOUT_S:.0f} s for the "
                                   f"worker simulating {out[i]['case']}; it did not "
                                   f"finish") from None
    return out


def _stats(errs: list) -> dict | None:
    return None if not errs else {
        "predicted": len(errs), "mean_abs": statistics.fmean(abs(e) for e in errs),
        "median_abs": statistics.median(abs(e) for e in errs),
        "mean_signed": statistics.fmean(errs)}


def summary_by_kind(rows: list[dict]) -> dict:
    """Per GPU kind (preset) and role (``held_out``, ``fit``; and ``<role>_dense``,
    ``<role>_moe`` apart): rows predicted, mean and median |error|, mean signed error;
    with the counts of rows refused and failed, and ``fits``: of the rows predicted (every
    one a configuration that ran), how many the memory model says fit."""
    out: dict = {}
    for kind in sorted({r["hardware"] or r["system"] for r in rows}):
        mine = [r for r in rows if (r["hardware"] or r["system"]) == kind]
        entry = {"rows": len(mine),
                 "refused": sum(r["status"] == "refused" for r in mine),
                 "failed": sum(r["status"] == "failed" for r in mine),
                 "fits": sum(bool(r.get("fits")) for r in mine
                             if r["status"] == "predicted")}
        for role in ("held_out", "fit"):
            done = [r for r in mine if r["role"] == role and r["status"] == "predicted"]
            entry[role] = _stats([r["rel_error"] for r in done])
            for family in ("dense", "moe"):
                entry[f"{role}_{family}"] = _stats([r["rel_error"] for r in done
                                                    if r["family"] == family])
        out[kind] = entry
    return out
