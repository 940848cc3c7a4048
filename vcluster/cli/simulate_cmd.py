"""``vcluster simulate gpt ...``: predict one GPT training iteration on real hardware.

    vcluster simulate gpt --hidden 12288 --layers 96 --heads 96 --seq 2048 --vocab 51200 \\
        --tp 8 --pp 8 --dp 16 --global-batch 1536 --micro-batch 1 --schedule 1f1b

prints the step time, tokens/s per GPU (global batch · seq / (step time · GPUs)), hardware
TFLOP/s per GPU (the FLOPs executed, recomputation included), model TFLOP/s per GPU and
MFU (the model's FLOPs, no recomputation), the per-device split of the step (compute,
communication, exposed communication, bubble), the compute/communication ratio for the
step and per op kind (embedding, attention, mlp, logits, optimizer; flagged below 10; the
data-parallel gradient reductions, and ZeRO's weight gathers, in rows of their own,
"grad reduce (dp)" and "param gather (dp)", communication only) and
peak memory per device and its parts (``--attention flash|unfused``,
``--arch llama --kv-heads N --ffn-hidden N [--head-dim D] [--qk-norm]``: a Llama
(a head dimension of its own, QK-norm),
``--zero 0|1|2|3``: ZeRO's stage, traced and replayed as the program runs it — 1 shards
the optimizer state over dp, 2 also the gradients (a reduce-scatter per micro-batch), 3
also the weights (all-gathered before each module's forward and backward); 2 and 3 need
pp = 1; ``--distributed-optimizer`` is an alias of
``--zero 1``: vcluster/planner/memory.py; ``--precision
megatron|torch_amp|torch_compile|fp64|fp32``: the bytes per parameter and activation the
memory counts — Megatron's bf16 + fp32 master/grads/Adam, 18 B/param, the default;
PyTorch AMP's fp32 params, grads and Adam, 16 B/param, eager or under ``torch.compile``;
the emulated program's own: vcluster/planner/precision.py); ``--cp N [--cp-algorithm
ring|all_gather]``: context parallelism (the sequence split over N ranks; GPUs =
tp·pp·cp·dp, which ``--gpus`` checks when given); ``--experts N --moe-top-k K
--ep E [--expert-skew X]``: a mixture of experts over E expert-parallel ranks carved out of
dp, the busiest expert X times the mean (not with ``--cp`` > 1 yet); ``--json PATH`` writes the
same figures (``tokens_per_s_per_gpu``, ``hardware_tflops_per_gpu`` — also under its earlier
name ``tflops_per_gpu`` —, ``model_tflops_per_gpu``, ``mfu``, ``ops``, ...). A configuration
whose peak exceeds the device memory less ``--memory-headroom`` (default 5%) is still
simulated (``fits: false``), but the command says so on stderr and exits 1 unless
``--allow-oom`` is given. ``--hardware`` also takes a heterogeneous cluster file
(``name`` and ``parts: [{hardware, nodes}, ...]``, docs/heterogeneous.md): every rank is
then priced on its own GPU kind, the output names the cluster and, per part, its kind,
nodes, the pipeline stages on it and their layers (``--layers-per-stage 5,11``: an
uneven split of one count per stage; the JSON's ``stages``). ``--activation-offload F``:
the first floor(F·L) layers of each stage keep their activations in host memory over the
hardware's host link (NVLink-C2C on gb200-nvl72, gb300-nvl72; refused elsewhere): the
output adds the host memory per GPU and the copy time the layers' compute does not hide,
included in the step time (docs/offload.md; the JSON's ``host_memory_gb``,
``offload_exposed_s``, ``offload``).
"""

from __future__ import annotations

import sys

from modeling import CPAlgorithm, Recompute, ZeroStage

from . import serve_cmd
from .args import (SCHEDULES, add_attention_argument, add_fp8_argument, low_precision,
                   add_grad_reduce_argument, add_model_arguments, add_tp_overlap_argument,
                   fraction, gpt_config, int_at_least, model_title, positive_int,
                   precision_name)

__all__ = ["add_parser"]




def _module_list(text: str) -> tuple[str, ...]:
    """``--recompute-modules a,b`` -> ("a", "b") (ParallelConfig checks the names)."""
    return tuple(m.strip() for m in text.split(",") if m.strip())

def add_parser(commands) -> None:
    sim = commands.add_parser("simulate", help="predict step time on real hardware")
    kinds = sim.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    gpt = kinds.add_parser("train", aliases=["gpt"], help="a transformer's training step "
                           "(a preset, a config.json or shape flags; Megatron TP, PP, DP)",
                           description=__doc__.split("\n\n")[0])
    add_model_arguments(gpt)
    for name, what in (("tp", "tensor-parallel degree: ranks each layer's matrices are split "
                               "over"),
                       ("pp", "pipeline-parallel degree: stages the layers are split into"),
                       ("dp", "data-parallel degree: replicas, each with B/dp sequences"),
                       ("ep", "expert-parallel degree (MoE): ranks the experts are spread "
                              "over, carved out of dp (with --etp 1: of tp x dp)")):
        gpt.add_argument(f"--{name}", type=positive_int, default=1, help=f"{what} (default 1)")
    gpt.add_argument("--etp", type=positive_int, default=None,
                     help="expert tensor parallelism (MoE): --tp (the default: each expert "
                          "split over tp) or 1 (experts whole, the ep group made of whole tp "
                          "groups; needs --sequence-parallel)")
    for end in ("first", "last"):
        gpt.add_argument(f"--{end}-stage-layers", default=None,
                         type=int_at_least(0, f"layers of the {end} pipeline stage"),
                         help=f"layers of the {end} pipeline stage (the other stages share "
                              "the rest evenly; Megatron's decoder_"
                              f"{end}_pipeline_num_layers, for layer counts pp x v does not "
                              f"divide; 0: the {'embedding' if end == 'first' else 'head'} "
                              "alone; default: an even split)")
    gpt.add_argument("--layers-per-stage", type=layer_counts, default=None, metavar="LIST",
                     help="every pipeline stage's layers, comma-separated (one per stage, "
                          "one stage per rank; e.g. 5,11 on pp 2: stages on GPU kinds of "
                          "different speeds; not with --first/--last-stage-layers)")
    gpt.add_argument("--moe-dispatcher", choices=("alltoall", "allgather", "flex"),
                     default="alltoall", help="MoE: how tokens reach their experts, "
                     "all_to_all over the expert group, all-gather the group's tokens and "
                     "reduce-scatter the outputs (Megatron's allgather, for small groups), "
                     "or flex (DeepEP / HybridEP: each token once per destination rank, "
                     "its experts' outputs summed there; default alltoall)")
    gpt.add_argument("--moe-ep-node-ranks", type=int, default=None, metavar="D",
                     help="MoE, flex only: the expert group's ranks per node (scale-up "
                     "domain): DeepEP's internode path, each token sent over the network "
                     "once per destination node and forwarded over NVLink there; ep must be "
                     "a multiple of D (default: the group in one node)")
    gpt.add_argument("--moe-comm-overlap", action="store_true",
                     help="MoE: Megatron-Core's --overlap-moe-expert-parallel-comm (combined "
                     "1F1B): the steady state's forward and backward of two micro-batches "
                     "run together, each one's token all-to-alls overlapping the other's "
                     "compute (needs ep > 1, the alltoall or flex dispatcher, and 1f1b on "
                     "pp 1 or interleaved_1f1b)")
    gpt.add_argument("--cp", type=positive_int, default=1,
                     help="context parallelism: ranks the sequence is split over (default 1)")
    gpt.add_argument("--cp-algorithm", choices=CPAlgorithm.values(), default="ring",
                     help="how attention reaches the other ranks' K/V (default ring)")
    gpt.add_argument("--gpus", type=positive_int, default=None,
                     help="check that tp·pp·cp·dp is this many GPUs")
    gpt.add_argument("--global-batch", type=positive_int, required=True,
                     help="sequences per step, over all data-parallel replicas (B)")
    gpt.add_argument("--micro-batch", type=positive_int, default=1,
                     help="sequences per micro-batch (b; B/(dp·b) micro-batches; default 1)")
    gpt.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                     help="pipeline schedule (default 1f1b)")
    gpt.add_argument("--virtual-stages", type=positive_int, default=None,
                     help="chunks per pipeline rank of the interleaved_1f1b schedule")
    gpt.add_argument("--sequence-parallel", action="store_true",
                     help="Megatron's sequence parallelism over the tp ranks (LayerNorms and "
                          "dropout split along the sequence)")
    gpt.add_argument("--recompute", choices=Recompute.values(), default="none",
                     help="activation recomputation (default none): selective re-runs the "
                          "core attention, full every layer's forward, op torchtitan's per-op "
                          "policy (dense Llama models: W_k, W_o, W_up and the elementwise ops "
                          "re-run)")
    gpt.add_argument("--recompute-modules", type=_module_list, default=None,
                     metavar="MODULES",
                     help="with --recompute selective: the modules re-run in the backward, "
                          "comma-separated (Megatron-Core's --recompute-modules; default "
                          "core_attn): core_attn, layernorm, mlp (the dense MLP), mla_up_proj "
                          "(latent attention's up-projections), moe_act (the experts' "
                          "activation)")
    add_attention_argument(gpt)
    add_tp_overlap_argument(gpt)
    add_grad_reduce_argument(gpt)
    add_fp8_argument(gpt)
    gpt.add_argument("--zero", type=int, choices=ZeroStage.values(), default=None,
                     help="ZeRO stage: 0 DDP (default), 1 optimizer state sharded over dp, "
                          "2 also the gradients, 3 also the weights (2 and 3: pp = 1; with "
                          "ep > 1 the experts' over the expert-data-parallel ranks)")
    gpt.add_argument("--distributed-optimizer", action="store_true",
                     help="shard the optimizer state and fp32 master weights over dp "
                          "(Megatron's distributed optimizer): an alias of --zero 1")
    gpt.add_argument("--precision", default="megatron", metavar="POLICY",
                     help="bytes per parameter and activation of the memory model: "
                          "megatron (default: bf16 weights, fp32 grads, fp32 master + Adam, "
                          "18 B/param), torch_amp (fp32 params, grads, Adam: 16 B/param), "
                          "torch_compile (torch_amp under torch.compile), "
                          "fp64 or fp32 (the emulated program's own count)")
    gpt.add_argument("--autocast-kernels", choices=("auto", "on", "off"), default="auto",
                     help="price plain PyTorch's autocast kernels (casts, fp32 LayerNorms "
                          "and residual adds; docs/timing.md): auto (default) under "
                          "--precision torch_amp on hardware with measured kernels")
    gpt.add_argument("--eager-kernels", action="store_true",
                     help="a Llama run by eager PyTorch (torchtitan without torch.compile): "
                          "price its RMSNorms, rotary embeddings, SwiGLU and grouped K/V as "
                          "the unfused kernels eager PyTorch runs (dense Llama only; "
                          "docs/timing.md)")
    gpt.add_argument("--fp8-casts", choices=("torchao-tensorwise", "torchao-rowwise"),
                     default=None,
                     help="with --fp8: price the cast kernels of torchao's float8 training "
                          "(torchtitan's float8) beside each FP8 GEMM, by its scaling recipe "
                          "(default: none, Transformer Engine's casts fused into the kernels "
                          "before the GEMMs; docs/timing.md)")
    gpt.add_argument("--torch-cp", action="store_true",
                     help="with --cp > 1 (ring): the context-parallel attention as PyTorch's "
                          "experimental context_parallel runs it (torchtitan): float32 "
                          "merges and accumulators, K and V repeated to every query head, "
                          "its buffer copies (default: Megatron's ring; docs/timing.md)")
    gpt.add_argument("--fsdp2-copies", action="store_true",
                     help="with --zero 2 or 3: price the copies PyTorch FSDP2 (per-parameter "
                          "sharding, torchtitan) makes around each data-parallel gather and "
                          "reduce-scatter (default: one flat parameter per module, as FSDP1 "
                          "and Megatron keep it; docs/timing.md)")
    gpt.add_argument("--hardware", default="a100-80gb-dgx",
                     help="a preset (vcluster hardware list), a YAML file, or a cluster "
                          "file of several GPU kinds (parts: [{hardware, nodes}, ...])")
    gpt.add_argument("--cluster-split", choices=("stages", "replicas"), default=None,
                     help="on a cluster file of several GPU kinds: each pipeline stage on "
                          "one kind (stages, the default when --pp > 1) or each data-parallel "
                          "replica on one kind (replicas, the default when --pp 1); "
                          "docs/heterogeneous.md")
    gpt.add_argument("--memory-headroom", type=fraction, default=None, metavar="FRACTION",
                     help="share of the device memory to leave free (default 0.05)")
    gpt.add_argument("--activation-offload", type=fraction, default=0.0, metavar="FRACTION",
                     help="share of each pipeline stage's layers whose activations go to "
                          "host memory over the host link (NVLink-C2C: gb200-nvl72, "
                          "gb300-nvl72); Megatron's --cpu-offloading-num-layers N of a stage "
                          "of L layers is N/L (default 0; docs/offload.md)")
    gpt.add_argument("--allow-oom", action="store_true",
                     help="exit 0 even when the configuration does not fit the memory")
    gpt.add_argument("--full-replay", action="store_true",
                     help="replay every micro-batch of the step (default: a pipelined step of "
                          "many micro-batches is extrapolated from three short ones, its "
                          "figures affine in the micro-batches past the warm-up, checked; "
                          "the two agree to rounding: docs/timing.md)")
    gpt.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    gpt.set_defaults(run=_gpt)
    serve_cmd.add_simulate_parser(kinds)


def _gpt(args) -> int:
    # lazy: keeps vcluster --help fast
    from pipeline_parallel.gpt import ParallelConfig
    from vcluster.localhost import load_hardware   # presets and files; says where localhost goes
    from vcluster.timing.cluster import load_cluster
    from vcluster.planner.memory import MEMORY_HEADROOM
    from vcluster.planner.simulation import RATIO_FLAG, describe_ratio, simulate_gpt
    from vcluster.planner.precision import PRECISIONS
    from vcluster.planner.float8_casts import RECIPE_GEMM_FORMATS
    zero = zero_stage(args)
    precision_name(args.precision)
    config = gpt_config(args)
    parallel = ParallelConfig(global_batch=args.global_batch, micro_batch=args.micro_batch,
                              dp=args.dp, pp=args.pp, tp=args.tp, schedule=args.schedule,
                              virtual_stages=args.virtual_stages,
                              sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                              **({} if args.recompute_modules is None else
                                 {"recompute_modules": args.recompute_modules}),
                              attention=args.attention, tp_overlap=args.tp_overlap,
                              grad_reduce_dtype=args.grad_reduce_dtype,
                              zero_stage=zero, cp=args.cp, cp_algorithm=args.cp_algorithm,
                              ep=args.ep, etp=args.etp, moe_dispatcher=args.moe_dispatcher,
                              moe_comm_overlap=args.moe_comm_overlap,
                              moe_ep_node_ranks=args.moe_ep_node_ranks,
                              first_stage_layers=args.first_stage_layers,
                              last_stage_layers=args.last_stage_layers,
                              layers_per_stage=args.layers_per_stage,
                              activation_offload=args.activation_offload)
    parallel.check_microbatches()
    if args.gpus is not None and args.gpus != parallel.gpus:
        raise ValueError(f"--gpus {args.gpus} is not tp·pp·cp·dp = {args.tp}·{args.pp}·"
                         f"{args.cp}·{args.dp} = {parallel.gpus}; choose degrees whose "
                         f"product is the GPU count")
    if args.torch_cp and (args.cp < 2 or args.cp_algorithm != "ring"):
        raise ValueError(f"--torch-cp prices PyTorch's context-parallel ring: it needs --cp "
                         f"2 or more with --cp-algorithm ring, got --cp {args.cp} "
                         f"--cp-algorithm {args.cp_algorithm}")
    if args.fsdp2_copies and zero < 2:
        raise ValueError(f"--fsdp2-copies prices FSDP2's copies around ZeRO's gathers and "
                         f"reduce-scatters: it needs --zero 2 or 3, got --zero {zero}")
    if args.fp8_casts is not None and low_precision(args) not in (
            True, RECIPE_GEMM_FORMATS.get(args.fp8_casts)):
        row = RECIPE_GEMM_FORMATS.get(args.fp8_casts) == "fp8-row"
        raise ValueError(f"--fp8-casts {args.fp8_casts} prices torchao's casts to FP8: it "
                         f"needs --fp8 (or --gemm-format fp8"
                         f"{', or fp8-row' if row else ''}), got "
                         f"{'--gemm-format ' + args.gemm_format if args.gemm_format else 'neither'}")
    headroom = MEMORY_HEADROOM if args.memory_headroom is None else args.memory_headroom
    hardware = load_cluster(args.hardware, hardware_loader=load_hardware)
    r = simulate_gpt(config, parallel, hardware, memory_headroom=headroom,
                     expert_skew=args.expert_skew, precision=args.precision,
                     autocast_kernels={"auto": None, "on": True, "off": False}[
                         args.autocast_kernels], fp8=bool(low_precision(args)),
                     gemm_format=low_precision(args) if isinstance(low_precision(args), str)
                     else "fp8", eager_kernels=args.eager_kernels,
                     cluster_split=args.cluster_split, fp8_casts=args.fp8_casts,
                     fsdp2_copies=args.fsdp2_copies, torch_cp=args.torch_cp,
                     full_replay=args.full_replay)
    print(f"{model_title(config, args.model)} on {r.gpus} x {r.hardware}: tp={args.tp} pp={args.pp} dp={args.dp}"
          f"{f' cp={args.cp} ({args.cp_algorithm})' if args.cp > 1 else ''}, "
          f"{r.microbatches} micro-batches of {args.micro_batch}, {args.schedule}, "
          f"recompute {args.recompute}{', sequence parallel' if args.sequence_parallel else ''}"
          f", ZeRO stage {int(parallel.zero_stage)}"
          + (", TP backward not overlapped" if args.tp > 1 and args.tp_overlap == "none" else "")
          + (f", {r.gemm_format.upper()} linear layers" if r.fp8 else "")
          + (f" with {r.fp8_casts}'s cast kernels" if r.fp8_casts else "")
          + (", FSDP2's copies" if r.fsdp2_copies else "")
          + (", PyTorch's context-parallel ring" if r.torch_cp else "")
          + (", gradients reduced in fp32" if r.grad_reduce_dtype == "fp32" else "")
          + (f", {r.attention} attention" if r.attention != "flash" else "")
          + (f", activation offload {r.activation_offload:g}" if r.activation_offload else "")
          + (f"; {config.experts} experts, top-{config.moe_top_k}, ep={args.ep}"
             + (f", etp={parallel.etp}" if args.tp > 1 else "")
             + f", expert skew {args.expert_skew:g}" if config.experts else ""))
    if r.stages:
        print(f"  cluster {r.hardware}: {hardware.gpus} GPUs of {len(hardware.kinds)} kinds; "
              f"each rank priced on its own GPU, the slowest stage sets the step; MFU "
              f"against the GPUs' mean peak")
        for line in cluster_lines(hardware, [(s.part, s.layers) for s in r.stages]):
            print("    " + line)
    if r.replicas:
        print(f"  cluster {r.hardware}: {hardware.gpus} GPUs of {len(hardware.kinds)} kinds; "
              f"each data-parallel replica on one kind, each rank priced on its own GPU, the "
              f"slowest replica sets the step; memory held to the smallest GPU; MFU against "
              f"the GPUs' mean peak")
        for p in r.replicas:
            print(f"    part {p.part}: {p.hardware}: {replicas_text(p.first, p.count)}")
    print(f"  step time            {r.step_time_s:.3f} s")
    if r.replayed_microbatches:
        print(f"                       the step of {r.microbatches} micro-batches extrapolated "
              f"from replays of {', '.join(map(str, r.replayed_microbatches))} (affine past "
              f"the warm-up, checked; --full-replay replays it whole)")
    print(f"  tokens/s per GPU     {r.tokens_per_s_per_gpu:,.0f}   (global batch · seq / "
          f"(step time · GPUs))")
    print(f"  hardware TFLOP/s     {r.hardware_tflops_per_gpu:.1f} per GPU: the FLOPs executed, "
          f"recomputation included")
    print(f"  model TFLOP/s        {r.model_tflops_per_gpu:.1f} per GPU: the model's FLOPs, "
          f"MFU {100 * r.mfu:.1f}%" + (" of the BF16 peak" if r.fp8 else ""))
    print(f"  per device: compute {r.compute_s:.3f} s, communication {r.comm_s:.3f} s, "
          f"exposed {r.exposed_comm_s:.3f} s, bubble {r.bubble_s:.3f} s")
    if r.inductor_fusion:
        print("  kernels              plain PyTorch's under autocast, fused by torch.compile: "
              "weight and gradient casts, LayerNorms with their residual adds and casts, a "
              "bf16 loss (measured prices)")
    elif r.autocast_kernels:
        print("  kernels              plain PyTorch's under autocast: weight, input and "
              "gradient casts, fp32 LayerNorms and residual adds (measured prices)")
    elif r.eager_kernels:
        print("  kernels              eager PyTorch's: RMSNorms, rotary embeddings, SwiGLU "
              "and the K/V repeat unfused, each op its own kernel")
    rule, cost = describe_ratio(r.compute_s, r.comm_s, r.exposed_comm_s, r.step_time_s)
    print(f"  compute / comm       {r.compute_comm_ratio:.1f}   {rule}")
    print(f"                       {cost}")
    print(f"  peak memory          {r.peak_memory_gb:.1f} GB per device "
          f"({'fits' if r.fits else 'does NOT fit'} {r.memory_limit_gb:.1f} GB: "
          f"{r.device_memory_gb:.1f} GB less {100 * headroom:g}% headroom"
          + (", the stage nearest its device's limit" if r.stages else "") + ")")
    for st in r.stages:
        print(f"                       stage {st.stage} on {st.hardware}: "
              f"{st.peak_memory_gb:.1f} GB of {st.memory_limit_gb:.1f}"
              + ("" if st.fits else " (does NOT fit)"))
    parts = r.memory_breakdown_gb
    kept = {"korthikanti": f"{args.attention} attention",
            "emulator": "activations as the emulated program keeps them"}.get(
        PRECISIONS[r.precision].activation_count,
        f"{args.attention} attention, activations as PyTorch's autograd saves them")
    print("                       " + ", ".join(
        f"{k} {parts[k]:.1f}" for k in ("params", "grads", "optimizer", "activations",
                                         "logits")) + f" GB (pipeline rank "
          f"{parts['rank_position']}; {r.precision} precision, {kept}"
          f"{f', ZeRO-{zero}' if zero else ''})")
    if r.activation_offload:
        _print_offload(r)
    _print_ops(r.ops, RATIO_FLAG)
    if args.json:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(args.json, r.to_json())
        print(f"wrote {args.json}")
    if not r.fits:
        tight = [s for s in r.stages if not s.fits]        # a cluster: the stages short of it
        where = (f"stage {tight[0].stage} on {tight[0].hardware}" if tight
                 else f"a {r.hardware} device")
        peak = tight[0].peak_memory_gb if tight else r.peak_memory_gb
        print(f"vcluster simulate: the configuration does not fit: {peak:.1f} GB "
              f"per device at its peak, {r.memory_limit_gb:.1f} GB usable of the "
              f"{r.device_memory_gb:.1f} GB of {where} ({100 * headroom:g}% "
              "headroom)" + (f", and {r.host_memory_gb:.1f} GB of offloaded activations in "
                             f"{r.host_memory_limit_gb:.1f} GB of host memory per GPU"
                             if r.activation_offload else "")
              + "; the figures above assume memory it does not have (--allow-oom "
              "to exit 0 anyway)", file=sys.stderr)
        return 0 if args.allow_oom else 1
    return 0


def _print_offload(r) -> None:
    """The activation offload's lines: layers, host memory, the copies' exposed time."""
    st = max(r.offload, key=lambda s: s.exposed_s)
    rate = st.layer_bytes / st.copy_s / 1e9 if st.copy_s else float("inf")
    slots = round(r.offload_exposed_s / st.exposed_s) if st.exposed_s else None
    print(f"  activation offload   {r.activation_offload:g} of each stage's layers "
          f"({st.offloaded} of {st.layers}) to host memory over the host link at "
          f"{rate:.0f} GB/s")
    print(f"  host memory          {r.host_memory_gb:.2f} GB per GPU of "
          f"{r.host_memory_limit_gb:.1f} GB ("
          f"{'fits' if r.host_memory_gb <= r.host_memory_limit_gb else 'does NOT fit'})")
    print(f"  exposed copy time    {r.offload_exposed_s:.4f} s per step (in the step time)"
          + (f": {1e3 * st.exposed_s:.3f} ms per micro-batch slot x {slots} slots"
             if slots else ": the layers' compute hides every copy")
          + f"; a layer's copy {1e3 * st.copy_s:.3f} ms, forward "
          f"{1e3 * st.forward_layer_s:.3f} ms, backward {1e3 * st.backward_layer_s:.3f} ms")


def layer_counts(text: str) -> tuple:
    """``--layers-per-stage``: comma-separated layer counts, e.g. ``5,11``."""
    # lazy: keeps vcluster --help fast
    import argparse
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"expected layer counts >= 1 separated by commas "
                                         f"(one per pipeline stage), got {text!r}")
    return counts


def replicas_text(first: int, count: int) -> str:
    """"replica 3" or "replicas 0-7": a run of consecutive data-parallel replicas."""
    return f"replica {first}" if count == 1 else f"replicas {first}-{first + count - 1}"


def cluster_lines(cluster, stages) -> list[str]:
    """One line per part of ``cluster``: its kind, nodes and ranks, and the pipeline
    stages on it with their layers; ``stages``: (part, layers) of each stage in order."""
    out = []
    for k, part in enumerate(cluster.parts):
        on = [(q, n) for q, (pk, n) in enumerate(stages) if pk == k]
        ranks = cluster.part_ranks(k)
        where = (f"stage{'s' if len(on) > 1 else ''} " + ", ".join(str(q) for q, _ in on)
                 + f" with {', '.join(str(n) for _, n in on)} layers") if on else "no stage"
        out.append(f"part {k}: {part.nodes} x {part.hardware.name} "
                   f"({part.hardware.device.name}), GPUs {ranks.start}-{ranks.stop - 1}: "
                   f"{where}")
    return out


def zero_stage(args) -> int:
    """The ZeRO stage of ``--zero`` and ``--distributed-optimizer`` (an alias of ``--zero
    1``); ValueError when both are given and disagree. Whether the stage is allowed with
    the rest of the plan is the rulebook's (:func:`modeling.check_zero_stage`), reported
    under ``--zero``."""
    zero = args.zero
    if args.distributed_optimizer:
        if zero is not None and zero != 1:
            raise ValueError(f"--distributed-optimizer is an alias of --zero 1; it contradicts "
                             f"--zero {zero} (give one of them)")
        zero = 1
    return 0 if zero is None else zero


def _print_ops(ops, flag_below: float) -> None:
    """The per-op table: seconds per device, T_compute / T_comm, flagged below the bound;
    a row of communication alone (the data-parallel rows) has no ratio ("-")."""
    width = max([len("op"), *(len(o.op) for o in ops)]) + 2
    print(f"  {'op':<{width}}{'compute':>9}{'comm':>11}{'compute/comm':>14}")
    for o in ops:
        ratio = o.compute_comm_ratio
        low = f"  below the rule (>= {flag_below:g})" if o.compute_s and ratio < flag_below \
            else ""
        text = "-" if not o.compute_s else "no comm" if ratio == float("inf") else f"{ratio:.1f}"
        print(f"  {o.op:<{width}}{o.compute_s:>8.3f}s{o.comm_s:>10.3f}s{text:>14}{low}")
