"""The small-message (inline) path of the shm collectives (issue 30).

* ``reduce_rows`` (one ``ufunc.accumulate``) equals ``reduce_into``'s group-order fold bit
  for bit, over dtypes, ops, group sizes and element counts, on strided rows like the
  descriptor snapshot's — including shapes where ``ufunc.reduce`` would sum pairwise;
* an inline collective wakes its peers once (phase 1), a large one twice (phases 1, 2);
* inline calls interleaved with message-algorithm and large calls on the same group, in
  both sync and async order, give the reference results (the skipped publish waits and
  phase-2 wakes never let a descriptor be rewritten while it is read);
* the recorded events of inline calls still hold sorted (peer, bytes, messages) pairs.
"""

import numpy as np
import pytest

from mesh import Mesh
from vcluster.runtime.collectives.common import ReduceOp, reduce_into, reduce_rows
from vcluster.runtime.layout import D

OPS = {"float32": ("sum", "prod", "max", "min", "avg"), "float64": ("sum", "avg", "max"),
       "float16": ("sum", "prod", "avg"), "int8": ("sum", "prod", "max"),
       "int64": ("sum", "min"), "bool": ("sum", "prod", "max")}


def _descriptor_rows(values: np.ndarray) -> np.ndarray:
    """``values`` (n, k) as the strided (n, k) view a descriptor snapshot gives."""
    n, k = values.shape
    words = np.zeros((n, D.WORDS), np.int64)
    rows = words[:, D.INLINE:].view(np.uint8)[:, :k * values.itemsize].view(values.dtype)
    rows[...] = values
    return rows


def _values(rng, dtype: str, n: int, k: int) -> np.ndarray:
    if dtype == "bool":
        return rng.random((n, k)) < 0.5
    if dtype.startswith("int"):
        return rng.integers(-9, 10, (n, k)).astype(dtype)
    decades = 2 if dtype == "float16" else 6      # float16 overflows past 65504
    wide = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-decades, decades, (n, k))
    return wide.astype(dtype)


@pytest.mark.parametrize("dtype", sorted(OPS))
@pytest.mark.parametrize("n", [2, 3, 8, 16, 65])
@pytest.mark.parametrize("k", [1, 2, 33])
def test_reduce_rows_is_the_group_order_fold(dtype, n, k):
    rng = np.random.default_rng(n * 100 + k)
    rows = _descriptor_rows(_values(rng, dtype, n, k))
    for name in OPS[dtype]:
        op = ReduceOp(name)
        want = np.empty(k, rows.dtype)
        with np.errstate(all="ignore"):
            reduce_into([want], list(rows), op, n)
            got = np.empty(k, rows.dtype)
            assert reduce_rows(got, rows, op, n) is got
        assert got.tobytes() == want.tobytes(), (dtype, name, n, k, got, want)


def test_reduce_rows_fold_differs_from_pairwise_reduce():
    """The case the fold guards against: numpy's pairwise sum of 16 float32 values."""
    rows = _descriptor_rows(_values(np.random.default_rng(2), "float32", 16, 1))
    got = np.empty(1, np.float32)
    assert reduce_rows(got, rows, ReduceOp.SUM, 16) is got
    assert got.tobytes() != np.add.reduce(rows, axis=0).tobytes()


def test_reduce_rows_leaves_complex_to_the_fold():
    rows = _descriptor_rows(np.ones((3, 2), np.complex64))
    got = np.zeros(2, np.complex64)
    assert reduce_rows(got, rows, ReduceOp.PROD, 3) is None
    assert (got == 0).all()


class _CountingWaker:
    """Wraps a device's futex waker and counts its wake-ups."""

    def __init__(self, inner):
        self.inner, self.kind, self.wakes = inner, inner.kind, 0

    def sleep(self, address, value, timeout_s):
        self.inner.sleep(address, value, timeout_s)

    def wake(self, address):
        self.wakes += 1
        self.inner.wake(address)


def _count_wakes(dev, calls: int):
    f = dev._f
    real, f.waker = f.waker, _CountingWaker(f.waker)
    try:
        small = np.full(2, dev.rank, np.float32)
        big = np.full(1024, dev.rank, np.float32)          # 4 KiB: not inline
        start = f.waker.wakes
        for _ in range(calls):
            dev.all_reduce(small)
        inline = f.waker.wakes - start
        start = f.waker.wakes
        for _ in range(calls):
            dev.barrier()
        barrier = f.waker.wakes - start
        start = f.waker.wakes
        for _ in range(calls):
            total = dev.all_reduce(big)
        large = f.waker.wakes - start
        return inline, barrier, large, float(total[0])
    finally:
        f.waker = real


def test_inline_calls_wake_peers_once(cluster_of):
    mesh = Mesh((4,), ("x",))
    calls = 20
    for inline, barrier, large, total in cluster_of(mesh).run(_count_wakes,
                                                              [(calls,)] * mesh.size):
        assert (inline, barrier, large) == (calls, calls, 2 * calls)
        assert total == sum(range(mesh.size))


def _mixed(dev, steps: int, async_op: bool):
    """Inline shm calls between tree broadcasts, ring all-reduces and large shm calls on
    one group: what every rank got back, in order."""
    got = []
    for i in range(steps):
        small = np.array([dev.rank + i, 1.5], np.float64)
        kinds = i % 4
        if kinds == 0:
            w = dev.broadcast(small if dev.rank == 1 else None, root=1,
                              algorithm="tree", async_op=async_op)
        elif kinds == 1:
            w = dev.all_reduce(np.full(300, float(dev.rank + i)), algorithm="ring",
                               async_op=async_op)
        elif kinds == 2:
            w = dev.all_reduce(np.full(200, float(dev.rank * i)), async_op=async_op)
        else:
            w = dev.all_gather(small, async_op=async_op)
        x = w.wait() if async_op else w
        got.append(np.asarray(x).copy())
        got.append(dev.all_reduce(small, op="max"))
        got.append(dev.reduce(small, root=i % dev.mesh.size))
    return got


def _mixed_reference(n: int, steps: int) -> list:
    want = []
    for i in range(steps):
        kinds = i % 4
        if kinds == 0:
            x = np.array([1 + i, 1.5])
        elif kinds == 1:
            x = np.full(300, float(sum(r + i for r in range(n))))
        elif kinds == 2:
            x = np.full(200, float(sum(r * i for r in range(n))))
        else:
            x = np.concatenate([np.array([r + i, 1.5]) for r in range(n)])
        want.append([x] * n)
        want.append([np.array([n - 1 + i, 1.5])] * n)
        red = np.array([float(sum(r + i for r in range(n))), 1.5 * n])
        want.append([red if r == i % n else None for r in range(n)])
    return want


@pytest.mark.parametrize("async_op", [False, True])
def test_inline_calls_between_other_algorithms(cluster_of, async_op):
    mesh = Mesh((5,), ("x",))
    steps = 24
    results = cluster_of(mesh).run(_mixed, [(steps, async_op)] * mesh.size)
    want = _mixed_reference(mesh.size, steps)
    for call, per_rank in enumerate(want):
        for rank, w in enumerate(per_rank):
            got = results[rank][call]
            if w is None:
                assert got is None, (call, rank)
            else:
                np.testing.assert_array_equal(got, w, err_msg=f"call {call}, rank {rank}")


def _inline_events(dev):
    dev.all_reduce(np.ones(3, np.float32))
    dev.barrier()


def test_inline_events_hold_sorted_peer_pairs(cluster_of):
    mesh = Mesh((4,), ("x",))
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    cluster.run(_inline_events)
    events = [e for e in cluster.trace() if e.collective in ("all_reduce", "barrier")]
    assert len(events) == 2 * mesh.size
    for e in events:
        assert e.algorithm == "shm" and e.sent == ()
        if e.collective == "all_reduce":
            assert e.received == tuple((p, 12, 1) for p in range(mesh.size) if p != e.rank)
            assert e.nbytes == 12
        else:
            assert e.received == ()
