"""Tensor parallelism: sharded MatMul (five policies) and FeedForward, forward and backward."""

from .matmul import MatMul, global_shape, local_matmul
from .matmul_sharding import MatMulPlan, MatMulSharding, MatMulShardingPolicy, transpose_layout
from .operation import ShardedOperation, run_sharded

__all__ = ["MatMul", "MatMulSharding", "MatMulShardingPolicy", "MatMulPlan", "ShardedOperation",
           "run_sharded", "global_shape", "local_matmul", "transpose_layout"]
