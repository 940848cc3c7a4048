"""The parallel plan of a transformer training step, and its one rulebook.

:class:`ParallelConfig` is the typed plan: global batch B, micro-batch b, degrees dp × pp
× cp × tp (and ep carved out of dp), the pipeline schedule, sequence parallelism,
recomputation, the attention kernel, the ZeRO stage, the context-parallel algorithm, TP
overlap and the gradient-reduction dtype — each closed choice an enum of
:mod:`modeling.choices`. Every cross-field rule is written once, here, and raises one
:class:`~modeling.errors.ConfigError` naming the field; the CLI maps the field to its flag
(``--zero``) and the scenario loader to its key path (``parallel.zero_stage``).

The rules (:meth:`ParallelConfig.__post_init__`, :func:`check_zero_stage`):

1. degrees, batch sizes and virtual stages are integers >= 1; each choice is one of its
   enum's values;
2. ZeRO-2/3 need pp = 1 (they reduce-scatter every micro-batch; DeepSpeed refuses them
   with pipelines; with sequence parallelism the tp-partial LayerNorm gradients are then
   summed over tp every micro-batch too); with ep > 1 every stage shards the experts'
   state over the expert-data-parallel ranks (Megatron's distributed optimizer and FSDP);
3. cp > 1 needs a fused attention kernel (context-parallel attention keeps O and the
   log-sum-exp, never the scores);
4. ep divides dp (the expert-parallel group is carved out of the data-parallel ranks);
   with ``etp`` = 1 and tp > 1 (the expert group folded over whole tp groups) ep is tp ×
   a divisor of dp instead, and sequence parallelism is on (each tp rank routes its own
   sequence slice, as Megatron-Core requires of MoE with tp); etp is 1 or tp;
   with cp > 1 the expert group takes whole cp groups: ep is cp (× tp when folded) × a
   divisor of dp (each rank routes its own chunks' tokens);
5. B splits into dp × b; m = B / (dp·b) micro-batches;
6. ``virtual_stages`` > 1 only under ``interleaved_1f1b``, whose v >= 2 chunks need m a
   multiple of pp (Megatron runs micro-batches in rounds of p);
7. ``layers_per_stage`` (one layer count per pipeline stage, each >= 1) has pp counts,
   needs one stage per rank (no interleaving: a count per rank is what a split over GPU
   kinds needs, and an interleaved rank's chunks would need a count each) and excludes
   ``first_stage_layers`` / ``last_stage_layers`` (two ways to say one split);
8. ``activation_offload`` (the share of each pipeline stage's layers whose saved
   activations go to host memory: Megatron-Core's ``--cpu-offloading-num-layers`` N of a
   stage of L layers is N / L) is in [0, 1) — the last layer is never offloaded — and 0
   with ``recompute`` full (a fully recomputed layer keeps only its input; Megatron-Core
   refuses CPU offloading with recomputation). Where it is priced: vcluster's
   ``planner.offload``.
9. ``moe_comm_overlap`` (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, the
   combined 1F1B schedule: :func:`pipelining.combined_1f1b`) needs expert parallelism
   (ep > 1) with the ``alltoall`` or ``flex`` dispatcher, no full recomputation, and a
   schedule Megatron runs it with: ``1f1b`` on one pipeline rank (no pipelining) or
   ``interleaved_1f1b`` with virtual stages >= 2 (Megatron-Core's
   ``TransformerConfig.__post_init__`` asserts each of these); experts > 0 is
   :meth:`ParallelConfig.check`'s.
10. ``recompute_modules`` (Megatron-Core's ``--recompute-modules``: the submodules
    ``recompute="selective"`` re-runs in the backward, each keeping only its input) names
    modules of :data:`~modeling.choices.RECOMPUTE_MODULES_MEGATRON`, each one modelled
    (:data:`~modeling.choices.RECOMPUTE_MODULES`: ``core_attn``, ``moe_act``,
    ``layernorm``, ``mla_up_proj``, ``mlp``; ``moe``, ``shared_experts`` and the
    GatedDelta/HyperConnection ones are refused as not modelled), none twice; it is the
    default ``("core_attn",)`` unless ``recompute`` is ``selective`` (Megatron ignores it
    then: a plan saying otherwise is refused). The model's side
    (:meth:`ParallelConfig.check`, :func:`recompute_modules_refusal`): ``mla_up_proj``
    needs latent attention, ``moe_act`` experts, ``mlp`` a dense MLP layer (Megatron-Core
    asserts the first two).

Rules that need the model (layers over stages, heads over tp, experts over ep) are
:meth:`ParallelConfig.check`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh import Mesh
from mesh.arguments import as_int

from .blocks import LLAMA_BLOCK
from .choices import (DEFAULT_RECOMPUTE_MODULES, FULL_RECOMPUTE, RECOMPUTE_MODULES,
                      RECOMPUTE_MODULES_MEGATRON, AttentionKernel, CPAlgorithm, GradReduceDtype,
                      Recompute, ScheduleName, TPOverlap, ZeroStage)
from .errors import ConfigError

__all__ = ["ParallelConfig", "check_zero_stage", "check_kv_heads", "parse", "MOE_DISPATCHERS",
           "recompute_refusal", "recompute_modules_refusal", "check_recompute_modules",
           "padded_vocab", "MEGATRON_VOCAB_DIVISOR"]

#: Megatron-LM's ``--make-vocab-size-divisible-by`` default (megatron/training/arguments.py),
#: which NeMo 2.0 and Megatron-Bridge keep (``make_vocab_size_divisible_by=128``)
MEGATRON_VOCAB_DIVISOR = 128

#: how an MoE layer's tokens reach their experts (Megatron-Core's token dispatchers):
#: all_to_all over the expert group, all-gather the group's tokens and reduce-scatter
#: the experts' partial outputs, or ``flex`` (DeepEP / HybridEP: each token once per
#: destination rank, combined there) (:mod:`tensor_parallel.moe`)
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")


def parse(kind, value, field: str, owner: str = ""):
    """``kind(value)`` (an enum member), or ConfigError naming ``field`` and the values."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        allowed = ", ".join(map(str, kind.values()))
        raise ConfigError(field, value, f"one of {allowed}", "not a known value",
                          owner=owner) from None


def check_recompute_modules(modules, recompute=Recompute.SELECTIVE,
                            owner: str = "") -> tuple[str, ...]:
    """``modules`` (a tuple, list, or comma-separated string of Megatron-Core's
    ``recompute_modules``) as a tuple in :data:`~modeling.choices.RECOMPUTE_MODULES`'s
    order, or ConfigError naming ``recompute_modules`` by rule 10 (module doc)."""
    value = modules
    if isinstance(modules, str):
        modules = tuple(m.strip() for m in modules.split(",") if m.strip())
    allowed = ", ".join(RECOMPUTE_MODULES)
    if isinstance(modules, bytes) or not hasattr(modules, "__iter__") \
            or not all(isinstance(m, str) for m in modules):
        raise ConfigError("recompute_modules", value, f"a list of {allowed}",
                          "not a list of module names", owner=owner)
    modules = tuple(modules)
    for m in modules:
        if m not in RECOMPUTE_MODULES_MEGATRON:
            raise ConfigError("recompute_modules", value, f"a list of {allowed}",
                              f"{m!r} is not one of Megatron-Core's recompute modules "
                              f"({', '.join(RECOMPUTE_MODULES_MEGATRON)})", owner=owner)
        if m not in RECOMPUTE_MODULES:
            raise ConfigError("recompute_modules", value, f"a list of {allowed}",
                              f"{m!r} (Megatron-Core's) is not modelled", owner=owner)
    if len(set(modules)) != len(modules):
        raise ConfigError("recompute_modules", value, f"a list of {allowed}, each once",
                          "a module named twice", owner=owner)
    modules = tuple(m for m in RECOMPUTE_MODULES if m in modules)
    if modules != DEFAULT_RECOMPUTE_MODULES and Recompute(recompute) is not Recompute.SELECTIVE:
        raise ConfigError("recompute_modules", value, f"{DEFAULT_RECOMPUTE_MODULES!r} "
                          f"with recompute={Recompute(recompute).value!r}",
                          "the modules are what recompute='selective' re-runs (Megatron-Core's "
                          "--recompute-modules with --recompute-granularity selective)",
                          owner=owner)
    return modules


def recompute_modules_refusal(modules, config) -> str:
    """Why ``modules`` (Megatron-Core's ``recompute_modules``) do not run on ``config``,
    or "" where they do: ``mla_up_proj`` needs latent attention (``kv_lora_rank``),
    ``moe_act`` experts, ``mlp`` a dense MLP layer (a model whose layers are all MoE has
    none)."""
    latent = getattr(config, "kv_lora_rank", None)
    experts = getattr(config, "experts", 0)
    if "mla_up_proj" in modules and not latent:
        return "mla_up_proj recomputes multi-head latent attention's up-projections: the " \
            "model has no latent attention (kv_lora_rank)"
    if "moe_act" in modules and not experts:
        return "moe_act recomputes the routed experts' activation: the model has no experts"
    if "mlp" in modules and experts and not getattr(config, "moe_dense_layers", ()):
        return "mlp recomputes the dense MLP: every layer of the model is MoE (Megatron's " \
            "'moe' recomputes an MoE layer; not modelled)"
    return ""


def check_zero_stage(zero_stage, pp: int = 1, owner: str = "") -> ZeroStage:
    """``zero_stage`` as a :class:`ZeroStage`, or ConfigError by rule 2 (module doc)."""
    if isinstance(zero_stage, bool):
        raise ConfigError("zero_stage", zero_stage, "one of 0, 1, 2, 3",
                          "not a known value", owner=owner)
    zero = parse(ZeroStage, zero_stage, "zero_stage", owner)
    if zero >= 2 and pp > 1:
        raise ConfigError("zero_stage", int(zero), "0 or 1 with pp > 1",
                          f"zero_stage={int(zero)} with pipeline parallelism (pp={pp}) is not "
                          "supported: ZeRO-2/3 reduce-scatter gradients every micro-batch, "
                          "and DeepSpeed refuses them with pipeline parallelism", owner=owner)
    return zero


def recompute_refusal(recompute, config) -> str:
    """Why ``recompute`` does not run on ``config``, or "" where it does: ``op``
    (torchtitan's per-op policy) is the dense Llama layer's, with grouped-query attention;
    ``full-torch`` (PyTorch's non-reentrant checkpoint, stopping before the MLP's last
    GEMM) the dense GPT and Llama layers'; the others run everywhere."""
    recompute, latent = Recompute(recompute), getattr(config, "kv_lora_rank", None)
    model = f"experts={config.experts}, kv_lora_rank={latent}"
    if recompute is Recompute.OP and (config.block is not LLAMA_BLOCK or config.experts
                                      or latent):
        return ("'op' (torchtitan's per-op policy) is the dense Llama layer's with "
                f"grouped-query attention; this model is {config.block.arch}, {model}")
    if recompute is Recompute.FULL_TORCH and (config.experts or latent):
        return ("'full-torch' (PyTorch's non-reentrant checkpoint, stopping before the MLP's "
                f"last GEMM) is the dense GPT and Llama layers'; this model has {model}")
    return ""


def padded_vocab(vocab: int, tp: int, divisible_by: int = MEGATRON_VOCAB_DIVISOR) -> int:
    """The vocabulary Megatron-LM builds its embedding and output layer with: ``vocab``
    rounded up to a multiple of divisible_by · tp (``_vocab_size_with_padding`` in
    megatron/training/tokenizer/tokenizer.py), so each tensor-parallel rank holds an equal,
    GPU-friendly slice; the padded rows are never a target. GPT-2's 50,257 tokens become
    50,304 at tp 1 and 50,688 at tp 4; Llama 3's 128,256 stay at tp 1 and 2 and become
    128,512 at tp 4.

    >>> padded_vocab(50257, 4)
    50688
    """
    for name, n in (("vocab", vocab), ("tp", tp), ("divisible_by", divisible_by)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(name, n, "an integer >= 1", "not a size", owner="padded_vocab")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def check_kv_heads(heads: int, kv_heads: int, tp: int) -> None:
    """ConfigError unless the query and key/value heads split over ``tp`` ranks: heads
    a multiple of tp; kv_heads a multiple of tp, or (fewer) a divisor of it, each KV head
    then replicated over tp/kv_heads ranks."""
    if heads % tp:
        raise ConfigError("heads", heads, f"a multiple of tp={tp}",
                          f"heads={heads} does not split evenly over tp={tp}", owner="GPT")
    if kv_heads >= tp and kv_heads % tp or kv_heads < tp and tp % kv_heads:
        rule = f"kv_heads={kv_heads} >= tp={tp} must be a multiple of tp (K/V heads split " \
            "over tp)" if kv_heads >= tp else f"kv_heads={kv_heads} < tp={tp} must divide " \
            "tp (each KV head replicated over tp/kv_heads ranks)"
        raise ConfigError("kv_heads", kv_heads, f"a multiple or a divisor of tp={tp}", rule,
                          owner="GPT")


@dataclass(frozen=True)
class ParallelConfig:
    """Global batch B, micro-batch b, degrees dp x pp x tp (the sizes of the mesh axes of
    those names), the schedule (virtual stages: interleaved_1f1b only, default 2),
    sequence parallelism, recomputation. Micro-batches per step m = B / (dp·b). The
    rules are the module docstring's.

    ``attention``: the attention kernel a real run uses (:class:`AttentionKernel`). The
    emulated program computes the same math either way; the memory model and the trace
    read it — fused kernels are traced as one kernel forward and one backward (O(s)
    bytes, the same FLOPs), unfused as the products and the softmax passes over the s²
    scores.

    ``zero_stage`` (0 DDP; 1, 2, 3: ZeRO, :mod:`pipeline_parallel.zero`) is what the
    emulated program runs. ``distributed_optimizer=True`` is an alias of ``zero_stage=1``
    kept for existing callers (it raises a ``zero_stage`` of 0 or None to 1); after
    construction ``distributed_optimizer`` reads ``zero_stage >= 1``.

    ``cp``: context parallelism, the size of the mesh axis ``cp`` (each rank holds 2 of
    the sequence's 2·cp chunks), with ``cp_algorithm`` ring or all_gather.

    ``tp_overlap``: ``backward`` (default) reduces the input gradient of each
    column-parallel linear asynchronously while that linear's weight gradient is computed
    (Megatron-LM's ``--async-tensor-model-parallel-allreduce``; Korthikanti et al. 2022
    §6.2); ``te`` adds Transformer Engine's overlap of the sequence-parallel all-gathers
    and reduce-scatters with the GEMMs they feed or drain, forward and backward
    (:mod:`tensor_parallel.collective_matmul`; it needs ``sequence_parallel`` with tp > 1,
    as Megatron-LM's ``--tp-comm-overlap`` does); ``none`` puts every tensor-parallel
    collective on the critical path.

    ``etp``: expert tensor parallelism, tp (each expert split over tp) or 1 (the expert
    group folded over whole tp groups; rule 4, :meth:`mesh`). ``moe_dispatcher``: how an
    MoE layer's tokens reach their experts, ``alltoall``, ``allgather`` or ``flex``
    (Megatron-Core's ``moe_token_dispatcher_type="flex"``, DeepEP / HybridEP: a token
    crosses once per destination rank, however many of its experts live there)
    (:data:`MOE_DISPATCHERS`).

    ``grad_reduce_dtype``: the dtype of the data-parallel gradient reductions (DDP's
    all-reduces, ZeRO's reduce-scatters, the tied embedding's exchange): ``model`` (the
    gradients' own) or ``fp32`` (each bucket cast up to float32, summed, cast back).

    ``moe_comm_overlap``: run the steady state's forward and backward of two micro-batches
    combined, layer by layer, each one's MoE all-to-alls overlapping the other's compute
    (Megatron-Core's ``--overlap-moe-expert-parallel-comm``; rule 9).

    ``moe_ep_node_ranks``: the flex dispatcher across nodes (DeepEP's internode kernels,
    Megatron-Core's HybridEP across NVLink domains): the expert group's positions
    [0..d-1], [d..2d-1], ... share a node (a scale-up domain); a token crosses the
    network once per destination node, to the rank there with its own local index, which
    forwards it over the node's links (:class:`tensor_parallel.MoE`'s
    ``ep_node_ranks``). None, or d >= ep: the group lies in one node (the one-hop flex);
    else ep must be a multiple of d, and the dispatcher ``flex``.
    :meth:`expert_ranks_per_domain` derives d from the mesh and a domain's size."""

    global_batch: int
    micro_batch: int = 1
    dp: int = 1
    pp: int = 1
    tp: int = 1
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int | None = None
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    recompute_modules: tuple = DEFAULT_RECOMPUTE_MODULES   # selective's modules (rule 10)
    attention: AttentionKernel = AttentionKernel.FLASH
    distributed_optimizer: bool = False
    zero_stage: int | None = None      # None: 1 if distributed_optimizer else 0
    cp: int = 1
    cp_algorithm: CPAlgorithm = CPAlgorithm.RING
    ep: int = 1          # expert parallelism, carved out of dp (ep divides dp; see mesh())
    etp: int | None = None   # expert tensor parallelism: tp (default) or 1 (see mesh())
    moe_dispatcher: str = "alltoall"   # MoE token dispatch: alltoall, allgather or flex
    first_stage_layers: int | None = None   # layers of the first pipeline stage (uneven)
    last_stage_layers: int | None = None    # layers of the last pipeline stage (uneven)
    layers_per_stage: tuple | None = None   # every stage's layers (rule 7; uneven, general)
    tp_overlap: TPOverlap = TPOverlap.BACKWARD
    grad_reduce_dtype: GradReduceDtype = GradReduceDtype.MODEL
    activation_offload: float = 0.0   # share of each stage's layers offloaded (rule 8)
    moe_comm_overlap: bool = False    # combined 1F1B: MoE all-to-alls overlapped (rule 9)
    moe_ep_node_ranks: int | None = None   # flex across nodes: ep ranks per node (None: one)

    def __post_init__(self):
        who = "ParallelConfig"
        for f in ("global_batch", "micro_batch", "dp", "pp", "tp", "cp", "ep") + tuple(
                f for f in ("virtual_stages", "first_stage_layers", "last_stage_layers")
                if getattr(self, f) is not None):
            # an end stage may hold no transformer layer: the embedding (or the head) alone
            low = 0 if f in ("first_stage_layers", "last_stage_layers") else 1
            try:
                as_int(getattr(self, f), f"{who}: {f}", low)
            except (TypeError, ValueError):
                raise ConfigError(f, getattr(self, f), f"an integer >= {low}",
                                  "not a positive integer" if low else
                                  "not a non-negative integer", owner=who) from None
        for f, kind in (("schedule", ScheduleName), ("recompute", Recompute),
                        ("attention", AttentionKernel), ("cp_algorithm", CPAlgorithm),
                        ("tp_overlap", TPOverlap), ("grad_reduce_dtype", GradReduceDtype)):
            object.__setattr__(self, f, parse(kind, getattr(self, f), f, who))
        object.__setattr__(self, "recompute_modules", check_recompute_modules(
            self.recompute_modules, self.recompute, who))
        for f in ("sequence_parallel", "distributed_optimizer", "moe_comm_overlap"):
            if getattr(self, f) not in (False, True):
                raise ConfigError(f, getattr(self, f), "True or False", "not a boolean",
                                  owner=who)
        zero = self.zero_stage
        if self.distributed_optimizer and zero in (None, 0):
            zero = 1
        zero = check_zero_stage(0 if zero is None else zero, self.pp, who)
        object.__setattr__(self, "zero_stage", zero)
        object.__setattr__(self, "distributed_optimizer", zero >= 1)
        if self.cp > 1 and not self.attention.fused:
            raise ConfigError("attention", self.attention, " or ".join(
                repr(v) for v in AttentionKernel.fused_values()) + f" with cp={self.cp}",
                f"cp={self.cp} needs attention='flash' or 'flash-v1' (context-parallel "
                "attention keeps O and the log-sum-exp, never the scores)", owner=who)
        self._check_experts(who)
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ConfigError("moe_dispatcher", self.moe_dispatcher,
                              f"one of {', '.join(MOE_DISPATCHERS)}", "not a token dispatcher",
                              owner=who)
        if self.global_batch % (self.dp * self.micro_batch):
            raise ConfigError("global_batch", self.global_batch,
                              f"a multiple of dp x micro_batch = {self.dp * self.micro_batch}",
                              f"global_batch={self.global_batch} does not split into "
                              f"dp={self.dp} x micro_batch={self.micro_batch}", owner=who)
        if self.tp_overlap is TPOverlap.TE and self.tp > 1 and not self.sequence_parallel:
            raise ConfigError("tp_overlap", self.tp_overlap.value,
                              "'backward' or 'none' without sequence_parallel",
                              f"tp_overlap='te' overlaps the sequence-parallel all-gathers "
                              f"and reduce-scatters with their GEMMs: it needs "
                              f"sequence_parallel=True with tp={self.tp} (Megatron-LM's "
                              f"--tp-comm-overlap needs --sequence-parallel)", owner=who)
        self._check_virtual_stages(who)
        self._check_layers_per_stage(who)
        self._check_activation_offload(who)
        self._check_moe_comm_overlap(who)
        self._check_ep_node_ranks(who)

    def _check_ep_node_ranks(self, who: str) -> None:
        d = self.moe_ep_node_ranks
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ConfigError("moe_ep_node_ranks", d, "None or an integer >= 1",
                              "the expert group's ranks per node", owner=who)
        if self.moe_dispatcher != "flex":
            raise ConfigError("moe_ep_node_ranks", d, f"None with moe_dispatcher="
                              f"{self.moe_dispatcher!r}", "the node-level dispatch (DeepEP's "
                              "internode kernels, HybridEP) is the flex dispatcher's",
                              owner=who)
        if d < self.ep and self.ep % d:
            raise ConfigError("moe_ep_node_ranks", d, f"a divisor of ep={self.ep}, or >= it "
                              "(one node)", f"ep={self.ep} ranks do not split into nodes of "
                              f"{d}", owner=who)

    def expert_ranks_per_domain(self, domain: int) -> int | None:
        """d, the expert group's ranks per scale-up domain when the global ranks 0..N−1
        (:meth:`mesh`'s order) fill domains of ``domain`` consecutive ranks: every expert
        group's positions [0..d-1], [d..2d-1], ... each lie in one domain, different ones
        in different domains; None without expert parallelism. ConfigError (key
        ``moe_ep_node_ranks``) where a group does not split so (a domain holding part
        of a block, or two blocks)."""
        if self.ep == 1:
            return None
        mesh = self.mesh()
        groups = {tuple(mesh.group(self.expert_axes, r)) for r in range(mesh.size)}
        ds = set()
        for g in groups:
            doms = [r // domain for r in g]
            d = doms.count(doms[0])
            blocks = [doms[i:i + d] for i in range(0, len(doms), d)]
            if len(doms) % d or any(len(set(b)) != 1 for b in blocks) or \
                    len({b[0] for b in blocks}) != len(blocks):
                raise ConfigError("moe_ep_node_ranks", None, "an expert group in whole "
                                  "scale-up domains", f"the expert group {g[:8]}... does not "
                                  f"split into domains of {domain} GPUs", owner="ParallelConfig")
            ds.add(d)
        if len(ds) != 1:
            raise ConfigError("moe_ep_node_ranks", None, "the same ranks per domain in every "
                              "expert group", f"groups hold {sorted(ds)} ranks per domain of "
                              f"{domain} GPUs", owner="ParallelConfig")
        return ds.pop()

    def _check_moe_comm_overlap(self, who: str) -> None:
        """Rule 9 (module docstring), as Megatron-Core's ``TransformerConfig`` asserts it."""
        if not self.moe_comm_overlap:
            return

        def refuse(allowed, why):
            raise ConfigError("moe_comm_overlap", True, allowed, why, owner=who)
        if self.ep == 1:
            refuse("False with ep=1", "the MoE overlap hides the expert-parallel all-to-alls: "
                   "it needs expert parallelism, ep > 1 (Megatron-Core: "
                   "'only supported with expert model parallelism')")
        if self.moe_dispatcher not in ("alltoall", "flex"):
            refuse(f"False with moe_dispatcher={self.moe_dispatcher!r}", "Megatron-Core "
                   "overlaps the alltoall and flex token dispatchers' exchanges only")
        if self.recompute in FULL_RECOMPUTE:
            refuse(f"False with recompute={self.recompute.value!r}", "Megatron-Core refuses "
                   "full recomputation with the MoE overlap")
        interleaved = self.schedule is ScheduleName.INTERLEAVED_1F1B and self.chunks > 1
        if not (interleaved or (self.pp == 1 and self.schedule is ScheduleName.ONE_F_ONE_B)):
            refuse(f"False with schedule={self.schedule.value!r} and pp={self.pp}; True with "
                   "schedule '1f1b' and pp=1, or 'interleaved_1f1b' with virtual_stages >= 2",
                   "Megatron-Core runs the combined 1F1B without pipelining or with the "
                   "interleaved schedule only (virtual_pipeline_model_parallel_size must be "
                   "set when pp > 1)")

    def _check_activation_offload(self, who: str) -> None:
        """Rule 8 (module docstring)."""
        f = self.activation_offload
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            raise ConfigError("activation_offload", f, "a fraction in [0, 1)",
                              "the share of each pipeline stage's layers whose activations "
                              "go to host memory; below 1: a stage's last layer is never "
                              "offloaded (its backward follows its forward at once)",
                              owner=who)
        object.__setattr__(self, "activation_offload", float(f))
        if f and self.recompute in FULL_RECOMPUTE:
            raise ConfigError("activation_offload", f, f"0 with recompute="
                              f"'{self.recompute.value}'",
                              "a fully recomputed layer keeps only its input and rebuilds "
                              "the rest in the backward: there is nothing to offload "
                              "(Megatron-Core refuses CPU offloading with recomputation)",
                              owner=who)

    def _check_layers_per_stage(self, who: str) -> None:
        """Rule 7 (module docstring); the counts' sum is checked against the model's
        layers by :meth:`stage_layers`."""
        counts = self.layers_per_stage
        if counts is None:
            return
        if isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
            raise ConfigError("layers_per_stage", counts, f"{self.pp} layer counts (one per "
                              f"pipeline stage, pp={self.pp})", "not a list of counts",
                              owner=who)
        counts = tuple(counts)
        for n in counts:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError("layers_per_stage", counts, f"{self.pp} integers >= 1",
                                  f"{n!r} is not a layer count >= 1 (every stage holds at "
                                  "least one layer)", owner=who)
        object.__setattr__(self, "layers_per_stage", counts)
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            raise ConfigError("layers_per_stage", counts, "none with first_stage_layers or "
                              "last_stage_layers", "layers_per_stage gives every stage's "
                              "count, first_stage_layers / last_stage_layers the ends': give "
                              "one of them", owner=who)
        if self.chunks != 1:
            raise ConfigError("layers_per_stage", counts, f"none with {self.chunks} stages "
                              "per rank (interleaved_1f1b)", "layers_per_stage takes one "
                              "stage per pipeline rank; an interleaved rank's chunks would "
                              "need a count each", owner=who)
        if len(counts) != self.pp:
            raise ConfigError("layers_per_stage", counts, f"{self.pp} counts (pp={self.pp})",
                              f"{len(counts)} counts for {self.pp} pipeline stages",
                              owner=who)

    def _check_experts(self, who: str) -> None:
        """Rule 4's expert-parallel part (etp and ep)."""
        etp = self.tp if self.etp is None else self.etp
        try:
            as_int(etp, f"{who}: etp", 1)
        except (TypeError, ValueError):
            raise ConfigError("etp", etp, f"1 or tp={self.tp}", "not a positive integer",
                              owner=who) from None
        if etp not in (1, self.tp):
            raise ConfigError("etp", etp, f"1 or tp={self.tp}",
                              f"etp={etp}: the experts' hidden dimension is split over the "
                              f"whole tp group (etp = tp = {self.tp}) or not at all (etp = 1, "
                              "the expert group folded over the tp ranks)", owner=who)
        object.__setattr__(self, "etp", etp)
        if self.ep == 1:
            return
        inner = (self.tp if self.folded else 1) * self.cp     # whole groups the ep group takes
        if self.ep % inner or self.dp % (self.ep // inner):
            whole = " x ".join(n for n, on in ((f"tp={self.tp}", self.folded),
                                               (f"cp={self.cp}", self.cp > 1)) if on)
            if not whole:
                raise ConfigError("ep", self.ep, f"a divisor of dp={self.dp}",
                                  f"ep={self.ep} must divide dp={self.dp} (the expert-parallel "
                                  "group is carved out of the data-parallel ranks)", owner=who)
            groups = " and ".join(n for n, on in (("tp (etp=1)", self.folded),
                                                  ("cp", self.cp > 1)) if on)
            raise ConfigError("ep", self.ep, f"{whole} x a divisor of dp={self.dp}",
                              f"the expert-parallel group is made of whole {groups} groups: "
                              f"ep={self.ep} must be {whole} times a divisor of dp={self.dp}",
                              owner=who)
        if not self.folded:
            return
        if not self.sequence_parallel:
            raise ConfigError("sequence_parallel", False, f"True with etp=1 and tp={self.tp}",
                              "with etp=1 each tp rank routes its own sequence slice to "
                              "experts outside its tp group: the tokens must be split over "
                              "tp (Megatron-Core requires sequence parallelism for MoE with "
                              "tp > 1)", owner=who)

    @property
    def folded(self) -> bool:
        """Whether the expert-parallel group is folded over the tp ranks (etp = 1, tp > 1,
        ep > 1): experts whole, spread over ep ranks made of ep/tp whole tp groups."""
        return self.etp == 1 and self.tp > 1 and self.ep > 1

    @property
    def expert_axes(self):
        """The mesh axes of the expert-parallel group: "ep", with "cp" (cp > 1) and "tp"
        (folded) after it — ep consecutive ranks ("ep" alone, absent from the mesh, with
        ep = 1: no group)."""
        if self.ep == 1:
            return "ep"
        axes = ("ep",) + (("cp",) if self.cp > 1 else ()) + (("tp",) if self.folded else ())
        return axes if len(axes) > 1 else "ep"

    @property
    def expert_dp(self) -> int:
        """The expert groups of a pipeline stage and tp slice — the ranks holding the same
        experts, the mesh's "dp" axis with ep > 1: dp·cp·f/ep, f = tp when folded else 1
        (dp/ep without cp or folding; dp·cp with ep = 1, each rank its own group)."""
        return self.dp * self.cp * (self.tp if self.folded else 1) // self.ep

    @property
    def token_split(self) -> int:
        """cp·f, f = tp when folded else 1: the ranks a micro-batch's b·s tokens are routed
        from (each rank routes b·s/(cp·f): its chunks, its sequence slice when folded)."""
        return self.cp * (self.tp if self.folded else 1)

    def stage_layers(self, layers: int) -> tuple[int, ...]:
        """The transformer layers of each of the pp·v pipeline stages, in order: the first
        ``first_stage_layers`` and the last ``last_stage_layers`` when given (Megatron-
        Core's ``decoder_first/last_pipeline_num_layers``: a first stage that also holds
        the embedding, a last that holds the head, or a layer count pp·v does not
        divide — Qwen3-235B's 94, DeepSeek-V3's 61), the others an equal share of the
        rest; ``layers_per_stage`` as given when set (its counts must add up to
        ``layers``); ConfigError naming the field when they do not split."""
        if self.layers_per_stage is not None:
            if sum(self.layers_per_stage) != layers:
                raise ConfigError("layers_per_stage", self.layers_per_stage,
                                  f"{self.pp} counts adding up to the model's {layers} layers",
                                  f"the counts add up to {sum(self.layers_per_stage)} layers, "
                                  f"the model has {layers}", owner="GPT")
            return self.layers_per_stage
        S, a, c = self.pp * self.chunks, self.first_stage_layers, self.last_stage_layers
        ends = [n for n in (a, c) if n is not None]
        if S == 1:
            if ends:
                field = "first_stage_layers" if a is not None else "last_stage_layers"
                raise ConfigError(field, a if a is not None else c, "none with one pipeline "
                                  "stage", "one stage holds every layer", owner="GPT")
            return (layers,)
        rest, n_rest = layers - sum(ends), S - len(ends)
        if any(n < 0 for n in ends) or rest < 0 or (n_rest and rest % n_rest) or \
                (n_rest == 0 and rest):
            if not ends:
                raise ConfigError("layers", layers, f"a multiple of {S} (pp={self.pp} x "
                                  f"{self.chunks} stages per rank), or first_stage_layers / "
                                  f"last_stage_layers", f"the {layers} layers do not split "
                                  f"evenly into {S} stages (pp={self.pp} x {self.chunks})",
                                  owner="GPT")
            field = "first_stage_layers" if a is not None else "last_stage_layers"
            raise ConfigError(field, a if a is not None else c, f"counts that leave the "
                              f"other {n_rest} stages an equal share of the {layers} layers",
                              f"first {a}, last {c}: the remaining {rest} layers do not "
                              f"split evenly into {n_rest} stages", owner="GPT")
        mid = rest // n_rest if n_rest else 0
        out = [mid] * S
        if a is not None:
            out[0] = a
        if c is not None:
            out[-1] = c
        return tuple(out)

    def rank_layers(self, layers: int, r: int) -> int:
        """The transformer layers pipeline rank r holds: its stages r, r + pp, ..."""
        return sum(self.stage_layers(layers)[r::self.pp])

    def _check_virtual_stages(self, who: str) -> None:
        v = self.virtual_stages
        if self.schedule is not ScheduleName.INTERLEAVED_1F1B:
            if v not in (None, 1):
                raise ConfigError("virtual_stages", v, f"1 (or none) with {self.schedule}",
                                  "virtual_stages must be 1 except under interleaved_1f1b",
                                  owner=who)

    def check_microbatches(self) -> None:
        """Rule 6's second half: interleaved_1f1b with v >= 2 needs m a multiple of pp
        (checked where a user's plan enters — the CLI, the scenario loader — since the
        simulator traces shortened steps of its own)."""
        who = "ParallelConfig"
        if self.schedule is not ScheduleName.INTERLEAVED_1F1B:
            return
        m, p = self.microbatches, self.pp
        if self.chunks > 1 and m % p:
            lower, upper = (m // p) * p, (m // p + 1) * p
            near = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(
                "microbatches", m, f"a multiple of pp={p} (e.g. {near}), or another schedule",
                f"interleaved_1f1b with {self.chunks} virtual stages runs micro-batches in "
                f"rounds of pp={p}: global_batch / (dp x micro_batch) = {m} is not a "
                "multiple of pp", owner=who)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def use_async_grad_reduce(self) -> bool:
        """Whether the program overlaps a column-parallel linear's input-gradient
        reduction with its weight gradient (``tp_overlap`` backward): not under the
        zero-bubble schedule, whose weight pass ``W`` runs apart from the input gradient
        ``I`` to fill the pipeline's bubbles."""
        return self.tp_overlap in (TPOverlap.BACKWARD, TPOverlap.TE) and \
            self.schedule is not ScheduleName.ZERO_BUBBLE

    @property
    def use_tp_comm_overlap(self) -> bool:
        """Whether the sequence-parallel gathers and reduce-scatters overlap their GEMMs
        (``tp_overlap`` te: :mod:`tensor_parallel.collective_matmul`)."""
        return self.tp_overlap is TPOverlap.TE and self.sequence_parallel and self.tp > 1

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank v."""
        return self.virtual_stages or (
            2 if self.schedule is ScheduleName.INTERLEAVED_1F1B else 1)

    def mesh(self) -> Mesh:
        """dp x pp x tp; with cp > 1 dp x pp x cp x tp: tp innermost (its collectives
        close every block), cp next to it (the ring's K/V, every layer, stays on the
        node's links when tp·cp fits a node), as Megatron orders tp-cp-dp-pp.

        With ep > 1, (dp/ep, pp, ep, tp) on axes ("dp", "pp", "ep", "tp"): data
        parallelism is the axes (dp, ep) together (``self.dp`` ranks), the axis "dp" alone
        is then the expert-data-parallel group (the ranks holding the same experts) and
        "ep" the expert-parallel group — next to tp, so that an ep·tp group of consecutive
        ranks shares a node when it fits one (its all_to_alls on NVLink). Folded (etp = 1,
        tp > 1) the "ep" axis has size ep/tp and the expert group is the axes ("ep",
        "tp") together (:attr:`expert_axes`): ep consecutive ranks, whole tp groups."""
        if self.ep > 1:
            k = self.ep // self.token_split          # data-parallel replicas in a group
            if self.cp > 1:
                return Mesh((self.dp // k, self.pp, k, self.cp, self.tp),
                            ("dp", "pp", "ep", "cp", "tp"))
            return Mesh((self.dp // k, self.pp, k, self.tp), ("dp", "pp", "ep", "tp"))
        if self.cp > 1:
            return Mesh((self.dp, self.pp, self.cp, self.tp), ("dp", "pp", "cp", "tp"))
        return Mesh((self.dp, self.pp, self.tp), ("dp", "pp", "tp"))

    @property
    def gpus(self) -> int:
        """dp·pp·cp·tp."""
        return self.dp * self.pp * self.cp * self.tp

    def check(self, config, mesh) -> None:
        """Raise if the mesh or a count of the model ``config`` (hidden, heads, kv_heads,
        ffn_hidden, layers, seq, vocab, experts) does not fit (naming both)."""
        k = self.ep // self.token_split if self.ep > 1 else 1
        expect = {"dp": self.dp // k, "ep": k}
        for a in (*mesh.axes, "dp", "pp", "cp", "tp", "ep"):
            if a not in ("dp", "ep", "pp", "cp", "tp"):
                raise ValueError(f"GPT: mesh axes must be among dp, ep, pp, cp, tp; got "
                                 f"{mesh.axes}")
            if mesh.shape.get(a, 1) != expect.get(a, getattr(self, a)):
                raise ValueError(f"GPT: ParallelConfig says {a}={getattr(self, a)}"
                                 + (f" (ep={self.ep})" if a in ("dp", "ep") else "")
                                 + f" but the mesh's {a} axis has size {mesh.shape.get(a, 1)}")
        if self.moe_comm_overlap and not config.experts:
            raise ConfigError("moe_comm_overlap", True, "False for a dense model (experts: 0)",
                              "a dense model has no MoE all-to-alls to overlap", owner="GPT")
        if self.ep > 1 and not config.experts:
            raise ConfigError("ep", self.ep, "1 for a dense model (experts: 0)",
                              f"experts=0 do not split over ep={self.ep} (a dense model needs "
                              "ep=1)", owner="GPT")
        if config.experts % self.ep:
            raise ConfigError("experts", config.experts, f"a multiple of ep={self.ep}",
                              f"experts={config.experts} do not split over ep={self.ep} (each "
                              "ep rank holds experts/ep experts)", owner="GPT")
        self.stage_layers(config.layers)          # raises when they do not split
        if why := recompute_refusal(self.recompute, config):
            raise ConfigError("recompute", self.recompute.value, "none, selective or full "
                              "for this model", why, owner="GPT")
        if why := recompute_modules_refusal(self.recompute_modules, config):
            raise ConfigError("recompute_modules", ",".join(self.recompute_modules),
                              "modules the model has (" + ", ".join(RECOMPUTE_MODULES) + ")",
                              why, owner="GPT")
        if self.cp > 1 and config.seq % (2 * self.cp):
            raise ConfigError("seq", config.seq, f"a multiple of 2 x cp = {2 * self.cp}",
                              f"seq={config.seq} does not split into 2·cp = {2 * self.cp} "
                              f"chunks of equal length (cp={self.cp})", owner="GPT")
        check_kv_heads(config.heads, config.kv_heads, self.tp)
        for field, what, n in (("vocab", "vocab", config.vocab),
                               ("ffn_hidden", "ffn_hidden", config.ffn_hidden)) + (
                (("seq", f"seq{'/cp' if self.cp > 1 else ''} (sequence parallelism)",
                  config.seq // self.cp),) if self.sequence_parallel else ()):
            if n % self.tp:
                value = config.seq if field == "seq" else n
                hint = f"; Megatron-LM pads it to {padded_vocab(n, self.tp)} " \
                    f"(--make-vocab-size-divisible-by {MEGATRON_VOCAB_DIVISOR} x tp): pass " \
                    f"that vocab" if field == "vocab" else ""
                raise ConfigError(field, value, f"a multiple of {self.cp * self.tp} "
                                  f"(cp x tp)" if field == "seq" else f"a multiple of "
                                  f"tp={self.tp}", f"{what}={n} does not split evenly over "
                                  f"tp={self.tp}{hint}", owner="GPT")
