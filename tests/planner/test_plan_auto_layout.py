"""Op-level ``auto``: every layout of a MatMul / FeedForward ranked by the replayed time of
its traced program (inputs redistributed from their stated layouts)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mesh import Mesh
from sharding import TensorSharding as TS
from tensor_parallel import MatMulSharding
from vcluster.planner.auto_layout import (auto_ffn, auto_layout, auto_matmul, layouts_2d,
                                          rank_ffn_layouts)
from tensor_parallel.ffn_sharding import FeedForwardSharding
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import TRAINING_KERNEL_EFFICIENCY

from tests.localhost_specs import spec as localhost_spec

pytestmark = pytest.mark.timeout(120)

A100 = "a100-80gb-dgx"
MESHES = [((4,), ("tp",)), ((2, 2), ("dp", "tp")), ((2, 4), ("dp", "tp")), ((1, 4), ("dp", "tp"))]


@pytest.mark.parametrize("shape", [(8, 8), (6, 8), (2, 3)])
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_layouts_2d_are_every_even_split(mesh_spec, shape):
    mesh = Mesh(*mesh_spec)
    axes = [a for a in mesh.axes if mesh.shape[a] > 1]
    expect = set()
    for choice in itertools.product((None, 0, 1), repeat=len(axes)):
        dims = [tuple(a for a, c in zip(axes, choice) if c == d) for d in (0, 1)]
        parts = [int(np.prod([mesh.shape[a] for a in ax])) for ax in dims]
        if shape[0] % parts[0] == 0 and shape[1] % parts[1] == 0:
            expect.add(TS(*(ax or None for ax in dims)))
    got = layouts_2d(mesh, shape)
    assert len(got) == len(set(got)) and set(got) == expect


@pytest.mark.parametrize("mesh_spec", MESHES[:3])
def test_matmul_auto_ranks_every_layout_pair(mesh_spec):
    mesh = Mesh(*mesh_spec)
    a_shape, b_shape = (256, 128), (128, 512)
    best, df = auto_matmul(mesh, a_shape, b_shape, hardware=A100)
    n = len(layouts_2d(mesh, a_shape)) * len(layouts_2d(mesh, b_shape))
    assert len(df) == n and df["predicted_s"].is_monotonic_increasing
    assert best == df["sharding"][0] and all(s.c == TS(None, None) for s in df["sharding"])
    # the replicated layout's time is the whole GEMM on one device: no communication
    row = df[[s.a == TS(None, None) and s.b == TS(None, None) for s in df["sharding"]]].iloc[0]
    device = load_hardware(A100).device
    assert row["predicted_s"] == pytest.approx(
        device.matmul_time_s(256, 128, 512, "fp32") / TRAINING_KERNEL_EFFICIENCY, rel=1e-9)
    assert row["flops_per_device"] == 2 * 256 * 128 * 512 and row["bytes_per_device"] == 0


@pytest.mark.parametrize("hardware", [A100, "h100-dgx", localhost_spec()])
def test_matmul_auto_picks_the_layout_that_needs_nothing(hardware):
    """Rows already split over tp and C wanted split the same way: A[S(tp), R] @ B[R, R]
    moves nothing and does 1/n of the FLOPs, so it must come first on any hardware."""
    mesh = Mesh((4,), ("tp",))
    rows = TS("tp", None)
    best, df = auto_matmul(mesh, (1024, 512), (512, 256), hardware=hardware,
                                   a_from=rows, c=rows)
    assert best == MatMulSharding(rows, TS(None, None), rows)
    assert df["bytes_per_device"][0] == 0
    assert df["predicted_s"][0] < df["predicted_s"][1]


def test_a_localhost_ranking_measures_the_tracers_rates_once(monkeypatch):
    """Ranking layouts on a host-timed localhost model measures the tracer's rates once
    for all candidates (HOST_TRACES sets, plus the model's own), not before each (~1 s
    apiece: a 2 x 4 mesh has 81 candidates). The real measurement runs, counted."""
    import vcluster.localhost.cost_model as localhost
    import vcluster.localhost.host_work as localhost_host
    from vcluster.localhost.host_work import HOST_TRACES
    from vcluster.planner.auto_layout import rank_matmul_layouts
    from tests.localhost_specs import HOST_RATES
    calls, measure = [], localhost_host.measure_tracer_rates

    def counted():
        calls.append(1)
        return measure()
    for module in (localhost, localhost_host):
        monkeypatch.setattr(module, "measure_tracer_rates", counted)
    df = rank_matmul_layouts(Mesh((2,), ("tp",)), (64, 32), (32, 16),
                             hardware=localhost_spec(**HOST_RATES), dtype="float64")
    assert len(df) > 3 and df["predicted_s"].is_monotonic_increasing
    assert len(calls) == 1 + HOST_TRACES


def test_matmul_auto_splits_big_products_on_a_cluster():
    """A 8192^3 product on 8 A100s: compute dominates, so the best layout splits the FLOPs
    eightfold (whatever collective closes it)."""
    mesh = Mesh((2, 4), ("dp", "tp"))
    best, df = auto_matmul(mesh, (8192, 8192), (8192, 8192), hardware=A100,
                                   dtype="float16")
    assert df["flops_per_device"][0] == 2 * 8192 ** 3 // 8
    unsharded = df[df["policy"] == "Unsharded"]["predicted_s"].min()
    assert df["predicted_s"][0] < unsharded / 4


def test_ffn_auto_covers_every_policy_and_axis_assignment():
    mesh = Mesh((2, 2), ("dp", "tp"))
    best, df = auto_ffn(mesh, (4, 64, 128), 512, hardware=A100, backward=True)
    # roles of 2 axes: 3^2; Unsharded where no axis is tp (4), Megatron and
    # SequenceParallel where one is (5 each), GSPMD where one is tp and one dp (2)
    assert len(df) == 16 and df["predicted_s"].is_monotonic_increasing
    assert sorted(df["policy"].value_counts().items()) == [
        ("GSPMD", 2), ("Megatron", 5), ("SequenceParallel", 5), ("Unsharded", 4)]
    assert best == df["sharding"][0]


def test_ffn_auto_skips_layouts_that_do_not_split():
    mesh = Mesh((2, 2), ("dp", "tp"))
    df = rank_ffn_layouts(mesh, (1, 3, 128), 512, hardware=A100)   # batch 1, seq 3
    assert not any(s.dp for s in df["sharding"])                   # batch cannot split
    assert not any(s.policy.name == "SequenceParallel" for s in df["sharding"])


def test_auto_layout_entry_point():
    mesh = Mesh((2,), ("tp",))
    best, df = auto_layout("matmul", mesh, {"a": (64, 64), "b": (64, 64)}, A100)
    assert isinstance(best, MatMulSharding) and len(df) == 9
    best, df = auto_layout("ffn", mesh, {"x": (2, 8, 16), "d_ff": 64}, A100)
    assert isinstance(best, FeedForwardSharding)
    with pytest.raises(ValueError, match="op must be 'matmul' or 'ffn', got 'conv'"):
        auto_layout("conv", mesh, {}, A100)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        auto_matmul(mesh, (4, 5), (6, 4), hardware=A100)
