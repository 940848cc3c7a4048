"""A device killed mid-training costs a restart from the last checkpoint, never the run's
data: the final parameters equal a fault-free run bit for bit (and the numpy reference to
rounding); a straggler gives the identical result, later; ``fail`` names the checkpoint."""

import random
import re
import time

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.checkpoint import CheckpointError, params_sha256
from pipeline_parallel.resilient import TrainingInterrupted
from vcluster import VirtualCluster
from vcluster.runtime.faults import CrashFault, SlowFault

pytestmark = pytest.mark.timeout(240)

STEPS = 7


def _data(sizes, batch=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, sizes[0])), rng.standard_normal((batch, sizes[-1]))


@pytest.mark.parametrize("shape,axes,optimizer,every", [
    ((2, 2), ("pp", "tp"), "adam", 2),
    ((2, 2), ("dp", "pp"), "sgd", 3),
    ((4,), ("pp",), "adam", 1),
])
def test_crash_at_a_random_step_with_restart_is_bit_identical(tmp_path, cluster_of, shape,
                                                              axes, optimizer, every):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    mesh = Mesh(shape, axes)
    crash = CrashFault(rank=rng.randrange(mesh.size), at_step=rng.randrange(STEPS))
    sizes = [8, 16, 16, 16, 4]
    mlp, (X, Y) = MLP(sizes, seed=3), _data(sizes)
    cluster = cluster_of(mesh)
    kw = dict(steps=STEPS, microbatches=3, optimizer=optimizer, lr=0.02)
    clean = mlp.fit(cluster, X, Y, **kw)
    run = mlp.fit(cluster, X, Y, **kw, checkpoint_every=every, checkpoint_dir=str(tmp_path),
                  faults=[crash], recovery="restart")
    why = f"seed {seed}: {crash}"
    assert params_sha256(run.params) == params_sha256(clean.params), why
    assert np.array_equal(run.losses, clean.losses), why
    ref = mlp.fit_reference(X, Y, steps=STEPS, optimizer=optimizer, lr=0.02)
    for (w, b), (rw, rb) in zip(run.params, ref.params):
        np.testing.assert_allclose(w, rw, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(b, rb, rtol=1e-10, atol=1e-12)
    [rec] = run.recoveries
    last = crash.at_step // every * every                  # newest checkpoint before it
    assert (rec.rank, rec.lost_at_step, rec.resumed_from_step) == (crash.rank, crash.at_step,
                                                                   last), why
    assert rec.checkpoint == (None if last == 0 else str(tmp_path / f"step-{last:08d}"))
    expected = sorted({*range(every, STEPS + 1, every), STEPS})
    assert [int(p[-8:]) for p in dict.fromkeys(run.checkpoints)] == expected


def test_two_crashes_and_fail_then_resume_in_a_fresh_cluster(tmp_path):
    sizes = [6, 12, 12, 12, 3]
    mlp, (X, Y) = MLP(sizes, activation="tanh", seed=5), _data(sizes, batch=16, seed=2)
    kw = dict(steps=8, microbatches=4, schedule="gpipe", optimizer="sgd", lr=0.05)
    mesh = Mesh((4,), ("pp",))
    with VirtualCluster(mesh, timeout_s=20.0) as cluster:
        clean = mlp.fit(cluster, X, Y, **kw)
        twice = mlp.fit(cluster, X, Y, **kw, checkpoint_every=2,
                        checkpoint_dir=str(tmp_path / "a"), recovery="restart",
                        faults=[{"kind": "crash", "rank": 1, "at_step": 3},
                                {"kind": "crash", "rank": 2, "at_step": 6}])
        assert params_sha256(twice.params) == params_sha256(clean.params)
        assert [(r.rank, r.resumed_from_step) for r in twice.recoveries] == [(1, 2), (2, 6)]

        with pytest.raises(TrainingInterrupted) as info:
            mlp.fit(cluster, X, Y, **kw, checkpoint_every=2, checkpoint_dir=str(tmp_path / "b"),
                    faults=[CrashFault(3, 5)], recovery="fail")
        ckpt = str(tmp_path / "b" / "step-00000004")
        assert info.value.checkpoint == ckpt
        message = str(info.value)
        assert "rank 3 was lost at step 5" in message and ckpt in message
        assert "--resume" in message
    # a fresh cluster (the old one is gone) continues from the named checkpoint
    with VirtualCluster(mesh, timeout_s=20.0) as fresh:
        resumed = mlp.fit(fresh, X, Y, **kw, resume_from=str(tmp_path / "b"),
                          checkpoint_every=2, checkpoint_dir=str(tmp_path / "b"))
    assert params_sha256(resumed.params) == params_sha256(clean.params)
    assert np.array_equal(resumed.losses, clean.losses)
    assert resumed.recoveries == ()


def test_resume_refuses_another_runs_or_a_corrupt_checkpoint(tmp_path, cluster_of):
    sizes = [4, 8, 8, 2]
    cluster = cluster_of(Mesh((1,), ("pp",)))
    X, Y = _data(sizes, batch=8)
    kw = dict(steps=4, microbatches=2, optimizer="adam", lr=0.01, checkpoint_every=2,
              checkpoint_dir=str(tmp_path))
    MLP(sizes, seed=1).fit(cluster, X, Y, **kw)
    with pytest.raises(CheckpointError, match="fingerprint.lr is 0.01 there, 0.02 now"):
        MLP(sizes, seed=1).fit(cluster, X, Y, **dict(kw, lr=0.02), resume_from=str(tmp_path))
    with pytest.raises(CheckpointError, match="fingerprint.model"):
        MLP(sizes, seed=2).fit(cluster, X, Y, **kw, resume_from=str(tmp_path))
    npz = tmp_path / "step-00000004" / "arrays.npz"
    data = bytearray(npz.read_bytes())
    data[-100] ^= 1
    npz.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{npz}: sha256"):
        MLP(sizes, seed=1).fit(cluster, X, Y, **kw, resume_from=str(tmp_path))


@pytest.mark.parametrize("kw,message", [
    (dict(recovery="retry"), "recovery: 'retry' is not a policy; allowed: restart, fail"),
    (dict(checkpoint_every=0, checkpoint_dir="x"), "checkpoint_every: must be a positive int"),
    (dict(checkpoint_every=2), "checkpoint_dir: needed with checkpoint_every"),
    (dict(faults=[{"kind": "crash", "rank": 4, "at_step": 1}]),
     "faults[0].rank: rank 4 is not in the cluster; allowed: 0..1"),
])
def test_bad_resilience_arguments(cluster_of, kw, message):
    sizes = [4, 8, 2]
    with pytest.raises(ValueError) as info:
        MLP(sizes).fit(cluster_of(Mesh((2,), ("pp",))), *_data(sizes, batch=8), steps=2,
                       microbatches=2, **kw)
    assert message in str(info.value)


@pytest.mark.alone   # action times against the wall clock
def test_straggler_gives_the_identical_result_later(cluster_of):
    sizes = [8, 16, 16, 4]
    mlp, (X, Y) = MLP(sizes, seed=7), _data(sizes, batch=12)
    cluster = cluster_of(Mesh((1, 3), ("dp", "pp")))
    cost_s, m, steps, slowdown = 0.01, 3, 3, 3.0
    kw = dict(steps=steps, microbatches=m, optimizer="sgd", lr=0.05,
              action_costs={"F": cost_s, "B": cost_s})
    mlp.fit(cluster, X, Y, **dict(kw, steps=1))       # warm up the device processes

    def timed(**extra):
        cluster.reset_stats()
        t0 = time.perf_counter()
        fit = mlp.fit(cluster, X, Y, **kw, **extra)
        wall_s = time.perf_counter() - t0
        actions = [e.end - e.start for e in cluster.trace() if e.rank == 1
                   and re.fullmatch(r"\d+[FB]\d+", getattr(e, "name", ""))]   # e.g. 1F2
        return fit, wall_s, min(actions)               # shortest action: robust to load

    clean, clean_s, clean_action_s = timed()
    slow, slow_s, slow_action_s = timed(faults=[SlowFault(rank=1, slowdown=slowdown)])
    assert params_sha256(slow.params) == params_sha256(clean.params)
    # the straggler's own work alone: steps x m x (F + B) sleeps, each x slowdown
    assert slow_s >= steps * m * 2 * cost_s * slowdown and slow_s > clean_s
    assert slow_action_s >= slowdown * cost_s * 0.98 and clean_action_s < 1.8 * cost_s
    assert cluster.faults == ()                       # the fit's faults are withdrawn after it


def test_sampled_mini_batches_recover_bit_identical_and_resume_mid_epoch(tmp_path, cluster_of):
    """With batch_size the data position and the sampler's RNG state are checkpointed:
    a crash (and a resume from a checkpoint in the middle of an epoch) trains on exactly
    the batches of the uninterrupted run, which matches the numpy reference."""
    sizes = [8, 16, 16, 4]
    mlp, (X, Y) = MLP(sizes, seed=2), _data(sizes, batch=50, seed=4)
    cluster = cluster_of(Mesh((2, 1), ("dp", "pp")))
    kw = dict(steps=9, microbatches=3, optimizer="adam", lr=0.01, batch_size=12, data_seed=7)
    clean = mlp.fit(cluster, X, Y, **kw)
    ref = mlp.fit_reference(X, Y, 9, optimizer="adam", lr=0.01, batch_size=12, data_seed=7)
    np.testing.assert_allclose(clean.losses, ref.losses, rtol=1e-12)
    full = mlp.fit_reference(X, Y, 9, optimizer="adam", lr=0.01)
    assert not np.allclose(full.losses, ref.losses)           # the batches matter
    run = mlp.fit(cluster, X, Y, **kw, checkpoint_every=2, checkpoint_dir=str(tmp_path),
                  faults=[CrashFault(1, 5)], recovery="restart")
    assert params_sha256(run.params) == params_sha256(clean.params)
    assert np.array_equal(run.losses, clean.losses)
    from pipeline_parallel.checkpoint import load_checkpoint
    mid = load_checkpoint(str(tmp_path / "step-00000006"))
    assert mid.data_position == 6 * 12 and mid.rng_state["epoch"] == 1      # 72 of 2 x 50
    assert mid.rng_state["position"] == 22
    resumed = mlp.fit(cluster, X, Y, **kw, resume_from=str(tmp_path / "step-00000006"))
    assert params_sha256(resumed.params) == params_sha256(clean.params)
    from pipeline_parallel.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="fingerprint.data_seed is 7 there, 8 now"):
        mlp.fit(cluster, X, Y, **dict(kw, data_seed=8), resume_from=str(tmp_path))


def test_fail_with_a_slow_device_withdraws_it_for_the_next_restart(tmp_path):
    sizes = [4, 8, 8, 2]
    X, Y = _data(sizes, batch=8)
    with VirtualCluster(Mesh((3,), ("pp",)), timeout_s=20.0) as cluster:
        with pytest.raises(TrainingInterrupted):
            MLP(sizes).fit(cluster, X, Y, steps=3, microbatches=2, recovery="fail",
                           faults=[CrashFault(0, 1), SlowFault(2, 4.0)])
        assert cluster.faults == ()
        cluster.restart()
        assert MLP(sizes).fit(cluster, X, Y, steps=1, microbatches=2).losses.shape == (1,)
