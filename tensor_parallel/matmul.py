"""``MatMul``: C = A @ B on any layouts, forward and backward, per device or from the host.

Forward (per device): redistribute A -> a*, B -> b*, multiply the local blocks, and
redistribute the (partial) product c* -> c; see :mod:`tensor_parallel.matmul_sharding`
for how a*, b*, c* are chosen and what each policy communicates.

Backward: with dC given in c's layout (replicated where c is partial),

    dA = dC @ B^T   in A's layout,        dB = A^T @ dC   in B's layout,

each computed by the same machinery — a MatMul on the layouts (c, b^T) -> a and
(a^T, c) -> b — so every policy has a backward pass and every gradient lands in its
parameter's layout. FLOPs: 2mkn forward, 4mkn backward (in total over the devices when
nothing is computed redundantly).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from sharding import TensorSharding, redistribute
from .explain import compute_rows, plan_rows, to_frame
from .gemm import gemm_accumulate
from .matmul_sharding import MatMulPlan, MatMulSharding, transpose_layout
from .operation import ShardedOperation, run_sharded

__all__ = ["MatMul", "global_shape", "local_matmul", "matmul_accumulate"]

_RESIDENT_MIN_BYTES = 1 << 20   # products this large go to shared memory (warm pages)


def global_shape(local_shape, layout: TensorSharding, mesh) -> tuple[int, ...]:
    """The global shape whose local pieces under ``layout`` have ``local_shape``."""
    return tuple(n * mesh.axis_size(d.axes) for n, d in zip(local_shape, layout.dims))


def _product_block(dev, name: str, a, b, c_passes: int):
    """The compute block of a @ b on ``dev``: 2mkn FLOPs touching A, B and ``c_passes``
    passes over C (1: written; 2: read and written)."""
    m, k = a.shape
    n = b.shape[1]
    itemsize = a.dtype.itemsize
    return dev.compute(name, flops=2 * m * k * n,
                       bytes=(m * k + k * n + c_passes * m * n) * itemsize,
                       gemm=(1, m, k, n))


def local_matmul(dev, a, b, name: str = "matmul"):
    """a @ b on this device, declared to it as 2mkn FLOPs touching the three operands."""
    with _product_block(dev, name, a, b, c_passes=1):
        m, n = a.shape[0], b.shape[1]
        dtype = a.dtype if a.dtype == b.dtype else np.result_type(a.dtype, b.dtype)
        if dev.xp is np and m * n * dtype.itemsize >= _RESIDENT_MIN_BYTES:
            out = dev.empty((m, n), dtype)
            return np.matmul(a, b, out=out)
        return dev.xp.matmul(a, b)


def matmul_accumulate(dev, a, b, out, *, first: bool, name: str = "matmul accumulate"):
    """out += a @ b on this device (out = a @ b when ``first``: a new sum), declared as
    one GEMM that also reads and writes C — 2mkn FLOPs, (mk + kn + 2mn) elements — every
    time: what a GPU framework with gradient-accumulation fusion runs for each
    micro-batch into a buffer zeroed at the step's start (Megatron-LM's fused wgrad
    into ``main_grad``). Here the first writes instead of adding to zeros: the same
    numbers without a pass of zeros."""
    with _product_block(dev, name, a, b, c_passes=2):
        return gemm_accumulate(a, b, out, beta=0.0 if first else 1.0)


class MatMul(ShardedOperation):
    """C = A @ B with ``sharding`` = MatMulSharding(a, b, c).

    ``algorithms`` optionally maps a collective name to the algorithm its
    redistributions use (e.g. ``sharding.MESSAGE_ALGORITHMS`` for ring / pairwise).
    """

    name = "matmul"

    def __init__(self, sharding: MatMulSharding, algorithms: Mapping[str, str] | None = None):
        if not isinstance(sharding, MatMulSharding):
            raise TypeError(f"MatMul: sharding must be a MatMulSharding, got {sharding!r}")
        self.sharding = sharding
        self.algorithms = dict(algorithms or {})
        self._grads: tuple | None = None

    def __repr__(self) -> str:
        return f"MatMul({self.sharding})"

    @property
    def dc_layout(self) -> TensorSharding:
        """Layout of dC in the backward pass: c's, replicated where c is partial."""
        return TensorSharding(*self.sharding.c.dims)

    def gradient_ops(self) -> tuple["MatMul", "MatMul"]:
        """The MatMuls of the backward pass: dA = dC @ B^T -> a, dB = A^T @ dC -> b."""
        if self._grads is None:
            s = self.sharding
            self._grads = (
                MatMul(MatMulSharding(self.dc_layout, transpose_layout(s.b), s.a), self.algorithms),
                MatMul(MatMulSharding(transpose_layout(s.a), self.dc_layout, s.b), self.algorithms))
        return self._grads

    def plan(self, mesh, a_shape, b_shape, itemsize: int = 8) -> MatMulPlan:
        """The sharding's plan for these global shapes (memoised per process)."""
        return self.sharding.plan(mesh, a_shape, b_shape, itemsize)

    # --- per-device programs --------------------------------------------------------
    def forward_local(self, dev, a, b):
        s, mesh = self.sharding, dev.mesh
        plan = self.plan(mesh, global_shape(a.shape, s.a, mesh), global_shape(b.shape, s.b, mesh),
                         np.dtype(a.dtype).itemsize)
        a = redistribute(dev, a, plan.a_plan, self.algorithms)
        b = redistribute(dev, b, plan.b_plan, self.algorithms)
        return redistribute(dev, local_matmul(dev, a, b), plan.c_plan, self.algorithms)

    def backward_local(self, dev, a, b, dc):
        """(dA, dB) in A's and B's layouts from the local dC (layout ``dc_layout``)."""
        grad_a, grad_b = self.gradient_ops()
        return grad_a.forward_local(dev, dc, b.T), grad_b.forward_local(dev, a.T, dc)

    # --- host conveniences ----------------------------------------------------------
    def run(self, cluster, A, B):
        """Global A, B in; global C out (partial layouts summed)."""
        self.sharding.validate(cluster.mesh, np.shape(A), np.shape(B))
        s = self.sharding
        return run_sharded(cluster, self.forward_local, [(A, s.a), (B, s.b)], [s.c])

    def backward(self, cluster, A, B, dC):
        """Global A, B, dC in; global (dA, dB) out."""
        s = self.sharding
        s.validate(cluster.mesh, np.shape(A), np.shape(B))
        return run_sharded(cluster, self.backward_local,
                           [(A, s.a), (B, s.b), (dC, self.dc_layout)], [s.a, s.b])

    def explain(self, mesh, a_shape, b_shape, dtype=np.float64, backward: bool = False):
        """Per device and step: FLOPs, collectives, group sizes, algorithms, bytes."""
        itemsize = np.dtype(dtype).itemsize
        rows = self._explain_rows(mesh, a_shape, b_shape, itemsize, "forward")
        if backward:
            m, n = a_shape[0], b_shape[1]
            grad_a, grad_b = self.gradient_ops()
            rows += grad_a._explain_rows(mesh, (m, n), (n, a_shape[1]), itemsize, "backward dA")
            rows += grad_b._explain_rows(mesh, (a_shape[1], m), (m, n), itemsize, "backward dB")
        return to_frame(rows)

    def _explain_rows(self, mesh, a_shape, b_shape, itemsize, phase) -> list[dict]:
        plan = self.plan(mesh, a_shape, b_shape, itemsize)
        return (plan_rows(mesh, plan.a_plan, phase, "redistribute A", itemsize, self.algorithms)
                + plan_rows(mesh, plan.b_plan, phase, "redistribute B", itemsize, self.algorithms)
                + compute_rows(mesh, phase, "matmul", "local A @ B", plan.flops_per_device)
                + plan_rows(mesh, plan.c_plan, phase, "redistribute C", itemsize, self.algorithms))
