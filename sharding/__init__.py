"""Tensor layouts over a named mesh, numpy shard/unshard helpers, and redistribution."""

from .redistribute import (MESSAGE_ALGORITHMS, RedistributePlan, RedistributeStep,
                           plan_redistribute, redistribute)
from .html import layout_html, sharding_html
from .shard import local_shape, shard, shard_slices, unshard, unshard_ranks
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
    "unshard_ranks",
    "RedistributeStep",
    "RedistributePlan",
    "plan_redistribute",
    "redistribute",
    "MESSAGE_ALGORITHMS",
    "sharding_html",
    "layout_html",
]
