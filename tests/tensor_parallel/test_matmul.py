"""MatMul on every policy and many layouts: outputs and gradients equal numpy, and the
traffic the emulator counts equals ``explain`` (and the ring closed forms)."""

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mesh import Mesh
from sharding import MESSAGE_ALGORITHMS, TensorSharding as TS, shard, unshard
from tensor_parallel import MatMul, MatMulSharding, MatMulShardingPolicy as P
from vcluster import VirtualCluster

pytestmark = pytest.mark.timeout(600)

MESHES = {
    "1x8": Mesh((1, 8), ("dp", "tp")),
    "2x4": Mesh((2, 4), ("dp", "tp")),
    "4x2": Mesh((4, 2), ("dp", "tp")),
    "2x2x2": Mesh((2, 2, 2), ("x", "y", "z")),
}
M, K, N = 8, 16, 8


def layouts_2d(mesh, partial=True):
    """Every 2-D layout on ``mesh`` (axes in every order; optionally partial axes)."""
    axes = mesh.axes
    out = []
    for places in itertools.product(range(4 if partial else 3), repeat=len(axes)):
        groups = {d: [a for a, p in zip(axes, places) if p == d] for d in range(4)}
        for o0, o1 in itertools.product(itertools.permutations(groups[0]),
                                        itertools.permutations(groups[1])):
            out.append(TS(o0 or None, o1 or None, partial=tuple(groups[3])))
    return out


def _divides(layout, shape, mesh):
    return all(n % mesh.axis_size(d.axes) == 0 for n, d in zip(shape, layout.dims))


def cases_by_policy(mesh, per_policy, seed=0):
    """Up to ``per_policy`` random valid (a, b, c) triples for each policy on ``mesh``."""
    rng = random.Random(seed)
    lay = layouts_2d(mesh)
    a_l = [s for s in lay if _divides(s, (M, K), mesh)]
    b_l = [s for s in lay if _divides(s, (K, N), mesh)]
    c_l = [s for s in lay if _divides(s, (M, N), mesh)]
    found = {p: [] for p in P}
    for _ in range(20000):
        sh = MatMulSharding(rng.choice(a_l), rng.choice(b_l), rng.choice(c_l))
        policy = sh.policy_on(mesh)
        if len(found[policy]) < per_policy:
            found[policy].append(sh)
        if all(len(v) >= per_policy for v in found.values()):
            break
    return found


def _many(dev, jobs):
    out = []
    for op, a, b, dc in jobs:
        out.append((op.forward_local(dev, a, b), *op.backward_local(dev, a, b, dc)))
    return out


def run_jobs(cluster, mesh, shardings, A, B, dC):
    """Forward and backward of every sharding in ONE cluster.run; global results."""
    ops = [MatMul(s) for s in shardings]
    per_rank = [[] for _ in range(mesh.size)]
    for op in ops:
        s = op.sharding
        pieces = [shard(A, s.a, mesh), shard(B, s.b, mesh), shard(dC, op.dc_layout, mesh)]
        for r in range(mesh.size):
            per_rank[r].append((op, pieces[0][r], pieces[1][r], pieces[2][r]))
    results = cluster.run(_many, [(jobs,) for jobs in per_rank])
    out = []
    for i, op in enumerate(ops):
        s = op.sharding
        c, da, db = ([results[r][i][j] for r in range(mesh.size)] for j in range(3))
        out.append((unshard(c, s.c, mesh), unshard(da, s.a, mesh), unshard(db, s.b, mesh)))
    return out


def assert_close(actual, ref, dtype):
    tol = 1e-10 if dtype == np.float64 else 1e-4
    scale = max(float(np.max(np.abs(ref))), 1e-300)
    np.testing.assert_allclose(actual, ref, rtol=tol, atol=tol * scale)


@pytest.fixture(scope="module", params=sorted(MESHES))
def mesh_cluster(request):
    mesh = MESHES[request.param]
    with VirtualCluster(mesh, timeout_s=30) as cluster:
        yield request.param, mesh, cluster


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_every_policy_matches_numpy(mesh_cluster, dtype):
    name, mesh, cluster = mesh_cluster
    rng = np.random.default_rng(7)
    A = rng.standard_normal((M, K)).astype(dtype)
    B = rng.standard_normal((K, N)).astype(dtype)
    dC = rng.standard_normal((M, N)).astype(dtype)
    found = cases_by_policy(mesh, per_policy=6, seed=hash(name) & 0xFFFF)
    # every policy is possible on these meshes (1x8 has one axis of size 1 only: no
    # FullSharding, which needs three axes that split)
    expected = set(P) - ({P.FullSharding} if name == "1x8" else set())
    assert {p for p, v in found.items() if v} == expected
    shardings = [s for v in found.values() for s in v]
    results = run_jobs(cluster, mesh, shardings, A, B, dC)
    for s, (C, dA, dB) in zip(shardings, results):
        for actual, ref, what in ((C, A @ B, "C"), (dA, dC @ B.T, "dA"), (dB, A.T @ dC, "dB")):
            try:
                assert_close(actual, ref, dtype)
            except AssertionError as exc:
                raise AssertionError(f"{what} wrong for {s} on {mesh}:\n{exc}") from None


def test_issue_snippet_runs():
    mesh = Mesh((2, 4), ("dp", "tp"))
    rng = np.random.default_rng(0)
    A, B, dC = rng.standard_normal((8, 16)), rng.standard_normal((16, 12)), rng.standard_normal((8, 12))
    sh = MatMulSharding(a=TS(None, "tp"), b=TS("tp", None), c=TS(None, None))
    assert sh.policy is P.MatchedInnerSharding
    op = MatMul(sh)
    with VirtualCluster(mesh) as cluster:
        C = op.run(cluster, A, B)
        dA, dB = op.backward(cluster, A, B, dC)
    table = op.explain(mesh, A.shape, B.shape, dtype=np.float64, backward=False)
    assert_close(C, A @ B, np.float64)
    assert_close(dA, dC @ B.T, np.float64)
    assert_close(dB, A.T @ dC, np.float64)
    total = table[table["operation"] == "total"]
    assert len(total) == 8 and (total["flops"] == 2 * 8 * 4 * 12).all()
    coll = table[table["kind"] == "collective"]
    assert set(coll["collective"]) == {"all_reduce"} and set(coll["group_size"]) == {4}


@pytest.mark.parametrize("a, b, c, mesh_name, policy", [
    (TS(None, None), TS(None, None), TS(None, None), "2x4", P.Unsharded),
    (TS(None, "tp"), TS("tp", None), TS(None, None), "2x4", P.MatchedInnerSharding),
    (TS(None, "tp"), TS("dp", None), TS(None, None), "2x4", P.UnmatchedInnerSharding),
    (TS(None, "tp"), TS(None, None), TS(None, None), "2x4", P.UnmatchedInnerSharding),
    (TS("dp", "tp"), TS(None, None), TS(None, None), "2x4", P.OuterSharding),
    (TS(None, None), TS(None, "tp"), TS(None, "tp"), "2x4", P.OuterSharding),
    (TS("x", "y"), TS("y", "z"), TS("x", "z"), "2x2x2", P.FullSharding),
    (TS("dp", "tp"), TS("tp", "dp"), TS(None, None), "2x4", P.FullSharding),
    # an axis of size 1 splits nothing
    (TS("dp", "tp"), TS("tp", None), TS(None, None), "1x8", P.MatchedInnerSharding),
])
def test_policy_classification(a, b, c, mesh_name, policy):
    assert MatMulSharding(a, b, c).policy_on(MESHES[mesh_name]) is policy


def test_size_one_axis_changes_policy_only_on_the_mesh():
    sh = MatMulSharding(TS("dp", "tp"), TS("tp", None), TS(None, None))
    assert sh.policy is P.OuterSharding
    assert sh.policy_on(MESHES["1x8"]) is P.MatchedInnerSharding


@pytest.mark.parametrize("kwargs, error, message", [
    ({"a": TS(None), "b": TS(None, None), "c": TS(None, None)}, ValueError, "a must describe a 2-D"),
    ({"a": "tp", "b": TS(None, None), "c": TS(None, None)}, TypeError, "a must be a TensorSharding"),
])
def test_sharding_type_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        MatMulSharding(**kwargs)


def test_invalid_requests_name_the_problem():
    mesh = MESHES["2x4"]
    sh = MatMulSharding(TS(None, "tp"), TS("tp", None), TS("pp", None))
    with pytest.raises(ValueError, match="uses mesh axis 'pp'"):
        sh.plan(mesh, (8, 16), (16, 8))
    sh = MatMulSharding(TS(None, "tp"), TS("tp", None), TS(None, None))
    with pytest.raises(ValueError, match=r"A of shape \(8, 16\) and B of shape \(12, 8\) cannot"):
        sh.plan(mesh, (8, 16), (12, 8))
    with pytest.raises(ValueError, match="dimension 1 of size 6 does not split evenly into 4"):
        sh.plan(mesh, (8, 6), (6, 8))


def _explain_totals(op, mesh, a_shape, b_shape, dtype):
    t = op.explain(mesh, a_shape, b_shape, dtype=dtype, backward=True)
    return t[t["operation"] == "total"].sort_values("rank")


@pytest.mark.parametrize("algorithms", [None, MESSAGE_ALGORITHMS])
def test_emulator_traffic_equals_explain(mesh_cluster, algorithms):
    name, mesh, cluster = mesh_cluster
    rng = np.random.default_rng(3)
    A, B, dC = (rng.standard_normal(s) for s in ((M, K), (K, N), (M, N)))
    found = cases_by_policy(mesh, per_policy=2, seed=11)
    for s in (s for v in found.values() for s in v):
        op = MatMul(s, algorithms)
        cluster.reset_stats()
        op.run(cluster, A, B)
        op.backward(cluster, A, B, dC)
        stats = cluster.stats()
        totals = _explain_totals(op, mesh, A.shape, B.shape, np.float64)
        for col in ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "flops"):
            assert stats[col].tolist() == totals[col].tolist(), (col, str(s))


@pytest.mark.parametrize("mesh_name, axis_size", [("1x8", 8), ("2x4", 4), ("4x2", 2)])
def test_matched_inner_ring_bytes_closed_form(mesh_name, axis_size):
    """MatchedInnerSharding closes C with one all-reduce: 2(n-1)/n |C| per device (ring)."""
    mesh = MESHES[mesh_name]
    op = MatMul(MatMulSharding(TS(None, "tp"), TS("tp", None), TS(None, None)), MESSAGE_ALGORITHMS)
    t = op.explain(mesh, (M, K), (K, N), dtype=np.float32)
    sent = t[t["operation"] == "total"]["bytes_sent"]
    c_bytes = M * N * 4
    assert (sent == 2 * (axis_size - 1) * c_bytes // axis_size).all()
    with VirtualCluster(mesh) as cluster:
        rng = np.random.default_rng(0)
        A = rng.standard_normal((M, K)).astype(np.float32)
        B = rng.standard_normal((K, N)).astype(np.float32)
        cluster.reset_stats()
        assert_close(op.run(cluster, A, B), A @ B, np.float32)
        assert cluster.stats()["bytes_sent"].tolist() == sent.tolist()


@pytest.fixture(scope="module")
def cluster_222():
    with VirtualCluster(MESHES["2x2x2"], timeout_s=30) as cluster:
        yield cluster


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_layouts_and_shapes(cluster_222, data):
    mesh = MESHES["2x2x2"]
    lay = layouts_2d(mesh)
    m, k, n = (data.draw(st.sampled_from([8, 16, 24]), label=x) for x in "mkn")
    a = data.draw(st.sampled_from([s for s in lay if _divides(s, (m, k), mesh)]), label="a")
    b = data.draw(st.sampled_from([s for s in lay if _divides(s, (k, n), mesh)]), label="b")
    c = data.draw(st.sampled_from([s for s in lay if _divides(s, (m, n), mesh)]), label="c")
    rng = np.random.default_rng(data.draw(st.integers(0, 1000), label="seed"))
    A, B, dC = (rng.standard_normal(s) for s in ((m, k), (k, n), (m, n)))
    (C, dA, dB), = run_jobs(cluster_222, mesh, [MatMulSharding(a, b, c)], A, B, dC)
    assert_close(C, A @ B, np.float64)
    assert_close(dA, dC @ B.T, np.float64)
    assert_close(dB, A.T @ dC, np.float64)



@pytest.mark.parametrize("mesh_name, a, b, c, closed_form", [
    ("2x4", TS(None, None), TS(None, None), TS("dp", "tp"), lambda A, B, C: 0),
    ("2x4", TS(None, "tp"), TS("tp", None), TS("tp", None), lambda A, B, C: 3 * C // 4),
    ("2x4", TS(None, "tp"), TS("dp", None), TS(None, None), lambda A, B, C: 5 * B // 16 + 3 * C // 2),
    ("2x4", TS("dp", "tp"), TS(None, None), TS("dp", None), lambda A, B, C: 3 * C // 4),
    ("2x2x2", TS("x", "y"), TS("y", "z"), TS("x", "z"), lambda A, B, C: C // 4),
])
def test_policy_closed_forms_with_ring(mesh_name, a, b, c, closed_form):
    """Bytes sent per device (ring algorithms) as stated in MatMulShardingPolicy's docs."""
    mesh = MESHES[mesh_name]
    op = MatMul(MatMulSharding(a, b, c), MESSAGE_ALGORITHMS)
    t = op.explain(mesh, (M, K), (K, N), dtype=np.float64)
    sent = t[t["operation"] == "total"]["bytes_sent"].tolist()
    assert sent == [closed_form(M * K * 8, K * N * 8, M * N * 8)] * mesh.size
    with VirtualCluster(mesh) as cluster:
        rng = np.random.default_rng(1)
        A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
        cluster.reset_stats()
        assert_close(op.run(cluster, A, B), A @ B, np.float64)
        assert cluster.stats()["bytes_sent"].tolist() == sent


def _plan_identity(dev, op, a, b):
    """The product, and which plan object this device used (its id in this process)."""
    from tensor_parallel.matmul import global_shape
    s = op.sharding
    plan = op.plan(dev.mesh, global_shape(a.shape, s.a, dev.mesh),
                   global_shape(b.shape, s.b, dev.mesh), a.itemsize)
    return op.forward_local(dev, a, b), id(plan)


def test_a_device_plans_a_layout_once_not_once_per_run(cluster_222):
    """Ops reach the devices pickled afresh every run (and pipeline stages build theirs
    every run); the plan, a search of 0.2-10 ms, is memoised per process, so a device's
    second run reuses the first run's plan object and still computes the same C."""
    mesh = MESHES["2x2x2"]
    op = MatMul(MatMulSharding(TS("x", "y"), TS("y", "z"), TS("x", "z")))
    rng = np.random.default_rng(3)
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    args = list(zip([op] * 8, shard(A, op.sharding.a, mesh), shard(B, op.sharding.b, mesh)))
    first = cluster_222.run(_plan_identity, args)
    second = cluster_222.run(_plan_identity, args)
    assert [p for _, p in first] == [p for _, p in second]
    for run in (first, second):
        np.testing.assert_allclose(unshard([c for c, _ in run], op.sharding.c, mesh), A @ B,
                                   rtol=1e-12)
    equal = MatMul(MatMulSharding(TS("x", "y"), TS("y", "z"), TS("x", "z")))
    assert equal.plan(mesh, (M, K), (K, N)) is op.plan(mesh, (M, K), (K, N))
