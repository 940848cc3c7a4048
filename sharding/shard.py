"""Cut a global numpy array into per-rank local arrays and put it back together.

Notation as in :mod:`sharding.spec`: dimension ``d`` (size ``L_d``) is split
over mesh axes ``A_d`` into ``k_d = prod |A_d|`` pieces, and the value is
partial over axes ``P``.  Rank ``r`` holds

    region(r) = prod_d [p_d * l_d, (p_d + 1) * l_d),   l_d = L_d / k_d,
                                                        p_d = pos_{A_d}(r),

and its local array is ``x[region(r)]`` if all of ``r``'s coordinates along
``P`` are 0, else zeros of the same shape.  Hence for every region

    x[region(r)] = sum_{q in group(P, r)} local_q.

:func:`unshard` inverts :func:`shard`: for every piece it sums the partial
group (in group order, starting from position 0) and, along mesh axes that
are neither split nor partial (replica axes), reads coordinate 0 only; the
other replicas are not inspected.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .spec import TensorSharding, check_sharding, check_shape

__all__ = ["local_shape", "shard_slices", "shard", "unshard", "unshard_ranks"]


def local_shape(shape: Sequence[int], sharding: TensorSharding, mesh) -> tuple[int, ...]:
    """Shape of every local array: ``l_d = L_d / k_d`` (uneven splits raise)."""
    dims = check_shape(shape)
    check_sharding(sharding, mesh, dims)
    return tuple(n // mesh.axis_size(d.axes) for n, d in zip(dims, sharding.dims))


def shard_slices(
    shape: Sequence[int], sharding: TensorSharding, mesh, rank: int
) -> tuple[slice, ...]:
    """``region(rank)`` as a tuple of slices into the global array."""
    local = local_shape(shape, sharding, mesh)
    out = []
    for n, d in zip(local, sharding.dims):
        p = mesh.group_position(d.axes, rank)
        out.append(slice(p * n, (p + 1) * n))
    return tuple(out)


def _holds_value(sharding: TensorSharding, mesh, rank: int) -> bool:
    """True when ``rank`` is at position 0 of its partial group."""
    return mesh.group_position(sharding.partial, rank) == 0


def shard(array, sharding: TensorSharding, mesh) -> list[np.ndarray]:
    """Local arrays of ``array`` under ``sharding``, indexed by rank.

    Each entry is an independent C-contiguous copy (never a view of ``array``).
    """
    x = np.asarray(array)
    local = local_shape(x.shape, sharding, mesh)
    out = []
    for r in range(mesh.size):
        if _holds_value(sharding, mesh, r):
            piece = x[shard_slices(x.shape, sharding, mesh, r)]
            out.append(np.array(piece, dtype=x.dtype, order="C", copy=True))
        else:
            out.append(np.zeros(local, dtype=x.dtype))
    return out


def unshard_ranks(sharding: TensorSharding, mesh) -> frozenset[int]:
    """The ranks whose local arrays :func:`unshard` reads (one replica of each piece,
    with its whole partial group); the others may be left out (passed as None)."""
    check_sharding(sharding, mesh)
    return frozenset(q for leader in mesh.group(sharding.split_axes, 0)
                     for q in mesh.group(sharding.partial, leader))


def unshard(locals_: Sequence, sharding: TensorSharding, mesh) -> np.ndarray:
    """Global array from per-rank local arrays (inverse of :func:`shard`).

    ``locals_[r]`` is rank ``r``'s array; all must share one shape.  Partial
    axes are summed in group order; replica axes are read at coordinate 0, so
    ranks outside :func:`unshard_ranks` may pass None.
    """
    if len(locals_) != mesh.size:
        raise ValueError(
            f"locals must have one array per rank ({mesh.size} for {mesh}), "
            f"got {len(locals_)}"
        )
    needed = unshard_ranks(sharding, mesh)
    missing = [r for r in sorted(needed) if locals_[r] is None]
    if missing:
        raise ValueError(f"unshard: ranks {missing} hold pieces of {sharding} but gave None")
    template = np.asarray(locals_[min(needed)])
    arrays = [template if a is None else np.asarray(a) for a in locals_]
    shape0 = arrays[0].shape
    for r, a in enumerate(arrays):
        if a.shape != shape0:
            raise ValueError(
                f"local arrays must all have the same shape; rank 0 has {shape0} "
                f"but rank {r} has {a.shape}"
            )
    check_sharding(sharding, mesh)
    if len(shape0) != sharding.ndim:
        raise ValueError(
            f"local arrays have {len(shape0)} dimensions but sharding {sharding} "
            f"describes {sharding.ndim}"
        )
    global_shape = tuple(
        n * mesh.axis_size(d.axes) for n, d in zip(shape0, sharding.dims)
    )
    out = np.empty(global_shape, dtype=np.result_type(*arrays))
    # group(split_axes, 0): one rank per piece, all other coordinates 0.
    for leader in mesh.group(sharding.split_axes, 0):
        members = mesh.group(sharding.partial, leader)
        total = arrays[members[0]].copy()
        for q in members[1:]:
            total = total + arrays[q]
        out[shard_slices(global_shape, sharding, mesh, leader)] = total
    return out
