"""``kind: matmul``: C = A @ B (and with ``backward``, dA = dC B^T, dB = A^T dC) with
:class:`tensor_parallel.MatMul` on the layouts of a named policy or explicit layouts.

A named policy is laid over the mesh axes in order, x = the first, y = the second, z =
the third, "all" = every axis (major to minor); R replicated, S(.) split:

    Unsharded               A [R, R]         B [R, R]         C [R, R]
    MatchedInnerSharding    A [R, S(all)]    B [S(all), R]    C [R, R]     (all-reduce)
    UnmatchedInnerSharding  A [R, S(y)]      B [S(x), R]      C [R, R]     (>= 2 axes)
    OuterSharding           A [S(x), R]      B [R, S(y)]      C [S(x), S(y)] (>= 2 axes)
    FullSharding            A [S(x), S(y)]   B [S(y), S(z)]   C [S(x), S(z)] (>= 3 axes)

With ``policy: auto`` the layouts of A and B are chosen by the timing model on the
scenario's hardware (:mod:`.auto`; C replicated). The reference is the float64 product
of the same inputs.
"""

from __future__ import annotations

import numpy as np
from sharding import TensorSharding as TS
from sharding import local_shape, shard, unshard
from tensor_parallel import MatMul, MatMulSharding
from vcluster.runtime.tracing import MetaArray

from ..errors import ScenarioError
from .auto import AUTO, choose
from .base import Workload

__all__ = ["validate", "build", "policy_layouts"]

_MIN_AXES = {"Unsharded": 0, "MatchedInnerSharding": 1, "UnmatchedInnerSharding": 2,
             "OuterSharding": 2, "FullSharding": 3}


def policy_layouts(policy: str, axes: tuple[str, ...]):
    """(a, b, c) TensorShardings of ``policy`` on mesh axes ``axes`` (module docstring)."""
    if len(axes) < _MIN_AXES[policy]:
        allowed = [p for p, k in _MIN_AXES.items() if k <= len(axes)]
        raise ScenarioError("parallel.policy", policy, ", ".join(allowed),
                            f"{policy} needs a mesh of at least {_MIN_AXES[policy]} axes, "
                            f"this one has {len(axes)}")
    x, y, z = (tuple(axes) + (None, None, None))[:3]
    every = axes[0] if len(axes) == 1 else tuple(axes)
    return {
        "Unsharded": (TS(None, None), TS(None, None), TS(None, None)),
        "MatchedInnerSharding": (TS(None, every), TS(every, None), TS(None, None)),
        "UnmatchedInnerSharding": (TS(None, y), TS(x, None), TS(None, None)),
        "OuterSharding": (TS(x, None), TS(None, y), TS(x, y)),
        "FullSharding": (TS(x, y), TS(y, z), TS(x, z)),
    }[policy]


def _sharding(scenario, mesh):
    par = scenario.parallel
    if par.get("layouts") is not None:
        layouts = []
        for name in ("a", "b", "c"):
            dims = [tuple(d) if isinstance(d, list) else d for d in par["layouts"][name]]
            for i, d in enumerate(dims):
                for axis in (() if d is None else (d,) if isinstance(d, str) else d):
                    if axis not in mesh.axes:
                        raise ScenarioError(f"parallel.layouts.{name}[{i}]", d,
                                            f"null or axes of the mesh: {', '.join(mesh.axes)}",
                                            "not a mesh axis")
            try:
                layouts.append(TS(*dims))
            except (TypeError, ValueError) as exc:
                raise ScenarioError(f"parallel.layouts.{name}", par["layouts"][name],
                                    "each mesh axis at most once", str(exc)) from None
        sharding = MatMulSharding(*layouts)
        if par.get("policy") and sharding.policy_on(mesh).value != par["policy"]:
            raise ScenarioError("parallel.policy", par["policy"],
                                f"{sharding.policy_on(mesh).value} (the policy of "
                                f"parallel.layouts), or no policy", "does not match the layouts")
        return sharding
    if not par.get("policy"):
        raise ScenarioError("parallel.policy", None, ", ".join(_MIN_AXES),
                            "a matmul needs parallel.policy or parallel.layouts")
    return MatMulSharding(*policy_layouts(par["policy"], tuple(mesh.axes)))


def _auto(scenario, mesh):
    """The :class:`~.auto.AutoChoice` of ``policy: auto`` (without layouts), else None."""
    par = scenario.parallel
    if par.get("policy") != AUTO or par.get("layouts") is not None:
        return None
    o = scenario.workload.options
    return choose("matmul", scenario, mesh, {"a": (o["m"], o["k"]), "b": (o["k"], o["n"])})


def validate(scenario, mesh) -> None:
    if scenario.parallel.get("policy") == AUTO and scenario.parallel.get("layouts") is None:
        return                                    # auto ranks only layouts that divide
    s = _sharding(scenario, mesh)
    o = scenario.workload.options
    for layout, dims in ((s.a, "mk"), (s.b, "kn"), (s.c, "mn")):
        for d, key in zip(layout.dims, dims):
            k = mesh.axis_size(d.axes)
            if o[key] % k:
                raise ScenarioError(f"workload.{key}", o[key], f"a multiple of {k}",
                                    f"{key} is split over mesh axes {', '.join(d.axes)} "
                                    f"({k} pieces)")


def _program(dev, op, a, b, dc):
    out = {"C": op.forward_local(dev, a, b)}
    if dc is not None:
        out["dA"], out["dB"] = op.backward_local(dev, a, b, dc)
    return out


def build(scenario, mesh) -> Workload:
    w, o = scenario.workload, scenario.workload.options
    auto = _auto(scenario, mesh)
    op = MatMul(auto.sharding if auto else _sharding(scenario, mesh))
    s = op.sharding
    shapes = {"a": (o["m"], o["k"]), "b": (o["k"], o["n"]), "dc": (o["m"], o["n"])}
    metas = tuple((op, MetaArray(local_shape(shapes["a"], s.a, mesh), w.dtype),
                   MetaArray(local_shape(shapes["b"], s.b, mesh), w.dtype),
                   MetaArray(local_shape(shapes["dc"], op.dc_layout, mesh), w.dtype)
                   if o["backward"] else None) for _ in range(mesh.size))
    args, A = (), None
    if scenario.run.mode != "simulate":               # simulate alone: shapes, no data
        rng = np.random.default_rng(w.seed)
        A = rng.standard_normal(shapes["a"]).astype(w.dtype)
        B = rng.standard_normal(shapes["b"]).astype(w.dtype)
        dC = rng.standard_normal(shapes["dc"]).astype(w.dtype) if o["backward"] else None
        pa, pb = shard(A, s.a, mesh), shard(B, s.b, mesh)
        pc = shard(dC, op.dc_layout, mesh) if dC is not None else [None] * mesh.size
        args = tuple((op, pa[r], pb[r], pc[r]) for r in range(mesh.size))
    layouts = {"C": s.c, "dA": s.a, "dB": s.b}

    def assemble(results):
        return {name: unshard([res[name] for res in results], layouts[name], mesh)
                for name in results[0]}

    def reference():
        if A is None:
            raise ValueError("a simulate-only matmul has no real inputs (run.mode: simulate)")
        a, b = A.astype(np.float64), B.astype(np.float64)
        out = {"C": a @ b}
        if dC is not None:
            dc = dC.astype(np.float64)
            out["dA"], out["dB"] = dc @ b.T, a.T @ dc
        return out

    return Workload("matmul", mesh, _program, args, metas, w.dtype, assemble, reference,
                    description=f"{s} ({s.policy_on(mesh).value})"
                                + (f"; {auto}" if auto else ""))
