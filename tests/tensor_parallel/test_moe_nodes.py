"""The flex dispatcher across nodes (``MoE(..., dispatcher="flex", ep_node_ranks=d)``,
``ParallelConfig.moe_ep_node_ranks``; DeepEP's internode kernels, Megatron-Core's HybridEP):
a token crosses the network once per destination *node*, to the rank there with its own
local index (the proxy), which forwards it over the node's links to the node's ranks
holding its choices; the proxy sums their answers per token before the one row goes back.

Checked: the layer equals the single-process reference, the one-hop flex and the
all-to-all dispatcher (rtol 1e-9) for ep 4 with 2 ranks per node and ep 8 with 2 and 4,
top-1/2/4, a capacity, a shared expert, skewed routing; the node table the emulator
reports is a direct count; per hop (inter-node tags MOE_TAG + 0..3, intra-node MOE_TAG +
4..7) the traffic equals its closed form and the trace moves the emulator's messages and
FLOPs; fewer bytes cross nodes than with the one-hop flex when tokens pick several ranks of
one node, the same with one rank per node; ``ExpertLoad.skewed(node_ranks=)``'s
expectation; the simulator prices the hops over the proxies and over the node; training
(Llama MoE with biases) equals its reference; bad values are named."""

import numpy as np
import pytest

from mesh import Mesh
from modeling import ConfigError
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, ParallelConfig
from tensor_parallel import MOE_TAG, ExpertLoad, MoE
from tensor_parallel.moe_load import distinct_rank_fraction
from tensor_parallel.moe_reference import moe_reference
from vcluster.runtime.events import CommEvent, ComputeEvent
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, comm_signature,
                                      trace_comm_signature, trace_program)

from ..pipeline_parallel.gpt_data import assert_fit_equals_reference, token_data
from .moe_data import (ATOL, BIASES, GRADS, PAIRWISE, RTOL, F, H, moe_cfg, moe_inputs,
                       skewed_router, trace_moves_the_runs_messages)

pytestmark = pytest.mark.timeout(300)

# --- numerics -----------------------------------------------------------------------------
# (ep, node ranks, experts, top_k, capacity factor, skewed router, shared width)
CASES = [(4, 2, 8, k, None, False, 0) for k in (1, 2, 4)] + [
    (4, 1, 8, 2, None, False, 0), (4, 2, 8, 2, None, True, 6), (4, 2, 16, 3, 0.75, False, 0),
    (8, 2, 16, 2, None, False, 0), (8, 4, 16, 4, None, True, 0)]


@pytest.mark.parametrize("ep, d, e, k, cf, skew, fs", CASES,
                         ids=[f"ep{c[0]}-node{c[1]}-E{c[2]}-top{c[3]}"
                              f"{'-cf' + str(c[4]) if c[4] else ''}{'-skewed' if c[5] else ''}"
                              f"{'-shared' if c[6] else ''}" for c in CASES])
def test_nodes_equal_the_reference_flex_and_alltoall(clusters, ep, d, e, k, cf, skew, fs):
    kw = dict(top_k=k, capacity_factor=cf, aux_coef=0.1, seed=ep + k, shared_ffn_hidden=fs)
    nodes = MoE(H, F, e, dispatcher="flex", ep_node_ranks=d, **kw)
    flex, a2a = MoE(H, F, e, dispatcher="flex", **kw), MoE(H, F, e, **kw)
    params = nodes.init_params()
    params = skewed_router(params) if skew else params
    x, dy = moe_inputs(seed=ep * 10 + k, n=2 * ep * 4)
    got = nodes.backward(clusters(ep), x, params, dy, d_aux=0.7)
    ref = nodes.reference(x, params, dy, ep=ep, d_aux=0.7)
    for other in (ref, flex.backward(clusters(ep), x, params, dy, d_aux=0.7),
                  a2a.backward(clusters(ep), x, params, dy, d_aux=0.7)):
        for name in GRADS:
            np.testing.assert_allclose(getattr(got, name), getattr(other, name), rtol=RTOL,
                                       atol=ATOL, err_msg=name)
        assert got.aux_loss == pytest.approx(other.aux_loss, rel=RTOL)
    for g, r in zip(got.shared_grads or (), ref.shared_grads or ()):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL)
    assert got.load.node_tokens is not None and len(got.load.node_tokens[0]) == ep // d
    np.testing.assert_allclose(nodes.run(clusters(ep), x, params).y, ref.y, rtol=RTOL,
                               atol=ATOL)


@pytest.mark.parametrize("ep, d, k, cf", [(4, 2, 2, None), (4, 2, 3, 0.75), (8, 4, 4, None)])
def test_node_table_is_a_direct_count(clusters, ep, d, k, cf):
    """node_tokens[r][N]: rank r's tokens with a kept choice among node N's experts."""
    e = 16
    moe = MoE(H, F, e, top_k=k, capacity_factor=cf, seed=3, dispatcher="flex",
              ep_node_ranks=d)
    params = skewed_router(moe.init_params())
    n_tok = 4 * ep
    x = moe_inputs(seed=5, n=n_tok)[0]
    load = moe.run(clusters(ep), x, params).load
    _, choice, keep = moe_reference(x, *(params[n] for n in moe.weight_names()), top_k=k,
                                    capacity_factor=cf, aux_coef=0.0, ep=ep)
    t, span = n_tok // ep, e * d // ep
    want = [[sum(any(keep[i, c] and choice[i, c] // span == nd for c in range(k))
                 for i in range(r * t, (r + 1) * t)) for nd in range(ep // d)]
            for r in range(ep)]
    assert [list(row) for row in load.node_tokens] == want
    assert sum(map(sum, load.node_tokens)) < sum(map(sum, load.tokens))


# --- traffic: emulator == closed form == trace --------------------------------------------
def _by_tag(events, rank):
    ev = [e for e in events if isinstance(e, CommEvent) and e.rank == rank]
    return {t: [e for e in ev if e.collective in ("send", "recv") and e.tag == MOE_TAG + t]
            for t in range(8)}


TRAFFIC = [(4, 2, 2), (4, 2, 1), (4, 2, 4), (8, 2, 2), (8, 4, 3)]


@pytest.mark.parametrize("ep, d, k", TRAFFIC, ids=[f"ep{c[0]}-node{c[1]}-top{c[2]}"
                                                   for c in TRAFFIC])
def test_traffic_per_hop_equals_the_closed_form_and_the_trace(clusters, ep, d, k):
    """Per rank r at node ν = ⌊r/d⌋, its sources (and proxies) S_r = {N·d + r mod d}, its
    node's ranks L_r, b = 8, row widths w = h + 2k (dispatch x), h (combine, dispatch dy),
    h + k (combine [dX | dg]):
      inter-node, dispatch:  sent w·b·Σ_{N≠ν} node_tokens[r][N],
                             received w·b·Σ_{s∈S_r, s≠r} node_tokens[s][ν];
      intra-node, dispatch:  sent w·b·Σ_{q∈L_r, q≠r} Σ_{s∈S_r} tokens[s][q],
                             received w·b·Σ_{s: s mod d ≠ r mod d} tokens[s][r];
    the combines the same with sent and received swapped; the counts all_to_all
    (n−1)(2 + E_l)·8. The trace moves the same messages and FLOPs."""
    e, b = 16, 8
    moe = MoE(H, F, e, top_k=k, aux_coef=0.1, seed=4, algorithms=PAIRWISE,
              dispatcher="flex", ep_node_ranks=d)
    params = skewed_router(moe.init_params(), bias=1.0)
    x, dy = moe_inputs(seed=6, n=4 * ep)
    cluster, mesh, e_l = clusters(ep), Mesh((ep,), ("ep",)), e // ep
    width = {0: H + 2 * k, 1: H, 2: H, 3: H + k}
    for backward in (False, True):
        cluster.reset_stats()
        res = moe.backward(cluster, x, params, dy) if backward else moe.run(cluster, x, params)
        events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
        tok, nod = res.load.tokens, res.load.node_tokens
        for r in range(ep):
            nu, src, local = r // d, [nd * d + r % d for nd in range(ep // d)], \
                range((r // d) * d, (r // d + 1) * d)
            a2a = [ev for ev in events if isinstance(ev, CommEvent) and ev.rank == r
                   and ev.collective == "all_to_all"]
            assert [ev.bytes_sent for ev in a2a] == [(ep - 1) * (2 + e_l) * 8]
            inter_out = sum(nod[r][nd] for nd in range(ep // d) if nd != nu)
            inter_in = sum(nod[s][nu] for s in src if s != r)
            intra_out = sum(tok[s][q] for q in local if q != r for s in src)
            intra_in = sum(tok[s][r] for s in range(ep) if s % d != r % d)
            tagged = _by_tag(events, r)
            for tag in range(4 if backward else 2):
                forth = tag in (0, 2)
                for hop, (out, into) in ((tag, (inter_out, inter_in)),
                                         (tag + 4, (intra_out, intra_in))):
                    sent = sum(ev.bytes_sent for ev in tagged[hop])
                    recvd = sum(ev.bytes_received for ev in tagged[hop])
                    want = (out, into) if forth else (into, out)
                    assert (sent, recvd) == (want[0] * width[tag] * b,
                                             want[1] * width[tag] * b), (r, hop)
                    peers = {ev.group[1] for ev in tagged[hop] if ev.collective == "send"}
                    assert peers <= (set(src) if hop < 4 else set(local)) - {r}
        program = moe.backward_local if backward else moe.forward_local
        traces = trace_program(mesh, program, moe.meta_args(mesh, x.shape, res.load, backward))
        for tr in traces:
            assert trace_comm_signature(tr) == comm_signature(events, tr.rank), tr.rank
        assert [sum(op.flops for op in tr.ops if isinstance(op, TraceCompute))
                for tr in traces] == flops
        for tr in traces:
            ran = sorted((ev for ev in events if isinstance(ev, ComputeEvent)
                          and ev.rank == tr.rank and ev.name.startswith("moe: ")),
                         key=lambda ev: ev.start)
            assert [(op.name, op.flops, op.bytes) for op in tr.ops
                    if isinstance(op, TraceCompute) and op.name.startswith("moe: ")] == [
                (ev.name, ev.flops, ev.bytes) for ev in ran], tr.rank


def _cross_node_bytes(events, ep, d):
    """Bytes sent between ranks of different nodes (d consecutive ranks per node)."""
    return sum(ev.bytes_sent for ev in events if isinstance(ev, CommEvent)
               and ev.collective == "send" and ev.rank // d != ev.group[1] // d
               and MOE_TAG <= ev.tag < MOE_TAG + 8)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fewer_bytes_cross_nodes_than_the_one_hop_flex(clusters, k):
    """ep 4, 16 experts, 2 ranks per node: with k >= 2 some token picks both ranks of a
    node, and fewer bytes cross nodes than with the one-hop flex (which sends it to each);
    with one rank per node the inter-node hop is the one-hop flex's, byte for byte (k = 1
    too: a token then reaches one rank anywhere)."""
    kw = dict(top_k=k, aux_coef=0.1, seed=9, algorithms=PAIRWISE)
    x, dy = moe_inputs(seed=11, n=64)
    crossing = {}
    for d in (None, 2, 1):
        moe = MoE(H, F, 16, dispatcher="flex", ep_node_ranks=d, **kw)
        cluster = clusters(4)
        cluster.reset_stats()
        moe.backward(cluster, x, moe.init_params(), dy)
        crossing[d] = _cross_node_bytes(cluster.trace(), 4, 2)
        if d == 1:                                  # every rank its own node
            events = cluster.trace()
            assert not any(isinstance(ev, CommEvent) and ev.collective == "send"
                           and ev.tag >= MOE_TAG + 4 for ev in events)
            one = sum(ev.bytes_sent for ev in events if isinstance(ev, CommEvent)
                      and ev.collective == "send" and MOE_TAG <= ev.tag < MOE_TAG + 4)
    cluster.reset_stats()
    MoE(H, F, 16, dispatcher="flex", **kw).backward(cluster, x, MoE(
        H, F, 16, **kw).init_params(), dy)
    flex_all = sum(ev.bytes_sent for ev in cluster.trace() if isinstance(ev, CommEvent)
                   and ev.collective == "send" and MOE_TAG <= ev.tag < MOE_TAG + 4)
    assert one == flex_all                          # node ranks 1: the one-hop flex
    if k == 1:
        assert crossing[2] == crossing[None]
    else:
        assert 0 < crossing[2] < crossing[None], crossing


# --- the expectation ------------------------------------------------------------------------
def test_skewed_load_takes_the_expected_node_tokens():
    """node_tokens = round(T·(1 − C(E − E·d/n, k)/C(E, k))) per (rank, node), clamped into
    [the most of the node's ranks, their sum]."""
    load = ExpertLoad.skewed(8, 64, 256, 8, node_ranks=4)
    want = round(256 * distinct_rank_fraction(64, 2, 8))
    assert load.node_tokens == ((want, want),) * 8
    assert want < 2 * load.tokens[0][0]
    assert ExpertLoad.skewed(8, 64, 256, 8, node_ranks=8).node_tokens is None
    one = ExpertLoad.skewed(4, 8, 64, 1, node_ranks=2)
    assert one.node_tokens[0] == (sum(one.tokens[0][:2]), sum(one.tokens[0][2:]))
    with pytest.raises(ValueError, match="node_ranks must be an int >= 1 dividing ep=8"):
        ExpertLoad.skewed(8, 64, 256, 8, node_ranks=3)
    with pytest.raises(ValueError, match=r"node_tokens\[0\]\[0\]=9 must lie in \[4, 8\]"):
        ExpertLoad(((4, 4, 4, 4),), ((4, 4, 4, 4),), None, ((4, 4, 4, 4),), ((9, 8),))


# --- the simulator ----------------------------------------------------------------------------
def test_simulator_prices_the_hops_over_proxies_and_nodes():
    """The traced rank's exchanges become all_to_alls: the inter-node tags over the proxies
    (the ranks with its local index, one per node), the intra-node tags over its node."""
    from vcluster.planner.simulation import moe_exchanges_as_all_to_all
    from vcluster.planner.stitch import Templates
    mesh, t, k, e = Mesh((8,), ("ep",)), 64, 4, 32
    load = ExpertLoad.skewed(8, e, t, k, node_ranks=4)
    moe = MoE(H, F, e, top_k=k, dispatcher="flex", ep_node_ranks=4)
    trace = trace_program(mesh, moe.backward_local,
                          moe.meta_args(mesh, (8 * t, H), load, backward=True), ranks=[0])[0]
    out = moe_exchanges_as_all_to_all(Templates({}, tuple(trace.ops), {}), tuple(range(8)),
                                      4, 0).tail
    a2a = [op for op in out if isinstance(op, TraceCollective)
           and op.collective == "all_to_all" and op.itemsize == 1]
    assert [op.group for op in a2a] == [(0, 4), (0, 1, 2, 3), (0, 1, 2, 3), (0, 4)] * 2
    # the inter-node dispatch: one peer (node 1's proxy), 2/1 · max(sent, received)
    sent = load.node_tokens[0][1] * (H + 2 * k) * 8
    assert [op.nbytes for op in trace.ops if getattr(op, "tag", None) == MOE_TAG] == \
        [sent, sent]                                  # the send and the receive
    assert a2a[0].nbytes == 2 * sent


def test_simulate_gpt_runs_across_nodes():
    from vcluster.planner.simulation import simulate_gpt
    from vcluster.timing.presets import preset
    cfg = moe_cfg(hidden=64, heads=4, kv_heads=4, ffn_hidden=128, moe_ffn_hidden=32, experts=16,
               moe_top_k=4, seq=64, vocab=128, dtype="float16")
    hw = preset("h100-dgx")
    step = {}
    for d in (None, 4):
        par = ParallelConfig(global_batch=16, dp=8, ep=8, moe_dispatcher="flex",
                             moe_ep_node_ranks=d)
        step[d] = simulate_gpt(cfg, par, hw).step_time_s
    assert step[4] > 0 and step[None] > 0


# --- names ----------------------------------------------------------------------------------
def test_bad_values_are_named():
    with pytest.raises(ValueError, match="ep_node_ranks.*dispatcher='flex'.*got "
                                         "ep_node_ranks=2 with dispatcher='alltoall'"):
        MoE(H, F, 8, ep_node_ranks=2)
    with pytest.raises(ConfigError, match="moe_ep_node_ranks"):
        ParallelConfig(global_batch=8, dp=8, ep=8, moe_ep_node_ranks=2)
    with pytest.raises(ConfigError, match="moe_ep_node_ranks.*divisor of ep=8"):
        ParallelConfig(global_batch=8, dp=8, ep=8, moe_dispatcher="flex", moe_ep_node_ranks=3)
    with pytest.raises(ConfigError, match="moe_ep_node_ranks.*integer >= 1"):
        ParallelConfig(global_batch=8, dp=8, ep=8, moe_dispatcher="flex", moe_ep_node_ranks=0)
    ParallelConfig(global_batch=8, dp=8, ep=8, moe_dispatcher="flex", moe_ep_node_ranks=16)
    moe, mesh = MoE(H, F, 8, dispatcher="flex", ep_node_ranks=2), Mesh((4,), ("ep",))
    bare = ExpertLoad.skewed(4, 8, 8, 2)                       # no node table
    with pytest.raises(Exception, match=r"ep_node_ranks=2 in a trace needs "
                                        r"load=ExpertLoad\(\.\.\., node_tokens=\.\.\.\)"):
        trace_program(mesh, moe.forward_local, moe.meta_args(mesh, (32, H), bare))
    with pytest.raises(ValueError, match="ep_node_ranks=3 must divide the expert group's 4"):
        MoE(H, F, 8, dispatcher="flex", ep_node_ranks=3).node_ranks(4)


def test_expert_ranks_per_domain_follow_the_mesh():
    """The mesh puts ep next to tp: ep 8 with tp 2 spans 16 consecutive GPUs, so 8-GPU
    domains hold 4 of a group's ranks; folded (etp 1) the group is 8 consecutive GPUs; a
    group spread over one domain's halves is refused."""
    par = ParallelConfig(global_batch=16, dp=8, tp=2, ep=8)
    assert par.expert_ranks_per_domain(8) == 4
    assert par.expert_ranks_per_domain(16) == 8
    folded = ParallelConfig(global_batch=16, dp=4, tp=2, ep=8, etp=1, sequence_parallel=True)
    assert folded.expert_ranks_per_domain(8) == 8
    assert folded.expert_ranks_per_domain(4) == 4
    assert ParallelConfig(global_batch=4, dp=4).expert_ranks_per_domain(8) is None
    with pytest.raises(ConfigError, match="moe_ep_node_ranks.*does not split into domains "
                                          "of 3 GPUs"):
        ParallelConfig(global_batch=16, dp=8, ep=8).expert_ranks_per_domain(3)


# --- inside training ------------------------------------------------------------------------
TRAIN = [(dict(), dict(dp=4, ep=4)),
         (BIASES, dict(dp=4, ep=4, micro_batch=2)),
         (dict(moe_top_k=2, moe_shared_ffn_hidden=6), dict(dp=4, ep=4, pp=2)),
         (BIASES, dict(dp=2, ep=4, tp=2, etp=1, sequence_parallel=True))]


@pytest.mark.parametrize("fields, extra", TRAIN,
                         ids=["ep4", "biases-mb2", "top2-shared-pp2", "biases-folded"])
def test_training_across_nodes_equals_the_reference(cluster_of, fields, extra):
    cfg = moe_cfg(**fields)
    par = ParallelConfig(**{"global_batch": 4 * extra.get("micro_batch", 1), **extra,
                            "moe_dispatcher": "flex", "moe_ep_node_ranks": 2})
    model, (tokens, targets) = GPT(cfg, seed=2), token_data(cfg, par.global_batch, seed=0)
    assert_fit_equals_reference(cluster_of(par.mesh()), model, par, tokens, targets,
                                steps=2, lr=0.1, rtol=RTOL, atol=ATOL, parallel=par)
    trace_program(par.mesh(), train_program, model.meta_args(par.mesh(), par, 1))


# --- wiring: validation, CLI, scenario ---------------------------------------------------------
def test_validation_sets_node_ranks_from_the_mesh_and_the_domain():
    """with_node_ranks: flex groups spanning several DGX nodes get the group's ranks per
    node; one-node groups, other dispatchers and NVL72 racks keep the one-hop path."""
    from vcluster.planner.candidates import with_node_ranks
    par = ParallelConfig(global_batch=64, dp=32, ep=32, moe_dispatcher="flex")
    assert with_node_ranks(par, "b200-dgx").moe_ep_node_ranks == 8
    assert with_node_ranks(par, "gb200-nvl72") is par                  # 72-GPU domain
    tp2 = ParallelConfig(global_batch=64, dp=16, tp=2, ep=16, moe_dispatcher="flex",
                         sequence_parallel=True)
    assert with_node_ranks(tp2, "h100-dgx").moe_ep_node_ranks == 4
    small = ParallelConfig(global_batch=64, dp=8, ep=8, moe_dispatcher="flex")
    assert with_node_ranks(small, "h100-dgx") is small
    a2a = ParallelConfig(global_batch=64, dp=32, ep=32)
    assert with_node_ranks(a2a, "h100-dgx") is a2a


def test_validation_rows_run_across_nodes():
    """The 2026 table's DeepEP/HybridEP rows on 8-GPU DGX nodes with ep > 8 (the B200
    DeepSeek-V3 row: ep 32 over 4 nodes) run with the group's ranks per node; rows over
    NVL72 racks whose group straddles a rack keep the one-hop flex, not refused, and say
    so; the H100 MoE table's flex rows with ep > 8 too (Qwen3 30B-A3B, ep 16: 8 ranks per
    node; Qwen3-235B, tp 2 and ep 32: 4)."""
    from vcluster.planner.validation import MOE_TABLE, moe_row_config
    from vcluster.planner.validation_2026 import TABLES_2026, row_config
    from vcluster.timing import read_data_csv
    flex = [r for r in read_data_csv(TABLES_2026[0])[1]
            if r.get("moe_dispatcher") in ("deepep", "hybridep") and int(r["ep"] or 1) > 8]
    dgx = [row_config(r) for r in flex if r["system"] in ("DGX-B200", "DGX-B300")]
    assert dgx and all(c[1].moe_ep_node_ranks == c[1].expert_ranks_per_domain(8) < c[1].ep
                       for c in dgx)
    racks = [row_config(r) for r in flex if r["system"] in ("DGX-GB200", "DGX-GB300")
             and r["gpus"] == "256"]
    assert racks and all(c[1] is not None and c[1].moe_ep_node_ranks is None and not c[4]
                         and any("one hop" in a for a in c[3]) for c in racks)
    moe = [moe_row_config(r)[1] for r in read_data_csv(MOE_TABLE)[1]
           if r.get("moe_dispatcher") in ("deepep", "hybridep") and int(r["ep"]) > 8]
    assert moe and all(p.moe_ep_node_ranks == p.expert_ranks_per_domain(8) for p in moe)


def test_cli_and_scenario_carry_node_ranks():
    import argparse

    from vcluster.cli import simulate_cmd
    from vcluster.scenario.schema import scenario_schema

    def find(node):
        if isinstance(node, dict):
            if "moe_ep_node_ranks" in node:
                return node["moe_ep_node_ranks"]
            return next((f for v in node.values() if (f := find(v)) is not None), None)
        if isinstance(node, list):
            return next((f for v in node if (f := find(v)) is not None), None)
        return None

    assert find(scenario_schema())["type"] == "integer"
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())
    sim = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train = next(a for a in sim.choices["simulate"]._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["train"]
    action = next(a for a in train._actions if a.dest == "moe_ep_node_ranks")
    assert action.type("4") == 4 and action.default is None


@pytest.mark.parametrize("extra", [dict(dp=4, ep=4, micro_batch=2),
                                   dict(dp=2, ep=4, tp=2, etp=1, micro_batch=2,
                                        sequence_parallel=True)],
                         ids=["ep4", "folded"])
def test_training_trace_moves_the_runs_messages(cluster_of, extra):
    """One step: the run reports node_tokens per layer; the trace given the run's loads
    moves the emulator's messages, rank by rank, both hops."""
    cfg = moe_cfg(moe_top_k=2, **BIASES)
    par = ParallelConfig(global_batch=8 if extra["dp"] == 4 else 4, **extra,
                         moe_dispatcher="flex", moe_ep_node_ranks=2)
    mesh, model = par.mesh(), GPT(cfg, seed=5)
    tokens, targets = token_data(cfg, par.global_batch, seed=0)
    run, events = trace_moves_the_runs_messages(cluster_of(mesh), model, par, tokens,
                                                targets)
    assert all(load.node_tokens is not None and len(load.node_tokens[0]) == 2
               for load in run.expert_load[0].values())
    assert any(isinstance(ev, CommEvent) and ev.tag == MOE_TAG + 4 for ev in events)
