"""Training leaves nothing behind in the arenas (issue 32, "No leak"): a device's arena use
after step k equals its use after step 1, read through ``cluster.stats()``.

Within one run, a leak shows as a peak that grows with the steps; between runs, as bytes
still in use. So each test compares a 1-step run with a many-step run of the same job:
``arena_peak_bytes`` (since ``reset_stats``) must not grow with the number of steps, and
``arena_bytes_in_use`` after the run must be 0. The old code kept every DDP bucket's
all-reduce result until the end of the run (the communication queue held the finished
futures): +2 buckets per step per device, the peak grew by (steps - 1) x that.

The issue's width-1024 model runs 200 steps in ``test_arena_soak.py`` (slow). Where every
pipeline message travels inline (stage boundaries of 8 features: 128 bytes),
nothing in the arena depends on timing and the peaks are equal to the byte. Where
messages are staged in the sender's arena (wide boundaries), a few of them may be in
flight at the peak, so the peaks agree up to ``_in_flight`` message bytes — far below one
leaked bucket. The trained result still equals the single-process reference.
"""

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.checkpoint import params_sha256
from vcluster import VirtualCluster
from vcluster.runtime.faults import CrashFault

pytestmark = pytest.mark.timeout(300)

DP2_PP4 = Mesh((2, 4), ("dp", "pp"))
NARROW = [16, 512, 8, 512, 8, 512, 8, 512, 16]   # buckets of 69-100 KiB, inline messages


def _data(sizes, batch, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, sizes[0])), rng.standard_normal((batch, sizes[-1]))


def _arena_after(cluster, train):
    """(bytes in use, peak bytes) per device for ``train()``, and what it returned."""
    cluster.reset_stats()
    result = train()
    st = cluster.stats()
    return st["arena_bytes_in_use"].tolist(), st["arena_peak_bytes"].tolist(), result


def _in_flight(message_bytes: int, pp: int) -> int:
    """Bound on staged pipeline messages alive at once on a device: the 1F1B warm-up
    sends up to pp activations before the first gradient comes back, and as many
    gradients the other way (each block rounded to the arena's 64-byte alignment)."""
    return 2 * pp * (-(-message_bytes // 64) * 64)


def _assert_flat(one, many, slack=0, why=""):
    in_one, peak_one, _ = one
    in_many, peak_many, _ = many
    assert in_one == in_many == [0] * len(in_one), why
    for r, (p1, pn) in enumerate(zip(peak_one, peak_many)):
        assert abs(pn - p1) <= slack, (f"{why} rank {r}: peak {pn} bytes after the many-step "
                                       f"run, {p1} after 1 step (slack {slack})")
    assert min(peak_one) > 64 * 1024, "the run must use the arena for a meaningful check"


def _assert_reference(mlp, run, X, Y, steps, ref=None):
    """``run`` equals ``mlp.fit_reference`` (``ref``: that reference, computed already)."""
    if ref is None:
        ref = mlp.fit_reference(X, Y, steps=steps, optimizer="sgd", lr=0.01)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-9, atol=0)
    for (w, b), (rw, rb) in zip(run.params, ref.params):
        np.testing.assert_allclose(w, rw, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(b, rb, rtol=1e-9, atol=1e-12)


def test_stats_report_arena_use_and_peak(cluster_of):
    cluster = cluster_of(Mesh((2,), ("dp",)))

    def prog(dev, nbytes):
        keep = dev.empty(nbytes // 8, np.float64)        # released when the program ends
        keep[...] = 1.0
        return float(keep.sum())

    in_use, peak, out = _arena_after(cluster, lambda: cluster.run(prog, [(1 << 20,)] * 2))
    assert out == [float(1 << 17)] * 2
    assert in_use == [0, 0] and peak == [1 << 20, 1 << 20]
    cluster.reset_stats()                                # a new peak window
    assert cluster.stats()["arena_peak_bytes"].tolist() == [0, 0]


def test_mlp_1f1b_dp2_pp4_arena_flat_to_the_byte(cluster_of):
    """Inline messages: peaks after 1 and 30 steps are equal exactly (old code: +~100
    KiB per step per device)."""
    cluster, mlp = cluster_of(DP2_PP4), MLP(NARROW, seed=0)
    X, Y = _data(NARROW, batch=16)
    kw = dict(microbatches=4, schedule="1f1b", optimizer="sgd", lr=0.01)
    one = _arena_after(cluster, lambda: mlp.fit(cluster, X, Y, steps=1, **kw))
    many = _arena_after(cluster, lambda: mlp.fit(cluster, X, Y, steps=30, **kw))
    _assert_flat(one, many)
    _assert_reference(mlp, many[2], X, Y, 30)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_dp2_pp2_arena_flat(tp):
    """The GPT training program, DDP over dp (with tp 2: Megatron TP inside the stages,
    whose blocking collectives used to drop the finished buckets in passing; with tp 1
    nothing did, and the old code grew by a bucket per step)."""
    cfg = GPTConfig(hidden=64, layers=4, heads=4, seq=8, vocab=64)
    gpt, par = GPT(cfg, seed=1), ParallelConfig(global_batch=8, dp=2, pp=2, tp=tp)
    rng = np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    steps = 12
    with VirtualCluster(par.mesh(), timeout_s=30.0, run_timeout_s=300.0) as cluster:
        def fit(n):
            return gpt.fit(cluster, tokens, targets, steps=n, parallel=par, optimizer="sgd",
                           lr=0.1)
        one = _arena_after(cluster, lambda: fit(1))
        many = _arena_after(cluster, lambda: fit(steps))
    message = 1 * cfg.seq * cfg.hidden * 8              # one sample's activations
    _assert_flat(one, many, slack=_in_flight(message, 2), why="GPT")
    ref = gpt.fit_reference(tokens, targets, steps=steps, optimizer="sgd", lr=0.1)
    np.testing.assert_allclose(many[2].losses, ref.losses, rtol=1e-9, atol=1e-12)
    for name, p in ref.params.items():
        np.testing.assert_allclose(many[2].params[name], p, rtol=1e-9, atol=1e-12,
                                   err_msg=name)


def test_recovered_run_arena_flat(tmp_path):
    """A crash at step 6, restart from the checkpoint of step 4: the segments after the
    restart (4 steps each) peak where a 1-step segment does."""
    sizes = [16, 512, 8, 512, 16]
    mlp, (X, Y) = MLP(sizes, seed=3), _data(sizes, batch=16)
    kw = dict(microbatches=4, schedule="1f1b", optimizer="sgd", lr=0.01, checkpoint_every=4)
    with VirtualCluster(Mesh((2, 2), ("dp", "pp")), timeout_s=30.0) as cluster:
        one = _arena_after(cluster, lambda: mlp.fit(
            cluster, X, Y, steps=1, checkpoint_dir=str(tmp_path / "one"), **kw))
        clean = mlp.fit(cluster, X, Y, steps=12, checkpoint_dir=str(tmp_path / "clean"), **kw)
        run = mlp.fit(cluster, X, Y, steps=12, checkpoint_dir=str(tmp_path / "crash"),
                      faults=[CrashFault(rank=3, at_step=6)], recovery="restart", **kw)
        st = cluster.stats()                              # the processes since the restart
    assert len(run.recoveries) == 1
    _assert_flat(one, (st["arena_bytes_in_use"].tolist(), st["arena_peak_bytes"].tolist(),
                       None), why="recovered run")
    assert params_sha256(run.params) == params_sha256(clean.params)
    _assert_reference(mlp, run, X, Y, 12)
