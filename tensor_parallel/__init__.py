"""Tensor parallelism: sharded MatMul (five policies) and FeedForward, forward and backward."""

from .matmul import MatMul, global_shape, local_matmul, matmul_accumulate
from .matmul_sharding import MatMulPlan, MatMulSharding, MatMulShardingPolicy, transpose_layout
from .operation import ShardedOperation, run_sharded
from .ffn import ACTIVATIONS, Activation, FeedForward
from .ffn_sharding import FeedForwardCollectives, FeedForwardSharding, FeedForwardShardingPolicy

__all__ = ["MatMul", "MatMulSharding", "MatMulShardingPolicy", "MatMulPlan", "ShardedOperation",
           "run_sharded", "global_shape", "local_matmul", "matmul_accumulate", "transpose_layout"]
__all__ += ["FeedForward", "FeedForwardSharding", "FeedForwardShardingPolicy",
            "FeedForwardCollectives", "Activation", "ACTIVATIONS"]
from .attention import Attention, TransformerOps, batched_matmul
from .transformer import (RECOMPUTE, TransformerLayer, TransformerStage, VocabParallelEmbedding,
                          VocabParallelHead)

__all__ += ["Attention", "TransformerOps", "batched_matmul", "TransformerLayer",
            "TransformerStage", "VocabParallelEmbedding", "VocabParallelHead", "RECOMPUTE"]
from .gqa import GQAttention
from .llama import LlamaLayer
from .mla import MLAttention

__all__ += ["GQAttention", "LlamaLayer", "MLAttention"]
from .context_parallel import (CP_ALGORITHMS, ContextParallelAttention, causal_chunk_pairs,
                               chunk_ids, join_sequence, sequence_order, sequence_positions,
                               split_sequence)

__all__ += ["ContextParallelAttention", "CP_ALGORITHMS", "chunk_ids", "sequence_positions",
            "sequence_order", "split_sequence", "join_sequence", "causal_chunk_pairs"]
from .moe import MOE_TAG, MoE
from .moe_load import ExpertLoad, MoEGradients, MoEOutput

__all__ += ["MoE", "ExpertLoad", "MoEOutput", "MoEGradients", "MOE_TAG"]
from .moe_layer import LlamaMoELayer, llama_moe_stage

__all__ += ["LlamaMoELayer", "llama_moe_stage"]
