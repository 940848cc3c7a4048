"""The workloads on device arrays: every MatMul policy forward and backward on 1-, 2- and
3-axis meshes, every FeedForward policy, the pipelined MLP with every schedule (and
dp x pp x tp), the GPT training program and checkpointed training — each equal to its
single-process numpy reference, as on ``array_module="numpy"``."""

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.gpt import GPT
from tensor_parallel import FeedForward, FeedForwardSharding, MatMulShardingPolicy as P
from tests.pipeline_parallel import test_gpt as G
from tests.pipeline_parallel.test_pipeline_parallel import SIZES, _data, _optim, assert_same_training
from tests.tensor_parallel.test_ffn import CASES as FFN_CASES, MESHES as FFN_MESHES, _check_numerics
from tests.tensor_parallel.test_matmul import M, K, N, assert_close, cases_by_policy, run_jobs

pytestmark = pytest.mark.timeout(900)

MATMUL_MESHES = {"4": Mesh((4,), ("tp",)), "2x4": Mesh((2, 4), ("dp", "tp")),
                 "2x2x2": Mesh((2, 2, 2), ("x", "y", "z"))}


@pytest.mark.parametrize("name", list(MATMUL_MESHES))
def test_matmul_every_policy_forward_and_backward(device_cluster_of, name):
    mesh = MATMUL_MESHES[name]
    rng = np.random.default_rng(11)
    A, B, dC = rng.standard_normal((M, K)), rng.standard_normal((K, N)), rng.standard_normal((M, N))
    found = cases_by_policy(mesh, per_policy=3, seed=5)
    if name == "2x2x2":
        assert all(found[p] for p in P)                 # every policy is on the 3-axis mesh
    shardings = [s for v in found.values() for s in v]
    results = run_jobs(device_cluster_of(mesh), mesh, shardings, A, B, dC)
    for s, (c, da, db) in zip(shardings, results):
        for got, want, what in ((c, A @ B, "C"), (da, dC @ B.T, "dA"), (db, A.T @ dC, "dB")):
            try:
                assert_close(got, want, np.float64)
            except AssertionError as exc:
                raise AssertionError(f"{what} wrong for {s} on {mesh}:\n{exc}") from None


@pytest.mark.parametrize("mesh_name", ["2x4", "2x2x2"])
def test_feedforward_every_policy(device_cluster_of, mesh_name):
    mesh = FFN_MESHES[mesh_name]
    cases = [c for c in FFN_CASES if c[0] == mesh_name]
    assert {c[1] for c in cases} == set(type(cases[0][1]))
    for _, policy, tp, dp in cases:
        for activation in ("relu", "gelu"):
            op = FeedForward(FeedForwardSharding(policy, tp=tp, dp=dp), activation=activation)
            _check_numerics(device_cluster_of(mesh), op, (4, 8, 16), 32, np.float64)


# fewer micro-batches than stages, as many, and more
@pytest.mark.parametrize("schedule, ms, v", [("gpipe", (1, 2, 5), None), ("1f1b", (1, 2, 5), None),
                                             ("zero_bubble", (1, 2, 5), None),
                                             ("interleaved_1f1b", (2, 4), 2)])
def test_mlp_every_schedule(device_cluster_of, schedule, ms, v):
    mlp = MLP(SIZES, activation="gelu", loss="mse", seed=3)
    X, Y = _data(1)
    extra = {} if v is None else {"virtual_stages": v}
    for mesh, opt in ((Mesh((2,), ("pp",)), "adam"), (Mesh((2, 2, 2), ("dp", "pp", "tp")), "sgd")):
        ref = mlp.fit_reference(X, Y, steps=2, **_optim(opt))
        for m in ms:
            run = mlp.fit(device_cluster_of(mesh), X, Y, steps=2, microbatches=m,
                          schedule=schedule, bucket_bytes=4096, **extra, **_optim(opt))
            assert_same_training(run, ref)


GPT_RUNS = [("dp2 pp2 tp2", "1f1b", 2, True, "selective", {}),
            ("pp2", "interleaved_1f1b", 2, False, "full", {"virtual_stages": 2}),
            ("tp4", "gpipe", 2, True, "none", {}),
            ("dp2 pp2", "zero_bubble", 1, False, "none", {})]


# float64 on a GPU: cuBLAS and CuPy reductions sum in another order than numpy, and Adam
# divides each gradient by its own root mean square, so the parameters of near-zero
# gradients after two steps differ by ~1e-9 relative (2e-9 seen on an H200).
GPT_RTOL = {"strict": G.RTOL, "cupy": 1e-7}


@pytest.mark.parametrize("spec, schedule, b, sp, recompute, extra", GPT_RUNS,
                         ids=[r[0].replace(" ", "-") + "-" + r[1] for r in GPT_RUNS])
def test_gpt_training(device_cluster_of, array_module, spec, schedule, b, sp, recompute, extra):
    gpt = GPT(G.CFG, seed=1)
    tokens, targets = G._data()
    ref_loss, ref_logits = gpt.reference_forward(tokens, targets)
    ref = gpt.fit_reference(tokens, targets, steps=G.STEPS, optimizer="adam", lr=0.01)
    mesh = G._mesh(spec)
    par = G._parallel(mesh, micro_batch=b, schedule=schedule, sequence_parallel=sp,
                      recompute=recompute, **extra)
    cluster = device_cluster_of(mesh)
    loss, logits = gpt.forward(cluster, tokens, targets, par)
    np.testing.assert_allclose(loss, ref_loss, rtol=G.RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=G.RTOL, atol=G.ATOL)
    run = gpt.fit(cluster, tokens, targets, steps=G.STEPS, parallel=par, optimizer="adam", lr=0.01)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=G.RTOL)
    for name in ref.params:
        np.testing.assert_allclose(run.params[name], ref.params[name],
                                   rtol=GPT_RTOL[array_module], atol=G.ATOL, err_msg=name)


def test_checkpointed_training_resumes_exactly(device_cluster_of, tmp_path):
    """Checkpoints written by device training hold host arrays; resuming from one ends
    where uninterrupted training ends."""
    mlp = MLP(SIZES, activation="relu", loss="mse", seed=7)
    X, Y = _data(3)
    cluster = device_cluster_of(Mesh((2,), ("pp",)))
    full = mlp.fit(cluster, X, Y, steps=4, microbatches=3, optimizer="adam", lr=0.01,
                   checkpoint_every=2, checkpoint_dir=str(tmp_path))
    assert len(full.checkpoints) == 2
    resumed = mlp.fit(cluster, X, Y, steps=4, microbatches=3, optimizer="adam", lr=0.01,
                      resume_from=full.checkpoints[0])
    assert_same_training(resumed, mlp.fit_reference(X, Y, steps=4, optimizer="adam", lr=0.01))
    np.testing.assert_array_equal(resumed.losses, full.losses)


def test_mlp_cross_entropy_with_integer_labels(device_cluster_of):
    """Class labels arrive as a device int array; the one-hot rows are built on the
    device (found by running scenarios/mlp_dp_pp_tp.yaml under the strict module)."""
    mlp = MLP(SIZES, activation="relu", loss="cross_entropy", seed=4)
    X, Y = _data(2, classes=True)
    ref = mlp.fit_reference(X, Y, steps=2, optimizer="sgd", lr=0.05)
    run = mlp.fit(device_cluster_of(Mesh((2, 2, 2), ("dp", "pp", "tp"))), X, Y, steps=2,
                  microbatches=2, optimizer="sgd", lr=0.05)
    assert_same_training(run, ref)
