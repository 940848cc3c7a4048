"""The optimizers update large parameters in cache-sized blocks: bit for bit what the
update of whole arrays gives (the formulas written out here, on whole arrays)."""

import numpy as np
import pytest

from pipeline_parallel.optim import BLOCK_BYTES, Optimizer, OptimizerConfig

ITEMS = BLOCK_BYTES // 8
SHAPES = [(5,), (ITEMS,), (ITEMS + 1,), (3 * ITEMS + ITEMS // 2,), (700, 300), (64, 2 * ITEMS // 64)]


def _whole(name, params, grads, steps, cfg):
    """The update rules on whole arrays, as the module docstring states them."""
    p = [x.copy() for x in params]
    m = [np.zeros_like(x) for x in params]
    v = [np.zeros_like(x) for x in params]
    for t in range(1, steps + 1):
        for i, g in enumerate(grads):
            if name == "sgd":
                v[i] *= cfg.momentum
                v[i] += g
                p[i] -= cfg.lr * v[i]
            else:
                b1, b2 = cfg.betas
                m[i] *= b1
                m[i] += (1 - b1) * g
                v[i] *= b2
                v[i] += (1 - b2) * g * g
                p[i] -= cfg.lr * (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t))
                                                          + cfg.eps)
    return p


@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocks_equal_whole_arrays_bit_for_bit(name, dtype):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    cfg = OptimizerConfig(name=name, lr=0.01)
    mine = [x.copy() for x in params]
    opt = Optimizer(cfg, mine)
    for _ in range(3):
        opt.step(mine, grads)
    for got, want in zip(mine, _whole(name, params, grads, 3, cfg)):
        np.testing.assert_array_equal(got, want)


def test_strided_parameters_take_the_whole_array_path():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((2 * ITEMS, 2))
    p, g = base[:, 0], rng.standard_normal(2 * ITEMS)      # a strided view, updated in place
    want = _whole("sgd", [p.copy()], [g], 2, OptimizerConfig())[0]
    opt = Optimizer(OptimizerConfig(), [p])
    opt.step([p], [g])
    opt.step([p], [g])
    np.testing.assert_array_equal(base[:, 0], want)
