"""``ModelSpec``: a decoder-only transformer described as data.

A model is an embedding (vocabulary V × hidden h; positions learned or rotary), a tuple
of layers and a head (its own V × h matrix, or the embedding's transpose when tied). Each
:class:`Layer` is one attention block and one MLP block behind pre-norms, so a model can
mix dense and MoE layers (DeepSeek-V3's first three are dense) or full and sliding-window
attention (GPT-OSS alternates them). Blocks are types, and every consumer dispatches on
the type, never on a name:

* attention: :class:`Attention` — multi-head (kv_heads = heads), grouped-query (a divisor)
  or multi-query (1); ``head_dim`` independent of h (Qwen3: 32 heads × 128 = 4096 ≠ h
  2560 is allowed), QK-norm, a sliding ``window``, attention ``sinks`` — or
  :class:`LatentAttention`, DeepSeek's multi-head latent attention (low-rank q and kv,
  decoupled RoPE dims);
* MLP: :class:`MLP` (gelu, swiglu, geglu of width f) or :class:`MoE` (routed experts,
  top-k, shared experts, router kind, capacity factor or dropless).

What a spec costs (parameters, FLOPs, KV and activation bytes) is answered once, in
:mod:`modeling.counts`; reading Hugging Face ``config.json`` files in
:mod:`modeling.hf_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import groupby

from .choices import MLPKind, NormKind, Positions, RouterScore
from .errors import ConfigError

__all__ = ["Attention", "LatentAttention", "MLP", "MoE", "Layer", "ModelSpec"]


def _positive(owner: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"an integer >= {minimum}", "not a valid count",
                          owner=owner)
    return value


def _flag(owner: str, name: str, value) -> None:
    if value not in (False, True):
        raise ConfigError(name, value, "true or false", "not a boolean", owner=owner)


@dataclass(frozen=True)
class Attention:
    """Softmax attention with ``heads`` query heads and ``kv_heads`` key/value heads
    (a divisor of heads: MHA when equal, MQA when 1, GQA between), each ``head_dim``
    wide. Weights: W_q h × heads·d, W_k and W_v h × kv_heads·d, W_o heads·d × h.

    ``qk_norm``: an RMSNorm of width d on each query and key head (Qwen3, OLMo 2).
    ``window``: each query sees the last ``window`` keys (sliding-window attention; None:
    every earlier key). ``sinks``: one learned logit per head added to the softmax's
    denominator (GPT-OSS). ``qkv_bias`` / ``out_bias``: biases on the projections."""

    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = False
    window: int | None = None
    sinks: bool = False
    qkv_bias: bool = False
    out_bias: bool = False

    def __post_init__(self):
        for f in ("heads", "kv_heads", "head_dim"):
            _positive("Attention", f, getattr(self, f))
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", self.kv_heads, f"a divisor of heads={self.heads}",
                              "each key/value head serves an equal group of query heads",
                              owner="Attention")
        if self.window is not None:
            _positive("Attention", "window", self.window)
        for f in ("qk_norm", "sinks", "qkv_bias", "out_bias"):
            _flag("Attention", f, getattr(self, f))

    @property
    def kind(self) -> str:
        """"multi-head", "multi-query" or "grouped-query" (for reading, not dispatch)."""
        if self.kv_heads == self.heads:
            return "multi-head"
        return "multi-query" if self.kv_heads == 1 else "grouped-query"

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def __str__(self) -> str:
        extra = "".join((f", window {self.window}" if self.window else "",
                         ", qk-norm" if self.qk_norm else "", ", sinks" if self.sinks else ""))
        return f"{self.kind} {self.heads}x{self.head_dim} (kv {self.kv_heads}){extra}"


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek-V2/V3's multi-head latent attention (MLA): queries through a rank
    ``q_lora_rank`` bottleneck (None: a full h × heads·(d_nope + d_rope) matrix), keys and
    values from one shared latent of rank ``kv_lora_rank`` (what a KV cache holds, with
    the d_rope-wide shared rotary key), up-projected per head to ``qk_nope_head_dim`` key
    and ``v_head_dim`` value dims; each query head is d_nope + d_rope wide.

    Weights: W_dq h × r_q, norm r_q, W_uq r_q × heads·(d_nope + d_rope); W_dkv
    h × (r_kv + d_rope), norm r_kv, W_ukv r_kv × heads·(d_nope + d_v); W_o heads·d_v × h."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    window = None           # MLA has no sliding-window form
    qk_norm = False
    sinks = False

    def __post_init__(self):
        for f in ("heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim"):
            _positive("LatentAttention", f, getattr(self, f))
        if self.q_lora_rank is not None:
            _positive("LatentAttention", "q_lora_rank", self.q_lora_rank)

    kind = "latent"

    @property
    def kv_heads(self) -> int:
        return self.heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __str__(self) -> str:
        q = f"q rank {self.q_lora_rank}, " if self.q_lora_rank else ""
        return (f"latent {self.heads} heads ({q}kv rank {self.kv_lora_rank}, qk "
                f"{self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v {self.v_head_dim})")


@dataclass(frozen=True)
class MLP:
    """A dense MLP of ``kind`` and ``width`` f (``bias``: biases on its matrices)."""

    kind: MLPKind
    width: int
    bias: bool = False
    clamp: float | None = None      # GPT-OSS's swiglu_limit: both products clamped to it

    def __post_init__(self):
        object.__setattr__(self, "kind", MLPKind(self.kind))
        _positive("MLP", "width", self.width)
        _flag("MLP", "bias", self.bias)
        if self.clamp is not None and not (isinstance(self.clamp, (int, float))
                                           and self.clamp > 0):
            raise ConfigError("clamp", self.clamp, "a number > 0, or None", "not a limit",
                              owner="MLP")

    def __str__(self) -> str:
        return f"{self.kind} {self.width}"


@dataclass(frozen=True)
class MoE:
    """A mixture of ``experts`` routed experts, each an :class:`MLP` ``expert``; a router
    (h × experts, ``router_bias`` adds one per expert) sends each token to ``top_k`` of
    them, weighted by ``router`` (softmax or sigmoid scores). ``shared_experts`` always-on
    experts of width ``shared_width`` each (DeepSeek, Qwen2-MoE). ``capacity_factor``:
    each expert takes at most cf·k·tokens/experts tokens, the rest dropped (None:
    dropless). ``aux_loss_coef``: the Switch load-balancing loss's weight (0: none, e.g.
    DeepSeek-V3's auxiliary-loss-free bias). Routing details that change the weights but
    no shapes: ``normalize_top_k`` (the k weights renormalized to sum to 1),
    ``routed_scaling`` (the routed output scaled, DeepSeek-V3 2.5), ``groups`` (n_group,
    topk_group: experts chosen within the best topk_group of n_group groups)."""

    experts: int
    top_k: int
    expert: MLP
    shared_experts: int = 0
    shared_width: int | None = None
    router: RouterScore = RouterScore.SOFTMAX
    router_bias: bool = False
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    normalize_top_k: bool = False
    routed_scaling: float = 1.0
    groups: tuple[int, int] | None = None

    def __post_init__(self):
        _positive("MoE", "experts", self.experts)
        _positive("MoE", "top_k", self.top_k)
        if self.top_k > self.experts:
            raise ConfigError("top_k", self.top_k, f"1 to experts={self.experts}",
                              "a token cannot use more experts than there are", owner="MoE")
        if not isinstance(self.expert, MLP):
            raise ConfigError("expert", self.expert, "an MLP", "not an MLP", owner="MoE")
        _positive("MoE", "shared_experts", self.shared_experts, 0)
        if self.shared_experts:
            _positive("MoE", "shared_width",
                      self.expert.width if self.shared_width is None else self.shared_width)
            if self.shared_width is None:
                object.__setattr__(self, "shared_width", self.expert.width)
        object.__setattr__(self, "router", RouterScore(self.router))
        _flag("MoE", "router_bias", self.router_bias)
        if self.capacity_factor is not None and not (
                isinstance(self.capacity_factor, (int, float))
                and not isinstance(self.capacity_factor, bool) and self.capacity_factor > 0):
            raise ConfigError("capacity_factor", self.capacity_factor,
                              "a number > 0, or None (dropless)", "not a capacity factor",
                              owner="MoE")
        if isinstance(self.aux_loss_coef, bool) or not isinstance(
                self.aux_loss_coef, (int, float)) or self.aux_loss_coef < 0:
            raise ConfigError("aux_loss_coef", self.aux_loss_coef, "a number >= 0",
                              "not a loss weight", owner="MoE")

    def __str__(self) -> str:
        shared = f" + {self.shared_experts} shared {self.shared_width}" \
            if self.shared_experts else ""
        return f"MoE {self.experts} x {self.expert}, top-{self.top_k}{shared}"


@dataclass(frozen=True)
class Layer:
    """One transformer layer: x + attention(norm(x)), then + mlp(norm(·))."""

    attention: Attention | LatentAttention
    mlp: MLP | MoE

    def __post_init__(self):
        if not isinstance(self.attention, (Attention, LatentAttention)):
            raise ConfigError("attention", self.attention, "Attention or LatentAttention",
                              "not an attention block", owner="Layer")
        if not isinstance(self.mlp, (MLP, MoE)):
            raise ConfigError("mlp", self.mlp, "MLP or MoE", "not an MLP block", owner="Layer")

    def __str__(self) -> str:
        return f"{self.attention} | {self.mlp}"


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: ``vocab`` V, ``hidden`` h, ``layers`` (a tuple of
    :class:`Layer`, one per layer), ``norm`` kind and ``norm_eps``, ``positions`` (learned
    for ``max_seq`` positions, or RoPE with ``rope_theta`` and optional ``rope_scaling``
    — a tuple of (key, value) pairs as the config gives it), ``tie_embeddings`` (the head
    is E^T). ``mtp_layers``: DeepSeek-V3's multi-token-prediction modules, trained beside
    the model and not part of its published size. ``name`` and ``source`` say what it is
    and where it came from.

    ``repr`` shows runs of equal layers once (``80 x Layer(...)``)."""

    name: str
    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    norm: NormKind = NormKind.RMSNORM
    norm_eps: float = 1e-5
    positions: Positions = Positions.ROPE
    max_seq: int = 4096
    rope_theta: float | None = 10000.0
    rope_scaling: tuple | None = None
    tie_embeddings: bool = False
    mtp_layers: int = 0
    weight_format: str | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self):
        for f in ("hidden", "vocab", "max_seq"):
            _positive("ModelSpec", f, getattr(self, f))
        _positive("ModelSpec", "mtp_layers", self.mtp_layers, 0)
        layers = tuple(self.layers)
        if not layers or not all(isinstance(x, Layer) for x in layers):
            raise ConfigError("layers", self.layers, "a non-empty tuple of Layer",
                              "a model needs layers", owner="ModelSpec")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "norm", NormKind(self.norm))
        object.__setattr__(self, "positions", Positions(self.positions))
        _flag("ModelSpec", "tie_embeddings", self.tie_embeddings)
        if self.positions is Positions.ROPE and not (
                isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ConfigError("rope_theta", self.rope_theta, "a number > 0",
                              "RoPE needs a base", owner="ModelSpec")

    # --- what it is ----------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return any(isinstance(x.mlp, MoE) for x in self.layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is dense."""
        return tuple(i for i, x in enumerate(self.layers) if isinstance(x.mlp, MLP))

    def uniform(self) -> Layer | None:
        """The one layer every layer equals, or None when they differ."""
        first = self.layers[0]
        return first if all(x == first for x in self.layers) else None

    def with_layers(self, count: int) -> "ModelSpec":
        """The same model with ``count`` layers (a proxy: the first ``count``, the pattern
        repeated when there are more)."""
        _positive("ModelSpec", "layers", count)
        n = self.num_layers
        return replace(self, layers=tuple(self.layers[i % n] for i in range(count)))

    def runs(self) -> list[tuple[int, Layer]]:
        """(count, layer) for each run of equal consecutive layers."""
        return [(len(list(g)), layer) for layer, g in groupby(self.layers)]

    def __repr__(self) -> str:
        runs = ", ".join(f"{n} x {layer!r}" for n, layer in self.runs())
        return (f"ModelSpec(name={self.name!r}, hidden={self.hidden}, vocab={self.vocab}, "
                f"layers=({runs}), norm={self.norm.value!r}, positions="
                f"{self.positions.value!r}, tie_embeddings={self.tie_embeddings}"
                + (f", mtp_layers={self.mtp_layers}" if self.mtp_layers else "") + ")")
