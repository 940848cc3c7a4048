"""Gradients in one buffer, buckets summed in place (issue 32, fewer copies).

``StageLayers.place_grads`` lays a stage's gradients back to back in device memory in the
order W completes them; a data-parallel bucket is then a view of that memory
(``adjacent_span``), all-reduced in place: no packing into a bucket, no write-back. The
sums must equal the packed path's, and each W must write (first micro-batch of a step)
or add (the others) — ``zero_grads`` no longer writes zeros.
"""

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.executor import GradBuckets, adjacent_span
from pipeline_parallel.layers import LayerSpec, StageLayers


def _layers(sizes, seed=0):
    rng = np.random.default_rng(seed)
    specs = [LayerSpec(i, sizes[i], sizes[i + 1], "dense", "relu" if i < len(sizes) - 2 else None)
             for i in range(len(sizes) - 1)]
    params = [(rng.standard_normal((a, b)), rng.standard_normal(b))
              for a, b in zip(sizes, sizes[1:])]
    return StageLayers(specs, params)


def test_adjacent_span_finds_back_to_back_views_only():
    buf = np.arange(20.0)
    a, b, c = buf[2:8].reshape(2, 3), buf[8:12], buf[12:20].reshape(4, 2)
    span = adjacent_span([a, b, c])
    assert span is not None and np.shares_memory(span, buf)
    np.testing.assert_array_equal(span, np.arange(2.0, 20.0))
    assert adjacent_span([b, a]) is None                       # out of order
    assert adjacent_span([a, c]) is None                       # a gap
    assert adjacent_span([a, b.astype(np.float32)]) is None    # another buffer and dtype
    assert adjacent_span([buf[::2][:3], buf[6:8]]) is None     # not contiguous
    assert adjacent_span([np.ones(3), np.ones(3)]) is None     # separate arrays


def test_place_grads_keeps_values_in_completion_order():
    layers = _layers([5, 4, 3, 2])
    for l, (gw, gb) in enumerate(layers.grads):
        gw[...], gb[...] = l + 1, -(l + 1)
    before = [[gw.copy(), gb.copy()] for gw, gb in layers.grads]
    buffer = layers.place_grads(lambda shape, dtype: np.empty(shape, dtype))
    assert buffer.size == sum(g.size for pair in before for g in pair)
    for (gw, gb), (w0, b0) in zip(layers.grads, before):
        np.testing.assert_array_equal(gw, w0)
        np.testing.assert_array_equal(gb, b0)
        assert np.shares_memory(gw, buffer) and np.shares_memory(gb, buffer)
    last_first = [g for l in (2, 1, 0) for g in layers.grads[l]]
    span = adjacent_span(last_first)
    assert span is not None and span.size == buffer.size
    assert adjacent_span(layers.grads[1] + layers.grads[0]) is not None   # one bucket's run
    assert layers.place_grads(lambda shape, dtype: None) is None          # no memory: kept


def test_zero_grads_then_w_writes_and_later_ws_add(cluster_of):
    """dW after three micro-batches equals the sum of their x^T dz, whatever the gradient
    buffers held before zero_grads (garbage, not zeros)."""
    cluster = cluster_of(Mesh((1,), ("dp",)))

    def prog(dev):
        layers = _layers([6, 5, 4], seed=3)
        for gw, gb in layers.grads:
            gw[...], gb[...] = 1e6, 1e6                         # stale values
        rng = np.random.default_rng(4)
        xs = [rng.standard_normal((7, 6)) for _ in range(3)]
        want_w = [np.zeros((6, 5)), np.zeros((5, 4))]
        want_b = [np.zeros(5), np.zeros(4)]
        layers.zero_grads()
        for j, x in enumerate(xs):
            out = layers.forward(dev, j, x)
            dy = np.ones_like(out)
            layers.backward_input(dev, j, dy, need_input_grad=False)
            saved = [(xx.copy(), dz.copy()) for (xx, _), dz in
                     zip(layers._saved[j], layers._dz[j])]
            layers.backward_weight(dev, j)
            for l, (xx, dz) in enumerate(saved):
                want_w[l] += xx.T @ dz
                want_b[l] += dz.sum(axis=0)
        return max(max(np.abs(gw - w).max(), np.abs(gb - b).max())
                   for (gw, gb), w, b in zip(layers.grads, want_w, want_b))

    assert cluster.run(prog) == [pytest.approx(0.0, abs=1e-12)]


def _ranked_grads(dev, placed: bool) -> StageLayers:
    """Three layers whose gradients hold rank + l (W) and 10 rank - l (b): summed over 3
    ranks, 3 + 3l and 30 - 3l. In one buffer of device memory when ``placed``."""
    layers = _layers([40, 30, 20, 10], seed=0)
    if placed:
        layers.place_grads(dev.empty)
    for l, (gw, gb) in enumerate(layers.grads):
        gw[...], gb[...] = dev.rank + l, 10 * dev.rank - l
    return layers


@pytest.mark.parametrize("placed", [True, False])
def test_buckets_sum_in_place_or_packed_alike(cluster_of, placed):
    cluster = cluster_of(Mesh((3,), ("dp",)))

    def prog(dev):
        layers = _ranked_grads(dev, placed)
        kept = [g for pair in layers.grads for g in pair]
        buckets = GradBuckets(dev, "dp", bucket_bytes=30 * 20 * 8)   # two layers, then one
        for l in (2, 1, 0):
            buckets.add(layers.grads[l])
        in_place = [arrays is None for _, arrays in buckets._launched]
        buckets.finish()
        assert all(a is b for a, b in zip(kept, [g for pair in layers.grads for g in pair]))
        return in_place, [(float(gw.mean()), float(gb.mean())) for gw, gb in layers.grads]

    for in_place, sums in cluster.run(prog):
        assert in_place == ([True, True] if placed else [False, False])
        assert sums == [(3 + 3 * l, 30 - 3 * l) for l in range(3)]


@pytest.mark.parametrize("placed", [True, False])
def test_what_is_left_at_finish_is_all_reduced_in_the_programs_thread(placed):
    """A bucket that never filled is waited for as soon as it starts, so ``finish`` runs
    it as a blocking all-reduce: same sums, and no communication thread is started for
    it (a fresh cluster: none ran before)."""
    import threading

    from vcluster import VirtualCluster

    def prog(dev):
        layers = _ranked_grads(dev, placed)
        buckets = GradBuckets(dev, "dp", bucket_bytes=1 << 30)     # never full
        for l in (2, 1, 0):
            buckets.add(layers.grads[l])
        assert buckets._launched == []
        buckets.finish()
        comm = [t.name for t in threading.enumerate() if t.name.startswith("vcluster-comm")]
        return comm, [(float(gw.mean()), float(gb.mean())) for gw, gb in layers.grads]

    with VirtualCluster(Mesh((3,), ("dp",)), timeout_s=30.0) as cluster:
        for comm, sums in cluster.run(prog):
            assert comm == []
            assert sums == [(3 + 3 * l, 30 - 3 * l) for l in range(3)]


@pytest.mark.parametrize("microbatches, algorithm", [(1, None), (3, None), (4, None),
                                                     (6, None), (3, "ring"), (3, "tree")])
def test_mlp_on_dp_x_pp_equals_the_reference(cluster_of, microbatches, algorithm):
    """The in-place buckets and written-then-added gradients, through fit, against the
    one-process reference: fewer, as many and more micro-batches than the 2 stages, and
    the buckets summed in place by each all-reduce algorithm."""
    cluster = cluster_of(Mesh((2, 2), ("dp", "pp")), algorithm)
    sizes = [8, 16, 12, 16, 4]
    mlp = MLP(sizes, seed=2)
    rng = np.random.default_rng(5)
    X, Y = rng.standard_normal((24, 8)), rng.standard_normal((24, 4))
    run = mlp.fit(cluster, X, Y, steps=3, microbatches=microbatches, schedule="1f1b",
                  optimizer="adam", lr=0.01)
    ref = mlp.fit_reference(X, Y, steps=3, optimizer="adam", lr=0.01)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-10)
    for (w, b), (rw, rb) in zip(run.params, ref.params):
        np.testing.assert_allclose(w, rw, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(b, rb, rtol=1e-9, atol=1e-12)
