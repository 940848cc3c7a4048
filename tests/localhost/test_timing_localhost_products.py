"""``localhost`` prices every product as BLAS work and elementwise expressions at the
vector rate, whatever the dtype and however skinny the product (a micro-batch of 8 rows):
the closed forms of docs/timing.md, and the real declarations of the programs."""

import numpy as np
import pytest

from tests.localhost_specs import spec
from vcluster.runtime.tracing import MetaArray, TraceCompute, trace_program
from vcluster.localhost.cost_model import BLAS_MIN_FLOPS_PER_ELEMENT, LocalhostCostModel
from mesh import Mesh
from tensor_parallel.matmul import local_matmul


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float64", 8)])
@pytest.mark.parametrize("m, k, n", [(8, 128, 128), (128, 64, 64), (18, 18, 18),
                                     (2048, 1024, 2048)])
def test_products_are_priced_at_the_gemm_rate(dtype, itemsize, m, k, n):
    s = spec()
    model = LocalhostCostModel(s, 8, dtype)
    flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * itemsize
    gemm = s.gemm_float32_flops_per_s if dtype == "float32" else s.gemm_float64_flops_per_s
    streamed = nbytes * s.busy_factor(s.memcpy_busy_speedup) / s.memcpy_bytes_per_s
    expected = s.compute_overhead_s + flops / gemm + streamed
    assert model.compute_time_s(TraceCompute("matmul", flops, nbytes)) == \
        pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_elementwise_work_is_priced_at_the_vector_rate(dtype):
    """gelu' of a (256, 1024) array: about 6 flops per element over 2 operands and a
    result, far below the bound."""
    s, n = spec(), 256 * 1024
    itemsize = np.dtype(dtype).itemsize
    op = TraceCompute("activation grad", 20 * n, 3 * n * itemsize)
    assert op.flops / (op.bytes / itemsize) < BLAS_MIN_FLOPS_PER_ELEMENT
    vector = s.vector_float32_flops_per_s if dtype == "float32" else s.vector_float64_flops_per_s
    kernel = max(op.flops * s.busy_factor(s.vector_busy_speedup) / vector,
                 op.bytes * s.busy_factor(s.memcpy_busy_speedup) / s.iadd_bytes_per_s)
    assert LocalhostCostModel(s, 8, dtype).compute_time_s(op) == pytest.approx(
        s.compute_overhead_s + kernel, rel=1e-12)


def test_a_micro_batch_product_of_the_mlp_is_blas():
    """The declaration local_matmul makes for (8, 128) @ (128, 128) float64 — a quickstart
    micro-batch — is priced within 2x of its GEMM time, not at the vector rate."""
    mesh = Mesh((1,), ("x",))

    def program(dev, a, b):
        local_matmul(dev, a, b)
    (trace,) = trace_program(mesh, program, [(MetaArray((8, 128), np.float64),
                                              MetaArray((128, 128), np.float64))])
    (op,) = [o for o in trace.ops if isinstance(o, TraceCompute)]
    s = spec()
    t = LocalhostCostModel(s, 1, "float64").compute_time_s(op)
    assert t < 2 * (s.compute_overhead_s + op.flops / s.gemm_float64_flops_per_s
                    + op.bytes * s.busy_factor(s.memcpy_busy_speedup) / s.memcpy_bytes_per_s)
    assert t < op.flops / s.vector_float64_flops_per_s / 10
