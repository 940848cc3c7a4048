"""``auto``: rank every valid layout of an op by its predicted time on a hardware model.

For a MatMul C = A @ B (:func:`auto_matmul`) the candidates are every pair of layouts
(a, b) of A (m, k) and B (k, n) on the mesh — each mesh axis of size > 1 splitting
dimension 0, dimension 1 or neither of each tensor, all dimensions splitting evenly —
with C delivered in a stated layout ``c`` (default replicated). For a FeedForward
(:func:`auto_ffn`) they are every policy with every assignment of the mesh
axes to its ``tp`` and ``dp`` roles, with y delivered in x's stated layout.

Every candidate is one per-device program: redistribute the inputs from their stated
layouts (``a_from``, ``b_from``; ``x_from`` and replicated weights; default replicated)
into the candidate's, run the op (MatMul: its plan's compute layouts and the
redistribution of C into ``c``; FeedForward: forward, and backward with
``backward=True``), and redistribute the output into the stated layout. The program is
traced on shape-only arrays and replayed by the timing model (:func:`simulate_trace`) on
``hardware``: a preset name, a YAML file or a HardwareSpec (:class:`HardwareCostModel`),
or the ``localhost`` machine — a :class:`~vcluster.localhost.spec.LocalhostSpec`, or
the string ``"localhost"`` to calibrate this machine first (seconds): see
:func:`vcluster.localhost.cost_model_for`. Each candidate is traced and replayed as the
cost model asks (:func:`vcluster.timing.model_traces`, ``model.core_pool``), so the ranking
uses the same cost model as every other prediction; no second one. ``cost_model=MODEL``
prices with a ready cost model instead (a scenario passes the one its own prediction uses, so that a
hardware ``dtype`` other than the trace's, e.g. fp32 peak for float64 data, is honoured).

Candidates that compile to the same program (e.g. a layout that is sliced straight back
into the same compute layout) are listed once, under the first layout that gives it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from sharding import TensorSharding as TS
from sharding import local_shape, plan_redistribute, redistribute
from tensor_parallel.ffn import FeedForward
from tensor_parallel.ffn_sharding import FeedForwardSharding, FeedForwardShardingPolicy
from tensor_parallel.matmul import MatMul
from tensor_parallel.matmul_sharding import MatMulSharding
from vcluster.localhost import cost_model_for
from vcluster.runtime.tracing import MetaArray
from vcluster.timing import core_pool_of, for_many_programs, model_traces
from vcluster.timing.engine import simulate_trace

__all__ = ["layouts_2d", "matmul_candidate_program", "ffn_candidate_program", "rank_matmul_layouts", "rank_ffn_layouts",
           "auto_matmul", "auto_ffn", "auto_layout"]


def layouts_2d(mesh, shape) -> list[TS]:
    """Every layout of a 2-D array of ``shape`` on ``mesh`` that splits evenly (axes of
    size 1 are left out; a dimension split by several axes takes them in mesh order)."""
    axes = [a for a in mesh.axes if mesh.shape[a] > 1]
    out = []
    for choice in itertools.product((None, 0, 1), repeat=len(axes)):
        dims = [tuple(a for a, c in zip(axes, choice) if c == d) for d in (0, 1)]
        if all(n % mesh.axis_size(ax) == 0 if ax else True for n, ax in zip(shape, dims)):
            out.append(TS(*(ax or None for ax in dims)))
    return out


def _predict_s(mesh, program, meta_args, model) -> float:
    traces = model_traces(model, mesh, program, meta_args)
    return simulate_trace(traces, model, mesh=mesh, core_pool=core_pool_of(model),
                          timeline=False).step_time_s


def _meta(shape, dtype):
    return MetaArray(tuple(shape), np.dtype(dtype))


# --- MatMul ------------------------------------------------------------------------------
def matmul_candidate_program(dev, op, a_in, b_in, a, b):
    a = redistribute(dev, a, a_in, op.algorithms)
    b = redistribute(dev, b, b_in, op.algorithms)
    return op.forward_local(dev, a, b)


def rank_matmul_layouts(mesh, a_shape, b_shape, hardware, dtype="float32",
                        a_from: TS | None = None, b_from: TS | None = None,
                        c: TS | None = None, cost_model=None):
    """A DataFrame of every distinct candidate (see the module docstring), fastest
    first: ``sharding`` (a MatMulSharding), ``policy``, ``predicted_s``, ``flops_per_device``,
    ``bytes_per_device`` and ``steps`` (of the input redistributions and the op's plan),
    ``program``."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    a_from, b_from, c = a_from or TS(None, None), b_from or TS(None, None), c or TS(None, None)
    MatMulSharding(a_from, b_from, c).validate(mesh, a_shape, b_shape)
    itemsize = np.dtype(dtype).itemsize
    model = for_many_programs(cost_model or cost_model_for(hardware, mesh.size, dtype))
    rows, seen = [], set()
    for a, b in itertools.product(layouts_2d(mesh, a_shape), layouts_2d(mesh, b_shape)):
        sharding = MatMulSharding(a, b, c)
        plan = sharding.plan(mesh, a_shape, b_shape, itemsize)
        a_in = plan_redistribute(a_from, a, mesh, a_shape, itemsize)
        b_in = plan_redistribute(b_from, b, mesh, b_shape, itemsize)
        program = f"A: {a_in} ; B: {b_in} ; {plan}".replace("\n", " ; ")
        if program in seen:
            continue
        seen.add(program)
        op = MatMul(sharding)
        metas = [(op, a_in, b_in, _meta(local_shape(a_shape, a_from, mesh), dtype),
                  _meta(local_shape(b_shape, b_from, mesh), dtype))] * mesh.size
        rows.append({"sharding": sharding, "policy": sharding.policy_on(mesh).value,
                     "predicted_s": _predict_s(mesh, matmul_candidate_program, metas, model),
                     "flops_per_device": plan.flops_per_device,
                     "bytes_per_device": plan.bytes_per_device + a_in.bytes_per_device
                     + b_in.bytes_per_device,
                     "steps": sum(len(p.steps) for p in (a_in, b_in, plan.a_plan, plan.b_plan,
                                                         plan.c_plan)),
                     "program": program})
    # equal predictions (the same collectives in another order): fewer bytes, then fewer
    # steps first
    return pd.DataFrame(rows).sort_values(["predicted_s", "bytes_per_device", "steps"],
                                          kind="stable").reset_index(drop=True)


def auto_matmul(mesh, a_shape, b_shape, hardware, **kwargs):
    """(the best MatMulSharding, the ranking DataFrame) — see rank_matmul_layouts."""
    df = rank_matmul_layouts(mesh, a_shape, b_shape, hardware, **kwargs)
    return df.iloc[0]["sharding"], df


# --- FeedForward -------------------------------------------------------------------------
def _ffn_candidates(mesh):
    P = FeedForwardShardingPolicy
    axes = [a for a in mesh.axes if mesh.shape[a] > 1]
    out = []
    for roles in itertools.product((None, "tp", "dp"), repeat=len(axes)):
        tp = tuple(a for a, r in zip(axes, roles) if r == "tp") or None
        dp = tuple(a for a, r in zip(axes, roles) if r == "dp") or None
        for policy in P:
            if (policy is P.Unsharded) != (tp is None) or (policy is P.GSPMD and not dp):
                continue
            out.append(FeedForwardSharding(policy, tp=tp, dp=dp))
    return out


def ffn_candidate_program(dev, op, plans, x, w1, b1, w2, b2, dy, backward, y_plan):
    x, w1, b1, w2, b2 = (redistribute(dev, t, plans[k], op.algorithms)
                         for k, t in zip(("x", "w1", "b1", "w2", "b2"), (x, w1, b1, w2, b2)))
    y = redistribute(dev, op.forward_local(dev, x, w1, b1, w2, b2), y_plan, op.algorithms)
    if backward:
        dy = redistribute(dev, dy, plans["x"], op.algorithms)
        op.backward_local(dev, x, w1, b1, w2, b2, dy)
    return y


def rank_ffn_layouts(mesh, x_shape, d_ff: int, hardware, dtype="float32",
                     x_from: TS | None = None, backward: bool = False, cost_model=None):
    """A DataFrame of every valid FeedForwardSharding on ``mesh``, fastest first:
    ``sharding``, ``policy``, ``tp``, ``dp``, ``predicted_s`` (inputs redistributed from
    ``x_from`` (default replicated) and replicated weights, y back into ``x_from``)."""
    x_from = x_from or TS(None, None, None)
    itemsize = np.dtype(dtype).itemsize
    shapes = FeedForwardSharding.global_shapes(tuple(x_shape), d_ff)
    model = for_many_programs(cost_model or cost_model_for(hardware, mesh.size, dtype))
    sources = {k: (x_from if k == "x" else TS(*([None] * len(s)))) for k, s in shapes.items()}
    rows = []
    for sharding in _ffn_candidates(mesh):
        try:
            sharding.validate(mesh, tuple(x_shape), d_ff)
        except ValueError:
            continue
        op = FeedForward(sharding)
        lay = sharding.layouts
        plans = {k: plan_redistribute(sources[k], lay[k], mesh, s, itemsize)
                 for k, s in shapes.items()}
        y_plan = plan_redistribute(lay["y"], x_from, mesh, shapes["x"], itemsize)
        metas = tuple(_meta(local_shape(s, sources[k], mesh), dtype) for k, s in shapes.items())
        args = [(op, plans) + metas + (_meta(local_shape(shapes["x"], x_from, mesh), dtype),
                                       backward, y_plan)] * mesh.size
        rows.append({"sharding": sharding, "policy": sharding.policy.name,
                     "tp": sharding.tp, "dp": sharding.dp,
                     "predicted_s": _predict_s(mesh, ffn_candidate_program, args, model)})
    return pd.DataFrame(rows).sort_values("predicted_s", kind="stable").reset_index(drop=True)


def auto_ffn(mesh, x_shape, d_ff: int, hardware, **kwargs):
    """(the best FeedForwardSharding, the ranking DataFrame) — see rank_ffn_layouts."""
    df = rank_ffn_layouts(mesh, x_shape, d_ff, hardware, **kwargs)
    return df.iloc[0]["sharding"], df


def auto_layout(op: str, mesh, shapes: dict, hardware, **kwargs):
    """One entry point for ``policy: auto`` in a scenario: ``op`` "matmul" with shapes
    {"a": (m, k), "b": (k, n)}, or "ffn" with {"x": (B, S, d), "d_ff": f}; returns the
    best sharding and the ranking DataFrame."""
    if op == "matmul":
        return auto_matmul(mesh, shapes["a"], shapes["b"], hardware, **kwargs)
    if op in ("ffn", "feed-forward", "feedforward"):
        return auto_ffn(mesh, shapes["x"], shapes["d_ff"], hardware, **kwargs)
    raise ValueError(f"auto_layout: op must be 'matmul' or 'ffn', got {op!r}")
