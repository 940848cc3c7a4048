"""The planner's search space: every TP x PP x DP split, micro-batch, schedule, sequence
parallelism and recomputation of a GPT on N GPUs, with the reasons the others are out.

A split (tp, pp, dp = N / (tp·pp)) is valid when

* tp divides the heads and the vocabulary (whole heads and vocabulary rows per rank)
  and tp <= ``max_tp`` (default: the GPUs of one node, so TP stays on NVLink);
* pp divides the layers;
* dp divides the global batch B.

For a valid split, the knobs are: micro-batch b among ``micro_batches`` (default the
divisors of B / dp up to ``DEFAULT_MAX_MICRO_BATCH``), m = B / (dp·b); the schedule
(``1f1b``, ``zero_bubble`` and ``interleaved_1f1b`` with v chunks per rank, v >= 2 a
divisor of l / pp up to ``max_virtual_stages``, needing m mod pp = 0; with pp = 1 only
``1f1b``, the others being the same step); sequence parallelism (when tp > 1 and tp
divides s); recomputation none / selective / full. Each candidate then must fit device
memory (:func:`~vcluster.planner.screen.peak_memory_bytes`, gpt_memory's formulas), with
the attention kernel ``attention`` (flash by default). The distributed optimizer
(optimizer state sharded over dp) is ``distributed_optimizer``: True or False for every
candidate, or None (the default) to use it where dp > 1 and the candidate does not fit
without it — it costs no extra traffic (its reduce-scatter and all-gather move what the
all-reduce did), so the planner turns it on exactly where memory asks for it.

ZeRO (``zero_stages``, default all of 0, 1, 2, 3; ``distributed_optimizer`` True is
``(1,)``, False ``(0,)``): each candidate takes the *lowest* stage of ``zero_stages`` that
fits its memory and that it supports — 2 and 3 need pp = 1; a stage >= 1 where dp·cp = 1 shards nothing and is tried only when 0
is not asked for. Why the lowest: a higher stage only trades traffic for memory (ZeRO-1
moves what DDP does; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also all-gathers
the weights before each module's forward and backward), and whatever a higher stage's
memory buys — a larger micro-batch, less recomputation — is a candidate of its own with
its own lowest fitting stage; so the search keeps one candidate per configuration (the
count of earlier versions), and ZeRO-2/3 appear exactly where 0 and 1 do not fit. A
candidate none of whose allowed stages is supported is rejected as
``zero_stage_unsupported``.

Context parallelism (``max_cp`` > 1; default 1 keeps the search of earlier versions):
cp among the divisors of N up to ``max_cp`` with s divisible by 2·cp, dp = N /
(tp·pp·cp), with ``cp_algorithm``; it needs flash attention (the screen's memory then
divides the activations by cp).

With a mixture of experts (``config.experts``), ep takes every value up to ``max_ep``
(default 1) that divides both dp and the experts: the ep group is carved out of the
data-parallel ranks, so ep multiplies no GPU count; each expert is split over tp (etp =
tp). With tp > 1 and sequence parallelism the search also folds the expert group over
whole tp groups (etp = 1, ep = tp × a divisor of dp, up to ``max_ep``). With cp > 1 the
expert group takes whole cp groups: ep = cp × a divisor of dp (× tp when folded).
Every candidate with ep > 1 takes the space's ``moe_dispatcher`` (default "alltoall")
and, with ``moe_comm_overlap``, Megatron-Core's MoE all-to-all overlap where
ParallelConfig's rule allows it for that candidate (its schedule, pp, virtual stages and
recomputation: :func:`with_moe_overlap`), off elsewhere: the overlap rejects no
candidate.

Rejections are counted per reason. A split-level reason (``tp_*``, ``pp_*``, ``dp_*``)
counts (tp, pp) splits, the others count whole candidates.

On a heterogeneous cluster (:class:`~vcluster.timing.cluster.ClusterSpec`) the pipeline
stages are placed pipeline-major (stage q on the cluster's GPUs q·G .. (q+1)·G − 1, G =
N / pp: :func:`stage_kinds`), each stage must lie on one GPU kind (else
``stage_spans_gpu_kinds``), and :func:`balance_layers` splits the layers over stages of
different speeds (the planner, :mod:`~vcluster.planner.search`, prices a layer on each
kind).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from types import MappingProxyType

from pipeline_parallel.gpt import (ATTENTION, FUSED_ATTENTION, GRAD_REDUCE_DTYPES, TP_OVERLAP,
                                   GPTConfig, ParallelConfig)
from pipeline_parallel.zero import ZERO_STAGES
from modeling import (ConfigError, Recompute, ScheduleName, check_zero_stage,
                      recompute_refusal)
from modeling.plan import MOE_DISPATCHERS
from tensor_parallel.context_parallel import CP_ALGORITHMS
from vcluster.timing import load_hardware
from .screen import peak_memory_bytes

__all__ = ["SearchSpace", "enumerate_candidates", "divisors", "stage_split", "REJECT_REASONS",
           "DEFAULT_MAX_MICRO_BATCH", "DEFAULT_MAX_VIRTUAL_STAGES", "PLAN_SCHEDULES",
           "stage_kinds", "replica_kinds", "balance_layers", "with_moe_overlap",
           "with_node_ranks"]

DEFAULT_MAX_MICRO_BATCH = 8       # Megatron's usual range 1..8 sequences per micro-batch
DEFAULT_MAX_VIRTUAL_STAGES = 8
#: the schedules the planner searches: every one of modeling's but GPipe (1F1B's memory
#: at GPipe's bubble, never better)
PLAN_SCHEDULES = tuple(s for s in ScheduleName.values() if s != ScheduleName.GPIPE)
RECOMPUTE_MODES = Recompute.values()
#: the recomputation the planner searches unless asked: Megatron's three (torchtitan's
#: per-op ``op`` and PyTorch's ``full-torch`` when asked for, on the models they run on)
DEFAULT_RECOMPUTE = tuple(r for r in RECOMPUTE_MODES
                          if r not in (Recompute.OP, Recompute.FULL_TORCH))

#: the reject reason of a recompute policy the model does not run (recompute_refusal)
_REFUSED_RECOMPUTE = MappingProxyType({"op": "op_recompute_model",
                                       "full-torch": "full_torch_model"})

REJECT_REASONS = {
    "tp_not_dividing_heads": "tp does not divide the attention heads",
    "tp_not_dividing_vocab": "tp does not divide the vocabulary",
    "tp_not_fitting_kv_heads": "Llama: kv_heads >= tp is no multiple of tp, or kv_heads < tp "
                               "does not divide tp",
    "tp_not_dividing_ffn": "Llama: tp does not divide ffn_hidden",
    "tp_larger_than_node": "tp is larger than the GPUs of a node (max_tp)",
    "pp_not_dividing_layers": "the layers split into pp stages neither evenly nor with "
                              "the embedding and the head counted as layers",
    "dp_not_dividing_batch": "dp = N/(tp·pp) does not divide the global batch",
    "cp_not_dividing_seq": "s does not split into 2·cp equal chunks",
    "interleaved_microbatches": "interleaved 1F1B needs m = B/(dp·b) to be a multiple of pp",
    "op_recompute_model": "recompute 'op' (torchtitan's per-op policy) runs on the dense "
                          "Llama layer only",
    "full_torch_model": "recompute 'full-torch' (PyTorch's non-reentrant checkpoint) runs "
                        "on dense GPT and Llama layers only",
    "zero_stage_unsupported": "no ZeRO stage asked for is supported here (2 and 3 need "
                              "pp = 1)",
    "out_of_memory": "peak memory per device exceeds the device's HBM less the headroom",
    "stage_spans_gpu_kinds": "heterogeneous cluster: a pipeline stage's GPUs (N/pp, placed "
                             "pipeline-major) lie on two GPU kinds, and so do a data-parallel "
                             "replica's (N/dp, in the mesh's order)",
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """The knobs the planner tries (see the module docstring)."""

    max_tp: int
    micro_batches: tuple | None = None          # None: divisors of B/dp up to the max
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH
    schedules: tuple = PLAN_SCHEDULES
    max_virtual_stages: int = DEFAULT_MAX_VIRTUAL_STAGES
    recompute: tuple = DEFAULT_RECOMPUTE
    sequence_parallel: tuple = (False, True)
    attention: str = "flash"
    tp_overlap: str = "backward"                   # ParallelConfig.tp_overlap, every candidate
    grad_reduce_dtype: str = "model"               # ParallelConfig.grad_reduce_dtype, every one
    distributed_optimizer: bool | None = None      # None: where memory needs it
    max_cp: int = 1                                # context parallelism: largest cp tried
    cp_algorithm: str = "ring"
    max_ep: int = 1                                # MoE: the largest expert parallelism
    zero_stages: tuple | None = None               # None: from distributed_optimizer
    precision: object = "megatron"                 # the memory model's PrecisionPolicy
    moe_dispatcher: str = "alltoall"               # MoE, every candidate with ep > 1
    moe_comm_overlap: bool = False                 # MoE: where the rule allows it

    def __post_init__(self):
        if self.zero_stages is None:
            stages = ZERO_STAGES if self.distributed_optimizer is None else (
                (1,) if self.distributed_optimizer else (0,))
        else:
            if self.distributed_optimizer is not None:
                raise ValueError("plan_gpt: give zero_stages or distributed_optimizer, not "
                                 f"both (got zero_stages={self.zero_stages!r}, "
                                 f"distributed_optimizer={self.distributed_optimizer!r})")
            stages = tuple(self.zero_stages)
            if not stages or any(isinstance(z, bool) or z not in ZERO_STAGES for z in stages):
                raise ValueError(f"plan_gpt: zero_stages must be a non-empty selection of "
                                 f"{ZERO_STAGES}, got {self.zero_stages!r}")
        object.__setattr__(self, "zero_stages", tuple(sorted(set(stages))))
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise ValueError(f"plan_gpt: cp_algorithm must be one of {CP_ALGORITHMS}, got "
                             f"{self.cp_algorithm!r}")
        if self.max_cp > 1 and self.attention not in FUSED_ATTENTION:
            raise ValueError(f"plan_gpt: max_cp={self.max_cp} needs attention='flash' or "
                             f"'flash-v1' (context-parallel attention never keeps the "
                             f"scores), got {self.attention!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"plan_gpt: attention must be one of {ATTENTION}, got "
                             f"{self.attention!r}")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(f"plan_gpt: grad_reduce_dtype must be one of "
                             f"{GRAD_REDUCE_DTYPES}, got {self.grad_reduce_dtype!r}")
        if self.tp_overlap not in TP_OVERLAP:
            raise ValueError(f"plan_gpt: tp_overlap must be one of {TP_OVERLAP}, got "
                             f"{self.tp_overlap!r}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"plan_gpt: moe_dispatcher={self.moe_dispatcher!r}: not a token "
                             f"dispatcher; allowed: {', '.join(MOE_DISPATCHERS)}")
        if not isinstance(self.moe_comm_overlap, bool):
            raise ValueError(f"plan_gpt: moe_comm_overlap={self.moe_comm_overlap!r}: "
                             f"allowed: True or False")
        if self.distributed_optimizer not in (None, False, True):
            raise ValueError(f"plan_gpt: distributed_optimizer must be True, False or None "
                             f"(where memory needs it), got {self.distributed_optimizer!r}")
        for name in ("max_tp", "max_micro_batch", "max_virtual_stages", "max_cp", "max_ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"plan_gpt: {name} must be a positive int, got {v!r}")
        for name, allowed in (("schedules", PLAN_SCHEDULES), ("recompute", RECOMPUTE_MODES),
                              ("sequence_parallel", (False, True))):
            values = tuple(getattr(self, name))
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"plan_gpt: {name} must be a non-empty selection of "
                                 f"{allowed}, got {values!r}")
            object.__setattr__(self, name, values)
        if self.micro_batches is not None:
            mbs = tuple(self.micro_batches)
            if not mbs or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                              for b in mbs):
                raise ValueError(f"plan_gpt: micro_batches must be positive ints, got {mbs!r}")
            object.__setattr__(self, "micro_batches", mbs)


def _split_reason(config: GPTConfig, tp, pp, dp, global_batch, max_tp) -> str | None:
    if config.heads % tp:
        return "tp_not_dividing_heads"
    if config.vocab % tp:
        return "tp_not_dividing_vocab"
    if config.block.grouped_query:
        c = config.kv_heads
        if (c >= tp and c % tp) or (c < tp and tp % c):
            return "tp_not_fitting_kv_heads"
        if config.ffn_hidden % tp:
            return "tp_not_dividing_ffn"
    if tp > max_tp:
        return "tp_larger_than_node"
    if stage_split(config.layers, pp) is None:
        return "pp_not_dividing_layers"
    if global_batch % dp:
        return "dp_not_dividing_batch"
    return None


def stage_split(layers: int, stages: int, empty_ends: bool = False):
    """How ``layers`` go into ``stages`` pipeline stages: () evenly; else (k, k), the
    first and last stages one layer short — Megatron-Core's account-for-embedding-and-loss
    split, the embedding and the head each counted as a layer, (L + 2)/S per stage; else
    (a, c), the middle stages m = ceil(L/S) layers each and the first and last the rest,
    a = ceil(r/2) >= c = floor(r/2) >= 1, r = L − (S−2)·m, a <= m (DeepSeek-V3's 61 on 16
    stages: 3, 4 × 14, 2); None when none of these splits.

    ``empty_ends``: an end stage may hold no transformer layer, as published layouts do —
    k = 0 where L + 2 = S (the first stage the embedding alone, the last the head alone:
    Megatron-Bridge's Llama 3.1 405B, 126 layers on pp 16 × vp 8), c = 0 (DeepSeek-V3's 61
    on 32 stages: 1, 2 × 30, 0 — Megatron-Bridge's ``pipeline_model_parallel_layout``
    "Et|(tt|)*30mL", the last stage the head alone). The planner searches splits whose
    every stage holds a layer (the default); validation replays the published ones. Every
    middle stage holds at least one layer either way."""
    if layers % stages == 0:
        return ()
    if stages == 1:
        return None
    low = 0 if empty_ends else 1
    if (layers + 2) % stages == 0 and (layers + 2) // stages >= 1 + low:
        k = (layers + 2) // stages - 1
        return (k, k)
    if stages > 2:
        m = -(-layers // stages)
        rest = layers - (stages - 2) * m
        a, c = -(-rest // 2), rest // 2
        if a >= 1 and c >= low and a <= m:
            return (a, c)
    return None


def stage_kinds(cluster, pp: int) -> tuple | None:
    """The GPU kind (an index into ``cluster.kinds``) of each of ``pp`` pipeline stages
    placed pipeline-major — stage q on the cluster's GPUs q·G .. (q+1)·G − 1, G = N / pp,
    as :func:`~vcluster.planner.simulation.cluster_placement` places them — or None when
    a stage straddles two kinds."""
    n = cluster.gpus
    if n % pp:
        return None
    size, kinds = n // pp, cluster.kinds
    out = []
    for q in range(pp):
        first = cluster.hardware_of(q * size)
        last = cluster.hardware_of((q + 1) * size - 1)
        if first != last or any(cluster.hardware_of(d) != first
                                for d in range(q * size, (q + 1) * size,
                                               cluster.gpus_per_node)):
            return None
        out.append(kinds.index(first))
    return tuple(out)


def replica_kinds(cluster, parallel) -> tuple | None:
    """The GPU kind (an index into ``cluster.kinds``) of each data-parallel replica — each
    coordinate of the plan's mesh's "dp" axis, G = N / that axis's size consecutive GPUs
    in the mesh's order, as :func:`~vcluster.planner.simulation.simulate_gpt` places
    them with ``cluster_split="replicas"`` — or None when a replica straddles two kinds
    (or the plan does not use the cluster's GPUs)."""
    mesh = parallel.mesh()
    if mesh.size != cluster.gpus:
        return None
    n_rep = mesh.shape["dp"]
    size, kinds = mesh.size // n_rep, cluster.kinds
    out = []
    for d in range(n_rep):
        first = cluster.hardware_of(d * size)
        if any(cluster.hardware_of(g) != first for g in range(d * size, (d + 1) * size)):
            return None
        out.append(kinds.index(first))
    return tuple(out)


def balance_layers(layers: int, seconds_per_layer, fixed_s=None) -> tuple[int, ...]:
    """Whole layers per stage (each >= 1, ``layers`` in all) that minimise the slowest
    stage's time ``n_s · seconds_per_layer[s] + fixed_s[s]`` (``fixed_s``: work a stage
    holds besides its layers — the embedding on the first, the head on the last; default
    none): every stage starts with one layer, and each further layer goes to the stage
    that would finish it earliest (the first such stage on a tie). For identical layers on
    stages of different speeds this greedy split is optimal (an exchange argument: moving
    a layer off the stage it chose can only end later)."""
    t = [float(x) for x in seconds_per_layer]
    c = [0.0] * len(t) if fixed_s is None else [float(x) for x in fixed_s]
    if not t or len(c) != len(t) or any(x <= 0 for x in t) or any(x < 0 for x in c):
        raise ValueError(f"balance_layers: seconds_per_layer must be > 0 and fixed_s >= 0, "
                         f"one per stage; got {seconds_per_layer!r} and {fixed_s!r}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < len(t):
        raise ValueError(f"balance_layers: {layers!r} layers do not give each of "
                         f"{len(t)} stages one")
    n = [1] * len(t)
    for _ in range(layers - len(t)):
        s = min(range(len(t)), key=lambda k: ((n[k] + 1) * t[k] + c[k], k))
        n[s] += 1
    return tuple(n)


def _schedules(space: SearchSpace, config: GPTConfig, pp: int):
    """(schedule, virtual_stages) pairs for a split (interleaved: every v tried)."""
    if pp == 1:
        return [("1f1b", None)]
    out = []
    for name in space.schedules:
        if name != "interleaved_1f1b":
            out.append((name, None))
        else:
            out += [(name, v) for v in range(2, space.max_virtual_stages + 1)
                    if stage_split(config.layers, pp * v) is not None]
    return out


def _expert_layouts(config, space, dp: int, tp: int, cp: int = 1) -> list[tuple[int, int]]:
    """The (ep, etp) a candidate tries: experts split over tp (etp = tp) in an ep group of
    cp × a divisor of dp ranks (ep 1 too: no group), and — tp > 1 — the expert group
    folded over whole tp groups (etp = 1, ep = tp × cp × a divisor of dp); each ep at
    most ``max_ep`` and dividing the experts."""
    if not config.experts:
        return [(1, tp)]
    out = [(1, tp)] + [(cp * e, tp) for e in divisors(dp) if 1 < cp * e <= space.max_ep
                       and config.experts % (cp * e) == 0]
    if tp > 1:
        out += [(tp * cp * e, 1) for e in divisors(dp)
                if tp * cp * e <= space.max_ep and config.experts % (tp * cp * e) == 0]
    return out


def _zero_allowed(zero: int, pp: int) -> bool:
    """Whether the plan's rulebook (:func:`modeling.check_zero_stage`) allows ``zero``."""
    try:
        check_zero_stage(zero, pp)
    except ConfigError:
        return False
    return True


def _zero_stages(space: SearchSpace, config: GPTConfig, shards: int, pp: int) -> tuple:
    """The ZeRO stages a candidate tries, lowest first (see the module docstring)."""
    stages = [z for z in space.zero_stages if _zero_allowed(z, pp)]
    if 0 in stages and shards == 1:          # sharding over one rank saves nothing
        stages = [0]
    return tuple(stages)


def with_moe_overlap(par: ParallelConfig) -> ParallelConfig:
    """``par`` with ``moe_comm_overlap`` where ParallelConfig's rule allows it (ep > 1, the
    alltoall or flex dispatcher, no full recomputation, 1f1b on pp 1 or interleaved_1f1b
    with virtual stages >= 2), else ``par`` itself (the overlap off)."""
    try:
        return replace(par, moe_comm_overlap=True)
    except ConfigError as exc:
        if exc.field != "moe_comm_overlap":
            raise
        return par


def with_node_ranks(par: ParallelConfig, hardware) -> ParallelConfig:
    """``par`` with ``moe_ep_node_ranks`` set where its flex dispatcher (DeepEP, HybridEP)
    spans several scale-up domains of ``hardware`` (a preset name or a HardwareSpec, as
    :func:`~vcluster.timing.load_hardware` takes): d, the expert group's ranks per domain
    of ``node.domain_gpus`` (default ``gpus_per_node``) GPUs, derived from the mesh
    (:meth:`~pipeline_parallel.gpt.ParallelConfig.expert_ranks_per_domain`: ep next to tp,
    so with tp = 2 an 8-GPU DGX holds 4 of a group's ranks). DeepEP's internode kernels
    and HybridEP send a token once per destination domain and forward it over NVLink
    there. ``par`` itself where the group lies in one domain or the dispatcher is not
    flex; ConfigError (key ``moe_ep_node_ranks``) where the group does not split into
    whole domains. The validation tables' rows and the planner's candidates both take it."""
    if par.moe_dispatcher != "flex" or par.ep == 1:
        return par
    node = load_hardware(hardware).node
    d = par.expert_ranks_per_domain(node.domain_gpus or node.gpus_per_node)
    return par if d is None or d >= par.ep else replace(par, moe_ep_node_ranks=d)


def enumerate_candidates(config: GPTConfig, gpus: int, global_batch: int, space: SearchSpace,
                         hbm_bytes: int) -> tuple[list[ParallelConfig], Counter]:
    """(the candidates that fit, rejected counts by reason) — see the module docstring."""
    rejected: Counter = Counter()
    out = []
    cps = [c for c in divisors(gpus) if c <= space.max_cp]
    splits = [(tp, pp, cp) for cp in cps for tp in divisors(gpus // cp)
              for pp in divisors(gpus // (cp * tp))]
    for tp, pp, cp in splits:
        dp = gpus // (tp * pp * cp)
        reason = _split_reason(config, tp, pp, dp, global_batch, space.max_tp)
        if reason is None and cp > 1 and config.seq % (2 * cp):
            reason = "cp_not_dividing_seq"
        if reason:
            rejected[reason] += 1
            continue
        per_replica = global_batch // dp
        mbs = [b for b in (space.micro_batches or divisors(per_replica))
               if per_replica % b == 0 and (space.micro_batches or b <= space.max_micro_batch)]
        sps = [sp for sp in space.sequence_parallel
               if not sp or (tp > 1 and config.seq // cp % tp == 0)]
        if space.tp_overlap == "te" and tp > 1:      # TE's overlap needs sequence parallelism
            sps = [sp for sp in sps if sp]
        layouts = _expert_layouts(config, space, dp, tp, cp)
        for b, (ep, etp) in ((b, x) for b in mbs for x in layouts):
            m = per_replica // b
            for name, v in _schedules(space, config, pp):
                for sp in sps:
                    if etp == 1 and tp > 1 and ep > 1 and not sp:
                        continue              # folded: each tp rank routes its own slice
                    for rc in space.recompute:
                        if recompute_refusal(rc, config):
                            rejected[_REFUSED_RECOMPUTE[rc]] += 1
                            continue
                        if name == "interleaved_1f1b" and m % pp:
                            rejected["interleaved_microbatches"] += 1
                            continue
                        stages = _zero_stages(space, config, dp * cp, pp)
                        if not stages:
                            rejected["zero_stage_unsupported"] += 1
                            continue
                        ends = stage_split(config.layers, pp * (v or 1))
                        par = ParallelConfig(
                            global_batch=global_batch, micro_batch=b, dp=dp, pp=pp, tp=tp,
                            schedule=name, virtual_stages=v, sequence_parallel=sp,
                            first_stage_layers=ends[0] if ends else None,
                            last_stage_layers=ends[1] if ends else None,
                            recompute=rc, attention=space.attention, ep=ep, etp=etp,
                            tp_overlap=space.tp_overlap,
                            grad_reduce_dtype=space.grad_reduce_dtype,
                            zero_stage=stages[0],
                            **({"cp": cp, "cp_algorithm": space.cp_algorithm}
                               if cp > 1 else {}),
                            **({"moe_dispatcher": space.moe_dispatcher}
                               if ep > 1 else {}))
                        if ep > 1 and space.moe_comm_overlap:
                            par = with_moe_overlap(par)
                        fits = peak_memory_bytes(config, par, space.precision) <= hbm_bytes
                        for z in stages[1:]:
                            if fits:
                                break
                            par = replace(par, zero_stage=z)
                            fits = peak_memory_bytes(config, par, space.precision) <= hbm_bytes
                        if fits:
                            out.append(par)
                        else:
                            rejected["out_of_memory"] += 1
    return out, rejected
