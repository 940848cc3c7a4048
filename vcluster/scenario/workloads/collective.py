"""``kind: collective``: every device calls one collective over the groups of an axis.

Each rank's input is ``size`` bytes of ``dtype`` drawn from the seed (rank r's own
stream); the group of rank r is ``mesh.group(axis, r)``, members ordered by coordinate,
``p`` its position, ``n`` the group size, ``x_j`` member j's input. Reference outputs:

    all_reduce      sum_j x_j                    reduce          sum_j x_j at p = 0
    all_gather      [x_0; ...; x_{n-1}]          gather          [x_0; ...] at p = 0
    reduce_scatter  piece p of sum_j x_j         scatter         piece p of x_0
    all_to_all      [piece p of x_0; ...]        broadcast       x_0

(pieces: the n equal parts of dimension 0). The program calls the collective ``calls``
times back to back and returns the last result.
"""

from __future__ import annotations

import numpy as np

from vcluster.runtime import ALGORITHMS
from vcluster.runtime.tracing import MetaArray

from ..errors import ScenarioError
from ..units import parse_size
from .base import Workload

__all__ = ["validate", "build"]

_SPLITS = ("reduce_scatter", "all_to_all", "scatter")       # inputs cut into n pieces
_ROOTED = ("reduce", "gather")                               # None except at the root


def _size_bytes(scenario) -> int:
    size = scenario.workload.options["size"]
    try:
        return size if isinstance(size, int) else parse_size(size)
    except ValueError as exc:
        raise ScenarioError("workload.size", size, "a byte count such as 4096, 64KiB, 1MiB",
                            str(exc)) from None


def _axis(scenario, mesh):
    axis = scenario.parallel["axis"]
    axes = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
    for a in axes:
        if a not in mesh.axes:
            raise ScenarioError("parallel.axis", axis, f"null or axes of the mesh: "
                                f"{', '.join(mesh.axes)}", "not a mesh axis")
    return None if axis is None else axes


def validate(scenario, mesh) -> None:
    op, alg = scenario.workload.options["op"], scenario.parallel["algorithm"]
    if alg != "auto" and alg not in ALGORITHMS[op]:
        raise ScenarioError("parallel.algorithm", alg, ", ".join(("auto",) + ALGORITHMS[op]),
                            f"not an algorithm of {op}")
    axes = _axis(scenario, mesh)
    itemsize = np.dtype(scenario.workload.dtype).itemsize
    nbytes = _size_bytes(scenario)
    n = mesh.axis_size(axes)
    unit = itemsize * (n if op in _SPLITS else 1)
    if nbytes % unit:
        raise ScenarioError("workload.size", scenario.workload.options["size"],
                            f"a multiple of {unit} bytes", f"{op} over {n} devices of "
                            f"{scenario.workload.dtype} needs whole elements"
                            + (f" split into {n} pieces" if op in _SPLITS else ""))


def _program(dev, op: str, x, axis, algorithm: str, calls: int):
    out = None
    for _ in range(calls):
        out = getattr(dev, op)(x, axis, algorithm=algorithm)
    return {"out": out}


def _group_values(op: str, members: list) -> list:
    """The reference output of each position of one group (None: no output)."""
    n = len(members)
    if op in ("all_reduce", "reduce", "reduce_scatter"):
        total = np.sum(members, axis=0)
        if op == "reduce_scatter":
            return np.split(total, n)
        return [total] * n if op == "all_reduce" else [total] + [None] * (n - 1)
    if op in ("all_gather", "gather"):
        whole = np.concatenate(members)
        return [whole] * n if op == "all_gather" else [whole] + [None] * (n - 1)
    if op == "scatter":
        return np.split(members[0], n)
    if op == "all_to_all":
        pieces = [np.split(m, n) for m in members]
        return [np.concatenate([p[j] for p in pieces]) for j in range(n)]
    return [members[0]] * n                                          # broadcast


def _reference(op: str, xs: list, mesh, axes) -> dict:
    out = {}
    for group in mesh.groups(axes):
        values = _group_values(op, [np.asarray(xs[g], np.float64) for g in group])
        out.update({f"rank{g}": v for g, v in zip(group, values) if v is not None})
    return dict(sorted(out.items(), key=lambda kv: int(kv[0][4:])))


def build(scenario, mesh) -> Workload:
    w = scenario.workload
    op, calls = w.options["op"], w.options["calls"]
    axes = _axis(scenario, mesh)
    elements = _size_bytes(scenario) // np.dtype(w.dtype).itemsize
    real = scenario.run.mode != "simulate"          # simulate alone: shapes, no data
    xs = [np.random.default_rng([w.seed, r]).standard_normal(elements).astype(w.dtype)
          for r in range(mesh.size)] if real else []
    axis = None if axes is None else (axes[0] if len(axes) == 1 else axes)
    alg = scenario.parallel["algorithm"]
    args = tuple((op, x, axis, alg, calls) for x in xs)
    metas = tuple((op, MetaArray((elements,), w.dtype), axis, alg, calls)
                  for _ in range(mesh.size))

    def assemble(results):
        return {f"rank{r}": res["out"] for r, res in enumerate(results)
                if res["out"] is not None}

    return Workload("collective", mesh, _program, args, metas, w.dtype, assemble,
                    lambda: _reference(op, xs, mesh, axes),
                    description=f"{calls} x {op} of {elements} {w.dtype} over {axis}")
