"""Tests for mesh.Mesh / mesh.MeshIndex against numpy reference layouts."""

import copy
import itertools
import pickle
import re

import numpy as np
import pytest

from mesh import Mesh, MeshIndex

MESHES = [
    ((8,), ("a",)),
    ((2, 4), ("dp", "tp")),
    ((4, 2), ("x", "y")),
    ((2, 2, 2), ("a", "b", "c")),
    ((1, 8), ("p", "q")),
    ((3,), ("pp",)),
]


def all_axis_choices(axes):
    """Every ordered subset of ``axes`` (including the empty one)."""
    for k in range(len(axes) + 1):
        yield from itertools.permutations(axes, k)


def reference_groups(dims, axes, chosen):
    """Groups via numpy: transpose (others..., chosen...) then reshape to rows."""
    ranks = np.arange(int(np.prod(dims))).reshape(dims)
    pos = [axes.index(a) for a in chosen]
    others = [i for i in range(len(axes)) if i not in pos]
    group_len = int(np.prod([dims[p] for p in pos]))
    return ranks.transpose(others + pos).reshape(-1, group_len)


CASES = [
    (dims, axes, chosen)
    for dims, axes in MESHES
    for chosen in all_axis_choices(axes)
]


@pytest.mark.parametrize("dims,axes,chosen", CASES, ids=str)
def test_groups_match_numpy(dims, axes, chosen):
    mesh = Mesh(dims, axes)
    ref = reference_groups(dims, axes, chosen)
    got = mesh.groups(chosen)
    assert got == tuple(tuple(int(v) for v in row) for row in ref)
    # partition: every rank exactly once
    flat = sorted(r for g in got for r in g)
    assert flat == list(range(mesh.size))
    assert mesh.axis_size(chosen) == ref.shape[1]
    for rank in range(mesh.size):
        row, col = (int(v[0]) for v in np.nonzero(ref == rank))
        assert mesh.group(chosen, rank) == tuple(int(v) for v in ref[row])
        assert mesh.group_position(chosen, rank) == col
        # a list argument behaves like the tuple
        assert mesh.group(list(chosen), rank) == mesh.group(chosen, rank)


@pytest.mark.parametrize("dims,axes", MESHES, ids=str)
def test_single_name_and_none(dims, axes):
    mesh = Mesh(dims, axes)
    for a in axes:
        assert mesh.groups(a) == mesh.groups((a,))
        assert mesh.axis_size(a) == dims[axes.index(a)]
    assert mesh.groups(None) == (tuple(range(mesh.size)),)
    assert mesh.axis_size(None) == mesh.size == int(np.prod(dims))
    assert mesh.axis_tuple(None) == axes


@pytest.mark.parametrize("dims,axes", MESHES, ids=str)
def test_index_rank_round_trip(dims, axes):
    mesh = Mesh(dims, axes)
    for rank in range(mesh.size):
        idx = mesh.index(rank)
        ref = tuple(int(v) for v in np.unravel_index(rank, dims))
        assert isinstance(idx, MeshIndex)
        assert idx == ref and hash(idx) == hash(ref)
        assert idx.axes == axes
        assert len(idx) == len(dims) and tuple(iter(idx)) == ref
        for i, a in enumerate(axes):
            assert idx[a] == idx[i] == ref[i]
        assert mesh.rank(idx) == rank
        assert mesh.rank(ref) == rank
        assert mesh.rank(dict(zip(reversed(axes), reversed(ref)))) == rank
        assert int(np.ravel_multi_index(ref, dims)) == rank


def test_examples_from_spec():
    mesh = Mesh((2, 4), ("dp", "tp"))
    assert mesh.size == 8 and mesh.ndim == 2
    assert mesh.dims == (2, 4) and mesh.axes == ("dp", "tp")
    assert mesh.shape["tp"] == 4
    assert mesh.shape == {"dp": 2, "tp": 4}
    assert list(mesh.shape) == ["dp", "tp"]
    with pytest.raises(TypeError):
        mesh.shape["dp"] = 3
    assert mesh.index(5) == (1, 1)
    assert repr(mesh.index(5)) == "MeshIndex(dp=1, tp=1)"
    assert mesh.group("tp", 5) == (4, 5, 6, 7)
    assert mesh.group("dp", 5) == (1, 5)
    assert mesh.group(None, 5) == tuple(range(8))
    assert mesh.group(("tp", "dp"), 0) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert mesh.group_position("dp", 5) == 1
    assert mesh.axis_tuple("tp") == ("tp",)
    assert mesh.axis_tuple(["tp", "dp"]) == ("tp", "dp")
    assert repr(mesh) == "Mesh(shape=(2, 4), axes=('dp', 'tp'))"
    assert str(mesh) == "Mesh(dp=2, tp=4)"
    pp = Mesh((4,), ("pp",))
    assert str(pp) == "Mesh(pp=4)" and pp.groups("pp") == ((0, 1, 2, 3),)


def test_equality_hash_pickle_repr():
    a = Mesh((2, 4), ("dp", "tp"))
    b = Mesh([2, 4], ["dp", "tp"])
    assert a == b and hash(a) == hash(b)
    assert a != Mesh((4, 2), ("dp", "tp"))
    assert a != Mesh((2, 4), ("tp", "dp"))
    assert a != (2, 4)
    assert len({a, b, Mesh((8,), ("x",))}) == 2
    for m in (a, Mesh((3,), ("pp",)), Mesh((2, 2, 2), ("a", "b", "c"))):
        assert pickle.loads(pickle.dumps(m)) == m
        assert copy.deepcopy(m) == m
        assert eval(repr(m)) == m
    with pytest.raises(AttributeError):
        a.dims = (8,)


def test_mesh_index_behaviour():
    idx = MeshIndex((1, 3), ("dp", "tp"))
    assert idx == (1, 3) and (1, 3) == idx
    assert {idx: "v"}[(1, 3)] == "v"
    assert idx.as_dict() == {"dp": 1, "tp": 3}
    assert idx[1:] == (3,) and idx[1:].axes == ("tp",)
    assert idx[-1] == 3
    clone = pickle.loads(pickle.dumps(idx))
    assert clone == idx and clone.axes == ("dp", "tp") and type(clone) is MeshIndex
    assert copy.copy(idx).axes == ("dp", "tp")
    with pytest.raises(KeyError, match="'pp'"):
        idx["pp"]
    with pytest.raises(AttributeError):
        idx.axes = ("a", "b")
    with pytest.raises(ValueError, match="same length"):
        MeshIndex((1, 2), ("a",))
    with pytest.raises(ValueError, match="non-negative"):
        MeshIndex((-1,), ("a",))


@pytest.mark.parametrize(
    "args,exc,pattern",
    [
        (((2, 0), ("a", "b")), ValueError, r"shape must be a tuple of positive ints, got \(2, 0\)"),
        (((2, -1), ("a", "b")), ValueError, r"positive ints, got \(2, -1\)"),
        (((2.0,), ("a",)), TypeError, r"positive ints, got \(2.0,\)"),
        (((True,), ("a",)), TypeError, r"positive ints"),
        ((4, ("a",)), TypeError, r"shape must be a tuple.*got 4"),
        (((4,), "a"), TypeError, r"axes must be a tuple.*got 'a'"),
        (((2, 2), ("a", "a")), ValueError, r"distinct, got 'a' repeated in axes=\('a', 'a'\)"),
        (((2,), ("",)), ValueError, r"non-empty identifiers, got ''"),
        (((2,), ("my axis",)), ValueError, r"identifiers, got 'my axis'"),
        (((2,), (3,)), TypeError, r"axes must be strings, got 3"),
        (((2, 4), ("dp",)), ValueError, r"shape=\(2, 4\) and axes=\('dp',\) must have the same length"),
    ],
)
def test_construction_errors(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Mesh(*args)


def test_lookup_errors():
    mesh = Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"rank 8 is out of range; valid ranks are 0\.\.7"):
        mesh.index(8)
    with pytest.raises(ValueError, match=r"rank -1 is out of range"):
        mesh.group("tp", -1)
    with pytest.raises(TypeError, match="rank must be an int, got 1.5"):
        mesh.index(1.5)
    with pytest.raises(ValueError, match=r"coordinate tp=4 is out of range; valid values are 0\.\.3"):
        mesh.rank((0, 4))
    with pytest.raises(ValueError, match=r"coordinate dp=-1"):
        mesh.rank({"dp": -1, "tp": 0})
    with pytest.raises(ValueError, match=r"has 1 coordinates, expected 2"):
        mesh.rank((1,))
    with pytest.raises(ValueError, match=r"exactly the keys \('dp', 'tp'\)"):
        mesh.rank({"dp": 0})
    with pytest.raises(ValueError, match=r"has axes \('a', 'b'\)"):
        mesh.rank(MeshIndex((0, 0), ("a", "b")))
    with pytest.raises(ValueError, match=r"axis 'pp' is not one of the mesh's axes \('dp', 'tp'\)"):
        mesh.group("pp", 0)
    with pytest.raises(ValueError, match=r"axis 'tp' is repeated in axes=\('tp', 'tp'\).*\('dp', 'tp'\)"):
        mesh.groups(("tp", "tp"))
    with pytest.raises(TypeError, match="axes must be"):
        mesh.axis_size(3)


def test_as_int_takes_any_integer_but_a_bool_and_names_the_argument():
    """mesh.arguments.as_int: the one integer check every layer uses."""
    from mesh.arguments import as_int
    assert as_int(3, "x") == 3 and type(as_int(np.int64(3), "x", 1)) is int
    assert as_int(0, "x", 0) == 0 and as_int(-5, "x") == -5
    for bad in (True, 2.0, "2", None, np.float64(2)):
        with pytest.raises(TypeError, match=rf"^Schedule: microbatches must be an int >= 1, "
                                            rf"got {re.escape(repr(bad))}$"):
            as_int(bad, "Schedule: microbatches", 1)
    with pytest.raises(ValueError, match=r"^Action: stage must be an int >= 0, got -1$"):
        as_int(-1, "Action: stage", 0)
