"""KV-cache capacity as vLLM computes it: weights, the profile run's activation peak, and
what is left for 16-token blocks on the most constrained GPU.

vLLM v1 (``gpu_worker.Worker.determine_available_memory``, ``v1/core/kv_cache_utils``)::

    requested  = ceil(total_gpu_memory × gpu_memory_utilization)
    budget     = requested − (weights + activation peak of the profile run + non-torch)
    page_bytes = 2 · block_size · kv_heads_local · head_dim · b_kv      (one layer's block)
               =     block_size · (kv_lora_rank + qk_rope_head_dim) · b_kv   (latent, MLA)
    num_blocks = floor(budget / (page_bytes × layers on the GPU))

with ``kv_heads_local = max(1, kv_heads // tp)`` (vLLM replicates KV heads when tp
exceeds them) and the latent of multi-head latent attention replicated on every tp rank
(one "head" of 576 for DeepSeek-V3). Every pipeline stage computes its own count; the
engine keeps the smallest (``get_kv_cache_configs``), so the stage that binds is the one
whose layers and weights leave the least room (:attr:`KVCapacity.stage`).

Pipeline stages split the layers as vLLM's ``get_pp_indices`` does
(:func:`vllm_stage_layers`): ⌊L/pp⌋ each, the remainder one more each on the stages
before the last, counting backwards.

Weights per GPU (:func:`stage_weights`) are :func:`modeling.counts.rank_params` per layer
(Megatron's split: attention and dense MLPs over tp, norms, routers and latent
down-projections replicated, the word embedding on the first stage and the head on the
last, each vocabulary-parallel), with two adaptations to vLLM:

* experts: ``rank_params`` splits routed experts over ep·tp (expert tensor parallelism =
  tp). vLLM places them either tensor-parallel (``ep = 1``: each expert's width over tp,
  E·P_e/tp per GPU) or whole (``ep = tp``, ``--enable-expert-parallel`` on one replica:
  E/ep experts of P_e each) — the same bytes per GPU when ep divides E, which
  :class:`serving.ServingPlan` requires. ``rank_params`` is called with ep = 1 and the
  experts are counted here as E·P_e/tp in both cases;
* KV heads replicated when tp > kv_heads: each GPU holds one whole KV head's W_k and W_v
  (2·h·d) where ``rank_params`` counts 2·h·kv_heads·d/tp.

Weights are ``params × weight_bytes_per_param``, the routed experts at
``expert_weight_bytes_per_param`` when given (GPT-OSS's MXFP4 experts beside bf16
attention, embedding and head: gpt-oss-120b 60.7 GiB, gpt-oss-20b 12.8 GiB — the model
card's checkpoint sizes, 60.8 and 12.8 GiB): an FP8 checkpoint (1) keeps its
embedding, head and norms in bf16 in vLLM, which this undercounts (DeepSeek-V3: 1.85 B
parameters at 1 byte instead of 2, 0.23 GB per GPU at tp 8).

The profile run's activation peak (:func:`activation_peak_bytes`) is a closed form, not
a measurement. vLLM's ``profile_run`` runs one forward over ``max_num_batched_tokens``
dummy tokens T spread over R = min(max_num_seqs, T) requests (attention skipped: no
metadata), then, on the last stage, the sampler over R rows of logits; torch's peak
allocation less the weights is the activation peak. It imitates PyTorch's caching
allocator as a persistent residual stream plus the largest transient (the form hf-mem's
warm-up estimate uses, alvarobartt/hf-mem#67), b = 2 bytes (bf16) per element::

    forward = T · b · (2h + max over the stage's layers of w)         2h: hidden + residual
      w(attention)        = (q + 2c)/tp_kv + q/tp + h                  qkv out, attn out, o_proj out
      w(latent)           = r_q + n_h·d_qk/tp + (r_kv + d_rope) + n_h·(d_nope + d_v)/tp + n_h·d_v/tp + h
      w(dense MLP)        = m·f/tp + h                                  gated m = 3 (gate_up 2f, act f)
      w(MoE)              = 2E + k·(m·f_e' + h)·min(T, C)/T + h + m·n_s·f_s/tp
                                                                        fp32 router logits, fused_moe's
                                                                        three caches, routed + shared out
    sampler (last stage) = T·h·b + R·V·b + R·V·4·F                     bf16 logits + F fp32 copies
    activation peak      = max(forward, sampler)

with q = heads·d, c = kv_heads·d (tp_kv: KV heads kept per GPU), f_e' = f_e/tp (f_e
whole under ep = tp: fused_moe sizes its caches for every token either way), C =
``VLLM_FUSED_MOE_CHUNK_TOKENS`` (fused_moe's token chunk) and F =
:data:`PROFILE_SAMPLER_FP32_COPIES`. For Llama-3.1-8B at T = 8192, R = 256 this gives 0.92 GB
(0.86 GiB, the sampler's term; the forward's is 0.91 GB); vLLM start-up logs of 7–8 B models report 0.7–1.3 GiB ("PyTorch activation peak
memory takes …"), so the form is the right size, not a fit.

Refusals. A plan whose weights + activations + non-torch memory leave no block raises
:class:`~modeling.errors.ConfigError` (vLLM: "No available memory for the cache blocks"),
as does one whose cache cannot hold one request of ``max_model_len`` tokens when given
(vLLM's ``check_enough_kv_cache_memory``). With ``allow_oom=True`` the capacity comes back
anyway with ``num_blocks = 0`` (and a budget that may be negative): the caller decides.

A model mixing sliding-window and full layers is laid out as vLLM's hybrid KV-cache
manager lays it out (:mod:`serving.kv_groups`): groups of G layers, each with its own
block tables, one pool whose block holds G_stage layers' pages (``hybrid_kv_cache``
False: one group over every layer, ``--disable-hybrid-kv-cache-manager``).

Not modelled: CUDA-graph memory (subtracted only under
``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``), the vocabulary's padding to a multiple of
64 per rank, and multi-token-prediction layers (loaded only for speculative decoding).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from modeling.counts import mlp_params, parameter_count, rank_params
from modeling.errors import ConfigError
from modeling.spec import Attention, LatentAttention, Layer, ModelSpec, MoE

from .kv_groups import KVCacheGroups, kv_cache_groups
from .plan import ServingPlan

__all__ = ["KVCapacity", "StageWeights", "kv_capacity", "stage_weights", "vllm_stage_layers",
           "kv_page_bytes", "kv_heads_per_rank", "activation_peak_bytes", "check_layout",
           "VLLM_NON_TORCH_BYTES", "PROFILE_SAMPLER_FP32_COPIES", "VLLM_FUSED_MOE_CHUNK_TOKENS",
           "ACTIVATION_BYTES"]

#: memory the profile run adds outside torch's allocator (cuBLAS and attention-backend
#: workspaces; NCCL's buffers are allocated before vLLM's baseline snapshot). vLLM's own
#: stand-in where it cannot measure it: ``xpu_worker.xpu_get_mem_info`` "mark it as
#: 128MB"; start-up logs of single-GPU runs print 0.04–0.26 GiB ("non_torch_memory takes")
VLLM_NON_TORCH_BYTES = 128 * 2**20
#: fp32 copies of the R × V logits alive at the sampler's peak in the profile run's dummy
#: sampler pass (top-k/top-p on, PyTorch path: the fp32 logits, the sorted values, the
#: int64 sort indices (two), the sorted softmax and its cumsum) — derived, not measured
PROFILE_SAMPLER_FP32_COPIES = 6
#: ``VLLM_FUSED_MOE_CHUNK_SIZE`` default (vllm/envs.py: 16 * 1024): fused_moe's
#: intermediate caches hold at most this many tokens
VLLM_FUSED_MOE_CHUNK_TOKENS = 16 * 1024
#: bytes per activation element (the model runs in bf16)
ACTIVATION_BYTES = 2
_FP32_BYTES = 4


def vllm_stage_layers(num_layers: int, pp: int) -> tuple[range, ...]:
    """The layers of each of ``pp`` stages as vLLM's ``get_pp_indices`` splits them:
    ⌊L/pp⌋ each, and the L mod pp left over one each on the stages before the last,
    from the second-to-last backwards (the last holds the head; with pp > 2 and at most
    pp − 2 left over, only middle stages grow).

    >>> [len(r) for r in vllm_stage_layers(61, 4)]
    [15, 15, 16, 15]
    """
    for name, value in (("num_layers", num_layers), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "an integer >= 1", "not a count")
    if pp > num_layers:
        raise ConfigError("pp", pp, f"at most the {num_layers} layers",
                          "every stage needs a layer")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:k]) for k in range(pp)]
    return tuple(range(s, s + n) for s, n in zip(starts, sizes))


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int) -> None:
    """Refuse a (tp, pp, ep) that ``spec`` cannot be served with: the rules of
    :meth:`serving.ServingPlan.check` (written once there)."""
    ServingPlan(tp=tp, pp=pp, ep=ep).check(spec)


def kv_heads_per_rank(att: Attention, tp: int) -> int:
    """KV heads one GPU keeps: kv_heads/tp, or one (replicated) when tp exceeds them."""
    return max(1, att.kv_heads // tp)


def kv_page_bytes(layer: Layer, *, tp: int = 1, block_size: int = 16,
                  kv_bytes_per_element: int = 2) -> int:
    """One block of one layer on one GPU (vLLM's ``page_size_bytes``): K and V of
    ``block_size`` tokens, 2·block_size·kv_heads_local·head_dim·b; a latent layer caches
    one latent of r_kv + d_rope per token on every tp rank, block_size·(r_kv + d_rope)·b."""
    att = layer.attention
    if isinstance(att, LatentAttention):
        return block_size * (att.kv_lora_rank + att.qk_rope_head_dim) * kv_bytes_per_element
    return 2 * block_size * kv_heads_per_rank(att, tp) * att.head_dim * kv_bytes_per_element


@dataclass(frozen=True)
class StageWeights:
    """Parameters (counts, not bytes) one GPU of a pipeline stage holds: ``dense`` — every
    weight of its ``layers`` but the routed experts (attention, dense MLPs, shared experts,
    routers, norms); ``experts`` — its routed experts, E·P_e/tp per MoE layer; the word
    ``embedding`` (first stage) and the final norm and ``head`` (last stage)."""

    layers: range
    dense: float
    experts: float
    embedding: float
    head: float

    @property
    def total(self) -> float:
        return self.dense + self.experts + self.embedding + self.head

    def __repr__(self) -> str:
        return (f"StageWeights(layers={self.layers.start}..{self.layers.stop - 1}, "
                f"dense={self.dense / 1e9:.3f}e9, experts={self.experts / 1e9:.3f}e9, "
                f"embedding={self.embedding / 1e9:.3f}e9, head={self.head / 1e9:.3f}e9)")


def _kv_replication(att, hidden: int, tp: int) -> float:
    """Parameters a GPU holds beyond rank_params' count when tp > kv_heads: W_k and W_v
    (and their biases) of kv_heads_local whole heads instead of kv_heads/tp of them."""
    if isinstance(att, LatentAttention) or tp <= att.kv_heads:
        return 0.0
    per_head = 2 * hidden * att.head_dim + (2 * att.head_dim if att.qkv_bias else 0)
    return per_head * (kv_heads_per_rank(att, tp) - att.kv_heads / tp)


def stage_weights(spec: ModelSpec, *, tp: int = 1, pp: int = 1,
                  ep: int = 1) -> tuple[StageWeights, ...]:
    """Parameters on one GPU of each pipeline stage (module docstring: rank_params per
    layer, adapted to vLLM's experts and replicated KV heads)."""
    check_layout(spec, tp, pp, ep)
    h, n = spec.hidden, spec.num_layers
    count = parameter_count(spec)
    embedding = spec.vocab * h / tp + (count.embedding - spec.vocab * h)
    final_norm = count.norms / (2 * n + 1)
    # one "stage" per layer: rank_params' per-layer counts, plus the embedding on the first
    # and the final norm and head on the last (the head even when tied, once pp·chunks > 1)
    per_layer = rank_params(spec, pp=n, tp=tp, ep=1)
    per_layer[0] -= embedding
    per_layer[-1] -= final_norm + (0 if spec.tie_embeddings and n == 1 else spec.vocab * h / tp)
    dense, experts = [], []
    for i, layer in enumerate(spec.layers):
        routed = 0.0
        if isinstance(layer.mlp, MoE):
            routed = layer.mlp.experts * mlp_params(layer.mlp.expert, h) / tp
        dense.append(per_layer[i] - routed + _kv_replication(layer.attention, h, tp))
        experts.append(routed)
    head = final_norm + (0 if spec.tie_embeddings and pp == 1 else spec.vocab * h / tp)
    out = []
    for k, layers in enumerate(vllm_stage_layers(n, pp)):
        out.append(StageWeights(layers, sum(dense[i] for i in layers),
                                sum(experts[i] for i in layers),
                                embedding if k == 0 else 0.0, head if k == pp - 1 else 0.0))
    return tuple(out)


def _layer_transient(layer: Layer, hidden: int, tp: int, ep: int, tokens: int) -> float:
    """w of one layer (module docstring): its largest transient, elements per token."""
    h, att, mlp = hidden, layer.attention, layer.mlp
    if isinstance(att, LatentAttention):
        heads = att.heads / tp
        w_att = ((att.q_lora_rank or 0) + heads * att.qk_head_dim
                 + att.kv_lora_rank + att.qk_rope_head_dim
                 + heads * (att.qk_nope_head_dim + att.v_head_dim) + heads * att.v_head_dim + h)
    else:
        q = att.q_width / tp
        w_att = q + 2 * kv_heads_per_rank(att, tp) * att.head_dim + q + h
    if isinstance(mlp, MoE):
        m = mlp.expert.kind.matrices
        chunk = min(tokens, VLLM_FUSED_MOE_CHUNK_TOKENS) / tokens
        width = mlp.expert.width / (1 if ep > 1 else tp)     # whole experts under ep
        w_mlp = (2 * mlp.experts + mlp.top_k * (m * width + h) * chunk + h
                 + m * mlp.shared_experts * (mlp.shared_width or 0) / tp)
    else:
        w_mlp = mlp.kind.matrices * mlp.width / tp + h
    return max(w_att, w_mlp)


def activation_peak_bytes(spec: ModelSpec, layers: range, *, tp: int = 1, ep: int = 1,
                          max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                          last_stage: bool = True) -> int:
    """The profile run's activation peak on one GPU of the stage holding ``layers``
    (module docstring's closed form; the sampler's term only on the ``last_stage``)."""
    t, h, b = max_num_batched_tokens, spec.hidden, ACTIVATION_BYTES
    widest = max(_layer_transient(layer, h, tp, ep, t)
                 for layer in Counter(spec.layers[i] for i in layers))
    forward = t * b * (2 * h + widest)
    if not last_stage:
        return math.ceil(forward)
    rows = min(max_num_seqs, t)
    sampler = t * h * b + rows * spec.vocab * (b + _FP32_BYTES * PROFILE_SAMPLER_FP32_COPIES)
    return math.ceil(max(forward, sampler))


@dataclass(frozen=True)
class KVCapacity:
    """What vLLM's start-up finds on the GPU that binds (``stage``: its pipeline stage):
    ``requested_bytes`` = ceil(memory × utilization), minus ``weights_bytes``,
    ``activation_peak_bytes`` and ``non_torch_bytes``, is the ``budget_bytes`` for the KV
    cache; ``bytes_per_block`` is one block over the stage's layers; ``num_blocks`` of
    ``block_size`` tokens (the smallest count over the stages, as the engine keeps)."""

    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    budget_bytes: int
    bytes_per_block: int
    num_blocks: int
    block_size: int
    stage: int = 0
    groups: KVCacheGroups | None = None
    max_num_batched_tokens: int = 8192

    @property
    def max_tokens(self) -> int:
        """Tokens the cache holds (vLLM's "GPU KV cache size"): num_blocks × block_size,
        or with the hybrid manager's groups ⌊num_blocks / groups⌋ × block_size."""
        groups = 1 if self.groups is None else len(self.groups.windows)
        return self.num_blocks // groups * self.block_size

    def blocks_for_request(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once
        (:meth:`serving.kv_groups.KVCacheGroups.blocks_for_request`; one group: ⌈T/B⌉)."""
        if self.groups is None:
            return -(-num_tokens // self.block_size)
        return self.groups.blocks_for_request(num_tokens, self.block_size,
                                              self.max_num_batched_tokens)

    def holds_request(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits beside the null block."""
        return self.num_blocks >= 2 and self.blocks_for_request(num_tokens) <= \
            self.num_blocks - 1

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the blocks take on the binding GPU."""
        return self.num_blocks * self.bytes_per_block

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    def max_concurrency(self, max_model_len: int) -> float:
        """Requests of ``max_model_len`` tokens the cache holds at once (vLLM's "Maximum
        concurrency for N tokens per request"): num_blocks / the blocks one such request
        holds (ceil(N / block_size) with one group)."""
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
                or max_model_len < 1:
            raise ConfigError("max_model_len", max_model_len, "an integer >= 1",
                              "not a request length")
        return self.num_blocks / self.blocks_for_request(max_model_len)

    def __str__(self) -> str:
        gib = 2 ** 30
        return (f"{self.num_blocks} blocks of {self.block_size} tokens ({self.max_tokens} "
                f"tokens, {self.kv_cache_bytes / gib:.2f} GiB) = ({self.requested_bytes / gib:.2f}"
                f" requested - {self.weights_bytes / gib:.2f} weights - "
                f"{self.activation_peak_bytes / gib:.2f} activations - "
                f"{self.non_torch_bytes / gib:.2f} non-torch GiB) / "
                f"{self.bytes_per_block} B per block (stage {self.stage})")


def _positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"an integer >= {minimum}", "not a valid count")
    return value


def _positive_number(name, value, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, value, "a number >= 0" if allow_zero else "a number > 0",
                          "not a size")
    return value


def kv_capacity(spec: ModelSpec, *, tp: int = 1, pp: int = 1, ep: int = 1,
                gpu_memory_bytes: int, gpu_memory_utilization: float = 0.9,
                block_size: int = 16, weight_bytes_per_param: float = 2,
                expert_weight_bytes_per_param: float | None = None,
                kv_bytes_per_element: int = 2, max_num_batched_tokens: int = 8192,
                max_num_seqs: int = 256, non_torch_bytes: int = VLLM_NON_TORCH_BYTES,
                max_model_len: int | None = None, allow_oom: bool = False,
                hybrid_kv_cache: bool = True) -> KVCapacity:
    """vLLM v1's KV-cache blocks for ``spec`` on GPUs of ``gpu_memory_bytes`` each (module
    docstring). ``gpu_memory_bytes`` is what torch reports as the device's total
    (``torch.cuda.mem_get_info()[1]``, what vLLM multiplies): on 80 GB GPUs vLLM's start-up
    logs print "total_gpu_memory (79.15GiB)" to "(79.33GiB)", about 85.0e9 B — not the
    datasheet's 80e9 (``DeviceSpec.hbm_bytes``); pass what the GPU reports.

    A model mixing sliding-window and full layers is laid out in the hybrid manager's
    groups (:mod:`serving.kv_groups`): a block holds the pages of G_stage layers, the most
    of one group on the stage; ``hybrid_kv_cache`` False is
    ``--disable-hybrid-kv-cache-manager`` (one group: a block over every layer).

    Raises ConfigError when no block fits (or, given ``max_model_len``, fewer than one
    request of it), unless ``allow_oom``: then ``num_blocks`` is 0."""
    check_layout(spec, tp, pp, ep)
    _positive_int("gpu_memory_bytes", gpu_memory_bytes)
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise ConfigError("gpu_memory_utilization", u, "a fraction in (0, 1]",
                          "the share of each GPU's memory the engine may use")
    for name in ("block_size", "kv_bytes_per_element", "max_num_batched_tokens",
                 "max_num_seqs"):
        _positive_int(name, locals()[name])
    _positive_number("weight_bytes_per_param", weight_bytes_per_param)
    b_e = weight_bytes_per_param if expert_weight_bytes_per_param is None else \
        _positive_number("expert_weight_bytes_per_param", expert_weight_bytes_per_param)
    _positive_number("non_torch_bytes", non_torch_bytes, allow_zero=True)
    if max_model_len is not None:
        _positive_int("max_model_len", max_model_len)
    requested = math.ceil(gpu_memory_bytes * u)
    groups = kv_cache_groups(spec, hybrid=hybrid_kv_cache)
    best = None
    for k, stage in enumerate(stage_weights(spec, tp=tp, pp=pp, ep=ep)):
        weights = math.ceil((stage.total - stage.experts) * weight_bytes_per_param
                            + stage.experts * b_e)
        act = activation_peak_bytes(spec, stage.layers, tp=tp, ep=ep,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=max_num_seqs, last_stage=k == pp - 1)
        budget = requested - weights - act - int(non_torch_bytes)
        pages = [kv_page_bytes(spec.layers[i], tp=tp, block_size=block_size,
                               kv_bytes_per_element=kv_bytes_per_element)
                 for i in stage.layers]
        per_block = pages[0] * groups.stage_group_size(stage.layers) if groups.hybrid \
            else sum(pages)
        blocks = max(0, budget // per_block)
        cap = KVCapacity(requested, weights, act, int(non_torch_bytes), budget, per_block,
                         blocks, block_size, k, None if groups.windows == (None,) else groups,
                         max_num_batched_tokens)
        if best is None or (cap.num_blocks, cap.budget_bytes) < (best.num_blocks,
                                                                 best.budget_bytes):
            best = cap
    if not allow_oom:
        _refuse(spec, best, max_model_len, tp, pp, u)
    return best


def _refuse(spec, cap: KVCapacity, max_model_len, tp, pp, u) -> None:
    gb = 1e9
    where = f"{spec.name} at tp={tp} pp={pp} (stage {cap.stage})"
    if cap.num_blocks == 0:
        raise ConfigError(
            "gpu_memory_utilization", u, "a larger share, more GPUs (tp, pp), smaller "
            "weights or a smaller max_num_batched_tokens — or allow_oom to get the capacity "
            "anyway", f"no KV block fits on {where}: {cap.requested_bytes / gb:.2f} GB "
            f"requested - {cap.weights_bytes / gb:.2f} GB weights - "
            f"{cap.activation_peak_bytes / gb:.2f} GB activations - "
            f"{cap.non_torch_bytes / gb:.2f} GB non-torch = {cap.budget_bytes / gb:.2f} GB "
            f"for blocks of {cap.bytes_per_block} B")
    if max_model_len is not None and cap.blocks_for_request(max_model_len) > cap.num_blocks:
        raise ConfigError(
            "max_model_len", max_model_len, f"at most the {cap.max_tokens} tokens the cache "
            "holds", f"one request of max_model_len tokens does not fit the KV cache on "
            f"{where} ({cap.num_blocks} blocks of {cap.block_size}; it needs "
            f"{cap.blocks_for_request(max_model_len)})")

