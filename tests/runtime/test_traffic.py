"""The traffic model predicts the emulator's recorded traffic exactly, event for event."""

import numpy as np
import pytest

from mesh import Mesh
from vcluster import ALGORITHMS, CommEvent, VirtualCluster
from vcluster.runtime.traffic import binomial_children, binomial_parent, collective_traffic

pytestmark = pytest.mark.timeout(180)

# element counts: inline (<= 512 B), large, and not divisible by the group size (ring)
SIZES = (2, 24, 7000, 12001)


def _program(dev, axis, cases):
    """Run every (collective, algorithm, count, root) case; return nothing."""
    n = len(dev.mesh.group(dev.mesh.axis_tuple(axis), dev.rank))
    pos = dev.mesh.group_position(dev.mesh.axis_tuple(axis), dev.rank)
    for collective, algorithm, count, root in cases:
        x = np.arange(count * n, dtype=np.float64) + dev.rank
        if collective in ("all_gather", "gather"):
            x = x[:count]
        kw = {"algorithm": algorithm}
        if collective in ("broadcast", "scatter", "gather", "reduce"):
            kw["root"] = root
        if collective in ("broadcast", "scatter") and pos != root:
            x = None
        getattr(dev, collective)(x, axis, **kw)


def _cases(n):
    cases = []
    for collective, algorithms in ALGORITHMS.items():
        if collective == "barrier":
            continue
        for algorithm in algorithms:
            for count in SIZES:
                if algorithm != "ring" and count == 12001:
                    continue
                root = (n - 1) if collective in ("broadcast", "scatter", "gather", "reduce") else 0
                cases.append((collective, algorithm, count, root))
    return cases


@pytest.mark.parametrize("shape, axes, axis", [
    ((3,), ("x",), "x"),
    ((4,), ("x",), "x"),
    ((2, 4), ("dp", "tp"), "tp"),
    ((2, 4), ("dp", "tp"), ("tp", "dp")),
    ((5,), ("x",), None),
])
def test_emulator_traffic_equals_model(shape, axes, axis):
    mesh = Mesh(shape, axes)
    axis_tuple = mesh.axis_tuple(axis)
    n = mesh.axis_size(axis_tuple)
    cases = _cases(n)
    with VirtualCluster(mesh, timeout_s=20) as cluster:
        cluster.run(_program, [(axis, cases)] * mesh.size)
        events = [e for e in cluster.trace() if isinstance(e, CommEvent)]
    by_rank = {r: [e for e in events if e.rank == r] for r in range(mesh.size)}
    for rank, evs in by_rank.items():
        assert len(evs) == len(cases)
        evs.sort(key=lambda e: e.start)
        members = mesh.group(axis_tuple, rank)
        pos = members.index(rank)
        for ev, (collective, algorithm, count, root) in zip(evs, cases):
            assert (ev.collective, ev.algorithm) == (collective, algorithm)
            total = count * n
            nbytes = 8 * (count if collective in ("all_gather", "gather") else total)
            model = collective_traffic(collective, algorithm, members, pos, nbytes, 8, root)
            assert ev.sent == model.sent, (rank, collective, algorithm, count)
            assert ev.received == model.received, (rank, collective, algorithm, count)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_binomial_tree_is_a_spanning_tree(n):
    for rel in range(1, n):
        p = binomial_parent(rel)
        assert 0 <= p < rel and rel in binomial_children(p, n)
    assert sorted(c for r in range(n) for c in binomial_children(r, n)) == list(range(1, n))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_closed_forms(n):
    """Ring totals per device: all_reduce 2(n-1)/n|x|, all_gather (n-1)|x|,
    reduce_scatter (n-1)/n|x|; pairwise all_to_all (n-1)/n|x|."""
    members = tuple(range(n))
    x = 8 * n * 1000
    for pos in range(n):
        assert collective_traffic("all_reduce", "ring", members, pos, x, 8).bytes_sent \
            == 2 * (n - 1) * x // n
        assert collective_traffic("all_gather", "ring", members, pos, x, 8).bytes_sent \
            == (n - 1) * x
        assert collective_traffic("reduce_scatter", "ring", members, pos, x, 8).bytes_sent \
            == (n - 1) * x // n
        assert collective_traffic("all_to_all", "pairwise", members, pos, x, 8).bytes_sent \
            == (n - 1) * x // n
