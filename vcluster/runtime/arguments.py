"""Checks of the arguments every engine's entry points share, so that the emulator and
the torch.distributed engine refuse bad input with the same words.

* :func:`check_run_args` — ``run(fn, args_per_rank)``: one tuple of arguments per rank of
  the mesh, and a callable;
* :func:`check_root` — a collective's ``root``: a position in the group (0..size-1), not a
  global rank;
* :func:`check_peer` — a point-to-point peer: a global rank of the mesh.
"""

from __future__ import annotations

import operator

__all__ = ["check_run_args", "check_root", "check_peer"]


def check_run_args(fn, args_per_rank, ranks: int) -> list:
    """``args_per_rank`` as a list of ``ranks`` argument tuples (``None``: no arguments),
    or TypeError / ValueError naming the argument, the value and what is allowed."""
    args_per_rank = [()] * ranks if args_per_rank is None else list(args_per_rank)
    if len(args_per_rank) != ranks:
        raise ValueError(f"run: args_per_rank has {len(args_per_rank)} entries; the mesh "
                         f"has {ranks} ranks")
    for r, args in enumerate(args_per_rank):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"run: args_per_rank[{r}] must be a tuple of arguments, got "
                            f"{type(args).__name__} (wrap a single argument as (x,))")
    if not callable(fn):
        raise TypeError(f"run: fn must be callable, got {type(fn).__name__}")
    return args_per_rank


def check_root(root, size: int, what: str) -> int:
    """``root`` as an int position in a group of ``size`` members, or TypeError /
    ValueError naming the call ``what``."""
    try:
        root = operator.index(root)
    except TypeError:
        raise TypeError(f"{what}: root must be an int position in the group, "
                        f"got {root!r}") from None
    if not 0 <= root < size:
        raise ValueError(f"{what}: root={root} is not a position in a group of {size} "
                         f"(valid: 0..{size - 1}); root is a position, not a rank")
    return root


def check_peer(peer, size: int, what: str) -> int:
    """``peer`` as an int rank of a mesh of ``size`` devices, or TypeError / ValueError
    naming the call ``what``."""
    try:
        peer = operator.index(peer)
    except TypeError:
        raise TypeError(f"{what}: expected an int rank, got {peer!r}") from None
    if not 0 <= peer < size:
        raise ValueError(f"{what}: rank {peer} is not in the mesh (valid: 0..{size - 1})")
    return peer
