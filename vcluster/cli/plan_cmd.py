"""``vcluster plan gpt ...``: the best parallel configuration of a GPT on N GPUs.

    vcluster plan gpt --hidden 12288 --layers 96 --heads 96 --seq 2048 --vocab 51200 \\
        --gpus 1024 --global-batch 1536 --hardware a100-80gb-dgx --top 10

enumerates TP x PP x DP x micro-batch x schedule x sequence parallelism x recomputation,
drops what does not fit memory, screens the rest in closed form, replays the best in the
SimPy timing model (at least the top K and 10) and prints the top K (step time, tokens/s
per GPU, hardware TFLOP/s per GPU — the FLOPs executed, recomputation included —, MFU —
the model's FLOPs —, peak memory, compute/comm ratio) and the rejections per reason.
Progress goes to stderr: a bar on a terminal, a line every few seconds and one per stage
when stderr is a pipe or a file (``plan: 10/10 candidates replayed in 11.2 s``);
``--quiet``: none.
``--json PATH`` writes ``{"candidates": [...], "rejected": {reason: count}, "precision":
name}`` (every configuration that fits, best first, each with ``tokens_per_s_per_gpu``,
``hardware_tflops_per_gpu`` (also under its earlier name ``tflops_per_gpu``) and
``model_tflops_per_gpu``; ``--precision megatron|torch_amp|
torch_compile|fp64|fp32``: the memory model's bytes per parameter and activation, as ``simulate
gpt``'s); ``--out DIR`` writes plan.json and plan.png (step time against peak memory for
every candidate). ``--max-cp N`` also searches context
parallelism up to cp = N (``--cp-algorithm ring|all_gather``; default 1: none, the
search and table of earlier versions); the table then has a cp column, and the JSON
candidates always carry ``cp``. ZeRO: ``--zero-stages 0,1,2,3`` (the default) are the
stages searched, each candidate taking the lowest that fits its memory (2 and 3 only
with pp = 1; see vcluster/planner/candidates.py); the
table's ``zero`` column and the JSON's ``zero_stage`` say which. ``--hardware`` also
takes a heterogeneous cluster file (``parts: [{hardware, nodes}, ...]``,
docs/heterogeneous.md; ``--gpus`` must be its GPU count): the stages are placed on the
GPU kinds and their layers balanced (the table's ``layers`` column, the JSON's
``layers_per_stage``), or — where a stage would straddle two kinds — the data-parallel
replicas each on one kind (``cluster_split``: "stages" or "replicas"), and the output
names the cluster and, for the best configuration, each part's kind, nodes, stages and
layers, or its replicas. Exit 0 when a configuration fits, 1 when
none does, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

from modeling import CPAlgorithm, ZeroStage

from . import serve_cmd
from .args import (add_attention_argument, add_fp8_argument, low_precision, add_grad_reduce_argument,
                   add_model_arguments, add_tp_overlap_argument, fraction, gpt_config,
                   model_title, positive_int, precision_name)

__all__ = ["add_parser", "plan_json", "JSON_KEYS", "DERIVED_KEYS"]

#: a JSON candidate's keys from plan_gpt's columns (``tflops_per_gpu``: hardware FLOPs,
#: recomputation included, the name earlier versions wrote; ``hardware_tflops_per_gpu``
#: repeats it under the clearer name)
JSON_KEYS = ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "schedule", "virtual_stages",
             "first_stage_layers", "last_stage_layers", "layers_per_stage",
             "sequence_parallel",
             "recompute", "distributed_optimizer", "zero_stage", "cluster_split",
             "moe_comm_overlap", "moe_ep_node_ranks", "step_time_s", "tflops_per_gpu",
             "mfu",
             "peak_memory_gb", "replayed", "compute_comm_ratio")
#: and the keys derived from them (:func:`vcluster.planner.search.throughput`)
DERIVED_KEYS = ("tokens_per_s_per_gpu", "hardware_tflops_per_gpu", "model_tflops_per_gpu")


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help="search the best parallel configuration")
    kinds = plan.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    gpt = kinds.add_parser("train", aliases=["gpt"], help="a transformer's training "
                           "(TP x PP x DP x schedule; a preset, a config.json or shape flags)",
                           description=__doc__.split("\n\n")[0])
    add_model_arguments(gpt, skew=False)
    gpt.add_argument("--gpus", type=positive_int, required=True, help="GPUs to plan for")
    gpt.add_argument("--max-ep", type=positive_int, default=1,
                     help="MoE: the largest expert-parallel degree tried (each ep divides "
                          "--experts and dp, or with the expert group folded over tp, etp 1, "
                          "is tp x a divisor of dp; default 1)")
    gpt.add_argument("--moe-dispatcher", choices=("alltoall", "allgather", "flex"),
                     default="alltoall", help="MoE: every candidate's token dispatcher with "
                     "ep > 1, as simulate gpt's (flex: DeepEP / HybridEP, across scale-up "
                     "domains with --moe-ep-node-ranks set from the hardware; default "
                     "alltoall)")
    gpt.add_argument("--moe-comm-overlap", action="store_true",
                     help="MoE: Megatron-Core's all-to-all overlap (combined 1F1B) on every "
                          "candidate with ep > 1 that allows it (alltoall or flex, no full "
                          "recomputation, 1f1b on pp 1 or interleaved_1f1b), off on the "
                          "others; the table's and JSON's moe_comm_overlap says which")
    gpt.add_argument("--global-batch", type=positive_int, required=True,
                     help="sequences per step, over all data-parallel replicas")
    gpt.add_argument("--hardware", default="a100-80gb-dgx",
                     help="a preset (vcluster hardware list), a YAML file, or a cluster "
                          "file of several GPU kinds (parts: [{hardware, nodes}, ...])")
    gpt.add_argument("--cluster-split", choices=("stages", "replicas"), default=None,
                     help="on a cluster file of several GPU kinds: search only plans with each "
                          "pipeline stage on one kind (stages) or each data-parallel replica "
                          "on one kind (replicas); default both (docs/heterogeneous.md)")
    gpt.add_argument("--top", type=positive_int, default=10, help="rows to show (default 10)")
    gpt.add_argument("--replay", type=int, default=None,
                     help="candidates to replay in SimPy (default max(top, 10))")
    gpt.add_argument("--max-tp", type=positive_int, default=None,
                     help="largest tensor-parallel degree (default: GPUs per node)")
    gpt.add_argument("--workers", type=positive_int, default=None,
                     help="replay processes (default: the cores this process may use)")
    gpt.add_argument("--memory-headroom", type=fraction, default=None, metavar="FRACTION",
                     help="share of each device's memory a configuration leaves free "
                          "(default 0.05)")
    add_attention_argument(gpt)
    add_tp_overlap_argument(gpt)
    add_grad_reduce_argument(gpt)
    add_fp8_argument(gpt)
    gpt.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                     default=None, help="shard the optimizer state over dp in every "
                     "configuration (or never, with --no-...): --zero-stages 1 (or 0); "
                     "default: where a configuration needs it to fit")
    gpt.add_argument("--zero-stages", type=_zero_stages, default=None, metavar="LIST",
                     help="ZeRO stages to search, comma-separated (default 0,1,2,3): each "
                          "candidate takes the lowest that fits")
    gpt.add_argument("--max-cp", type=positive_int, default=1,
                     help="largest context-parallel degree to search (default 1: none)")
    gpt.add_argument("--cp-algorithm", choices=CPAlgorithm.values(), default="ring",
                     help="context parallelism's attention algorithm (default ring)")
    gpt.add_argument("--precision", default="megatron", metavar="POLICY",
                     help="bytes per parameter and activation of the memory model: megatron "
                          "(default, 18 B/param), torch_amp (16 B/param), torch_compile "
                          "(torch_amp under torch.compile), fp64, fp32 (the emulated "
                          "program's); see simulate gpt --help")
    gpt.add_argument("--json", metavar="PATH", help="write every candidate as JSON")
    gpt.add_argument("--out", metavar="DIR", help="write plan.json and plan.png here")
    gpt.add_argument("--quiet", action="store_true",
                     help="no progress on stderr (a bar on a terminal, else a line every few "
                          "seconds and one per stage)")
    gpt.set_defaults(run=_gpt)
    serve_cmd.add_plan_parser(kinds)


def _zero_stages(text: str) -> tuple:
    try:
        stages = tuple(sorted({int(z) for z in text.split(",")}))
    except ValueError:
        stages = ()
    if not stages or any(z not in ZeroStage.values() for z in stages):
        raise argparse.ArgumentTypeError(f"expected stages among 0,1,2,3 separated by "
                                         f"commas, got {text!r}")
    return stages


def _finite(x):
    return x if not isinstance(x, float) or math.isfinite(x) else None


def plan_json(df) -> dict:
    """``{"candidates": [...], "rejected": {reason: count}, "precision": ..., "fp8": ...,
    "gemm_format": ..., "grad_reduce_dtype": ..., "attention": ..., "tp_overlap": ...,
    "cluster_parts": ...}`` from plan_gpt's DataFrame; a candidate
    holds :data:`JSON_KEYS` and :data:`DERIVED_KEYS`."""
    from vcluster.planner.search import throughput     # lazy: keeps vcluster --help fast
    rows = df[list(JSON_KEYS)].to_dict(orient="records")
    candidates = [{k: _finite(v.item() if hasattr(v, "item") else v) for k, v in r.items()}
                  for r in rows]
    for c in candidates:
        for k in ("first_stage_layers", "last_stage_layers"):     # None: an even split
            c[k] = None if c[k] is None else int(c[k])
        c["layers_per_stage"] = None if c["layers_per_stage"] is None else [
            int(n) for n in c["layers_per_stage"]]
        c.update(throughput(c["step_time_s"], df.attrs),
                 hardware_tflops_per_gpu=c["tflops_per_gpu"])
    return {"candidates": candidates, "rejected": dict(df.attrs.get("rejected", {})),
            "precision": df.attrs.get("precision", "megatron"),
            "fp8": bool(df.attrs.get("fp8", False)),
            "gemm_format": (None if not df.attrs.get("fp8") else "fp8"
                            if df.attrs["fp8"] is True else df.attrs["fp8"]),
            "grad_reduce_dtype": df.attrs.get("grad_reduce_dtype", "model"),
            "attention": df.attrs.get("attention", "flash"),
            "tp_overlap": df.attrs.get("tp_overlap", "backward"),
            "cluster_parts": df.attrs.get("cluster_parts")}


def _stage_layers(row, layers: int) -> tuple:
    """Each pipeline rank's layers of a plan row (its ``layers_per_stage``, else the
    split its knobs give)."""
    # lazy: keeps vcluster --help fast
    from pipeline_parallel.gpt import ParallelConfig
    if row["layers_per_stage"] is not None:
        return tuple(int(n) for n in row["layers_per_stage"])
    v = int(row["virtual_stages"])
    ends = {k: None if row[k] is None or row[k] != row[k] else int(row[k])
            for k in ("first_stage_layers", "last_stage_layers")}
    par = ParallelConfig(global_batch=1, pp=int(row["pp"]), schedule=row["schedule"],
                         virtual_stages=v if row["schedule"] == "interleaved_1f1b" else None,
                         **ends)
    return tuple(par.rank_layers(layers, r) for r in range(par.pp))


def _print_cluster(df, cluster) -> None:
    """The best configuration's stages on the cluster's parts."""
    # lazy: keeps vcluster --help fast
    from vcluster.planner.candidates import stage_kinds
    from .simulate_cmd import cluster_lines, replicas_text
    row = df.iloc[0]
    pp = int(row["pp"])
    if len(cluster.kinds) == 1:                  # one kind: the mesh's own rank order
        print(f"cluster {cluster.name}: {cluster.gpus} GPUs of one kind, ranks in the "
              f"mesh's order:")
        for line in cluster_lines(cluster, []):
            print("  " + line)
        return
    if row.get("cluster_split") == "replicas":
        # lazy: keeps vcluster --help fast
        from pipeline_parallel.gpt import ParallelConfig
        from vcluster.planner.candidates import replica_kinds
        par = ParallelConfig(global_batch=int(row["dp"]), dp=int(row["dp"]), pp=pp,
                             tp=int(row["tp"]), cp=int(row["cp"]), ep=int(row["ep"]),
                             etp=None if row["etp"] is None or row["etp"] != row["etp"]
                             else int(row["etp"]))
        kinds = replica_kinds(cluster, par)
        print(f"cluster {cluster.name}: {cluster.gpus} GPUs of {len(cluster.kinds)} kinds; the "
              f"best configuration's data-parallel replicas (in the mesh's order, each on "
              f"one kind; the slowest sets the step):")
        first = 0
        for kind, run in itertools.groupby(kinds):
            count = len(list(run))
            print(f"  {cluster.kinds[kind].name}: {replicas_text(first, count)}")
            first += count
        return
    kinds = stage_kinds(cluster, pp)
    size = cluster.gpus // pp
    stages = [(cluster.part_of(q * size), n) for q, n in
              enumerate(_stage_layers(row, df.attrs["config"].layers))]
    print(f"cluster {cluster.name}: {cluster.gpus} GPUs of {len(cluster.kinds)} kinds; the "
          f"best configuration's pipeline stages (placed pipeline-major, each on one kind"
          f"{'' if kinds is not None else ': NOT'}):")
    for line in cluster_lines(cluster, stages):
        print("  " + line)


def _print_table(df, top: int, cp: bool = False, ep: bool = False,
                 layers: bool = False, overlap: bool = False) -> None:
    """The top rows and a legend of the figures; ``cp``: with a cp column (after dp);
    ``ep``: expert-parallel columns after dp (and cp), ep and etp (MoE models);
    ``overlap``: an ``a2a-ovl`` column after etp, the row's ``moe_comm_overlap``;
    ``layers``: a column of the layers per stage (heterogeneous clusters)."""
    from vcluster.planner.search import throughput     # lazy: keeps vcluster --help fast
    cp_head = f"{'cp':>3} " if cp else ""
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>5} {cp_head}" + (f"{'ep':>3} {'etp':>3} " if ep else "")
            + (f"{'a2a-ovl':<7} " if overlap else "")
            + f"{'b':>3} {'m':>5} {'schedule':<20} {'sp':<3} "
            f"{'recompute':<9} {'zero':>4} {'step s':>8} {'tok/s/GPU':>9} {'hw TFLOP/s':>10} "
            f"{'MFU':>6} {'mem GB':>7} {'comp/comm':>9}  source"
            + ("  layers per stage" if layers else ""))
    print(head)
    for i, r in df.head(top).iterrows():
        tokens = throughput(r["step_time_s"], df.attrs)["tokens_per_s_per_gpu"]
        sched = r["schedule"] + (f" v={r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        ratio = f"{r['compute_comm_ratio']:9.1f}" if math.isfinite(r["compute_comm_ratio"]) \
            else f"{'inf':>9}"
        cp_col = f"{r['cp']:>3} " if cp else ""
        ep_col = f"{r['ep']:>3} {r['etp']:>3} " if ep else ""
        if overlap:
            ep_col += f"{'yes' if r['moe_comm_overlap'] else 'no':<7} "
        print(f"{i + 1:>3} {r['tp']:>3} {r['pp']:>3} {r['dp']:>5} {cp_col}{ep_col}"
              f"{r['micro_batch']:>3} "
              f"{r['microbatches']:>5} {sched:<20} {'yes' if r['sequence_parallel'] else 'no':<3} "
              f"{r['recompute']:<9} {r['zero_stage']:>4} "
              f"{r['step_time_s']:8.3f} {tokens:9,.0f} {r['tflops_per_gpu']:10.1f} "
              f"{100 * r['mfu']:5.1f}% {r['peak_memory_gb']:7.1f} {ratio}  "
              f"{'replay' if r['replayed'] else 'screen':<6}"
              + (f"  {_layers_text(r)}" if layers else ""))
    print(f"{'':>4}tok/s/GPU: global batch · seq / (step · GPUs); hw TFLOP/s: hardware "
          "TFLOP/s per GPU, the FLOPs executed (with recomputation); MFU: the model's FLOPs "
          "over the peak (without)")


def _layers_text(row) -> str:
    if row.get("cluster_split") == "replicas":
        return "replicas on kinds"
    lps = row["layers_per_stage"]
    return "even" if lps is None else ",".join(str(int(n)) for n in lps)


def _progress(quiet: bool, lines):
    """plan_gpt's ``progress``: none with ``--quiet``; rich's bar when stderr is a terminal
    (None); else ``lines("plan")``, a line every few seconds and one per stage (a bar's
    escape codes in a pipe or a log file would be noise, and nothing looked hung)."""
    if quiet:
        return False
    return None if sys.stderr.isatty() else lines("plan")


def _why_none(rejected: dict, gpus: int, hw) -> str:
    """Why no configuration is left: memory when some configurations divide the model
    and batch but none fits, else the counts that do not divide."""
    memory = rejected.get("out_of_memory", 0)
    shapes = sum(n for reason, n in rejected.items() if reason != "out_of_memory")
    if memory:
        kinds = getattr(hw, "kinds", (hw,))        # a cluster's GPU kinds, or the one
        hbm = " or ".join(f"{h.device.hbm_bytes / 1e9:.0f}" for h in kinds)
        return (f"no configuration fits the device memory ({hbm} "
                f"GB per GPU): {memory} rejected for memory, {shapes} for counts that do "
                "not divide (see 'rejected')")
    return (f"no configuration divides this model and batch over {gpus} GPUs (every "
            "candidate was rejected for a count that does not divide: see 'rejected')")


def _gpt(args) -> int:
    # lazy: keeps vcluster --help fast
    from vcluster.planner.search import REJECT_REASONS, plan_gpt
    from vcluster.localhost import load_hardware   # presets and files; says where localhost goes
    from vcluster.planner.progress import ProgressLines
    from vcluster.timing.cluster import ClusterSpec, load_cluster
    if args.replay is not None and args.replay < 0:
        raise ValueError(f"--replay must be >= 0, got {args.replay}")
    if args.zero_stages is not None and args.distributed_optimizer is not None:
        raise ValueError("--distributed-optimizer means --zero-stages 1 (--no-... 0); give "
                         "one of them")
    hw = load_cluster(args.hardware, hardware_loader=load_hardware)
    cluster = hw if isinstance(hw, ClusterSpec) else None
    c = gpt_config(args)
    df = plan_gpt(config=c, gpus=args.gpus, global_batch=args.global_batch,
                  hardware=hw, top=args.top, replay=args.replay, max_tp=args.max_tp,
                  workers=args.workers, progress=_progress(args.quiet, ProgressLines),
                  attention=args.attention, tp_overlap=args.tp_overlap,
                  grad_reduce_dtype=args.grad_reduce_dtype,
                  distributed_optimizer=args.distributed_optimizer,
                  max_cp=args.max_cp, cp_algorithm=args.cp_algorithm,
                  max_ep=args.max_ep, zero_stages=args.zero_stages,
                  moe_dispatcher=args.moe_dispatcher, moe_comm_overlap=args.moe_comm_overlap,
                  precision=precision_name(args.precision), fp8=low_precision(args),
                  cluster_splits=None if args.cluster_split is None else (args.cluster_split,),
                  **({} if args.memory_headroom is None
                     else {"memory_headroom": args.memory_headroom}))
    a = df.attrs
    print(f"{model_title(a['config'], args.model)}, global batch {args.global_batch}, on {args.gpus} x {hw.name}: {a['candidates']} "
          f"configurations fit {a['memory_limit_gb']:.1f} GB per device "
          f"({100 * a['memory_headroom']:g}% headroom), {a['replayed']} replayed, planned in "
          f"{a['planning_time_s']:.1f} s; memory in {a['precision']} precision"
          + (f"; {'FP8' if a['fp8'] is True else str(a['fp8']).upper()} linear layers"
             if a["fp8"] else "")
          + ("; gradients reduced in fp32" if a.get("grad_reduce_dtype") == "fp32" else "")
          + (f"; {a['attention']} attention" if a.get("attention", "flash") != "flash"
             else "")
          + (f"; MoE {a['moe_dispatcher']} dispatcher" if a.get("moe_dispatcher", "alltoall")
             != "alltoall" else "")
          + ("; MoE all-to-all overlap where allowed" if a.get("moe_comm_overlap") else ""))
    if len(df):
        _print_table(df, args.top, cp=args.max_cp > 1, ep=bool(a["config"].experts),
                     layers=cluster is not None, overlap=args.moe_comm_overlap)
        if cluster is not None:
            _print_cluster(df, cluster)
    print("rejected:" + ("" if a["rejected"] else " none"))
    for reason, count in a["rejected"].items():
        print(f"  {count:>7}  {reason}: {REJECT_REASONS[reason]}")
    result = plan_json(df)
    if args.json:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.out:
        # lazy: keeps vcluster --help fast
        from reports.plan_plot import plan_png
        from vcluster.runtime.files import write_bytes_atomic, write_json
        write_json(os.path.join(args.out, "plan.json"), result)
        png = plan_png(df, title=f"{args.model or 'GPT'} h={c.hidden} l={c.layers} on "
                       f"{args.gpus} x "
                       f"{hw.name}", hbm_gb=min(h.device.hbm_bytes for h in getattr(
                           hw, "kinds", (hw,))) / 1e9)
        if png is not None:
            write_bytes_atomic(os.path.join(args.out, "plan.png"), png)
        print(f"wrote {args.out}/plan.json" + (" and plan.png" if png else ""))
    if not len(df):
        print("vcluster plan: " + _why_none(a["rejected"], args.gpus, hw))
        return 1
    return 0
