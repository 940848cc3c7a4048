"""Which process groups a torch.distributed run needs for a mesh (pure, no torch).

``torch.distributed.new_group`` is collective: every rank must call it for every group,
members or not, in the same order. :func:`group_plan` lists, once each and in one fixed
order, the member sets of every axis group of the mesh (every non-empty subset of its
axes, each split into its groups) that have at least two members and are not the whole
world (the default group serves that). torch orders a group's members by global rank;
the mesh orders them by coordinates along the axes (``mesh.group``) — the context maps
between the two, so ``root`` and piece order keep the mesh's meaning.
"""

from __future__ import annotations

import itertools

__all__ = ["group_plan"]


def group_plan(mesh) -> tuple[tuple[int, ...], ...]:
    """Sorted member tuples of every axis group of ``mesh`` with 2..size-1 members."""
    seen: dict[tuple[int, ...], None] = {}
    for k in range(1, len(mesh.axes) + 1):
        for axes in itertools.combinations(mesh.axes, k):
            for members in mesh.groups(axes):
                key = tuple(sorted(members))
                if 1 < len(key) < mesh.size:
                    seen.setdefault(key, None)
    return tuple(seen)
