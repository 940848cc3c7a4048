"""``FeedForward``: y = act(x W1 + b1) W2 + b2, forward and backward, on any policy.

x (B, S, d) is reshaped to (rows, d) for the products; with h = x W1 + b1, a = act(h):

    forward:   y = a W2 + b2                      (b2 added once, after any reduction)
    backward:  db2 = sum_rows dy,   dW2 = a^T dy,   da = dy W2^T,   dh = da · act'(h),
               db1 = sum_rows dh,   dW1 = x^T dh,   dx = dh W1^T

Activations: ``relu`` (act' = [h > 0]) and ``gelu``, the tanh approximation

    gelu(h)  = 0.5 h (1 + t),   t = tanh(u),   u = c (h + k h^3),   c = sqrt(2/pi), k = 0.044715
    gelu'(h) = 0.5 (1 + t) + 0.5 h (1 - t^2) c (1 + 3k h^2)          (its exact derivative).

One program (:func:`_forward`, :func:`_backward`) serves every policy: the policy only
chooses the collectives around the products (:class:`FeedForwardCollectives`). It runs on
a device (arrays; every product declared through ``local_matmul``, the elementwise work
through ``dev.compute``) or on shapes alone (``explain``: zero-stride arrays, rows from
``collective_traffic``), so the explain table lists exactly the steps the device runs.

Elementwise FLOPs declared per element (counted operation by operation in the formulas
above, tanh as one): bias add 1, row sum 1, relu 1, relu' (times da) 1, gelu 9,
gelu' (times da) 18.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np

from vcluster.runtime.algorithm import choose_algorithm
from vcluster.runtime.tracing.kernel import Kernel
from vcluster.runtime.traffic import collective_traffic
from .explain import compute_rows, to_frame
from .ffn_sharding import (Collective, FeedForwardCollectives, FeedForwardSharding,
                           FeedForwardShardingPolicy)
from .matmul import local_matmul
from .operation import ShardedOperation, run_sharded

__all__ = ["FeedForward", "Activation", "ACTIVATIONS"]

_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def _relu(xp, h):
    return xp.maximum(h, 0)


def _relu_grad(xp, da, h):
    return da * (h > 0)


def _gelu(xp, h):
    return 0.5 * h * (1 + xp.tanh(_C * (h + _K * (h * h * h))))


def _gelu_grad(xp, da, h):
    h2 = h * h
    t = xp.tanh(_C * (h + _K * h2 * h))
    return da * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _C * (1 + 3 * _K * h2))


@dataclass(frozen=True)
class Activation:
    """An activation, da·act'(h), and their FLOPs per element."""

    name: str
    fn: Callable
    grad: Callable
    flops: int
    grad_flops: int


ACTIVATIONS = MappingProxyType({"relu": Activation("relu", _relu, _relu_grad, 1, 1),
                                "gelu": Activation("gelu", _gelu, _gelu_grad, 9, 18)})


def _activation(name) -> Activation:
    if isinstance(name, Activation):
        return name
    if name not in ACTIVATIONS:
        raise ValueError(f"FeedForward: unknown activation {name!r}; choose one of "
                         f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# --- where the program runs -----------------------------------------------------------
class _Backend(ABC):
    """The FFN's elementary steps; subclasses run them on a device or on shapes and add
    ``matmul(a, b, name)`` and ``comm(collective, x, name)`` (None: x unchanged)."""

    xp = np

    def __init__(self, act: Activation):
        self.act = act

    @abstractmethod
    def work(self, name: str, flops: int, operands, out_shape, fn, kernel=None):
        """``fn()`` declared as ``flops`` touching ``operands`` (inputs, then one array
        shaped like the output) — or, on shapes, a row and zeros of ``out_shape``;
        ``kernel``: what it is as one kernel (:class:`~vcluster.runtime.tracing.Kernel`)."""

    def add_bias(self, x, b, name):
        return self.work(name, x.size, (x, b, x), x.shape, lambda: x + b)

    def activation(self, h, name):
        return self.work(name, self.act.flops * h.size, (h, h), h.shape,
                         lambda: self.act.fn(self.xp, h), self._act_kernel(h, False))

    def activation_grad(self, da, h, name):
        return self.work(name, self.act.grad_flops * h.size, (da, h, h), h.shape,
                         lambda: self.act.grad(self.xp, da, h), self._act_kernel(h, True))

    def _act_kernel(self, h, backward: bool) -> Kernel:
        width = h.shape[-1] if h.ndim else 1
        return Kernel.activation(h.size // max(width, 1), width, backward, self.act.name)

    def sum_rows(self, g, name):
        g2 = g.reshape(-1, g.shape[-1])
        return self.work(name, g2.size, (g2,), g2.shape[1:], lambda: g2.sum(axis=0))

    def gather_matmul(self, c: Collective | None, x, weights, gather_name, names):
        """``(xc, [xc2 @ w for w in weights])``: x after ``c`` (a gather, or None) and its
        rows times each weight (``names``: one per weight). A backend may overlap the
        gather with the products (:mod:`tensor_parallel.collective_matmul`)."""
        xc = self.comm(c, x, gather_name)
        x2 = xc.reshape(-1, xc.shape[-1])
        return xc, [self.matmul(x2, w, name) for w, name in zip(weights, names)]

    def matmul_reduce(self, c: Collective | None, a, w, shape, name, reduce_name):
        """``c`` (a reduction, or None) applied to ``(a @ w).reshape(shape)``; a backend may
        overlap the reduction with the product (as :meth:`gather_matmul`)."""
        return self.comm(c, self.matmul(a, w, name).reshape(shape), reduce_name)


class _OnDevice(_Backend):
    def __init__(self, dev, act: Activation, algorithms: Mapping[str, str]):
        super().__init__(act)
        self.dev, self.xp, self.algorithms = dev, dev.xp, algorithms

    def work(self, name, flops, operands, out_shape, fn, kernel=None):
        itemsize = np.dtype(operands[0].dtype).itemsize
        nbytes = sum(int(o.size) for o in operands) * itemsize
        with self.dev.compute(f"ffn: {name}", flops=flops, bytes=nbytes, kernel=kernel):
            return fn()

    def matmul(self, a, b, name):
        return local_matmul(self.dev, a, b, f"ffn: {name}")

    def comm(self, c: Collective | None, x, name, async_op: bool = False):
        """``c`` on x (x itself when None); ``async_op``: issued asynchronously, its
        :class:`Work` returned (``wait()`` gives the result)."""
        if c is None:
            return x
        alg = self.algorithms.get(c.kind, "auto")
        if c.kind == "all_gather":
            return self.dev.all_gather(x, c.axis, dim=c.dim, algorithm=alg, async_op=async_op)
        if c.kind == "reduce_scatter":
            return self.dev.reduce_scatter(x, c.axis, dim=c.dim, algorithm=alg,
                                           async_op=async_op)
        return self.dev.all_reduce(x, c.axis, algorithm=alg, async_op=async_op)


class _OnShapes(_Backend):
    """Runs the program on zero-stride arrays and records explain rows."""

    def __init__(self, mesh, act: Activation, algorithms: Mapping[str, str], dtype, phase):
        super().__init__(act)
        self.mesh, self.algorithms, self.dtype, self.phase = mesh, algorithms, dtype, phase
        self.rows: list[dict] = []

    def zeros(self, shape):
        return np.broadcast_to(np.zeros((), self.dtype), tuple(shape))

    def work(self, name, flops, operands, out_shape, fn, kernel=None):
        step = f"elementwise on {tuple(operands[0].shape)}"
        self.rows += compute_rows(self.mesh, self.phase, name, step, flops)
        return self.zeros(out_shape)

    def matmul(self, a, b, name):
        (m, k), n = a.shape, b.shape[1]
        self.rows += compute_rows(self.mesh, self.phase, name, f"({m}, {k}) @ ({k}, {n})",
                                  2 * m * k * n)
        return self.zeros((m, n))

    def comm(self, c: Collective | None, x, name):
        if c is None:
            return x
        itemsize = np.dtype(self.dtype).itemsize
        nbytes = int(x.size) * itemsize
        for rank in range(self.mesh.size):
            members = self.mesh.group(c.axes, rank)
            alg = choose_algorithm(c.kind, nbytes, len(members),
                                   requested=self.algorithms.get(c.kind, "auto"))
            t = collective_traffic(c.kind, alg, members, members.index(rank), nbytes, itemsize)
            self.rows.append({
                "rank": rank, "phase": self.phase, "operation": name, "step": str(c),
                "kind": "collective", "collective": c.kind, "axis": ",".join(c.axes),
                "group_size": len(members), "algorithm": alg, "flops": 0,
                "bytes_sent": t.bytes_sent, "bytes_received": t.bytes_received,
                "messages_sent": sum(k for _, _, k in t.sent),
                "messages_received": sum(k for _, _, k in t.received)})
        shape = list(x.shape)
        n = self.mesh.axis_size(c.axes)
        if c.kind == "all_gather":
            shape[c.dim] *= n
        elif c.kind == "reduce_scatter":
            shape[c.dim] //= n
        return self.zeros(shape)


# --- the program ----------------------------------------------------------------------
def _hidden(be, c: FeedForwardCollectives, x, w1, b1, w2, tag=""):
    """Gather what the products need; h = x W1 + b1 and a = act(h) on (rows, f_local)."""
    w1c = be.comm(c.w1_in, w1, f"{tag}gather W1")
    xc, (xw,) = be.gather_matmul(c.x_in, x, (w1c,), f"{tag}gather x", (f"{tag}x @ W1",))
    x2 = xc.reshape(-1, xc.shape[-1])
    h = be.add_bias(xw, b1, f"{tag}h = x W1 + b1")
    a = be.activation(h, f"{tag}a = act(h)")
    w2c = be.comm(c.w2_in, w2, f"{tag}gather W2")
    return xc, x2, w1c, w2c, h, a


def _forward(be, c: FeedForwardCollectives, x, w1, b1, w2, b2):
    xc, _, _, w2c, _, a = _hidden(be, c, x, w1, b1, w2)
    y = be.matmul_reduce(c.y_out, a, w2c, xc.shape[:-1] + (w2c.shape[1],), "a @ W2",
                         "reduce y")
    return be.add_bias(y, b2, "y + b2")


def _backward(be, c: FeedForwardCollectives, x, w1, b1, w2, b2, dy):
    xc, x2, w1c, w2c, h, a = _hidden(be, c, x, w1, b1, w2, tag="recompute: ")
    dyc = be.comm(c.x_in, dy, "gather dy")
    dy2 = dyc.reshape(-1, dyc.shape[-1])
    db2 = be.sum_rows(dyc if c.db2_from_gathered else dy, "db2 = sum_rows dy")
    db2 = be.comm(c.db2, db2, "reduce db2")
    dw2 = be.comm(c.dw2, be.matmul(a.T, dy2, "dW2 = a^T dy"), "reduce dW2")
    da = be.matmul(dy2, w2c.T, "da = dy W2^T")
    dh = be.activation_grad(da, h, "dh = da act'(h)")
    db1 = be.comm(c.db1, be.sum_rows(dh, "db1 = sum_rows dh"), "reduce db1")
    dw1 = be.comm(c.dw1, be.matmul(x2.T, dh, "dW1 = x^T dh"), "reduce dW1")
    dx = be.matmul(dh, w1c.T, "dx = dh W1^T").reshape(xc.shape)
    dx = be.comm(c.y_out, dx, "reduce dx")
    return dx, dw1, db1, dw2, db2


# --- the operation ----------------------------------------------------------------------
class FeedForward(ShardedOperation):
    """``FeedForward(sharding, activation="gelu", algorithms=None)``.

    ``sharding`` is a :class:`FeedForwardSharding` (or a policy / policy name, with the
    default axes); ``algorithms`` maps a collective name (all_gather, reduce_scatter,
    all_reduce) to the algorithm every such call uses (default ``auto``), e.g.
    ``sharding.MESSAGE_ALGORITHMS`` for the ring closed forms of the policy docstrings.
    """

    name = "feed-forward"

    def __init__(self, sharding, activation: str = "gelu",
                 algorithms: Mapping[str, str] | None = None):
        if isinstance(sharding, (FeedForwardShardingPolicy, str)):
            sharding = FeedForwardSharding(sharding)
        if not isinstance(sharding, FeedForwardSharding):
            raise TypeError(f"FeedForward: sharding must be a FeedForwardSharding, got "
                            f"{sharding!r}")
        self.sharding = sharding
        self.activation = _activation(activation)
        self.algorithms = dict(algorithms or {})
        for kind, alg in self.algorithms.items():
            choose_algorithm(kind, 0, 2, requested=alg)   # unknown names raise ValueError

    def __repr__(self) -> str:
        return f"FeedForward({self.sharding}, activation={self.activation.name!r})"

    @property
    def layouts(self):
        """Name -> TensorSharding of every tensor and gradient (see FeedForwardSharding)."""
        return self.sharding.layouts

    # --- per-device programs --------------------------------------------------------
    def forward_local(self, dev, x, w1, b1, w2, b2):
        """This device's y (layout ``layouts["y"]``) from its local pieces."""
        self.sharding.validate(dev.mesh)
        be = _OnDevice(dev, self.activation, self.algorithms)
        return _forward(be, self.sharding.collectives, x, w1, b1, w2, b2)

    def backward_local(self, dev, x, w1, b1, w2, b2, dy):
        """This device's (dx, dW1, db1, dW2, db2), each in its tensor's layout; h and a
        are recomputed (with the forward's gathers)."""
        self.sharding.validate(dev.mesh)
        be = _OnDevice(dev, self.activation, self.algorithms)
        return _backward(be, self.sharding.collectives, x, w1, b1, w2, b2, dy)

    # --- host conveniences ----------------------------------------------------------
    def _check(self, mesh, **arrays) -> None:
        """Shapes consistent with x (B, S, d) and W1 (d, d_ff), and divisible on mesh."""
        x_shape, w1_shape = np.shape(arrays["x"]), np.shape(arrays["w1"])
        if len(w1_shape) != 2:
            raise ValueError(f"FeedForward: W1 must be 2-D (d_model, d_ff), got shape {w1_shape}")
        expected = dict(FeedForwardSharding.global_shapes(x_shape, w1_shape[1]), dy=x_shape)
        for name, a in arrays.items():
            if np.shape(a) != expected[name]:
                raise ValueError(f"FeedForward: {name} has shape {np.shape(a)}; with x of shape "
                                 f"{x_shape} and d_ff={w1_shape[1]} it must be {expected[name]}")
        self.sharding.validate(mesh, x_shape, w1_shape[1])

    def _inputs(self, arrays, names):
        L = self.layouts
        return [(a, L[n]) for a, n in zip(arrays, names)]

    def run(self, cluster, x, w1, b1, w2, b2):
        """Global x, W1, b1, W2, b2 in; global y out."""
        self._check(cluster.mesh, x=x, w1=w1, b1=b1, w2=w2, b2=b2)
        return run_sharded(cluster, self.forward_local,
                           self._inputs((x, w1, b1, w2, b2), ("x", "w1", "b1", "w2", "b2")),
                           [self.layouts["y"]])

    def backward(self, cluster, x, w1, b1, w2, b2, dy):
        """Global inputs and dy in; global (dx, dW1, db1, dW2, db2) out."""
        self._check(cluster.mesh, x=x, w1=w1, b1=b1, w2=w2, b2=b2, dy=dy)
        L = self.layouts
        return run_sharded(cluster, self.backward_local,
                           self._inputs((x, w1, b1, w2, b2, dy),
                                        ("x", "w1", "b1", "w2", "b2", "dy")),
                           [L["dx"], L["dw1"], L["db1"], L["dw2"], L["db2"]])

    def explain(self, mesh, x_shape, d_ff, dtype=np.float64, backward: bool = False):
        """Per device and step: FLOPs, collectives, group sizes, algorithms, bytes — the
        forward (``run``), and with ``backward`` also one ``backward`` call; then the
        totals per rank (the numbers ``cluster.stats()`` counts)."""
        local = self.sharding.local_shapes(mesh, tuple(x_shape), d_ff)
        rows = []
        for phase in ("forward", "backward") if backward else ("forward",):
            be = _OnShapes(mesh, self.activation, self.algorithms, np.dtype(dtype), phase)
            args = [be.zeros(local[n]) for n in ("x", "w1", "b1", "w2", "b2")]
            c = self.sharding.collectives
            if phase == "forward":
                _forward(be, c, *args)
            else:
                _backward(be, c, *args, be.zeros(local["x"]))
            rows += be.rows
        return to_frame(rows)
