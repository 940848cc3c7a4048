"""Tensor layouts over a named mesh, and numpy shard/unshard helpers."""

from .shard import local_shape, shard, shard_slices, unshard
from .spec import DimArg, DimSharding, TensorSharding, check_shape, check_sharding

__all__ = [
    "DimSharding",
    "TensorSharding",
    "DimArg",
    "check_sharding",
    "check_shape",
    "local_shape",
    "shard_slices",
    "shard",
    "unshard",
]
