"""Tests for vcluster.timing.collective_cost: closed forms, placement, auto, flows, NCCL data."""

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vcluster.timing import (ALGORITHMS, NCCL_BASE_LATENCY_US, Algorithm, Collective,
                             algbw_gbps, bus_factor, busbw_gbps, collective_cost,
                             collective_time_s, preset, read_data_csv, validate_nccl)
from vcluster.timing.nccl_validation import NCCL_TOLERANCE, format_validation_table

HW = preset("a100-80gb-dgx")
BASE = NCCL_BASE_LATENCY_US * 1e-6
A_NV = 3.4e-6           # NVLink step latency (tuning.cc, Ring/Simple)
B_NV = 1 / 240e9        # 12 links x 20 GB/s
A_NET = 9.6e-6          # network step latency (tuning.cc, Ring/Simple), one leaf switch
NODE_GBPS = 8 * 23.5    # 8 HDR NICs at the achieved 23.5 GB/s
N = 3.0e8               # bytes


def lg(p):
    return math.ceil(math.log2(p))


# Within one node: the closed forms of FORMULAS.md (gamma = 0), plus NCCL's base latency.
SINGLE_NODE = {
    ("all_reduce", "ring"): lambda p, n: BASE + 2 * (p - 1) * A_NV + 2 * (p - 1) / p * n * B_NV,
    ("all_reduce", "tree"): lambda p, n: BASE + 2 * (p - 1) * A_NV + 2 * n * B_NV,
    ("all_reduce", "recursive"): lambda p, n: BASE + 2 * lg(p) * A_NV + 2 * (p - 1) / p * n * B_NV,
    ("all_reduce", "hierarchical"):  # two NCCL calls: reduce_scatter + all_gather
        lambda p, n: 2 * BASE + 2 * (p - 1) * A_NV + 2 * (p - 1) / p * n * B_NV,
    ("all_gather", "ring"): lambda p, n: BASE + (p - 1) * A_NV + (p - 1) / p * n * B_NV,
    ("all_gather", "recursive"): lambda p, n: BASE + lg(p) * A_NV + (p - 1) / p * n * B_NV,
    ("reduce_scatter", "ring"): lambda p, n: BASE + (p - 1) * A_NV + (p - 1) / p * n * B_NV,
    ("reduce_scatter", "recursive"): lambda p, n: BASE + lg(p) * A_NV + (p - 1) / p * n * B_NV,
    ("all_to_all", "pairwise"): lambda p, n: BASE + (p - 1) * A_NV + (p - 1) / p * n * B_NV,
    ("scatter", "pairwise"): lambda p, n: BASE + (p - 1) * A_NV + (p - 1) / p * n * B_NV,
    ("gather", "pairwise"): lambda p, n: BASE + (p - 1) * A_NV + (p - 1) / p * n * B_NV,
    ("barrier", "ring"): lambda p, n: BASE + 2 * (p - 1) * A_NV,
    ("barrier", "tree"): lambda p, n: BASE + 2 * (p - 1) * A_NV,
    ("broadcast", "tree"): lambda p, n: BASE + lg(p) * (A_NV + n * B_NV),
    ("broadcast", "ring"): lambda p, n: BASE + (p - 1) * A_NV + n * B_NV,
    ("reduce", "tree"): lambda p, n: BASE + lg(p) * (A_NV + n * B_NV),
    ("reduce", "ring"): lambda p, n: BASE + (p - 1) * A_NV + n * B_NV,
}


def test_every_algorithm_has_a_closed_form_test():
    # NVLink SHARP needs a fabric with it (not this file's presets): its closed form is
    # tested in test_scaleup_domains.py
    pairs = {(c.value, a.value) for c, algs in ALGORITHMS.items() for a in algs
             if c not in (Collective.SEND, Collective.RECV)
             and a.value not in ("nvls", "nvls_tree")}
    assert pairs == set(SINGLE_NODE)


@pytest.mark.parametrize("coll,alg", sorted(SINGLE_NODE))
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_single_node_closed_forms(coll, alg, p):
    if alg == "recursive" and p & (p - 1):
        with pytest.raises(ValueError, match="power-of-two"):
            collective_cost(coll, N, tuple(range(p)), HW, algorithm=alg)
        return
    group = tuple(range(8, 8 + p))  # any node: here node 1
    cost = collective_cost(coll, N, group, HW, algorithm=alg)
    assert cost.algorithm.value == alg and cost.nodes == 1 and cost.group_size == p
    assert cost.time_s == pytest.approx(SINGLE_NODE[coll, alg](p, N), rel=1e-12)


@pytest.mark.parametrize("coll", ["send", "recv"])
def test_point_to_point_closed_forms(coll):
    assert collective_time_s(coll, N, (3, 5), HW) == pytest.approx(BASE + A_NV + N * B_NV)
    # across nodes a single GPU reaches its own rail's NIC
    assert collective_time_s(coll, N, (3, 13), HW) == pytest.approx(BASE + A_NET + N / 23.5e9)
    with pytest.raises(ValueError, match="two ranks"):
        collective_cost(coll, N, (1, 2, 3), HW)


# Two DGX A100 nodes, 16 ranks, 8 NICs per node.
P2 = tuple(range(16))
B_NET = 1 / (NODE_GBPS * 1e9)
TWO_NODES = {
    ("all_reduce", "ring"): BASE + 2 * (14 * A_NV + A_NET) + 2 * 15 / 16 * N * B_NET,
    ("all_reduce", "tree"): BASE + 2 * (7 * A_NV + 1 * A_NET) + 2 * N * B_NET,
    ("all_reduce", "hierarchical"):
        3 * BASE + 2 * 7 * A_NV + 2 * A_NET + 2 * 7 / 8 * N * B_NV + 2 * 1 / 2 * N * B_NET,
    ("all_reduce", "recursive"):  # distances 1, 2, 4 inside nodes; 8 crosses (8 senders)
        BASE + 2 * (3 * A_NV + A_NET) + 2 * (7 / 8 * N * B_NV + N / 16 * 8 * B_NET),
    ("all_gather", "ring"): BASE + 14 * A_NV + A_NET + 15 / 16 * N * B_NET,
    ("reduce_scatter", "ring"): BASE + 14 * A_NV + A_NET + 15 / 16 * N * B_NET,
    ("all_to_all", "pairwise"):
        BASE + 7 * A_NV + 8 * A_NET + max(7 / 16 * N * B_NV, 8 * 8 / 16 * N * B_NET),
    ("broadcast", "ring"): BASE + 14 * A_NV + A_NET + N * B_NET,
    ("broadcast", "tree"):  # the root sends across first, from its own rail's NIC
        BASE + A_NET + N / 23.5e9 + 3 * (A_NV + N * B_NV),
    ("scatter", "pairwise"):  # the root's 8 remote blocks leave through its own NIC
        BASE + 7 * A_NV + 8 * A_NET + max(7 / 16 * N * B_NV, 8 / 16 * N / 23.5e9),
    ("barrier", "ring"): BASE + 2 * (14 * A_NV + A_NET),
    ("barrier", "tree"): BASE + 2 * (7 * A_NV + A_NET),
}


@pytest.mark.parametrize("coll,alg", sorted(TWO_NODES))
def test_two_node_closed_forms(coll, alg):
    cost = collective_cost(coll, N, P2, HW, algorithm=alg)
    assert cost.nodes == 2
    assert cost.time_s == pytest.approx(TWO_NODES[coll, alg], rel=1e-12)


def test_ring_crossing_nodes_is_bottlenecked_by_the_nics():
    for nics in (8, 4, 2):
        hw = HW.with_nics_per_node(nics)
        cost = collective_cost("all_reduce", 8e9, P2, hw, algorithm="ring")
        assert cost.bandwidth_s == pytest.approx(2 * 15 / 16 * 8e9 / (nics * 23.5e9))
    # NVLink-bound when the NICs are faster than the GPU links
    fast = dataclasses.replace(HW, network=dataclasses.replace(HW.network, nics_per_node=16))
    cost = collective_cost("all_reduce", 8e9, P2, fast, algorithm="ring")
    assert cost.bandwidth_s == pytest.approx(2 * 15 / 16 * 8e9 * B_NV)


def test_group_order_and_placement():
    shuffled = (9, 3, 15, 0, 12, 6, 1, 8, 2, 14, 4, 11, 5, 13, 7, 10)
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time_s(coll, N, shuffled, HW) == collective_time_s(coll, N, P2, HW)
    # the same group size is faster inside one node than across two
    assert collective_time_s("all_reduce", N, tuple(range(8)), HW) < collective_time_s(
        "all_reduce", N, (0, 1, 2, 3, 8, 9, 10, 11), HW)


def test_uneven_groups():
    group = (0, 1, 2, 8)  # 3 members on node 0, 1 on node 1
    cost = collective_cost("all_reduce", N, group, HW, algorithm="ring")
    net = 1 / (23.5e9 * 1)  # node 1 has one member: one rail
    assert cost.time_s == pytest.approx(BASE + 2 * (2 * A_NV + A_NET) + 2 * 3 / 4 * N * net)
    with pytest.raises(ValueError, match="same number of members"):
        collective_cost("all_reduce", N, group, HW, algorithm="hierarchical")


def test_auto_picks_tree_for_small_and_ring_for_large_across_nodes():
    group = tuple(range(32))  # 4 nodes
    ring_lat = BASE + 2 * (28 * A_NV + 3 * A_NET)
    tree_lat = BASE + 2 * (7 * A_NV + 2 * A_NET)
    # ring: 2(p-1)/p n / B, tree: 2n / B -> crossover where the latencies balance
    crossover = (ring_lat - tree_lat) / ((2 - 2 * 31 / 32) * B_NET)
    assert 1e8 < crossover < 1e9
    for nbytes, expected in ((8, "tree"), (1 << 20, "tree"), (0.9 * crossover, "tree"),
                             (1.1 * crossover, "ring"), (8e9, "ring")):
        assert collective_cost("all_reduce", nbytes, group, HW).algorithm.value == expected
    # inside one node the tree's chain has the ring's latency and less bandwidth: ring
    for nbytes in (8, 1 << 20, 8e9):
        assert collective_cost("all_reduce", nbytes, tuple(range(8)), HW).algorithm is (
            Algorithm.RING)
    # auto chooses among NCCL's algorithms only, and is never slower than them
    for nbytes in (8, 1e6, 1e9):
        auto = collective_time_s("all_reduce", nbytes, group, HW)
        assert auto == min(collective_time_s("all_reduce", nbytes, group, HW, algorithm=a)
                           for a in ("ring", "tree"))


@pytest.mark.parametrize("flows", [1, 2, 4, 8])
def test_concurrent_flows_share_the_nics_in_proportion(flows):
    one = collective_cost("all_reduce", 8e9, P2, HW)
    shared = collective_cost("all_reduce", 8e9, P2, HW, concurrent_flows=flows)
    assert shared.latency_s == one.latency_s
    assert shared.bandwidth_s == pytest.approx(flows * one.bandwidth_s)


def test_rail_aligned_groups_do_not_share_nics_until_rails_run_out():
    dp_group = (0, 8, 16, 24)  # one GPU per node: one rail each
    one = collective_cost("all_reduce", 1e9, dp_group, HW, algorithm="ring")
    assert one.bandwidth_s == pytest.approx(2 * 3 / 4 * 1e9 / 23.5e9)
    for flows in (2, 8):  # 8 data-parallel rings, one per local rank, one NIC each
        assert collective_cost("all_reduce", 1e9, dp_group, HW, algorithm="ring",
                               concurrent_flows=flows).bandwidth_s == pytest.approx(one.bandwidth_s)
    sixteen = collective_cost("all_reduce", 1e9, dp_group, HW, algorithm="ring",
                              concurrent_flows=16)
    assert sixteen.bandwidth_s == pytest.approx(2 * one.bandwidth_s)
    # four NICs for eight GPUs: two neighbouring GPUs share one
    four = HW.with_nics_per_node(4)
    assert collective_cost("all_reduce", 1e9, dp_group, four, algorithm="ring",
                           concurrent_flows=8).bandwidth_s == pytest.approx(2 * one.bandwidth_s)


def test_fat_tree_spine_hops_and_oversubscription():
    far = tuple(range(8)) + tuple(range(160, 168))  # nodes 0 and 20: different leaf switches
    near = cost_near = collective_cost("all_reduce", N, P2, HW, algorithm="ring")
    cost_far = collective_cost("all_reduce", N, far, HW, algorithm="ring")
    extra_hops = 2 * 0.13e-6  # leaf -> spine -> leaf
    assert cost_far.latency_s == pytest.approx(near.latency_s + 2 * extra_hops)
    assert cost_far.bandwidth_s == pytest.approx(cost_near.bandwidth_s)
    thin = dataclasses.replace(HW, network=dataclasses.replace(HW.network, oversubscription=2.0))
    assert collective_cost("all_reduce", N, far, thin, algorithm="ring").bandwidth_s == (
        pytest.approx(2 * cost_far.bandwidth_s))
    assert collective_cost("all_reduce", N, P2, thin, algorithm="ring") == cost_near


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(k for k in SINGLE_NODE if k[0] != "barrier")),
       st.sampled_from([1, 2, 4]), st.integers(0, 1 << 34))
def test_time_grows_with_bytes_and_busbw_stays_below_the_links(case, nodes, nbytes):
    coll, alg = case
    group = tuple(range(8 * nodes))
    t = collective_time_s(coll, nbytes, group, HW, algorithm=alg)
    assert collective_time_s(coll, nbytes + 1e6, group, HW, algorithm=alg) > t >= 0
    if nbytes and alg == "ring":
        bound = 240.0 if nodes == 1 else NODE_GBPS
        assert busbw_gbps(coll, nbytes, t, len(group)) <= bound * (1 + 1e-9)


def test_trivial_cases_cost_nothing_but_a_barrier_costs_its_latency():
    assert collective_cost("all_reduce", N, (5,), HW).time_s == 0.0
    assert collective_cost("barrier", 0, (5,), HW).time_s == 0.0
    zero = collective_cost("all_gather", 0, P2, HW)
    assert zero.time_s == 0.0 and zero.algorithm is Algorithm.LOCAL
    barrier = collective_cost("barrier", 123, P2, HW)  # bytes are ignored; auto: the tree
    assert barrier.collective is Collective.BARRIER and barrier.algorithm is Algorithm.TREE
    assert barrier.time_s == pytest.approx(TWO_NODES["barrier", "tree"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(collective="allreduce"), "unknown collective 'allreduce'"),
    (dict(algorithm="bruck"), "unknown algorithm 'bruck'"),
    (dict(collective="all_gather", algorithm="tree"), "all_gather has no algorithm 'tree'"),
    (dict(group=()), "non-empty"),
    (dict(group=(0, 1, 1)), "repeated"),
    (dict(group=(0, -1)), ">= 0"),
    (dict(nbytes=-1), "nbytes"),
    (dict(concurrent_flows=0), "concurrent_flows"),
])
def test_input_errors(kwargs, match):
    args = dict(collective="all_reduce", nbytes=N, group=P2, hardware=HW) | kwargs
    with pytest.raises(ValueError, match=match):
        collective_cost(**args)
    with pytest.raises(TypeError):
        collective_cost("all_reduce", N, P2, "a100-80gb-dgx")


def test_nccl_tests_bandwidth_helpers():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    for coll in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(coll, 8) == 7 / 8
    for coll in ("broadcast", "reduce", "send", "recv"):
        assert bus_factor(coll, 8) == 1.0
    assert algbw_gbps(8e9, 0.1) == pytest.approx(80.0)
    assert busbw_gbps("all_reduce", 8e9, 0.1, 16) == pytest.approx(80.0 * 2 * 15 / 16)
    # a large single-node ring all-reduce runs at the effective NVLink bandwidth
    cost = collective_cost("all_reduce", 64e9, tuple(range(8)), HW)
    assert cost.busbw_gbps == pytest.approx(240.0, rel=1e-3)
    with pytest.raises(ValueError):
        algbw_gbps(1, 0)


def test_validation_against_published_nccl_busbw():
    rows = validate_nccl()
    _, csv_rows = read_data_csv("nccl_a100.csv")
    assert len(rows) == len(csv_rows) == 5
    assert json.loads(json.dumps(rows)) == rows
    for row, src in zip(rows, csv_rows):
        assert row["metric"] == "busbw_gbps" and row["source"] == src["source"]
        assert row["published"] == float(src["busbw_gbps"])
        assert row["rel_error"] == pytest.approx(row["predicted"] / row["published"] - 1,
                                                 abs=1e-4)
        assert abs(row["rel_error"]) <= NCCL_TOLERANCE, row
        assert row["hardware"].endswith("-4nic") == (src["nics_per_node"] == "4")
    assert "| case |" in format_validation_table(rows)
    # a caller may substitute hardware per system
    system = csv_rows[0]["system"]
    slow = preset("a100-40gb-dgx")
    slow = dataclasses.replace(slow, node=dataclasses.replace(
        slow.node, gpu_link=dataclasses.replace(slow.node.gpu_link, efficiency=0.4)))
    first = validate_nccl({system: slow})[0]
    assert first["predicted"] == pytest.approx(rows[0]["predicted"] / 2, rel=1e-3)


def test_large_groups_are_cheap_to_price():
    group = tuple(range(4096))
    for coll in ("all_reduce", "all_gather", "all_to_all"):
        assert collective_time_s(coll, 1e9, group, HW) > 0
    assert collective_time_s("all_reduce", 1e9, group, HW, algorithm="recursive") > 0
