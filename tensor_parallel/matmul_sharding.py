"""How C = A @ B splits over a mesh: layouts, policy, and the plan that computes it.

``MatMulSharding(a, b, c)`` gives the layouts of A (m, k), B (k, n) and C (m, n). Its
policy says which of m, k, n are split (cut into more than one piece) by the inputs:

* ``Unsharded``: none. Every device computes the product it needs (all of C, or just
  its piece of C when c is sharded — slicing replicated inputs is free). Traffic: 0.
* ``MatchedInnerSharding``: only k, over the same axes (n devices) on A and B:
  A = [A_1 ... A_n], B = [B_1; ...; B_n], C = sum_i A_i B_i; each device's product is a
  partial C, closed by all-reduce — 2(n-1)/n·|C| bytes sent per device (ring) — or by
  reduce-scatter when c is split over those axes — (n-1)/n·|C|.
* ``UnmatchedInnerSharding``: only k, split differently on A and B: one side is
  re-split to match the other by the cheapest redistribution, then as above. E.g.
  A [R, S(tp)], B [S(dp), R], C [R, R] on dp=2 x tp=4: B becomes [S(tp), R] by
  slice(tp) on n, all_gather(dp) on k and all_to_all(tp) from n to k —
  |B|/8 + 3/4·|B|/4 = 5/16·|B| bytes, less than gathering B's k (|B|/2) — and C is
  closed by all_reduce(tp): 2·3/4·|C|.
* ``OuterSharding``: m and/or n split, not all three: C's rows follow A's and its
  columns B's; a split k on either side becomes a partial C as above. E.g. A [S(dp), S(tp)],
  B [R, R], C [S(dp), R] on 2 x 4: B is sliced (free), C_local = |C|/2 is all-reduced over
  tp: 2·3/4·|C|/2 bytes.
* ``FullSharding``: m, k and n all split (e.g. A [S(x), S(y)], B [S(y), S(z)]): each
  device multiplies blocks A_{x,y} B_{y,z}, a partial C_{x,z} summed over y: with
  C [S(x), S(z)] on 2 x 2 x 2, an all-reduce over y of |C|/4 bytes: 2·1/2·|C|/4.

Every redistribution's bytes are those of :mod:`sharding.redistribute`; ``MatMul.explain``
lists them per device and step, and they equal what the emulator counts.

The plan: choose *compute layouts* a* = [M, K] and b* = [K, N] (K the same axes on both
sides, every axis used once) from the candidates the inputs and the output suggest;
redistribute A -> a*, B -> b*; multiply locally, which gives c* = [M, N] partial over K
(and over the inputs' partial axes); redistribute c* -> c. Among valid candidates the
plan minimises the FLOPs per device first (no redundant compute where the layouts allow
it), then the bytes of the three redistributions, then their number of steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from sharding import RedistributePlan, TensorSharding, check_sharding, plan_redistribute

__all__ = ["MatMulShardingPolicy", "MatMulSharding", "MatMulPlan", "transpose_layout"]


class MatMulShardingPolicy(Enum):
    Unsharded = "Unsharded"
    MatchedInnerSharding = "MatchedInnerSharding"
    UnmatchedInnerSharding = "UnmatchedInnerSharding"
    OuterSharding = "OuterSharding"
    FullSharding = "FullSharding"


def transpose_layout(s: TensorSharding) -> TensorSharding:
    """The layout of x.T when x has layout ``s`` (2-D)."""
    return TensorSharding(s.dims[1], s.dims[0], partial=s.partial)


def _prod(mesh, axes) -> int:
    return mesh.axis_size(axes) if axes else 1


@dataclass(frozen=True)
class MatMulPlan:
    """Compute layouts and the three redistributions of one MatMul on one mesh."""

    a_compute: TensorSharding
    b_compute: TensorSharding
    c_compute: TensorSharding
    a_plan: RedistributePlan
    b_plan: RedistributePlan
    c_plan: RedistributePlan
    local_shape: tuple[int, int, int]      # (m, k, n) of each device's product

    @property
    def flops_per_device(self) -> int:
        m, k, n = self.local_shape
        return 2 * m * k * n

    @property
    def bytes_per_device(self) -> float:
        return sum(p.bytes_per_device for p in (self.a_plan, self.b_plan, self.c_plan))

    def __str__(self) -> str:
        return "\n".join([f"A: {self.a_plan}", f"B: {self.b_plan}",
                          f"local C{list(self.local_shape)[::2]} = A{list(self.local_shape[:2])} "
                          f"@ B{list(self.local_shape[1:])}  ({self.flops_per_device} FLOPs)",
                          f"C: {self.c_plan}"])


@dataclass(frozen=True)
class MatMulSharding:
    """Layouts of A (m, k), B (k, n) and C = A @ B (m, n); see the module docstring."""

    a: TensorSharding
    b: TensorSharding
    c: TensorSharding

    def __post_init__(self):
        for name in ("a", "b", "c"):
            s = getattr(self, name)
            if not isinstance(s, TensorSharding):
                raise TypeError(f"MatMulSharding: {name} must be a TensorSharding, got {s!r}")
            if s.ndim != 2:
                raise ValueError(f"MatMulSharding: {name} must describe a 2-D array, got {s} "
                                 f"({s.ndim} dimensions)")

    def __str__(self) -> str:
        return f"A{self.a} @ B{self.b} -> C{self.c}"

    @property
    def policy(self) -> MatMulShardingPolicy:
        """The policy when every named axis has more than one device."""
        return self._classify(lambda axis: True)

    def policy_on(self, mesh) -> MatMulShardingPolicy:
        """The policy on ``mesh``: an axis of size 1 splits nothing."""
        self.validate(mesh)
        return self._classify(lambda axis: mesh.shape[axis] > 1)

    def _classify(self, splits) -> MatMulShardingPolicy:
        def eff(axes):
            return tuple(x for x in axes if splits(x))
        m, ka, kb, n = (eff(self.a.dims[0].axes), eff(self.a.dims[1].axes),
                        eff(self.b.dims[0].axes), eff(self.b.dims[1].axes))
        P = MatMulShardingPolicy
        k = bool(ka or kb)
        if not (m or k or n):
            return P.Unsharded
        if k and not (m or n):
            return P.MatchedInnerSharding if ka == kb else P.UnmatchedInnerSharding
        if m and k and n:
            return P.FullSharding
        return P.OuterSharding

    def validate(self, mesh, a_shape=None, b_shape=None) -> None:
        """Check axes against ``mesh`` and, given shapes, that the product is defined and
        every layout splits its dimensions evenly."""
        for name, s in (("a", self.a), ("b", self.b), ("c", self.c)):
            try:
                check_sharding(s, mesh)
            except ValueError as exc:
                raise ValueError(f"MatMulSharding {name}: {exc}") from None
        if a_shape is None or b_shape is None:
            return
        a_shape, b_shape = tuple(a_shape), tuple(b_shape)
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != b_shape[0]:
            raise ValueError(f"MatMul: A of shape {a_shape} and B of shape {b_shape} cannot be "
                             "multiplied (need A (m, k) and B (k, n))")
        for name, s, shape in (("a", self.a, a_shape), ("b", self.b, b_shape),
                               ("c", self.c, (a_shape[0], b_shape[1]))):
            try:
                check_sharding(s, mesh, shape)
            except ValueError as exc:
                raise ValueError(f"MatMulSharding {name} = {s} for shape {shape}: {exc}") from None

    def plan(self, mesh, a_shape, b_shape, itemsize: int = 8) -> MatMulPlan:
        """The cheapest valid compute layouts and their redistributions.

        A pure function of its arguments, and a search (0.2-10 ms on a 2 x 2 x 2 mesh,
        most of it :func:`~sharding.plan_redistribute`'s), so it is memoised per process:
        a device plans each layout once in its life, not once per run of a program that
        builds (or receives) its ops afresh. The validation is memoised with it (a hit
        costs ~1 us, validating ~10 us: it ran on every call of a hot path)."""
        a_shape, b_shape = tuple(a_shape), tuple(b_shape)
        # the element types join the key: (16.0, 64) == (16, 64), but only ints are valid
        return _plan(self, mesh, a_shape, b_shape, itemsize,
                     tuple(map(type, a_shape + b_shape)))


@lru_cache(maxsize=512)   # pure: (sharding, mesh, shapes, itemsize, their types) -> plan
def _plan(sharding: MatMulSharding, mesh, a_shape: tuple, b_shape: tuple, itemsize,
          _types: tuple) -> MatMulPlan:
    """:meth:`MatMulSharding.plan`, validation included (memoised)."""
    sharding.validate(mesh, a_shape, b_shape)
    (m, k), n, itemsize = map(int, a_shape), int(b_shape[1]), int(itemsize)
    a, b, c = sharding.a, sharding.b, sharding.c

    def options(*axes_lists):
        return list(dict.fromkeys(tuple(x) for x in axes_lists))

    best = None
    for M, K, N, PA, PB in itertools.product(
            options(a.dims[0].axes, c.dims[0].axes, ()),
            options(a.dims[1].axes, b.dims[0].axes, c.partial, ()),
            options(b.dims[1].axes, c.dims[1].axes, ()),
            options(a.partial, ()), options(b.partial, ())):
        groups = (M, K, N, PA, PB)
        flat = [x for g in groups for x in g]
        if len(flat) != len(set(flat)):
            continue          # an axis used twice (a partial input would meet the other side)
        if m % _prod(mesh, M) or k % _prod(mesh, K) or n % _prod(mesh, N):
            continue
        a_star = TensorSharding(M or None, K or None, partial=PA)
        b_star = TensorSharding(K or None, N or None, partial=PB)
        c_star = TensorSharding(M or None, N or None, partial=K + PA + PB)
        plans = (plan_redistribute(a, a_star, mesh, (m, k), itemsize),
                 plan_redistribute(b, b_star, mesh, (k, n), itemsize),
                 plan_redistribute(c_star, c, mesh, (m, n), itemsize))
        local = (m // _prod(mesh, M), k // _prod(mesh, K), n // _prod(mesh, N))
        key = (local[0] * local[1] * local[2], sum(p.bytes_per_device for p in plans),
               sum(len(p.steps) for p in plans))
        if best is None or key < best[0]:
            best = (key, MatMulPlan(a_star, b_star, c_star, *plans, local))
    if best is None:   # pragma: no cover - all-replicated compute is always valid
        raise ValueError(f"MatMul: no valid compute layout for {sharding} on {mesh}")
    return best[1]
