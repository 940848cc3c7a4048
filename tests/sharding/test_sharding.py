"""Tests for sharding: layouts, shard/unshard, checked against direct numpy slicing."""

import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import Mesh
from sharding import (
    DimSharding,
    TensorSharding,
    check_sharding,
    local_shape,
    shard,
    shard_slices,
    unshard,
)

MESHES = [
    ((2, 4), ("dp", "tp")),
    ((4, 2), ("dp", "tp")),
    ((2, 2, 2), ("a", "b", "c")),
    ((8,), ("x",)),
    ((1, 8), ("p", "q")),
]


def all_shardings(axes, ndim):
    """Every TensorSharding of an ndim tensor using mesh ``axes``.

    Each axis is unused, partial, or splits one dimension; axes sharing a
    dimension (or the partial set) appear in every order.
    """
    seen = set()
    for assign in itertools.product(["unused", "partial", *range(ndim)], repeat=len(axes)):
        buckets = {key: [a for a, k in zip(axes, assign) if k == key]
                   for key in ["partial", *range(ndim)]}
        orders = [list(itertools.permutations(buckets[key])) for key in ["partial", *range(ndim)]]
        for choice in itertools.product(*orders):
            s = TensorSharding(*choice[1:], partial=choice[0])
            if s not in seen:
                seen.add(s)
                yield s


def ref_coords(mesh_dims, rank):
    return [int(v) for v in np.unravel_index(rank, mesh_dims)]


def n_shards(mesh_dims, mesh_axes, axes):
    return int(np.prod([mesh_dims[mesh_axes.index(a)] for a in axes]))


def ref_piece_number(mesh_dims, mesh_axes, axes, rank):
    """Row-major position of ``rank``'s coordinates along ``axes`` (numpy)."""
    if not axes:
        return 0, 1
    coords = ref_coords(mesh_dims, rank)
    sub = [coords[mesh_axes.index(a)] for a in axes]
    sizes = [mesh_dims[mesh_axes.index(a)] for a in axes]
    return int(np.ravel_multi_index(sub, sizes)), n_shards(mesh_dims, mesh_axes, axes)


def ref_local(x, sharding, mesh_dims, mesh_axes, rank):
    """Rank's local array computed with np.split and explicit coordinates."""
    piece = x
    for d, dim in enumerate(sharding.dims):
        p, k = ref_piece_number(mesh_dims, mesh_axes, dim.axes, rank)
        piece = np.split(piece, k, axis=d)[p]
    coords = ref_coords(mesh_dims, rank)
    if any(coords[mesh_axes.index(a)] != 0 for a in sharding.partial):
        return np.zeros_like(piece)
    return piece


def ref_unshard(locals_, sharding, mesh_dims, mesh_axes):
    """Global array via one big numpy reshape/transpose of the stacked locals."""
    loc = locals_[0].shape
    big = np.stack(locals_).reshape(tuple(mesh_dims) + loc)
    split = [a for d in sharding.dims for a in d.axes]
    # reduce mesh axes from the last to the first so positions stay valid
    for i in reversed(range(len(mesh_axes))):
        a = mesh_axes[i]
        if a in sharding.partial:
            big = big.sum(axis=i)
        elif a not in split:
            big = big.take(0, axis=i)
    kept = [a for a in mesh_axes if a in split]
    nk = len(kept)
    perm = []
    for d, dim in enumerate(sharding.dims):
        perm += [kept.index(a) for a in dim.axes] + [nk + d]
    out_shape = tuple(n * n_shards(mesh_dims, mesh_axes, dim.axes)
                      for n, dim in zip(loc, sharding.dims))
    return big.transpose(perm).reshape(out_shape)


def make_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def is_even(shape, sharding, mesh_dims, mesh_axes):
    return all(n % n_shards(mesh_dims, mesh_axes, d.axes) == 0
               for n, d in zip(shape, sharding.dims))


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
@pytest.mark.parametrize("shape", [(8, 24), (4, 6, 8)], ids=str)
@pytest.mark.parametrize("mesh_dims,mesh_axes", MESHES, ids=str)
def test_every_sharding_round_trips(mesh_dims, mesh_axes, shape, dtype):
    mesh = Mesh(mesh_dims, mesh_axes)
    x = make_array(shape, dtype)
    n_valid = n_uneven = 0
    for s in all_shardings(mesh_axes, len(shape)):
        if not is_even(shape, s, mesh_dims, mesh_axes):
            n_uneven += 1
            with pytest.raises(ValueError, match="does not split evenly"):
                shard(x, s, mesh)
            with pytest.raises(ValueError, match="does not split evenly"):
                local_shape(shape, s, mesh)
            continue
        n_valid += 1
        locals_ = shard(x, s, mesh)
        assert len(locals_) == mesh.size
        for r, loc in enumerate(locals_):
            ref = ref_local(x, s, mesh_dims, mesh_axes, r)
            assert loc.dtype == x.dtype and loc.flags.c_contiguous
            np.testing.assert_array_equal(loc, ref)
            assert loc.shape == local_shape(shape, s, mesh)
            if not any(ref_coords(mesh_dims, r)[mesh_axes.index(a)] for a in s.partial):
                np.testing.assert_array_equal(x[shard_slices(shape, s, mesh, r)], ref)
            assert not np.shares_memory(loc, x)
        back = unshard(locals_, s, mesh)
        assert back.dtype == x.dtype
        np.testing.assert_array_equal(back, x)
        np.testing.assert_array_equal(ref_unshard(locals_, s, mesh_dims, mesh_axes), x)
    assert n_valid > 0
    if shape == (8, 24):
        assert n_uneven == 0


@pytest.mark.parametrize("mesh_dims,mesh_axes", MESHES, ids=str)
def test_unshard_sums_partial_and_reads_replica_zero(mesh_dims, mesh_axes):
    """Arbitrary locals (not produced by shard) vs the stacked-numpy reference."""
    mesh = Mesh(mesh_dims, mesh_axes)
    rng = np.random.default_rng(1)
    for s in all_shardings(mesh_axes, 2):
        loc = (2, 3)
        locals_ = [rng.integers(-50, 50, size=loc) for _ in range(mesh.size)]
        np.testing.assert_array_equal(
            unshard(locals_, s, mesh), ref_unshard(locals_, s, mesh_dims, mesh_axes)
        )


def test_partial_float_sum_order():
    mesh = Mesh((2, 4), ("dp", "tp"))
    s = TensorSharding(None, partial=("tp",))
    vals = [np.array([1e16]), np.array([1.0]), np.array([-1e16]), np.array([1.0])]
    locals_ = vals + [np.array([np.nan])] * 4  # dp=1 replicas are ignored
    expected = ((vals[0] + vals[1]) + vals[2]) + vals[3]
    np.testing.assert_array_equal(unshard(locals_, s, mesh), expected)


def test_local_arrays_are_independent_copies():
    mesh = Mesh((2, 4), ("dp", "tp"))
    x = np.arange(32.0).reshape(8, 4)
    locals_ = shard(x, TensorSharding("dp", None), mesh)  # contiguous row blocks
    locals_[0][...] = -1
    assert x[0, 0] == 0 and locals_[1][0, 0] == 0  # replica along tp untouched
    assert all(not np.shares_memory(a, b) for a, b in itertools.combinations(locals_, 2))


def test_scalar_and_zero_size():
    mesh = Mesh((2, 2), ("a", "b"))
    s = TensorSharding(partial="b")
    locals_ = shard(np.float64(3.5), s, mesh)
    assert [float(v) for v in locals_] == [3.5, 0.0, 3.5, 0.0]
    assert unshard(locals_, s, mesh).shape == () and float(unshard(locals_, s, mesh)) == 3.5
    x = np.zeros((0, 4))
    s2 = TensorSharding("a", "b")
    assert local_shape((0, 4), s2, mesh) == (0, 2)
    assert unshard(shard(x, s2, mesh), s2, mesh).shape == (0, 4)


def test_shard_slices_and_local_shape_examples():
    mesh = Mesh((2, 4), ("dp", "tp"))
    s = TensorSharding(("dp", "tp"), None)
    assert local_shape((16, 3), s, mesh) == (2, 3)
    assert shard_slices((16, 3), s, mesh, 5) == (slice(10, 12), slice(0, 3))
    s = TensorSharding(("tp", "dp"), None)  # tp major: rank 5 = (dp1, tp1) -> piece 3
    assert shard_slices((16, 3), s, mesh, 5) == (slice(6, 8), slice(0, 3))
    assert local_shape((6, 7), TensorSharding(None, None, partial=("dp", "tp")), mesh) == (6, 7)
    assert local_shape((8, 3), TensorSharding("pp", None), Mesh((1, 8), ("pp", "tp"))) == (8, 3)


def test_dim_sharding_forms():
    assert DimSharding() == DimSharding(None) == DimSharding(())
    assert DimSharding("tp").axes == ("tp",)
    assert DimSharding(["dp", "tp"]).axes == ("dp", "tp")
    assert DimSharding().is_replicated and not DimSharding("tp").is_replicated
    assert str(DimSharding()) == "R"
    assert str(DimSharding("tp")) == "S(tp)"
    assert str(DimSharding(("dp", "tp"))) == "S(dp,tp)"
    assert repr(DimSharding("tp")) == "DimSharding(axes=('tp',))"
    assert eval(repr(DimSharding(("dp", "tp")))) == DimSharding(("dp", "tp"))
    assert pickle.loads(pickle.dumps(DimSharding(("a", "b")))) == DimSharding(("a", "b"))
    assert len({DimSharding("tp"), DimSharding(("tp",)), DimSharding()}) == 2


@pytest.mark.parametrize(
    "sharding,text,rep",
    [
        (TensorSharding(None, "tp"), "[R, S(tp)]", "TensorSharding(None, 'tp')"),
        (TensorSharding(("dp", "tp"), None), "[S(dp,tp), R]", "TensorSharding(('dp', 'tp'), None)"),
        (TensorSharding(None, None, partial="tp"), "[R, R] P(tp)",
         "TensorSharding(None, None, partial=('tp',))"),
        (TensorSharding(("dp", "tp"), None, partial="pp"), "[S(dp,tp), R] P(pp)",
         "TensorSharding(('dp', 'tp'), None, partial=('pp',))"),
        (TensorSharding(None, partial=("dp", "tp")), "[R] P(dp,tp)",
         "TensorSharding(None, partial=('dp', 'tp'))"),
        (TensorSharding(), "[]", "TensorSharding()"),
    ],
)
def test_str_repr_pickle(sharding, text, rep):
    assert str(sharding) == text
    assert repr(sharding) == rep
    assert eval(rep) == sharding and hash(eval(rep)) == hash(sharding)
    clone = pickle.loads(pickle.dumps(sharding))
    assert clone == sharding and hash(clone) == hash(sharding)


def test_tensor_sharding_attributes():
    s = TensorSharding(DimSharding("dp"), ["a", "b"], None, partial=["tp"])
    assert s.dims == (DimSharding("dp"), DimSharding(("a", "b")), DimSharding())
    assert s.partial == ("tp",) and s.ndim == 3
    assert TensorSharding(None, None, partial=None).partial == ()
    assert TensorSharding.replicated(3) == TensorSharding(None, None, None)
    assert TensorSharding.replicated(0) == TensorSharding()
    assert TensorSharding("a", partial="b") != TensorSharding("a")
    with pytest.raises(AttributeError):
        s.partial = ()


@pytest.mark.parametrize(
    "build,exc,pattern",
    [
        (lambda: TensorSharding("tp", "tp"), ValueError,
         r"mesh axis 'tp' is used twice \(dimension 0 and dimension 1\)"),
        (lambda: TensorSharding(("dp", "dp")), ValueError, r"mesh axis 'dp' is used twice"),
        (lambda: TensorSharding("tp", partial="tp"), ValueError,
         r"mesh axis 'tp' is used twice \(dimension 0 and partial\)"),
        (lambda: TensorSharding(None, partial=("a", "a")), ValueError, r"'a' is used twice"),
        (lambda: TensorSharding(3), TypeError, r"DimSharding axes must be None.*got 3"),
        (lambda: TensorSharding((1, 2)), TypeError, r"axis names must be str, got 1"),
        (lambda: TensorSharding(""), ValueError, r"non-empty identifiers, got ''"),
        (lambda: TensorSharding(None, partial=5), TypeError, r"partial must be None.*got 5"),
        (lambda: TensorSharding.replicated(-1), ValueError, r"ndim must be a non-negative int, got -1"),
    ],
)
def test_construction_errors(build, exc, pattern):
    with pytest.raises(exc, match=pattern):
        build()


def test_mesh_checks():
    mesh = Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"axis 'pp', which is not one of the mesh's axes \('dp', 'tp'\)"):
        TensorSharding(None, "pp").validate(mesh)
    with pytest.raises(ValueError, match=r"axis 'ep'.*\('dp', 'tp'\)"):
        check_sharding(TensorSharding(None, partial="ep"), mesh)
    with pytest.raises(ValueError, match=r"shape \(4, 4, 4\) has 3 dimensions but sharding \[R, S\(tp\)\] describes 2"):
        TensorSharding(None, "tp").validate(mesh, (4, 4, 4))
    with pytest.raises(ValueError, match=r"dimension 1 of size 10 does not split evenly into 4 shards over mesh axes \('tp',\)"):
        local_shape((8, 10), TensorSharding(None, "tp"), mesh)
    with pytest.raises(ValueError, match=r"dimension 0 of size 4 does not split evenly into 8 shards over mesh axes \('dp', 'tp'\)"):
        shard(np.zeros((4, 2)), TensorSharding(("dp", "tp"), None), mesh)
    with pytest.raises(ValueError, match=r"shape must be a tuple of non-negative ints, got \(-1, 2\)"):
        local_shape((-1, 2), TensorSharding(None, None), mesh)
    with pytest.raises(TypeError, match=r"sharding must be a TensorSharding"):
        local_shape((2, 2), (None, "tp"), mesh)
    with pytest.raises(ValueError, match=r"rank 8 is out of range"):
        shard_slices((8, 8), TensorSharding(None, "tp"), mesh, 8)
    TensorSharding(None, "tp").validate(mesh, (3, 8))  # fine


def test_unshard_errors():
    mesh = Mesh((2, 4), ("dp", "tp"))
    s = TensorSharding(None, "tp")
    with pytest.raises(ValueError, match=r"one array per rank \(8 for Mesh\(dp=2, tp=4\)\), got 3"):
        unshard([np.zeros((2, 2))] * 3, s, mesh)
    bad = [np.zeros((2, 2))] * 7 + [np.zeros((2, 3))]
    with pytest.raises(ValueError, match=r"rank 0 has \(2, 2\) but rank 7 has \(2, 3\)"):
        unshard(bad, s, mesh)
    with pytest.raises(ValueError, match=r"local arrays have 1 dimensions but sharding \[R, S\(tp\)\] describes 2"):
        unshard([np.zeros(2)] * 8, s, mesh)


@st.composite
def layouts(draw):
    mesh_dims, mesh_axes = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(0, 3))
    order = draw(st.permutations(mesh_axes))
    slots = {key: [] for key in ["partial", *range(ndim)]}
    for a in order:
        key = draw(st.sampled_from(["unused", "partial", *range(ndim)]))
        if key != "unused":
            slots[key].append(a)
    sharding = TensorSharding(*(tuple(slots[d]) for d in range(ndim)), partial=tuple(slots["partial"]))
    shape = tuple(draw(st.integers(0, 3)) * n_shards(mesh_dims, mesh_axes, slots[d])
                  for d in range(ndim))
    dtype = draw(st.sampled_from([np.float64, np.int64, np.float32, np.int32]))
    return Mesh(mesh_dims, mesh_axes), sharding, shape, dtype


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(0, 2**32 - 1))
def test_hypothesis_round_trip(layout, seed):
    mesh, s, shape, dtype = layout
    x = make_array(shape, dtype, seed)
    locals_ = shard(x, s, mesh)
    assert len(locals_) == mesh.size
    for r, loc in enumerate(locals_):
        np.testing.assert_array_equal(loc, ref_local(x, s, mesh.dims, mesh.axes, r))
        assert loc.shape == local_shape(shape, s, mesh)
    back = unshard(locals_, s, mesh)
    assert back.dtype == x.dtype and back.shape == x.shape
    np.testing.assert_array_equal(back, x)
    assert pickle.loads(pickle.dumps(s)) == s and eval(repr(s)) == s
