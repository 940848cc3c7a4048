"""``ServingPlan``: how a model is served — its parallel layout and its engine's settings,
every rule written once and raising :class:`~modeling.errors.ConfigError`.

A *replica* is one engine instance: ``tp × pp`` GPUs holding the whole model, tensor
parallel within a stage (Megatron's split of heads and MLP width, one all-reduce after
attention and one after the MLP) and pipeline parallel across stages. MoE layers put
their experts either tensor-parallel too (``ep = 1``: every expert's width split over
tp, vLLM's default) or whole on the tp ranks (``ep = tp``: vLLM's
``--enable-expert-parallel`` on one replica, E/tp experts per GPU). ``replicas``
engines serve behind a ``router``; with ``prefill_replicas`` > 0 the deployment is
*disaggregated*: prefills run on their own replicas and the KV cache moves to the
``replicas`` decode replicas.

GPUs: (replicas + prefill_replicas) · tp · pp.
"""

from __future__ import annotations

from dataclasses import dataclass

from modeling.choices import Engine, Router
from modeling.errors import ConfigError
from modeling.spec import LatentAttention, ModelSpec, MoE

from .kv_groups import kv_cache_groups

__all__ = ["ServingPlan", "VLLM_MAX_NUM_BATCHED_TOKENS", "VLLM_MAX_NUM_SEQS",
           "MXFP4_BYTES_PER_PARAM", "EXPERT_WEIGHT_BYTES"]

#: vLLM ≥ 0.8's default token budget of ``vllm serve`` on a data-centre GPU (V1 engine,
#: chunked prefill on: ``EngineArgs._set_default_args_v1``, OPENAI_API_SERVER usage context)
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
#: vLLM's ``SchedulerConfig.max_num_seqs`` default
VLLM_MAX_NUM_SEQS = 256
#: vLLM's ``CacheConfig`` defaults: 16-token blocks, 90% of the GPU's memory
VLLM_BLOCK_SIZE = 16
VLLM_GPU_MEMORY_UTILIZATION = 0.9


def _count(name, value, minimum=1, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"an integer >= {minimum}"
                          + (" (or unset)" if allow_none else ""), "not a valid count",
                          owner="ServingPlan")
    return value


#: bytes per MXFP4 parameter: 4-bit E2M1 elements with one 8-bit E8M0 scale per 32 (the OCP
#: Microscaling Formats spec v1.0), 4.25 bits — "weights are quantized to 4.25 bits per
#: parameter" (gpt-oss-120b & gpt-oss-20b model card, arXiv 2508.10925, of its MoE weights)
MXFP4_BYTES_PER_PARAM = 4.25 / 8
#: the routed-expert formats a plan may give (bytes per parameter)
EXPERT_WEIGHT_BYTES = (MXFP4_BYTES_PER_PARAM, 1, 2, 4)


@dataclass(frozen=True)
class ServingPlan:
    """A serving deployment (module docstring). Engine settings carry vLLM's names and
    defaults: ``max_num_batched_tokens`` (None: the engine's default, 8192 under
    ``vllm-v1``, no cap under ``static``), ``max_num_seqs``, ``block_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``enable_chunked_prefill``,
    ``enable_prefix_caching`` (vLLM v1's default, on), ``long_prefill_token_threshold``,
    ``hybrid_kv_cache`` (vLLM's hybrid KV-cache manager for models mixing sliding-window
    and full layers, on; off is ``--disable-hybrid-kv-cache-manager``);
    ``weight_bytes`` and ``kv_bytes`` per element
    (2: bf16; 1: FP8 weights or ``--kv-cache-dtype fp8``); ``expert_weight_bytes`` per
    routed-expert parameter when the experts are stored otherwise (None: ``weight_bytes``;
    :data:`MXFP4_BYTES_PER_PARAM`: GPT-OSS's checkpoint, MXFP4 experts beside bf16
    attention, vLLM's ``mxfp4`` quantization)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    replicas: int = 1
    prefill_replicas: int = 0
    engine: Engine = Engine.VLLM_V1
    router: Router = Router.ROUND_ROBIN
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    block_size: int = VLLM_BLOCK_SIZE
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    weight_bytes: int = 2
    kv_bytes: int = 2
    expert_weight_bytes: float | None = None
    hybrid_kv_cache: bool = True

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "replicas", "max_num_seqs", "block_size"):
            _count(name, getattr(self, name))
        _count("prefill_replicas", self.prefill_replicas, 0)
        _count("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _count("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _count("max_model_len", self.max_model_len, 2, allow_none=True)
        for name, enum in (("engine", Engine), ("router", Router)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                raise ConfigError(name, value, ", ".join(enum.values()),
                                  f"no such {name}", owner="ServingPlan") from None
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError("gpu_memory_utilization", u, "a fraction in (0, 1]",
                              "the share of each GPU's memory the engine may use",
                              owner="ServingPlan")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "hybrid_kv_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "true or false", "not a boolean",
                                  owner="ServingPlan")
        for name in ("weight_bytes", "kv_bytes"):
            if getattr(self, name) not in (1, 2, 4):
                raise ConfigError(name, getattr(self, name), "1, 2 or 4",
                                  "bytes per element of a supported dtype "
                                  "(fp8, bf16/fp16, fp32)", owner="ServingPlan")
        if self.expert_weight_bytes is not None and not any(
                self.expert_weight_bytes == b for b in EXPERT_WEIGHT_BYTES):
            raise ConfigError("expert_weight_bytes", self.expert_weight_bytes,
                              f"None or one of {', '.join(map(str, EXPERT_WEIGHT_BYTES))}",
                              "bytes per routed-expert parameter of a supported format "
                              "(MXFP4, FP8, BF16, FP32)", owner="ServingPlan")
        if self.ep not in (1, self.tp):
            raise ConfigError("ep", self.ep, f"1 or tp={self.tp}",
                              "experts are either split over the tp ranks (1) or spread "
                              "whole over them (tp), as vLLM places them on one replica",
                              owner="ServingPlan")
        if self.engine is Engine.STATIC and self.prefill_replicas:
            raise ConfigError("prefill_replicas", self.prefill_replicas, "0 with engine "
                              "static", "disaggregated serving needs a continuous-batching "
                              "engine", owner="ServingPlan")

    # --- derived ---------------------------------------------------------------------
    @property
    def uses_hybrid_kv_cache(self) -> bool:
        """Whether vLLM lays sliding-window models out in KV-cache groups: the hybrid
        manager on and no KV transfer (vLLM turns the manager off under a KV connector,
        which a disaggregated deployment needs)."""
        return self.hybrid_kv_cache and not self.disaggregated

    @property
    def routed_expert_bytes(self) -> float:
        """Bytes per routed-expert parameter: ``expert_weight_bytes``, else
        ``weight_bytes``."""
        return self.weight_bytes if self.expert_weight_bytes is None else \
            self.expert_weight_bytes

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def gpus(self) -> int:
        return (self.replicas + self.prefill_replicas) * self.gpus_per_replica

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def token_budget(self) -> int | None:
        """The engine's ``max_num_batched_tokens``, its default filled in."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return VLLM_MAX_NUM_BATCHED_TOKENS if self.engine is Engine.VLLM_V1 else None

    def scheduler_settings(self, spec: ModelSpec | None = None) -> dict:
        """The keyword arguments of :func:`serving.make_scheduler` for this engine; with
        ``spec``, its KV-cache groups' windows when it has sliding-window layers
        (:mod:`serving.kv_groups`, ``hybrid_kv_cache``)."""
        common = {"block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                  "max_model_len": self.max_model_len,
                  "max_num_batched_tokens": self.token_budget}
        if spec is not None:
            windows = kv_cache_groups(spec, self.uses_hybrid_kv_cache).windows
            if windows != (None,):
                common["kv_group_windows"] = windows
        if self.engine is Engine.VLLM_V1:
            common.update(enable_chunked_prefill=self.enable_chunked_prefill,
                          enable_prefix_caching=self.enable_prefix_caching,
                          long_prefill_token_threshold=self.long_prefill_token_threshold)
        return common

    # --- against a model -------------------------------------------------------------
    def check(self, spec: ModelSpec) -> "ServingPlan":
        """Refuse a layout ``spec`` cannot take (vLLM's own checks): tp divides the query
        heads, and the KV heads divide tp or tp divides them; pp at most the layers; ep > 1
        only for an MoE whose experts it divides; experts stored otherwise
        (``expert_weight_bytes``) only for a model that has them."""
        for i, layer in enumerate(spec.layers):
            att = layer.attention
            if att.heads % self.tp:
                raise ConfigError("tp", self.tp, f"a divisor of the {att.heads} attention heads",
                                  f"{spec.name}'s heads split evenly over tp",
                                  owner="ServingPlan")
            if not isinstance(att, LatentAttention) and att.kv_heads % self.tp \
                    and self.tp % att.kv_heads:
                raise ConfigError("tp", self.tp, f"a divisor or multiple of the {att.kv_heads} "
                                  "KV heads", f"{spec.name}'s KV heads split or replicate "
                                  "evenly over tp", owner="ServingPlan")
        if self.pp > spec.num_layers:
            raise ConfigError("pp", self.pp, f"at most the {spec.num_layers} layers",
                              "every stage needs a layer", owner="ServingPlan")
        if self.ep > 1:
            moes = [x.mlp for x in spec.layers if isinstance(x.mlp, MoE)]
            if not moes:
                raise ConfigError("ep", self.ep, "1 for a dense model",
                                  f"{spec.name} has no experts", owner="ServingPlan")
            if moes[0].experts % self.ep:
                raise ConfigError("ep", self.ep, f"a divisor of the {moes[0].experts} experts",
                                  "each GPU holds an equal share of the experts",
                                  owner="ServingPlan")
        if self.expert_weight_bytes is not None and not spec.is_moe:
            raise ConfigError("expert_weight_bytes", self.expert_weight_bytes,
                              "None for a dense model", f"{spec.name} has no routed experts "
                              "to store in another format (MXFP4 quantizes GPT-OSS's "
                              "experts)", owner="ServingPlan")
        return self
