"""Redistribution: plans are the cheapest single-axis step sequences, and executing them
on the emulator turns shard(x, src) into shard(x, dst) exactly."""

import itertools
import random

import numpy as np
import pytest

from mesh import Mesh
from sharding import (MESSAGE_ALGORITHMS, TensorSharding as TS, plan_redistribute,
                      redistribute, shard, unshard)
from vcluster import VirtualCluster

pytestmark = pytest.mark.timeout(300)


def _all_layouts(mesh, ndim):
    """Every TensorSharding of an ndim tensor on mesh (axes in every order)."""
    axes = mesh.axes
    out = []
    for places in itertools.product(range(ndim + 2), repeat=len(axes)):
        # place: 0..ndim-1 = split that dim, ndim = partial, ndim+1 = unused
        groups = {d: [a for a, p in zip(axes, places) if p == d] for d in range(ndim + 1)}
        for orders in itertools.product(*(itertools.permutations(groups[d])
                                          for d in range(ndim))):
            out.append(TS(*[tuple(o) or None for o in orders], partial=tuple(groups[ndim])))
    return out


@pytest.mark.parametrize("src, dst, expected", [
    (TS("tp", None), TS(None, None), "[S(tp), R] -> [R, R]: all_gather(tp, dim=0)"),
    (TS(None, None, partial="tp"), TS(None, None), "[R, R] P(tp) -> [R, R]: all_reduce(tp)"),
    (TS(None, None, partial="tp"), TS(None, "tp"),
     "[R, R] P(tp) -> [R, S(tp)]: reduce_scatter(tp, dim=1)"),
    (TS(None, None), TS("tp", None), "[R, R] -> [S(tp), R]: slice(tp, dim=0)"),
    (TS("tp", None), TS(None, "tp"), "[S(tp), R] -> [R, S(tp)]: all_to_all(tp, 0->1)"),
    (TS(None, None), TS(None, None, partial="dp"), "[R, R] -> [R, R] P(dp): partial(dp)"),
    (TS("dp", "tp"), TS("dp", "tp"), "[S(dp), S(tp)] -> [S(dp), S(tp)]: no communication"),
    (TS(("dp", "tp"), None), TS("dp", None), "[S(dp,tp), R] -> [S(dp), R]: all_gather(tp, dim=0)"),
])
def test_basic_plans(src, dst, expected):
    mesh = Mesh((2, 4), ("dp", "tp"))
    assert str(plan_redistribute(src, dst, mesh, (8, 8))) == expected


def test_plan_is_never_costlier_than_gather_then_slice():
    """Any layout change can be done by gathering/reducing everything then slicing;
    the planner's plan never costs more than that."""
    mesh = Mesh((2, 2, 2), ("a", "b", "c"))
    shape, itemsize = (8, 8), 8
    layouts = _all_layouts(mesh, 2)
    rng = random.Random(0)
    for src, dst in (rng.sample(layouts, 2) for _ in range(300)):
        plan = plan_redistribute(src, dst, mesh, shape, itemsize)
        via = plan_redistribute(src, TS(None, None), mesh, shape, itemsize).bytes_per_device
        via += plan_redistribute(TS(None, None), dst, mesh, shape, itemsize).bytes_per_device
        assert plan.bytes_per_device <= via + 1e-9, str(plan)


def test_uneven_layout_is_rejected_with_the_dimension():
    mesh = Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match="dst layout .*dimension 1 of size 6 does not split "
                                         "evenly into 4 shards"):
        plan_redistribute(TS(None, None), TS(None, "tp"), mesh, (8, 6))


def _execute_all(dev, cases):
    return [redistribute(dev, x, plan, algorithms) for x, plan, algorithms in cases]


@pytest.mark.parametrize("shape, axes, tensor_shape", [
    ((2, 4), ("dp", "tp"), (8, 16)),
    ((4, 2), ("dp", "tp"), (8, 4)),
    ((2, 2, 2), ("a", "b", "c"), (4, 8)),
    ((8,), ("x",), (16, 8)),
    ((2, 2, 2), ("a", "b", "c"), (4, 4, 8)),
])
def test_execution_matches_shard_of_the_target(shape, axes, tensor_shape):
    mesh = Mesh(shape, axes)
    rng = np.random.default_rng(1)
    x = rng.integers(-1000, 1000, size=tensor_shape).astype(np.int64)
    layouts = [s for s in _all_layouts(mesh, len(tensor_shape))
               if all(n % mesh.axis_size(d.axes) == 0 for n, d in zip(tensor_shape, s.dims))]
    all_pairs = list(itertools.product(layouts, layouts))
    pairs = random.Random(len(layouts)).sample(all_pairs, min(60, len(all_pairs)))
    plans = [plan_redistribute(a, b, mesh, tensor_shape) for a, b in pairs]
    per_rank = [[] for _ in range(mesh.size)]
    for (src, _), plan in zip(pairs, plans):
        for r, local in enumerate(shard(x, src, mesh)):
            per_rank[r].append((local, plan, None))
    with VirtualCluster(mesh, timeout_s=30) as cluster:
        out = cluster.run(_execute_all, [(cases,) for cases in per_rank])
    for i, ((_, dst), plan) in enumerate(zip(pairs, plans)):
        locals_ = [out[r][i] for r in range(mesh.size)]
        expected = shard(x, dst, mesh)
        for r in range(mesh.size):
            assert locals_[r].shape == expected[r].shape, str(plan)
        np.testing.assert_array_equal(unshard(locals_, dst, mesh), x, err_msg=str(plan))


def test_bytes_sent_equal_the_plan_with_message_algorithms():
    mesh = Mesh((2, 4), ("dp", "tp"))
    shape = (16, 32)
    x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    cases = [(TS(("dp", "tp"), None), TS(None, ("tp", "dp"))),
             (TS(None, None, partial=("dp", "tp")), TS("tp", "dp")),
             (TS("tp", None, partial="dp"), TS(None, None))]
    with VirtualCluster(mesh, timeout_s=30) as cluster:
        for src, dst in cases:
            plan = plan_redistribute(src, dst, mesh, shape, itemsize=8)
            cluster.reset_stats()
            out = cluster.run(_execute_all, [([(loc, plan, MESSAGE_ALGORITHMS)],)
                                             for loc in shard(x, src, mesh)])
            np.testing.assert_array_equal(unshard([o[0] for o in out], dst, mesh), x)
            sent = cluster.stats()["bytes_sent"].tolist()
            assert sent == [plan.bytes_per_device] * mesh.size, str(plan)
