"""The model layer: what a transformer is (``ModelSpec``, presets, Hugging Face
``config.json``), what it costs (parameters, FLOPs, KV and activation bytes), and the
parallel plan it is trained under (``ParallelConfig``: enums, one rulebook,
``ConfigError``). Pure: it imports only the standard library, numpy and :mod:`mesh`.

>>> spec = load_model("llama-3.1-8b")
>>> round(parameter_count(spec).total / 1e9, 2)
8.03
"""

from .blocks import BLOCKS, GPT2_BLOCK, LLAMA_BLOCK, Block, block_named, block_of
from .choices import (DEFAULT_RECOMPUTE_MODULES, FULL_RECOMPUTE, RECOMPUTE_MODULES,
                      AttentionKernel, Choice, CPAlgorithm, FlopConvention,
                      GradReduceDtype, MLPKind, NormKind, Positions, Recompute, RouterScore,
                      ScheduleName, TPOverlap, ZeroStage)
from .counts import (FlopsPerToken, ParameterCount, activation_bytes_per_layer,
                     flops_per_token, kv_bytes_per_token, kv_cache_bytes, parameter_count,
                     rank_params)
from .errors import ConfigError
from .hf_config import from_hf_config
from .plan import (MEGATRON_VOCAB_DIVISOR, ParallelConfig, check_zero_stage, padded_vocab,
                   recompute_refusal)
from .presets import load_model, preset_info, preset_names
from .spec import MLP, Attention, LatentAttention, Layer, ModelSpec, MoE

__all__ = ["Block", "BLOCKS", "GPT2_BLOCK", "LLAMA_BLOCK", "block_named", "block_of",
           "ModelSpec", "Layer", "Attention", "LatentAttention", "MLP", "MoE",
           "from_hf_config", "load_model", "preset_names", "preset_info",
           "ParameterCount", "FlopsPerToken", "parameter_count", "flops_per_token",
           "kv_bytes_per_token", "kv_cache_bytes", "activation_bytes_per_layer",
           "rank_params", "ParallelConfig", "check_zero_stage", "ConfigError", "Choice",
           "ScheduleName", "Recompute", "AttentionKernel", "CPAlgorithm", "TPOverlap",
           "GradReduceDtype", "ZeroStage", "NormKind", "MLPKind", "Positions",
           "RouterScore", "FlopConvention", "recompute_refusal",
           "FULL_RECOMPUTE", "RECOMPUTE_MODULES", "DEFAULT_RECOMPUTE_MODULES", "padded_vocab", "MEGATRON_VOCAB_DIVISOR"]
