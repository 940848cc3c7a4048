"""Simulate one GPT training iteration on a hardware model, from the training program.

1. Trace the GPT training program (:func:`pipeline_parallel.executor.train_program` with
   the GPT stages) on shape-only 16-bit arrays, one representative rank per pipeline
   position (data- and tensor-parallel peers are identical), for a short step of a few
   micro-batches, on a pipeline of at most three positions — first, one middle, last —
   whose middle one stands for every middle position of the full pipeline
   (:func:`gpt_step_traces`);
2. stitch the full step's traces from those actions (:mod:`vcluster.planner.stitch`),
   following the full schedule of m = B / (dp·b) micro-batches;
3. replay them on the hardware (:func:`vcluster.timing.engine.simulate_trace` with
   :class:`~vcluster.timing.hardware_model.HardwareCostModel`), symmetric mode — a step
   of many micro-batches as three short ones (:func:`steady_state_microbatches`), its
   figures extrapolated where every one is affine in them
   (:mod:`vcluster.timing.steady_state`; ``full_replay=True``: the whole step).

With context parallelism (``ParallelConfig.cp`` > 1) every cp rank of replica 0 (tp 0)
is traced at each traced pipeline position — the K/V ring's sends and receives inside
an action run between them (a replayed receive needs its sender's trace), and stay in
the templates, their peers renamed like the collectives' groups — and the full step has
cp·p traces: the ring's transfers overlap the attention blocks on the hardware model.

A mixture of experts (``GPTConfig(experts=E)``, ``ParallelConfig(ep)``) routes
``ExpertLoad.skewed(..., expert_skew)`` in the trace (its busiest expert on the traced ep
rank 0); its dropless token exchanges are replayed as all_to_alls over the ep group
(:func:`moe_exchanges_as_all_to_all`; the flex dispatcher across nodes,
``moe_ep_node_ranks``, as two: over the traced rank's proxies and over its node); with
``moe_comm_overlap`` (Megatron-Core's combined 1F1B) the steady state's (F, B) pairs are
stitched interleaved, each all_to_all asynchronous and overlapping the other
micro-batch's compute (:func:`~vcluster.planner.stitch.combined_ops`). The emulated
program does not run ZeRO with expert
parallelism yet, and the plan's rulebook refuses that combination
(:func:`modeling.check_zero_stage`): what is simulated is what the program runs.

Uneven stages (``ParallelConfig.layers_per_stage``): the short step traces the first
position, one middle position per distinct middle layer count and the last; each stands
for the full positions of its count (tested equal to tracing them all).

A heterogeneous cluster (``hardware`` a :class:`~vcluster.timing.cluster.ClusterSpec`,
several GPU kinds) is split by pipeline stages or by data-parallel replicas
(``cluster_split``). By stages: the ranks are placed pipeline-major
(:func:`cluster_placement`), so that stage q runs on the cluster's GPUs q·N/pp ..
(q+1)·N/pp − 1 — stage 0 on the first part's GPUs — and each stage must lie on one kind
(:func:`stage_parts`); the result's ``stages`` say where each stage runs and whether its
memory fits its own device. By replicas: the mesh's own order, each replica on one kind
(:func:`replica_parts`), one replica per kind traced; the result's ``replicas`` say
which replicas run where. Either way the templates are coalesced and the replay prices
compute under each traced rank's own kind
(:class:`~vcluster.timing.cluster_cost.ClusterCostModel`), collectives and transfers on
the kinds they span (the slowest).

Outputs: step time; per device compute, communication, exposed communication and bubble
time (means over the pipeline ranks); T_compute / T_comm for the step and per op kind
(embedding, attention, mlp, logits, optimizer: :func:`gpt_op_kind`, with the
communication charged to each as :mod:`vcluster.timing.results` defines, except the
data-parallel communication, which has rows of its own: :func:`data_parallel_row`);
tokens/s per GPU, B·s / (step·GPUs), the unit of published training tables; hardware
TFLOP/s per GPU counting the FLOPs actually executed (recomputation included, from the
trace) and model TFLOP/s per GPU counting the model FLOPs 72·B·s·l·h²·(1 + s/6h + V/12lh)
(Llama: :func:`~pipeline_parallel.gpt.llama_model_flops`), which over the peak of the
compute dtype is the MFU; peak memory per device (:mod:`vcluster.planner.memory`) and
whether it fits; with activation offload (``ParallelConfig.activation_offload``,
:mod:`vcluster.planner.offload`) the host memory per GPU and the copy time exposed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from modeling import GPT2_BLOCK, LLAMA_BLOCK
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from pipeline_parallel.optim import OptimizerConfig
from pipelining import combined_pairs, make_schedule
from tensor_parallel.moe import MOE_TAG
from vcluster.runtime.algorithm import choose_algorithm
from vcluster.runtime.tracing import KernelKind, TraceCompute, trace_program
from vcluster.runtime.tracing.ops import TraceCollective, TraceRecv, TraceSend
from vcluster.timing.cluster import ClusterSpec, axis_major_placement, load_cluster
from vcluster.timing.cluster_cost import ClusterCostModel
from vcluster.timing.engine import simulate_trace
from vcluster.timing.steady_state import REL_TOL, NotAffine, extrapolated, extrapolated_result
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.attention_kernels import named_kernel

from .autocast_kernels import autocast_kernels_priced
from .eager_kernels import with_eager_kernels
from .float8_casts import check_fp8_casts, recipe_gemm_format, with_float8_casts
from .fsdp2_copies import with_fsdp2_copies
from .torch_context_parallel import with_torch_cp_kernels
from .inductor_kernels import pytorch_kernels
from .memory import MEMORY_HEADROOM, gpt_memory, usable_memory_bytes
from .offload import host_link_of, microbatch_slots, offload_timing
from .precision import MEGATRON, precision_policy
from .stitch import Templates, coalesce, cut_templates, moved, stitch, unique_handles

#: the optimizer of a simulated step: Adam, as Megatron-LM and PyTorch training steps run
ADAM = OptimizerConfig("adam")

__all__ = ["GPTSimulation", "simulate_gpt", "gpt_step_traces", "gpt_schedule", "gpt_op_kind",
           "ReplicaPlacement", "replica_parts", "CLUSTER_SPLITS", "cluster_split_of",
           "fp8_gemm", "StagePlacement", "stage_parts", "cluster_placement",
           "moe_exchanges_as_all_to_all", "data_parallel_row", "steady_state_microbatches",
           "OP_KINDS", "DP_GRAD_REDUCE", "DP_PARAM_GATHER", "RATIO_FLAG", "TRACED_POSITIONS",
           "describe_ratio"]

# The rule of thumb of DESIGN.md: keep compute / communication above 10, so that even
# communication that does not overlap costs under a tenth of the step.
RATIO_FLAG = 10.0


def describe_ratio(compute_s: float, comm_s: float, exposed_comm_s: float,
                   step_time_s: float, rule: float = RATIO_FLAG) -> tuple[str, str]:
    """The compute/communication figures in words, from the numbers alone, as (the rule
    as a check, what communication costs), e.g. for 3.2 s of compute, 0.4 s of
    communication of which 0.24 s exposed in a 3.5 s step:

        ("rule compute/comm >= 10: not met (8.0)",
         "communication is 12% of compute; 6.8% of the step is exposed communication")

    The rule is a check with its threshold, never a verdict the figures contradict: a
    ratio of 8 with most communication overlapped is below the rule, and the exposed
    share says what that costs."""
    exposed = 100 * exposed_comm_s / step_time_s if step_time_s > 0 else 0.0
    if comm_s <= 0:
        return f"rule compute/comm >= {rule:g}: met (no communication)", "no communication"
    ratio = compute_s / comm_s
    met = "met" if ratio >= rule else "not met"
    share = f"{100 * comm_s / compute_s:.0f}% of compute" if compute_s > 0 else "all the work"
    return (f"rule compute/comm >= {rule:g}: {met} ({ratio:.1f})",
            f"communication is {share}; {exposed:.1f}% of the step is exposed communication")


@dataclass(frozen=True)
class GPTSimulation:
    step_time_s: float
    tflops_per_gpu: float    # hardware TFLOP/s per GPU: FLOPs executed, recomputation included
    mfu: float               # model FLOPs / (GPUs · peak · step): no recomputation counted
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    compute_comm_ratio: float
    low_ratio: bool
    peak_memory_gb: float
    fits: bool
    memory: tuple
    gpus: int
    microbatches: int
    hardware: str
    ops: tuple = ()          # OpStats per op kind, seconds per device (mean over pp ranks)
    memory_limit_gb: float = math.inf   # what fits compares with: HBM less the headroom
    device_memory_gb: float = math.inf  # the device's HBM
    zero_stage: int = 0                 # the ZeRO stage traced and counted (0: DDP)
    precision: str = "megatron"         # the PrecisionPolicy the memory counts bytes by
    autocast_kernels: bool = False      # plain PyTorch's autocast kernels priced
    inductor_fusion: bool = False       # ... as torch.compile's Inductor fuses them
    eager_kernels: bool = False         # eager PyTorch's unfused Llama kernels priced
    fp8: bool = False                   # the layers' linear GEMMs priced in FP8 (fp8_gemm)
    # their format (vcluster.timing.gemm_formats: fp8, fp8-row, fp8-block, mxfp8, nvfp4,
    # mxfp4); None without fp8
    gemm_format: str | None = None
    # torchao's float8 cast kernels priced after each FP8 GEMM (planner.float8_casts:
    # "torchao-tensorwise", "torchao-rowwise"); None: fused into the kernels before them
    fp8_casts: str | None = None
    fsdp2_copies: bool = False          # FSDP2's copies around ZeRO's collectives priced
    torch_cp: bool = False              # the cp ring as PyTorch's context_parallel runs it
    grad_reduce_dtype: str = "model"    # ParallelConfig.grad_reduce_dtype traced ("fp32": 4 B)
    attention: str = "flash"            # ParallelConfig.attention (flash-v1: priced apart)
    model_tflops_per_gpu: float = math.nan   # model FLOPs / (GPUs · step) / 1e12: mfu · peak
    tokens_per_s_per_gpu: float = math.nan   # global batch · seq / (step · GPUs)
    stages: tuple = ()       # on a heterogeneous cluster: a StagePlacement per pp position
    # ... split by data-parallel replicas (cluster_split="replicas"): ReplicaPlacements
    replicas: tuple = ()
    # activation offload to host memory (ParallelConfig.activation_offload, planner.offload):
    activation_offload: float = 0.0     # the share of each stage's layers offloaded
    host_memory_gb: float = 0.0         # offloaded activations per GPU, the largest stage's
    host_memory_limit_gb: float | None = None   # NodeSpec.host_memory_bytes (None: none)
    offload_exposed_s: float = 0.0      # what the copies add to the step (in step_time_s)
    offload: tuple = ()                 # an OffloadStage per pipeline rank and chunk
    # the micro-batch counts replayed when the step was extrapolated from three short
    # ones (steady_state_microbatches); () when the whole step was replayed
    replayed_microbatches: tuple = ()

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU of the FLOPs executed, recomputation included (``tflops_per_gpu``,
        the name earlier versions wrote); ``model_tflops_per_gpu`` counts the model's."""
        return self.tflops_per_gpu

    @property
    def reserve_gb(self) -> float:
        """The memory kept free beside the tensors (the headroom): HBM less the limit."""
        return self.device_memory_gb - self.memory_limit_gb if math.isfinite(
            self.device_memory_gb) else 0.0

    @property
    def memory_breakdown_gb(self) -> dict:
        """The peak pipeline position's parts, GB: params, grads, optimizer, activations,
        logits and the reserve (``peak_memory_gb`` is their sum less the reserve); with
        activation offload also ``host``, its activations in host memory (not in the
        peak)."""
        peak = max(self.memory, key=lambda m: m.total_bytes)
        parts = {"rank_position": peak.rank_position, "params": peak.params_bytes / 1e9,
                 "grads": peak.grads_bytes / 1e9, "optimizer": peak.optimizer_bytes / 1e9,
                 "activations": peak.activations_bytes / 1e9,
                 "logits": peak.logits_bytes / 1e9, "reserve": self.reserve_gb}
        if self.activation_offload:
            parts["host"] = peak.host_bytes / 1e9
        return parts

    def to_json(self) -> dict:
        """The fields as JSON values; a ratio without communication (infinite) is null."""
        out = dataclasses.asdict(self)
        reserve = round(self.reserve_gb * 1e9)
        out["memory"] = [dataclasses.asdict(m) | {"total_bytes": m.total_bytes,
                                                  "reserve_bytes": reserve}
                         for m in self.memory]
        out["memory_breakdown_gb"] = self.memory_breakdown_gb
        out["compute_comm_ratio"] = _finite(self.compute_comm_ratio)
        out["hardware_tflops_per_gpu"] = self.hardware_tflops_per_gpu
        # a communication-only row (the data-parallel ones) has no ratio to hold to the rule
        out["ops"] = [{"op": o.op, "compute_s": o.compute_s, "comm_s": o.comm_s,
                       "compute_comm_ratio": _finite(o.compute_comm_ratio)
                       if o.compute_s else None,
                       "low_ratio": bool(o.compute_s) and o.compute_comm_ratio < RATIO_FLAG}
                      for o in self.ops]
        return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


#: Pipeline positions traced for a deep pipeline: the first, one middle, the last.
TRACED_POSITIONS = 3

#: The op kinds of a GPT step, and the compute-op names (after "gpt: ") each begins with.
#: A pre-LN block is LayerNorm + sublayer + residual: ln1 belongs to attention, ln2 to the
#: MLP (whose unnamed inner products come from the FFN program: "x @ W1", ...).
OP_KINDS = {
    "embedding": ("embedding",),
    "attention": ("attention", "ln1"),
    "mlp": ("mlp", "ln2", "x @ W1", "h = x W1", "a = act", "a @ W2", "y + b2"),
    "logits": ("logits", "head", "ce:", "final ln"),
    "optimizer": ("optimizer",),
}
_INHERIT = ("residual",)       # the kind of the op before (see gpt_op_kind)


def gpt_op_kind(name: str) -> str | None:
    """The kind of a GPT compute op (a key of :data:`OP_KINDS`; ``"other"`` for a GPT op
    of no known kind) from its name (a mixture of experts' ops, "moe: ...", are "mlp").
    None — the kind of the op before — for the residual adds, which close the block they
    follow, and for names that are not the GPT's ops: the executor's zero-cost action
    markers (``"0F3"``) and unnamed merged runs."""
    if name.startswith("moe: "):                 # the MoE block of an MoE layer is its MLP
        return "mlp"
    rest = name[5:] if name.startswith("gpt: ") else name
    for kind, prefixes in OP_KINDS.items():
        if rest.startswith(prefixes):
            return kind
    return "other" if rest is not name and not rest.startswith(_INHERIT) else None


#: The per-op table's rows of the data-parallel communication, booked apart from the
#: compute op each collective follows (issue 56: the gradient buckets' all-reduces went to
#: "attention", the kind of the last backward op before them).
DP_GRAD_REDUCE = "grad reduce (dp)"      # DDP's bucket all-reduces, ZeRO's reduce-scatters
DP_PARAM_GATHER = "param gather (dp)"    # ZeRO's all-gathers of the weights over dp
_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
_GATHERS = ("all_gather", "broadcast")
#: the axes a gradient group spans (:class:`pipeline_parallel.executor.TrainJob`: dp, the
#: ep ranks carved out of it, and cp, whose ranks hold the same weights)
_GRADIENT_AXES = ("dp", "ep", "cp")


def data_parallel_row(op: TraceCollective, mesh, axes_of: dict | None = None) -> str | None:
    """The per-op table's row of collective ``op`` when it is data-parallel communication,
    else None (it stays with the op it follows). Data-parallel: its group spans
    data-parallel replicas — ranks that differ in their ``dp`` coordinate and in nothing
    but dp, ep and cp — and it is a reduction (:data:`DP_GRAD_REDUCE`: the gradients' or
    ZeRO's) or a gather (:data:`DP_PARAM_GATHER`: ZeRO's weights); and the all-reduce of
    the gradients over the cp ranks alone when dp = 1 (context parallelism's own attention
    collectives are sends and receives, or all-gathers and reduce-scatters, never an
    all-reduce). A group over ep or cp ranks alone is otherwise the MoE layer's or
    attention's (the router's all-reduce, the K/V all-gather), and so is the gradient
    reduction there when the ep or cp group is the whole data-parallel group (dp = ep, or
    dp = 1 with ZeRO and cp): it stays with its op. ``axes_of``: a cache of each group's
    varying axes, kept by the caller."""
    if axes_of is None:
        axes_of = {}
    axes = axes_of.get(op.group)
    if axes is None:
        coords = [mesh.index(r) for r in op.group]
        axes = axes_of[op.group] = frozenset(
            a for a in mesh.axes if len({c[a] for c in coords}) > 1)
    if not axes or not axes <= set(_GRADIENT_AXES):
        return None
    if "dp" in axes:
        return DP_GRAD_REDUCE if op.collective in _REDUCTIONS else \
            DP_PARAM_GATHER if op.collective in _GATHERS else None
    return DP_GRAD_REDUCE if axes == {"cp"} and op.collective == "all_reduce" else None


def fp8_gemm(op) -> bool:
    """Whether a traced compute op is a GEMM that runs in FP8 under Transformer Engine's FP8
    training as Megatron-LM uses it (``--fp8-format``): the linear layers of every
    transformer layer — attention's QKV and output projections, the MLP's (or each
    expert's) two or three — forward and backward. The core attention's products (one
    batched GEMM per head, or the flash kernel), the output head (logits), the MoE router
    and every op that is not a GEMM stay in BF16."""
    kernel = getattr(op, "kernel", None)
    if kernel is None or kernel.kind is not KernelKind.GEMM or kernel.shape[0] > 1:
        return False
    return not op.name.startswith("moe: router") and gpt_op_kind(op.name) in ("attention",
                                                                            "mlp")


def _short_microbatches(parallel: ParallelConfig) -> int:
    """Micro-batches of the traced short step: enough for every template (two: a
    stage's non-last and last backward), a full round of p for the interleaved schedule."""
    m = parallel.microbatches
    if parallel.schedule == "interleaved_1f1b":
        return parallel.pp if m >= parallel.pp else m
    return min(m, 2)


def _short_position(q: int, p: int, p_short: int) -> int:
    """The traced position that stands for pipeline position ``q`` of ``p``."""
    return 0 if q == 0 else p_short - 1 if q == p - 1 else min(q, p_short - 2)


def _is_moe_message(op) -> bool:
    return isinstance(op, (TraceSend, TraceRecv)) and MOE_TAG <= op.tag < MOE_TAG + 8


def moe_exchanges_as_all_to_all(templates: Templates, group: tuple,
                                node_ranks: int | None = None, rank: int | None = None
                                ) -> Templates:
    """``templates`` with each dropless MoE token exchange (a run of sends and receives of
    one :data:`~tensor_parallel.moe.MOE_TAG` tag: one message per peer) replaced by one
    all_to_all over the ep ``group`` whose per-peer share is the larger of what the
    traced rank sends and receives, n/(n−1)·max(sent, received) bytes of input (the
    pairwise all_to_all moves (n−1)/n of it each way). The symmetric replay lets an
    untraced rank mirror the traced one but needs a receive's sender traced; the traced
    rank is ep rank 0, the busiest expert's, which receives the most.

    Across nodes (``node_ranks`` d < n, the flex dispatcher's ``ep_node_ranks``; ``rank``
    the traced rank, a member of ``group``, at position p): the inter-node hop (tags
    ``MOE_TAG`` + 0..3) becomes an all_to_all over the proxies, the n/d members with p's
    local index (group[N·d + p mod d], one per node), and the intra-node hop (tags
    ``MOE_TAG`` + 4..7) one over p's node (group[⌊p/d⌋·d .. ⌊p/d⌋·d + d − 1]), each
    n'/(n'−1)·max(sent, received) bytes with n' that group's size — so the collective
    cost model prices the first on the network and the second on the node's links."""
    n = len(group)
    groups = {False: tuple(group), True: tuple(group)}      # by "intra-node tag"
    if node_ranks is not None and node_ranks < n:
        p, d = list(group).index(rank), node_ranks
        groups = {False: tuple(group[node * d + p % d] for node in range(n // d)),
                  True: tuple(group[(p // d) * d:(p // d + 1) * d])}

    def rewrite(ops):
        out, run = [], []

        def flush():
            if run:
                sent = sum(o.nbytes for o in run if isinstance(o, TraceSend))
                got = sum(o.nbytes for o in run if isinstance(o, TraceRecv))
                g = groups[run[0].tag >= MOE_TAG + 4]
                m = len(g)
                if m > 1:
                    nbytes = -(-max(sent, got) * m // (m - 1))
                    out.append(TraceCollective("all_to_all", g, nbytes, 1, choose_algorithm(
                        "all_to_all", nbytes, m)))
                run.clear()

        for op in ops:
            if _is_moe_message(op) and (not run or run[0].tag == op.tag):
                run.append(op)
                continue
            flush()
            if _is_moe_message(op):
                run.append(op)
            else:
                out.append(op)
        flush()
        return tuple(out)
    return Templates({k: rewrite(v) for k, v in templates.bodies.items()},
                     rewrite(templates.tail), templates.message_bytes)


def _stage_mapping(full: tuple, stages: int, mapping=None) -> list:
    """The full stage each short stage stands for: ``mapping`` when given, else short
    stage k for full stage k and the last short stage for the last full one."""
    if mapping is not None:
        return list(mapping)
    return list(range(stages - 1)) + [len(full) - 1] if stages > 1 else [0]


def _short_dense_layers(config: GPTConfig, full: tuple, stages: int, mapping=None) -> dict:
    """The short step's ``moe_dense_layers``: short stage k holds full stage k's pattern
    (the last short stage the last full stage's; ``mapping``: the full stage of each
    short stage), so dense-first layers on the first
    stage — DeepSeek-V3's three — are traced where they run; dense layers on middle
    stages stand for the middle stages the short step traces ({} for a model without
    them)."""
    dense = set(getattr(config, "moe_dense_layers", ()) or ())
    if not dense:
        return {}
    starts = [sum(full[:k]) for k in range(len(full))]
    mapping = _stage_mapping(full, stages, mapping)
    out, at = [], 0
    for k in mapping:
        out += [at + o for o in range(full[k]) if starts[k] + o in dense]
        at += full[k]
    if len(out) >= at:                      # every short layer dense: keep one MoE layer
        out = out[:-1]
    return {"moe_dense_layers": tuple(out)}


def _short_window_layers(config: GPTConfig, full: tuple, stages: int, mapping=None) -> dict:
    """The short step's ``window_layers`` (sliding-window attention on some layers): short
    stage k holds full stage k's pattern, as :func:`_short_dense_layers` maps the dense
    ones ({} where every layer or none has the window)."""
    windowed = getattr(config, "window_layers", None)
    if windowed is None:
        return {}
    windowed = set(windowed)
    starts = [sum(full[:k]) for k in range(len(full))]
    mapping = _stage_mapping(full, stages, mapping)
    out, at = [], 0
    for k in mapping:
        out += [at + o for o in range(full[k]) if starts[k] + o in windowed]
        at += full[k]
    if not out:                             # the traced stages have no windowed layer
        return {"window": None, "window_layers": None}
    return {"window_layers": tuple(out) if len(out) < at else None}


def _short_layout(parallel: ParallelConfig, layers: int, traced_positions) -> tuple:
    """(the full pipeline positions the short step traces, in order; the short position
    that stands for each full position). An even split (or first/last_stage_layers):
    the first, ``min(p, traced_positions) - 2`` middle ones and the last (all of them with
    ``traced_positions`` None). ``layers_per_stage``: the first, one middle position per
    distinct middle layer count (its first) and the last — the middle positions of a
    split over GPU kinds differ in their counts; every position with ``traced_positions``
    None."""
    p = parallel.pp
    if parallel.layers_per_stage is None or traced_positions is None or p <= 3:
        p_short = p if traced_positions is None else min(p, traced_positions)
        reps = list(range(p_short - 1)) + [p - 1] if p_short > 1 else [0]
        return reps, [_short_position(q, p, p_short) for q in range(p)]
    counts = parallel.stage_layers(layers)
    middle: dict = {}
    for q in range(1, p - 1):
        middle.setdefault(counts[q], q)
    reps = [0] + list(middle.values()) + [p - 1]
    index = {n: 1 + k for k, n in enumerate(middle)}
    return reps, [0] + [index[counts[q]] for q in range(1, p - 1)] + [len(reps) - 1]


def _short_templates(config: GPTConfig, parallel: ParallelConfig, reps: list,
                     optimizer=None, expert_skew: float = 1.0, autocast_kernels: bool = False,
                     inductor_fusion: bool = False, eager_kernels: bool = False,
                     fp8_casts: str | None = None, fsdp2_copies: bool = False,
                     optimizer_step_bytes: float | None = None, torch_cp: bool = False):
    """(mesh, templates per cp rank and short position, not coalesced) of a short step on
    a pipeline of the full positions ``reps`` (:func:`_short_layout`) with ``parallel``'s
    layers per stage, micro-batch, dp and tp (``autocast_kernels``: rewritten by
    :func:`.inductor_kernels.pytorch_kernels`, compiled with ``inductor_fusion``;
    ``eager_kernels``, ``fp8_casts``, ``fsdp2_copies``, ``optimizer_step_bytes``,
    ``torch_cp``: :func:`gpt_step_traces`)."""
    v = parallel.chunks
    p_short = len(reps)
    full = parallel.stage_layers(config.layers)      # first, middle ..., last stage
    mapping = None
    if parallel.layers_per_stage is not None:
        short = dataclasses.replace(parallel, pp=p_short,
                                    layers_per_stage=tuple(full[q] for q in reps))
        layers, mapping = sum(full[q] for q in reps), reps
    else:
        short = dataclasses.replace(parallel, pp=p_short)
        layers = full[0] + full[-1] + (p_short * v - 2) * (full[1] if len(full) > 2 else 0) \
            if p_short * v > 1 else full[0]
    m_short = _short_microbatches(short)
    short = dataclasses.replace(short, global_batch=parallel.dp * parallel.micro_batch * m_short)
    short_config = dataclasses.replace(config, dtype="float16",          # 16-bit bytes
                                       layers=layers, **_short_dense_layers(
                                           config, full, p_short * v, mapping),
                                       **_short_window_layers(config, full, p_short * v,
                                                              mapping))
    short_mesh = short.mesh()
    args = GPT(short_config).meta_args(short_mesh, short, optimizer=optimizer,
                                       expert_skew=expert_skew)
    job = args[0][0]
    groups = [short_mesh.group("pp", _at(short_mesh, cp=c)) for c in range(short.cp)]
    traces = {t.rank: t for t in trace_program(short_mesh, train_program, args,
                                               ranks=[r for g in groups for r in g])}
    templates = [[cut_templates(traces[r], job.actions[pos], p_short * v, m_short,
                                pipeline_peers=frozenset(g)) for pos, r in enumerate(g)]
                 for g in groups]
    if autocast_kernels:
        templates = _rewritten(templates, lambda ops: pytorch_kernels(ops, inductor_fusion))
    if eager_kernels:
        templates = _rewritten(templates, with_eager_kernels)
    if fp8_casts is not None:
        tokens = parallel.micro_batch * config.seq // parallel.cp
        sp_tp = parallel.tp if parallel.sequence_parallel else 1
        templates = _rewritten(templates, lambda ops: with_float8_casts(
            ops, fp8_casts, fp8_gemm, tokens, sp_tp))
    if fsdp2_copies:
        axes_of: dict = {}
        templates = _rewritten(templates, lambda ops: with_fsdp2_copies(
            ops, lambda op: data_parallel_row(op, short_mesh, axes_of), DP_PARAM_GATHER,
            DP_GRAD_REDUCE))
    if optimizer_step_bytes is not None:
        templates = _rewritten(templates, lambda ops: with_optimizer_step_bytes(
            ops, optimizer_step_bytes))
    if torch_cp and short.cp > 1:
        group = config.heads // config.kv_heads if config.block.grouped_query else 1
        templates = _rewritten_by_rank(templates, groups, lambda ops, r: with_torch_cp_kernels(
            ops, group, short_mesh.group("cp", r)))
    if "ep" in short_mesh.axes:
        templates = [[moe_exchanges_as_all_to_all(t, short_mesh.group(short.expert_axes, r),
                                                  short.moe_ep_node_ranks, r)
                      for t, r in zip(ts, g)] for ts, g in zip(templates, groups)]
    return short_mesh, templates


def with_optimizer_step_bytes(ops, bytes_per_param: float) -> list:
    """``ops`` with each optimizer step's bytes (a :class:`TraceCompute` of an
    ``optimizer`` kernel over P parameters: the whole stage's, or a ZeRO shard) set to
    P · ``bytes_per_param`` — the traffic of the precision policy the step runs in
    (:attr:`~.precision.PrecisionPolicy.optimizer_step_bytes`), where the traced 16-bit
    program counts its own: 7 · 2 bytes for Adam over 16-bit state. Every other op is
    kept as it is."""
    return [dataclasses.replace(op, bytes=int(op.kernel.shape[0] * bytes_per_param))
            if isinstance(op, TraceCompute) and op.kernel is not None
            and op.kernel.kind is KernelKind.OPTIMIZER else op for op in ops]


def _rewritten(templates, rewrite) -> list:
    """``templates`` (per cp rank, per short position) with every body and tail passed
    through ``rewrite`` (ops -> ops)."""
    return [[Templates({key: rewrite(body) for key, body in t.bodies.items()},
                       rewrite(t.tail), t.message_bytes) for t in ts] for ts in templates]


def _rewritten_by_rank(templates, groups, rewrite) -> list:
    """``templates`` (per cp rank, per short position; ``groups``: their ranks, alike) with
    every body and tail of rank r passed through ``rewrite(ops, r)``."""
    return [[Templates({key: rewrite(body, r) for key, body in t.bodies.items()},
                       rewrite(t.tail, r), t.message_bytes) for t, r in zip(ts, g)]
            for ts, g in zip(templates, groups)]


def _at(mesh, **coords) -> int:
    """The rank at ``coords`` (axes not named: 0; names the mesh lacks must be 0)."""
    assert all(a in mesh.axes or c == 0 for a, c in coords.items()), (mesh, coords)
    return mesh.rank({a: coords.get(a, 0) for a in mesh.axes})


def gpt_schedule(parallel: ParallelConfig, microbatches: int | None = None):
    """The full step's :class:`pipelining.Schedule` (Megatron-Core's combined 1F1B form
    with ``moe_comm_overlap``: :func:`pipelining.combined_1f1b`), of ``microbatches``
    (default the plan's)."""
    m = parallel.microbatches if microbatches is None else microbatches
    return make_schedule(parallel.schedule, parallel.pp, m,
                         virtual_stages=parallel.chunks
                         if parallel.schedule == "interleaved_1f1b" else None,
                         combined=parallel.moe_comm_overlap)


def gpt_step_traces(config: GPTConfig, parallel: ParallelConfig, costs, schedule=None,
                    traced_positions: int | None = TRACED_POSITIONS, optimizer=ADAM,
                    markers: bool = False, expert_skew: float = 1.0,
                    autocast_kernels: bool = False, inductor_fusion: bool = False,
                    eager_kernels: bool = False, replicas: tuple = (0,),
                    fp8_casts: str | None = None, fsdp2_copies: bool = False,
                    optimizer_step_bytes: float | None = MEGATRON.optimizer_step_bytes,
                    torch_cp: bool = False) -> list:
    """One training step's traces of the pipeline ranks of replica 0 (tp 0) — of every
    cp rank with context parallelism, cp rank-major — runs of compute ops of one kind
    (:func:`gpt_op_kind`) coalesced under ``costs`` (see
    :func:`~vcluster.planner.stitch.coalesce`).

    The GPT program is traced for a short step on a pipeline of ``p' = min(p,
    traced_positions)`` positions (``None``: all ``p``) with the same layers per stage,
    micro-batch, dp and tp: position 0 (embedding), p'-1 (head) and the middle ones hold
    the same stages as the full pipeline's. Each full position q takes the templates of
    its stand-in (0, p'-1, or a middle one) with stage c·p'+q' renamed c·p+q and every
    collective's group renamed by coordinates (pp coordinate q' -> q, dp and tp kept),
    and is stitched following the full schedule. A test checks that this equals tracing
    all p positions, op for op. ``optimizer``: the step's
    :class:`~pipeline_parallel.optim.OptimizerConfig` (default :data:`ADAM`, the
    optimizer of the training steps the model is validated on; it was SGD before
    2026-11-26). ``markers``: keep
    the zero-cost action markers (``"0F3"``, each holding its work: a report draws the
    schedule from them); the planner leaves them out. ``autocast_kernels``: the kernel
    list of plain PyTorch under bf16 autocast (:mod:`.autocast_kernels`), not the
    program's own; with ``inductor_fusion``, as ``torch.compile`` fuses it
    (:mod:`.inductor_kernels`). ``eager_kernels``: the Llama program's norms, rotary
    embeddings, SwiGLU and grouped K/V as eager PyTorch runs them, unfused
    (:mod:`.eager_kernels`). ``fp8_casts``: torchao's float8 cast kernels after each
    FP8 GEMM, by recipe (:mod:`.float8_casts`; None: none). ``fsdp2_copies``: PyTorch
    FSDP2's copies around ZeRO's gathers and reduce-scatters (:mod:`.fsdp2_copies`).
    ``optimizer_step_bytes``: the bytes per parameter each optimizer step moves (a
    precision policy's :attr:`~.precision.PrecisionPolicy.optimizer_step_bytes`:
    :func:`with_optimizer_step_bytes`; default Megatron's 30, as :func:`simulate_gpt`'s
    default policy); None keeps the traced program's own (Adam over 16-bit state: 14).
    ``torch_cp``: the context-parallel ring as PyTorch's experimental context parallelism
    runs it — float32 merges and accumulators, K and V repeated to the query heads, its
    buffer copies (:mod:`.torch_context_parallel`). ``replicas``: the data-parallel
    replicas (coordinates of the mesh's "dp" axis) whose pipeline ranks are traced, replica 0 first; another
    replica d's traces are replica 0's with every rank's "dp" coordinate moved by d
    (mod dp) — the program is SPMD — and a group that then holds the same ranks keeps
    its order (a data-parallel group is one group whichever replica calls it). On a
    cluster of several GPU kinds one replica per kind is traced (:func:`simulate_gpt`).
    """
    return _stitcher(config, parallel, costs, traced_positions, optimizer, markers,
                     expert_skew, autocast_kernels, inductor_fusion, eager_kernels, replicas,
                     fp8_casts, fsdp2_copies, optimizer_step_bytes,
                     torch_cp)(schedule or gpt_schedule(parallel))


def _stitcher(config: GPTConfig, parallel: ParallelConfig, costs, traced_positions,
              optimizer, markers, expert_skew, autocast_kernels, inductor_fusion,
              eager_kernels, replicas, fp8_casts, fsdp2_copies, optimizer_step_bytes,
              torch_cp):
    """The short step traced (:func:`gpt_step_traces`' arguments) and a function
    ``schedule -> traces`` that stitches a full step following ``schedule``: the plan's,
    or one that differs from it in its micro-batch count only."""
    if traced_positions is not None and (isinstance(traced_positions, bool) or not
                                         isinstance(traced_positions, int) or traced_positions < 3):
        raise ValueError(f"gpt_step_traces: traced_positions must be an int >= 3 (first, "
                         f"middle, last) or None (all), got {traced_positions!r}")
    mesh = parallel.mesh()
    parallel.check(config, mesh)
    p, v = parallel.pp, parallel.chunks
    reps, short_of = _short_layout(parallel, config.layers, traced_positions)
    p_short = len(reps)
    short_mesh, raw = _short_templates(config, parallel, reps, optimizer, expert_skew,
                                       autocast_kernels, inductor_fusion, eager_kernels,
                                       fp8_casts, fsdp2_copies, optimizer_step_bytes,
                                       torch_cp)
    S = p * v
    sizes_short = {k: n for ts in raw for t in ts for k, n in t.message_bytes.items()}
    # compute runs coalesced under the model that prices the rank: ``costs``, or on a
    # cluster of several GPU kinds (costs.rank_costs) the rank's own kind's model
    rank_costs = getattr(costs, "rank_costs", None)
    coalesced: dict = {}

    def templates(cp_rank, q_short, rank):
        model = costs if rank_costs is None else rank_costs(rank)
        key = (cp_rank, q_short, id(model))
        if key not in coalesced:
            coalesced[key] = coalesce(raw[cp_rank][q_short], model, gpt_op_kind)
        return coalesced[key]

    def short_stage(s):
        return s // p * p_short + short_of[s % p]

    sizes = {(d, s): sizes_short[(d, short_stage(s))] for d in (0, 1) for s in range(S)
             if (d, short_stage(s)) in sizes_short}
    dp = mesh.shape["dp"]
    replicas = _traced_replicas(replicas, dp)
    moved_of = []                  # (rank, position, pipeline ranks, templates moved there)
    for d in replicas:
        for cp_rank in range(parallel.cp):
            ranks = tuple(mesh.group("pp", _at(mesh, cp=cp_rank, dp=d)))
            for q, rank in enumerate(ranks):
                q_short = short_of[q]

                def full_rank(r, q=q, q_short=q_short, shift=d):  # short-mesh axes by name
                    c = short_mesh.index(r)
                    pos = {0: 0, p_short - 1: p - 1, q_short: q}.get(c["pp"])
                    if pos is None:
                        raise ValueError(f"GPT trace: a collective of traced pipeline "
                                         f"position {q_short} reaches position {c['pp']}, "
                                         f"which stands for no single position of the full "
                                         f"pipeline")
                    return mesh.rank({**{a: c[a] for a in short_mesh.axes}, "pp": pos,
                                      "dp": (c["dp"] + shift) % dp})

                def group_of(group, renamed, full_rank=full_rank, shift=d):
                    # a group of the same ranks as replica 0's (data-parallel) keeps its order
                    if not shift:
                        return renamed
                    own = tuple(full_rank(r, shift=0) for r in group)
                    return own if set(own) == set(renamed) else renamed

                moved_of.append((rank, q, ranks, moved(
                    templates(cp_rank, q_short, rank), lambda s, q=q: s // p_short * p + q,
                    full_rank, sizes, group_of=group_of)))

    def stitched(schedule) -> list:
        # Megatron-Core's combined 1F1B: its steady (F, B) pairs are stitched interleaved,
        # each MoE all_to_all overlapping the other micro-batch's compute
        pairs = combined_pairs(schedule) if schedule.name == "combined_1f1b" else \
            (frozenset(),) * p
        # a handle per issue: ZeRO-2/3 issue a reduce-scatter per micro-batch, waited at
        # the step's end; the overlapped TP reductions reuse a template's handle in each
        # copy (and the numbers a template got depend on the short step traced)
        return [unique_handles(stitch(t, rank, tuple(schedule.actions[q]), ranks, S,
                                      schedule.microbatches, markers=markers,
                                      pairs=pairs[q]))
                for rank, q, ranks, t in moved_of]
    return stitched


def _traced_replicas(replicas, dp: int) -> tuple:
    """``replicas`` checked: distinct data-parallel coordinates in 0..dp-1, 0 first."""
    out = tuple(replicas)
    if (not out or out[0] != 0 or len(set(out)) != len(out) or any(
            isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < dp for d in out)):
        raise ValueError(f"gpt_step_traces: replicas must be distinct data-parallel "
                         f"coordinates in 0..{dp - 1}, replica 0 first; got {replicas!r}")
    return out


@dataclass(frozen=True)
class StagePlacement:
    """Where one pipeline position runs on a heterogeneous cluster, and its memory."""

    stage: int               # the pipeline position (rank of the pp axis)
    part: int                # the cluster part (GPU kind) that holds its ranks
    hardware: str            # that part's hardware name
    layers: int              # the transformer layers it holds (all its chunks)
    peak_memory_gb: float    # its peak (memory model), per device
    memory_limit_gb: float   # its device's HBM less the headroom
    fits: bool


@dataclass(frozen=True)
class ReplicaPlacement:
    """Consecutive data-parallel replicas (coordinates of the mesh's "dp" axis) on one
    part of a heterogeneous cluster."""

    first: int               # the first replica of the run
    count: int               # how many
    part: int                # the cluster part (GPU kind) that holds their ranks
    hardware: str            # that part's hardware name


def _parts_along(parallel: ParallelConfig, costs, axis: str, unit: str, rule: str,
                 other: str) -> list[int]:
    """The cluster part of each coordinate of the mesh's ``axis`` (its ranks' part under
    ``costs``); ValueError naming the ``unit``, its ranks' parts, the ``rule`` and the
    ``other`` split when a coordinate's ranks lie on more than one GPU kind."""
    mesh = parallel.mesh()
    cluster = costs.cluster
    out = []
    for c in range(mesh.shape[axis]):
        ranks = [r for r in range(mesh.size) if mesh.index(r)[axis] == c]
        parts = sorted({costs.part_of(r) for r in ranks})
        if len({id(costs.models[k]) for k in parts}) > 1:
            kinds = ", ".join(f"part {k} ({cluster.parts[k].hardware.name})" for k in parts)
            raise ValueError(f"simulate_gpt: {unit} {c}'s {len(ranks)} ranks lie on {kinds} "
                             f"of cluster {cluster.name!r}; allowed: {rule}; or split by "
                             f"{other}")
        out.append(costs.part_of(ranks[0]))
    return out


def stage_parts(parallel: ParallelConfig, costs) -> list[int]:
    """The cluster part of each pipeline position under ``costs`` (a
    :class:`~vcluster.timing.cluster_cost.ClusterCostModel`: its placement; the part of
    the position's first rank); ValueError naming the position, its ranks' parts and the
    rule when a position's ranks lie on more than one GPU kind (its traced rank would
    stand for ranks of another kind)."""
    return _parts_along(
        parallel, costs, "pp", "pipeline stage",
        f"parts that hold whole pipeline stages ({parallel.gpus // parallel.pp} GPUs each: "
        f"dp·cp·tp = {parallel.dp}·{parallel.cp}·{parallel.tp}; the stages are placed "
        f"pp-outermost, stage 0 on the first ranks)",
        "data-parallel replicas (cluster_split='replicas', --cluster-split replicas)")


def replica_parts(parallel: ParallelConfig, costs) -> list[int]:
    """The cluster part of each data-parallel replica — each coordinate of the mesh's
    "dp" axis: its pp·(ep)·cp·tp ranks — under ``costs`` (a
    :class:`~vcluster.timing.cluster_cost.ClusterCostModel` with the mesh's own order:
    replica 0's ranks on the cluster's first GPUs, then replica 1's, ...); ValueError
    naming the replica, its ranks' parts and the rule when a replica's ranks lie on more
    than one GPU kind (its traced ranks would stand for ranks of another kind)."""
    mesh = parallel.mesh()
    return _parts_along(
        parallel, costs, "dp", "data-parallel replica",
        f"parts that hold whole replicas ({mesh.size // mesh.shape['dp']} GPUs each: GPUs / "
        f"dp; the replicas are placed in the mesh's order, replica 0 on the first GPUs)",
        "pipeline stages (cluster_split='stages', --cluster-split stages)")


#: how a plan's ranks are laid on a cluster of several GPU kinds (:func:`simulate_gpt`)
CLUSTER_SPLITS = ("stages", "replicas")


def cluster_split_of(split, parallel: ParallelConfig) -> str:
    """``split`` checked, or its default: ``"stages"`` when the plan has a pipeline
    (pp > 1), ``"replicas"`` otherwise."""
    if split is None:
        return "stages" if parallel.pp > 1 else "replicas"
    if split not in CLUSTER_SPLITS:
        raise ValueError(f"simulate_gpt: cluster_split={split!r}; allowed: "
                         f"{', '.join(CLUSTER_SPLITS)}, or None (stages when pp > 1, else "
                         f"replicas)")
    return split


def cluster_placement(parallel: ParallelConfig, cluster, split: str = "stages"):
    """The device of each mesh rank on ``cluster``: None (the mesh's own order) on a
    cluster of one GPU kind, or with ``split="replicas"`` (the mesh orders "dp"
    outermost: replica 0's ranks first); else pipeline-major
    (:func:`~vcluster.timing.cluster.axis_major_placement` on "pp", Megatron-LM's
    default order ``tp-cp-ep-dp-pp``), so that stage 0's dp·cp·tp ranks come first,
    then stage 1's, and parts holding whole stages hold each on one kind."""
    if len(cluster.kinds) == 1 or split == "replicas":
        return None
    return axis_major_placement(parallel.mesh(), "pp")


def _cluster_costs(cluster, parallel: ParallelConfig, dtype: str, fp8: bool,
                   gemm_format: str = "fp8", split: str = "stages"):
    """The ClusterCostModel of ``parallel`` on ``cluster`` (its GPU count checked)."""
    if parallel.gpus != cluster.gpus:
        raise ValueError(f"simulate_gpt: the plan uses dp·pp·cp·tp = {parallel.dp}·"
                         f"{parallel.pp}·{parallel.cp}·{parallel.tp} = {parallel.gpus} GPUs, "
                         f"cluster {cluster.name!r} has {cluster.gpus}; allowed: a plan of "
                         f"every GPU of the cluster")
    return ClusterCostModel(cluster, dtype, fp8_gemms=fp8_gemm if fp8 else None,
                            flash_v1=parallel.attention == "flash-v1", gemm_format=gemm_format,
                            placement=cluster_placement(parallel, cluster, split),
                            attention_kernel=named_kernel(parallel.attention))


def _replica_runs(of_replica: list, cluster) -> tuple:
    """ReplicaPlacements: the runs of consecutive replicas on one part."""
    runs: list = []
    for d, k in enumerate(of_replica):
        if runs and runs[-1][2] == k:
            runs[-1][1] += 1
        else:
            runs.append([d, 1, k])
    return tuple(ReplicaPlacement(first, n, k, cluster.parts[k].hardware.name)
                 for first, n, k in runs)


def steady_state_microbatches(parallel: ParallelConfig) -> tuple[int, int, int] | None:
    """The three micro-batch counts whose replays :func:`simulate_gpt` extrapolates the
    plan's step from (:mod:`vcluster.timing.steady_state`): 2p, 2p + u and 2p + 2u, with
    u the schedule's period (p for interleaved 1F1B, whose micro-batches run in rounds of
    p; 1 for GPipe and 1F1B) and 2p a steady state past the warm-up of p − 1 (the premise
    is checked on every figure all the same). None when those replays would stitch as
    many micro-batches as the plan's step or more, and for the zero-bubble schedule: its
    step time is affine from m = 2 on, but how its waits split into exposed communication
    and bubble settles only from about 4p (pp 4: irregular up to m = 16), past samples
    that would still pass the check."""
    p, m = parallel.pp, parallel.microbatches
    if parallel.schedule == "zero_bubble":
        return None
    u = p if parallel.schedule == "interleaved_1f1b" and parallel.chunks > 1 else 1
    samples = (2 * p, 2 * p + u, 2 * p + 2 * u)    # m - 2p is a multiple of u: m of p
    return None if sum(samples) >= m else samples


def _flops(traces) -> list:
    """The FLOPs each trace executes."""
    return [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in traces]


def _extrapolated(steps: list, results: list, samples: tuple, m: int) -> tuple:
    """(the replay of ``m`` micro-batches, each trace's FLOPs) from the replays
    ``results`` of the steps ``steps`` of ``samples`` micro-batches; (None, None) when a
    figure is not affine in them."""
    result = extrapolated_result(results, samples, m)
    if result is None:
        return None, None
    spacing = samples[1] - samples[0]
    per_trace = zip(*(_flops(t) for t in steps))
    try:
        flops = [extrapolated(f, spacing, (m - samples[2]) // spacing, REL_TOL * f[2])
                 for f in per_trace]
    except NotAffine:
        return None, None
    return result, flops


def simulate_gpt(config: GPTConfig, parallel: ParallelConfig, hardware, dtype: str = "bf16",
                 traced_positions: int | None = TRACED_POSITIONS,
                 memory_headroom: float = MEMORY_HEADROOM,
                 expert_skew: float = 1.0, precision="megatron",
                 autocast_kernels: bool | None = None, fp8: bool = False,
                 gemm_format: str = "fp8", eager_kernels: bool = False,
                 cluster_split: str | None = None,
                 fp8_casts: str | None = None, fsdp2_copies: bool = False,
                 torch_cp: bool = False, full_replay: bool = False) -> GPTSimulation:
    """See the module docstring. ``hardware``: a HardwareSpec, a preset name or a file,
    or a heterogeneous cluster (a :class:`~vcluster.timing.cluster.ClusterSpec` or its
    file: :func:`~vcluster.timing.cluster.load_cluster`; below);
    ``precision``: the memory model's bytes per parameter and activation (a
    :class:`~vcluster.planner.precision.PrecisionPolicy` or a preset's name: "megatron",
    the default, "torch_amp", "fp64", "fp32"; it changes the memory, not the timing);
    ``traced_positions``: see :func:`gpt_step_traces` (the result does not depend on it);
    ``memory_headroom``: the share of the device memory kept free (``fits`` compares the
    peak with the rest, :func:`~vcluster.planner.memory.usable_memory_bytes`);
    ``expert_skew`` (MoE): the busiest expert's tokens over the mean, >= 1 — the trace
    routes ``ExpertLoad.skewed(..., expert_skew)``, whose busiest expert sits on the
    traced ep rank 0, so its compute (which every all_to_all waits for) sets the step;
    ``autocast_kernels``: price plain PyTorch's autocast kernels (:mod:`.autocast_kernels`)
    — None, the default: when the precision policy runs them (``torch_amp``) and the
    hardware prices kernels from measurements (a kernel table or a calibrated GPU: that
    module's docstring says why not on the analytic presets); under a policy with
    ``inductor_fusion`` (``torch_compile``) they are priced as ``torch.compile`` fuses them
    (:mod:`.inductor_kernels`); ``eager_kernels``: the dense Llama layer run by eager
    PyTorch (torchtitan without ``torch.compile``): its norms, rotary embeddings, SwiGLU
    and grouped K/V priced as the unfused kernels eager PyTorch runs
    (:mod:`.eager_kernels`; refused on other models); ``fp8``: the transformer layers'
    linear GEMMs priced in FP8
    (:func:`fp8_gemm`: at the device's FP8 peak, analytic hardware with one only; the
    memory model is unchanged, and ``mfu`` stays against the BF16 peak), in
    ``gemm_format`` (:mod:`vcluster.timing.gemm_formats`: ``fp8``, the default — one
    scale per tensor, Transformer Engine's delayed or current scaling — ``fp8-row``
    (PyTorch's row-scaled GEMM, at its measured share of the FP8 rate), ``fp8-block``,
    ``mxfp8`` at the FP8 peak; ``nvfp4``, ``mxfp4`` at the FP4 peak; refused by name on
    hardware without it); ``fp8_casts``: with ``fp8`` in the ``fp8`` format, the cast
    kernels of a framework whose casts are not fused into the kernels before the GEMMs —
    ``"torchao-tensorwise"`` or ``"torchao-rowwise"`` (torchao's float8 training, as
    torchtitan runs it; :mod:`.float8_casts`) — priced after each FP8 GEMM, the GEMMs in
    the recipe's format (rowwise: ``fp8-row``, which ``gemm_format`` may also name;
    :func:`~.float8_casts.recipe_gemm_format`); None (the
    default): Transformer Engine's fused casts, none added; ``fsdp2_copies``: under ZeRO-2/3,
    the copies PyTorch FSDP2 (per-parameter sharding: torchtitan) makes around each
    data-parallel gather and reduce-scatter (:mod:`.fsdp2_copies`; False, the default: one
    flat parameter per module, as FSDP1 and Megatron keep it); ``torch_cp``: with
    context parallelism (the ring), the ring as PyTorch's experimental
    ``context_parallel`` runs it (torchtitan): float32 merges and accumulators, K and V
    repeated to every query head, its buffer copies (:mod:`.torch_context_parallel`;
    False, the default: Megatron's ring as the program traces it); ``full_replay``:
    replay every micro-batch of the step (False, the default: a step of many
    micro-batches is replayed as three short ones, :func:`steady_state_microbatches`, and
    extrapolated where every figure is affine in them, :mod:`vcluster.timing.steady_state`;
    the result's ``replayed_microbatches`` say which).
    ``parallel.activation_offload`` f > 0 (:mod:`.offload`): the
    first floor(f·L) layers of each stage keep their activations in the host's memory
    over its ``host_link`` (NVLink-C2C; ConfigError on hardware without one, ValueError
    on a cluster of several kinds): the memory counts them as ``host_bytes`` and ``fits``
    also holds them to ``host_memory_bytes``; the copies the layers' compute does not hide
    add ``offload_exposed_s`` to the replayed step (slots · e, :func:`.offload.
    offload_timing`), which ``step_time_s`` and the rates include (not ``bubble_s``). A job
    on hardware whose scale-up domains it does not fill
    whole is placed on the fewest domains in equal segments
    (:meth:`~vcluster.timing.hardware.HardwareSpec.for_job`: 256 GPUs on GB200 NVL72
    racks are 4 racks of 64).

    On a cluster of several GPU kinds (a ClusterSpec, whose GPUs the plan must use
    all of) the replay prices each rank on its own device
    (:class:`~vcluster.timing.cluster_cost.ClusterCostModel`): the stages are placed
    pipeline-major (:func:`cluster_placement`: stage 0's ranks on the cluster's first
    GPUs, then stage 1's, ...), each stage's ranks must lie on one kind
    (:func:`stage_parts`; else ValueError), and the traced rank of each stage is priced
    on its kind, so the slowest stage sets the step. ``fits`` holds each stage to its own
    device's memory (``stages``: one :class:`StagePlacement` per pipeline position);
    ``memory_limit_gb`` and ``device_memory_gb`` are those of the stage closest to its
    limit; ``mfu`` is against the mean peak of the GPUs used; ``hardware`` is the
    cluster's name. That is ``cluster_split="stages"``, the default when pp > 1. With
    ``cluster_split="replicas"`` (the default when pp = 1) each data-parallel replica
    runs on one kind instead: the ranks keep the mesh's order (the "dp" axis outermost:
    replica 0 on the cluster's first GPUs), each replica's ranks must lie on one kind
    (:func:`replica_parts`; else ValueError), and the pipeline ranks of one replica per
    kind are traced (:func:`gpt_step_traces` ``replicas``), each priced on its kind; the
    data-parallel collectives join them, so the slowest replica sets the step and the
    faster ones wait in it. ``replicas`` lists the runs of replicas per part; every stage
    runs on every kind, so ``fits`` holds it to the smallest GPU's memory; the per-device
    means (compute, communication, exposed, bubble) are over the traced ranks, one
    replica per kind. A cluster of one kind keeps the mesh's rank order and gives the
    figures of its HardwareSpec."""
    hw = load_cluster(hardware)
    if not isinstance(fp8, bool):
        raise ValueError(f"simulate_gpt: fp8 must be True or False, got {fp8!r}")
    fp8_casts = check_fp8_casts(fp8_casts, fp8, gemm_format)
    gemm_format = recipe_gemm_format(fp8_casts, gemm_format)
    if not isinstance(fsdp2_copies, bool) or (fsdp2_copies and parallel.zero_stage < 2):
        raise ValueError(f"simulate_gpt: fsdp2_copies={fsdp2_copies!r} with zero_stage="
                         f"{int(parallel.zero_stage)}: FSDP2's copies come with its "
                         f"sharding; allowed: False, or True with zero_stage 2 or 3")
    if not isinstance(torch_cp, bool) or (torch_cp and (
            parallel.cp < 2 or parallel.cp_algorithm != "ring")):
        raise ValueError(f"simulate_gpt: torch_cp={torch_cp!r} with cp={parallel.cp}, "
                         f"cp_algorithm={str(parallel.cp_algorithm)!r}: it prices PyTorch's "
                         f"context-parallel ring; allowed: False, or True with cp >= 2 and "
                         f"cp_algorithm 'ring'")
    precision = precision_policy(precision)
    mesh = parallel.mesh()
    m = parallel.microbatches
    traced_replicas, replicas = (0,), ()
    if isinstance(hw, ClusterSpec):
        split = cluster_split_of(cluster_split, parallel)
        costs = _cluster_costs(hw, parallel, dtype, fp8, gemm_format, split)
        if split == "stages":
            parts = stage_parts(parallel, costs)
            kinds = [hw.parts[k].hardware for k in parts]
        else:                      # every stage runs on every kind: the smallest HBM holds it
            of_replica = replica_parts(parallel, costs)
            first: dict = {}       # one traced replica per cost model (GPU kind), 0 first
            for d, k in enumerate(of_replica):
                first.setdefault(id(costs.models[k]), d)
            traced_replicas = tuple(sorted(first.values()))
            replicas = _replica_runs(of_replica, hw)
            smallest = min((hw.parts[k].hardware for k in set(of_replica)),
                           key=lambda h: h.device.hbm_bytes)
            kinds = [smallest] * parallel.pp
        limits = [usable_memory_bytes(h.device.hbm_bytes, memory_headroom) for h in kinds]
        if parallel.activation_offload:
            raise ValueError(f"simulate_gpt: activation_offload="
                             f"{parallel.activation_offload:g} on cluster {hw.name!r} of "
                             f"several GPU kinds is not modelled; allowed: a hardware preset "
                             f"or file with a host link (gb200-nvl72, gb300-nvl72)")
        peak_flops = sum(hw.hardware_of(costs.device(r)).device.peak_flops(dtype)
                         for r in range(mesh.size)) / mesh.size
    else:
        hw = hw.for_job(mesh.size)
        costs = HardwareCostModel(hw, dtype, fp8_gemms=fp8_gemm if fp8 else None,
                                  flash_v1=parallel.attention == "flash-v1",
                                  gemm_format=gemm_format,
                                  attention_kernel=named_kernel(parallel.attention))
        kinds = [hw] * parallel.pp
        limits = [usable_memory_bytes(hw.device.hbm_bytes, memory_headroom)] * parallel.pp
        if parallel.activation_offload:   # refused before tracing: no host link, or
            host_link_of(hw, parallel.activation_offload)  # a schedule not modelled
            microbatch_slots(parallel)
        peak_flops = hw.device.peak_flops(dtype)
    if autocast_kernels is None:
        autocast_kernels = autocast_kernels_priced(precision, costs)
    elif not isinstance(autocast_kernels, bool):
        raise ValueError(f"simulate_gpt: autocast_kernels must be True, False or None, got "
                         f"{autocast_kernels!r}")
    if autocast_kernels and (config.block is not GPT2_BLOCK or config.experts or parallel.cp > 1):
        raise ValueError(f"simulate_gpt: autocast_kernels rewrites the dense GPT program "
                         f"without context parallelism (the PyTorch reference step), got "
                         f"arch={config.arch!r}, experts={config.experts}, cp={parallel.cp}")
    if not isinstance(eager_kernels, bool):
        raise ValueError(f"simulate_gpt: eager_kernels must be True or False, got "
                         f"{eager_kernels!r}")
    if eager_kernels and (config.block is not LLAMA_BLOCK or config.experts
                          or getattr(config, "kv_lora_rank", None)
                          or parallel.activation_offload):
        raise ValueError(f"simulate_gpt: eager_kernels prices eager PyTorch's unfused kernels "
                         f"of the dense Llama layer with grouped-query attention (torchtitan's "
                         f"Llama 3), without activation offload; got arch={config.arch!r}, "
                         f"experts={config.experts}, kv_lora_rank="
                         f"{getattr(config, 'kv_lora_rank', None)}, activation_offload="
                         f"{parallel.activation_offload:g} (a GPT model run in plain "
                         f"PyTorch: precision='torch_amp' prices its autocast kernels)")
    if fp8_casts is not None and (config.block is not LLAMA_BLOCK or config.experts
                                  or getattr(config, "kv_lora_rank", None)):
        raise ValueError(f"simulate_gpt: fp8_casts={fp8_casts!r} prices torchao's casts for "
                         f"the linears of the dense Llama layer (torchtitan's Llama 3); got "
                         f"arch={config.arch!r}, experts={config.experts}, kv_lora_rank="
                         f"{getattr(config, 'kv_lora_rank', None)}")
    fused = autocast_kernels and precision.inductor_fusion
    schedule = gpt_schedule(parallel)
    stitched = _stitcher(config, parallel, costs, traced_positions, ADAM, False, expert_skew,
                         autocast_kernels, fused, eager_kernels, traced_replicas, fp8_casts,
                         fsdp2_copies, precision.optimizer_step_bytes, torch_cp)
    axes_of: dict = {}               # data_parallel_row's cache: group -> its varying axes

    def replayed(traces):
        return simulate_trace(traces, costs, mesh=mesh, symmetric=True, timeline=False,
                              op_kind=gpt_op_kind,
                              collective_kind=lambda op: data_parallel_row(op, mesh, axes_of))

    if not isinstance(full_replay, bool):
        raise ValueError(f"simulate_gpt: full_replay must be True or False, got "
                         f"{full_replay!r}")
    samples = None if full_replay else steady_state_microbatches(parallel)
    result = None
    if samples is not None:          # the step from three short ones (timing.steady_state)
        steps = [stitched(gpt_schedule(parallel, s)) for s in samples]
        result, flops = _extrapolated(steps, [replayed(t) for t in steps], samples, m)
    if result is None:
        samples = None
        full = stitched(schedule)
        result = replayed(full)
        flops = _flops(full)
    offload = None
    if parallel.activation_offload:       # the copies' exposed time (planner.offload)
        offload = offload_timing(config, parallel, hw, costs, expert_skew, autocast_kernels,
                                 fused)
    step = result.step_time_s + (offload.step_exposed_s if offload else 0.0)
    n = mesh.size
    flops_model = model_flops(config, parallel.global_batch)
    memory = tuple(gpt_memory(config, parallel, schedule, expert_skew, precision))
    peak = max(mm.total_bytes for mm in memory)
    tight = max(range(len(memory)), key=lambda q: memory[q].total_bytes / limits[q])
    fits = all(mm.total_bytes <= limits[q] for q, mm in enumerate(memory))
    host_limit = None if isinstance(hw, ClusterSpec) else hw.node.host_memory_bytes
    if offload:                           # the offloaded activations fit the host's memory
        fits = fits and all(mm.host_bytes <= host_limit for mm in memory)
    stages = ()
    if isinstance(hw, ClusterSpec) and not replicas:
        stages = tuple(StagePlacement(q, parts[q], kinds[q].name,
                                      parallel.rank_layers(config.layers, q),
                                      memory[q].total_bytes / 1e9, limits[q] / 1e9,
                                      memory[q].total_bytes <= limits[q])
                       for q in range(parallel.pp))

    def mean(d):
        return sum(d.values()) / len(d)

    ratio = result.compute_comm_ratio
    return GPTSimulation(
        step_time_s=step, tflops_per_gpu=sum(flops) / len(flops) / step / 1e12,
        mfu=flops_model / (n * peak_flops * step),
        model_tflops_per_gpu=flops_model / (n * step) / 1e12,
        tokens_per_s_per_gpu=parallel.global_batch * config.seq / (step * n),
        compute_s=mean(result.compute_s), comm_s=mean(result.comm_s),
        exposed_comm_s=mean(result.exposed_comm_s), bubble_s=mean(result.bubble_s),
        compute_comm_ratio=ratio, low_ratio=ratio < RATIO_FLAG,
        peak_memory_gb=peak / 1e9, fits=fits, memory=memory,
        gpus=n, microbatches=m, hardware=hw.name, memory_limit_gb=limits[tight] / 1e9,
        device_memory_gb=kinds[tight].device.hbm_bytes / 1e9,
        zero_stage=int(parallel.zero_stage),
        precision=precision.name, autocast_kernels=autocast_kernels, inductor_fusion=fused,
        eager_kernels=eager_kernels,
        fp8=fp8, gemm_format=gemm_format if fp8 else None, fp8_casts=fp8_casts,
        fsdp2_copies=fsdp2_copies, torch_cp=torch_cp,
        grad_reduce_dtype=parallel.grad_reduce_dtype, attention=parallel.attention,
        ops=tuple(dataclasses.replace(o, compute_s=o.compute_s / len(result.ranks),
                                      comm_s=o.comm_s / len(result.ranks))
                  for o in result.op_stats),
        stages=stages, replicas=replicas, activation_offload=parallel.activation_offload,
        host_memory_gb=max(mm.host_bytes for mm in memory) / 1e9,
        host_memory_limit_gb=None if host_limit is None else host_limit / 1e9,
        offload_exposed_s=offload.step_exposed_s if offload else 0.0,
        offload=offload.stages if offload else (),
        replayed_microbatches=samples or ())
