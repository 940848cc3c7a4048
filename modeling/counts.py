"""What a :class:`~modeling.spec.ModelSpec` costs, answered once: parameters (total,
active per token, per pipeline stage and per rank), FLOPs per token, KV-cache bytes and
activation bytes per layer.

Notation: h hidden, V vocabulary, s sequence, b micro-batch, t tensor-parallel degree;
per attention block q = heads·d, c = kv_heads·d; per MLP f its width, m its matrices
(2 plain, 3 gated).

Parameters of one layer: its two pre-norms (h each for RMSNorm, 2h for LayerNorm), its
attention (:func:`attention_params`) and its MLP (:func:`mlp_params`, :func:`moe_params`).
The model adds the embedding V·h (+ max_seq·h learned positions), the final norm and, when
untied, the head V·h. *Active* parameters are those one token's forward uses: every
parameter but the routed experts it is not sent to (the embedding and head included:
Mistral's convention for Mixtral's 12.9 B; :attr:`ParameterCount.active_without_embedding`
drops the input table, OpenAI's convention for GPT-OSS).

FLOPs per token, forward (:func:`flops_per_token`): 2 per weight that enters a product
(the head included, the embedding lookup not) plus, per layer, 2·heads·(d_qk + d_v) per
key each query reads (QKᵀ and A·V); the backward is twice the forward. Which keys are
counted is the :class:`~modeling.choices.FlopConvention`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .choices import (FULL_RECOMPUTE, AttentionKernel, FlopConvention, NormKind, Positions,
                      Recompute)
from .errors import ConfigError
from .spec import MLP, Attention, LatentAttention, Layer, ModelSpec, MoE

__all__ = ["ParameterCount", "FlopsPerToken", "attention_params", "mlp_params", "moe_params",
           "layer_params", "parameter_count", "stage_layers", "rank_params",
           "flops_per_token", "keys_per_query", "causal_square", "kv_bytes_per_token",
           "kv_cache_bytes", "activation_bytes_per_layer"]


@dataclass(frozen=True)
class ParameterCount:
    """A model's parameters by part (counts, not bytes). ``mtp``: multi-token-prediction
    modules (DeepSeek-V3's 14 B), outside ``total``."""

    total: int
    active: int
    embedding: int          # V·h, plus learned positions
    head: int               # V·h; 0 when tied to the embedding
    attention: int
    mlp: int                # every expert of every layer
    mlp_active: int         # what one token uses: top-k routed + shared + router
    norms: int
    mtp: int = 0

    @property
    def active_without_embedding(self) -> int:
        """``active`` less the input embedding table (a lookup, not a product)."""
        return self.active - self.embedding

    def __str__(self) -> str:
        return f"{self.total / 1e9:.2f} B" + (
            f" ({self.active / 1e9:.2f} B active)" if self.active != self.total else "")


def _norm(kind: NormKind, width: int) -> int:
    return 2 * width if kind is NormKind.LAYERNORM else width


def attention_params(att: Attention | LatentAttention, hidden: int) -> int:
    """Attention: h·q + 2·h·c + q·h (+ q + 2c and h of biases, 2d of QK-norms, one sink
    per head); latent: see :class:`~modeling.spec.LatentAttention`."""
    h = hidden
    if isinstance(att, LatentAttention):
        qd = att.heads * att.qk_head_dim
        q = (h * att.q_lora_rank + att.q_lora_rank + att.q_lora_rank * qd) if att.q_lora_rank \
            else h * qd
        kv = h * (att.kv_lora_rank + att.qk_rope_head_dim) + att.kv_lora_rank \
            + att.kv_lora_rank * att.heads * (att.qk_nope_head_dim + att.v_head_dim)
        return q + kv + att.heads * att.v_head_dim * h
    q, c = att.q_width, att.kv_width
    n = h * q + 2 * h * c + q * h
    n += (q + 2 * c if att.qkv_bias else 0) + (h if att.out_bias else 0)
    n += 2 * att.head_dim if att.qk_norm else 0
    return n + (att.heads if att.sinks else 0)


def _attention_replicated(att: Attention | LatentAttention, hidden: int) -> int:
    """The attention parameters every tp rank holds whole: the output bias; latent
    attention's down-projections and their norms, h·r_q + r_q + h·(r_kv + d_rope) + r_kv
    (Megatron-Core's MLA: only the heads' up-projections and W_o split)."""
    if isinstance(att, LatentAttention):
        r_q = att.q_lora_rank or 0
        return hidden * r_q + r_q + hidden * (att.kv_lora_rank + att.qk_rope_head_dim) \
            + att.kv_lora_rank
    return hidden if att.out_bias else 0


def _attention_matmul_params(att: Attention | LatentAttention, hidden: int) -> int:
    """The attention weights that enter products (no biases, norms, sinks)."""
    h = hidden
    if isinstance(att, LatentAttention):
        qd = att.heads * att.qk_head_dim
        q = h * att.q_lora_rank + att.q_lora_rank * qd if att.q_lora_rank else h * qd
        return q + h * (att.kv_lora_rank + att.qk_rope_head_dim) + att.kv_lora_rank \
            * att.heads * (att.qk_nope_head_dim + att.v_head_dim) + att.heads * att.v_head_dim * h
    return 2 * h * att.q_width + 2 * h * att.kv_width


def mlp_params(mlp: MLP, hidden: int) -> int:
    """m·h·f, + f·(m − 1) + h of biases."""
    m = mlp.kind.matrices
    return m * hidden * mlp.width + ((m - 1) * mlp.width + hidden if mlp.bias else 0)


def moe_params(moe: MoE, hidden: int) -> tuple[int, int]:
    """(all, active): router h·E (+ E bias), E experts, shared experts; active has top_k
    experts instead of E."""
    router = hidden * moe.experts + (moe.experts if moe.router_bias else 0)
    one = mlp_params(moe.expert, hidden)
    shared = moe.shared_experts * mlp_params(MLP(moe.expert.kind, moe.shared_width or 1,
                                                 moe.expert.bias), hidden) \
        if moe.shared_experts else 0
    return router + moe.experts * one + shared, router + moe.top_k * one + shared


def _mlp_block(mlp: MLP | MoE, hidden: int) -> tuple[int, int]:
    if isinstance(mlp, MoE):
        return moe_params(mlp, hidden)
    n = mlp_params(mlp, hidden)
    return n, n


def layer_params(layer: Layer, spec: ModelSpec) -> tuple[int, int]:
    """(all, active) parameters of one layer, its two norms included."""
    norms = 2 * _norm(spec.norm, spec.hidden)
    att = attention_params(layer.attention, spec.hidden)
    mlp, mlp_active = _mlp_block(layer.mlp, spec.hidden)
    return norms + att + mlp, norms + att + mlp_active


def parameter_count(spec: ModelSpec) -> ParameterCount:
    """Every parameter of ``spec`` by part (module docstring)."""
    h = spec.hidden
    embedding = spec.vocab * h + (spec.max_seq * h if spec.positions is Positions.LEARNED
                                  else 0)
    head = 0 if spec.tie_embeddings else spec.vocab * h
    attention = mlp = mlp_active = 0
    for layer in spec.layers:
        attention += attention_params(layer.attention, h)
        a, b = _mlp_block(layer.mlp, h)
        mlp, mlp_active = mlp + a, mlp_active + b
    norms = (2 * spec.num_layers + 1) * _norm(spec.norm, h)
    total = embedding + head + attention + mlp + norms
    mtp = 0
    if spec.mtp_layers:   # DeepSeek-V3: per module 2 norms, a 2h x h projection, a layer
        mtp = spec.mtp_layers * (2 * _norm(spec.norm, h) + 2 * h * h + _norm(spec.norm, h)
                                 + layer_params(spec.layers[-1], spec)[0])
    return ParameterCount(total, total - mlp + mlp_active, embedding, head, attention, mlp,
                          mlp_active, norms, mtp)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each of ``stages`` pipeline stages: equal shares, or ConfigError."""
    if num_layers % stages:
        raise ConfigError("pp", stages, f"a count of stages dividing the {num_layers} layers",
                          "the layers do not split evenly into pipeline stages")
    per = num_layers // stages
    return [range(k * per, (k + 1) * per) for k in range(stages)]


def rank_params(spec: ModelSpec, pp: int = 1, tp: int = 1, ep: int = 1,
                chunks: int = 1) -> list[float]:
    """Parameters one GPU of each pipeline rank holds under Megatron's layout: stage k of
    pp·chunks on rank k mod pp; attention and dense MLP weights split over tp (norms and
    the row-parallel output biases replicated; latent attention's down-projections and
    their norms too), routed experts split over ep·tp (expert
    tensor parallelism = tp) with the router replicated; the word embedding and head split
    over tp (vocabulary-parallel; learned positions replicated) on the first and last rank
    (both on one stage when tied and pp·chunks = 1)."""
    h = spec.hidden
    stages = pp * chunks
    ranks = [0.0] * pp
    for k, layers in enumerate(stage_layers(spec.num_layers, stages)):
        for i in layers:
            layer = spec.layers[i]
            att = attention_params(layer.attention, h)
            whole = _attention_replicated(layer.attention, h)
            n = 2 * _norm(spec.norm, h) + (att - whole) / tp + whole
            if isinstance(layer.mlp, MoE):
                moe = layer.mlp
                router = h * moe.experts + (moe.experts if moe.router_bias else 0)
                shared = moe_params(moe, h)[0] - router - moe.experts * mlp_params(moe.expert, h)
                n += router + shared / tp + moe.experts * mlp_params(moe.expert, h) / (ep * tp)
            else:
                row_bias = h if layer.mlp.bias else 0
                n += (mlp_params(layer.mlp, h) - row_bias) / tp + row_bias
            ranks[k % pp] += n
    count = parameter_count(spec)
    ranks[0] += spec.vocab * h / tp + (count.embedding - spec.vocab * h)
    last = (stages - 1) % pp
    ranks[last] += _norm(spec.norm, h) + (
        0 if spec.tie_embeddings and stages == 1 else spec.vocab * h / tp)
    return ranks


@dataclass(frozen=True)
class FlopsPerToken:
    """Model FLOPs per token of one training step (products only)."""

    forward: float
    convention: FlopConvention

    @property
    def backward(self) -> float:
        """Input and weight gradients: twice the forward."""
        return 2 * self.forward

    @property
    def training(self) -> float:
        return 3 * self.forward


def causal_square(seq: int, window: int | None = None) -> int:
    """The s² of the causal count (which declares s²/2 (query, key) pairs per head) under a
    sliding window w (key j visible to query i iff i − w < j ≤ i): 2·m·s − m², m = min(s,
    w) — twice Σ_i min(i+1, w) − m/2, the pairs each query reads with its own diagonal
    key at half, as the causal count's; s² without a window or with w >= s. The one
    closed form the program's declarations (:mod:`tensor_parallel.gqa`), the model FLOPs
    (:func:`pipeline_parallel.gpt.model_flops`) and :func:`keys_per_query` share."""
    m = seq if window is None else min(seq, window)
    return 2 * m * seq - m * m


def keys_per_query(att: Attention | LatentAttention, seq: int,
                   convention: FlopConvention) -> float:
    """Keys a query reads on average: under ``causal`` s/2 (full) or w − w²/(2s) for a
    window w < s (∫₀ˢ min(x, w) dx / s = :func:`causal_square` / 2s); under ``megatron``
    and ``palm`` all s."""
    if FlopConvention(convention) is not FlopConvention.CAUSAL:
        return float(seq)
    return causal_square(seq, att.window) / (2 * seq)


def flops_per_token(spec: ModelSpec, seq: int,
                    convention: FlopConvention | str = FlopConvention.CAUSAL) -> FlopsPerToken:
    """Forward FLOPs per token at sequence ``seq`` (module docstring): 2·N_products +
    Σ_layers 2·heads·(d_qk + d_v)·keys; ``palm`` uses 2·N_active (every active
    parameter, the embedding's included) for the first term."""
    convention = FlopConvention(convention)
    h = spec.hidden
    if convention is FlopConvention.PALM:
        weights = parameter_count(spec).active
    else:
        weights = spec.vocab * h
        for layer in spec.layers:
            weights += _attention_matmul_params(layer.attention, h)
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                shared = mlp.shared_experts * mlp.expert.kind.matrices * h * (mlp.shared_width or 0)
                weights += h * mlp.experts + mlp.top_k * mlp.expert.kind.matrices * h \
                    * mlp.expert.width + shared
            else:
                weights += mlp.kind.matrices * h * mlp.width
    scores = 0.0
    for layer in spec.layers:
        att = layer.attention
        if isinstance(att, LatentAttention):
            width = att.heads * (att.qk_head_dim + att.v_head_dim)
        else:
            width = 2 * att.q_width
        scores += 2 * width * keys_per_query(att, seq, convention)
    return FlopsPerToken(2 * weights + scores, convention)


def kv_bytes_per_token(spec: ModelSpec, bytes_per_element: int = 2) -> int:
    """KV-cache bytes one token adds over all layers: 2·c per attention layer, r_kv +
    d_rope per latent layer (the cached latent and the shared rotary key, as vLLM caches
    MLA)."""
    return sum(_layer_kv(x.attention) for x in spec.layers) * bytes_per_element


def _layer_kv(att) -> int:
    if isinstance(att, LatentAttention):
        return att.kv_lora_rank + att.qk_rope_head_dim
    return 2 * att.kv_width


def kv_cache_bytes(spec: ModelSpec, context: int, bytes_per_element: int = 2) -> int:
    """KV-cache bytes of one sequence of ``context`` tokens: a sliding-window layer keeps
    at most its window."""
    return sum(_layer_kv(x.attention) * (context if x.attention.window is None
                                         else min(context, x.attention.window))
               for x in spec.layers) * bytes_per_element


def _op_activation_elements(layer: Layer, x: int, h: int, tp: int, sp: int) -> float:
    """The elements ``op`` keeps (:func:`activation_bytes_per_layer`); ValueError for a
    layer it does not run on."""
    att, mlp = layer.attention, layer.mlp
    if isinstance(att, LatentAttention) or isinstance(mlp, MoE) or mlp.kind.matrices != 3:
        raise ValueError("activation_bytes_per_layer: recompute 'op' (torchtitan's per-op "
                         "policy) runs on a dense layer with grouped-query attention and a "
                         f"gated MLP, not {type(att).__name__} with {type(mlp).__name__}")
    return x * (h / sp + (h / tp if sp > 1 else 0) + (2 * att.q_width + att.kv_width) / tp
                + mlp.width / tp)


def activation_bytes_per_layer(layer: Layer, spec: ModelSpec, seq: int, micro_batch: int,
                               tp: int = 1, sequence_parallel: bool = False,
                               recompute: Recompute | str = Recompute.NONE,
                               attention: AttentionKernel | str = AttentionKernel.FLASH,
                               bytes_per_element: int = 2) -> float:
    """Bytes one layer keeps for its backward per micro-batch (Korthikanti et al. 2022's
    accounting without dropout; X = s·b elements of a per-token width, ``bytes_per_element``
    each):

    * ``full``: the layer's input, s·b·h (/t under sequence parallelism);
    * ``op`` (torchtitan's per-op policy; a dense layer with grouped-query attention and a
      gated MLP): the input s·b·h (/t under SP), the products x W_q, x W_v and the
      attention's output s·b·(2q + c)/t, the gate's product s·b·f/t and, under SP, the
      attention's reduce-scattered output s·b·h/t (no statistics: none of the above has);
    * otherwise the two norms' inputs 2·s·b·h and the attention and MLP inputs 2·s·b·h
      (/t under sequence parallelism); attention's Q, K, V and output s·b·(2q + 2c)/t
      (latent: the q and kv latents, the up-projected q, k, v and the output); under
      ``unfused`` attention and no ``selective`` recompute the softmax's s²·b·heads/t
      (s·min(s, w)·b·heads/t under a sliding window w);
      the MLP's hidden m·s·b·f/t (gated: both products and their product; plain: the
      product and the activation); an MoE's router logits s·b·E and, per routed copy,
      k·s·b·(h + m·f_e)/t, plus its shared experts' m·s·b·f_s/t."""
    recompute, attention = Recompute(recompute), AttentionKernel(attention)
    h, x = spec.hidden, seq * micro_batch
    sp = tp if sequence_parallel else 1
    if recompute in FULL_RECOMPUTE:
        return x * h / sp * bytes_per_element
    if recompute is Recompute.OP:
        return _op_activation_elements(layer, x, h, tp, sp) * bytes_per_element
    elements = 4 * x * h / sp
    att = layer.attention
    if isinstance(att, LatentAttention):
        elements += x * ((att.q_lora_rank or 0) + att.kv_lora_rank
                         + att.heads * (att.qk_head_dim * 2 + att.v_head_dim * 2) / tp)
    else:
        elements += x * (2 * att.q_width + 2 * att.kv_width) / tp
    if not attention.fused and recompute is not Recompute.SELECTIVE:
        keys = seq if att.window is None else min(seq, att.window)     # a window's scores
        elements += keys * x * att.heads / tp
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        m = mlp.expert.kind.matrices
        elements += x * mlp.experts + mlp.top_k * x * (h + m * mlp.expert.width) / tp
        elements += mlp.shared_experts * m * x * (mlp.shared_width or 0) / tp
    else:
        elements += mlp.kind.matrices * x * mlp.width / tp
    return elements * bytes_per_element
