"""ZeRO-2 and ZeRO-3 (FSDP), and tensor parallelism's overlapped backward, on the torch
engine (4 gloo ranks, dp 2 x tp 2): the same training programs train the MLP and GPT as
the single-process references do."""

import importlib.util

import numpy as np
import pytest

# A skip mark, not importorskip: the devices import this module and must not pay for torch.
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed"),
              pytest.mark.timeout(300), pytest.mark.slow]

from mesh import Mesh  # noqa: E402
from pipeline_parallel import MLP  # noqa: E402
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig  # noqa: E402

RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(scope="module")
def torch_cluster():
    from vcluster.torchdist import TorchCluster
    with TorchCluster(Mesh((2, 1, 2), ("dp", "pp", "tp")), backend="gloo") as cluster:
        yield cluster


def test_mlp_zero_2_and_3_on_torch(torch_cluster):
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((16, 6)), rng.standard_normal((16, 4))
    mlp = MLP([6, 16, 16, 4], activation="tanh", seed=1)
    ref = mlp.fit_reference(X, Y, steps=2, optimizer="adam", lr=0.01)
    for zero in (2, 3):
        run = mlp.fit(torch_cluster, X, Y, steps=2, microbatches=2, optimizer="adam", lr=0.01,
                      zero_stage=zero)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
        for got, want in zip(run.params, ref.params, strict=True):
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"zero={zero}")


def test_gpt_zero_2_and_3_on_torch(torch_cluster):
    cfg = GPTConfig(hidden=8, layers=2, heads=2, seq=4, vocab=16)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    ref = gpt.fit_reference(tokens, targets, steps=2, lr=0.1, momentum=0.9)
    for zero in (2, 3):
        par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, tp=2, zero_stage=zero)
        run = gpt.fit(torch_cluster, tokens, targets, steps=2, parallel=par, lr=0.1,
                      momentum=0.9)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
        for what in ("params", "grads"):
            for name, want in getattr(ref, what).items():
                np.testing.assert_allclose(getattr(run, what)[name], want, rtol=RTOL,
                                           atol=ATOL, err_msg=f"{what} {name} zero={zero}")


@pytest.mark.parametrize("sp", [False, True])
def test_gpt_backward_overlap_on_torch(torch_cluster, sp):
    """Tensor parallelism's asynchronous input-gradient reductions (the default
    ``tp_overlap``: an async all_reduce, or reduce_scatter under sequence parallelism,
    waited after the weight gradients) through torch.distributed's async work."""
    cfg = GPTConfig(hidden=8, layers=2, heads=2, seq=4, vocab=16)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    ref = gpt.fit_reference(tokens, targets, steps=2, lr=0.1, momentum=0.9)
    par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, tp=2, sequence_parallel=sp)
    assert par.use_async_grad_reduce
    run = gpt.fit(torch_cluster, tokens, targets, steps=2, parallel=par, lr=0.1, momentum=0.9)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
    for what in ("params", "grads"):
        for name, want in getattr(ref, what).items():
            np.testing.assert_allclose(getattr(run, what)[name], want, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{what} {name} sp={sp}")
