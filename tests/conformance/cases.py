"""Cases: one collective call each; inputs and the numpy reference."""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

from .base import *  # noqa: F401,F403  (shared names)
from .base import _FILL, _RTOL  # noqa: F401


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One collective call, issued by every rank of the mesh over its group."""

    collective: str
    axis: object = None                 # None, a name, or a tuple of names
    algorithm: str = "auto"
    dtype: str = "float64"
    shape: tuple = (5,)                 # per-rank input shape (already fitted)
    kwargs: tuple = ()                  # sorted (name, value) pairs: op, dim, root, ...
    out: str = "none"                   # none | numpy | empty | strided | inplace
    exact: bool = False                 # reductions: bit-exact group-order result
    values: str = "normal"              # normal | wide (mixed magnitudes)
    layout: str = "plain"               # input as passed | copied to dev.empty | strided view

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {self.collective!r}")
        if self.out not in OUT_MODES:
            raise ValueError(f"unknown out mode {self.out!r}")
        if self.out == "inplace" and self.collective not in INPLACE_COLLECTIVES:
            raise ValueError(f"{self.collective} has no in-place form")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}")

    @property
    def kw(self) -> dict:
        return dict(self.kwargs)

    def label(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        extra = "" if self.out == "none" else f", out={self.out}"
        extra += "" if self.layout == "plain" else f", input={self.layout}"
        return (f"{self.collective}(axis={self.axis!r}, {self.dtype}{list(self.shape)}"
                f"{', ' + args if args else ''}, algorithm={self.algorithm})")

    def spec(self) -> tuple:
        """What the device program needs, as plain builtins (no import of this module)."""
        return (self.collective, self.axis, self.algorithm, self.dtype, self.kw, self.out,
                self.layout)


def make_case(collective, axis=None, algorithm="auto", dtype="float64", shape=(5,),
              out="none", exact=False, values="normal", layout="plain", **kwargs) -> Case:
    return Case(collective, axis, algorithm, str(np.dtype(dtype)), tuple(shape),
                tuple(sorted(kwargs.items())), out, exact, values, layout)


def axis_choices(mesh) -> list:
    """None plus every ordered subset of the mesh's axes (a name when it has one axis)."""
    out: list = [None]
    for k in range(len(mesh.axes) + 1):
        for combo in itertools.permutations(mesh.axes, k):
            out.append(combo[0] if k == 1 else combo)
    return out


def group_size(mesh, axis) -> int:
    return len(mesh.group(axis, 0))


def roots_for(n: int) -> list[int]:
    """Every root of a small group; first, middle and last of a larger one."""
    return list(range(n)) if n <= 4 else sorted({0, n // 2, n - 1})


def dims_for(ndim: int) -> list[int]:
    return {0: [], 1: [0], 2: [0, 1], 3: [0, -2, -1]}.get(ndim, [0, -1])


def dim_pairs_for(ndim: int) -> list[tuple[int, int]]:
    """(split_dim, concat_dim) pairs of all_to_all."""
    return {0: [], 1: [(0, 0)], 2: [(0, 0), (0, 1), (1, 0), (1, 1)],
            3: [(0, 2), (1, 0), (-1, 1), (2, 2)]}.get(ndim, [(0, 0)])


def fit_shape(shape: tuple, dim: int, n: int) -> tuple:
    """``shape`` with ``shape[dim]`` rounded up to a multiple of n (0 stays 0)."""
    shape = list(shape)
    d = dim % len(shape)
    shape[d] = -(-shape[d] // n) * n
    return tuple(shape)


def _zip_cycle(a: list, b: list) -> list[tuple]:
    """Pairs (a[i % len a], b[i % len b]) until both lists are used up: every value of
    each appears at least once, without the cross product."""
    if not a or not b:
        return []
    return [(a[i % len(a)], b[i % len(b)]) for i in range(max(len(a), len(b)))]


def _variants(collective: str, shape: tuple, n: int, ops) -> list:
    """(input shape, kwargs) of one collective for one base shape and group size:
    every op, every root (:func:`roots_for`) and every dim (:func:`dims_for`) once."""
    ndim, roots, dims = len(shape), roots_for(n), dims_for(len(shape))
    if collective == "all_reduce":
        return [(shape, {"op": op}) for op in ops]
    if collective == "reduce":
        return [(shape, {"op": op, "root": r}) for op, r in _zip_cycle(list(ops), roots)]
    if collective == "broadcast":
        return [(shape, {"root": r}) for r in roots]
    if collective == "all_gather":
        return [(shape, {"dim": d}) for d in dims]
    if collective == "gather":
        return [(shape, {"dim": d, "root": r}) for d, r in _zip_cycle(dims, roots)]
    if collective == "scatter":
        return [(fit_shape(shape, d, n), {"dim": d, "root": r})
                for d, r in _zip_cycle(dims, roots)]
    if collective == "reduce_scatter":
        return [(fit_shape(shape, d, n), {"dim": d, "op": op})
                for d, op in _zip_cycle(dims, list(ops))]
    if collective == "all_to_all":
        return [(fit_shape(shape, s, n), {"split_dim": s, "concat_dim": c})
                for s, c in dim_pairs_for(ndim)]
    return []


def enumerate_cases(mesh, collective: str, axes=(None,), algorithms=("auto",),
                    dtypes=DTYPES, shapes=tuple(SHAPES), ops=OPS, out="none",
                    exact_algorithms=(), rotate_axes=False, rotate_shapes=False,
                    rotate_ops=False, values="normal", layout="plain") -> list[Case]:
    """Cases of one collective: algorithms x dtypes x shapes x ops (with every root and
    dim per shape, see :func:`_variants`).

    ``axes``: the groups to use; every case runs over each of them, or over one of them
    in turn with ``rotate_axes``. ``shapes``: names from :data:`SHAPES` (or tuples);
    ``rotate_shapes`` uses one per (axis, algorithm, dtype) in turn instead of all, and
    ``rotate_ops`` one op per shape in turn.
    ``avg`` is skipped for integer dtypes (it must raise, see :func:`error_cases`).
    ``exact_algorithms``: algorithms whose reductions must be bit-exact in group order.
    ``out``, ``values``, ``layout``: see :class:`Case`.
    """
    op_counter = itertools.count()
    shape_list = [SHAPES.get(s, s) if isinstance(s, str) else tuple(s) for s in shapes]
    cases: list[Case] = []
    axis_cycle = itertools.cycle(axes)
    shape_cycle = itertools.cycle(shape_list)
    axis_loop = [None] if rotate_axes else list(axes)
    for axis_slot in axis_loop:
        for algorithm in algorithms:
            if collective == "barrier":
                axis = next(axis_cycle) if rotate_axes else axis_slot
                cases.append(make_case("barrier", axis, algorithm, "float64", ()))
                continue
            for dtype in dtypes:
                kinds = [next(shape_cycle)] if rotate_shapes else shape_list
                for shape in kinds:
                    axis = next(axis_cycle) if rotate_axes else axis_slot
                    n = group_size(mesh, axis)
                    exact_type = not np.issubdtype(np.dtype(dtype), np.inexact)
                    use_ops = [o for o in ops if not (exact_type and o == "avg")]
                    if rotate_ops:
                        use_ops = [use_ops[next(op_counter) % len(use_ops)]]
                    for in_shape, kw in _variants(collective, shape, n, use_ops):
                        cases.append(make_case(
                            collective, axis, algorithm, dtype, in_shape, out=out,
                            exact=algorithm in exact_algorithms, values=values,
                            layout=layout, **kw))
    return cases


CASES = enumerate_cases


# ------------------------------------------------------------------- inputs, reference
def _values(rng, dtype: np.dtype, shape: tuple, op: str | None, kind: str) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        if op == "prod":
            v = rng.integers(-3, 4, shape)            # |prod| <= 3**8 for 8 members
        elif op in ("max", "min"):
            v = rng.integers(-5, 6, shape)            # many ties
        else:
            v = rng.integers(-1000, 1001, shape)
        return np.asarray(v, dtype)
    if np.issubdtype(dtype, np.complexfloating):
        scale = 0.7 if op == "prod" else 1.0
        v = scale * (rng.standard_normal(shape) + 1j * rng.standard_normal(shape))
    elif op == "prod":
        v = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
    elif kind == "wide":                               # rounding depends on the order
        v = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)
    else:
        v = rng.standard_normal(shape)
    return np.asarray(v, dtype)


def make_inputs(case: Case, mesh, seed: int = 0) -> list:
    """Per-rank inputs of ``case``: arrays, or None on non-roots of broadcast/scatter."""
    if case.collective == "barrier":
        return [None] * mesh.size
    kw, dtype = case.kw, np.dtype(case.dtype)
    xs = []
    for r in range(mesh.size):
        rng = np.random.default_rng([seed, r])
        pos = mesh.group_position(case.axis, r)
        if case.collective in ("broadcast", "scatter") and pos != kw.get("root", 0):
            xs.append(None)
        else:
            xs.append(_values(rng, dtype, case.shape, kw.get("op"), case.values))
    return xs


def _fold(arrays: list, op: str) -> np.ndarray:
    """((a0 op a1) op a2) ... in list order, in the arrays' dtype; avg divides by n."""
    uf = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}[op]
    acc = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        acc = np.asarray(uf(acc, a))
    if op == "avg":
        acc = np.asarray(acc / len(arrays))
    return acc.astype(arrays[0].dtype, copy=False)


def reference(case: Case, mesh, xs: list) -> list:
    """What every rank must get back, computed on the host from the inputs ``xs``."""
    kw = case.kw
    res: list = [None] * mesh.size
    if case.collective == "barrier":
        return res
    root = kw.get("root", 0)
    for group in mesh.groups(case.axis):
        n = len(group)
        ins = [xs[m] for m in group]
        c = case.collective
        if c in REDUCTIONS:
            total = _fold(ins, kw.get("op", "sum"))
        for p, r in enumerate(group):
            if c == "all_reduce":
                res[r] = total
            elif c == "reduce":
                res[r] = total if p == root else None
            elif c == "reduce_scatter":
                res[r] = np.split(total, n, axis=kw.get("dim", 0))[p]
            elif c == "all_gather":
                res[r] = np.concatenate(ins, axis=kw.get("dim", 0))
            elif c == "gather":
                res[r] = np.concatenate(ins, axis=kw.get("dim", 0)) if p == root else None
            elif c == "broadcast":
                res[r] = ins[root].copy()
            elif c == "scatter":
                res[r] = np.split(ins[root], n, axis=kw.get("dim", 0))[p]
            elif c == "all_to_all":
                res[r] = np.concatenate(
                    [np.split(x, n, axis=kw.get("split_dim", 0))[p] for x in ins],
                    axis=kw.get("concat_dim", 0))
    return res


def _payload(src: int, dst: int, tag: int, kinds) -> np.ndarray:
    """A distinct array for message (src, dst, tag), cycling through shapes and dtypes."""
    shape, dtype = kinds[(src * 7 + dst * 3 + tag) % len(kinds)]
    rng = np.random.default_rng([src, dst, tag, 11])
    return _values(rng, np.dtype(dtype), shape, "sum", "normal")


P2P_KINDS = (((5,), "float64"), ((), "int64"), ((0, 3), "float32"), ((3, 7), "float32"),
             ((40000,), "float64"), ((2, 3, 5), "int64"), ((33, 17), "float64"))
