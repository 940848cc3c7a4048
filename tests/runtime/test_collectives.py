"""Conformance of the emulator's collectives and point-to-point calls (tests/conformance/).

One test body runs over many communicators, as in mpi4py's test-suite: each test issues
a whole batch of calls in ONE ``cluster.run`` (hundreds of cases: every algorithm,
dtype, shape, op, root, dim, group) and checks every rank's result against numpy on the
host. The clusters are session-wide (``cluster_of`` in conftest.py), one per mesh.

Coverage:

* group sizes 1, 2, 3, 4, 8 and 6 / 3 / 2 on a (3, 2) mesh: every collective x every
  algorithm (plus "auto") x float32/float64/int64 x shapes 0-d, (1,), (5,), (3, 7),
  (2, 3, 5), (0, 3), (33, 17), (40000,) x every reduce op x roots x dims;
* every axis choice (every ordered subset of the axes, and None) of a 2x4 ("dp", "tp")
  and a 2x2x2 ("a", "b", "c") mesh, for every collective and algorithm;
* ``out=`` (numpy buffers, ``dev.empty`` buffers, strided views, in place), inputs
  that are strided views or live in ``dev.empty`` memory, ``async_op=True`` (all in
  flight, waited in a random order per rank; and mixed with blocking calls), chained
  all_reduces over disjoint groups, barriers, int32/uint8/float16/complex128;
* send / recv / isend / irecv: several peers and tags posted before any receive,
  received out of order, same-tag FIFO order, a pending message across many
  collectives between the same ranks;
* reproducibility (two runs bit-identical) and the "shm" algorithm's reductions equal,
  bit for bit, the group-order fold ``((x0 op x1) op x2) ...``;
* errors: avg on integers (TypeError), bad roots and indivisible dims (ValueError naming
  the dimension, its size and the group size), after which the group still works.
"""

import numpy as np
import pytest

from tests import conformance as C
from mesh import Mesh
from vcluster import ALGORITHMS, VirtualCluster

#: algorithms per collective on this engine; "auto" is tried as well.
ALGS = {c: ("auto",) + ALGORITHMS[c] for c in C.COLLECTIVES if c != "barrier"}
ALGS["barrier"] = ("auto",)          # barrier() has no algorithm= keyword, see below
EXACT = ("shm",)                     # reductions folded in group order, bit for bit

SIZE_MESHES = {
    "1": (Mesh((1,), ("x",)), (None, "x")),
    "2": (Mesh((2,), ("x",)), (None, "x")),
    "3": (Mesh((3,), ("x",)), (None, "x")),
    "4": (Mesh((4,), ("x",)), (None, "x")),
    "8": (Mesh((8,), ("x",)), (None, "x")),
    "3x2": (Mesh((3, 2), ("x", "y")), (None, "x", "y", ("y", "x"))),
}
DP_TP = Mesh((2, 4), ("dp", "tp"))
ABC = Mesh((2, 2, 2), ("a", "b", "c"))
AXIS_MESHES = {"2x4": DP_TP, "2x2x2": ABC}


def _mesh(name: str) -> Mesh:
    return SIZE_MESHES[name][0] if name in SIZE_MESHES else AXIS_MESHES[name]


# ------------------------------------------------------------------ the main matrix
@pytest.mark.parametrize("collective", C.COLLECTIVES)
@pytest.mark.parametrize("size", list(SIZE_MESHES))
def test_group_sizes(cluster_of, size, collective):
    """Every algorithm x dtype x shape x op (x roots, dims) for one group size."""
    mesh, axes = SIZE_MESHES[size]
    cases = C.enumerate_cases(mesh, collective, axes=axes, rotate_axes=True,
                              algorithms=ALGS[collective], exact_algorithms=EXACT)
    C.check_cases(cluster_of(mesh), mesh, cases)


@pytest.mark.parametrize("collective", C.COLLECTIVES)
@pytest.mark.parametrize("name", list(AXIS_MESHES))
def test_every_axis(cluster_of, name, collective):
    """Every axis choice x algorithm x dtype; shapes and ops rotate. The groups of one
    batch differ from call to call, so disjoint groups alternate within the run."""
    mesh = AXIS_MESHES[name]
    cases = C.enumerate_cases(mesh, collective, axes=C.axis_choices(mesh),
                              algorithms=ALGS[collective], exact_algorithms=EXACT,
                              rotate_shapes=True, rotate_ops=True)
    C.check_cases(cluster_of(mesh), mesh, cases, seed=1)


# --------------------------------------------------------------- out=, async, chains
OUT_SHAPES = ("scalar", "one", "empty", "3d", "medium", "large")


def _mixed_batch(mesh, axes, out="none", shapes=OUT_SHAPES, dtypes=C.DTYPES):
    collectives = C.INPLACE_COLLECTIVES if out == "inplace" else C.COLLECTIVES
    cases = []
    for c in collectives:
        cases += C.enumerate_cases(mesh, c, axes=axes, rotate_axes=True,
                                   algorithms=ALGS[c], exact_algorithms=EXACT,
                                   dtypes=dtypes, shapes=shapes, ops=("sum", "max", "avg"),
                                   out=out)
    return cases


@pytest.mark.parametrize("out", ["numpy", "empty", "strided", "inplace"])
@pytest.mark.parametrize("name", ["3", "3x2"])
def test_out(cluster_of, name, out):
    """``out=`` gets the result and is what the call returns (numpy buffers, dev.empty
    buffers, strided views, and in place: ``all_reduce(buf, out=buf)`` on ``dev.empty``
    memory)."""
    mesh, axes = SIZE_MESHES[name]
    C.check_cases(cluster_of(mesh), mesh,
                  _mixed_batch(mesh, axes, out, dtypes=("float32", "int64")), seed=2)


def test_out_every_axis(cluster_of):
    mesh, cases = ABC, []
    for out in ("empty", "inplace"):
        cases += _mixed_batch(mesh, C.axis_choices(mesh), out, shapes=("odd", "large"),
                              dtypes=("float32", "int64"))
    C.check_cases(cluster_of(mesh), mesh, cases, seed=3)


@pytest.mark.parametrize("layout", ["empty", "strided"])
@pytest.mark.parametrize("name", ["3", "2x4"])
def test_input_layouts(cluster_of, name, layout):
    """Inputs in ``dev.empty`` memory (zero-copy paths) and strided (non-contiguous)
    views, over every axis, algorithm and collective."""
    mesh = _mesh(name)
    cases = []
    for c in C.COLLECTIVES:
        cases += C.enumerate_cases(mesh, c, axes=C.axis_choices(mesh), rotate_axes=True,
                                   algorithms=ALGS[c], exact_algorithms=EXACT,
                                   dtypes=("float64", "int64"), ops=("sum", "min"),
                                   shapes=("scalar", "odd", "3d", "empty", "medium", "large"),
                                   layout=layout)
    C.check_cases(cluster_of(mesh), mesh, cases, seed=7)


@pytest.mark.parametrize("name", ["3", "2x4"])
def test_more_dtypes(cluster_of, name):
    """int32, uint8, float16 and complex128 (max/min only on real dtypes)."""
    mesh = _mesh(name)
    cases = []
    for c in C.COLLECTIVES[:-1]:
        for dtypes, ops in ((("int32", "uint8", "float16"), C.OPS),
                            (("complex128",), ("sum", "prod", "avg"))):
            cases += C.enumerate_cases(mesh, c, axes=[None, mesh.axes[-1]], rotate_axes=True,
                                       algorithms=ALGS[c], exact_algorithms=EXACT,
                                       dtypes=dtypes, ops=ops, shapes=("odd", "3d", "large"),
                                       rotate_shapes=True)
    C.check_cases(cluster_of(mesh), mesh, cases, seed=8)


@pytest.mark.parametrize("mode", ["async", "mixed"])
@pytest.mark.parametrize("name", list(AXIS_MESHES))
def test_async(cluster_of, name, mode):
    """Every collective and algorithm with ``async_op=True``, all in flight over
    alternating groups, each rank waiting its handles in its own random order;
    ``mixed``: every other call blocking (queued behind the asynchronous ones)."""
    mesh = AXIS_MESHES[name]
    cases = _mixed_batch(mesh, C.axis_choices(mesh), shapes=("scalar", "odd", "3d", "large"),
                         dtypes=("float32", "int64"))
    C.check_cases(cluster_of(mesh), mesh, cases, mode=mode, seed=4)


@pytest.mark.parametrize("name", ["3", "2x4"])
def test_async_overlapping_p2p(cluster_of, name):
    """send/recv on the program's thread while asynchronous collectives (message-based
    ones too) run on the device's communication thread over the same channels."""
    mesh = _mesh(name)
    cases = _mixed_batch(mesh, C.axis_choices(mesh), shapes=("odd", "large"),
                         dtypes=("float64",))
    C.check_cases(cluster_of(mesh), mesh, cases, mode="async", seed=9, overlap_p2p=True)


@pytest.mark.parametrize("out", ["numpy", "empty", "inplace"])
def test_async_out(cluster_of, out):
    mesh = DP_TP
    cases = _mixed_batch(mesh, [None, "tp", "dp", ("tp", "dp")], out,
                         shapes=("odd", "large"), dtypes=("float64",))
    C.check_cases(cluster_of(mesh), mesh, cases, mode="async", seed=5)


@pytest.mark.parametrize("algorithm", ALGS["all_reduce"])
@pytest.mark.parametrize("mesh, axes", [
    (DP_TP, ("tp", "dp")), (DP_TP, ("dp", "tp")), (ABC, ("c", ("b", "a"))),
    (ABC, ("a", "b", "c")), (SIZE_MESHES["3x2"][0], ("y", "x"))])
def test_hierarchical_all_reduce(cluster_of, mesh, axes, algorithm):
    """all_reduce over "tp" then over "dp" (disjoint groups) equals one over both."""
    C.check_hierarchical_all_reduce(cluster_of(mesh), mesh, axes, algorithm)


# ------------------------------------------------------------------ reproducibility
@pytest.mark.parametrize("name", ["3", "8", "3x2"])
def test_reproducible_float32_sums(cluster_of, name):
    """float32 sums with mixed magnitudes (rounding depends on the order): two runs are
    bit-identical for every algorithm, and "shm" equals the group-order fold exactly."""
    mesh, axes = SIZE_MESHES[name]
    cases = []
    for c in C.REDUCTIONS:
        cases += C.enumerate_cases(mesh, c, axes=axes, algorithms=ALGS[c],
                                   exact_algorithms=EXACT, dtypes=("float32",),
                                   shapes=("odd", "medium", "large"), ops=("sum", "avg"),
                                   values="wide")
    C.check_reproducible(cluster_of(mesh), mesh, cases, seed=6)


# -------------------------------------------------------------------------- barrier
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("name", ["3", "2x4", "2x2x2"])
def test_barrier(cluster_of, name, async_op):
    mesh = _mesh(name)
    C.check_barrier(cluster_of(mesh), mesh, C.axis_choices(mesh), async_op=async_op)


def test_barrier_algorithm_keyword(cluster_of):
    mesh = DP_TP
    C.check_barrier(cluster_of(mesh), mesh, [None, "tp"], algorithm="shm", delay_s=0.0)


# -------------------------------------------------------------------- point to point
P2P_MODES = [("send", "recv", False), ("isend", "irecv", False), ("isend", "irecv", True),
             ("send", "irecv", False), ("isend", "recv", True), ("send", "recv_out", False)]


@pytest.mark.parametrize("send_mode, recv_mode, use_empty", P2P_MODES)
@pytest.mark.parametrize("name", ["2", "3", "8", "2x4"])
def test_p2p(cluster_of, name, send_mode, recv_mode, use_empty):
    """Sends to every peer with several tags before any receive; receives in reverse
    peer order, tags out of order, in a random order per rank."""
    mesh = _mesh(name)
    C.check_p2p(cluster_of(mesh), mesh, send_mode, recv_mode, use_empty=use_empty)


@pytest.mark.parametrize("name", ["3", "8"])
def test_p2p_ring_many_tags(cluster_of, name):
    mesh = SIZE_MESHES[name][0]
    C.check_p2p(cluster_of(mesh), mesh, "isend", "irecv", tags=tuple(range(8)), peers="ring")


@pytest.mark.parametrize("name", ["2", "3", "8"])
def test_p2p_same_tag_fifo(cluster_of, name):
    mesh = SIZE_MESHES[name][0]
    C.check_p2p_same_tag_fifo(cluster_of(mesh), mesh)
    C.check_p2p_same_tag_fifo(cluster_of(mesh), mesh, shape=(20000,))   # rendezvous size


@pytest.mark.parametrize("name", ["2", "3", "2x4"])
def test_p2p_pending_across_collectives(cluster_of, name):
    """A sent, not yet received message must not block later collectives between the
    same ranks (regression: the mailbox used slot (q - 1) mod 16 for message q, so one
    pending message blocked its pair after 15 more, e.g. after 8 ring all_reduces)."""
    mesh = _mesh(name)
    calls = [(c, a) for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
             for a in ALGS[c]] * 3
    C.check_p2p_pending_across_collectives(cluster_of(mesh), mesh, calls)


def test_irecv_matches_in_post_order(cluster_of):
    C.check_irecv_post_order(cluster_of(SIZE_MESHES["2"][0]), SIZE_MESHES["2"][0])


@pytest.fixture(scope="module")
def impatient_pair():
    """A 2-rank cluster that gives up a wait after 1 s (for expected deadlocks)."""
    with VirtualCluster(Mesh((2,), ("x",)), timeout_s=1.0) as cluster:
        yield cluster


def test_many_buffered_sends_before_receives(impatient_pair):
    C.check_p2p(impatient_pair, Mesh((2,), ("x",)), "send", "recv", tags=tuple(range(24)))


def test_sixteen_buffered_sends_before_receives(impatient_pair):
    C.check_p2p(impatient_pair, Mesh((2,), ("x",)), "send", "recv", tags=tuple(range(16)))


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name, axes", [
    ("2", [None]), ("3", [None]), ("8", [None]), ("3x2", C.axis_choices(SIZE_MESHES["3x2"][0])),
    ("2x4", C.axis_choices(DP_TP)), ("2x2x2", [None, "a", ("c", "b")])])
def test_errors(cluster_of, name, axes):
    """avg on int64 -> TypeError; root outside the group -> ValueError; indivisible
    dims -> ValueError naming the dimension, its size and the group size; the group
    works afterwards."""
    mesh = _mesh(name)
    for axis in axes:
        C.check_errors(cluster_of(mesh), mesh, axis, ALGS)


def _scatter_program(dev, x, axis, algorithm):
    return dev.scatter(x, axis, root=1, dim=-1, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALGS["scatter"])
def test_scatter_indivisible_dim_on_root(cluster_of, algorithm):
    """Only the root sees the array, so the ValueError comes from the root's side; the
    run fails naming it, and the cluster is usable again afterwards."""
    mesh = DP_TP
    cluster = cluster_of(mesh)
    args = [(np.ones((2, 7)) if mesh.group_position("tp", r) == 1 else None, "tp", algorithm)
            for r in range(mesh.size)]
    C.check_run_raises(cluster, mesh, _scatter_program, args, "ValueError",
                       contains=((-1, 1), 7, 4))     # dimension, its size, the group size
    C.check_scatter(cluster, mesh, "tp", algorithm, "float32", (2, 8), dim=-1, root=1)
