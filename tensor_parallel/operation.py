"""``ShardedOperation``: an operation whose inputs and outputs have tensor layouts.

The host conveniences shard each global input with its layout, run the per-device
program on every rank, and unshard each output with its layout (partial layouts are
summed), so ``op.run(cluster, A, B)`` takes and returns plain global numpy arrays.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from sharding import TensorSharding, shard, unshard
from vcluster.runtime.operation import Operation

__all__ = ["ShardedOperation", "run_sharded"]


def run_sharded(cluster, program: Callable, inputs: Sequence[tuple[np.ndarray, TensorSharding]],
                outputs: Sequence[TensorSharding], extra_args: tuple = ()):
    """Shard ``inputs``, run ``program(dev, *locals, *extra_args)`` on every rank, and
    unshard its outputs (a tuple when there are several) with ``outputs``' layouts."""
    mesh = cluster.mesh
    per_input = [shard(np.asarray(x), layout, mesh) for x, layout in inputs]
    args = [tuple(pieces[r] for pieces in per_input) + tuple(extra_args)
            for r in range(mesh.size)]
    results = cluster.run(program, args)
    if len(outputs) == 1:
        return unshard(results, outputs[0], mesh)
    return tuple(unshard([res[i] for res in results], layout, mesh)
                 for i, layout in enumerate(outputs))


class ShardedOperation(Operation):
    """An Operation whose host conveniences shard and unshard by tensor layouts."""

    name = "sharded operation"
