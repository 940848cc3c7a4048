"""Predicted against published: Megatron-LM's iteration times and TFLOP/s per GPU (and,
in :func:`validate_recompute`, Korthikanti et al. 2022's iterations and layer times with
full and selective recomputation, run as that paper gives them; in :func:`validate_fsdp`,
MosaicML's measured MPT throughput under FSDP on A100s and H100s; in :func:`validate_fp8`,
NeMo's FP8 pretraining throughput on H100s; in :func:`validate_moe`, published
mixture-of-experts pretraining throughput on H100s, each row predicted or refused with its
reason).

Every row of ``megatron_2020_a100.csv`` (iteration time, ms) and
``megatron_sc21_table1.csv`` (TFLOP/s per GPU) is simulated with
:func:`~vcluster.planner.simulation.simulate_gpt` on the A100-80GB DGX preset,
with one documented default for what the tables leave out, the same for every row:

* the micro-batch size: with pipeline parallelism 1 (``DEFAULT_MICRO_BATCH``, Megatron's
  default), without it the whole per-replica batch B/dp — no gradient accumulation,
  which only costs time when there is no pipeline to fill (:func:`micro_batch_for`);
* the 1F1B schedule without interleaving;
* full activation recomputation (the papers' TFLOP/s count it: 96·B·s·l·h²(...));
* no sequence parallelism (it came after both papers), mixed precision (bf16 peak);
* unfused attention (``attention="unfused"``): both papers predate FlashAttention (2022);
  Megatron's fused softmax kernel still writes the s² scores.
* every tensor-parallel collective on the critical path (``tp_overlap="none"``): neither
  paper describes the asynchronous input-gradient reduction that Megatron-LM added later
  in 2021 (Korthikanti et al. 2022 §6.2 describe it, and :func:`validate_recompute` runs
  with it).

``rel_error`` = predicted / published − 1. TFLOP/s per GPU is computed as the papers do:
the recomputation-inclusive FLOPs 96·B·s·l·h²·(1 + s/6h + V/16lh) over (GPUs × time).
"""

from __future__ import annotations

from types import MappingProxyType

from modeling import ConfigError, block_named
from pipeline_parallel.gpt import GPTConfig, ParallelConfig, megatron_flops_with_recompute
from vcluster.runtime.tracing import TraceError
from vcluster.timing import load_hardware, read_data_csv

from .candidates import stage_split, with_node_ranks
from .simulation import simulate_gpt

__all__ = ["validate_megatron", "validate_recompute", "validate_gpu_steps", "gpu_steps",
           "validate_fsdp", "validate_fp8", "micro_batch_for", "RECOMPUTE_TABLE", "FSDP_TABLE",
           "FSDP_HARDWARE", "FP8_TABLE", "FP8_BRIDGE_TABLE", "FP8_TABLES", "validate_fsdp2",
           "FSDP2_TABLE", "FSDP2_HARDWARE", "validate_moe", "moe_row_config", "MOE_TABLE",
           "MOE_HARDWARE", "MOE_METRICS", "MOE_DEFAULT_ETP", "RECIPE_DISPATCHERS",
           "recipe_dispatcher", "RECIPE_GRANULARITIES", "recipe_recompute",
           "DEFAULT_MICRO_BATCH", "HARDWARE", "GPU_STEP_TABLES", "COMPILED_POLICY"]

#: measured one-GPU PyTorch steps (``vcluster bench gpu-step``): table -> (the preset it
#: is predicted on, the precision policy of the step it measured: PyTorch AMP over fp32
#: parameters, its header says; its ``compiled`` rows are predicted under that policy's
#: compiled counterpart, :data:`COMPILED_POLICY`)
GPU_STEP_TABLES = MappingProxyType({"h200_gpt_steps.csv": ("h200-dgx", "torch_amp"),
                                    "h100_gpt_steps.csv": ("h100-dgx", "torch_amp"),
                                    "h200_shapes_steps.csv": ("h200-dgx", "torch_amp")})

#: a measured step's policy -> the same step's under ``torch.compile``
COMPILED_POLICY = MappingProxyType({"torch_amp": "torch_compile"})

DEFAULT_MICRO_BATCH = 1
HARDWARE = "a100-80gb-dgx"

#: Korthikanti et al. 2022's A100 iterations and layer times with full and selective
#: recomputation (:func:`validate_recompute`)
RECOMPUTE_TABLE = "korthikanti_2022_a100.csv"

#: MosaicML LLM Foundry's measured MPT training throughput under FSDP (:func:`validate_fsdp`)
FSDP_TABLE = "llm_foundry_mpt.csv"

#: that table's GPUs -> the preset its rows are predicted on (the A100 tables' 1600 Gb/s
#: RoCE per node is the DGX A100's 8 x 200 Gb/s)
FSDP_HARDWARE = MappingProxyType({"h100_80gb": "h100-dgx", "a100_80gb": "a100-80gb-dgx",
                                  "a100_40gb": "a100-40gb-dgx"})

#: NeMo 24.07's FP8 pretraining throughput on DGX H100 (:func:`validate_fp8`)
FP8_TABLE = "nemo_2407_h100_fp8.csv"
#: Megatron-Bridge's (NeMo 25.11) FP8 Llama 3 pretraining throughput on DGX H100
#: (:func:`validate_fp8`; added after every constant was set, held out)
FP8_BRIDGE_TABLE = "megatron_bridge_h100_fp8.csv"
#: the FP8 tables :func:`validate_fp8` predicts
FP8_TABLES = (FP8_TABLE, FP8_BRIDGE_TABLE)
#: torchtitan's FSDP2 runs of Llama 2 and Llama 3 on 64 A100-80GB, and the preset they run on
FSDP2_TABLE = "torchtitan_a100_fsdp.csv"
FSDP2_HARDWARE = "a100-80gb-dgx"
#: published mixture-of-experts pretraining throughput on DGX H100: Megatron-Bridge's
#: performance archive and Megatron-Core's MoE Model Zoo (:func:`validate_moe`; every row
#: held out)
MOE_TABLE = "megatron_bridge_h100_moe.csv"
#: the preset :data:`MOE_TABLE`'s rows are simulated on
MOE_HARDWARE = "h100-dgx"
#: a :data:`MOE_TABLE` row's published figures; the first it gives is its compared metric
MOE_METRICS = ("tokens_per_s_per_gpu", "step_s", "model_tflops_per_gpu")
#: the expert tensor parallelism of a :data:`MOE_TABLE` row whose source does not state it
#: (:func:`moe_row_config`)
MOE_DEFAULT_ETP = 1
#: a recipe's token dispatcher (the MoE tables' ``moe_dispatcher`` column, read from the
#: Megatron-Bridge recipe of the row's release) -> the program's: DeepEP and HybridEP are
#: Megatron-Core's ``flex`` dispatcher (each token sent once per destination rank); a
#: row whose recipe is not known runs Megatron-Core's default, ``alltoall``
RECIPE_DISPATCHERS = MappingProxyType({"": "alltoall", "alltoall": "alltoall",
                                       "allgather": "allgather", "deepep": "flex",
                                       "hybridep": "flex"})


def recipe_dispatcher(r: dict) -> str:
    """The program's dispatcher for a row's recipe (:data:`RECIPE_DISPATCHERS`)."""
    name = r.get("moe_dispatcher") or ""
    if name not in RECIPE_DISPATCHERS:
        raise ConfigError("moe_dispatcher", name, ", ".join(RECIPE_DISPATCHERS),
                          "not a Megatron-Core token dispatcher this validation maps",
                          owner="moe table row")
    return RECIPE_DISPATCHERS[name]


#: a recipe's ``recompute_granularity`` (the 2026 and MoE tables' column, read from the
#: Megatron-Bridge recipe of the row's release) -> the program's ``recompute``
RECIPE_GRANULARITIES = MappingProxyType({"none": "none", "selective": "selective",
                                         "full": "full"})


def recipe_recompute(r: dict) -> tuple | None:
    """(``recompute``, ``recompute_modules`` or None) as a row's recipe sets them — the
    ``recompute_granularity`` and ``recompute_modules`` columns (Megatron-Core's names,
    ``;``-separated; Megatron-Core's default ``core_attn`` where a selective row names
    none) — or None where the recipe is not known (empty granularity)."""
    granularity = r.get("recompute_granularity") or ""
    if not granularity:
        return None
    if granularity not in RECIPE_GRANULARITIES:
        raise ConfigError("recompute_granularity", granularity,
                          ", ".join(RECIPE_GRANULARITIES), "not a Megatron-Core "
                          "recompute granularity", owner="table row")
    names = tuple(m.strip() for m in (r.get("recompute_modules") or "").split(";")
                  if m.strip())
    if granularity != "selective":
        return RECIPE_GRANULARITIES[granularity], None
    return "selective", names or ("core_attn",)

_RECOMPUTE_LABEL = MappingProxyType({"none": "no recompute", "full": "full recompute",
                                     "selective": "selective recompute"})

#: the layer ops of :attr:`GPTSimulation.ops` (the rest: embedding, logits, optimizer)
_LAYER_OPS = ("attention", "mlp")


def _done(on_row) -> None:
    """One more row predicted: ``on_row()`` when given (a progress report)."""
    if on_row is not None:
        on_row()


def micro_batch_for(global_batch: int, dp: int, pp: int) -> int:
    """The documented default micro-batch of every row (see the module docstring)."""
    return global_batch // dp if pp == 1 else DEFAULT_MICRO_BATCH


def _row_result(source: str, case: str, metric: str, published: float, predicted: float):
    return {"source": source, "case": case, "metric": metric, "published": published,
            "predicted": predicted, "rel_error": predicted / published - 1.0}


def _model(r: dict, **extra) -> GPTConfig:
    """The GPTConfig of a table row's hidden, layers, heads, seq and vocab columns."""
    return GPTConfig(**{k: int(r[k]) for k in ("hidden", "layers", "heads", "seq", "vocab")},
                     **extra)


def validate_megatron(hardware: str = HARDWARE, on_row=None) -> list[dict]:
    """Every row of both Megatron tables (``on_row``: called after each, for progress)."""

    rows = []
    for r in read_data_csv("megatron_2020_a100.csv")[1]:
        cfg = _model(r)
        par = ParallelConfig(global_batch=int(r["global_batch"]),
                             micro_batch=micro_batch_for(int(r["global_batch"]), int(r["dp"]),
                                                         int(r["pp"])),
                             dp=int(r["dp"]), pp=int(r["pp"]), tp=int(r["tp"]), recompute="full",
                             attention="unfused", tp_overlap="none")
        sim = simulate_gpt(cfg, par, hardware)
        case = f"{r['model']} tp={r['tp']} pp={r['pp']} dp={r['dp']} ({r['gpus']} GPUs)"
        rows.append(_row_result("megatron_2020_a100.csv", case, "iter_ms",
                                float(r["iter_ms"]), sim.step_time_s * 1e3))
        _done(on_row)
    for r in read_data_csv("megatron_sc21_table1.csv")[1]:
        tp, pp, gpus = int(r["tp"]), int(r["pp"]), int(r["gpus"])
        cfg = _model(r)
        dp = gpus // (tp * pp)
        par = ParallelConfig(global_batch=int(r["global_batch"]),
                             micro_batch=micro_batch_for(int(r["global_batch"]), dp, pp),
                             dp=dp, pp=pp, tp=tp, recompute="full",
                             attention="unfused", tp_overlap="none")
        sim = simulate_gpt(cfg, par, hardware)
        flops = megatron_flops_with_recompute(par.global_batch, cfg.seq, cfg.layers, cfg.hidden,
                                              cfg.vocab)
        case = f"{r['model']} tp={tp} pp={pp} dp={par.dp} ({gpus} GPUs)"
        rows.append(_row_result("megatron_sc21_table1.csv", case, "tflops_per_gpu",
                                float(r["tflops_per_gpu"]), flops / gpus / sim.step_time_s / 1e12))
        _done(on_row)
    return rows


def validate_recompute(hardware: str = HARDWARE, on_row=None, rows=None) -> list[dict]:
    """Every row of :data:`RECOMPUTE_TABLE` (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", 2022): the configuration its header and
    columns give (micro-batch, interleaving degree, recomputation, sequence parallelism as
    run, unfused attention as for the other Megatron tables), simulated on the A100-80GB
    DGX preset, with the asynchronous input-gradient reduction the paper describes
    (§6.2: ``tp_overlap="backward"``). ``iter_s``: the step time. ``layer_ms``: one
    transformer layer's forward plus backward, the step less the other ops' compute and
    communication, over the layers — on one pipeline stage with one micro-batch the rest
    (the embedding, the logits and loss, the optimizer: every op but :data:`_LAYER_OPS`)
    runs apart from the layers, its collectives blocking. ``on_row``: called after each row
    (progress); ``rows``: the table rows to run (dicts as
    :func:`~vcluster.timing.read_data_csv` reads them; default all)."""
    table = read_data_csv(RECOMPUTE_TABLE)[1] if rows is None else rows
    rows, sims = [], {}      # a configuration's iteration and layer rows share its step
    for r in table:
        cfg = _model(r)
        v = int(r["virtual_stages"])
        par = ParallelConfig(global_batch=int(r["global_batch"]),
                             micro_batch=int(r["micro_batch"]), dp=int(r["dp"]),
                             pp=int(r["pp"]), tp=int(r["tp"]),
                             schedule="interleaved_1f1b" if v > 1 else "1f1b",
                             virtual_stages=v if v > 1 else None, recompute=r["recompute"],
                             sequence_parallel=r["sequence_parallel"] == "1",
                             attention="unfused", tp_overlap="backward")
        sim = sims.get((cfg, par))
        if sim is None:
            sim = sims[(cfg, par)] = simulate_gpt(cfg, par, hardware)
        how = _RECOMPUTE_LABEL[r["recompute"]] + (" + sp" if par.sequence_parallel else "")
        if r["metric"] == "iter_s":
            case = f"{r['model']} {how} pp={par.pp} dp={par.dp} ({r['gpus']} GPUs)"
            predicted = sim.step_time_s
        else:
            if par.pp != 1 or par.microbatches != 1:
                raise ValueError(f"{RECOMPUTE_TABLE}: a layer_ms row needs pp = 1 and one "
                                 f"micro-batch, got pp={par.pp}, {par.microbatches}")
            case = f"{r['model']} one layer, {how}"
            rest = sum(o.compute_s + o.comm_s for o in sim.ops if o.op not in _LAYER_OPS)
            predicted = 1e3 * (sim.step_time_s - rest) / cfg.layers
        rows.append(_row_result(RECOMPUTE_TABLE, case, r["metric"], float(r["published"]),
                                predicted))
        _done(on_row)
    return rows


def gpu_steps():
    """Every row of the measured one-GPU step tables (:data:`GPU_STEP_TABLES`) as
    ``(table, preset, precision, row, config, parallel, case)``: the table's preset and
    precision policy (:data:`COMPILED_POLICY`'s for a compiled row), the CSV row
    (``step_ms``, ``peak_gb``, ...), its GPTConfig, one GPU with global batch =
    micro-batch, and the row's label."""
    for table, (preset, precision) in GPU_STEP_TABLES.items():
        for r in read_data_csv(table)[1]:
            cfg = _model(r)
            mb = int(r["micro_batch"])
            compiled = r["compiled"] == "1"
            case = f"{r['model']} 1 GPU mb={mb} {'compiled' if compiled else 'eager'}"
            yield (table, preset, COMPILED_POLICY[precision] if compiled else precision, r, cfg,
                   ParallelConfig(global_batch=mb, micro_batch=mb), case)


def validate_gpu_steps(kernel_table: str = "", on_row=None) -> list[dict]:
    """Every row of :func:`gpu_steps`: step time (ms) and peak memory (GB,
    ``peak_memory_gb``: without the allocator's reserve, as
    ``torch.cuda.max_memory_allocated``), simulated on one GPU of the table's preset under
    the precision policy of the measured step (``torch_amp``: 16 bytes per parameter;
    ``torch_compile`` for a compiled row). ``kernel_table``: a shipped table of measured
    kernels that prices the preset's kernels instead (moved from the GPU that measured it
    to the preset's by datasheet ratios; under ``torch_amp`` that adds plain PyTorch's
    autocast kernels, :mod:`.autocast_kernels`, fused under ``torch_compile``,
    :mod:`.inductor_kernels`). ``on_row``: called after each table row (its two results),
    for progress."""
    rows = []
    hardware = {preset: load_hardware({"base": preset, "device": {"kernel_table": kernel_table}})
                if kernel_table else preset for preset, _ in GPU_STEP_TABLES.values()}
    for table, preset, precision, r, cfg, par, case in gpu_steps():
        sim = simulate_gpt(cfg, par, hardware[preset], precision=precision)
        case = f"{case} ({preset}{', ' + kernel_table if kernel_table else ''})"
        rows.append(_row_result(table, case, "step_ms", float(r["step_ms"]),
                                sim.step_time_s * 1e3))
        rows.append(_row_result(table, case, "peak_gb", float(r["peak_gb"]),
                                sim.peak_memory_gb))
        _done(on_row)
    return rows


def validate_fsdp(rows=None, on_row=None) -> list[dict]:
    """Every row of :data:`FSDP_TABLE` (MosaicML LLM Foundry's MPT benchmarks: Composer and
    PyTorch FSDP ``FULL_SHARD`` on 8 to 128 A100s or H100s, sequences of 512 to 65,536),
    simulated as a user would type it, nothing chosen per row::

        vcluster simulate gpt --hidden h --layers l --heads a --seq s --vocab 50368 \\
            --tie-embeddings --dp GPUS --zero 3 --micro-batch b --global-batch B \\
            [--recompute full] --attention flash-v1 --hardware <FSDP_HARDWARE[gpu]>

    ZeRO-3 (FSDP's full sharding: every layer's parameters gathered before its forward and
    again before its backward, its gradients reduce-scattered per micro-batch), data
    parallelism only, flash attention built for Ampere (``flash-v1``: LLM Foundry's benchmark
    configurations run ``attn_impl: triton``, its 2023 Triton FlashAttention, which its
    TUTORIAL.md calls "slightly faster than" FlashAttention 1; since 2026-11-28, after the
    table's first run, which priced today's kernels), full recomputation where the row checkpoints
    activations, the default (Megatron) precision policy, every collective in bf16.
    ``tokens_per_s`` = B·s / step time. MPT ties its output head to the input embedding:
    so does the modelled GPT (``tie_embeddings``, ``--tie-embeddings``; since 2026-11-28,
    after the table's first run, which modelled an untied head: V·h more parameters to
    gather, reduce and update). What it does not share with MPT: the rows whose FSDP mixed
    precision is ``DEFAULT`` may reduce gradients in fp32. Each row also carries ``fits``:
    whether the memory model says the configuration fits (every one of them ran). ``rows``: the table
    rows to run (dicts as :func:`~vcluster.timing.read_data_csv` reads them; default all);
    ``on_row``: called after each (progress)."""
    results = []
    for r in read_data_csv(FSDP_TABLE)[1] if rows is None else rows:
        cfg = _model(r, tie_embeddings=True)
        checkpointed = r["activation_checkpointing"] == "1"
        par = ParallelConfig(global_batch=int(r["global_batch"]),
                             micro_batch=int(r["micro_batch"]), dp=int(r["gpus"]), zero_stage=3,
                             recompute="full" if checkpointed else "none",
                             attention="flash-v1")
        sim = simulate_gpt(cfg, par, FSDP_HARDWARE[r["gpu"]])
        gpu = r["gpu"].replace("_", "-").upper()
        case = (f"MPT-{r['model']} s={cfg.seq} {par.dp}x{gpu} mb={par.micro_batch}"
                f"x{par.microbatches}{' ckpt' if checkpointed else ''}")
        results.append(_row_result(FSDP_TABLE, case, "tokens_per_s", float(r["tokens_per_s"]),
                                   par.global_batch * cfg.seq / sim.step_time_s)
                       | {"gpu": r["gpu"], "fits": sim.fits})
        _done(on_row)
    return results


def validate_fsdp2(on_row=None) -> list[dict]:
    """Every row of :data:`FSDP2_TABLE` (torchtitan's FSDP2 training of Llama 2 13B/70B
    and Llama 3 70B on 64 A100-80GB GPUs), simulated as a user would type it, nothing
    chosen per row::

        vcluster simulate gpt --arch llama --hidden h --layers l --heads a --kv-heads c \\
            --ffn-hidden f --seq s --vocab V --dp 64 --zero 3 --micro-batch b \\
            --global-batch 64b [--recompute full-torch] --grad-reduce-dtype fp32 \\
            --fsdp2-copies --hardware a100-80gb-dgx

    FSDP2 shards every parameter over the 64 GPUs and gathers each block's before its
    forward and its backward (ZeRO-3); one micro-batch per step; flash attention;
    gradients reduce-scattered in fp32 (torchtitan's ``training.mixed_precision_reduce``,
    default and only value "float32", passed to FSDP2 as ``MixedPrecisionPolicy(
    reduce_dtype=...)``; since 2026-11-28, after the first run, which reduced in bf16).
    FSDP2's copies around its gathers and reduce-scatters are priced (``fsdp2_copies``,
    :mod:`.fsdp2_copies`; since 2026-11-30). Not modelled: the machines' network, which the
    document does not give (the preset's: HDR InfiniBand, one NIC per GPU). ``on_row``:
    called after each row (progress)."""
    rows = []
    for r in read_data_csv(FSDP2_TABLE)[1]:
        cfg = _model(r, arch="llama", kv_heads=int(r["kv_heads"]),
                     ffn_hidden=int(r["ffn_hidden"]))
        gpus, b = int(r["gpus"]), int(r["batch"])
        # torchtitan's full AC is PyTorch's non-reentrant checkpoint: "full-torch"
        par = ParallelConfig(global_batch=gpus * b, micro_batch=b, dp=gpus, zero_stage=3,
                             recompute="full-torch" if r["activation_checkpointing"] == "full"
                             else "none", grad_reduce_dtype="fp32")
        sim = simulate_gpt(cfg, par, FSDP2_HARDWARE, fsdp2_copies=True)
        case = (f"torchtitan {r['model']} s={cfg.seq} {gpus}xA100-80GB b={b}"
                f"{' full AC' if par.recompute == 'full-torch' else ''}")
        rows.append(_row_result(FSDP2_TABLE, case, "tokens_per_s_per_gpu",
                                float(r["tokens_per_s_per_gpu"]),
                                b * cfg.seq / sim.step_time_s) | {"fits": sim.fits})
        _done(on_row)
    return rows


def fp8_row_config(r: dict) -> tuple:
    """(GPTConfig, ParallelConfig) of a row of an :data:`FP8_TABLES` table: its model,
    degrees, micro-batch and interleaving, and what the tables leave out, the same for
    every row: sequence parallelism where tp > 1, the distributed optimizer (ZeRO-1; a row
    with ``fsdp`` 1: ZeRO-3, Megatron FSDP), no recomputation, flash attention, and tensor
    parallelism overlapped as Transformer Engine runs it (``tp_overlap="te"`` where tp > 1:
    NeMo's launcher configurations of these runs set ``sequence_parallel: true`` and
    ``ub_tp_comm_overlap: true`` — github.com/NVIDIA/NeMo-Framework-Launcher,
    launcher_scripts/conf/training/gpt3/175b.yaml at 056a90e and
    launcher_scripts/conf/training/llama/llama3_70b.yaml at 3dd3561, the latter the 24.07
    row's tp 4, pp 4, cp 2, vp 5 — and Megatron-Bridge's H100 performance recipes keep TP
    communication overlap on)."""
    arch = r["arch"]
    llama = {"kv_heads": int(r["kv_heads"]), "ffn_hidden": int(r["ffn_hidden"])}
    cfg = _model(r, arch=arch, **(llama if block_named(arch).grouped_query else {}))
    tp, pp, cp, vp = (int(r[k]) for k in ("tp", "pp", "cp", "vp"))
    par = ParallelConfig(global_batch=int(r["global_batch"]), micro_batch=int(r["micro_batch"]),
                         dp=int(r["gpus"]) // (tp * pp * cp), pp=pp, tp=tp, cp=cp,
                         schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                         virtual_stages=vp if vp > 1 else None, sequence_parallel=tp > 1,
                         zero_stage=3 if r.get("fsdp") == "1" else 1,
                         tp_overlap="te" if tp > 1 else "backward")
    return cfg, par


def validate_fp8(tables=FP8_TABLES, on_row=None) -> list[dict]:
    """Every row of the :data:`FP8_TABLES` (NeMo 24.07 on DGX H100 with Transformer
    Engine's FP8: GPT-3 5B to 175B and Llama 2/3 7B to 70B on 8 to 512 GPUs, with tensor,
    pipeline (interleaved), context and data parallelism; Megatron-Bridge 25.11's Llama 3
    8B under Megatron FSDP on 8 and 70B with tp 4, pp 8 interleaved on 64), simulated on
    the ``h100-dgx`` preset
    with the transformer layers' linear GEMMs in FP8 (``simulate_gpt(fp8=True)``) and the
    configuration of :func:`fp8_row_config`. ``tokens_per_s_per_gpu`` = B·s / (step ·
    GPUs). Not modelled: Transformer Engine's FP8 casts and scaling (amax) kernels.
    ``on_row``: called after each row (progress)."""
    rows = []
    for table in tables:
        for r in read_data_csv(table)[1]:
            cfg, par = fp8_row_config(r)
            sim = simulate_gpt(cfg, par, "h100-dgx", fp8=True)
            how = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "cp", "vp") if r[k] != "1")
            if r.get("fsdp") == "1":
                how = "fsdp"
            case = f"{r['model']} FP8 {r['gpus']}xH100 {how or 'dp only'}"
            rows.append(_row_result(table, case, "tokens_per_s_per_gpu",
                                    float(r["tokens_per_s_per_gpu"]),
                                    par.global_batch * cfg.seq / sim.step_time_s / par.gpus))
            _done(on_row)
    return rows


def moe_row_config(r: dict) -> tuple:
    """(config, parallel, fp8, refusals) of a :data:`MOE_TABLE` row: its GPTConfig, its
    ParallelConfig, whether its GEMMs run in FP8, and the message of every ConfigError the
    program raises on it, in order — the model, the precision, the recomputation, the plan
    (its rules, the micro-batch rounds, the model over the mesh); ``config`` and ``parallel``
    are None where refused before they could be built, and a row with refusals is not
    simulated.

    The model: ``GPTConfig.of_model(preset, seq, timing_only=True)`` (refused where the GPT
    program cannot run the preset). The plan, the row's own where it gives it: global and micro-batch, dp =
    GPUs / (tp·pp·cp), tp, pp, cp, ep; ``etp`` as published, else :data:`MOE_DEFAULT_ETP`
    (1: each expert whole, the expert group folded over the tp ranks — what
    Megatron-Bridge's Qwen3 and GPT-OSS performance recipes and the Model Zoo's
    configurations set, ``expert_tensor_parallel_size = 1``; the same as etp = tp where
    tp = 1); the interleaved 1F1B schedule with ``vp`` virtual stages where vp > 1, else
    1F1B; sequence parallelism where tp > 1 (Megatron-Core requires it of MoE with tp); the
    recomputation as published (none where the row says none: the H100 recipes of both
    sources set none; Megatron-Core's selective recomputation of modules, the Model Zoo's
    "norm, act", runs as ``recompute="selective"`` with ``recompute_modules`` ("layernorm",
    "moe_act") — the names of :data:`_MOE_RECOMPUTE_MODULES`, anything else refused —
    since 2026-11-30; before, those rows were refused), and where the row's Megatron-Bridge
    recipe is known its recomputation instead (:func:`recipe_recompute`); FP8
    GEMMs where the precision is FP8 (refused where the source states none); a layer count
    pp·vp does not divide is split as Megatron-Core's ``account_for_embedding_in_pipeline_
    split`` and ``account_for_loss_in_pipeline_split`` do, the embedding and the head
    each counted as a layer (:func:`~.candidates.stage_split`: Qwen3-235B's 94 layers on
    32 stages, 2 + 30 × 3 + 2; on 96 stages, since 2026-12-01, the first and last stage
    the embedding and the head alone), refused where that does not split either. The
    optimizer: a row with ``fsdp`` 1 asks for ZeRO-3 (refused with ep > 1); every other row
    ran Megatron's distributed optimizer, simulated as ZeRO-1 — the experts' state sharded
    over the expert-data-parallel ranks, the rest over dp (since 2026-11-30; before, the
    program refused ZeRO with ep > 1 and these rows ran as plain data parallelism: the same
    gradient bytes, the optimizer over the whole parameters, ``fits`` the DDP verdict).
    Megatron-Core's MoE all-to-all overlap (``moe_comm_overlap``) where the row's recipe
    turned it on (``moe_a2a_overlap`` 1, with its ``recipe_source``), and the recipe's token
    dispatcher (:func:`recipe_dispatcher`: DeepEP and HybridEP run as ``flex``); both since
    2026-11-30. A flex row whose expert group spans several DGX nodes runs DeepEP's
    internode path (``moe_ep_node_ranks``: :func:`~.candidates.with_node_ranks`; since 2026-11-30)."""
    refusals = []
    try:
        cfg = GPTConfig.of_model(r["preset"], seq=int(r["seq"]), timing_only=True)
    except ConfigError as e:
        return None, None, False, [str(e)]
    precision = r["precision"]
    if precision != "BF16" and not precision.startswith("FP8"):
        refusals.append(str(ConfigError(
            "precision", precision, "BF16 or FP8", "the source does not state the precision "
            "the row ran in", owner=MOE_TABLE)))
    try:
        recipe = recipe_recompute(r)          # the recipe's, where known, over the page's
    except ConfigError as e:
        recipe, refusals = None, refusals + [str(e)]
    recompute, modules = recipe or _page_recompute(r, refusals)
    tp, pp, cp, vp, ep = (int(r[k]) for k in ("tp", "pp", "cp", "vp", "ep"))
    ends = stage_split(cfg.layers, pp * vp, empty_ends=True) or ()  # Megatron: embedding, loss
    try:
        par = ParallelConfig(global_batch=int(r["global_batch"]),
                             first_stage_layers=ends[0] if ends else None,
                             last_stage_layers=ends[1] if ends else None,
                             micro_batch=int(r["micro_batch"]),
                             dp=int(r["gpus"]) // (tp * pp * cp), pp=pp, tp=tp, cp=cp, ep=ep,
                             etp=int(r["etp"]) if r["etp"] else MOE_DEFAULT_ETP,
                             schedule="interleaved_1f1b" if vp > 1 else "1f1b",
                             virtual_stages=vp if vp > 1 else None, sequence_parallel=tp > 1,
                             recompute=recompute,
                             **({"recompute_modules": modules} if modules else {}),
                             zero_stage=3 if r["fsdp"] == "1" else 1,
                             moe_comm_overlap=r.get("moe_a2a_overlap") == "1",
                             moe_dispatcher=recipe_dispatcher(r))
        par = with_node_ranks(par, MOE_HARDWARE)
    except ConfigError as e:
        return cfg, None, False, refusals + [str(e)]
    for check in (par.check_microbatches, lambda: par.check(cfg, par.mesh())):
        try:
            check()
        except ConfigError as e:
            refusals.append(str(e))
    return cfg, par, precision.startswith("FP8"), refusals


#: the MoE table's ``recompute`` column's module names (the Model Zoo's abbreviations of
#: Megatron-Core's ``--recompute-modules``: "norm, act" is ``layernorm moe_act``) ->
#: ParallelConfig.recompute_modules' names
_MOE_RECOMPUTE_MODULES = MappingProxyType({"norm": "layernorm", "act": "moe_act",
                                           "layernorm": "layernorm", "moe_act": "moe_act",
                                           "mlp": "mlp", "mla_up_proj": "mla_up_proj",
                                           "core_attn": "core_attn"})


def _page_recompute(r: dict, refusals: list) -> tuple:
    """(recompute, modules or None) as a :data:`MOE_TABLE` row's ``recompute`` column
    publishes it (empty: none; the Model Zoo's module abbreviations, "norm, act", as
    Megatron-Core's module recomputation); a ConfigError's text appended to ``refusals``
    (and ("none", None)) where not modelled."""
    recompute = {"": "none", "full": "full"}.get(r["recompute"])
    if recompute is not None:
        return recompute, None
    names = [m.strip() for m in r["recompute"].split(",") if m.strip()]
    modules = tuple(_MOE_RECOMPUTE_MODULES.get(m) for m in names)
    if names and None not in modules:
        return "selective", modules
    refusals.append(str(ConfigError(
        "recompute", r["recompute"], "none, full or Megatron-Core's recompute modules "
        + ", ".join(f"{k} ({v})" for k, v in _MOE_RECOMPUTE_MODULES.items()),
        "a recomputation not modelled", owner=MOE_TABLE)))
    return "none", None


def _moe_case(i: int, r: dict) -> str:
    how = " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "cp", "vp", "ep", "etp")
                   if r[k] not in ("", "1"))
    return (f"#{i} {r['model']} {r['precision']} {r['gpus']}xH100 {how or 'dp only'}"
            f"{' fsdp' if r['fsdp'] == '1' else ''} mb={r['micro_batch']} "
            f"B={r['global_batch']} ({r['release']})")


def validate_moe(on_row=None) -> list[dict]:
    """Every row of :data:`MOE_TABLE` (Megatron-Bridge's DGX-H100 MoE pretraining rows,
    25.09 to 26.04.01 containers, and Megatron-Core's MoE Model Zoo H100 rows: Mixtral
    8x22B, Qwen3 30B-A3B and 235B-A22B, GPT-OSS 120B, DeepSeek-V3), one result each, in
    the table's order: the configuration of :func:`moe_row_config` simulated on
    :data:`MOE_HARDWARE` with even routing (``expert_skew`` 1: both sources force-balance
    the tokens over the experts). Every row is ``held_out``: the table was added after every
    constant of the timing model was set, and none was chosen looking at it.

    ``metric``: the first of :data:`MOE_METRICS` the row publishes, ``published`` and
    ``predicted`` (``simulate_gpt``'s ``tokens_per_s_per_gpu``, ``step_time_s`` or
    ``model_tflops_per_gpu``: the simulator's model FLOPs, which match both sources' counts
    within 0.7%, the table's header says) and ``rel_error`` = predicted / published − 1;
    ``published_tflops`` and ``predicted_tflops``: model TFLOP/s per GPU where the row
    publishes them. ``status``: ``predicted``; ``refused`` (``predicted`` and ``rel_error``
    None, ``reason`` every ConfigError of the features or plan the program cannot run yet,
    "; "-joined); or
    ``failed`` (the program accepted the row but could not trace it: ``reason`` the
    TraceError, a defect to fix, not a limit). Modelled since 2026-11-30 where a row's
    recipe sets them (:func:`moe_row_config`): DeepEP's and HybridEP's one row per token and
    destination rank (the ``flex`` dispatcher) and the overlap of the expert all-to-alls
    with another micro-batch's computation (``--overlap-moe-expert-parallel-comm``). Not
    modelled: the SMs those dispatch kernels take from the GEMMs beside them, Transformer
    Engine's FP8 scaling kernels, CUDA graphs. ``on_row``: called after each row
    (progress)."""
    rows = []
    for i, r in enumerate(read_data_csv(MOE_TABLE)[1], 1):
        metric = next(m for m in MOE_METRICS if r[m])
        out = {"source": MOE_TABLE, "case": _moe_case(i, r), "metric": metric,
               "published": float(r[metric]), "predicted": None, "rel_error": None,
               "role": "held_out", "status": "predicted", "reason": "",
               "published_tflops": float(r["model_tflops_per_gpu"])
               if r["model_tflops_per_gpu"] else None, "predicted_tflops": None,
               "fits": None, "model": r["model"], "preset": r["preset"],
               "release": r["release"], "url": r["source"]}
        cfg, par, fp8, refusals = moe_row_config(r)
        try:
            if refusals:
                raise ConfigError("row", i, "a row the program runs", "; ".join(refusals))
            sim = simulate_gpt(cfg, par, MOE_HARDWARE, fp8=fp8)
        except ConfigError as e:
            out.update(status="refused", reason=e.reason if refusals else str(e))
        except TraceError as e:
            out.update(status="failed", reason=str(e).splitlines()[0])
        else:
            predicted = {"tokens_per_s_per_gpu": sim.tokens_per_s_per_gpu,
                         "step_s": sim.step_time_s,
                         "model_tflops_per_gpu": sim.model_tflops_per_gpu}[metric]
            out.update(predicted=predicted, rel_error=predicted / out["published"] - 1.0,
                       predicted_tflops=sim.model_tflops_per_gpu, fits=sim.fits)
        rows.append(out)
        _done(on_row)
    return rows
