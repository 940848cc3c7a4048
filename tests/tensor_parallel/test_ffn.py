"""FeedForward: every policy on several meshes equals an unsharded numpy reference
(output and all gradients), and the emulator's counts equal ``explain`` and, with ring
algorithms, the closed forms of the policy docstrings."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from pandas.testing import assert_frame_equal

from mesh import Mesh
from sharding import MESSAGE_ALGORITHMS, TensorSharding as TS, shard, unshard
from tensor_parallel import FeedForward, FeedForwardSharding, FeedForwardShardingPolicy as P

pytestmark = pytest.mark.timeout(600)

MESHES = {"1x8": Mesh((1, 8), ("dp", "tp")), "2x4": Mesh((2, 4), ("dp", "tp")),
          "4x2": Mesh((4, 2), ("dp", "tp")), "2x2x2": Mesh((2, 2, 2), ("dp", "tp", "x"))}
SHAPE, D_FF = (4, 8, 16), 32
COUNTED = ["bytes_sent", "bytes_received", "messages_sent", "messages_received", "flops"]


def _cases(mesh_name):
    """(policy, tp, dp) of every possible policy on the mesh."""
    if mesh_name == "2x2x2":
        axes = [("tp", "dp"), (("tp", "x"), "dp"), ("x", ("dp", "tp")), (("x", "tp"), None)]
    else:
        axes = [("tp", None), ("tp", "dp")]
    return [(p, tp, dp) for p in P for tp, dp in axes if not (p is P.GSPMD and dp is None)]


CASES = [(m, *c) for m in MESHES for c in _cases(m)]


def _id(case):
    mesh, policy, tp, dp = case
    return f"{mesh}-{policy.name}-tp={tp}-dp={dp}".replace("'", "").replace(" ", "")




# --- the unsharded reference --------------------------------------------------------------
def _act(h, activation):
    """act(h) and act'(h): relu, or gelu's tanh approximation and its exact derivative."""
    if activation == "relu":
        return np.maximum(h, 0.0), (h > 0).astype(h.dtype)
    c, k = np.sqrt(2.0 / np.pi), 0.044715
    t = np.tanh(c * (h + k * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t ** 2) * c * (1 + 3 * k * h ** 2)


def reference(x, w1, b1, w2, b2, dy, activation):
    """y and (dx, dW1, db1, dW2, db2) in float64, from the definitions."""
    x, w1, b1, w2, b2, dy = (np.asarray(a, np.float64) for a in (x, w1, b1, w2, b2, dy))
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    h = x2 @ w1 + b1
    a, da_dh = _act(h, activation)
    y = (a @ w2 + b2).reshape(x.shape)
    dh = (dy2 @ w2.T) * da_dh
    return y, ((dh @ w1.T).reshape(x.shape), x2.T @ dh, dh.sum(0), a.T @ dy2, dy2.sum(0))


def _inputs(shape, d_ff, dtype, seed=0):
    rng = np.random.default_rng(seed)
    d = shape[-1]
    arrays = (rng.standard_normal(shape), rng.standard_normal((d, d_ff)) / np.sqrt(d),
              rng.standard_normal(d_ff), rng.standard_normal((d_ff, d)) / np.sqrt(d_ff),
              rng.standard_normal(d), rng.standard_normal(shape))
    return tuple(a.astype(dtype) for a in arrays)


def _assert_close(got, want, dtype, what):
    tol = 1e-10 if np.dtype(dtype) == np.float64 else 1e-4
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=what)


def _check_numerics(cluster, op, shape, d_ff, dtype, seed=0):
    x, w1, b1, w2, b2, dy = _inputs(shape, d_ff, dtype, seed)
    y_ref, grads_ref = reference(x, w1, b1, w2, b2, dy, op.activation.name)
    y = op.run(cluster, x, w1, b1, w2, b2)
    assert y.dtype == np.dtype(dtype)
    _assert_close(y, y_ref, dtype, "y")
    grads = op.backward(cluster, x, w1, b1, w2, b2, dy)
    for name, got, want in zip(("dx", "dW1", "db1", "dW2", "db2"), grads, grads_ref):
        _assert_close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_unsharded_reference(cluster_of, case, activation, dtype):
    mesh_name, policy, tp, dp = case
    op = FeedForward(FeedForwardSharding(policy, tp=tp, dp=dp), activation=activation)
    _check_numerics(cluster_of(MESHES[mesh_name]), op, SHAPE, D_FF, dtype)


def test_reference_gradients_match_finite_differences():
    """The test's reference itself: d/dθ sum(y·dy) by central differences."""
    for activation in ("relu", "gelu"):
        args = list(_inputs((2, 3, 4), 5, np.float64, seed=1))
        _, grads = reference(*args, activation)
        for i, grad in zip((0, 1, 2, 3, 4), grads):
            for idx in [(0,) * args[i].ndim, tuple(s - 1 for s in args[i].shape)]:
                plus, minus = [a.copy() for a in args], [a.copy() for a in args]
                plus[i][idx] += 1e-6
                minus[i][idx] -= 1e-6
                f = [np.sum(reference(*p, activation)[0] * args[5]) for p in (plus, minus)]
                assert abs((f[0] - f[1]) / 2e-6 - grad[idx]) < 1e-5 * max(1, abs(grad[idx]))


# --- traffic and FLOPs: emulator == explain == closed form -------------------------------
def closed_form(policy, n, m, shape, d_ff, e):
    """(bytes, messages) each device sends with ring algorithms: forward, backward; and
    whether the forms are exact (a ring all_reduce of k elements over n devices moves
    exactly 2(n-1)/n of them only when n divides k)."""
    B, S, d = shape
    f, r = d_ff, B // m * S
    exact = []

    def ar(count, k):          # all_reduce of ``count`` elements
        exact.append(count % k == 0)
        return 2 * (k - 1) / k * count * e

    def rs(count, k):          # reduce_scatter of ``count`` elements
        return (k - 1) / k * count * e

    def ag(piece, k):          # all_gather of a ``piece``-element local array
        return (k - 1) * piece * e

    grads = ar(d * f // n, m) + ar(f // n, m) + ar(d * f // n, m) + ar(d, m)
    if policy is P.Unsharded:
        out = (0, 0), (grads, 8 * (m - 1))
    elif policy is P.Megatron:
        out = (ar(r * d, n), 2 * (n - 1)), (ar(r * d, n) + grads, 2 * (n - 1) + 8 * (m - 1))
    elif policy is P.SequenceParallel:
        fwd = ag(r * d // n, n) + rs(r * d, n)
        out = (fwd, 2 * (n - 1)), (2 * ag(r * d // n, n) + rs(r * d, n) + grads,
                                  3 * (n - 1) + 8 * (m - 1))
    else:
        w = d * f // (n * m)
        fwd = ag(r * d // n, n) + 2 * ag(w, m) + rs(r * d, n)
        bwd = (2 * ag(r * d // n, n) + 2 * ag(w, m) + rs(r * d, n) + 2 * rs(d * f // n, m)
               + ar(f // n, m) + ar(d // n, m))
        out = (fwd, 2 * (n - 1) + 2 * (m - 1)), (bwd, 3 * (n - 1) + 8 * (m - 1))
    return out, all(exact)


def _totals(frame):
    rows = frame[frame.operation == "total"] if "operation" in frame else frame
    return rows.set_index("rank")[COUNTED].astype(float)


def _phase_totals(explained, phase):
    return explained[(explained.phase == phase) & (explained.operation != "total")] \
        .groupby("rank")[COUNTED].sum().astype(float)


def _stats(cluster):
    return cluster.stats().set_index("rank")[COUNTED].astype(float)


def _check_counts(cluster, op, shape, d_ff, dtype, ring: bool):
    """Forward, backward, and both in a row: emulator counts == explain (== closed form)."""
    mesh = cluster.mesh
    x, w1, b1, w2, b2, dy = _inputs(shape, d_ff, dtype)
    explained = op.explain(mesh, shape, d_ff, dtype=dtype, backward=True)
    cluster.reset_stats()
    op.run(cluster, x, w1, b1, w2, b2)
    forward = _stats(cluster)
    cluster.reset_stats()
    op.backward(cluster, x, w1, b1, w2, b2, dy)
    backward = _stats(cluster)
    assert_frame_equal(forward, _totals(op.explain(mesh, shape, d_ff, dtype=dtype)))
    assert_frame_equal(forward, _phase_totals(explained, "forward"))
    assert_frame_equal(backward, _phase_totals(explained, "backward"))
    assert_frame_equal(forward + backward, _totals(explained))
    s = op.sharding
    n, m = mesh.axis_size(s.tp_axes), mesh.axis_size(s.dp_axes)
    # the products: 4·r·d·f/n forward, 10·r·d·f/n backward (recompute + four)
    r = shape[0] // m * shape[1]
    products = explained[explained.step.str.contains("@")].groupby(["phase", "rank"]).flops.sum()
    assert (products["forward"] == 4 * r * shape[2] * d_ff // n).all()
    assert (products["backward"] == 10 * r * shape[2] * d_ff // n).all()
    if not ring:
        return
    e = np.dtype(dtype).itemsize
    ((fb, fm), (bb, bm)), exact = closed_form(s.policy, n, m, shape, d_ff, e)
    ring_bytes = s.ring_bytes_per_device(mesh, shape, d_ff, e)
    assert (ring_bytes["forward"], ring_bytes["backward"]) == pytest.approx((fb, bb))
    for counts, nbytes, messages in ((forward, fb, fm), (backward, bb, bm)):
        assert (counts.messages_sent == messages).all(), (counts.messages_sent.tolist(), messages)
        if exact:       # else uneven ring chunks: explain (== emulator) is the exact count
            assert (counts.bytes_sent == nbytes).all(), (counts.bytes_sent.tolist(), nbytes)
            assert (counts.bytes_received == nbytes).all()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "auto"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_counts_equal_explain_and_closed_form(cluster_of, case, ring):
    mesh_name, policy, tp, dp = case
    op = FeedForward(FeedForwardSharding(policy, tp=tp, dp=dp), activation="gelu",
                     algorithms=MESSAGE_ALGORITHMS if ring else None)
    _check_counts(cluster_of(MESHES[mesh_name]), op, SHAPE, D_FF, np.float64, ring)


def test_explain_lists_megatron_steps():
    mesh = MESHES["2x4"]
    op = FeedForward(FeedForwardSharding("Megatron", dp="dp"), algorithms=MESSAGE_ALGORITHMS)
    df = op.explain(mesh, SHAPE, D_FF, dtype=np.float32)
    coll = df[(df.kind == "collective") & (df["rank"] == 0)]
    assert coll[["operation", "collective", "axis", "group_size", "algorithm"]].values.tolist() \
        == [["reduce y", "all_reduce", "tp", 4, "ring"]]
    # 2(n-1)/n·|y_l|, |y_l| = 2·8·16 float32
    assert coll.bytes_sent.tolist() == [2 * 3 / 4 * 2 * 8 * 16 * 4]
    assert set(df[df.operation == "total"]["rank"]) == set(range(8))


def test_forward_and_backward_local_compose_in_one_program(cluster_of):
    """A training step as one program: forward_local then backward_local."""
    mesh = MESHES["2x4"]
    cluster = cluster_of(mesh)
    op = FeedForward(FeedForwardSharding(P.SequenceParallel, dp="dp"), activation="relu",
                     algorithms=MESSAGE_ALGORITHMS)
    x, w1, b1, w2, b2, dy = _inputs(SHAPE, D_FF, np.float64)
    L = op.layouts
    names = ("x", "w1", "b1", "w2", "b2", "dy")
    pieces = [shard(a, L[n], mesh) for a, n in zip((x, w1, b1, w2, b2, dy), names)]

    def step(dev, *local):
        return op.forward_local(dev, *local[:5]), op.backward_local(dev, *local)

    cluster.reset_stats()
    out = cluster.run(step, [tuple(p[r] for p in pieces) for r in range(mesh.size)])
    y_ref, (dx_ref, *_) = reference(x, w1, b1, w2, b2, dy, "relu")
    _assert_close(unshard([o[0] for o in out], L["y"], mesh), y_ref, np.float64, "y")
    _assert_close(unshard([o[1][0] for o in out], L["dx"], mesh), dx_ref, np.float64, "dx")
    explained = op.explain(mesh, SHAPE, D_FF, backward=True)
    assert_frame_equal(_stats(cluster), _totals(explained))


# --- random shapes ----------------------------------------------------------------------------
HYPO_MESHES = [MESHES["2x4"], MESHES["2x2x2"]]


@st.composite
def _random_case(draw):
    mesh = draw(st.sampled_from(HYPO_MESHES))
    policy = draw(st.sampled_from(list(P)))
    if mesh.ndim == 3:
        tp, dp = draw(st.sampled_from([("tp", "dp"), (("tp", "x"), "dp"), ("x", None)]))
    else:
        tp, dp = "tp", draw(st.sampled_from([None, "dp"]))
    if policy is P.GSPMD and dp is None:
        dp, tp = ("dp", "tp") if mesh.ndim == 2 else ("dp", ("tp", "x"))
    s = FeedForwardSharding(policy, tp=tp, dp=dp)
    n, m = mesh.axis_size(s.tp_axes), mesh.axis_size(s.dp_axes)
    k = lambda: draw(st.integers(1, 3))   # noqa: E731
    seq_split = n if policy is P.SequenceParallel else 1
    d_split = n * m if policy is P.GSPMD else 1
    shape = (m * k(), seq_split * k(), d_split * k())
    d_ff = n * (m if policy is P.GSPMD else 1) * k()
    return mesh, s, draw(st.sampled_from(["relu", "gelu"])), shape, d_ff


@settings(max_examples=25, deadline=None)
@given(case=_random_case(), seed=st.integers(0, 2**16))
def test_random_shapes(cluster_of, case, seed):
    mesh, sharding, activation, shape, d_ff = case
    cluster = cluster_of(mesh)
    op = FeedForward(sharding, activation=activation, algorithms=MESSAGE_ALGORITHMS)
    _check_numerics(cluster, op, shape, d_ff, np.float64, seed)
    _check_counts(cluster, op, shape, d_ff, np.float64, ring=True)


# --- layouts and validation ---------------------------------------------------------------------
def test_layouts_of_each_policy():
    g = FeedForwardSharding("GSPMD", dp="dp").layouts
    assert (g["x"], g["y"], g["w1"], g["b1"], g["w2"], g["b2"]) == (
        TS("dp", None, "tp"), TS("dp", None, "tp"), TS("dp", "tp"), TS("tp"), TS("tp", "dp"),
        TS("tp"))
    m = FeedForwardSharding(P.Megatron).layouts
    assert (m["x"], m["w1"], m["b1"], m["w2"], m["b2"]) == (
        TS(None, None, None), TS(None, "tp"), TS("tp"), TS("tp", None), TS(None))
    sp = FeedForwardSharding("SequenceParallel", tp=("tp", "x"), dp="dp").layouts
    assert sp["x"] == sp["dy"] == sp["dx"] == TS("dp", ("tp", "x"), None)
    for layouts in (g, m, sp):
        for name in ("x", "w1", "b1", "w2", "b2"):
            assert layouts["d" + name] == layouts[name]
    assert FeedForwardSharding("Unsharded", dp="dp").layouts["w1"] == TS(None, None)


def test_policy_by_name_and_frozen():
    assert FeedForwardSharding("Megatron") == FeedForwardSharding(P.Megatron, tp="tp")
    assert FeedForwardSharding(P.GSPMD, tp=["tp"], dp=("dp",)).tp == "tp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        FeedForwardSharding("Megatron").tp = "x"
    with pytest.raises(ValueError, match="unknown policy 'Tensor'.*Megatron"):
        FeedForwardSharding("Tensor")
    assert "all_reduce(tp)" in P.Megatron.__doc__


@pytest.mark.parametrize("make, shape, d_ff, match", [
    (lambda: FeedForwardSharding("SequenceParallel"), (4, 6, 16), 32,
     r"seq \(dimension 1 of x, shape \(4, 6, 16\)\) of size 6 does not split evenly into 4 "
     r"shards over mesh axes \('tp',\)"),
    (lambda: FeedForwardSharding("Megatron", dp="dp"), (3, 8, 16), 32,
     r"batch \(dimension 0 of x.*size 3 does not split evenly into 2 shards"),
    (lambda: FeedForwardSharding("Megatron"), (4, 8, 16), 30,
     r"d_ff \(dimension 1 of w1.*size 30 does not split evenly into 4 shards"),
    (lambda: FeedForwardSharding("GSPMD", dp="dp"), (4, 8, 6), 32,
     r"d_model \(dimension 2 of x.*size 6 does not split evenly into 4 shards"),
    (lambda: FeedForwardSharding("Megatron", tp="model"), (4, 8, 16), 32,
     r"tp axis 'model' is not one of the mesh's axes \('dp', 'tp'\)"),
    (lambda: FeedForwardSharding("GSPMD"), (4, 8, 16), 32, "GSPMD needs a dp axis"),
    (lambda: FeedForwardSharding("Megatron", tp="tp", dp="tp"), (4, 8, 16), 32,
     "share an axis"),
])
def test_invalid_configurations_are_named(make, shape, d_ff, match):
    with pytest.raises(ValueError, match=match):
        FeedForward(make()).explain(MESHES["2x4"], shape, d_ff)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown activation 'tanh'.*gelu.*relu"):
        FeedForward(FeedForwardSharding("Megatron"), activation="tanh")
    with pytest.raises(ValueError, match="all_gather has no algorithm 'tree'"):
        FeedForward(FeedForwardSharding("Megatron"), algorithms={"all_gather": "tree"})
    with pytest.raises(TypeError, match="must be a FeedForwardSharding"):
        FeedForward(TS(None, "tp"))


def test_run_rejects_inconsistent_shapes(cluster_of):
    cluster = cluster_of(MESHES["2x4"])
    op = FeedForward(FeedForwardSharding("SequenceParallel"))
    x, w1, b1, w2, b2, dy = _inputs(SHAPE, D_FF, np.float64)
    with pytest.raises(ValueError, match=r"w2 has shape \(16, 32\).*must be \(32, 16\)"):
        op.run(cluster, x, w1, b1, w2.T, b2)
    with pytest.raises(ValueError, match=r"dy has shape \(4, 8, 8\)"):
        op.backward(cluster, x, w1, b1, w2, b2, dy[..., :8])
    with pytest.raises(ValueError, match="seq .* of size 6 does not split evenly into 4"):
        x6 = x[:, :6]
        op.run(cluster, x6, w1, b1, w2, b2)
