"""``GPT``: a decoder-only transformer trained with data x pipeline x tensor parallelism.

>>> gpt = GPT(GPTConfig(hidden=16, layers=4, heads=4, seq=8, vocab=32), seed=0)
>>> par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, pp=2, tp=2, schedule="1f1b")
>>> run = gpt.fit(cluster, tokens, targets, steps=2, parallel=par, lr=0.1)  # doctest: +SKIP
>>> ref = gpt.fit_reference(tokens, targets, steps=2, lr=0.1)              # doctest: +SKIP

Model (B batch, s sequence, h hidden, a heads, l layers, V vocabulary): embedding E (V, h)
+ positions P (s, h); l pre-LN layers (causal attention, MLP 4h with gelu; see
:mod:`tensor_parallel.transformer`); final LN; logits = x W_out, W_out (h, V) untied from
E; loss = mean over the B·s tokens of -log softmax(logits)[target].

Parallelism over the mesh axes ``dp``, ``pp``, ``tp`` (absent = 1): stage 0 holds E and
the first l/(p·v) layers, the last stage the last layers and the head; stage k runs on
pipeline rank k mod p under any :mod:`pipelining` schedule (executor:
:func:`~pipeline_parallel.executor.train_program`, which also all-reduces gradients over
dp). E, W_out and the cross-entropy are vocabulary-parallel over tp (no rank gathers the
logits); the layers are Megatron TP, optionally with sequence parallelism.

FLOPs (products only, elementwise work declared with 0): per layer forward 24·b·s·h² +
4·b·s²·h, logits 2·b·s·h·V, each backward twice its forward: :func:`megatron_model_flops`
per iteration; full recomputation adds every layer's forward (not the logits'):
:func:`megatron_flops_with_recompute`; selective adds the core attention's 4·B·s²·h·l.

``GPTConfig(arch="llama")`` trains a Llama instead (RMSNorm, RoPE, grouped-query
attention with ``kv_heads``, SwiGLU MLP ``ffn_hidden`` wide, no biases but optionally
the attention's (``qkv_bias``, ``out_bias``), no learned positions; per device
:mod:`tensor_parallel.llama`, reference :mod:`pipeline_parallel.llama`) under the same
parallelism, executor and schedules; its FLOPs, causal attention counted at half of s²:
:func:`llama_model_flops`.

Context parallelism (``ParallelConfig(cp=N, cp_algorithm="ring" | "all_gather")``, mesh
axis ``cp``; GPUs = dp·pp·cp·tp): every micro-batch's sequence is cut into 2·cp chunks
and cp rank r holds chunks r and 2cp−1−r of the tokens and targets
(:func:`~tensor_parallel.context_parallel.split_sequence`, Megatron's load balancing).
Every per-token op (embedding, norms, MLP, head, cross-entropy) works on the local rows;
attention is :class:`~tensor_parallel.context_parallel.ContextParallelAttention` over cp
(K/V around the ring, or all-gathered), on the tp rank's heads; the learned positions
(GPT) and RoPE (Llama) use the rows' global positions. The loss is the sum over the cp
ranks of their rows' share of the mean over B·s tokens, and the executor all-reduces the
gradients over dp × cp in one bucketed all-reduce per bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from modeling import (BLOCKS, LLAMA_BLOCK, AttentionKernel, Block, ConfigError,
                      LatentAttention, FlopConvention, GradReduceDtype, MLPKind, ModelSpec,
                      ParallelConfig, Positions, TPOverlap, block_named, block_of,
                      load_model)
from modeling import MoE as MoESpec
from modeling import RouterScore
from modeling.counts import causal_square
from modeling.plan import parse
from pipelining import make_schedule
from sharding import shard_slices
from tensor_parallel.attention import TransformerOps
from tensor_parallel.context_parallel import (ContextParallelAttention,
                                              sequence_positions, split_sequence, join_sequence)
from tensor_parallel.llama import is_kv_param, kv_pieces, llama_piece, llama_split_dim, \
    llama_stage
from tensor_parallel.moe import MoE
from tensor_parallel.moe_layer import (EXPERT_BIAS_PARAMS, EXPERT_PARAMS, MOE_PARAMS,
                                       MOE_TP_DIM, is_expert_param, is_moe_param,
                                       llama_moe_stage, moe_piece)
from tensor_parallel.moe_load import ExpertLoad
from tensor_parallel.transformer import (TransformerLayer, TransformerStage,
                                         param_layout, split_dim)
from vcluster.runtime.tracing import MetaArray, is_meta

from .executor import TrainJob, train_program
from .functional import activation, activation_grad, loss_and_grad
from .llama import llama_param_shapes, llama_reference, moe_calls_reference
from .optim import Optimizer, OptimizerConfig
from .zero import unshard_results
from mesh.arguments import as_int

__all__ = ["GPT", "GPTConfig", "ParallelConfig", "GPTFitResult", "forward_program",
           "megatron_model_flops", "megatron_flops_with_recompute", "llama_model_flops",
           "llama_ffn_hidden", "model_flops", "moe_model_flops", "moe_groups", "moe_call_blocks",
           "ATTENTION", "ARCHS",
           "TP_OVERLAP", "GRAD_REDUCE_DTYPES", "FUSED_ATTENTION"]

#: the closed choices of ParallelConfig, as text (the enums of :mod:`modeling.choices`)
ATTENTION = AttentionKernel.values()
FUSED_ATTENTION = AttentionKernel.fused_values()
TP_OVERLAP = TPOverlap.values()
GRAD_REDUCE_DTYPES = GradReduceDtype.values()

_LAYER = TransformerLayer.names


def megatron_model_flops(B: int, s: int, l: int, h: int, V: int) -> int:
    """72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) = 72·B·s·l·h² + 12·B·s²·l·h + 6·B·s·h·V."""
    return 72 * B * s * l * h * h + 12 * B * s * s * l * h + 6 * B * s * h * V


def megatron_flops_with_recompute(B: int, s: int, l: int, h: int, V: int) -> int:
    """96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) = 96·B·s·l·h² + 16·B·s²·l·h + 6·B·s·h·V."""
    return 96 * B * s * l * h * h + 16 * B * s * s * l * h + 6 * B * s * h * V


#: the architectures GPTConfig.arch names (:data:`modeling.BLOCKS`): GPT-2 (LayerNorm,
#: learned positions, gelu MLP 4h, biases) and Llama (RMSNorm, RoPE, grouped-query
#: attention, SwiGLU, no biases)
ARCHS = tuple(BLOCKS)


#: GPTConfig's fields of multi-head latent attention (MLA; on when kv_lora_rank is set)
LATENT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")


def _settable(block: Block, field: str) -> bool:
    """Whether a config of ``block`` takes its own ``field``: kv_heads, head_dim, qk_norm,
    the sliding window (window, window_layers), attention_sinks and the attention's biases
    (qkv_bias, out_bias) under grouped-query attention (:mod:`tensor_parallel.gqa`), and
    multi-head latent attention's fields (:data:`LATENT_FIELDS`, :mod:`tensor_parallel.mla`)
    in the same block, ffn_hidden with a gated MLP (a plain one is 4h)."""
    if field in ("kv_heads", "head_dim", "qk_norm", "window", "window_layers",
                 "attention_sinks", "qkv_bias", "out_bias") + LATENT_FIELDS:
        return block.grouped_query
    return block.mlp.matrices == 3


def llama_ffn_hidden(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: int(2·4h/3) rounded up to a multiple of ``multiple_of``
    (h 4096 -> 11008)."""
    return multiple_of * -(-int(2 * 4 * hidden / 3) // multiple_of)


def _attention_terms(h: int, heads: int, kv_heads: int, d: int,
                     latent: LatentAttention | None) -> tuple[int, int]:
    """(the attention's weights that enter products, the causal core's width per query
    a·(d_qk + d_v)): GQA h·(h_q + 2·c·d) + h_q·h and 2·h_q; MLA (``latent``)
    h·r_q + r_q·a·d_qk (or h·a·d_qk) + h·(r_kv + d_r) + r_kv·a·(d_n + d_v) + a·d_v·h and
    a·(d_n + d_r + d_v)."""
    if latent is None:
        hq = heads * d
        return h * (hq + 2 * kv_heads * d) + hq * h, 2 * hq
    a, r_q, r_kv = latent.heads, latent.q_lora_rank, latent.kv_lora_rank
    d_qk, d_v = latent.qk_head_dim, latent.v_head_dim
    q = h * r_q + r_q * a * d_qk if r_q else h * a * d_qk
    kv = h * (r_kv + latent.qk_rope_head_dim) + r_kv * a * (latent.qk_nope_head_dim + d_v)
    return q + kv + a * d_v * h, a * (d_qk + d_v)


def _core_square(s: int, l: int, window: int | None, window_layers: int | None) -> int:
    """Σ over the l layers of the causal core's s² (:func:`modeling.counts.causal_square`):
    2·m·s − m² (m = min(s, w)) on the ``window_layers`` layers with the window (None:
    all l), s² on the others."""
    n = l if window_layers is None else window_layers
    if window is None or not n:
        return l * s * s
    return (l - n) * s * s + n * causal_square(s, window)


def llama_model_flops(B: int, s: int, l: int, h: int, V: int, heads: int, kv_heads: int,
                      ffn_hidden: int, head_dim: int | None = None,
                      latent: LatentAttention | None = None, window: int | None = None,
                      window_layers: int | None = None) -> int:
    """6·N·B·s + 6·B·s²·l·h_q: a Llama step's FLOPs (forward + backward = 3x forward),
    products only, causal attention at half the full s² count (FlashAttention's). N =
    l·(h·(h_q + 2·c·d) + h_q·h + 3·h·f) + h·V, the parameters that enter a product (not
    the embedding: a lookup), d = ``head_dim`` (default h/heads), h_q = heads·d, c =
    kv_heads, f = ffn_hidden; GQA shrinks N, not the attention term. QK-norm adds no
    product (its norms are elementwise, 0 FLOPs as every norm here). ``latent``: the
    layers' multi-head latent attention (a :class:`~modeling.spec.LatentAttention`):
    its projections (:func:`_attention_terms`) enter N and the core term is
    3·B·s²·l·a·(d_qk + d_v) (6·B·s²·l·h_q when d_v = d_qk = d). A sliding ``window`` w
    on ``window_layers`` of the l layers (a count; None: all) replaces their s² by
    2·m·s − m², m = min(s, w) (Σ_i min(i+1, w) pairs per head, the diagonal at half:
    :func:`modeling.counts.causal_square`); attention sinks add no product."""
    d = head_dim or h // heads
    attention, core = _attention_terms(h, heads, kv_heads, d, latent)
    n = l * (attention + 3 * h * ffn_hidden) + h * V
    return 6 * n * B * s + 3 * B * _core_square(s, l, window, window_layers) * core


def moe_model_flops(B: int, s: int, l: int, h: int, V: int, heads: int, kv_heads: int,
                    experts: int, top_k: int, moe_ffn_hidden: int,
                    head_dim: int | None = None, shared_ffn_hidden: int = 0,
                    latent: LatentAttention | None = None, dense_layers: int = 0,
                    ffn_hidden: int = 0, window: int | None = None,
                    window_layers: int | None = None) -> int:
    """6·N_active·B·s + 6·B·s²·l·h_q: :func:`llama_model_flops` with each layer's MLP
    3·h·f replaced by the parameters a token uses, the router h·E, its k experts
    k·3·h·f_e and the shared expert 3·h·F_s (N_active: the routed parameters, not all E
    experts) — except ``dense_layers`` of the l layers, whose MLP stays the dense
    3·h·``ffn_hidden``; d = ``head_dim`` (default h/heads); ``latent``, ``window``,
    ``window_layers``: as :func:`llama_model_flops`'s."""
    d = head_dim or h // heads
    attention, core = _attention_terms(h, heads, kv_heads, d, latent)
    mlp = h * experts + top_k * 3 * h * moe_ffn_hidden + 3 * h * shared_ffn_hidden
    n = l * attention + (l - dense_layers) * mlp + dense_layers * 3 * h * ffn_hidden + h * V
    return 6 * n * B * s + 3 * B * _core_square(s, l, window, window_layers) * core


def model_flops(config: "GPTConfig", global_batch: int) -> int:
    """The model FLOPs of one step of ``config`` on ``global_batch`` sequences:
    :func:`megatron_model_flops` (gpt), :func:`llama_model_flops` (llama) or
    :func:`moe_model_flops` (experts > 0, which only a SwiGLU block takes)."""
    c = config
    if c.experts:
        return moe_model_flops(global_batch, c.seq, c.layers, c.hidden, c.vocab,
                                         c.heads, c.kv_heads, c.experts, c.moe_top_k,
                                         c.moe_ffn_hidden, head_dim=c.head_dim,
                                         shared_ffn_hidden=c.moe_shared_ffn_hidden,
                                         latent=c.latent_attention(),
                                         dense_layers=len(c.moe_dense_layers),
                                         ffn_hidden=c.ffn_hidden, window=c.window,
                                         window_layers=c.windowed_layers())
    if c.block.attention_flops is FlopConvention.CAUSAL:
        return llama_model_flops(global_batch, c.seq, c.layers, c.hidden, c.vocab, c.heads,
                                 c.kv_heads, c.ffn_hidden, c.head_dim,
                                 latent=c.latent_attention(), window=c.window,
                                 window_layers=c.windowed_layers())
    return megatron_model_flops(global_batch, c.seq, c.layers, c.hidden, c.vocab)


@dataclass(frozen=True)
class GPTConfig:
    """hidden h, layers l, heads a (h % a == 0 unless head_dim is given), seq s, vocab
    V, dtype, norm eps.

    ``arch``: "gpt" (default; kv_heads = a, ffn_hidden = 4h, head_dim = h/a and no
    qk_norm, the only values it takes) or "llama" (:mod:`tensor_parallel.llama`):
    ``kv_heads`` (a % kv_heads == 0; default a: multi-head attention, 1: multi-query),
    ``ffn_hidden`` (default :func:`llama_ffn_hidden`), RoPE base ``rope_theta``,
    ``head_dim`` d (default h/a; any even d: Qwen3 32 x 128 with h 2560, GPT-OSS 64 x 64
    with h 2880, so W_q is (h, a·d), W_kv (h, 2, c·d), W_o (a·d, h)), ``qk_norm``
    (Qwen3, OLMo 2: an RMSNorm of width d, eps ``eps``, on every query and key head
    before RoPE, with gains q_norm_g, k_norm_g (d,)). After construction kv_heads,
    ffn_hidden and head_dim hold the values used.

    Multi-head latent attention (MLA: DeepSeek-V2/V3, :mod:`tensor_parallel.mla`; Llama
    block only) when ``kv_lora_rank`` r_kv is set: keys and values from one latent of
    rank r_kv (with a ``qk_rope_head_dim`` d_r rotary key shared by the heads), queries
    through a ``q_lora_rank`` r_q bottleneck (None: one h × a·d_qk matrix), each head
    ``qk_nope_head_dim`` d_n + d_r wide for queries and keys and ``v_head_dim`` d_v for
    values. The three head dims are then required (d_r even: RoPE), kv_heads is heads,
    head_dim is d_qk = d_n + d_r (the scores' width and scale) and there is no qk_norm.

    ``tie_embeddings``: the output head multiplies by the word embedding's transpose,
    logits = x E^T, instead of its own W_out (GPT-2, MPT, Gemma; Llama 3.2 1B and 3B), so
    the model has V·h fewer parameters and dE gains the head's x^T dlogits. A stage that
    holds both ends keeps one E; on a pipeline the first and the last stage each keep a
    copy and, after the data-parallel reduction, sum their gradients (Megatron-LM's
    embedding group): the same update keeps the copies equal.

    Sliding-window attention (Llama block; Mistral, GPT-OSS): ``window`` w, each query
    attending to its last w positions, itself included (key j visible to query i iff
    i − w < j ≤ i, Hugging Face's convention), on the layers ``window_layers`` (a tuple
    of indices; None: every layer) — GPT-OSS alternates w = 128 with full layers. Its
    FLOPs, unfused scores and fused kernels follow the window, not the sequence
    (:func:`llama_model_flops`). ``attention_sinks`` (GPT-OSS): every layer's softmax has
    one learned logit per query head in its denominator (parameters ``sinks`` (a,), split
    over tp by heads), whose probability is dropped (:mod:`tensor_parallel.gqa`). Not
    with multi-head latent attention.

    Attention biases (Llama block; Qwen2/Qwen2.5: ``qkv_bias``, GPT-OSS: ``qkv_bias`` and
    ``out_bias``): q = x W_q + b_q, [k | v] = x W_kv + b_kv (before QK-norm and RoPE),
    y = C W_o + b_o, parameters b_q (a·d,), b_kv (2, c·d) split over tp as W_q's and
    W_kv's columns, b_o (h,) whole on every rank (:mod:`tensor_parallel.gqa`). The GPT
    block always has its biases (these fields stay False there). Not with multi-head
    latent attention.

    MoE biases (GPT-OSS; with ``experts``): ``moe_router_bias`` — l = u W_r + b_r,
    parameters b_router (E,) replicated like W_r —; ``moe_expert_bias`` — each routed
    expert O = (silu(X W_g + b_g) * (X W_u + b_u)) W_d + b_d, combined as Σ g·O (b_d
    inside the routing weight), parameters moe_b_gate, moe_b_up (E, f_e) and moe_b_down
    (E, h) split over ep with their experts (:mod:`tensor_parallel.moe`). The shared
    experts have none."""

    hidden: int
    layers: int
    heads: int
    seq: int
    vocab: int
    dtype: str = "float64"
    eps: float = 1e-5
    arch: str = "gpt"
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    head_dim: int | None = None        # d of each attention head (default hidden // heads)
    qk_norm: bool = False              # RMSNorm of each query and key head before RoPE
    kv_lora_rank: int | None = None    # MLA's K/V latent rank r_kv (None: no MLA)
    q_lora_rank: int | None = None     # MLA's query latent rank r_q (None: W_q is h × a·d_qk)
    qk_nope_head_dim: int | None = None   # MLA: each q/k head's part without RoPE, d_n
    qk_rope_head_dim: int | None = None   # MLA: each q/k head's rotary part d_r (shared key)
    v_head_dim: int | None = None      # MLA: each value head's width d_v
    experts: int = 0                   # E > 0: every layer's MLP is a mixture of E experts
    moe_top_k: int = 2                 # experts per token, 1 to E (Switch 1, Mixtral 2, DeepSeek 8)
    moe_ffn_hidden: int | None = None  # each expert's SwiGLU width (default ffn_hidden)
    capacity_factor: float | None = None   # per-expert capacity factor; None: dropless
    moe_aux_coef: float = 0.01         # alpha of the Switch load-balancing loss (0: none)
    moe_router: str = "softmax"        # the router's scores: softmax or sigmoid (DeepSeek-V3)
    moe_normalize_top_k: bool | None = None   # gates / their sum (None: the MoE's default)
    moe_routed_scaling: float = 1.0    # the gates' factor (DeepSeek-V3 2.5)
    moe_shared_ffn_hidden: int = 0     # the always-on shared experts' total width (0: none)
    moe_dense_layers: tuple = ()       # layers whose MLP stays dense (DeepSeek-V3: 0, 1, 2)
    moe_groups: tuple | None = None    # (n_group, topk_group): group-limited routing (V3: 8, 4)
    moe_bias_update_rate: float = 0.0  # aux-loss-free balancing's bias step (V3: 1e-3; 0: none)
    moe_router_bias: bool = False      # the router's bias b_r (E,): l = x W_r + b_r (GPT-OSS)
    moe_expert_bias: bool = False      # the experts' b_gate, b_up (E, f_e), b_down (E, h) (GPT-OSS)
    tie_embeddings: bool = False       # the output head is E^T (no W_out; GPT-2, MPT, Gemma)
    window: int | None = None          # sliding window: a query sees its last `window` keys
    window_layers: tuple | None = None   # the layers with the window (None: every layer)
    attention_sinks: bool = False      # GPT-OSS: a learned logit per head in each softmax
    qkv_bias: bool = False             # Llama block: biases b_q, b_kv (Qwen2, GPT-OSS)
    out_bias: bool = False             # Llama block: the output projection's bias b_o (GPT-OSS)

    def __post_init__(self):
        for f in ("hidden", "layers", "heads", "seq", "vocab"):
            as_int(getattr(self, f), f"GPTConfig: {f}", 1)
        who = "GPTConfig"
        block = block_named(self.arch)
        latent = self._check_latent(block)          # MLA: sets head_dim = d_n + d_r
        head_dim_given = self.head_dim is not None and _settable(block, "head_dim") or latent
        if self.hidden % self.heads and not head_dim_given:
            raise ConfigError("heads", self.heads, f"a divisor of hidden={self.hidden}",
                              f"hidden={self.hidden} is not divisible by heads={self.heads}"
                              " (the default head_dim is hidden/heads)", owner=who)
        if self.tie_embeddings not in (False, True):
            raise ValueError(f"GPTConfig: tie_embeddings must be True or False, got "
                             f"{self.tie_embeddings!r}")
        if np.dtype(self.dtype).kind != "f":
            raise ValueError(f"GPTConfig: dtype must be a float type, got {self.dtype!r}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        gated = block.mlp.matrices == 3
        defaults = {"kv_heads": self.heads,
                    "ffn_hidden": llama_ffn_hidden(self.hidden) if gated else 4 * self.hidden,
                    "head_dim": self.hidden // self.heads}
        for f, default in defaults.items():
            value = default if getattr(self, f) is None else as_int(
                getattr(self, f), f"GPTConfig: {f}", 1)
            if not _settable(block, f) and value != default:
                takes = " or ".join(repr(b.arch) for b in BLOCKS.values() if _settable(b, f))
                raise ConfigError(f, value, f"{default} (or no value) with arch={self.arch!r}",
                                  f"{f}={value} needs arch={takes}; arch={self.arch!r} has "
                                  f"{f}={default}", owner=who)
            object.__setattr__(self, f, value)
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", self.kv_heads, f"a divisor of heads={self.heads}",
                              f"kv_heads={self.kv_heads} must divide heads={self.heads} "
                              "(query heads share key/value heads in equal groups)", owner=who)
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not self.rope_theta > 0:
            raise ValueError(f"GPTConfig: rope_theta must be a number > 0, got "
                             f"{self.rope_theta!r}")
        if self.qk_norm not in (False, True):
            raise ValueError(f"GPTConfig: qk_norm must be True or False, got "
                             f"{self.qk_norm!r}")
        if self.qk_norm and not _settable(block, "qk_norm"):
            takes = " or ".join(repr(b.arch) for b in BLOCKS.values() if _settable(b, "qk_norm"))
            raise ConfigError("qk_norm", True, f"False with arch={self.arch!r}",
                              f"qk_norm=True needs arch={takes}; the {block} block's "
                              "attention has no QK-norm", owner=who)
        object.__setattr__(self, "qk_norm", bool(self.qk_norm))
        self._check_moe()
        self._check_window(block)
        if block.positions is Positions.ROPE and self.head_dim % 2 and not latent:
            field, value, what, allowed = ("head_dim", self.head_dim, "head_dim", "an even "
                                           "head dimension") if head_dim_given else \
                ("heads", self.heads, "hidden/heads", "a count that leaves hidden/heads even")
            raise ConfigError(field, value, allowed,
                              f"arch={self.arch!r} rotates pairs of the head dimension (RoPE): "
                              f"{what} = {self.head_dim} must be even", owner=who)

    def _check_latent(self, block: Block) -> bool:
        """Check multi-head latent attention's fields (the class docstring); True with MLA,
        whose query/key head dimension d_n + d_r then becomes ``head_dim``."""
        who = "GPTConfig"
        if self.kv_lora_rank is None:
            for f in LATENT_FIELDS:
                if getattr(self, f) is not None:
                    raise ConfigError(f, getattr(self, f), "None without kv_lora_rank",
                                      f"{f} is multi-head latent attention's, which "
                                      "kv_lora_rank turns on", owner=who)
            return False
        if not _settable(block, "kv_lora_rank"):
            takes = " or ".join(repr(b.arch) for b in BLOCKS.values()
                                if _settable(b, "kv_lora_rank"))
            raise ConfigError("kv_lora_rank", self.kv_lora_rank, f"None with arch="
                              f"{self.arch!r}", f"multi-head latent attention needs arch="
                              f"{takes}", owner=who)
        for f in LATENT_FIELDS:
            if f == "q_lora_rank" and self.q_lora_rank is None:
                continue
            if getattr(self, f) is None:
                raise ConfigError(f, None, "an integer >= 1", f"multi-head latent "
                                  f"attention (kv_lora_rank={self.kv_lora_rank}) needs {f}",
                                  owner=who)
            object.__setattr__(self, f, as_int(getattr(self, f), f"GPTConfig: {f}", 1))
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim", self.qk_rope_head_dim, "an even width",
                              "RoPE rotates pairs of the rotary head dimension", owner=who)
        d_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        for f, value, rule in (("head_dim", d_qk, "the query/key head width d_n + d_r"),
                               ("kv_heads", self.heads, "heads (one latent serves every "
                                "head; each has its own key and value)"),
                               ("qk_norm", False, "no QK-norm")):
            if getattr(self, f) not in (None, value):
                raise ConfigError(f, getattr(self, f), f"{value!r} (or no value) with "
                                  f"kv_lora_rank", f"multi-head latent attention's {f} is "
                                  f"{rule}", owner=who)
        object.__setattr__(self, "head_dim", d_qk)
        return True

    def _check_window(self, block: Block) -> None:
        """Check sliding-window attention's, attention sinks' and the attention biases'
        fields (the class docstring): grouped-query attention of the Llama block only."""
        who = "GPTConfig"
        for f in ("attention_sinks", "qkv_bias", "out_bias"):
            if getattr(self, f) not in (False, True):
                raise ConfigError(f, getattr(self, f), "True or False", "not a boolean",
                                  owner=who)
            object.__setattr__(self, f, bool(getattr(self, f)))
        for f, value, unset in (("window", self.window, None),
                                ("window_layers", self.window_layers, None),
                                ("attention_sinks", self.attention_sinks, False),
                                ("qkv_bias", self.qkv_bias, False),
                                ("out_bias", self.out_bias, False)):
            if value == unset:
                continue
            bias = f in ("qkv_bias", "out_bias")
            if not _settable(block, f):
                takes = " or ".join(repr(b.arch) for b in BLOCKS.values() if _settable(b, f))
                what = "always has its biases (b_qkv, b_o)" if bias and block.biases else \
                    "has no " + ("optional biases" if bias else "sliding window or sinks")
                raise ConfigError(f, value, f"{unset!r} with arch={self.arch!r}",
                                  f"{f} needs arch={takes}: the {block} block's attention "
                                  f"{what}", owner=who)
            if self.kv_lora_rank is not None:
                raise ConfigError(f, value, f"{unset!r} with kv_lora_rank",
                                  "multi-head latent attention has no sliding-window, "
                                  "sink or bias form here", owner=who)
        if self.window is not None:
            object.__setattr__(self, "window", as_int(self.window, "GPTConfig: window", 1))
        if self.window_layers is None:
            return
        if self.window is None:
            raise ConfigError("window_layers", self.window_layers, "None without window",
                              "the layers a window applies to need a window", owner=who)
        try:
            layers = tuple(sorted({as_int(i, "window_layers", 0) for i in self.window_layers}))
        except (TypeError, ValueError):
            layers = None
        if not layers or layers[-1] >= self.layers:
            raise ConfigError("window_layers", self.window_layers, f"layer indices 0 to "
                              f"{self.layers - 1}, at least one", "the layers whose attention "
                              "has the sliding window (the others see every earlier key)",
                              owner=who)
        object.__setattr__(self, "window_layers", layers)

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (None: every earlier key)."""
        if self.window is None or (self.window_layers is not None
                                   and i not in self.window_layers):
            return None
        return self.window

    def windowed_layers(self) -> int:
        """How many layers have the sliding window."""
        return 0 if self.window is None else (
            self.layers if self.window_layers is None else len(self.window_layers))

    def latent_attention(self) -> LatentAttention | None:
        """The layers' multi-head latent attention as the model layer describes it (None:
        grouped-query attention)."""
        if self.kv_lora_rank is None:
            return None
        return LatentAttention(self.heads, self.q_lora_rank, self.kv_lora_rank,
                               self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)

    def _check_moe(self) -> None:
        as_int(self.experts, "GPTConfig: experts", 0)
        if not self.experts:
            for f, unset in (("moe_ffn_hidden", None), ("capacity_factor", None),
                             ("moe_router", "softmax"), ("moe_normalize_top_k", None),
                             ("moe_routed_scaling", 1.0), ("moe_shared_ffn_hidden", 0),
                             ("moe_dense_layers", ()), ("moe_groups", None),
                             ("moe_bias_update_rate", 0.0), ("moe_router_bias", False),
                             ("moe_expert_bias", False)):
                if getattr(self, f) != unset:
                    raise ConfigError(f, getattr(self, f), f"{unset!r} without experts",
                                      "only a mixture-of-experts model takes it",
                                      owner="GPTConfig")
            return
        if self.block.mlp is not MLPKind.SWIGLU:
            raise ConfigError("experts", self.experts, f"0 with arch={self.arch!r} (experts need "
                              "a SwiGLU block: arch='llama')",
                              f"the program's experts are SwiGLU MLPs, and arch={self.arch!r}'s "
                              f"MLP is {self.block.mlp.value}: its experts would be a model "
                              "that does not exist (1.5x its MLP)", owner="GPTConfig")
        if isinstance(self.moe_top_k, bool) or not isinstance(self.moe_top_k, int) \
                or not 1 <= self.moe_top_k <= self.experts:
            raise ConfigError("moe_top_k", self.moe_top_k, f"an integer from 1 to experts="
                              f"{self.experts}", f"moe_top_k must be 1 to experts="
                              f"{self.experts} (a token uses each expert at most once), got "
                              f"{self.moe_top_k!r}", owner="GPTConfig")
        object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden if self.moe_ffn_hidden
                           is None else as_int(self.moe_ffn_hidden, "GPTConfig: moe_ffn_hidden", 1))
        object.__setattr__(self, "moe_shared_ffn_hidden", as_int(
            self.moe_shared_ffn_hidden, "GPTConfig: moe_shared_ffn_hidden", 0))
        object.__setattr__(self, "moe_router", parse(RouterScore, self.moe_router,
                                                      "moe_router", "GPTConfig").value)
        if self.moe_normalize_top_k not in (None, False, True):
            raise ConfigError("moe_normalize_top_k", self.moe_normalize_top_k,
                              "True, False or None (the router's default)", "not a boolean",
                              owner="GPTConfig")
        r = self.moe_routed_scaling
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
            raise ConfigError("moe_routed_scaling", r, "a finite number > 0",
                              "not a gate factor", owner="GPTConfig")
        if self.moe_groups is not None:
            object.__setattr__(self, "moe_groups", tuple(self.moe_groups))
        for f in ("moe_router_bias", "moe_expert_bias"):
            if getattr(self, f) not in (False, True):
                raise ConfigError(f, getattr(self, f), "True or False", "not a boolean",
                                  owner="GPTConfig")
            object.__setattr__(self, f, bool(getattr(self, f)))
        g = self.moe_bias_update_rate
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < math.inf:
            raise ConfigError("moe_bias_update_rate", g, "a finite number >= 0 (0: no bias)",
                              "not a bias step", owner="GPTConfig")
        try:
            moe = self.moe()            # capacity_factor, moe_aux_coef, moe_groups: MoE checks
        except ValueError as e:
            if "groups" not in str(e):
                raise
            raise ConfigError("moe_groups", self.moe_groups, "(n_group, topk_group)",
                              str(e).removeprefix("MoE: "), owner="GPTConfig") from None
        object.__setattr__(self, "moe_normalize_top_k", moe.normalize_top_k)
        dense = self.moe_dense_layers
        try:
            dense = tuple(sorted({as_int(i, "moe_dense_layers", 0) for i in dense}))
        except (TypeError, ValueError):
            dense = None
        if dense is None or any(i >= self.layers for i in dense) or \
                len(dense) >= self.layers:
            raise ConfigError("moe_dense_layers", self.moe_dense_layers,
                              f"layer indices 0 to {self.layers - 1}, not every layer",
                              "the layers whose MLP stays dense (the others are the mixture "
                              "of experts)", owner="GPTConfig")
        object.__setattr__(self, "moe_dense_layers", dense)

    def moe(self, dispatcher: str = "alltoall",
            ep_node_ranks: int | None = None) -> "MoE | None":
        """The MoE layer of every layer (None: dense), its tokens moved by ``dispatcher``
        (ParallelConfig.moe_dispatcher), across nodes of ``ep_node_ranks`` expert-group
        ranks (ParallelConfig.moe_ep_node_ranks; flex only)."""
        if not self.experts:
            return None
        return MoE(self.hidden, self.moe_ffn_hidden, self.experts, self.moe_top_k,
                   self.capacity_factor, self.moe_aux_coef, router=self.moe_router,
                   normalize_top_k=self.moe_normalize_top_k,
                   routed_scaling=self.moe_routed_scaling,
                   shared_ffn_hidden=self.moe_shared_ffn_hidden, dispatcher=dispatcher,
                   groups=self.moe_groups, router_bias=self.moe_router_bias,
                   expert_bias=self.moe_expert_bias, ep_node_ranks=ep_node_ranks)

    @property
    def block(self) -> Block:
        """What this config's layers are made of (:mod:`modeling.blocks`): engines ask
        it, never the ``arch`` name."""
        return BLOCKS[self.arch]

    @classmethod
    def of_model(cls, model, seq: int, dtype: str = "float64", timing_only: bool = False,
                 layers: int | None = None, **overrides) -> "GPTConfig":
        """The GPTConfig of a preset or a config.json (:func:`modeling.load_model`),
        cut to ``layers`` (the model's own layer pattern, a proxy) and with GPTConfig
        fields in ``overrides`` replacing the model's — what ``--model`` with shape flags
        and ``workload.model`` with shape keys mean. A head dimension the model ties to
        hidden/heads (Llama's) follows new ``hidden``/``heads``; one of its own (Qwen3-32B's
        128 with 64 heads and h 5120) stays unless ``head_dim`` is given."""
        spec = load_model(model)
        if layers is not None:
            spec = spec.with_layers(layers)
        config = cls.from_spec(spec, seq, dtype, timing_only)
        if not overrides:
            return config
        block = block_named(overrides.get("arch", config.arch))
        follow = {}
        if {"hidden", "heads", "arch"} & set(overrides) and (
                config.head_dim * config.heads == config.hidden
                or not _settable(block, "head_dim")):
            follow["head_dim"] = None
        if config.kv_lora_rank is not None:       # MLA: d_n + d_r and heads, derived
            follow.update(head_dim=None, kv_heads=None)
        return replace(config, **{**follow, **overrides})

    @classmethod
    def from_spec(cls, spec: ModelSpec, seq: int, dtype: str = "float64",
                  timing_only: bool = False) -> "GPTConfig":
        """The GPTConfig of a :class:`~modeling.ModelSpec` trained on sequences of
        ``seq`` tokens, or ConfigError naming the feature of ``spec`` this program cannot
        run (latent attention, QK-norm, a head dimension other than h/heads, sliding
        windows or attention sinks in a GPT block, sliding windows of different widths,
        layers that differ other than MoE layers beside dense ones (``moe_dense_layers``)
        and windowed layers beside full ones (``window_layers``), biases in a Llama
        block's dense MLP or shared experts, gated GELU MLPs, ...). The block's types pick the
        program: LayerNorm +
        learned positions + a GELU MLP with biases is the GPT block, RMSNorm + RoPE + a
        SwiGLU MLP without biases the Llama block (:func:`modeling.block_of`), whose
        attention may have biases on its projections (``qkv_bias``, ``out_bias``: Qwen2,
        GPT-OSS), and its routed experts and router theirs (``moe_expert_bias``,
        ``moe_router_bias``: GPT-OSS). Multi-head
        latent attention (:class:`~modeling.spec.LatentAttention`) passes its ranks and
        head dims (GPTConfig's MLA fields); YaRN's attention scale (``rope_scaling``,
        timing_only) is not modelled.

        ``timing_only``: the config is only traced, simulated and counted, so settings
        that change values but no shape or FLOP are accepted: RoPE scaling, a clamped
        SwiGLU, the routing weights' normalisation and scaling, a sigmoid router."""
        def refuse(feature, value, allowed="a model without it"):
            raise ConfigError("model", spec.name, allowed, f"the GPT program cannot run "
                              f"{feature} ({value}) yet")

        windows = sorted({x.attention.window for x in spec.layers} - {None})
        if len(windows) > 1:
            refuse("sliding windows of different widths", windows, "one window width, "
                   "with full layers beside it or not")
        window = windows[0] if windows else None
        window_layers = tuple(i for i, x in enumerate(spec.layers)
                              if x.attention.window is not None)
        bare = replace(spec, layers=tuple(      # the layers with their windows set apart
            replace(x, attention=replace(x.attention, window=None))
            if x.attention.window is not None else x for x in spec.layers))
        layer, dense_mlp = bare.uniform(), None
        if layer is None:         # dense-first layers among MoE ones: one of each kind
            kinds = {x for x in bare.layers}
            moes = [x for x in kinds if isinstance(x.mlp, MoESpec)]
            denses = [x for x in kinds if not isinstance(x.mlp, MoESpec)]
            if len(moes) != 1 or len(denses) != 1 or \
                    moes[0].attention != denses[0].attention:
                refuse("layers that differ", f"{len(bare.runs())} runs of layers"
                       + ("" if bare.is_moe else " (mixed attention)"),
                       "every layer alike (but for a sliding window), or MoE layers with "
                       "some dense ones")
            layer, dense_mlp = moes[0], denses[0].mlp
        att, mlp = layer.attention, layer.mlp
        expert = mlp.expert if isinstance(mlp, MoESpec) else mlp
        if dense_mlp is not None and (dense_mlp.kind, dense_mlp.bias, dense_mlp.clamp) != \
                (expert.kind, expert.bias, expert.clamp):
            refuse("dense layers whose MLP differs from the experts' in kind", str(dense_mlp),
                   f"{expert.kind} dense layers")
        latent = isinstance(att, LatentAttention)
        attention_bias = not latent and (att.qkv_bias or att.out_bias)
        block = block_of(spec.norm, spec.positions, expert.kind, expert.bias, attention_bias)
        router_bias = isinstance(mlp, MoESpec) and mlp.router_bias
        if block_of(spec.norm, spec.positions, expert.kind, False, False) is LLAMA_BLOCK \
                and (block is None or router_bias):   # a Llama block with biases
            biases = [what for what, on in (
                ("the MLP", not isinstance(mlp, MoESpec) and expert.bias),
                ("the dense layers' MLP", dense_mlp is not None and dense_mlp.bias),
                ("the shared experts", isinstance(mlp, MoESpec) and expert.bias
                 and bool(mlp.shared_experts))) if on]
            if biases:
                refuse(f"biases in {' and '.join(biases)} of a Llama block", True,
                       "a Llama block without biases in its dense MLP or shared experts "
                       "(its attention's q, k, v and output projections, its routed "
                       "experts and its router may have them)")
            block = LLAMA_BLOCK   # biases in the attention, routed experts or router only
        if block is None:
            refuse("this block", f"{spec.norm} norm, {spec.positions} positions, "
                   f"{expert.kind} MLP{' with biases' if expert.bias else ''}",
                   "a GPT block (layernorm, learned positions, gelu with biases) or a "
                   "Llama block (rmsnorm, rope, swiglu, no biases)")
        if latent and not _settable(block, "kv_lora_rank"):
            refuse(f"multi-head latent attention in a {block} block", str(att),
                   "grouped-query attention, or the Llama block")
        if not latent and not _settable(block, "head_dim") \
                and att.heads * att.head_dim != spec.hidden:
            refuse(f"a head dimension independent of the hidden size in a {block} block",
                   f"{att.heads} x {att.head_dim} != {spec.hidden}", "heads x head_dim = "
                   "hidden, or the Llama block")
        if not _settable(block, "qk_norm") and att.qk_norm:
            refuse(f"QK-norm in a {block} block", True, "no QK-norm, or the Llama block")
        if not _settable(block, "window") and window is not None:
            refuse(f"sliding-window attention in a {block} block", window,
                   "no window, or the Llama block")
        if not _settable(block, "attention_sinks") and att.sinks:
            refuse(f"attention sinks in a {block} block", True, "no sinks, or the Llama "
                   "block")
        if not timing_only:
            for feature, value in (("RoPE scaling", spec.rope_scaling),
                                   ("a clamped SwiGLU", expert.clamp)):
                if value is not None:
                    refuse(feature, value, "none when emulated (timing_only=True to "
                           "simulate)")
        moe = {}
        if isinstance(mlp, MoESpec):
            if block is not LLAMA_BLOCK:      # the program's experts are SwiGLU
                refuse(f"{expert.kind} experts", str(mlp), "SwiGLU experts (the Llama block)")
            moe = dict(experts=mlp.experts, moe_top_k=mlp.top_k,
                       moe_ffn_hidden=mlp.expert.width, capacity_factor=mlp.capacity_factor,
                       moe_aux_coef=mlp.aux_loss_coef, moe_router=mlp.router.value,
                       moe_normalize_top_k=mlp.normalize_top_k,
                       moe_routed_scaling=float(mlp.routed_scaling),
                       moe_shared_ffn_hidden=mlp.shared_experts * (mlp.shared_width or 0),
                       moe_dense_layers=spec.dense_layers, moe_groups=mlp.groups,
                       moe_router_bias=mlp.router_bias, moe_expert_bias=expert.bias)
        own = {"kv_heads": att.kv_heads,
               "ffn_hidden": expert.width if dense_mlp is None else dense_mlp.width,
               "head_dim": None if latent else att.head_dim, "qk_norm": att.qk_norm,
               "window": window, "attention_sinks": att.sinks,
               **({"qkv_bias": att.qkv_bias, "out_bias": att.out_bias} if not latent else {}),
               "window_layers": window_layers if 0 < len(window_layers) < spec.num_layers
               else None,
               **({f: getattr(att, f) for f in LATENT_FIELDS} if latent else {})}
        if not _settable(block, "ffn_hidden") and expert.width != 4 * spec.hidden:
            refuse(f"a {block} MLP other than 4h", expert.width, f"{4 * spec.hidden}")
        fields = {f: v for f, v in own.items() if _settable(block, f)}
        if block.positions is Positions.ROPE:
            fields["rope_theta"] = spec.rope_theta
        return cls(hidden=spec.hidden, layers=spec.num_layers, heads=att.heads, seq=seq,
                   vocab=spec.vocab, dtype=dtype, eps=spec.norm_eps, arch=block.arch,
                   tie_embeddings=spec.tie_embeddings, **fields, **moe)


@dataclass(frozen=True)
class GPTFitResult:
    """Per-step losses (MoE: the aux loss included), final parameters and last-step
    gradients by name, memory; MoE: the aux loss per step and the tokens per expert."""

    losses: np.ndarray
    params: dict
    grads: dict
    memory: object = None
    aux_losses: np.ndarray | None = None   # MoE: the aux loss inside ``losses``, per step
    expert_load: list | None = None   # MoE: per step {layer: ExpertLoad} (see GPT.fit)


def _stage(cfg: GPTConfig, par: ParallelConfig, dev, job: TrainJob, stage: int, load=None):
    """The job's ``stage_factory``: this device's :class:`TransformerStage` ([embedding]
    + the stage's layers + [head]) with its pieces of the job's global parameters; under
    ZeRO-2/3, whose gradients leave the rank every micro-batch, its tp-partial gradients
    (the K/V replicas', QK-norm's, sequence parallelism's) summed every micro-batch."""
    built = _build_stage(cfg, par, dev, job, stage, load)
    built.seq_partial_each_microbatch = par.zero_stage >= 2
    return built


def _build_stage(cfg: GPTConfig, par: ParallelConfig, dev, job: TrainJob, stage: int,
                 load=None):
    """:func:`_stage`'s stage before its ZeRO setting."""
    ops, glob = TransformerOps(dev, "tp" if "tp" in dev.mesh.axes else None,
                               par.sequence_parallel, flash=par.attention in FUSED_ATTENTION,
                               async_grad_reduce=par.use_async_grad_reduce,
                               tp_comm_overlap=par.use_tp_comm_overlap), \
        dict(job.params)
    cp = positions = None
    if "cp" in dev.mesh.axes and dev.mesh.axis_size("cp") > 1:
        n, kv = dev.mesh.axis_size("cp"), max(cfg.kv_heads // ops.tp_size, 1)
        group = cfg.heads // ops.tp_size // kv if cfg.block.grouped_query else 1
        cp = ContextParallelAttention(cfg.heads // ops.tp_size, cfg.head_dim,
                                      par.cp_algorithm, "cp", group=group,
                                      label="gpt: attention: cp", flash=ops.flash,
                                      v_head_dim=cfg.v_head_dim)
        positions = sequence_positions(cfg.seq, n, dev.mesh.group_position("cp", dev.rank))

    def local(names, prefix=""):
        arrays = {n: glob[prefix + n] for n in names}
        if cfg.experts:
            coords = _expert_coords(dev.mesh, par, dev.rank)
            return {n: moe_piece(n, a, *coords) if is_moe_param(n)
                    else llama_piece(
                n, a, ops.tp_size, ops.tp_rank, cfg.kv_heads) if cfg.block is LLAMA_BLOCK else
                a[shard_slices(a.shape, param_layout(n, a.ndim, ops.tp_axis), dev.mesh,
                               dev.rank)] for n, a in arrays.items()}
        if cfg.block is LLAMA_BLOCK:
            return {n: llama_piece(n, a, ops.tp_size, ops.tp_rank, cfg.kv_heads)
                    for n, a in arrays.items()}
        return arrays if ops.tp_axis is None else {n: a[shard_slices(
            a.shape, param_layout(n, a.ndim), dev.mesh, dev.rank)] for n, a in arrays.items()}

    if cfg.experts:
        return llama_moe_stage(ops, local, job.specs[stage], stage == 0,
                               stage == job.n_stages - 1, cfg.heads, cfg.kv_heads, cfg.hidden,
                               cfg.rope_theta, par.recompute, cfg.eps, job.microbatches,
                               cfg.seq, cfg.moe(par.moe_dispatcher, par.moe_ep_node_ranks),
                               1 / (par.expert_dp * job.microbatches),
                               load, kv_sum_every=1 if par.zero_stage >= 2 else None,
                               tie=cfg.tie_embeddings,
                               ep_axes=par.expert_axes, folded=par.folded,
                               head_dim=cfg.head_dim, qk_norm=cfg.qk_norm,
                               latent=cfg.latent_attention(), cp=cp, positions=positions,
                               dense_layers=cfg.moe_dense_layers,
                               bias_rate=cfg.moe_bias_update_rate, window=cfg.window,
                               window_layers=cfg.window_layers, sinks=cfg.attention_sinks,
                               qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
                               recompute_modules=par.recompute_modules)
    if cfg.block is LLAMA_BLOCK:
        return llama_stage(ops, local, job.specs[stage], stage == 0, stage == job.n_stages - 1,
                           cfg.heads, cfg.kv_heads, cfg.hidden, cfg.rope_theta, par.recompute,
                           cfg.eps, job.microbatches, cfg.seq, cp, positions,
                           kv_sum_every=1 if par.zero_stage >= 2 else None,
                           tie=cfg.tie_embeddings, head_dim=cfg.head_dim,
                           qk_norm=cfg.qk_norm, latent=cfg.latent_attention(),
                           window=cfg.window, window_layers=cfg.window_layers,
                           sinks=cfg.attention_sinks, qkv_bias=cfg.qkv_bias,
                           out_bias=cfg.out_bias, recompute_modules=par.recompute_modules)
    return TransformerStage.gpt(ops, local, job.specs[stage], stage == 0,
                                stage == job.n_stages - 1, cfg.heads, cfg.hidden,
                                par.recompute, cfg.eps, job.microbatches, cfg.seq, cp,
                                positions, tie=cfg.tie_embeddings,
                                recompute_modules=par.recompute_modules)


def _ps_stage(cfg: GPTConfig, names: tuple, dev, job):
    """A parameter server's worker stage (``ParameterServerJob.worker_stage``): the whole
    model on this device, its B/W sequences one micro-batch (a dp = W replica's stage),
    its tensors ``job.tensors`` (named ``names``, the stage's own order)."""
    B = job.global_batch
    parallel = ParallelConfig(B, micro_batch=B // job.workers, dp=job.workers)
    train = TrainJob(params=tuple(zip(names, job.tensors)),
                     specs=(tuple(range(cfg.layers)),), actions=((),), loss="cross_entropy",
                     optimizer=job.optimizer, steps=job.steps, microbatches=1,
                     global_batch=job.global_batch)
    stage = _stage(cfg, parallel, dev, train, 0)
    assert tuple(stage.named_params()) == names, "the worker's tensors in the job's order"
    return stage


def forward_program(dev, job: TrainJob, X, Y):
    """Forward only, stage after stage: the last stage's {loss, logits per micro-batch};
    an MoE model's ranks add {aux}: their stages' weighted aux losses."""
    pp = dev.mesh.group(job.pp_axis, dev.rank) if job.pp_axis in dev.mesh.axes else (dev.rank,)
    (p, pos), S, m = (len(pp), pp.index(dev.rank)), job.n_stages, job.microbatches
    rows, loss, logits = job.global_batch // (dev.mesh.axis_size(job.dp_axis or ()) * m), 0.0, []
    aux = 0.0
    for s in range(pos, S, p):
        stage = job.stage_factory(dev, job, s)
        for j in range(m):
            x = X[j * rows:(j + 1) * rows] if s == 0 else dev.recv(pp[(s - 1) % p], s * m + j)
            out = stage.forward(dev, j, x)
            if s < S - 1:
                dev.send(out, pp[(s + 1) % p], (s + 1) * m + j)
            else:
                loss += stage.loss_and_grad(dev, j, out, Y[j * rows:(j + 1) * rows],
                                            job.global_batch)[0]
                logits.append(out)
        if hasattr(stage, "moe_report"):
            aux += stage.moe_report()[0]
    return {"loss": loss, "logits": logits, "aux": aux} if logits or aux else None


def _grad_axes(mesh):
    """The group the (non-expert) gradients are reduced (and ZeRO shards) over: every
    data-parallel-like axis present, in the executor's order: dp, ep, cp."""
    axes = tuple(a for a in ("dp", "ep", "cp") if a in mesh.axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _coord(mesh, axis: str, rank: int) -> int:
    return mesh.group_position(axis, rank) if axis in mesh.axes else 0


def _cp_rows(x, mesh, c: int):
    """cp rank ``c``'s chunks of every sequence of ``x`` (rows, s) (shape-only: its shape)."""
    cp = mesh.shape.get("cp", 1)
    if cp == 1:
        return x
    if is_meta(x):
        return MetaArray((x.shape[0], x.shape[1] // cp), x.dtype)
    return split_sequence(x, cp)[c]


def _dp_axes(mesh):
    """The data-parallel axes of ``mesh``: "dp", or ("dp", "ep") / "ep" with expert
    parallelism (the ep group carved out of data parallelism), None without."""
    axes = tuple(a for a in ("dp", "ep") if a in mesh.axes)
    return axes[0] if len(axes) == 1 else axes or None


def _dp_index(mesh, rank: int) -> int:
    """The data-parallel replica of ``rank``: its position over :func:`_dp_axes`."""
    axes = _dp_axes(mesh)
    return 0 if axes is None else mesh.group_position(axes, rank)


def _expert_dp_axes(mesh):
    """The experts' gradient group with expert parallelism: the expert-data-parallel
    group, the axis "dp" (the expert group holds every cp rank: ParallelConfig.mesh),
    None without ep."""
    return "dp" if "ep" in mesh.axes else None


def _expert_coords(mesh, parallel: ParallelConfig, rank: int) -> tuple[int, int, int, int]:
    """(ep, e, etp, t): the size of ``rank``'s expert group and its position in it (its
    experts are e·E/ep ...), the size of the group its experts' hidden dimension is split
    over and its position there (tp, or 1 when folded)."""
    ep, e = (mesh.axis_size(parallel.expert_axes),
             mesh.group_position(parallel.expert_axes, rank)) if "ep" in mesh.axes else (1, 0)
    if parallel.folded:
        return ep, e, 1, 0
    return ep, e, mesh.shape.get("tp", 1), _coord(mesh, "tp", rank)


def _reports_aux(mesh, parallel: ParallelConfig, rank: int) -> bool:
    """Whether ``rank``'s aux losses count in the step's: one rank per MoE call — the
    first of its expert group (every member computes the group's value), in tp piece 0
    (tp ranks repeat it unless the group is folded over them)."""
    return _expert_coords(mesh, parallel, rank)[1] == 0 and _coord(mesh, "tp", rank) == 0


def moe_call_blocks(parallel: ParallelConfig, global_batch: int, seq: int) -> list:
    """The tokens of each MoE call as blocks (batch rows, positions): a call's ranks in
    expert-group order (replica, cp rank, tp rank when folded), each rank's tokens one
    block — its micro-batch rows (:func:`moe_groups`) at its positions: the whole
    sequence, a cp rank's two chunks (:func:`~tensor_parallel.context_parallel.
    sequence_positions`), and folded (etp = 1) its tp slice of those."""
    t, cp = (parallel.tp if parallel.folded else 1), parallel.cp
    local = [np.asarray(sequence_positions(seq, cp, c)) if cp > 1 else np.arange(seq)
             for c in range(cp)]
    n = len(local[0]) // t
    per_rank = [pos[r * n:(r + 1) * n] for pos in local for r in range(t)]
    replicas = max(parallel.ep // parallel.token_split, 1)    # replicas in a group
    calls = moe_groups(parallel, global_batch, replicas)
    if parallel.ep == 1 and parallel.token_split > 1:     # no group: each rank a call
        return [[(rows, pos)] for rows in calls for pos in per_rank]
    out = []
    for rows in calls:
        b = len(rows) // replicas
        out.append([(rows[e * b:(e + 1) * b], pos) for e in range(replicas)
                    for pos in per_rank])
    return out


def moe_groups(parallel: ParallelConfig, global_batch: int | None = None,
               ep: int | None = None) -> list:
    """The batch rows of each MoE call: per expert-data-parallel replica d (dp/ep of
    them) and micro-batch j, the rows of its ep ranks e = 0..ep-1 in order, rank e
    (data-parallel replica d·ep + e) contributing its micro-batch j's b rows."""
    B = parallel.global_batch if global_batch is None else global_batch
    per, b = B // parallel.dp, parallel.micro_batch
    ep = parallel.ep if ep is None else ep          # data-parallel replicas in a group
    return [[(d * ep + e) * per + j * b + i for e in range(ep) for i in range(b)]
            for d in range(parallel.dp // ep) for j in range(parallel.microbatches)]


class GPT:
    """The model of ``config`` with parameters drawn from ``seed`` (see the module doc)."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {config!r}")
        self.config, self.seed = config, int(seed)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shapes by name: wte, wpe, layers.{i}.{ln1_g ... b_2}, lnf_g, lnf_b, w_out
        (not with ``tie_embeddings``; Llama: :func:`~pipeline_parallel.llama.llama_param_shapes`)."""
        if self.config.block is LLAMA_BLOCK:
            return llama_param_shapes(self.config)
        c, h, f = self.config, self.config.hidden, 4 * self.config.hidden
        layer = dict(zip(_LAYER, [(h,), (h,), (h, 3, h), (3, h), (h, h), (h,), (h,), (h,),
                                  (h, f), (f,), (f, h), (h,)]))
        if c.experts:            # MoE: w_1, b_1, w_2, b_2 become the router + experts
            e, fe = c.experts, c.moe_ffn_hidden
            layer = {**{n: layer[n] for n in _LAYER[:8]}, "w_router": (h, e),
                     "moe_gate": (e, h, fe), "moe_up": (e, h, fe), "moe_down": (e, fe, h)}
        return {"wte": (c.vocab, h), "wpe": (c.seq, h),
                **{f"layers.{i}.{n}": layer[n] for i in range(c.layers) for n in layer},
                "lnf_g": (h,), "lnf_b": (h,),
                **({} if c.tie_embeddings else {"w_out": (h, c.vocab)})}

    def init_params(self) -> dict[str, np.ndarray]:
        """Every parameter random (so that every gradient path shows): matrices
        N(0, 1/fan_in), vectors N(0, 0.1²), plus 1 for the LayerNorm gains."""
        rng, out = np.random.default_rng(self.seed), {}
        for name, shape in self.param_shapes().items():
            last, a = name.rsplit(".", 1)[-1], rng.standard_normal(shape)
            matrix = len(shape) > 1 and last not in ("b_qkv", "b_kv") + EXPERT_BIAS_PARAMS
            fan = shape[1] if last in EXPERT_PARAMS else shape[last == "wte"]  # (E, in, out)
            a = a / np.sqrt(fan) if matrix else a * 0.1 + last.endswith("_g")
            out[name] = a.astype(self.config.dtype)
        return out

    def train_job(self, mesh, parallel: ParallelConfig, steps: int = 1, optimizer=None,
                  params=None, bucket_bytes: int = 1 << 20, expert_load=None) -> TrainJob:
        """The executor's job (``params``: global arrays by name, default the seed's;
        ``expert_load``: what a trace of an MoE model routes, an ExpertLoad for every
        layer or a dict layer -> ExpertLoad)."""
        parallel.check(self.config, mesh)
        S, m = parallel.pp * parallel.chunks, parallel.microbatches
        zero = parallel.zero_stage
        if self.config.tie_embeddings and S > 1 and zero and (zero >= 2 or parallel.pp == 1):
            raise ValueError(f"GPT: tie_embeddings with zero_stage={zero} on {S} stages (pp="
                             f"{parallel.pp} x {parallel.chunks}) is not supported: the "
                             f"first and last stage's copies of E are summed once per step, "
                             f"which ZeRO-2/3 (reducing every micro-batch) and ZeRO on one "
                             f"pipeline rank (both copies there) do not allow; use one "
                             f"stage, zero_stage 0, or zero_stage 1 with pp > 1")
        sched = make_schedule(parallel.schedule, parallel.pp, m,
                              virtual_stages=parallel.virtual_stages,
                              combined=parallel.moe_comm_overlap)
        bounds = np.cumsum((0,) + parallel.stage_layers(self.config.layers)).tolist()
        return TrainJob(
            params=tuple((params or self.init_params()).items()), loss="cross_entropy",
            specs=tuple(tuple(range(bounds[k], bounds[k + 1])) for k in range(S)),
            actions=tuple(tuple(sched.actions[r]) for r in range(parallel.pp)),
            optimizer=optimizer or OptimizerConfig(), steps=as_int(steps, "steps", 1),
            microbatches=m, global_batch=parallel.global_batch,
            dp_axis=_dp_axes(mesh),
            tp_axis="tp" if "tp" in mesh.axes else None, bucket_bytes=int(bucket_bytes),
            cp_axis="cp" if "cp" in mesh.axes else None,
            stage_factory=partial(_stage, self.config, parallel, load=expert_load),
            zero_stage=parallel.zero_stage, expert_dp_axis=_expert_dp_axes(mesh),
            tied=("wte",) if self.config.tie_embeddings else (),
            grad_reduce_dtype=None if parallel.grad_reduce_dtype == "model" else "float32")

    def device_args(self, mesh, job: TrainJob, tokens, targets) -> list[tuple]:
        """(job, tokens or None, targets or None) per rank: the first stage's ranks get
        their replica's tokens, the last stage's its targets (with context parallelism
        their cp rank's chunks of each sequence)."""
        rows, last = job.global_batch // mesh.axis_size(_dp_axes(mesh) or ()), job.n_stages - 1
        parts = [(slice(_dp_index(mesh, r) * rows, (_dp_index(mesh, r) + 1) * rows),
                  _coord(mesh, "pp", r), _coord(mesh, "cp", r)) for r in range(mesh.size)]
        return [(job, _cp_rows(tokens[part], mesh, c) if pos == 0 else None,
                 _cp_rows(targets[part], mesh, c) if pos == last % mesh.shape.get("pp", 1)
                 else None) for part, pos, c in parts]

    def meta_args(self, mesh, parallel: ParallelConfig, steps: int = 1, optimizer=None,
                  bucket_bytes: int = 1 << 20, expert_load=None,
                  expert_skew: float = 1.0) -> list[tuple]:
        """``device_args`` on shape-only arrays, for ``trace_program(mesh, train_program,
        ...)`` (or ``forward_program``) at any scale. An MoE model routes ``expert_load``
        (an ExpertLoad, or a dict layer -> ExpertLoad), default
        ``ExpertLoad.skewed(ep, E, b·s, k, expert_skew, capacity)`` for every layer
        (folded, etp = 1: each rank routes b·s/t tokens; with ``moe_ep_node_ranks`` its
        ``node_tokens`` expectation too)."""
        params = {n: MetaArray(s, self.config.dtype) for n, s in self.param_shapes().items()}
        data = MetaArray((parallel.global_batch, self.config.seq), np.int64)
        c = self.config
        if c.experts and expert_load is None:
            tokens = parallel.micro_batch * c.seq // parallel.token_split
            expert_load = ExpertLoad.skewed(parallel.ep, c.experts, tokens, c.moe_top_k,
                                            expert_skew, c.moe().capacity(tokens),
                                            node_ranks=parallel.moe_ep_node_ranks)
        return self.device_args(mesh, self.train_job(mesh, parallel, steps, optimizer, params,
                                                      bucket_bytes, expert_load), data, data)

    def _check_data(self, tokens, targets, parallel=None):
        """Both int arrays (B, s) of values in [0, V), B = ``parallel.global_batch``."""
        c, out = self.config, [np.asarray(tokens), np.asarray(targets)]
        B = parallel.global_batch if parallel else len(out[0])
        for what, a in zip(("tokens", "targets"), out):
            if a.shape != (B, c.seq) or a.dtype.kind not in "iu" or a.min() < 0 \
                    or a.max() >= c.vocab:
                raise ValueError(f"GPT: {what} must be ints in [0, {c.vocab}) of shape "
                                 f"({B}, {c.seq}), got {a.dtype} {a.shape} in "
                                 f"[{a.min()}, {a.max()}]")
        return [a.astype(np.int64) for a in out]

    def fit(self, cluster, tokens, targets, steps: int, parallel: ParallelConfig,
            optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.9,
            betas=(0.9, 0.999), eps: float = 1e-8, bucket_bytes: int = 1 << 20) -> GPTFitResult:
        """Train ``steps`` steps on ``cluster`` (its mesh must match ``parallel``)."""
        import pandas as pd
        tokens, targets, mesh = *self._check_data(tokens, targets, parallel), cluster.mesh
        job = self.train_job(mesh, parallel, steps, OptimizerConfig(
            optimizer, lr, momentum, tuple(betas), eps), bucket_bytes=bucket_bytes)
        results = cluster.run(train_program, self.device_args(mesh, job, tokens, targets))
        memory = pd.DataFrame([dict(r["memory"], peak_in_flight=max(
            r["memory"]["peak_in_flight"].values(), default=0)) for r in results])
        if not self.config.experts:
            return GPTFitResult(*self.collect(mesh, results, parallel), memory)
        losses, params, grads = self.collect(mesh, results, parallel)
        aux, load = self.moe_report(mesh, parallel, results)
        return GPTFitResult(losses + aux, params, grads, memory, aux, load)

    def parameter_server_job(self, mesh, servers: int, global_batch: int, steps: int = 1,
                             optimizer=None, staleness: int = 0, replay=None, params=None,
                             timeout_s: float = 60.0):
        """The :class:`~pipeline_parallel.parameter_server.ParameterServerJob` of
        :meth:`fit_parameter_server` on ``mesh`` (``params``: the tensors by name, default
        the seed's; shape-only arrays make a job to trace). Each worker's stage is the
        whole model on one device (no tp, pp or cp), its ``global_batch / W`` sequences
        one micro-batch: the stage a dp = W replica of :meth:`fit` runs with
        ``ParallelConfig(global_batch, micro_batch=global_batch / W, dp=W)``."""
        from .parameter_server import make_job
        caller, c = "GPT.fit_parameter_server", self.config
        if c.experts:
            raise ValueError(f"{caller}: experts={c.experts} is not supported (a worker "
                             f"holds the whole model and routes alone); use a dense model, "
                             f"experts=0 (arch 'gpt' or 'llama')")
        if len(mesh.axes) == 1 and mesh.axes[0] in ("tp", "cp", "ep"):
            raise ValueError(f"{caller}: the mesh's one axis is called {mesh.axes[0]!r}, "
                             f"which the GPT stages read as a {mesh.axes[0]} group; name it "
                             f"otherwise (e.g. 'ps')")
        params = params or self.init_params()
        names = tuple(self.param_shapes())
        return make_job(caller, mesh, [params[n] for n in names], partial(_ps_stage, c, names),
                        loss="cross_entropy", optimizer=optimizer or OptimizerConfig(),
                        steps=steps, batch=global_batch, servers=servers,
                        staleness=staleness, replay=replay, timeout_s=timeout_s)

    def fit_parameter_server(self, cluster, tokens, targets, steps: int, servers: int = 1,
                             optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.9,
                             betas=(0.9, 0.999), eps: float = 1e-8, staleness: int = 0,
                             replay=None):
        """Parameter-server training on ``cluster`` (one mesh axis), as
        :meth:`MLP.fit_parameter_server <pipeline_parallel.mlp.MLP.fit_parameter_server>`
        (:mod:`pipeline_parallel.parameter_server`): its first ``servers`` ranks hold the
        parameter tensors, the others are workers, each training the whole model on an
        equal slice of the sequences (:meth:`parameter_server_job`). ``staleness=0``:
        synchronous, bit for bit :meth:`fit` with ``ParallelConfig(B, micro_batch=B / W,
        dp=W)`` on the ``shm`` all-reduce, and :meth:`fit_reference` within rounding;
        ``staleness=s >= 1``: asynchronous, workers at most s steps apart,
        ``replay=run.events`` repeats a run exactly. Returns a
        :class:`~pipeline_parallel.parameter_server.ParameterServerFit` whose ``params``
        are the final arrays by name. Dense models only (``experts=0``)."""
        from .parameter_server import fit_parameter_server
        tokens, targets = self._check_data(tokens, targets)
        job = self.parameter_server_job(
            cluster.mesh, servers, len(tokens), steps,
            OptimizerConfig(optimizer, lr, momentum, tuple(betas), eps), staleness, replay,
            timeout_s=cluster.options.timeout_s)
        return fit_parameter_server(cluster, job, tokens, targets,
                                    lambda t: dict(zip(self.param_shapes(), t)))

    def moe_report(self, mesh, parallel: ParallelConfig, results):
        """(aux loss per step, per step {layer: ExpertLoad}): the aux losses summed over
        one rank of each call (:func:`_reports_aux`); the load's rows are the routing
        ranks — the dp data-parallel replicas, each replica's cp ranks (cp > 1) and tp
        ranks (folded, etp = 1) — their tokens summed over the step's micro-batches, so its
        capacity is m·C; its ``tokens``: each routing rank's distinct tokens per member of
        its expert group (the flex dispatcher's rows), summed likewise; its
        ``node_tokens`` (``moe_ep_node_ranks``): per node of the group, likewise."""
        aux = sum(np.array(r["aux_losses"]) for i, r in enumerate(results)
                  if _reports_aux(mesh, parallel, i))
        cap = self.config.moe().capacity(parallel.micro_batch * self.config.seq
                                         // parallel.token_split)
        loads = []
        for step in range(len(aux)):
            tables: dict = {}
            for i, r in enumerate(results):
                if parallel.folded or _coord(mesh, "tp", i) == 0:
                    for prefix, counts in r["moe_loads"][step].items():
                        tables.setdefault(int(prefix.split(".")[1]), {})[
                            (_dp_index(mesh, i), _coord(mesh, "cp", i),
                             _coord(mesh, "tp", i) if parallel.folded else 0)] = counts
            loads.append({layer: ExpertLoad(
                [table[d][0] for d in sorted(table)], [table[d][1] for d in sorted(table)],
                None if cap is None else cap * parallel.microbatches,
                [table[d][2] for d in sorted(table)],
                [table[d][3] for d in sorted(table)] if all(
                    len(table[d]) > 3 for d in table) else None)
                for layer, table in sorted(tables.items())})
        return aux, loads

    def collect(self, mesh, results, parallel: ParallelConfig | None = None
                ) -> tuple[np.ndarray, dict, dict]:
        """(losses per step, parameters, gradients) from ``train_program``'s per-rank
        ``results`` on ``mesh``: each step's loss summed over the ranks that report one, in
        tensor-parallel piece 0 (as ``fit`` reports it; the dp replicas' and cp ranks'
        shares of the mean); the global arrays joined from the pieces of data-parallel
        replica 0, cp rank 0 (ZeRO shards first joined over dp × cp). ``parallel``: how
        an MoE model's experts were laid out (default: the mesh's, etp = tp)."""
        results = unshard_results(mesh, _grad_axes(mesh), results)
        losses = sum(np.array(r["losses"]) for i, r in enumerate(results)
                     if r["losses"] is not None and _coord(mesh, "tp", i) == 0)
        par = parallel or ParallelConfig(global_batch=1, tp=mesh.shape.get("tp", 1))
        return (losses, self._join(mesh, results, "params", par),
                self._join(mesh, results, "grads", par))

    def _join(self, mesh, results, key: str, parallel: ParallelConfig) -> dict:
        """Global arrays from the pieces of the ranks of data-parallel replica 0 (Llama's
        W_kv replicated over tp: one piece per KV head; the experts' by expert group and
        etp position)."""
        pieces: dict = {}
        for r, res in enumerate(results):
            replica0, cp0 = _coord(mesh, "dp", r) == 0, _coord(mesh, "cp", r) == 0
            for name, a in res[key].items() if replica0 else ():
                if is_moe_param(name):     # experts: pieces over the expert group and etp
                    _, e, _, t = _expert_coords(mesh, parallel, r)
                    if cp0 or parallel.ep > 1:
                        pieces.setdefault(name, {})[(e, t)] = a
                elif cp0 and _coord(mesh, "ep", r) == 0:
                    pieces.setdefault(name, {})[_coord(mesh, "tp", r)] = a
        llama, tp = self.config.block is LLAMA_BLOCK, mesh.shape.get("tp", 1)
        out = {}
        for n in self.param_shapes():
            if is_moe_param(n):
                last = n.rsplit(".", 1)[-1]
                ep_n = max(e for e, _ in pieces[n]) + 1 if is_expert_param(last) else 1
                etp_n = max(t for _, t in pieces[n]) + 1
                tp_dim = MOE_TP_DIM.get(last)
                by_ep = [pieces[n][(e, 0)] if tp_dim is None or etp_n == 1 else np.concatenate(
                    [pieces[n][(e, t)] for t in range(etp_n)], axis=tp_dim)
                    for e in range(ep_n)]
                out[n] = np.concatenate(by_ep) if ep_n > 1 else by_ep[0]
                continue
            dim = llama_split_dim(n) if llama else split_dim(n)
            step = tp // kv_pieces(self.config.kv_heads, tp) if llama and is_kv_param(n) \
                else 1
            out[n] = pieces[n][0] if dim is None else np.concatenate(
                [pieces[n][t] for t in sorted(pieces[n])[::step]], axis=dim)
        return out

    def forward(self, cluster, tokens, targets, parallel: ParallelConfig):
        """(mean loss, logits (B, s, V)) of the seed's parameters, run on ``cluster``."""
        tokens, targets = self._check_data(tokens, targets, parallel)
        mesh, (B, s), V = cluster.mesh, tokens.shape, self.config.vocab
        results = cluster.run(forward_program, self.device_args(
            mesh, self.train_job(mesh, parallel), tokens, targets))
        last = {(_dp_index(mesh, r), _coord(mesh, "cp", r), _coord(mesh, "tp", r)): res
                for r, res in enumerate(results) if res and res["logits"]}  # replica, cp, tp
        aux = sum(res["aux"] for r, res in enumerate(results) if res and "aux" in res
                  and _reports_aux(mesh, parallel, r))
        cp = parallel.cp

        def piece(d, c):
            return np.concatenate([np.concatenate(last[d, c, t]["logits"]).reshape(
                B // parallel.dp, s // cp, V // parallel.tp) for t in range(parallel.tp)], axis=2)
        logits = np.concatenate([join_sequence([piece(d, c) for c in range(cp)])
                                 for d in range(parallel.dp)])
        return sum(last[d, c, 0]["loss"] for d in range(parallel.dp)
                   for c in range(cp)) + aux, logits

    # --- the single-process reference ---------------------------------------------------
    def _reference(self, params, tokens, targets, backward: bool = False, parallel=None,
                   moe_state=None):
        ref = llama_reference if self.config.block is LLAMA_BLOCK else _reference
        if self.config.experts:
            return ref(self.config, params, tokens, targets, backward,
                       moe_groups=self._moe_groups(parallel, len(tokens)),
                       **({"moe_state": moe_state} if moe_state is not None else {}))
        return ref(self.config, params, tokens, targets, backward)

    def _moe_groups(self, parallel, batch: int):
        """(ep, the rows of each MoE call) of ``parallel`` (MoE models; default: the whole
        batch in one call, ep 1 — capacity and the aux loss depend on the grouping)."""
        if parallel is None:
            return 1, [[(list(range(batch)), np.arange(self.config.seq))]]
        return parallel.ep, moe_call_blocks(parallel, batch, self.config.seq)

    def reference_forward(self, tokens, targets, params=None, parallel=None):
        """(mean loss, logits (B, s, V)) in plain numpy, unsharded: the ground truth. An
        MoE model routes each call of ``parallel`` (:func:`moe_groups`) apart, and its
        loss includes the aux loss."""
        tokens, targets = self._check_data(tokens, targets)
        return self._reference(params or self.init_params(), tokens, targets,
                               parallel=parallel)[:2]

    def fit_reference(self, tokens, targets, steps: int, optimizer: str = "sgd",
                      lr: float = 0.01, momentum: float = 0.9, betas=(0.9, 0.999),
                      eps: float = 1e-8, parallel=None) -> GPTFitResult:
        """Full-batch training in this process: what ``fit`` must reproduce
        (``parallel``: an MoE model's calls, as :meth:`reference_forward`)."""
        tokens, targets = self._check_data(tokens, targets)
        params, losses, grads = self.init_params(), [], {}
        opt = Optimizer(OptimizerConfig(optimizer, lr, momentum, tuple(betas), eps),
                        list(params.values()))
        rate = self.config.moe_bias_update_rate if self.config.experts else 0.0
        state = {"bias": {}, "routed": {}} if rate else None   # aux-loss-free balancing
        for _ in range(as_int(steps, "steps", 1)):
            loss, _, grads = self._reference(params, tokens, targets, backward=True,
                                             parallel=parallel, moe_state=state)
            opt.step(list(params.values()), [grads[n] for n in params])
            losses.append(loss)
            for i, n in (state["routed"].items() if state else ()):
                state["bias"][i] = state["bias"].get(i, np.zeros_like(n)) \
                    + rate * np.sign(n.mean() - n)
            if state:
                state["routed"] = {}
        return GPTFitResult(np.array(losses), params, grads)


def _ln(x, g, b, eps):
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    xhat = (x - x.mean(-1, keepdims=True)) * rstd
    return xhat * g + b, (xhat, rstd, g)


def _ln_back(dy, cache):
    """(dx, dg, db) of a LayerNorm over the last axis."""
    xhat, rstd, g = cache
    d = dy * g
    dx = rstd * (d - d.mean(-1, keepdims=True) - xhat * (d * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum((0, 1)), dy.sum((0, 1))


def _reference(cfg: GPTConfig, P: dict, tokens, targets, backward: bool = False,
               moe_groups=None):
    """Forward (and backward) of the whole model on the whole batch: (loss, logits, grads).
    An MoE model's MLP is :func:`~pipeline_parallel.llama.moe_calls_reference` on the
    calls ``moe_groups`` (ep, rows per call), its aux loss added to the loss."""
    (B, s), h, a, V = tokens.shape, cfg.hidden, cfg.heads, cfg.vocab
    d, future = h // a, np.triu(np.ones((s, s), bool), 1)
    x, caches, aux_total = P["wte"][tokens] + P["wpe"][:s], [], 0.0
    names = _LAYER[:8] + MOE_PARAMS if cfg.experts else _LAYER
    for i in range(cfg.layers):
        L = {n: P[f"layers.{i}.{n}"] for n in names}
        u, c1 = _ln(x, L["ln1_g"], L["ln1_b"], cfg.eps)
        qkv = np.einsum("bsh,htk->bstk", u, L["w_qkv"]) + L["b_qkv"]      # (B, s, 3, h)
        q, k, v = (qkv[:, :, t].reshape(B, s, a, d) for t in range(3))
        S = np.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(d)
        S[..., future] = -np.inf
        A = np.exp(S - S.max(-1, keepdims=True))
        A /= A.sum(-1, keepdims=True)                                        # (B, a, s, s)
        ctx = np.einsum("bnqk,bknd->bqnd", A, v).reshape(B, s, h)
        x1 = x + ctx @ L["w_o"] + L["b_o"]
        u2, c2 = _ln(x1, L["ln2_g"], L["ln2_b"], cfg.eps)
        if cfg.experts:
            y, aux = moe_calls_reference(cfg, L, u2, moe_groups)
            x, aux_total, z = x1 + y, aux_total + aux, None
        else:
            z = u2 @ L["w_1"] + L["b_1"]
            x = x1 + activation("gelu", z) @ L["w_2"] + L["b_2"]
        caches.append((L, u, c1, q, k, v, A, ctx, u2, c2, z))
    uf, cf = _ln(x, P["lnf_g"], P["lnf_b"], cfg.eps)
    w_out = P["wte"].T if cfg.tie_embeddings else P["w_out"]                 # (h, V)
    logits = uf @ w_out                                                      # (B, s, V)
    ce, dlogits = loss_and_grad("cross_entropy", logits.reshape(B * s, V),
                                targets.reshape(-1), B * s)       # mean over the B·s tokens
    loss = ce + aux_total
    if not backward:
        return loss, logits, None
    G = {}
    dlogits = dlogits.reshape(B, s, V)
    G["w_out"] = np.einsum("bsh,bsv->hv", uf, dlogits)
    dx, G["lnf_g"], G["lnf_b"] = _ln_back(dlogits @ w_out.T, cf)
    for i in reversed(range(cfg.layers)):
        L, u, c1, q, k, v, A, ctx, u2, c2, z = caches[i]
        if cfg.experts:
            dmoe, g = moe_calls_reference(cfg, L, u2, moe_groups, dy=dx)
            du2, g["ln2_g"], g["ln2_b"] = _ln_back(dmoe, c2)
        else:
            g = {"b_2": dx.sum((0, 1)),
                 "w_2": np.einsum("bsf,bsh->fh", activation("gelu", z), dx)}
            dz = activation_grad("gelu", z, dx @ L["w_2"].T)
            g["b_1"], g["w_1"] = dz.sum((0, 1)), np.einsum("bsh,bsf->hf", u2, dz)
            du2, g["ln2_g"], g["ln2_b"] = _ln_back(dz @ L["w_1"].T, c2)
        dx1 = dx + du2
        g["b_o"], g["w_o"] = dx1.sum((0, 1)), np.einsum("bsk,bsh->kh", ctx, dx1)
        dctx = (dx1 @ L["w_o"].T).reshape(B, s, a, d)
        dA = np.einsum("bqnd,bknd->bnqk", dctx, v)
        dv = np.einsum("bnqk,bqnd->bknd", A, dctx)
        dS = A * (dA - (dA * A).sum(-1, keepdims=True)) / np.sqrt(d)
        dq = np.einsum("bnqk,bknd->bqnd", dS, k)
        dk = np.einsum("bnqk,bqnd->bknd", dS, q)
        dqkv = np.stack([dq, dk, dv], axis=2).reshape(B, s, 3, h)
        g["b_qkv"], g["w_qkv"] = dqkv.sum((0, 1)), np.einsum("bsh,bstk->htk", u, dqkv)
        du, g["ln1_g"], g["ln1_b"] = _ln_back(np.einsum("bstk,htk->bsh", dqkv, L["w_qkv"]), c1)
        dx = dx1 + du
        G.update({f"layers.{i}.{n}": g[n] for n in names})
    G["wpe"], G["wte"] = dx.sum(0), np.zeros_like(P["wte"])             # s = cfg.seq
    np.add.at(G["wte"], tokens, dx)
    if cfg.tie_embeddings:
        G["wte"] += G.pop("w_out").T
    return loss, logits, {n: G[n] for n in P}
