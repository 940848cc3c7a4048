"""Two hundred training steps leave the arenas as one step does (issue 32's acceptance): the
issue's width-1024 MLP on dp 2 x pp 4 and on tp 2 x pp 2 x dp 2, the GPT training program,
and a run recovered from a crash. The same checks as test_arena_steps (which runs 12-30
steps of each in seconds), at the length where the old leak was fatal (ArenaFullError
near step 27 at width 1024): arena bytes in use 0 after the run, peaks equal to a 1-step
run's up to the pipeline messages in flight, and the trained result equal to the
single-process reference.
"""

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster import VirtualCluster
from vcluster.runtime.faults import CrashFault

from .test_arena_steps import _arena_after, _assert_flat, _assert_reference, _data, _in_flight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 200
WIDE = [1024] * 9


@pytest.fixture(scope="module")
def wide_reference():
    """The width-1024 MLP trained STEPS steps in this process (both meshes train the same
    model on the same data: one reference for both)."""
    mlp, (X, Y) = MLP(WIDE, seed=0), _data(WIDE, batch=16)
    return mlp.fit_reference(X, Y, steps=STEPS, optimizer="sgd", lr=0.01)


@pytest.mark.parametrize("shape, axes, microbatches", [((2, 4), ("dp", "pp"), 2),
                                                       ((2, 2, 2), ("dp", "pp", "tp"), 2)])
def test_mlp_width_1024_200_steps(shape, axes, microbatches, wide_reference):
    """Micro-batches: fewer than the stages on pp 4, as many on pp 2 (each micro-batch
    re-reads every weight, so these steps are memory-bound: ~0.4 s each at m = 4 on
    pp 4, two thirds of that at m = 2; test_arena_steps runs m = 4 for 12-30 steps)."""
    mlp, (X, Y) = MLP(WIDE, seed=0), _data(WIDE, batch=16)
    kw = dict(microbatches=microbatches, schedule="1f1b", optimizer="sgd", lr=0.01)
    mesh = Mesh(shape, axes)
    with VirtualCluster(mesh, timeout_s=60.0) as cluster:
        one = _arena_after(cluster, lambda: mlp.fit(cluster, X, Y, steps=1, **kw))
        many = _arena_after(cluster, lambda: mlp.fit(cluster, X, Y, steps=STEPS, **kw))
    pp = dict(zip(axes, shape))["pp"]
    message = 16 // (2 * microbatches) * 1024 * 8        # rows x width x float64
    _assert_flat(one, many, slack=_in_flight(message, pp), why=str(mesh))
    _assert_reference(mlp, many[2], X, Y, STEPS, wide_reference)


def test_gpt_tp2_pp2_dp2_200_steps():
    cfg = GPTConfig(hidden=64, layers=4, heads=4, seq=8, vocab=64)
    gpt, par = GPT(cfg, seed=1), ParallelConfig(global_batch=8, dp=2, pp=2, tp=2)
    rng = np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    with VirtualCluster(par.mesh(), timeout_s=60.0) as cluster:
        def fit(n):
            return gpt.fit(cluster, tokens, targets, steps=n, parallel=par, optimizer="sgd",
                           lr=0.01)
        one = _arena_after(cluster, lambda: fit(1))
        many = _arena_after(cluster, lambda: fit(STEPS))
    _assert_flat(one, many, slack=_in_flight(1 * cfg.seq * cfg.hidden * 8, 2), why="GPT")
    ref = gpt.fit_reference(tokens, targets, steps=STEPS, optimizer="sgd", lr=0.01)
    np.testing.assert_allclose(many[2].losses, ref.losses, rtol=1e-9, atol=1e-12)


def test_recovered_200_step_run(tmp_path):
    """A crash at step 130, restart from the checkpoint of step 100; the processes since
    the restart (100 steps) peak where a 1-step run does."""
    sizes = [16, 512, 8, 512, 16]
    mlp, (X, Y) = MLP(sizes, seed=3), _data(sizes, batch=16)
    kw = dict(microbatches=4, schedule="1f1b", optimizer="sgd", lr=0.01, checkpoint_every=50)
    with VirtualCluster(Mesh((2, 2), ("dp", "pp")), timeout_s=60.0) as cluster:
        one = _arena_after(cluster, lambda: mlp.fit(
            cluster, X, Y, steps=1, checkpoint_dir=str(tmp_path / "one"), **kw))
        run = mlp.fit(cluster, X, Y, steps=STEPS, checkpoint_dir=str(tmp_path / "crash"),
                      faults=[CrashFault(rank=3, at_step=130)], recovery="restart", **kw)
        st = cluster.stats()
    assert len(run.recoveries) == 1
    _assert_flat(one, (st["arena_bytes_in_use"].tolist(), st["arena_peak_bytes"].tolist(),
                       None), why="recovered run")
    _assert_reference(mlp, run, X, Y, STEPS)
