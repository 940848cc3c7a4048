"""``gemm_accumulate``: C += A @ B in one BLAS call, equal to numpy's two passes."""

import numpy as np
import pytest

from mesh import Mesh
from tensor_parallel import matmul_accumulate
from tensor_parallel.gemm import gemm_accumulate
from vcluster import ComputeEvent
from vcluster.runtime.tracing.meta import MetaArray


def _operand(rng, shape, dtype, order):
    x = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    x = x.astype(dtype)
    if order == "F":
        return np.asfortranarray(x)
    if order == "T":                                   # a transposed view
        return np.ascontiguousarray(x.T).T
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("a_order", ["C", "F", "T"])
@pytest.mark.parametrize("b_order", ["C", "F", "T"])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (7, 3, 5), (64, 128, 33)])
def test_equals_numpy_in_place(dtype, a_order, b_order, mkn):
    m, k, n = mkn
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a, b = _operand(rng, (m, k), dtype, a_order), _operand(rng, (k, n), dtype, b_order)
    c = _operand(rng, (m, n), dtype, "C")
    want = c + a @ b
    before = c.__array_interface__["data"][0]
    out = gemm_accumulate(a, b, c)
    assert out is c and c.__array_interface__["data"][0] == before
    tol = 1e-4 if dtype in (np.float32, np.complex64) else 1e-12
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("case", ["int", "strided c", "mixed dtypes", "fortran c"])
def test_the_two_pass_path_gives_the_same_sum(case):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 4)), rng.standard_normal((4, 5))
    c = rng.standard_normal((6, 5))
    if case == "int":
        a, b, c = (np.round(x * 10).astype(np.int64) for x in (a, b, c))
    elif case == "strided c":
        c = rng.standard_normal((6, 10))[:, ::2]
    elif case == "mixed dtypes":
        a = a.astype(np.float32)
    elif case == "fortran c":
        c = np.asfortranarray(c)
    want = c + a @ b
    assert gemm_accumulate(a, b, c) is c
    np.testing.assert_allclose(c, want, rtol=1e-6)


def test_meta_arrays_pass_through():
    c = MetaArray((3, 5), np.float64)
    assert gemm_accumulate(MetaArray((3, 4), np.float64), MetaArray((4, 5), np.float64), c) is c


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_beta_zero_writes_without_reading(beta):
    a, b = np.ones((3, 4)), np.ones((4, 2))
    c = np.full((3, 2), np.nan)                         # BLAS must not read C at beta 0
    if beta == 1.0:
        c[...] = 1.0
    gemm_accumulate(a, b, c, beta=beta)
    np.testing.assert_array_equal(c, np.full((3, 2), 4.0 + beta))


def test_other_betas_are_refused():
    with pytest.raises(ValueError, match="beta must be 0 or 1, got 0.5"):
        gemm_accumulate(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), beta=0.5)


def test_matmul_accumulate_writes_then_adds_and_declares_c_read(cluster_of):
    """On a device: the first call writes (stale values ignored), the next adds; each is
    one compute block of 2mkn FLOPs over (mk + kn + 2mn) elements, first or not."""
    cluster = cluster_of(Mesh((1,), ("dp",)))

    def prog(dev):
        rng = np.random.default_rng(1)
        x, dz = rng.standard_normal((128, 96)), rng.standard_normal((128, 80))
        g = np.full((96, 80), 1e9)
        matmul_accumulate(dev, x.T, dz, g, first=True, name="dW")
        matmul_accumulate(dev, x.T, 2 * dz, g, first=False, name="dW")
        return float(np.abs(g - 3 * x.T @ dz).max())

    cluster.reset_stats()
    assert cluster.run(prog)[0] < 1e-11
    blocks = [(e.flops, e.bytes) for e in cluster.trace()
              if isinstance(e, ComputeEvent) and e.name == "dW"]
    want = (2 * 128 * 96 * 80, (128 * 96 + 128 * 80 + 2 * 96 * 80) * 8)
    assert blocks == [want, want]
