"""``ShardedOperation``: an operation whose inputs and outputs have tensor layouts.

The host conveniences shard each global input with its layout, run the per-device
program on every rank, and unshard each output with its layout (partial layouts are
summed), so ``op.run(cluster, A, B)`` takes and returns plain global numpy arrays.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from sharding import TensorSharding, shard, unshard, unshard_ranks
from vcluster.runtime.operation import Operation

__all__ = ["ShardedOperation", "run_sharded"]


def _needed_outputs(dev, program, needed, *args):
    """Run ``program``; return only the outputs the host will read from this rank
    (replicas it does not need stay on the device instead of crossing to the host)."""
    result = program(dev, *args)
    outputs = result if len(needed) > 1 else (result,)
    kept = tuple(out if dev.rank in ranks else None for out, ranks in zip(outputs, needed))
    return kept if len(needed) > 1 else kept[0]


def run_sharded(cluster, program: Callable, inputs: Sequence[tuple[np.ndarray, TensorSharding]],
                outputs: Sequence[TensorSharding], extra_args: tuple = ()):
    """Shard ``inputs``, run ``program(dev, *locals, *extra_args)`` on every rank, and
    unshard its outputs (a tuple when there are several) with ``outputs``' layouts."""
    mesh = cluster.mesh
    per_input = [shard(np.asarray(x), layout, mesh) for x, layout in inputs]
    needed = tuple(unshard_ranks(layout, mesh) for layout in outputs)
    args = [(program, needed) + tuple(pieces[r] for pieces in per_input) + tuple(extra_args)
            for r in range(mesh.size)]
    results = cluster.run(_needed_outputs, args)
    if len(outputs) == 1:
        return _join(results, outputs[0], mesh)
    return tuple(_join([res[i] for res in results], layout, mesh)
                 for i, layout in enumerate(outputs))


def _join(pieces, layout: TensorSharding, mesh) -> np.ndarray:
    """unshard, except that a replicated output is the one copy that crossed to the host
    (already a fresh array: copying 64 MiB again costs as much as the transfer)."""
    if not layout.split_axes and not layout.partial:
        return pieces[min(unshard_ranks(layout, mesh))]
    return unshard(pieces, layout, mesh)


class ShardedOperation(Operation):
    """An Operation whose host conveniences shard and unshard by tensor layouts."""

    name = "sharded operation"
