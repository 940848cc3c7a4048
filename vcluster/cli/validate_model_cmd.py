"""``vcluster validate-model``: the timing model against published measurements.

Rows: bus bandwidth of every row of nccl_a100.csv, iteration time of every row of
megatron_2020_a100.csv, TFLOP/s per GPU of every row of megatron_sc21_table1.csv,
iteration time and one layer's time of every row of korthikanti_2022_a100.csv (full and
selective recomputation, :func:`~vcluster.planner.validation.validate_recompute`), and step
time and peak memory of every row of h200_gpt_steps.csv, h100_gpt_steps.csv and
h200_shapes_steps.csv (one-GPU PyTorch steps measured with ``vcluster bench gpu-step``),
and training throughput of every row of llm_foundry_mpt.csv (MosaicML's MPT models under
FSDP on 8-128 A100s and H100s, :func:`~vcluster.planner.validation.validate_fsdp`) and
of every row of nemo_2407_h100_fp8.csv (NeMo's FP8 pretraining on DGX H100,
:func:`~vcluster.planner.validation.validate_fp8`) and of torchtitan_a100_fsdp.csv
(torchtitan's FSDP2 Llama runs on 64 A100s,
:func:`~vcluster.planner.validation.validate_fsdp2`) and of megatron_bridge_h100_fp8.csv
(Megatron-Bridge's FP8 Llama 3 8B and 70B on DGX H100, also ``validate_fp8``)
(copies ship with vcluster as package data), each with
published (or measured), predicted and
rel_error = predicted / published - 1, the shipped ``table`` it comes from and its
``role``: ``fit`` when a constant of the model was chosen while looking at it,
``held_out`` otherwise. While it runs (minutes), progress lines go to stderr — each
group of tables' rows predicted so far, every few seconds, and its count when done
(``validate-model: 191/191 rows of llm_foundry_mpt.csv predicted in 36.5 s``); ``--quiet``:
none. The summary gives the mean and max absolute error over all rows
and the held-out mean separately, then each table's mean and max per metric
(``by_table``), the FSDP table's by GPU and how many of its configurations the memory
model says fit (``fsdp``: every one ran; null without that table); then the H100 GEMM
profile's leave-one-out error on
h100_kernels.csv (:mod:`vcluster.timing.kernel_profile`) and that of each other kind's
profile (:mod:`vcluster.timing.kernel_profiles`).

Mixture-of-experts training (megatron_bridge_h100_moe.csv: Megatron-Bridge's DGX-H100 MoE
rows and Megatron-Core's MoE Model Zoo H100 rows, Mixtral 8x22B, Qwen3, GPT-OSS,
DeepSeek-V3, :func:`~vcluster.planner.validation.validate_moe`) has its own section
(``moe`` in the JSON, null without that table): every row of the table with its role
(``held_out``), its status — ``predicted`` (published, predicted, rel_error), ``refused``
(the reason: a feature or plan the program cannot run yet) or ``failed`` (the program
accepted the row and could not trace it) — and the median, mean and max |error| of the
predicted rows. Its rows stay out of ``rows`` and of the means above (some carry no
prediction). ``--table NAME`` (repeatable) keeps only those tables' rows (and simulates
only what they need).

Long-context and overlapped training (torchtitan_long_context.csv: torchtitan's Llama 3.1
runs on H100s and H200s, :func:`~vcluster.planner.validation_long_context.
validate_long_context`) has a section of its own (``long_context``), and so has this
project's sequence sweep on one real H200 (h200_llama_steps.csv: Llama 3.1 8B's and 70B's
layer shapes at 2K to 32K tokens, eager and compiled, torchtitan's checkpointing modes,
:func:`~vcluster.planner.validation_long_context.validate_gpu_sweep`;
``gpu_sequence_sweep``): each row's tokens/s measured and predicted, its error now and as
the model stood before issue 54 (``first_run``), and the signed error by sequence band.
Both are ``held_out`` and stay out of ``rows`` and the means above.

NVIDIA's published one-GPU training iterations of Hugging Face's Llama-3.2-1B on a B200
and an H200 (hf_llama_1b_steps.csv: cudnn-frontend's benchmark, SDPA pinned to cuDNN,
memory-efficient or FlashAttention-2, :func:`~vcluster.planner.validation_hf_llama.
validate_hf_llama_steps`) have a section of their own too (``hf_llama_1b_steps``), after
the sweep's: each row's tokens/s and step measured and predicted, or ``refused`` with its
reason (the memory-efficient kernel: no published curve), and the mean |error| and mean
signed error per GPU and per backend. ``held_out``, out of ``rows`` and the means above.

The hardware of 2026 has a section of its own (``hardware_2026`` in the JSON, null
without its tables), also out of ``rows`` and the means above: collectives measured on
DGX B200/B300, GB200 NVL72 and MI300X (nccl_2026.csv, each row ``fit`` where a preset
constant was read from it, else ``held_out``:
:func:`~vcluster.timing.nccl_validation.validate_nccl_2026`) and training throughput on
DGX-B200/B300, GB200/GB300 NVL72, MI325X and MI355X (megatron_bridge_blackwell.csv,
amd_instinct_training.csv: :func:`~vcluster.planner.validation_2026.validate_2026`; by
default the rows of each configuration's latest release, ``--all-releases`` for every
release's), with the mean |error| per GPU kind and role, dense and MoE apart.

Which constant was chosen on which table: ``TRAINING_KERNEL_EFFICIENCY`` and the
micro-batch default on both Megatron tables (every row ``fit``); no constant on
nccl_a100.csv (its link figures come from NCCL's topology model and datasheets:
``held_out``) nor on korthikanti_2022_a100.csv nor on llm_foundry_mpt.csv nor on
nemo_2407_h100_fp8.csv nor on torchtitan_a100_fsdp.csv nor on megatron_bridge_h100_fp8.csv
nor on megatron_bridge_h100_moe.csv nor on hf_llama_1b_steps.csv (added after every
constant was set)
nor on the one-GPU step tables (measured after every constant was set: ``held_out``;
h200_shapes_steps.csv also after the ``torch_amp`` memory count was
written, at shapes fixed beforehand; the three compiled rows are predicted under the
``torch_compile`` count, which was written after they were seen: docs/timing.md).
"""

from __future__ import annotations

from concurrent.futures import as_completed

__all__ = ["add_parser", "validation_rows", "FIT_TABLES", "TABLES"]

#: the tables a constant was chosen on (module docstring): their rows are "fit"
FIT_TABLES = {"megatron_2020_a100.csv": "fit", "megatron_sc21_table1.csv": "fit"}

#: every shipped table validate-model predicts, and the group of rows it belongs to (a
#: group is simulated as a whole: :func:`validation_rows`)
_GROUPS = {"nccl_a100.csv": "nccl", "megatron_2020_a100.csv": "megatron",
           "megatron_sc21_table1.csv": "megatron", "korthikanti_2022_a100.csv": "recompute",
           "h200_gpt_steps.csv": "gpu_steps", "h100_gpt_steps.csv": "gpu_steps",
           "h200_shapes_steps.csv": "gpu_steps", "llm_foundry_mpt.csv": "fsdp",
           "nemo_2407_h100_fp8.csv": "fp8", "torchtitan_a100_fsdp.csv": "fsdp2",
           "megatron_bridge_h100_fp8.csv": "fp8", "megatron_bridge_h100_moe.csv": "moe",
           "nccl_2026.csv": "hw2026", "megatron_bridge_blackwell.csv": "hw2026",
           "amd_instinct_training.csv": "hw2026",
           "torchtitan_long_context.csv": "long_context",
           "h200_llama_steps.csv": "gpu_sweep", "hf_llama_1b_steps.csv": "hf_steps"}
TABLES = tuple(_GROUPS)


def add_parser(commands) -> None:
    cmd = commands.add_parser("validate-model", help="predicted vs published figures",
                              description=__doc__.split("\n\n")[0])
    cmd.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    cmd.add_argument("--table", action="append", choices=TABLES, metavar="TABLE",
                     help="only this table's rows (repeatable; default every table: "
                          + ", ".join(TABLES) + ")")
    cmd.add_argument("--all-releases", action="store_true",
                     help="the 2026 hardware tables: every release's rows (default: each "
                          "configuration's latest release; all take ~5 minutes)")
    cmd.add_argument("--workers", type=int, default=None, metavar="N",
                     help="processes that simulate the groups of tables side by side (then "
                          "the 2026 hardware tables' independent rows); default the cores "
                          "this process may use, 1: this process; the rows are the same")
    cmd.add_argument("--quiet", action="store_true",
                     help="no progress lines on stderr (by default a line every few seconds "
                          "and one per group of tables: the run takes minutes)")
    cmd.set_defaults(run=_run)


def validation_rows(tables=None, progress=None, all_releases: bool = False,
                    workers: int = 1) -> dict:
    """The rows of ``tables`` (names of :data:`TABLES`; default all) and their summaries
    (the module docstring). ``progress``: None, or an object that reports a task's count
    (:class:`~vcluster.planner.progress.ProgressLines`: ``add_task``, ``advance``,
    ``finish``), one task per group of tables counting its table rows predicted.
    ``workers``: processes that run the groups of tables side by side, and then the
    2026 hardware tables' rows (1: all in this process; the rows are the same)."""
    wanted = set(TABLES if tables is None else tables)
    unknown = wanted - set(TABLES)
    if unknown or not wanted:
        raise ValueError(f"validate-model: tables must be among {', '.join(TABLES)}, got "
                         f"{sorted(unknown) or 'none'}")
    groups = {_GROUPS[t] for t in wanted}
    # lazy: keeps vcluster --help fast
    from vcluster.planner.validation import (FP8_TABLES, MOE_TABLE, validate_fp8,
                                             validate_fsdp, validate_fsdp2,
                                             validate_gpu_steps, validate_megatron,
                                             validate_moe, validate_recompute)
    from vcluster.planner.validation_hf_llama import HF_LLAMA_TABLE, validate_hf_llama_steps
    from vcluster.planner.validation_long_context import (GPU_SWEEP_TABLE, LONG_CONTEXT_TABLE,
                                                          validate_gpu_sweep,
                                                          validate_long_context)
    from vcluster.timing import validate_nccl
    from vcluster.timing.kernel_profile import H100_KERNEL_TABLE, h100_gemm_leave_one_out
    from vcluster.timing.kernel_profiles import h100_kernel_leave_one_out
    fp8_tables = tuple(t for t in FP8_TABLES if t in wanted)
    # name -> a group's run: (group, validate, its keyword arguments, the tables its
    # progress counts (None: the group's), what it counts (None: "rows of ... predicted")),
    # the longest first (a pool starts them in this order)
    calls = {
        "fsdp": ("fsdp", validate_fsdp, {}, None, None),
        "long_context": ("long_context", validate_long_context, {}, None,
                         f"rows of {LONG_CONTEXT_TABLE} simulated (or refused)"),
        "recompute": ("recompute", validate_recompute, {}, None, None),
        "moe": ("moe", validate_moe, {}, None, f"rows of {MOE_TABLE} simulated (or refused)"),
        "fp8": ("fp8", validate_fp8, {"tables": fp8_tables}, fp8_tables, None),
        "megatron": ("megatron", validate_megatron, {}, None, None),
        "gpu_steps": ("gpu_steps", validate_gpu_steps, {}, None, None),
        "repriced": ("gpu_steps", validate_gpu_steps, {"kernel_table": H100_KERNEL_TABLE},
                     None, f"one-GPU step rows repriced by {H100_KERNEL_TABLE}"),
        "gpu_sweep": ("gpu_sweep", validate_gpu_sweep, {}, None, None),
        "hf_steps": ("hf_steps", validate_hf_llama_steps, {}, None,
                     f"rows of {HF_LLAMA_TABLE} simulated (or refused)"),
        "fsdp2": ("fsdp2", validate_fsdp2, {}, None, None)}
    out = _run_groups({name: c for name, c in calls.items() if c[0] in groups}, progress,
                      workers)

    def result(name):
        return out.get(name, [])

    keys = ("source", "case", "metric", "published", "predicted", "rel_error")
    nccl = validate_nccl() if "nccl" in groups else []      # instant: no progress
    rows = [{k: r[k] for k in keys} | {"table": "nccl_a100.csv"} for r in nccl]
    for name in ("megatron", "recompute", "gpu_steps"):
        rows += [r | {"table": r["source"]} for r in result(name)]
    fsdp = result("fsdp")
    rows += [{k: r[k] for k in keys} | {"table": r["source"]} for r in fsdp]
    rows += [r | {"table": r["source"]} for r in result("fp8")]
    rows += [{k: r[k] for k in keys} | {"table": r["source"]} for r in result("fsdp2")]
    rows = [r for r in rows if r["table"] in wanted]
    fsdp = [r for r in fsdp if r["source"] in wanted]
    moe = result("moe")
    long_context, gpu_sweep, hf_steps = (result(n) for n in ("long_context", "gpu_sweep",
                                                             "hf_steps"))
    # after the pool's runs: its own pool of `workers` processes
    hw2026 = _hardware_2026(wanted, progress, all_releases, workers) \
        if "hw2026" in groups else None
    for r in rows:
        r["role"] = FIT_TABLES.get(r["table"], "held_out")
    errors = [abs(r["rel_error"]) for r in rows]
    held = [abs(r["rel_error"]) for r in rows if r["role"] == "held_out"]
    fit = [abs(r["rel_error"]) for r in rows if r["role"] == "fit"]
    by_table: dict = {}
    for r in rows:
        by_table.setdefault(r["table"], {}).setdefault(r["metric"], []).append(
            abs(r["rel_error"]))
    measured: dict = {}
    for r in result("repriced"):
        if r["metric"] == "step_ms" and r["source"] in wanted:
            measured.setdefault(r["source"], []).append(abs(r["rel_error"]))
    return {"rows": rows, "mean_abs_rel_error": sum(errors) / len(errors) if errors else None,
            "max_abs_rel_error": max(errors) if errors else None,
            "held_out_mean_abs_rel_error": sum(held) / len(held) if held else None,
            "fit_mean_abs_rel_error": sum(fit) / len(fit) if fit else None,
            # mean |error| per table and metric: step times and peak memory apart
            "by_table": {table: {metric: {"rows": len(e), "mean_abs_rel_error": sum(e) / len(e),
                                          "max_abs_rel_error": max(e)}
                                 for metric, e in metrics.items()}
                         for table, metrics in by_table.items()},
            "fsdp": _fsdp_summary(fsdp) if fsdp else None,
            "moe": _moe_summary(MOE_TABLE, moe) if moe else None,
            "hardware_2026": hw2026,
            "long_context": _long_context_summary(LONG_CONTEXT_TABLE, long_context)
            if long_context else None,
            "gpu_sequence_sweep": _long_context_summary(GPU_SWEEP_TABLE, gpu_sweep)
            if gpu_sweep else None,
            "hf_llama_1b_steps": _hf_steps_summary(HF_LLAMA_TABLE, hf_steps)
            if hf_steps else None,
            "gemm_profile": h100_gemm_leave_one_out(),
            "kernel_profiles": h100_kernel_leave_one_out(),
            # one-GPU step time priced by h100_kernels.csv (moved to the step's GPU) with
            # plain PyTorch's autocast kernels (fused as torch.compile fuses them on a
            # compiled row): checked, not held out (docs/timing.md)
            "measured_prices": {"kernel_table": H100_KERNEL_TABLE, "step_ms_mean_abs_rel_error": {
                table: sum(e) / len(e) for table, e in measured.items()}}}


def _run_groups(calls: dict, progress, workers: int) -> dict:
    """``{name: validate(**kwargs)}`` for each of ``calls`` (:func:`validation_rows`), on
    ``workers`` processes (a pool of min(workers, runs), in the order given: the longest
    first) or in this one (1, one run, or no pool on this platform). The rows are the same
    either way; each run is one task on ``progress`` (None: none), counted row by row in
    this process and at its end in a pool's."""
    # lazy: keeps vcluster --help fast
    from vcluster.planner.search import process_pool
    from vcluster.timing import read_data_csv

    def task(name):
        group, _, _, counted, label = calls[name]
        counted = counted or tuple(t for t, g in _GROUPS.items() if g == group)
        total = sum(len(read_data_csv(t)[1]) for t in counted)
        return progress.add_task(label or f"rows of {', '.join(counted)} predicted",
                                 total=total), total

    out = {}
    pool = process_pool(workers, len(calls), "validate-model")
    if pool is None:
        for name, (_, validate, kwargs, _, _) in calls.items():
            if progress is None:
                out[name] = validate(**kwargs)
                continue
            t, _ = task(name)
            out[name] = validate(**kwargs, on_row=lambda t=t: progress.advance(t))
            progress.finish(t)
        return out
    with pool:
        futures = {pool.submit(validate, **kwargs): name
                   for name, (_, validate, kwargs, _, _) in calls.items()}
        tasks = {name: task(name) for name in calls} if progress is not None else {}
        for future in as_completed(futures):
            name = futures[future]
            out[name] = future.result()
            if progress is not None:
                t, total = tasks[name]
                progress.advance(t, total)
                progress.finish(t)
    return out


def _hardware_2026(wanted: set, progress, all_releases: bool, workers: int = 1) -> dict:
    """The 2026 hardware section (module docstring): collective rows and their mean |error|
    by role; training rows and their summary by GPU kind."""
    # lazy: keeps vcluster --help fast
    from vcluster.planner.validation_2026 import TABLES_2026, summary_by_kind, validate_2026
    from vcluster.timing import read_data_csv
    from vcluster.timing.nccl_validation import NCCL_2026_CSV, validate_nccl_2026
    collectives = validate_nccl_2026() if NCCL_2026_CSV in wanted else []
    by_role = {}
    for role in ("fit", "held_out"):
        e = [abs(r["rel_error"]) for r in collectives if r["role"] == role]
        by_role[role] = None if not e else {"rows": len(e), "mean_abs_rel_error": sum(e) / len(e),
                                            "max_abs_rel_error": max(e)}
    tables = tuple(t for t in TABLES_2026 if t in wanted)
    training = []
    if tables:
        latest_only = not all_releases
        task = None
        if progress is not None:
            total = sum(1 for t in tables for r in read_data_csv(t)[1]
                        if all_releases or r.get("latest") == "1")
            task = progress.add_task(f"rows of {', '.join(tables)} simulated (or refused)",
                                     total=total)
        training = validate_2026(tables, latest_only=latest_only, workers=workers,
                                 on_row=None if task is None else
                                 (lambda: progress.advance(task)))
        if task is not None:
            progress.finish(task)
    return {"collectives": {"table": NCCL_2026_CSV, "rows": collectives, "by_role": by_role}
            if collectives else None,
            "training": {"tables": list(tables), "latest_only": not all_releases,
                         "rows": training, "by_kind": summary_by_kind(training)}
            if tables else None}


def _print_hardware_2026(h: dict) -> None:
    """The 2026 hardware section: collectives, then training rows, then the summary."""
    def percent(x):
        return "-" if x is None else f"{100 * x:+.1f}%"
    c = h["collectives"]
    if c is not None:
        print(f"collectives on 2026 hardware ({c['table']}):")
        for r in c["rows"]:
            print(f"  {r['case'][:78]:<79}{r['published']:>8.4g}{r['predicted']:>9.4g}"
                  f"{percent(r['rel_error']):>8}  {r['role']:<9}{r['algorithm']}")
        print("  " + "   ".join(f"{role}: mean |error| {100 * v['mean_abs_rel_error']:.1f}% "
                                f"(max {100 * v['max_abs_rel_error']:.1f}%, {v['rows']} rows)"
                                for role, v in c["by_role"].items() if v))
    t = h["training"]
    if t is None:
        return
    print(f"training on 2026 hardware ({', '.join(t['tables'])}; "
          f"{'latest release of each configuration' if t['latest_only'] else 'every release'}):")
    for r in t["rows"]:
        if r["status"] == "predicted":
            print(f"  {r['case'][:96]:<97}{r['published']:>10.0f}{r['predicted']:>10.0f}"
                  f"{percent(r['rel_error']):>8}  {r['role']}")
        else:
            print(f"  {r['case'][:96]:<97}{r['published']:>10.0f}{'-':>10}  {r['status']}: "
                  f"{r['reason'][:140]}")
    print("  by GPU kind (tokens/s per GPU; mean |error|, median, mean signed):")
    for kind, k in t["by_kind"].items():
        parts = []
        for role in ("held_out", "fit"):
            for family in ("all", "dense", "moe"):
                v = k[role] if family == "all" else (k.get(f"{role}_{family}") or None)
                if v:
                    parts.append(f"{role}{'' if family == 'all' else ' ' + family} "
                                 f"{100 * v['mean_abs']:.1f}% / {100 * v['median_abs']:.1f}% / "
                                 f"{100 * v['mean_signed']:+.1f}% ({v['predicted']})")
        predicted = k['rows'] - k['refused'] - k['failed']
        print(f"  {kind:<14}{k['rows']:>3} rows, {k['refused']} refused, {k['failed']} failed"
              + (": " + "; ".join(parts) if parts else "")
              + (f"; memory model: {k['fits']} of {predicted} fit (every one ran)"
                 if predicted else ""))


def _fsdp_summary(rows: list[dict]) -> dict:
    """The FSDP table's mean and max |error| per GPU, and how many of its configurations
    (all of which ran) the memory model says fit."""
    by_gpu: dict = {}
    for r in rows:
        by_gpu.setdefault(r["gpu"], []).append(abs(r["rel_error"]))
    return {"table": rows[0]["source"], "rows": len(rows),
            "predicted_to_fit": sum(r["fits"] for r in rows),
            "by_gpu": {gpu: {"rows": len(e), "mean_abs_rel_error": sum(e) / len(e),
                             "max_abs_rel_error": max(e)} for gpu, e in by_gpu.items()}}


def _moe_summary(table: str, rows: list[dict]) -> dict:
    """The MoE table's rows (every one, predicted or not), its role, and the median, mean
    and max |error| of its predicted rows (None when none is)."""
    errors = sorted(abs(r["rel_error"]) for r in rows if r["status"] == "predicted")
    n = len(errors)
    return {"table": table, "role": FIT_TABLES.get(table, "held_out"), "rows": rows,
            "predicted": n, "refused": sum(r["status"] == "refused" for r in rows),
            "failed": sum(r["status"] == "failed" for r in rows),
            "median_abs_rel_error": (errors[n // 2] if n % 2 else
                                     (errors[n // 2 - 1] + errors[n // 2]) / 2) if n else None,
            "mean_abs_rel_error": sum(errors) / n if n else None,
            "max_abs_rel_error": errors[-1] if n else None}


def _long_context_summary(table: str, rows: list[dict]) -> dict:
    """The long-context table's rows, the mean |error| of its predicted rows now and as
    first run, and the signed error by sequence band (both)."""
    # lazy: keeps vcluster --help fast
    from vcluster.planner.validation_long_context import summary_by_band
    done = [r for r in rows if r["status"] == "predicted"]

    def mean(key):
        return sum(abs(r[key]) for r in done) / len(done) if done else None
    return {"table": table, "role": "held_out", "rows": rows, "predicted": len(done),
            "refused": len(rows) - len(done), "mean_abs_rel_error": mean("rel_error"),
            "first_run_mean_abs_rel_error": mean("first_run_error"),
            "by_band": summary_by_band(rows), "first_run_by_band":
            summary_by_band(rows, "first_run_error")}


def _print_long_context(c: dict, title: str = "long context and overlapped TP") -> None:
    """The long-context section (or, ``title``, the one-GPU sequence sweep's): each row's
    error now and as first run, then by band."""
    def percent(x):
        return "-" if x is None else f"{100 * x:+.1f}%"
    print(f"{title} ({c['table']}, {c['role']}): {c['predicted']} of "
          f"{len(c['rows'])} rows predicted, {c['refused']} refused; mean |error| "
          f"{100 * c['mean_abs_rel_error']:.1f}% (first run "
          f"{100 * c['first_run_mean_abs_rel_error']:.1f}%)")
    print(f"  {'case':<82}{'published':>10}{'predicted':>10}{'error':>8}{'first run':>10}")
    for r in c["rows"]:
        if r["status"] == "predicted":
            print(f"  {r['case'][:81]:<82}{r['published']:>10.4g}{r['predicted']:>10.4g}"
                  f"{percent(r['rel_error']):>8}{percent(r['first_run_error']):>10}")
        else:
            print(f"  {r['case'][:81]:<82}{r['published']:>10.4g}{'-':>10}  refused: "
                  f"{r['reason']}")
    print("  signed error by sequence band (mean; rows): " + "; ".join(
        f"{band} {percent(v['mean_signed'])} ({v['rows']}), first run "
        f"{percent(c['first_run_by_band'][band]['mean_signed'])}"
        for band, v in c["by_band"].items() if v is not None))


def _hf_steps_summary(table: str, rows: list[dict]) -> dict:
    """The Llama-3.2-1B table's rows (every one, predicted or refused), the mean |error|
    and mean signed error of its predicted rows, and both per GPU and per backend."""
    # lazy: keeps vcluster --help fast
    from vcluster.planner.validation_hf_llama import summary_by
    errors = [r["rel_error"] for r in rows if r["status"] == "predicted"]
    return {"table": table, "role": "held_out", "rows": rows, "predicted": len(errors),
            "refused": len(rows) - len(errors),
            "mean_abs_rel_error": sum(map(abs, errors)) / len(errors) if errors else None,
            "mean_signed_rel_error": sum(errors) / len(errors) if errors else None,
            "by_gpu": summary_by(rows, "gpu"), "by_backend": summary_by(rows, "backend")}


def _print_hf_steps(c: dict) -> None:
    """The Llama-3.2-1B section: each row's step measured and predicted (or why not),
    then the means per GPU and per backend."""
    def percent(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    def absolute(x):
        return "-" if x is None else f"{100 * x:.1f}%"
    print(f"one-GPU Llama-3.2-1B iterations, Hugging Face eager ({c['table']}, {c['role']}): "
          f"{c['predicted']} of {len(c['rows'])} rows predicted, {c['refused']} refused; "
          f"mean |error| {absolute(c['mean_abs_rel_error'])}, mean signed "
          f"{percent(c['mean_signed_rel_error'])} (tokens/s)")
    print(f"  {'case':<52}{'step ms':>9}{'predicted':>10}{'tokens/s':>10}{'predicted':>10}"
          f"{'error':>8}")
    for r in c["rows"]:
        if r["status"] == "predicted":
            print(f"  {r['case'][:51]:<52}{r['step_ms']:>9.1f}{r['predicted_step_ms']:>10.1f}"
                  f"{r['published']:>10.0f}{r['predicted']:>10.0f}{percent(r['rel_error']):>8}")
        else:
            print(f"  {r['case'][:51]:<52}{r['step_ms']:>9.1f}{'-':>10}{r['published']:>10.0f}"
                  f"  {r['status']}: {r['reason']}")
    for what, key in (("GPU", "by_gpu"), ("backend", "by_backend")):
        print(f"  by {what} (mean |error|, mean signed; predicted of rows): " + "; ".join(
            f"{name} {absolute(v['mean_abs'])}, "
            f"{percent(v['mean_signed'])} ({v['predicted']} of {v['rows']})"
            for name, v in c[key].items()))


def _print_moe(m: dict) -> None:
    """The MoE section: each row predicted against published, or why it is not."""
    def percent(x):
        return "-" if x is None else f"{100 * x:.1f}%"
    print(f"mixture of experts ({m['table']}, {m['role']}): {m['predicted']} of "
          f"{len(m['rows'])} rows predicted, {m['refused']} refused, {m['failed']} failed; "
          f"predicted rows: median |error| {percent(m['median_abs_rel_error'])}, mean "
          f"{percent(m['mean_abs_rel_error'])}, max {percent(m['max_abs_rel_error'])}")
    for r in m["rows"]:
        if r["status"] == "predicted":
            tflops = "" if r["published_tflops"] is None or r["metric"] == \
                "model_tflops_per_gpu" else (f"  model TFLOP/s {r['published_tflops']:.4g} "
                                             f"-> {r['predicted_tflops']:.4g}")
            print(f"  {r['case'][:88]:<89}{r['metric']:<22}{r['published']:>9.4g}"
                  f"{r['predicted']:>10.4g}{100 * r['rel_error']:>+7.1f}%{tflops}")
        else:
            print(f"  {r['case'][:88]:<89}{r['metric']:<22}{r['published']:>9.4g}"
                  f"{'-':>10}  {r['status']}: {r['reason']}")


def _run(args) -> int:
    # lazy: keeps vcluster --help fast
    from vcluster.planner.progress import ProgressLines
    from vcluster.runtime.cores import usable_cores
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    result = validation_rows(args.table, None if args.quiet else ProgressLines("validate-model"),
                             all_releases=args.all_releases,
                             workers=args.workers or usable_cores())
    print(f"{'case':<58}{'metric':<16}{'published':>10}{'predicted':>11}{'error':>8}  role")
    for r in result["rows"]:
        print(f"{r['case'][:57]:<58}{r['metric']:<16}{r['published']:>10.4g}"
              f"{r['predicted']:>11.4g}{100 * r['rel_error']:>+7.1f}%  {r['role']}")
    n_held = sum(r["role"] == "held_out" for r in result["rows"])

    def percent(x):
        return "-" if x is None else f"{100 * x:.1f}%"
    print(f"mean |error| {percent(result['mean_abs_rel_error'])}   "
          f"max |error| {percent(result['max_abs_rel_error'])}   "
          f"held out ({n_held} rows, no constant chosen on them): "
          f"{percent(result['held_out_mean_abs_rel_error'])}   fit "
          f"({len(result['rows']) - n_held} rows): {percent(result['fit_mean_abs_rel_error'])}")
    print("by table and metric (mean |error|, max |error|, rows):")
    roles = {r["table"]: r["role"] for r in result["rows"]}
    width = max(map(len, result["by_table"]), default=0) + 1
    for table, metrics in result["by_table"].items():
        print(f"  {table:<{width}}{roles[table]:<9}" + "   ".join(
            f"{metric} {100 * m['mean_abs_rel_error']:.1f}% "
            f"(max {100 * m['max_abs_rel_error']:.1f}%, {m['rows']})"
            for metric, m in metrics.items()))
    f = result["fsdp"]
    if f is not None:
        print(f"  {f['table']} by GPU: " + ", ".join(
            f"{gpu} {100 * e['mean_abs_rel_error']:.1f}% (max "
            f"{100 * e['max_abs_rel_error']:.1f}%, {e['rows']})" for gpu, e in f["by_gpu"].items())
            + f"; the memory model says {f['predicted_to_fit']} of its {f['rows']} "
            f"configurations fit (every one ran)")
    if result["moe"] is not None:
        _print_moe(result["moe"])
    if result["hardware_2026"] is not None:
        _print_hardware_2026(result["hardware_2026"])
    if result["long_context"] is not None:
        _print_long_context(result["long_context"])
    if result["gpu_sequence_sweep"] is not None:
        _print_long_context(result["gpu_sequence_sweep"], "one-GPU sequence sweep, tokens/s")
    if result["hf_llama_1b_steps"] is not None:
        _print_hf_steps(result["hf_llama_1b_steps"])
    g = result["gemm_profile"]
    print(f"H100 GEMM profile ({g['rows']} rows of {g['table']}), each row predicted by a "
          f"profile fitted without it: median |error| {100 * g['median_abs_rel_error']:.1f}%, "
          f"{100 * g['within_20_percent']:.1f}% of rows within 20%, max "
          f"{100 * g['max_abs_rel_error']:.1f}%")
    print("H100 kernel profiles by kind (call + size x rate per kind, same table), each row "
          "predicted by a profile fitted without it:")
    for name, k in result["kernel_profiles"].items():
        print(f"  {name:<20}{k['rows']:>3} rows  median |error| "
              f"{100 * k['median_abs_rel_error']:5.1f}%  max {100 * k['max_abs_rel_error']:5.1f}%"
              f"  (size: {k['unit']})")
    m = result["measured_prices"]
    if m["step_ms_mean_abs_rel_error"]:
        print(f"one-GPU step time priced by {m['kernel_table']} (moved to each step's GPU) with "
              f"plain PyTorch's autocast kernels (fused on the compiled rows), no efficiency "
              f"constant on the profiled kernels (checked, not held out): "
              + ", ".join(f"{t} {100 * e:.1f}%"
                          for t, e in m["step_ms_mean_abs_rel_error"].items()))
    if args.json:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
