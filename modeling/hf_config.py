"""Hugging Face ``config.json`` -> :class:`~modeling.spec.ModelSpec`.

:func:`from_hf_config` reads the families whose ``model_type`` is in :data:`FAMILIES`:
``gpt2`` (GPT2LMHeadModel), ``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``qwen3``,
``qwen3_moe``, ``deepseek_v3``, ``gpt_oss`` and ``phi3``. Every key of the file must be known:

* an *architecture* key of its family is read into the spec (see each ``_read_*``);
* a key in :data:`NOT_MATH` is metadata, tokenizer ids, serving or initialisation
  settings and dropout rates — none changes a shape, a FLOP or a forward result of a
  trained model (vcluster models no dropout);
* any other key is refused with a :class:`~modeling.errors.ConfigError` naming it: a
  field that could change the math is never silently dropped.

A few values are checked because the spec cannot say them (e.g. Mixtral's
``router_jitter_noise`` must be 0). The presets in :mod:`modeling.presets` are such files,
read by this same loader; their extra ``_vcluster`` key carries the preset's name, source
and published parameter counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

from .choices import MLPKind, NormKind, Positions, RouterScore
from .errors import ConfigError
from .spec import MLP, Attention, LatentAttention, Layer, ModelSpec, MoE

__all__ = ["from_hf_config", "read_hf_config", "FAMILIES", "NOT_MATH", "METADATA_KEY"]

#: the preset files' own key: name, source, published parameter counts
METADATA_KEY = "_vcluster"

#: keys that change no shape, FLOP or trained forward result (module docstring)
NOT_MATH = frozenset({
    # what the file is
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "auto_map", "_name_or_path", "name_or_path", METADATA_KEY,
    # tokens and serving
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_router_logits",
    "initial_context_length", "prefix", "task_specific_params",
    # initialisation, and TP of the original checkpoint's reference code
    "initializer_range", "pretraining_tp", "ep_size",
    # dropout (vcluster models none; modern pretraining uses 0)
    "attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
    "summary_first_dropout",
    # GPT-2's sequence-classification head (not part of the language model)
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    # GPT-2's numerics options that equal the defaults vcluster runs
    "scale_attn_weights", "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx",
    "n_ctx", "output_past", "predict_special_tokens",
})

_GATED = {"silu": MLPKind.SWIGLU, "swish": MLPKind.SWIGLU, "gelu": MLPKind.GEGLU,
          "gelu_pytorch_tanh": MLPKind.GEGLU}
_GPT2_ACT = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")


class _Keys:
    """A config's keys, each to be read once; :meth:`leftover` names what nobody read."""

    def __init__(self, config: dict, where: str):
        self.config, self.where, self.read = config, where, set()

    def get(self, key, default=None):
        self.read.add(key)
        return self.config.get(key, default)

    def need(self, key):
        self.read.add(key)
        if key not in self.config:
            raise ConfigError(key, None, f"a value in {self.where}", "missing")
        return self.config[key]

    def expect(self, key, allowed: tuple, why: str):
        """Read ``key`` and refuse a value outside ``allowed`` (what the spec can say)."""
        value = self.get(key, allowed[0])
        if value not in allowed:
            raise ConfigError(key, value, " or ".join(map(repr, allowed)), why,
                              owner=self.where)
        return value

    def leftover(self) -> None:
        for key in self.config:
            if key not in self.read and key not in NOT_MATH:
                raise ConfigError(key, self.config[key], "a key vcluster reads for "
                                  f"model_type {self.config.get('model_type')!r} "
                                  "(docs/models.md lists them)",
                                  "unknown, and it may change the math: refused rather "
                                  "than dropped", owner=self.where)


def _gpt2(k: _Keys):
    h, heads = k.need("n_embd"), k.need("n_head")
    k.expect("activation_function", _GPT2_ACT, "GPT-2's MLP is a GELU")
    k.expect("n_special", (0,), "special tokens would widen the embedding")
    layer = Layer(Attention(heads, heads, h // heads, qkv_bias=True, out_bias=True),
                  MLP(MLPKind.GELU, k.get("n_inner") or 4 * h, bias=True))
    return dict(hidden=h, vocab=k.need("vocab_size"), layers=(layer,) * k.need("n_layer"),
                norm=NormKind.LAYERNORM, norm_eps=k.get("layer_norm_epsilon", 1e-5),
                positions=Positions.LEARNED, max_seq=k.need("n_positions"), rope_theta=None,
                tie_embeddings=k.get("tie_word_embeddings", True))


def _rope(k: _Keys, default_theta: float = 10000.0) -> dict:
    scaling = k.get("rope_scaling")
    return dict(positions=Positions.ROPE, rope_theta=k.get("rope_theta", default_theta),
                rope_scaling=None if scaling is None else tuple(sorted(
                    (key, tuple(v) if isinstance(v, list) else v)
                    for key, v in scaling.items())),
                max_seq=k.need("max_position_embeddings"), norm=NormKind.RMSNORM,
                norm_eps=k.get("rms_norm_eps", 1e-6))


def _gated_kind(k: _Keys) -> MLPKind:
    act = k.get("hidden_act", "silu")
    if act not in _GATED:
        raise ConfigError("hidden_act", act, ", ".join(_GATED), "not a gated activation "
                          "vcluster models", owner=k.where)
    return _GATED[act]


def _attention(k: _Keys, h: int, *, qk_norm=False, window=None, sinks=False,
               out_bias=False, bias_default=False) -> Attention:
    heads = k.need("num_attention_heads")
    bias = k.get("attention_bias", bias_default)
    return Attention(heads, k.get("num_key_value_heads") or heads,
                     k.get("head_dim") or h // heads, qk_norm=qk_norm, window=window,
                     sinks=sinks, qkv_bias=bias, out_bias=bias and out_bias)


def _window(k: _Keys, *, qwen: bool) -> int | None:
    """Mistral: ``sliding_window`` (null: none); Qwen: only with ``use_sliding_window``,
    and then only above ``max_window_layers`` layers — refused (the spec would need it)."""
    window = k.get("sliding_window")
    if not qwen:
        return window
    use = k.get("use_sliding_window", False)
    k.get("max_window_layers")
    if use:
        raise ConfigError("use_sliding_window", use, "false", "Qwen's per-layer windows "
                          "(max_window_layers) are not read yet", owner=k.where)
    return None


def _dense_family(k: _Keys, *, qwen=False, qk_norm=False, qkv_bias=False):
    h = k.need("hidden_size")
    bias = k.get("mlp_bias", False)
    # Llama's attention_bias covers q, k, v and o; Qwen2's q, k and v only
    att = _attention(k, h, qk_norm=qk_norm, window=_window(k, qwen=qwen), out_bias=not qwen,
                     bias_default=qkv_bias)
    layer = Layer(att, MLP(_gated_kind(k), k.need("intermediate_size"), bias=bias))
    return dict(hidden=h, vocab=k.need("vocab_size"),
                layers=(layer,) * k.need("num_hidden_layers"),
                tie_embeddings=k.get("tie_word_embeddings", False), **_rope(k))


def _llama(k):
    return _dense_family(k)


def _qwen2(k):
    """Qwen2 (and Qwen2.5): q, k and v carry biases without a config key saying so
    (transformers' Qwen2Attention builds them with ``bias=True``); Qwen3 says
    ``attention_bias`` (false). The base Qwen2.5 files carry ``use_mrope: false`` (plain
    RoPE); Qwen2-VL's multimodal RoPE is refused."""
    k.expect("use_mrope", (False,), "multimodal RoPE (Qwen2-VL's position sections) is "
             "not modelled")
    return _dense_family(k, qwen=True, qkv_bias=True)


def _qwen3(k):
    return _dense_family(k, qwen=True, qk_norm=True)


def _phi3(k: _Keys):
    """Phi-3: the Llama block with q, k, v and gate, up packed into one weight each (the
    same products), a sliding window as Mistral's; RoPE over the whole head only."""
    k.expect("partial_rotary_factor", (1.0,), "RoPE over a part of each head (Phi-4-mini's "
             "0.75) is not modelled")
    k.get("original_max_position_embeddings")   # LongRoPE's base length: in rope_scaling
    return _dense_family(k)


def _mixtral(k: _Keys):
    spec = _dense_family(k)
    jitter = k.get("router_jitter_noise", 0.0)
    if jitter:
        raise ConfigError("router_jitter_noise", jitter, "0", "a noisy router is not "
                          "modelled", owner=k.where)
    att, mlp = spec["layers"][0].attention, spec["layers"][0].mlp
    moe = MoE(k.need("num_local_experts"), k.need("num_experts_per_tok"), mlp,
              aux_loss_coef=k.get("router_aux_loss_coef", 0.0), normalize_top_k=True)
    spec["layers"] = (Layer(att, moe),) * len(spec["layers"])
    return spec


def _qwen3_moe(k: _Keys):
    spec = _dense_family(k, qwen=True, qk_norm=True)
    att, dense = spec["layers"][0].attention, spec["layers"][0].mlp
    step, only = k.get("decoder_sparse_step", 1), set(k.get("mlp_only_layers") or ())
    moe = MoE(k.need("num_experts"), k.need("num_experts_per_tok"),
              MLP(dense.kind, k.need("moe_intermediate_size")),
              aux_loss_coef=k.get("router_aux_loss_coef", 0.0),
              normalize_top_k=k.get("norm_topk_prob", False))
    spec["layers"] = tuple(
        Layer(att, moe if i not in only and (i + 1) % step == 0 else dense)
        for i in range(len(spec["layers"])))
    return spec


def _deepseek_v3(k: _Keys):
    h = k.need("hidden_size")
    heads = k.need("num_attention_heads")
    kv = k.get("num_key_value_heads", heads)
    if kv != heads:
        raise ConfigError("num_key_value_heads", kv, f"num_attention_heads={heads}",
                          "latent attention has one key/value head per query head",
                          owner=k.where)
    if k.get("attention_bias", False):
        raise ConfigError("attention_bias", True, "false", "MLA has no biases", owner=k.where)
    att = LatentAttention(heads, k.get("q_lora_rank"), k.need("kv_lora_rank"),
                          k.need("qk_nope_head_dim"), k.need("qk_rope_head_dim"),
                          k.need("v_head_dim"))
    kind = _gated_kind(k)
    dense = MLP(kind, k.need("intermediate_size"))
    router = {"sigmoid": RouterScore.SIGMOID, "softmax": RouterScore.SOFTMAX}
    score = k.expect("scoring_func", ("sigmoid", "softmax"), "the router's score")
    k.expect("topk_method", ("noaux_tc", "greedy", "group_limited_greedy"),
             "how top-k is chosen")
    groups = (k.get("n_group", 1), k.get("topk_group", 1))
    aux = k.get("aux_loss_alpha", 0.0) if k.get("seq_aux", True) else 0.0
    moe = MoE(k.need("n_routed_experts"), k.need("num_experts_per_tok"),
              MLP(kind, k.need("moe_intermediate_size")),
              shared_experts=k.get("n_shared_experts") or 0,
              router=router[score], aux_loss_coef=aux,
              normalize_top_k=k.get("norm_topk_prob", False),
              routed_scaling=k.get("routed_scaling_factor", 1.0),
              groups=None if groups == (1, 1) else groups)
    first, freq = k.get("first_k_dense_replace", 0), k.get("moe_layer_freq", 1)
    layers = tuple(Layer(att, moe if i >= first and i % freq == 0 else dense)
                   for i in range(k.need("num_hidden_layers")))
    quant = k.get("quantization_config")
    return dict(hidden=h, vocab=k.need("vocab_size"), layers=layers,
                tie_embeddings=k.get("tie_word_embeddings", False),
                mtp_layers=k.get("num_nextn_predict_layers", 0),
                weight_format=quant.get("quant_method") if quant else None, **_rope(k))


def _gpt_oss(k: _Keys):
    h = k.need("hidden_size")
    types = k.need("layer_types")
    window = k.need("sliding_window")
    n = k.need("num_hidden_layers")
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError("layer_types", types, f"{n} of sliding_attention / full_attention",
                          "one attention type per layer", owner=k.where)
    k.get("experts_per_token")           # the original checkpoint's name of the same value
    top_k = k.need("num_experts_per_tok")
    if k.config.get("experts_per_token", top_k) != top_k:
        raise ConfigError("experts_per_token", k.config["experts_per_token"],
                          f"num_experts_per_tok={top_k}", "two different top-k values",
                          owner=k.where)
    expert = MLP(_gated_kind(k), k.need("intermediate_size"), bias=True,
                 clamp=k.get("swiglu_limit"))
    moe = MoE(k.need("num_local_experts"), top_k, expert, router_bias=True,
              aux_loss_coef=k.get("router_aux_loss_coef", 0.0), normalize_top_k=True)
    atts = {t: _attention(k, h, sinks=True, out_bias=True,
                          window=window if t == "sliding_attention" else None)
            for t in set(types)}
    quant = k.get("quantization_config")
    return dict(hidden=h, vocab=k.need("vocab_size"),
                layers=tuple(Layer(atts[t], moe) for t in types),
                tie_embeddings=k.get("tie_word_embeddings", False),
                weight_format=quant.get("quant_method") if quant else None, **_rope(k))


#: model_type -> reader of its architecture keys
FAMILIES = MappingProxyType({
    "gpt2": _gpt2, "llama": _llama, "mistral": _llama, "mixtral": _mixtral,
    "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss, "phi3": _phi3,
})


def read_hf_config(path) -> dict:
    """The JSON object of a ``config.json`` file (ConfigError when it is not one)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("model", str(path), "a preset name (vcluster model list) or a "
                          "Hugging Face config.json", "no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model", str(path), "a Hugging Face config.json",
                          f"not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError("model", str(path), "a JSON object", "not a config.json")
    return config


def from_hf_config(source, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face config: a path to ``config.json`` (or a
    folder holding one) or the parsed dict. ``name`` defaults to the preset name in the
    file's ``_vcluster`` key, else the file's folder or stem."""
    where = "config"
    if isinstance(source, dict):
        config = source
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        config, where = read_hf_config(path), str(path)
        if name is None:
            name = path.parent.name if path.name == "config.json" else path.stem
    meta = config.get(METADATA_KEY) or {}
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError("model_type", model_type, ", ".join(FAMILIES),
                          "not a family vcluster reads", owner=where)
    keys = _Keys(config, where)
    fields = FAMILIES[model_type](keys)
    keys.leftover()
    return ModelSpec(name=meta.get("name") or name or model_type,
                     source=meta.get("source", where), **fields)
