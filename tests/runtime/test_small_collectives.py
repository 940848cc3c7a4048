"""The small-message (inline) path of the shm collectives (issue 30).

* ``reduce_rows`` (one ``ufunc.accumulate``) equals ``reduce_into``'s group-order fold bit
  for bit, over dtypes, ops, group sizes and element counts, on strided rows like the
  descriptor snapshot's — including shapes where ``ufunc.reduce`` would sum pairwise;
* an inline collective wakes its peers once (phase 1), a large one twice (phases 1, 2);
* inline calls interleaved with message-algorithm and large calls on the same group, in
  both sync and async order, give the reference results (the skipped publish waits and
  phase-2 wakes never let a descriptor be rewritten while it is read);
* the recorded events of inline calls still hold sorted (peer, bytes, messages) pairs;
* a call site's plan (``collectives.inline``) is built once: repeated inline all_reduces
  and barriers build no ``GroupCall``; its results equal the group-order fold on evenly
  and unevenly spaced groups, for every op, ``out=``, 0-d and strided inputs; a member
  that differs is named with the general path's words.
"""

import numpy as np
import pytest

from mesh import Mesh
from vcluster import DeviceProgramError
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


def _count_group_calls(dev, calls: int):
    """GroupCalls built by ``calls`` inline all_reduces, barriers and large all_reduces."""
    from vcluster.runtime.collectives import common
    built = [0]
    real = common.GroupCall.__init__

    def counting(self, *args, **kwargs):
        built[0] += 1
        real(self, *args, **kwargs)

    common.GroupCall.__init__ = counting
    try:
        counts = []
        for x in (np.full(2, dev.rank, np.float32), None, np.ones(1024, np.float32)):
            start = built[0]
            for _ in range(calls):
                dev.barrier() if x is None else dev.all_reduce(x)
            counts.append(built[0] - start)
        return tuple(counts)
    finally:
        common.GroupCall.__init__ = real


def test_a_call_site_builds_its_plan_once(cluster_of):
    mesh = Mesh((4,), ("x",))
    for inline, barrier, large in cluster_of(mesh).run(_count_group_calls, [(10,)] * 4):
        assert (inline, barrier, large) == (0, 0, 10)


def _mixed_paths(dev):
    """Call 1 publishes output words (a large all_reduce); call 3, on the same parity,
    is inline, by the general path on rank 0 (asynchronous) and by plans elsewhere:
    GroupCalls the plans built for call 3, and its result."""
    from vcluster.runtime.collectives import common
    built = [0]
    real = common.GroupCall.__init__

    def counting(self, *args, **kwargs):
        built[0] += 1
        real(self, *args, **kwargs)

    x = np.full(3, dev.rank + 1.0)
    dev.all_reduce(np.ones(1024))                          # call 1: out= words published
    dev.all_reduce(x)                                      # call 2
    common.GroupCall.__init__ = counting
    try:
        if dev.rank == 0:
            res = dev.all_reduce(x, async_op=True).wait()  # call 3: the general path
            return None, res
        res = dev.all_reduce(x)
        return built[0], res
    finally:
        common.GroupCall.__init__ = real


def test_general_and_plan_paths_write_the_same_header(cluster_of):
    """The general publish writes the output words (-1, 0) when it has no output, so a
    plan sees identical headers from a member on the general path: no fallback to the
    general checks (before, the words of call 1 were still there)."""
    for rank, (built, res) in enumerate(cluster_of(Mesh((4,), ("x",))).run(_mixed_paths)):
        assert res.tolist() == [10.0] * 3
        assert built == (None if rank == 0 else 0)


def _plan_results(dev, axes):
    """Inline all_reduces of several signatures on one call site each, twice over (the
    second time through the cached plans), beside barriers."""
    got = []
    r = dev.rank
    for _ in range(2):
        for dtype, op in (("float32", "sum"), ("float64", "avg"), ("int16", "prod"),
                          ("bool", "max"), ("float16", "min")):
            x = (np.arange(6) * (r + 1) % 5 - 2 + 0.37 * r).astype(dtype).reshape(2, 3)
            got.append(dev.all_reduce(x, axes, op=op))
            got.append(dev.all_reduce(x[:, ::2], axes, op=op))         # strided input
            dev.barrier(axes)
        out = np.zeros((2,), np.float64)
        assert dev.all_reduce(np.array([r, 1.0 / (r + 3)]), axes, out=out) is out
        got.append(out.copy())
        got.append(dev.all_reduce(np.float32(r + 0.5) * np.ones(()), axes))   # 0-d
    return got


def _fold(xs: list[np.ndarray], op: str, n: int) -> np.ndarray:
    want = np.empty(xs[0].size, xs[0].dtype)
    reduce_into([want], [np.ascontiguousarray(x).reshape(-1) for x in xs], ReduceOp(op), n)
    return want.reshape(xs[0].shape)


@pytest.mark.parametrize("shape,names,axes", [
    ((4,), ("x",), "x"),                        # members evenly spaced, step 1
    ((2, 3), ("a", "b"), "a"),                  # step 3
    ((2, 2, 2), ("a", "b", "c"), ("a", "c")),   # (0, 1, 4, 5): gathered per call
])
def test_plans_give_the_group_order_fold(cluster_of, shape, names, axes):
    mesh = Mesh(shape, names)
    results = cluster_of(mesh).run(_plan_results, [(axes,)] * mesh.size)
    for rank in range(mesh.size):
        members = mesh.group(mesh.axis_tuple(axes), rank)
        n = len(members)
        k = 0
        for _ in range(2):
            for dtype, op in (("float32", "sum"), ("float64", "avg"), ("int16", "prod"),
                              ("bool", "max"), ("float16", "min")):
                xs = [(np.arange(6) * (m + 1) % 5 - 2 + 0.37 * m).astype(dtype).reshape(2, 3)
                      for m in members]
                for want in (_fold(xs, op, n), _fold([x[:, ::2] for x in xs], op, n)):
                    got = results[rank][k]
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert got.tobytes() == want.tobytes(), (rank, k, dtype, op)
                    k += 1
            want = _fold([np.array([m, 1.0 / (m + 3)]) for m in members], "sum", n)
            assert results[rank][k].tobytes() == want.tobytes()
            want = _fold([np.float32(m + 0.5) * np.ones(()) for m in members], "sum", n)
            assert results[rank][k + 1].shape == () and results[rank][k + 1] == want
            k += 2


def _differ(dev, what: str):
    x = np.ones(2, np.float32)
    for _ in range(3):
        dev.all_reduce(x)                      # the plan is built and used first
    if dev.rank == 2 and what != "none":
        if what == "shape":
            return dev.all_reduce(np.ones(3, np.float32))
        if what == "op":
            return dev.all_reduce(x, op="max")
        return dev.barrier()
    return dev.all_reduce(x)


@pytest.mark.parametrize("what,words", [
    ("shape", "has dtype float32, shape (2,), argument 1 but rank 2 has dtype float32, "
              "shape (3,), argument 1"),
    ("op", "argument 1 but rank 2 has dtype float32, shape (2,), argument 3"),
    ("collective", "called all_reduce (call #4 over axes ('x',), group (0, 1, 2, 3)) but "
                   "rank 2 called barrier (call #4) at that point"),
])
def test_a_member_that_differs_is_named(cluster_of, what, words):
    cluster = cluster_of(Mesh((4,), ("x",)))
    with pytest.raises(DeviceProgramError) as info:
        cluster.run(_differ, [(what,)] * 4)
    assert "CollectiveMismatch" in str(info.value) and words in str(info.value)
    assert cluster.run(_differ, [("none",)] * 4)[0].tolist() == [4.0, 4.0]


def _count_splits(dev, calls: int):
    """``np.split`` calls made inside the shm algorithms by inline and large all_to_alls."""
    from vcluster.runtime.collectives import shm
    real, counted = shm.np, [0]

    class _CountingNumpy:
        def __getattr__(self, name):
            return getattr(real, name)

        def split(self, *args, **kwargs):
            counted[0] += 1
            return real.split(*args, **kwargs)

    n = dev.mesh.size
    shm.np = _CountingNumpy()
    try:
        counts, results = [], []
        for per in (2, 1024):                               # 8 B pieces (inline), 4 KiB
            start = counted[0]
            for _ in range(calls):
                x = (np.arange(n * per, dtype=np.float32) + 1000 * dev.rank).reshape(n, per)
                results.append(dev.all_to_all(x, split_dim=0, concat_dim=1))
            counts.append(counted[0] - start)
        return counts, results
    finally:
        shm.np = real


def test_all_to_all_slices_only_its_own_piece(cluster_of):
    """Each member takes its piece of every input by one slice (inline: one indexing of
    all members' inputs at once), not by splitting every member's input n ways: n + 1
    splits per call before, whose cost grew as n^2 per device."""
    mesh = Mesh((8,), ("x",))
    calls = 3
    for rank, (counts, results) in enumerate(cluster_of(mesh).run(_count_splits,
                                                                  [(calls,)] * 8)):
        assert counts == [0, calls]                # the large one splits its result once
        for i, per in enumerate([2] * calls + [1024] * calls):
            want = np.concatenate([(np.arange(8 * per, dtype=np.float32) + 1000 * m)
                                   .reshape(8, per)[rank:rank + 1] for m in range(8)], axis=1)
            np.testing.assert_array_equal(results[i], want)
