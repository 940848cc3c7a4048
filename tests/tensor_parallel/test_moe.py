"""MoE with expert parallelism: outputs and every gradient equal the plain-numpy reference
(itself checked by finite differences) for ep in {1, 2, 4}, top-1 and top-2, dropless and
with tokens really dropped; the bytes the emulator moves equal the closed forms of the
routed counts and the trace's, event for event; the load report equals a direct count."""

import numpy as np
import pytest

from mesh import Mesh
from tensor_parallel import MOE_TAG, ExpertLoad, MoE
from tensor_parallel.moe_reference import moe_reference
from vcluster import VirtualCluster
from vcluster.runtime.events import CommEvent
from vcluster.runtime.tracing import (TraceCompute, comm_signature, trace_comm_signature,
                                      trace_program)

pytestmark = pytest.mark.timeout(300)

H, F, N = 8, 12, 16                 # hidden, expert ffn, global tokens
RTOL, ATOL = 1e-9, 1e-12
PAIRWISE = {"all_to_all": "pairwise"}
GRADS = ("y", "dx", "d_router", "d_gate", "d_up", "d_down")

# (ep, experts, top_k, capacity_factor): every ep with top-1 and top-2, dropless and a
# capacity small enough to drop
CASES = [(ep, e, k, cf) for ep, e in ((1, 4), (2, 4), (4, 4), (4, 8)) for k in (1, 2)
         for cf in (None, 0.75)]


def _id(case):
    ep, e, k, cf = case
    return f"ep{ep}-E{e}-top{k}-" + ("dropless" if cf is None else f"cf{cf}")


@pytest.fixture(scope="module")
def clusters():
    made = {}

    def get(ep):
        if ep not in made:
            made[ep] = VirtualCluster(Mesh((ep,), ("ep",)), timeout_s=30)
        return made[ep]

    yield get
    for c in made.values():
        c.close()


def _data(seed=3, n=N, h=H):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, h)), rng.standard_normal((n, h))


def _skewed_params(moe, bias=1.5):
    """Params whose router favours expert 0 (a real imbalance to report)."""
    p = moe.init_params()
    p["w_router"] = p["w_router"].copy()
    p["w_router"][:, 0] += bias / np.sqrt(moe.hidden)
    return p


# --- numerics -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_forward_backward_equal_the_reference(clusters, case):
    ep, e, k, cf = case
    moe = MoE(H, F, e, top_k=k, capacity_factor=cf, aux_coef=0.1, seed=ep + e + k)
    params = moe.init_params()
    x, dy = _data(seed=ep * 10 + k)
    got = moe.backward(clusters(ep), x, params, dy, d_aux=0.7)
    ref = moe.reference(x, params, dy, ep=ep, d_aux=0.7)
    for name in GRADS:
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    assert got.aux_loss == pytest.approx(ref.aux_loss, rel=RTOL)
    assert got.load == ref.load
    if cf is None:
        assert got.load.dropped == 0 and got.load.capacity is None
    else:
        assert got.load.dropped > 0 and got.load.capacity == moe.capacity(N // ep)
        assert max(max(row) for row in got.load.kept) <= got.load.capacity


@pytest.mark.parametrize("ep, k, cf", [(2, 2, 0.75), (4, 1, None)])
def test_run_equals_the_reference_forward(clusters, ep, k, cf):
    moe = MoE(H, F, 4, top_k=k, capacity_factor=cf, aux_coef=0.05, seed=5)
    params = moe.init_params()
    x = _data(seed=8)[0].reshape(4, 4, H)            # (batch, seq, h): batch split over ep
    got = moe.run(clusters(ep), x, params)
    ref = moe.reference(x, params, ep=ep)
    np.testing.assert_allclose(got.y, ref.y, rtol=RTOL, atol=ATOL)
    assert got.y.shape == x.shape
    assert got.aux_loss == pytest.approx(ref.aux_loss, rel=RTOL)
    assert got.load == ref.load


@pytest.mark.parametrize("k, cf", [(1, None), (2, None), (1, 0.75), (2, 0.75)])
def test_reference_gradients_are_finite_differences(k, cf):
    """The reference's hand-written gradients against central differences of
    L = <dy, y> + d_aux·aux, at entries whose perturbation leaves the routing alone."""
    rng = np.random.default_rng(11)
    moe = MoE(H, F, 4, top_k=k, capacity_factor=cf, aux_coef=0.3, seed=2)
    p = moe.init_params()
    x, dy = _data(seed=4)
    d_aux, eps = 0.7, 1e-6

    def loss(x_, p_):
        out, choice, keep = moe_reference(x_, p_["w_router"], p_["w_gate"], p_["w_up"],
                                          p_["w_down"], top_k=k, capacity_factor=cf,
                                          aux_coef=0.3, ep=2)
        return float(np.sum(dy * out.y)) + d_aux * out.aux_loss, choice, keep

    grads, choice0, keep0 = moe_reference(x, p["w_router"], p["w_gate"], p["w_up"],
                                          p["w_down"], top_k=k, capacity_factor=cf,
                                          aux_coef=0.3, ep=2, dy=dy, d_aux=d_aux)
    targets = [("x", x, grads.dx), ("w_router", p["w_router"], grads.d_router),
               ("w_gate", p["w_gate"], grads.d_gate), ("w_up", p["w_up"], grads.d_up),
               ("w_down", p["w_down"], grads.d_down)]
    checked = 0
    for name, arr, grad in targets:
        for flat in rng.choice(arr.size, 6, replace=False):
            idx = np.unravel_index(flat, arr.shape)
            vals = []
            for sign in (1, -1):
                a = arr.copy()
                a[idx] += sign * eps
                args = (a, p) if name == "x" else (x, dict(p, **{name: a}))
                val, choice, keep = loss(*args)
                vals.append(val if (np.array_equal(choice, choice0)
                                    and np.array_equal(keep, keep0)) else None)
            if None in vals:
                continue
            numeric = (vals[0] - vals[1]) / (2 * eps)
            assert grad[idx] == pytest.approx(numeric, rel=1e-5, abs=1e-7), (name, idx)
            checked += 1
    assert checked >= 25


# --- the load report ------------------------------------------------------------------------
@pytest.mark.parametrize("ep, k, cf", [(2, 1, 1.0), (4, 2, None), (4, 2, 1.0)])
def test_load_report_is_a_direct_count_of_the_reference_routing(clusters, ep, k, cf):
    moe = MoE(H, F, 8, top_k=k, capacity_factor=cf, seed=7)
    params = _skewed_params(moe)
    x = _data(seed=9, n=32)[0]
    load = moe.run(clusters(ep), x, params).load
    _, choice, keep = moe_reference(x, params["w_router"], params["w_gate"], params["w_up"],
                                    params["w_down"], top_k=k, capacity_factor=cf,
                                    aux_coef=0.0, ep=ep)
    routed = np.bincount(choice.ravel(), minlength=8)
    kept = np.bincount(choice[keep], minlength=8)
    assert load.per_expert_routed == tuple(routed)
    assert load.per_expert_kept == tuple(kept)
    assert load.imbalance == pytest.approx(routed.max() / routed.mean(), rel=1e-12)
    assert load.kept_imbalance == pytest.approx(kept.max() / kept.mean(), rel=1e-12)
    assert load.imbalance > 1.5                     # the skewed router really is skewed
    assert load.dropped == routed.sum() - kept.sum()
    per_rank = [np.bincount(choice[r * 32 // ep:(r + 1) * 32 // ep].ravel(), minlength=8)
                for r in range(ep)]
    assert np.array_equal(load.routed, per_rank)
    assert "imbalance" in str(load)


def test_skewed_load_has_the_asked_imbalance():
    load = ExpertLoad.skewed(ep=4, experts=8, tokens_per_rank=64, top_k=2, skew=3.0)
    assert load.imbalance == 3.0 and load.dropped == 0
    assert all(sum(row) == 128 for row in load.routed)
    capped = ExpertLoad.skewed(ep=2, experts=8, tokens_per_rank=64, top_k=2, skew=3.0,
                               capacity=20)
    assert capped.per_expert_kept[0] == 40 and capped.dropped == 2 * (48 - 20)
    with pytest.raises(ValueError, match=r"skew=5.0 must be in \[1, experts/top_k = 4\]"):
        ExpertLoad.skewed(ep=2, experts=8, tokens_per_rank=64, top_k=2, skew=5.0)
    with pytest.raises(ValueError, match="kept exceeds capacity=3"):
        ExpertLoad(((4, 4),), ((4, 4),), capacity=3)


# --- traffic: emulator == closed form == trace --------------------------------------------
def _a2a_bytes(events, rank):
    ev = [e for e in events if isinstance(e, CommEvent) and e.rank == rank]
    a2a = [e for e in ev if e.collective == "all_to_all"]
    tagged = {t: [e for e in ev if e.collective in ("send", "recv") and e.tag == MOE_TAG + t]
              for t in range(4)}
    return a2a, tagged


TRAFFIC = [(ep, k, cf) for ep in (2, 4) for k in (1, 2) for cf in (None, 0.75)]


@pytest.mark.parametrize("ep, k, cf", TRAFFIC, ids=[_id((c[0], 8, c[1], c[2])) for c in TRAFFIC])
def test_traffic_equals_the_closed_form_and_the_trace(clusters, ep, k, cf):
    e, b = 8, 8                                              # experts, float64 bytes
    moe = MoE(H, F, e, top_k=k, capacity_factor=cf, aux_coef=0.1, seed=4, algorithms=PAIRWISE)
    params = _skewed_params(moe, bias=1.0)
    x, dy = _data(seed=6, n=32)
    cluster, mesh = clusters(ep), Mesh((ep,), ("ep",))
    t, e_l = 32 // ep, e // ep
    for backward in (False, True):
        cluster.reset_stats()
        res = (moe.backward(cluster, x, params, dy) if backward
               else moe.run(cluster, x, params))
        events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
        load = res.load
        exchanges = 4 if backward else 2
        for r in range(ep):
            a2a, tagged = _a2a_bytes(events, r)
            counts = (ep - 1) * e_l * 8                      # (n-1)/n of E int64 counts
            if cf is None:
                assert [ev.bytes_sent for ev in a2a] == [counts]
                own = range(r * e_l, (r + 1) * e_l)
                out_rows = sum(load.kept[r][i] for i in range(e) if i not in own)
                in_rows = sum(load.kept[s][i] for s in range(ep) if s != r for i in own)
                for tag in range(exchanges):
                    sent = sum(ev.bytes_sent for ev in tagged[tag])
                    recvd = sum(ev.bytes_received for ev in tagged[tag])
                    forth = tag in (0, 2)                    # dispatch x, dispatch dO
                    assert sent == (out_rows if forth else in_rows) * H * b
                    assert recvd == (in_rows if forth else out_rows) * H * b
                    peers = {ev.group[1] for ev in tagged[tag] if ev.collective == "send"}
                    assert len(peers) == sum(ev.collective == "send" for ev in tagged[tag])
            else:
                cap = moe.capacity(t)
                rows = (ep - 1) * e_l * cap * H * b
                assert [ev.bytes_sent for ev in a2a] == [counts] + [rows] * exchanges
                assert [ev.bytes_received for ev in a2a] == [counts] + [rows] * exchanges
                assert not any(tagged.values())
            products = 2 * t * H * e * (3 if backward else 1) \
                + 2 * 3 * H * F * load.received(r) * (3 if backward else 1)
            assert flops[r] == products
        program = moe.backward_local if backward else moe.forward_local
        traces = trace_program(mesh, program, moe.meta_args(mesh, x.shape, load, backward))
        for tr in traces:
            assert trace_comm_signature(tr) == comm_signature(events, tr.rank), tr.rank
        assert [sum(op.flops for op in tr.ops if isinstance(op, TraceCompute))
                for tr in traces] == flops


def test_trace_equals_the_emulator_with_default_algorithms(clusters):
    moe = MoE(H, F, 8, top_k=2, capacity_factor=None, seed=1)
    params, mesh = _skewed_params(moe), Mesh((4,), ("ep",))
    x, dy = _data(seed=2, n=32)
    cluster = clusters(4)
    cluster.reset_stats()
    load = moe.backward(cluster, x, params, dy).load
    events = cluster.trace()
    for tr in trace_program(mesh, moe.backward_local, moe.meta_args(mesh, x.shape, load, True)):
        assert trace_comm_signature(tr) == comm_signature(events, tr.rank)


def test_trace_prices_an_expert_skew():
    """Without values, the trace takes the counts: dropless traffic follows the skew;
    with capacity the traffic is fixed by the shapes (only the FLOPs follow it)."""
    mesh, t, e = Mesh((4,), ("ep",)), 64, 8

    def traced(cf, skew):
        moe = MoE(H, F, e, top_k=2, capacity_factor=cf, algorithms=PAIRWISE)
        load = ExpertLoad.skewed(4, e, t, 2, skew, capacity=moe.capacity(t))
        traces = trace_program(mesh, moe.backward_local,
                               moe.meta_args(mesh, (4 * t, H), load, backward=True))
        return load, traces

    load, traces = traced(None, 3.0)
    sig = trace_comm_signature(traces[1])
    # rank 1 (experts 2, 3) receives the rows ranks 0, 2, 3 route to its experts
    dispatch_in = sum(load.kept[s][i] for s in (0, 2, 3) for i in (2, 3)) * H * 8
    received = [sum(b for _, b, _ in entry[3]) for key, entries in sig.items()
                if len(key) == 2 for entry in entries if entry[0] == "recv"]
    assert sum(received) == 2 * dispatch_in + 2 * sum(  # dispatch x, dO; combine O, dX
        load.kept[1][i] for i in range(e) if i not in (2, 3)) * H * 8
    assert trace_comm_signature(traced(None, 1.0)[1][1]) != sig
    capped = [traced(2.0, s)[1] for s in (1.0, 3.0)]      # capacity 32: the busy one drops
    assert trace_comm_signature(capped[0][0]) == trace_comm_signature(capped[1][0])
    flops = [sum(op.flops for op in tr[0].ops if isinstance(op, TraceCompute)) for tr in capped]
    assert flops[1] > flops[0]                       # rank 0 owns the busy expert 0


# --- bad arguments ------------------------------------------------------------------------
def test_bad_arguments_are_named(clusters):
    with pytest.raises(ValueError, match="top_k=2 exceeds experts=1"):
        MoE(H, F, 1, top_k=2)
    with pytest.raises(ValueError, match="top_k must be 1 or 2, got 3"):
        MoE(H, F, 4, top_k=3)
    for cf in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
            MoE(H, F, 4, capacity_factor=cf)
    with pytest.raises(ValueError, match="aux_coef must be a finite number >= 0"):
        MoE(H, F, 4, aux_coef=-0.1)
    with pytest.raises(ValueError, match="experts must be an int >= 1"):
        MoE(H, F, 0)
    moe = MoE(H, F, 6)
    x = _data()[0]
    with pytest.raises(ValueError, match=r"experts=6 is not divisible by ep=4 \(mesh axis 'ep'\)"):
        moe.run(clusters(4), x, moe.init_params())
    with pytest.raises(ValueError, match="has no axis ep_axis='ep'"):
        moe.ep_size(Mesh((2,), ("dp",)))
    moe = MoE(H, F, 4)
    with pytest.raises(ValueError, match=r"x must have shape \(tokens, ..., hidden=8\)"):
        moe.run(clusters(2), x[:, :4], moe.init_params())
    with pytest.raises(ValueError, match="w_up has shape"):
        moe.run(clusters(2), x, dict(moe.init_params(), w_up=np.zeros((4, 8, 3))))
    with pytest.raises(ValueError, match="load must be an ExpertLoad of ep=2 ranks and 4 experts"):
        moe.meta_args(Mesh((2,), ("ep",)), x.shape, ExpertLoad.skewed(4, 4, 4, 2))
    with pytest.raises(Exception, match="pass load=ExpertLoad"):
        trace_program(Mesh((2,), ("ep",)), moe.forward_local,
                      [a[:-1] + (None,) for a in moe.meta_args(Mesh((2,), ("ep",)), x.shape,
                                                                ExpertLoad.skewed(2, 4, 8, 2))])


def test_runs_under_the_strict_array_module():
    """No host array meets device math (CuPy's rules, checked on the CPU)."""
    params = MoE(H, F, 4, seed=1).init_params()
    x, dy = _data(seed=1)
    with VirtualCluster(Mesh((2,), ("ep",)), array_module="strict", timeout_s=30) as cluster:
        for cf in (0.75, None):
            moe = MoE(H, F, 4, top_k=2, capacity_factor=cf, aux_coef=0.1, seed=1)
            got = moe.backward(cluster, x, params, dy)
            ref = moe.reference(x, params, dy, ep=2)
            for name in GRADS:
                np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=RTOL,
                                           atol=ATOL, err_msg=name)
