"""``kind: ffn``: y = act(x W1 + b1) W2 + b2 with :class:`tensor_parallel.FeedForward`
under a policy (Unsharded, Megatron, SequenceParallel, GSPMD) on the mesh axes ``tp`` /
``dp``; with ``backward`` also (dx, dW1, db1, dW2, db2) from a random dy.

The reference is computed in float64 from the definitions (gelu: the tanh
approximation 0.5 h (1 + tanh(c (h + 0.044715 h^3))), c = sqrt(2/pi), and its exact
derivative). With ``policy: auto`` the policy and the roles of the mesh axes (``tp``,
``dp``) are chosen by the timing model on the scenario's hardware (:mod:`.auto`).

    h = x W1 + b1,  a = act(h),  y = a W2 + b2,
    dh = (dy W2^T) act'(h),  dx = dh W1^T,  dW1 = x^T dh,  db1 = sum dh,
    dW2 = a^T dy,  db2 = sum dy       (x, dy as (B·S, d) rows).
"""

from __future__ import annotations

import numpy as np
from sharding import local_shape, shard, unshard
from tensor_parallel import FeedForward, FeedForwardSharding
from vcluster.runtime.tracing import MetaArray

from ..errors import ScenarioError
from .auto import AUTO, choose
from .base import Workload

__all__ = ["validate", "build"]

_KEYS = {"batch": "workload.batch", "seq": "workload.seq", "d_model": "workload.d_model",
         "d_ff": "workload.d_ff"}
_DIMS = {"x": ("batch", "seq", "d_model"), "w1": ("d_model", "d_ff"), "b1": ("d_ff",),
         "w2": ("d_ff", "d_model"), "b2": ("d_model",)}


def _sharding(scenario, mesh):
    par = scenario.parallel
    for key in ("tp", "dp"):
        value = par[key]
        for axis in (() if value is None else (value,) if isinstance(value, str) else value):
            if axis not in mesh.axes:
                raise ScenarioError(f"parallel.{key}", value,
                                    f"null or axes of the mesh: {', '.join(mesh.axes)}",
                                    "not a mesh axis")
    tp = tuple(par["tp"]) if isinstance(par["tp"], list) else par["tp"]
    dp = tuple(par["dp"]) if isinstance(par["dp"], list) else par["dp"]
    try:
        return FeedForwardSharding(par["policy"], tp=tp, dp=dp)
    except ValueError as exc:
        key = "dp" if ("dp axis" in str(exc) or "share" in str(exc)) else "tp"
        raise ScenarioError(f"parallel.{key}", par[key], "distinct mesh axes for tp and dp "
                            "(GSPMD needs dp; every policy but Unsharded needs tp)",
                            str(exc)) from None


def _auto(scenario, mesh):
    """The :class:`~.auto.AutoChoice` of ``policy: auto``, else None."""
    if scenario.parallel["policy"] != AUTO:
        return None
    o = scenario.workload.options
    return choose("ffn", scenario, mesh, {"x": (o["batch"], o["seq"], o["d_model"]),
                                          "d_ff": o["d_ff"]}, backward=o["backward"])


def validate(scenario, mesh) -> None:
    if scenario.parallel["policy"] == AUTO:
        return                                    # auto ranks only layouts that divide
    s = _sharding(scenario, mesh)
    o = scenario.workload.options
    for tensor, dims in _DIMS.items():
        for name, d in zip(dims, s.layouts[tensor].dims):
            k = mesh.axis_size(d.axes)
            if o[name] % k:
                raise ScenarioError(_KEYS[name], o[name], f"a multiple of {k}",
                                    f"{s.policy.name} splits {name} ({tensor}) over mesh axes "
                                    f"{', '.join(d.axes)}")


def _program(dev, op, x, w1, b1, w2, b2, dy):
    out = {"y": op.forward_local(dev, x, w1, b1, w2, b2)}
    if dy is not None:
        for name, g in zip(("dx", "dW1", "db1", "dW2", "db2"),
                           op.backward_local(dev, x, w1, b1, w2, b2, dy)):
            out[name] = g
    return out


def _act(h, name):
    """act(h), act'(h)."""
    if name == "relu":
        return np.maximum(h, 0.0), (h > 0).astype(np.float64)
    c, k = np.sqrt(2.0 / np.pi), 0.044715
    t = np.tanh(c * (h + k * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * k * h * h)


def reference(arrays: dict, activation: str) -> dict:
    """The module docstring's formulas in float64."""
    x, w1, b1, w2, b2 = (np.asarray(arrays[k], np.float64) for k in ("x", "w1", "b1", "w2",
                                                                      "b2"))
    rows = x.reshape(-1, x.shape[-1])
    h = rows @ w1 + b1
    a, da_dh = _act(h, activation)
    out = {"y": (a @ w2 + b2).reshape(x.shape)}
    if arrays.get("dy") is not None:
        dy = np.asarray(arrays["dy"], np.float64).reshape(-1, x.shape[-1])
        dh = (dy @ w2.T) * da_dh
        out.update(dx=(dh @ w1.T).reshape(x.shape), dW1=rows.T @ dh, db1=dh.sum(0),
                   dW2=a.T @ dy, db2=dy.sum(0))
    return out


def build(scenario, mesh) -> Workload:
    w, o = scenario.workload, scenario.workload.options
    auto = _auto(scenario, mesh)
    op = FeedForward(auto.sharding if auto else _sharding(scenario, mesh),
                     activation=o["activation"])
    L = op.layouts
    B, S, d, f = o["batch"], o["seq"], o["d_model"], o["d_ff"]
    names = ("x", "w1", "b1", "w2", "b2", "dy")
    shapes = {"x": (B, S, d), "w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,),
              "dy": (B, S, d) if o["backward"] else None}
    metas = tuple((op,) + tuple(None if shapes[k] is None else
                                MetaArray(local_shape(shapes[k], L[k], mesh), w.dtype)
                                for k in names) for _ in range(mesh.size))
    args, arrays = (), None
    if scenario.run.mode != "simulate":               # simulate alone: shapes, no data
        rng = np.random.default_rng(w.seed)
        arrays = {"x": rng.standard_normal((B, S, d)),
                  "w1": rng.standard_normal((d, f)) / np.sqrt(d), "b1": rng.standard_normal(f),
                  "w2": rng.standard_normal((f, d)) / np.sqrt(f), "b2": rng.standard_normal(d),
                  "dy": rng.standard_normal((B, S, d)) if o["backward"] else None}
        arrays = {k: None if v is None else v.astype(w.dtype) for k, v in arrays.items()}
        pieces = {k: shard(v, L[k], mesh) if v is not None else [None] * mesh.size
                  for k, v in arrays.items()}
        args = tuple((op,) + tuple(pieces[k][r] for k in names) for r in range(mesh.size))
    layouts = {"y": L["y"], "dx": L["dx"], "dW1": L["dw1"], "db1": L["db1"],
               "dW2": L["dw2"], "db2": L["db2"]}

    def assemble(results):
        return {name: unshard([res[name] for res in results], layouts[name], mesh)
                for name in results[0]}

    return Workload("ffn", mesh, _program, args, metas, w.dtype, assemble,
                    lambda: reference(arrays, o["activation"]),
                    description=f"FeedForward {op.sharding.policy.name} x {(B, S, d)}, "
                                f"d_ff {f}" + (f"; {auto}" if auto else ""))
