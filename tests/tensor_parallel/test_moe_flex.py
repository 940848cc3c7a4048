"""The token-deduplicating ``flex`` MoE dispatcher (DeepEP / HybridEP, Megatron-Core's
``moe_token_dispatcher_type="flex"``): each token crosses once per destination rank with
its routing there, that rank's experts' gate-weighted outputs come back summed.

Checked: the emulated layer equals the single-process reference (y, dx, the router's and
the experts' gradients, rtol 1e-9) for ep 1/2/4, top-1/2/4, skewed routing and dropped
choices; the distinct-token table the emulator reports is a direct count; the traced
program moves the emulator's messages one for one and the same FLOPs; the traffic of
each exchange equals the closed form of that table; flex sends strictly fewer token rows
than alltoall when tokens choose several experts on one rank and the same rows for k = 1;
``ExpertLoad.skewed`` fills the table with the documented expectation; bad names are
named. The training program with flex (the GPT/Llama MoE block, biases, etp 2, folded,
cp) equals its reference, and its trace given the run's load moves the run's bytes."""

import math

import numpy as np
import pytest

from mesh import Mesh
from modeling import ConfigError
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, ParallelConfig
from tensor_parallel import MOE_TAG, ExpertLoad, MoE
from tensor_parallel.moe_load import distinct_rank_fraction
from tensor_parallel.moe_reference import moe_reference
from vcluster import VirtualCluster
from vcluster.runtime.events import CommEvent, ComputeEvent
from vcluster.runtime.tracing import (TraceCompute, comm_signature, trace_comm_signature,
                                      trace_program)

from ..pipeline_parallel.gpt_data import assert_fit_equals_reference, token_data
from .moe_data import (ATOL, BIASES, GRADS, PAIRWISE, RTOL, F, H, moe_cfg, moe_inputs,
                       skewed_router, trace_moves_the_runs_messages)

pytestmark = pytest.mark.timeout(300)

# --- numerics -----------------------------------------------------------------------------
# (ep, experts, top_k, capacity factor, skewed router, shared width)
CASES = [(ep, 8, k, None, False, 0) for ep in (1, 2, 4) for k in (1, 2, 4)] + [
    (2, 8, 2, None, True, 6), (4, 8, 4, None, True, 0), (4, 16, 3, 0.75, False, 0),
    (2, 8, 2, 1.0, True, 0)]


@pytest.mark.parametrize("ep, e, k, cf, skew, fs", CASES,
                         ids=[f"ep{c[0]}-E{c[1]}-top{c[2]}-{'cf' + str(c[3]) if c[3] else 'dropless'}"
                              f"{'-skewed' if c[4] else ''}{'-shared' if c[5] else ''}"
                              for c in CASES])
def test_flex_equals_the_reference_and_the_alltoall(clusters, ep, e, k, cf, skew, fs):
    kw = dict(top_k=k, capacity_factor=cf, aux_coef=0.1, seed=ep + k, shared_ffn_hidden=fs)
    flex, a2a = MoE(H, F, e, dispatcher="flex", **kw), MoE(H, F, e, **kw)
    params = flex.init_params()
    params = skewed_router(params) if skew else params
    x, dy = moe_inputs(seed=ep * 10 + k)
    got = flex.backward(clusters(ep), x, params, dy, d_aux=0.7)
    ref = flex.reference(x, params, dy, ep=ep, d_aux=0.7)
    other = a2a.backward(clusters(ep), x, params, dy, d_aux=0.7)
    for name in GRADS:
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=RTOL,
                                   atol=ATOL, err_msg=name)
        np.testing.assert_allclose(getattr(got, name), getattr(other, name), rtol=RTOL,
                                   atol=ATOL, err_msg=name)
    assert got.aux_loss == pytest.approx(ref.aux_loss, rel=RTOL)
    assert got.load == ref.load == other.load
    if skew:
        assert got.load.imbalance > 1.1
    if cf is not None:
        assert got.load.dropped > 0
    for g, r in zip(got.shared_grads or (), ref.shared_grads or ()):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(flex.run(clusters(ep), x, params).y, ref.y, rtol=RTOL,
                               atol=ATOL)


@pytest.mark.parametrize("ep, k, cf", [(2, 2, None), (4, 3, None), (4, 2, 0.75)])
def test_tokens_table_is_a_direct_count(clusters, ep, k, cf):
    """ExpertLoad.tokens[r][d]: rank r's tokens with at least one kept choice among
    member d's experts, counted here from the reference's routing token by token."""
    moe = MoE(H, F, 8, top_k=k, capacity_factor=cf, seed=3, dispatcher="flex")
    params = skewed_router(moe.init_params())
    x = moe_inputs(seed=5)[0]
    load = moe.run(clusters(ep), x, params).load
    _, choice, keep = moe_reference(x, *(params[n] for n in moe.weight_names()), top_k=k,
                                    capacity_factor=cf, aux_coef=0.0, ep=ep)
    t, e_l = 32 // ep, 8 // ep
    want = [[sum(any(keep[i, c] and choice[i, c] // e_l == d for c in range(k))
                 for i in range(r * t, (r + 1) * t)) for d in range(ep)] for r in range(ep)]
    assert [list(row) for row in load.tokens] == want
    # some token has two choices on one member: fewer distinct rows than kept rows
    assert sum(map(sum, load.tokens)) < sum(map(sum, load.kept))


def test_runs_under_the_strict_array_module():
    params = MoE(H, F, 4, seed=1).init_params()
    x, dy = moe_inputs(seed=1)
    with VirtualCluster(Mesh((2,), ("ep",)), array_module="strict", timeout_s=30) as cluster:
        for cf in (None, 0.75):
            moe = MoE(H, F, 4, top_k=2, capacity_factor=cf, aux_coef=0.1, seed=1,
                      dispatcher="flex")
            got = moe.backward(cluster, x, params, dy)
            ref = moe.reference(x, params, dy, ep=2)
            for name in GRADS:
                np.testing.assert_allclose(getattr(got, name), getattr(ref, name),
                                           rtol=RTOL, atol=ATOL, err_msg=name)


# --- traffic: emulator == closed form == trace --------------------------------------------
def _tagged(events, rank):
    ev = [e for e in events if isinstance(e, CommEvent) and e.rank == rank]
    return ([e for e in ev if e.collective == "all_to_all"],
            {t: [e for e in ev if e.collective in ("send", "recv") and e.tag == MOE_TAG + t]
             for t in range(4)})


TRAFFIC = [(2, 2, None), (4, 2, None), (4, 4, None), (4, 1, None), (4, 3, 0.75)]


@pytest.mark.parametrize("ep, k, cf", TRAFFIC, ids=[f"ep{c[0]}-top{c[1]}-{c[2]}" for c in TRAFFIC])
def test_traffic_equals_the_closed_form_and_the_trace(clusters, ep, k, cf):
    """Per rank r and exchange, with tokens[s][d] the load's table, b = 8 (float64):
    counts all_to_all (n−1)(1 + E_l)·8; dispatch x (h + 2k)·b per row, sent
    Σ_{q≠r} tokens[r][q] rows, received Σ_{s≠r} tokens[s][r]; combine h·b per row the
    other way; dispatch dy h·b per row as x; combine [dX | dg] (h + k)·b per row as the
    combine. One message per peer with rows; the trace moves the same, event for event,
    with the same FLOPs (those of the all-to-all dispatcher)."""
    e, b = 8, 8
    kw = dict(top_k=k, capacity_factor=cf, aux_coef=0.1, seed=4, algorithms=PAIRWISE)
    moe, a2a = MoE(H, F, e, dispatcher="flex", **kw), MoE(H, F, e, **kw)
    params = skewed_router(moe.init_params(), bias=1.0)
    x, dy = moe_inputs(seed=6)
    cluster, mesh, e_l = clusters(ep), Mesh((ep,), ("ep",)), e // ep
    width = {0: H + 2 * k, 1: H, 2: H, 3: H + k}
    for backward in (False, True):
        cluster.reset_stats()
        res = moe.backward(cluster, x, params, dy) if backward else moe.run(cluster, x, params)
        events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
        tokens = res.load.tokens
        for r in range(ep):
            a2a_ev, tagged = _tagged(events, r)
            assert [ev.bytes_sent for ev in a2a_ev] == [(ep - 1) * (1 + e_l) * 8]
            out_rows = sum(tokens[r][q] for q in range(ep) if q != r)
            in_rows = sum(tokens[s][r] for s in range(ep) if s != r)
            for tag in range(4 if backward else 2):
                forth = tag in (0, 2)
                sent = sum(ev.bytes_sent for ev in tagged[tag])
                recvd = sum(ev.bytes_received for ev in tagged[tag])
                assert sent == (out_rows if forth else in_rows) * width[tag] * b, (r, tag)
                assert recvd == (in_rows if forth else out_rows) * width[tag] * b, (r, tag)
                sends = [ev for ev in tagged[tag] if ev.collective == "send"]
                assert len({ev.group[1] for ev in sends}) == len(sends)   # one per peer
        cluster.reset_stats()
        a2a.backward(cluster, x, params, dy) if backward else a2a.run(cluster, x, params)
        assert cluster.stats()["flops"].tolist() == flops
        program = moe.backward_local if backward else moe.forward_local
        traces = trace_program(mesh, program, moe.meta_args(mesh, x.shape, res.load, backward))
        for tr in traces:
            assert trace_comm_signature(tr) == comm_signature(events, tr.rank), tr.rank
        assert [sum(op.flops for op in tr.ops if isinstance(op, TraceCompute))
                for tr in traces] == flops
        for tr in traces:          # every compute op: name, FLOPs and bytes (so dtypes) too
            ran = sorted((ev for ev in events if isinstance(ev, ComputeEvent)
                          and ev.rank == tr.rank and ev.name.startswith("moe: ")),
                         key=lambda ev: ev.start)
            assert [(op.name, op.flops, op.bytes) for op in tr.ops
                    if isinstance(op, TraceCompute) and op.name.startswith("moe: ")] == [
                (ev.name, ev.flops, ev.bytes) for ev in ran], tr.rank


def _rows_sent(events, ep, tag, width):
    """Token rows sent by all ranks in exchange ``tag`` (8-byte items, ``width`` wide)."""
    return sum(ev.bytes_sent for ev in events if isinstance(ev, CommEvent)
               and ev.collective == "send" and ev.tag == MOE_TAG + tag) // (8 * width)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_flex_sends_fewer_rows_than_alltoall_exactly_when_tokens_share_a_rank(clusters, k):
    """ep 2, 8 experts (4 per rank): with k = 1 both dispatchers send the same token rows
    (flex's a little wider: 2 routing columns); with k >= 2 some token has two choices on
    one rank and flex sends strictly fewer rows and bytes, in every exchange."""
    kw = dict(top_k=k, aux_coef=0.1, seed=9, algorithms=PAIRWISE)
    x, dy = moe_inputs(seed=11)
    sent = {}
    for name in ("alltoall", "flex"):
        moe = MoE(H, F, 8, dispatcher=name, **kw)
        cluster = clusters(2)
        cluster.reset_stats()
        moe.backward(cluster, x, moe.init_params(), dy)
        events = cluster.trace()
        widths = {0: H + 2 * k, 1: H, 2: H, 3: H + k} if name == "flex" else dict.fromkeys(
            range(4), H)
        sent[name] = ([_rows_sent(events, 2, t, widths[t]) for t in range(4)],
                      sum(ev.bytes_sent for ev in events if isinstance(ev, CommEvent)
                          and ev.collective == "send"))
    (rows_a, bytes_a), (rows_f, bytes_f) = sent["alltoall"], sent["flex"]
    assert min(rows_a) > 0
    if k == 1:
        assert rows_f == rows_a
    else:
        assert all(f < a for f, a in zip(rows_f, rows_a)), (rows_f, rows_a)
        assert bytes_f < bytes_a


# --- the expectation of ExpertLoad.skewed ---------------------------------------------------
def test_skewed_load_takes_the_expected_distinct_tokens():
    """tokens = round(T·(1 − C(E − E/n, k)/C(E, k))) per (rank, member), clamped to
    [max(busiest expert's rows there, rows there / min(k, E/n)), rows there]; k = 1 is
    exactly the kept rows."""
    assert distinct_rank_fraction(8, 2, 2) == pytest.approx(1 - 6 / 28)
    assert distinct_rank_fraction(256, 8, 8) == pytest.approx(
        1 - math.comb(224, 8) / math.comb(256, 8))
    load = ExpertLoad.skewed(2, 8, 64, 2)
    assert load.tokens == ((50, 50), (50, 50))               # 64·(1 − 6/28) = 50.3
    one = ExpertLoad.skewed(4, 8, 64, 1, 2.0)
    assert one.tokens == tuple(tuple(sum(row[d * 2:(d + 1) * 2]) for d in range(4))
                               for row in one.kept)
    hot = ExpertLoad.skewed(4, 8, 64, 2, 3.0)
    busiest = hot.kept[0][0]                                   # 48 of 64 tokens
    want = round(64 * distinct_rank_fraction(8, 4, 2))         # 30
    assert want == 30 and busiest == 48 and hot.tokens[0][0] == 48      # clamped up
    assert hot.tokens[0][1] == sum(hot.kept[0][2:4]) == 24              # clamped down
    even = ExpertLoad.skewed(4, 16, 64, 4)
    assert even.tokens[0] == (round(64 * distinct_rank_fraction(16, 4, 4)),) * 4
    assert ExpertLoad.skewed(3, 8, 64, 2).tokens is None       # 3 does not divide 8
    with pytest.raises(ValueError, match=r"tokens\[0\]\[1\]=9 must lie in \[4, 8\]"):
        ExpertLoad(((4, 4, 4, 4),), ((4, 4, 4, 4),), None, ((8, 9),))
    with pytest.raises(ValueError, match="tokens must be a"):
        ExpertLoad(((4, 4, 4),), ((4, 4, 4),), None, ((4, 4),))


def test_trace_prices_the_expected_table():
    """A trace of ExpertLoad.skewed at ep 4, top-4 of 16: rank 0 sends
    Σ_{q≠0} tokens[0][q] rows of (h + 2k)·b forward, combines as many rows of h·b, and
    fewer rows than the alltoall's trace."""
    mesh, t, k, e = Mesh((4,), ("ep",)), 64, 4, 16
    load = ExpertLoad.skewed(4, e, t, k)
    sent, experts = {}, {}
    for name in ("alltoall", "flex"):
        moe = MoE(H, F, e, top_k=k, dispatcher=name, algorithms=PAIRWISE)
        trace = trace_program(mesh, moe.forward_local,
                              moe.meta_args(mesh, (4 * t, H), load))[0]
        sent[name] = sum(b for key, entries in trace_comm_signature(trace).items()
                         if len(key) == 2 for entry in entries if entry[0] == "send"
                         for _, b, _ in entry[2])
        half = trace_program(mesh, moe.backward_local, moe.meta_args(
            mesh, (4 * t, H), load, backward=True, dtype=np.float16), ranks=[0])[0]
        experts[name] = [(op.name, op.flops, op.bytes) for op in half.ops
                         if isinstance(op, TraceCompute) and ": expert " in op.name]
    # the experts compute the same rows in 16-bit (their inputs keep x's dtype)
    assert experts["flex"] == experts["alltoall"] and len(experts["flex"]) > 4 * 10
    rows = sum(load.tokens[0][1:])
    assert rows == 3 * round(t * distinct_rank_fraction(e, 4, k))
    assert sent["flex"] == rows * ((H + 2 * k) + H) * 8        # dispatch + combine
    a2a_rows = 3 * (t * k // 4)                                 # 4 experts per rank
    assert sent["alltoall"] == 2 * a2a_rows * H * 8
    assert rows < a2a_rows      # fewer rows (at h = 8 the 2k routing columns outweigh them)


# --- names ----------------------------------------------------------------------------------
def test_bad_names_are_named():
    with pytest.raises(ValueError, match=r"dispatcher must be one of \('alltoall', "
                       r"'allgather', 'flex'\), got 'deepep'"):
        MoE(H, F, 4, dispatcher="deepep")
    with pytest.raises(ConfigError, match="moe_dispatcher.*deepep.*alltoall, allgather, flex"):
        ParallelConfig(global_batch=4, dp=2, ep=2, moe_dispatcher="deepep")
    moe, mesh = MoE(H, F, 4, dispatcher="flex"), Mesh((2,), ("ep",))
    bare = ExpertLoad(((8, 8, 8, 8),) * 2, ((8, 8, 8, 8),) * 2)          # no tokens table
    with pytest.raises(Exception, match=r"dispatcher='flex' in a trace needs "
                                        r"load=ExpertLoad\(\.\.\., tokens=\.\.\.\)"):
        trace_program(mesh, moe.forward_local, moe.meta_args(mesh, (32, H), bare))


def test_cli_and_scenario_list_flex():
    """The scenario key ``parallel.moe_dispatcher`` and ``--moe-dispatcher`` allow exactly
    MOE_DISPATCHERS."""
    import argparse

    from modeling.plan import MOE_DISPATCHERS
    from vcluster.cli import simulate_cmd
    from vcluster.scenario.schema import scenario_schema

    def find(node):
        if isinstance(node, dict):
            if "moe_dispatcher" in node and isinstance(node["moe_dispatcher"], dict) \
                    and "enum" in node["moe_dispatcher"]:
                return node["moe_dispatcher"]["enum"]
            return next((f for v in node.values() if (f := find(v)) is not None), None)
        if isinstance(node, list):
            return next((f for v in node if (f := find(v)) is not None), None)
        return None

    assert tuple(find(scenario_schema())) == MOE_DISPATCHERS == ("alltoall", "allgather", "flex")
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())
    sim = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train = next(a for a in sim.choices["simulate"]._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["train"]
    action = next(a for a in train._actions if a.dest == "moe_dispatcher")
    assert tuple(action.choices) == MOE_DISPATCHERS


# --- inside training ------------------------------------------------------------------------
TRAIN = [(dict(), dict(dp=2, ep=2)),
         (dict(moe_shared_ffn_hidden=6), dict(dp=4, ep=4, pp=2)),
         (BIASES, dict(dp=2, ep=2, micro_batch=2)),
         (dict(BIASES, qkv_bias=True, out_bias=True), dict(dp=2, ep=2, tp=2,
                                                           sequence_parallel=True)),
         (BIASES, dict(dp=2, ep=4, tp=2, etp=1, sequence_parallel=True)),
         (dict(moe_top_k=2, capacity_factor=1.0), dict(dp=2, ep=2, tp=2)),
         (dict(seq=16), dict(dp=2, ep=2, cp=2)),
         (dict(moe_top_k=8, moe_router="sigmoid", moe_routed_scaling=2.5, moe_aux_coef=0.0),
          dict(dp=2, ep=2))]


@pytest.mark.parametrize("fields, extra", TRAIN,
                         ids=["ep2", "ep4-pp2-shared", "biases-mb2", "biases-etp2-sp",
                              "biases-folded", "capacity-etp2", "cp2", "sigmoid-top8"])
def test_training_with_flex_equals_the_reference(cluster_of, fields, extra):
    cfg = moe_cfg(**fields)
    par = ParallelConfig(**{"global_batch": 4, "micro_batch": 1, **extra,
                            "moe_dispatcher": "flex"})
    model, (tokens, targets) = GPT(cfg, seed=2), token_data(cfg, 4, seed=0)
    run, ref = assert_fit_equals_reference(cluster_of(par.mesh()), model, par, tokens,
                                           targets, steps=3, lr=0.1, rtol=RTOL, atol=ATOL,
                                           parallel=par)
    if fields.get("moe_expert_bias"):
        assert np.abs(ref.grads["layers.0.moe_b_down"]).max() > 1e-6
    for load in run.expert_load[0].values():
        assert load.tokens is not None and sum(map(sum, load.tokens)) <= sum(
            map(sum, load.kept))


@pytest.mark.parametrize("extra", [dict(dp=2, ep=2, micro_batch=2),
                                   dict(dp=2, ep=2, tp=2, micro_batch=2,
                                        sequence_parallel=True)],
                         ids=["ep2", "etp2-sp"])
def test_training_trace_moves_the_runs_messages(cluster_of, extra):
    """One step, one micro-batch per replica: the trace given the run's ExpertLoad per
    layer (its tokens table included) moves the emulator's messages, rank by rank."""
    cfg = moe_cfg(moe_top_k=2, **BIASES)
    par = ParallelConfig(global_batch=4, **extra, moe_dispatcher="flex")
    mesh, model = par.mesh(), GPT(cfg, seed=5)
    tokens, targets = token_data(cfg, 4, seed=0)
    run, _ = trace_moves_the_runs_messages(cluster_of(mesh), model, par, tokens, targets)
    assert all(load.tokens is not None for load in run.expert_load[0].values())
    # and it simulates with the planner's expected table (ExpertLoad.skewed)
    trace_program(mesh, train_program, model.meta_args(mesh, par, 1))
