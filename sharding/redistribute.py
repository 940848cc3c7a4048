"""Change a tensor's layout: plan it (pure), then execute it inside a device program.

A plan is a short list of steps, each one collective (or local operation) over ONE mesh
axis x of size n, on the local array of |x| bytes::

    step                  layout change of x                          bytes sent per device
    all_gather(x, dim=d)  S(..., x) on d  -> not used                 (n-1)·|x|
    all_reduce(x)         partial        -> not used                  2(n-1)/n·|x|
    reduce_scatter(x, d)  partial        -> S(..., x) on d            (n-1)/n·|x|
    all_to_all(x, i->j)   S(..., x) on i -> S(..., x) on j            (n-1)/n·|x|
    slice(x, dim=d)       not used       -> S(..., x) on d            0 (local)
    partial(x)            not used       -> partial (value at position 0, zeros elsewhere)   0

(byte counts: ring / pairwise closed forms). The local steps move no bytes between devices
but are real work, declared as ``dev.compute`` blocks so that timing models price them:
a slice copies its piece (reads and writes |x|/n bytes), a partial writes zeros.
Only the minor-most axis of a dimension can
be gathered or moved, and a new split always becomes the minor-most, because those are
the changes that keep every local piece contiguous in the global array.

:func:`plan_redistribute` searches these steps with Dijkstra's algorithm over layouts,
so the plan moves no more bytes than the cheapest such sequence (ties: fewer steps).
The search first moves only the axes whose placement differs between the two layouts
(so ``P(tp) -> R`` is one ``all_reduce(tp)``, not a detour that slices the replicas along
another axis); only when no such plan exists does it move other axes temporarily.
It prints like ``[S(tp), R] -> [R, R]: all_gather(tp, dim=0)``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

from .spec import TensorSharding, check_sharding, check_shape

__all__ = ["RedistributeStep", "RedistributePlan", "plan_redistribute", "redistribute",
           "MESSAGE_ALGORITHMS"]

# The algorithms whose traffic the plan's byte counts describe.
MESSAGE_ALGORITHMS = MappingProxyType({"all_gather": "ring", "reduce_scatter": "ring",
                                       "all_reduce": "ring", "all_to_all": "pairwise"})
_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "slice", "partial")


@dataclass(frozen=True)
class RedistributeStep:
    """One step over mesh axis ``axis``; ``dim`` (and ``to_dim`` for all_to_all)."""

    kind: str
    axis: str
    dim: int | None = None
    to_dim: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"step kind must be one of {_KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        if self.kind == "all_to_all":
            return f"all_to_all({self.axis}, {self.dim}->{self.to_dim})"
        if self.dim is None:
            return f"{self.kind}({self.axis})"
        return f"{self.kind}({self.axis}, dim={self.dim})"


@dataclass(frozen=True)
class RedistributePlan:
    """The steps from ``src`` to ``dst`` for a global ``shape``; ``bytes_per_device`` is
    the total of the table above over the steps (the cost the planner minimised)."""

    src: TensorSharding
    dst: TensorSharding
    shape: tuple[int, ...]
    steps: tuple[RedistributeStep, ...]
    bytes_per_device: float

    def __str__(self) -> str:
        body = ", ".join(str(s) for s in self.steps) or "no communication"
        return f"{self.src} -> {self.dst}: {body}"

    @property
    def is_identity(self) -> bool:
        return not self.steps

    def local_shapes(self, mesh) -> list[tuple[int, ...]]:
        """The local shape before each step, and after the last (len(steps) + 1 shapes)."""
        sizes = dict(mesh.shape)
        state = _state(self.src)
        shapes = [tuple(_local_elements(self.shape, state[0], sizes))]
        for step in self.steps:
            state = _apply(state, step)
            shapes.append(tuple(_local_elements(self.shape, state[0], sizes)))
        return shapes


# A layout during the search: (tuple of axes per dim, frozenset of partial axes).
_State = tuple[tuple[tuple[str, ...], ...], frozenset]


def _state(s: TensorSharding) -> _State:
    return tuple(d.axes for d in s.dims), frozenset(s.partial)


def _local_elements(shape, dims, sizes) -> list[int]:
    out = []
    for n, axes in zip(shape, dims):
        for a in axes:
            n //= sizes[a]
        out.append(n)
    return out


def _placement(state: _State, axis: str):
    """Where ``axis`` is in a layout: ("dim", d, position), ("partial",) or ("unused",)."""
    dims, partial = state
    if axis in partial:
        return ("partial",)
    for d, axes in enumerate(dims):
        if axis in axes:
            return ("dim", d, axes.index(axis))
    return ("unused",)


def _apply(state: _State, step: RedistributeStep) -> _State:
    dims, partial = state
    x = step.axis

    def append(ds, d):
        return ds[:d] + (ds[d] + (x,),) + ds[d + 1:]

    def drop(ds, d):
        return ds[:d] + (ds[d][:-1],) + ds[d + 1:]

    if step.kind == "all_gather":
        return drop(dims, step.dim), partial
    if step.kind == "all_reduce":
        return dims, partial - {x}
    if step.kind == "reduce_scatter":
        return append(dims, step.dim), partial - {x}
    if step.kind == "all_to_all":
        return append(drop(dims, step.dim), step.to_dim), partial
    if step.kind == "slice":
        return append(dims, step.dim), partial
    return dims, partial | {x}


def _moves(state: _State, shape, sizes, itemsize, movable):
    """Every single-axis step from ``state`` on a ``movable`` axis: (step, next, bytes),
    each step as the fields of a :class:`RedistributeStep` (kind, axis, dim, to_dim) —
    a search looks at hundreds of thousands of them and keeps a few."""
    dims, partial = state
    local = _local_elements(shape, dims, sizes)
    nbytes = math.prod(local) * itemsize
    used = {a for axes in dims for a in axes} | partial
    for x, n in sizes.items():
        if x not in movable:
            continue
        if x in partial:
            yield ("all_reduce", x, None, None), (dims, partial - {x}), 2 * (n - 1) / n * nbytes
            for d in range(len(dims)):
                if local[d] % n == 0:
                    new = dims[:d] + (dims[d] + (x,),) + dims[d + 1:]
                    yield ("reduce_scatter", x, d, None), (new, partial - {x}), \
                        (n - 1) / n * nbytes
        elif x not in used:
            yield ("partial", x, None, None), (dims, partial | {x}), 0.0
            for d in range(len(dims)):
                if local[d] % n == 0:
                    new = dims[:d] + (dims[d] + (x,),) + dims[d + 1:]
                    yield ("slice", x, d, None), (new, partial), 0.0
        for i, axes in enumerate(dims):
            if not axes or axes[-1] != x:
                continue
            removed = dims[:i] + (axes[:-1],) + dims[i + 1:]
            yield ("all_gather", x, i, None), (removed, partial), (n - 1) * nbytes
            for j in range(len(dims)):
                if j != i and local[j] % n == 0:
                    new = removed[:j] + (removed[j] + (x,),) + removed[j + 1:]
                    yield ("all_to_all", x, i, j), (new, partial), (n - 1) / n * nbytes


def plan_redistribute(src: TensorSharding, dst: TensorSharding, mesh, shape: Sequence[int],
                      itemsize: int = 8) -> RedistributePlan:
    """The cheapest plan (bytes sent per device, then steps) from ``src`` to ``dst``."""
    shape = check_shape(shape)
    for name, s in (("src", src), ("dst", dst)):
        try:
            check_sharding(s, mesh, shape)
        except ValueError as exc:
            raise ValueError(f"redistribute: {name} layout {s}: {exc}") from None
    sizes = dict(mesh.shape)
    start, goal = _state(src), _state(dst)
    # First only touch the axes whose placement differs (no detours through axes that
    # end where they started); if that is impossible, allow every axis.
    changing = {a for a in sizes if _placement(start, a) != _placement(goal, a)}
    plan = _search(start, goal, shape, sizes, itemsize, changing)
    if plan is None:
        plan = _search(start, goal, shape, sizes, itemsize, set(sizes))
    if plan is None:
        raise ValueError(f"redistribute: no plan from {src} to {dst} for shape {shape} "
                         f"on {mesh}")
    steps, cost = plan
    return RedistributePlan(src, dst, shape, steps, cost)


def _search(start: _State, goal: _State, shape, sizes, itemsize, movable):
    """Dijkstra over layouts; returns (steps, bytes) or None."""
    tie = itertools.count()
    frontier = [(0.0, 0, next(tie), start, ())]
    best: dict[_State, tuple[float, int]] = {start: (0.0, 0)}
    while frontier:
        cost, nsteps, _, state, steps = heapq.heappop(frontier)
        if state == goal:
            return tuple(RedistributeStep(*step) for step in steps), cost
        if best.get(state, (float("inf"), 0)) < (cost, nsteps):
            continue
        for step, nxt, step_bytes in _moves(state, shape, sizes, itemsize, movable):
            key = (cost + step_bytes, nsteps + 1)
            if key < best.get(nxt, (float("inf"), 0)):
                best[nxt] = key
                heapq.heappush(frontier, (key[0], key[1], next(tie), nxt, steps + (step,)))
    return None


def redistribute(dev, x, plan: RedistributePlan,
                 algorithms: Mapping[str, str] | None = None):
    """Run ``plan`` on this device's local array ``x`` (inside a per-device program).

    ``algorithms`` maps a collective to the algorithm to use (default: each call's auto).
    """
    algorithms = algorithms or {}
    for step in plan.steps:
        alg = algorithms.get(step.kind, "auto")
        if step.kind == "all_gather":
            x = dev.all_gather(x, step.axis, dim=step.dim, algorithm=alg)
        elif step.kind == "all_reduce":
            x = dev.all_reduce(x, step.axis, algorithm=alg)
        elif step.kind == "reduce_scatter":
            x = dev.reduce_scatter(x, step.axis, dim=step.dim, algorithm=alg)
        elif step.kind == "all_to_all":
            x = dev.all_to_all(x, step.axis, split_dim=step.to_dim, concat_dim=step.dim,
                               algorithm=alg)
        else:
            group = dev.mesh.group(step.axis, dev.rank)
            pos = group.index(dev.rank)
            if step.kind == "slice":
                piece = np.split(x, len(group), axis=step.dim)[pos]
                with dev.compute(f"slice({step.axis}, dim={step.dim})", flops=0,
                                 bytes=2 * piece.nbytes):        # read + write: a real copy
                    x = piece.copy()    # C-contiguous (numpy, cupy and meta arrays)
            elif pos != 0:   # partial: the value stays at position 0
                with dev.compute(f"partial({step.axis}): zeros", flops=0, bytes=x.nbytes):
                    x = np.zeros_like(x)
    return x
