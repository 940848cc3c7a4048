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


def _finite_differences(run, x, p, targets, dy, d_aux, rng, eps=1e-6) -> int:
    """Check each target's hand-written gradient against central differences of
    L = <dy, y> + d_aux·aux at 6 random entries, skipping entries whose perturbation
    changes the routing; ``run(x, params, dy=None)`` -> (result, choice, keep). Returns
    how many entries were checked."""
    _, choice0, keep0 = run(x, p, dy)
    checked = 0
    for name, arr, grad in targets:
        for flat in rng.choice(arr.size, 6, replace=False):
            idx = np.unravel_index(flat, arr.shape)
            vals = []
            for sign in (1, -1):
                a = arr.copy()
                a[idx] += sign * eps
                out, choice, keep = run(a, p) if name == "x" else run(x, dict(p, **{name: a}))
                same = np.array_equal(choice, choice0) and np.array_equal(keep, keep0)
                vals.append(float(np.sum(dy * out.y)) + d_aux * out.aux_loss if same else None)
            if None in vals:
                continue
            assert grad[idx] == pytest.approx((vals[0] - vals[1]) / (2 * eps), rel=1e-5,
                                              abs=1e-7), (name, idx)
            checked += 1
    return checked


@pytest.mark.parametrize("k, cf", [(1, None), (2, None), (1, 0.75), (2, 0.75)])
def test_reference_gradients_are_finite_differences(k, cf):
    """The reference's hand-written gradients against central differences of
    L = <dy, y> + d_aux·aux, at entries whose perturbation leaves the routing alone."""
    moe = MoE(H, F, 4, top_k=k, capacity_factor=cf, aux_coef=0.3, seed=2)
    p = moe.init_params()
    x, dy = _data(seed=4)

    def run(x_, p_, dy_=None):
        return moe_reference(x_, p_["w_router"], p_["w_gate"], p_["w_up"], p_["w_down"],
                             top_k=k, capacity_factor=cf, aux_coef=0.3, ep=2, dy=dy_,
                             d_aux=0.7)

    grads = run(x, p, dy)[0]
    targets = [("x", x, grads.dx), ("w_router", p["w_router"], grads.d_router),
               ("w_gate", p["w_gate"], grads.d_gate), ("w_up", p["w_up"], grads.d_up),
               ("w_down", p["w_down"], grads.d_down)]
    assert _finite_differences(run, x, p, targets, dy, 0.7, np.random.default_rng(11)) >= 25


# --- fine-grained routing: any top-k, sigmoid scores, scaling, shared experts ----------------
# (ep, experts, top_k, router, normalize_top_k, routed_scaling, shared width, capacity factor)
ROUTINGS = [(1, 8, 4, "softmax", True, 1.0, 0, None),
            (2, 8, 4, "softmax", False, 1.0, 10, None),
            (2, 8, 8, "sigmoid", True, 2.5, 6, None),
            (4, 16, 8, "sigmoid", True, 2.5, 0, 1.0),
            (4, 8, 3, "sigmoid", False, 1.0, 4, 0.75),
            (2, 8, 1, "softmax", True, 1.0, 10, None)]


def _routing_id(case):
    ep, e, k, router, norm, sigma, fs, cf = case
    return (f"ep{ep}-E{e}-top{k}-{router}-{'norm' if norm else 'raw'}-x{sigma:g}"
            f"-shared{fs}-" + ("dropless" if cf is None else f"cf{cf}"))


def _fine_moe(case, seed=1, aux=0.2):
    ep, e, k, router, norm, sigma, fs, cf = case
    return MoE(H, F, e, top_k=k, capacity_factor=cf, aux_coef=aux, seed=seed, router=router,
               normalize_top_k=norm, routed_scaling=sigma, shared_ffn_hidden=fs)


@pytest.mark.parametrize("case", ROUTINGS, ids=[_routing_id(c) for c in ROUTINGS])
def test_fine_grained_routing_equals_the_reference(clusters, case):
    """Forward, backward and every gradient (the shared expert's too) on the emulated
    ranks equal the plain-numpy reference, for top-k up to E, both routers, raw and
    normalised gates, a routed scaling and a shared expert."""
    ep = case[0]
    moe = _fine_moe(case, seed=ep + case[2])
    params = moe.init_params()
    x, dy = _data(seed=ep * 7 + case[2], n=32)
    got = moe.backward(clusters(ep), x, params, dy, d_aux=0.7)
    ref = moe.reference(x, params, dy, ep=ep, d_aux=0.7)
    for name in GRADS:
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    assert got.aux_loss == pytest.approx(ref.aux_loss, rel=RTOL)
    assert got.load == ref.load
    assert sum(sum(r) for r in got.load.routed) == 32 * case[2]
    if case[6]:
        for g, r in zip(got.shared_grads, ref.shared_grads):
            np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL)
    else:
        assert got.shared_grads is None and ref.shared_grads is None
    fwd = moe.run(clusters(ep), x, params)
    np.testing.assert_allclose(fwd.y, ref.y, rtol=RTOL, atol=ATOL)


def test_default_normalisation_follows_the_router():
    assert MoE(H, F, 4, top_k=1).normalize_top_k is False          # Switch: the raw p
    assert MoE(H, F, 4, top_k=2).normalize_top_k is True           # Mixtral
    assert MoE(H, F, 4, top_k=1, router="sigmoid").normalize_top_k is True   # DeepSeek-V3
    assert "shared_ffn_hidden=5" in repr(MoE(H, F, 4, shared_ffn_hidden=5))


def test_gates_by_hand():
    """One token, sigmoid scores: the gates are σ·v/Σv over the chosen k, by hand."""
    w_r = np.zeros((H, 4))
    x = np.zeros((1, H))
    x[0, 0] = 1.0
    w_r[0] = [2.0, -1.0, 0.5, 1.0]              # logits of the 4 experts
    moe = MoE(H, F, 4, top_k=2, router="sigmoid", routed_scaling=2.5, aux_coef=0.0)
    p = dict(moe.init_params(), w_router=w_r)
    out, choice, _ = moe_reference(x, w_r, p["w_gate"], p["w_up"], p["w_down"], top_k=2,
                                   capacity_factor=None, aux_coef=0.0, router="sigmoid",
                                   routed_scaling=2.5)
    v = 1 / (1 + np.exp(-np.array([2.0, 1.0])))
    assert choice.tolist() == [[0, 3]]
    o = [(lambda a, b: (a / (1 + np.exp(-a)) * b) @ p["w_down"][e])(
        x @ p["w_gate"][e], x @ p["w_up"][e]) for e in (0, 3)]
    np.testing.assert_allclose(out.y, 2.5 * (v[0] * o[0] + v[1] * o[1]) / v.sum(), rtol=1e-12)


@pytest.mark.parametrize("case", [ROUTINGS[1], ROUTINGS[2], ROUTINGS[4]],
                         ids=[_routing_id(c) for c in (ROUTINGS[1], ROUTINGS[2], ROUTINGS[4])])
def test_fine_grained_reference_gradients_are_finite_differences(case):
    """The reference's Jacobians (normalised gates, sigmoid scores, the aux loss through
    p = v/Σv, the shared expert) against central differences."""
    ep, e, k, router, norm, sigma, fs, cf = case
    moe = _fine_moe(case, seed=3, aux=0.3)
    p = moe.init_params()
    x, dy = _data(seed=5, n=16)
    names = moe.weight_names()

    def run(x_, p_, dy_=None):
        shared = tuple(p_[n] for n in names[4:]) or None
        return moe_reference(x_, *(p_[n] for n in names[:4]), top_k=k, capacity_factor=cf,
                             aux_coef=0.3, ep=ep, dy=dy_, d_aux=0.7, router=router,
                             normalize_top_k=norm, routed_scaling=sigma, shared=shared)

    grads = run(x, p, dy)[0]
    targets = [("x", x, grads.dx), ("w_router", p["w_router"], grads.d_router),
               ("w_gate", p["w_gate"], grads.d_gate), ("w_down", p["w_down"], grads.d_down)]
    targets += [(n, p[n], g) for n, g in zip(names[4:], grads.shared_grads or ())]
    assert _finite_differences(run, x, p, targets, dy, 0.7, np.random.default_rng(12)) >= 20


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


# --- group-limited routing (DeepSeek-V3's n_group / topk_group) ------------------------------
@pytest.mark.parametrize("ep, groups, k, router", [(2, (4, 2), 4, "sigmoid"),
                                                   (4, (8, 3), 6, "sigmoid"),
                                                   (2, (4, 1), 2, "softmax")])
def test_group_limited_routing_equals_the_reference(clusters, ep, groups, k, router):
    """Each token picks its experts within its best groups only: emulated = reference,
    and every token's chosen experts lie in at most topk_group groups."""
    moe = MoE(H, F, 16, top_k=k, aux_coef=0.1, seed=ep + k, router=router, groups=groups)
    params = moe.init_params()
    x, dy = _data(seed=31, n=32)
    got = moe.backward(clusters(ep), x, params, dy, d_aux=0.7)
    ref = moe.reference(x, params, dy, ep=ep, d_aux=0.7)
    for name in GRADS:
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    assert got.load == ref.load
    _, choice, _ = moe_reference(x, *(params[n] for n in moe.weight_names()), top_k=k,
                                 capacity_factor=None, aux_coef=0.1, router=router,
                                 groups=groups)
    size = 16 // groups[0]
    assert max(len({e // size for e in row}) for row in choice.tolist()) <= groups[1]
    free, _, _ = moe_reference(x, *(params[n] for n in moe.weight_names()), top_k=k,
                               capacity_factor=None, aux_coef=0.1, router=router)
    assert not np.allclose(free.y, ref.y)            # the groups really change the routing


def test_bad_groups_are_named():
    for bad in ((3, 1), (4, 5), (4, 0), (2, 1, 1)):
        with pytest.raises(ValueError, match=r"groups must be \(n_group, topk_group\)"):
            MoE(H, F, 16, top_k=4, groups=bad)
    with pytest.raises(ValueError, match="topk_group x experts/n_group >= top_k=8"):
        MoE(H, F, 16, top_k=8, groups=(8, 2))


# --- the all-gather dispatcher ---------------------------------------------------------------
GATHER = [(2, 8, 2, None, 0), (4, 8, 4, None, 6), (4, 8, 2, 0.75, 0), (2, 4, 1, 1.0, 6),
          (1, 4, 2, None, 0)]


@pytest.mark.parametrize("ep, e, k, cf, fs", GATHER,
                         ids=[f"ep{c[0]}-E{c[1]}-top{c[2]}-"
                              f"{'dropless' if c[3] is None else 'cf' + str(c[3])}-shared{c[4]}"
                              for c in GATHER])
def test_allgather_dispatcher_equals_the_reference_and_the_alltoall(clusters, ep, e, k, cf,
                                                                    fs):
    """Megatron's all-gather dispatcher (gather the group's tokens, reduce-scatter the
    experts' partial outputs) gives the reference's outputs, gradients and load — the
    same numbers as the all-to-all dispatcher."""
    kw = dict(top_k=k, capacity_factor=cf, aux_coef=0.1, seed=ep + k, shared_ffn_hidden=fs)
    gather, a2a = MoE(H, F, e, dispatcher="allgather", **kw), MoE(H, F, e, **kw)
    params = _skewed_params(gather, bias=0.5)
    x, dy = _data(seed=ep + 20, n=32)
    got = gather.backward(clusters(ep), x, params, dy, d_aux=0.7)
    ref = gather.reference(x, params, dy, ep=ep, d_aux=0.7)
    other = a2a.backward(clusters(ep), x, params, dy, d_aux=0.7)
    for name in GRADS:
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=RTOL, atol=ATOL,
                                   err_msg=name)
        np.testing.assert_allclose(getattr(got, name), getattr(other, name), rtol=RTOL,
                                   atol=ATOL, err_msg=name)
    assert got.load == ref.load == other.load
    assert got.aux_loss == pytest.approx(ref.aux_loss, rel=RTOL)
    np.testing.assert_allclose(gather.run(clusters(ep), x, params).y, ref.y, rtol=RTOL,
                               atol=ATOL)


@pytest.mark.parametrize("ep, k, cf", [(2, 2, None), (4, 2, 0.75), (4, 1, None)])
def test_allgather_traffic_equals_the_closed_form_and_the_trace(clusters, ep, k, cf):
    """Per rank and call, whatever the routing (b the itemsize, n = ep, T tokens per
    rank): forward all_gather of the routing table (T, 2k) and of x (T, h), reduce_scatter
    of the partial y (n·T, h); the backward all_gathers dy and reduce-scatters [dx | dg]
    (n·T, h + k). An all_gather receives (n−1) pieces, a reduce_scatter sends (n−1)/n of
    its input (the ring). The trace moves the same, event for event."""
    e, b = 8, 8
    moe = MoE(H, F, e, top_k=k, capacity_factor=cf, aux_coef=0.1, seed=4,
              dispatcher="allgather", algorithms={"all_gather": "ring",
                                                  "reduce_scatter": "ring"})
    params = _skewed_params(moe, bias=1.0)
    x, dy = _data(seed=6, n=32)
    cluster, mesh, t = clusters(ep), Mesh((ep,), ("ep",)), 32 // ep
    for backward in (False, True):
        cluster.reset_stats()
        res = moe.backward(cluster, x, params, dy) if backward else moe.run(cluster, x, params)
        events = cluster.trace()
        for r in range(ep):
            ev = [v for v in events if isinstance(v, CommEvent) and v.rank == r]
            gathers = [v.bytes_received for v in ev if v.collective == "all_gather"]
            scatters = [v.bytes_sent for v in ev if v.collective == "reduce_scatter"]
            want_g = [(ep - 1) * t * 2 * k * b, (ep - 1) * t * H * b]
            want_s = [(ep - 1) * t * H * b]
            if backward:
                want_g += [(ep - 1) * t * H * b]
                want_s += [(ep - 1) * t * (H + k) * b]
            assert gathers == want_g and scatters == want_s
            assert not [v for v in ev if v.collective in ("send", "recv", "all_to_all")]
        program = moe.backward_local if backward else moe.forward_local
        traces = trace_program(mesh, program, moe.meta_args(mesh, x.shape, res.load, backward))
        for tr in traces:
            assert trace_comm_signature(tr) == comm_signature(events, tr.rank), tr.rank
        flops = cluster.stats()["flops"].tolist()
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
    with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
        MoE(H, F, 4, top_k=0)
    with pytest.raises(ValueError, match=r"router must be one of \('softmax', 'sigmoid'\), "
                       "got 'relu'"):
        MoE(H, F, 4, router="relu")
    with pytest.raises(ValueError, match="normalize_top_k must be True, False or None"):
        MoE(H, F, 4, normalize_top_k="yes")
    for bad in (0, -2.5, float("inf"), True):
        with pytest.raises(ValueError, match="routed_scaling must be a finite number > 0"):
            MoE(H, F, 4, routed_scaling=bad)
    with pytest.raises(ValueError, match=r"dispatcher must be one of \('alltoall', "
                       r"'allgather', 'flex'\), got 'deepep'"):
        MoE(H, F, 4, dispatcher="deepep")
    with pytest.raises(ValueError, match="shared_ffn_hidden must be an int >= 0, got -1"):
        MoE(H, F, 4, shared_ffn_hidden=-1)
    with pytest.raises(ValueError, match=r"params must have the keys .*w_shared_down"):
        MoE(H, F, 4, shared_ffn_hidden=6).run(clusters(2), _data()[0], MoE(H, F, 4).init_params())
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
