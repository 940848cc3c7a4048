"""The torch engine (4 and 8 gloo ranks) reproduces the oracle: every MatMul policy,
every FeedForward policy (forward and backward) and a 1F1B pipelined MLP training step.

Per mesh, one batch program runs every workload in ONE run: on the emulator it makes the
golden (checked here against unsharded numpy first, so the golden is trusted on its
own), on torch.distributed the actual results, compared with ``oracle.compare``. A
backend result perturbed on purpose is caught, naming the rank, the tensor and the index.
"""

import importlib.util

import numpy as np
import pytest

# A skip mark, not importorskip: the emulator's devices import this module to find its
# programs, and must not pay for importing torch.
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed")]

from mesh import Mesh  # noqa: E402
from pipeline_parallel import MLP  # noqa: E402
from pipeline_parallel.executor import TrainJob, train_program  # noqa: E402
from pipeline_parallel.optim import OptimizerConfig  # noqa: E402
from pipeline_parallel.plan import plan_training  # noqa: E402
from sharding import TensorSharding as TS, shard, unshard  # noqa: E402
from tensor_parallel import (FeedForward, FeedForwardSharding, MatMul,  # noqa: E402
                             MatMulSharding, MatMulShardingPolicy as P)
from vcluster import VirtualCluster  # noqa: E402
from vcluster.oracle import OracleMismatch, capture, compare  # noqa: E402
from vcluster.torchdist import TorchCluster  # noqa: E402

pytestmark.append(pytest.mark.timeout(600))

M, K, N = 8, 16, 8
X_SHAPE, D_FF = (4, 4, 8), 16


def matmul_layouts(axes):
    """(a, b, c) layouts of each policy on mesh axes x, y(, z)."""
    x, y, z = (tuple(axes) + (None,) * 3)[:3]
    out = {P.Unsharded: (TS(None, None), TS(None, None), TS(None, None)),
           P.MatchedInnerSharding: (TS(None, tuple(axes)), TS(tuple(axes), None), TS(None, None)),
           P.UnmatchedInnerSharding: (TS(None, y), TS(x, None), TS(None, None)),
           P.OuterSharding: (TS(x, None), TS(None, y), TS(x, y))}
    if z is not None:
        out[P.FullSharding] = (TS(x, y), TS(y, z), TS(x, z))
    return out


FFN = ("Unsharded", "Megatron", "SequenceParallel", "GSPMD")
#: name -> (mesh, the FeedForward's dp axis); the MLP step trains over "pp" (and "tp", "dp")
MESHES = {"4": (Mesh((2, 2), ("pp", "tp")), "pp"),
          "8": (Mesh((2, 2, 2), ("dp", "pp", "tp")), "dp")}


def _jobs(mesh, ffn_dp, seed=0):
    """[(name, op, global inputs, input layouts, output names and layouts, reference)]."""
    rng = np.random.default_rng(seed)
    jobs = []
    for policy, (la, lb, lc) in matmul_layouts(mesh.axes).items():
        s = MatMulSharding(la, lb, lc)
        assert s.policy_on(mesh) is policy
        op = MatMul(s)
        A, B, dC = (rng.standard_normal(sh) for sh in ((M, K), (K, N), (M, N)))
        jobs.append((f"matmul.{policy.value}", op, (A, B, dC), (s.a, s.b, op.dc_layout),
                     (("C", s.c), ("dA", s.a), ("dB", s.b)), (A @ B, dC @ B.T, A.T @ dC)))
    for policy in FFN:
        op = FeedForward(FeedForwardSharding(policy, tp="tp", dp=ffn_dp), activation="gelu")
        d = X_SHAPE[-1]
        x, dy = rng.standard_normal(X_SHAPE), rng.standard_normal(X_SHAPE)
        w1, b1 = rng.standard_normal((d, D_FF)) / np.sqrt(d), rng.standard_normal(D_FF)
        w2, b2 = rng.standard_normal((D_FF, d)) / np.sqrt(D_FF), rng.standard_normal(d)
        lay = op.layouts
        jobs.append((f"ffn.{policy}", op, (x, w1, b1, w2, b2, dy),
                     tuple(lay[n] for n in ("x", "w1", "b1", "w2", "b2", "y")),
                     (("y", lay["y"]), ("dx", lay["x"]), ("dW1", lay["w1"]), ("db1", lay["b1"]),
                      ("dW2", lay["w2"]), ("db2", lay["b2"])),
                     _ffn_reference(x, w1, b1, w2, b2, dy)))
    return jobs


def _gelu(h):
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (h + 0.044715 * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)


def _ffn_reference(x, w1, b1, w2, b2, dy):
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    h = x2 @ w1 + b1
    a, da_dh = _gelu(h)
    y = (a @ w2 + b2).reshape(x.shape)
    dh = (dy2 @ w2.T) * da_dh
    return y, (dh @ w1.T).reshape(x.shape), x2.T @ dh, dh.sum(0), a.T @ dy2, dy2.sum(0)


def _batch_program(dev, jobs, mlp_args, perturb=None):
    """Every job's forward and backward on this rank, then the MLP step; returns
    {"<job>.<tensor>": local array, "mlp.params.<layer>.<i>": ...}."""
    out = {}
    for name, op, local in jobs:
        if name.startswith("matmul"):
            a, b, dc = local
            c = op.forward_local(dev, a, b)
            da, db = op.backward_local(dev, a, b, dc)
            res = {"C": c, "dA": da, "dB": db}
        else:
            y = op.forward_local(dev, *local[:5])
            grads = op.backward_local(dev, *local)
            res = dict(zip(("y", "dx", "dW1", "db1", "dW2", "db2"), (y,) + tuple(grads)))
        out.update({f"{name}.{k}": v for k, v in res.items()})
    train = train_program(dev, *mlp_args)
    for layer, pair in enumerate(train["params"]):
        for i, p in enumerate(pair if isinstance(pair, (tuple, list)) else (pair,)):
            if p is not None:
                out[f"mlp.params.{layer}.{i}"] = np.asarray(p)
    if train["losses"] is not None:
        out["mlp.losses"] = np.asarray(train["losses"])
    if perturb is not None and dev.rank == perturb[0]:
        tensor, index, delta = perturb[1:]
        out[tensor] = out[tensor].copy()
        out[tensor][index] += delta
    return out


def _mlp_args(mesh, seed=0):
    mlp = MLP([8, 16, 16, 16, 4], activation="relu", loss="mse", seed=seed)
    rng = np.random.default_rng(seed + 1)
    X, Y = rng.standard_normal((16, 8)), rng.standard_normal((16, 4))
    plan = plan_training(mlp, mesh, len(X), 4, "1f1b", None)
    job = TrainJob(params=tuple(mlp.init_params()), specs=plan.stage_specs, actions=plan.actions,
                   loss="mse", optimizer=OptimizerConfig("sgd", 0.05, 0.9, (0.9, 0.999), 1e-8),
                   steps=1, microbatches=4, global_batch=len(X), pp_axis="pp",
                   dp_axis=plan.dp_axis, tp_axis=plan.tp_axis, bucket_bytes=1 << 20,
                   action_costs={})
    return mlp, X, Y, plan, plan.device_args(job, X, Y)


def _args(mesh, ffn_dp):
    jobs = _jobs(mesh, ffn_dp)
    mlp, X, Y, plan, mlp_args = _mlp_args(mesh)
    per_rank = [[] for _ in range(mesh.size)]
    for name, op, inputs, layouts, _, _ in jobs:
        pieces = [shard(x, lay, mesh) for x, lay in zip(inputs, layouts)]
        for r in range(mesh.size):
            per_rank[r].append((name, op, tuple(p[r] for p in pieces)))
    return jobs, (mlp, X, Y, plan), [(per_rank[r], mlp_args[r]) for r in range(mesh.size)]


def _check_golden_against_numpy(golden, mesh, jobs, mlp, X, Y, plan):
    """The golden is trusted on its own: unsharded, its tensors equal numpy's."""
    results = golden.results_by_rank()
    for name, _, _, _, outputs, refs in jobs:
        for (tensor, layout), ref in zip(outputs, refs):
            got = unshard([results[r][f"{name}.{tensor}"] for r in range(mesh.size)], layout, mesh)
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max(),
                                       err_msg=f"{name}.{tensor}")
    ref = mlp.fit_reference(X, Y, steps=1, optimizer="sgd", lr=0.05)
    params = plan.assemble(lambda r: golden_params(results[r]))
    for (w, b), (rw, rb) in zip(params, ref.params):
        np.testing.assert_allclose(w, rw, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(b, rb, rtol=1e-10, atol=1e-12)


def golden_params(flat: dict) -> list:
    """The rank's (W, b) pieces per layer from the flattened ``mlp.params.*`` names."""
    layers = sorted({int(k.split(".")[2]) for k in flat if k.startswith("mlp.params.")})
    return {layer: (flat[f"mlp.params.{layer}.0"], flat[f"mlp.params.{layer}.1"])
            for layer in layers}


def _batch_program(dev, jobs, mlp_args, perturb=None):
    """Every job's forward and backward on this rank, then one 1F1B MLP training step;
    returns {"<job>.<tensor>": local array, "mlp.params.<layer>.<0|1>": ...}."""
    out = {}
    for name, op, local in jobs:
        if name.startswith("matmul"):
            a, b, dc = local
            c = op.forward_local(dev, a, b)
            da, db = op.backward_local(dev, a, b, dc)
            res = {"C": c, "dA": da, "dB": db}
        else:
            y = op.forward_local(dev, *local[:5])
            grads = op.backward_local(dev, *local)
            res = dict(zip(("y", "dx", "dW1", "db1", "dW2", "db2"), (y,) + tuple(grads)))
        out.update({f"{name}.{k}": v for k, v in res.items()})
    train = train_program(dev, *mlp_args)
    for layer, (w, b) in train["params"].items():
        out[f"mlp.params.{layer}.0"], out[f"mlp.params.{layer}.1"] = w, b
    if perturb is not None and dev.rank == perturb[0]:
        tensor, index, delta = perturb[1:]
        out[tensor] = out[tensor].copy()
        out[tensor][index] += delta
    return out


@pytest.fixture(scope="module", params=list(MESHES))
def setup(request):
    """(golden from the emulator, checked against numpy; a torch cluster; the args)."""
    mesh, ffn_dp = MESHES[request.param]
    jobs, (mlp, X, Y, plan), args = _args(mesh, ffn_dp)
    with VirtualCluster(mesh) as cluster:
        golden = capture(cluster, _batch_program, args, name=f"torch-oracle-{mesh.size}", seed=0)
    _check_golden_against_numpy(golden, mesh, jobs, mlp, X, Y, plan)
    with TorchCluster(mesh, backend="gloo", timeout_s=60.0) as torch_cluster:
        yield golden, torch_cluster, args


def test_torch_reproduces_every_policy_and_the_mlp_step(setup):
    golden, cluster, args = setup
    assert cluster.info["torch_backend"] == "gloo"
    names = set(golden.results(0))
    assert {f"matmul.{p.value}.C" for p in P if cluster.mesh.ndim == 3 or p is not P.FullSharding} <= names
    assert {f"ffn.{p}.dW1" for p in FFN} <= names and "mlp.params.0.0" in names
    actual = cluster.run(_batch_program, args)
    result = compare(actual, golden)
    assert result.ok, str(result)
    assert result.checked == sum(len(golden.results(r)) for r in range(golden.size))


def test_a_perturbed_backend_result_is_caught(setup):
    golden, cluster, args = setup
    rank = cluster.mesh.size - 1
    tensor = "ffn.Megatron.dW1"
    index = (3, 1)
    scale = float(np.abs(golden.results(rank)[tensor]).max())
    perturbed = [a + (((rank, tensor, index, 1e-6 * scale) if r == rank else None),)
                 for r, a in enumerate(args)]
    actual = cluster.run(_batch_program, perturbed)
    result = compare(actual, golden)
    assert [(m.rank, m.tensor, m.index) for m in result.mismatches] == [(rank, tensor, index)]
    with pytest.raises(OracleMismatch) as info:
        result.raise_if_mismatch()
    assert f"rank {rank}, tensor '{tensor}', index {index}" in str(info.value)
    m = result.mismatches[0]
    assert m.abs_error == pytest.approx(1e-6 * scale, rel=1e-3) and m.ulps > 1000
