"""Every collective x algorithm on device arrays (``strict`` everywhere, ``cupy`` on a
GPU), kept resident (``transport="ipc"``) or staged through the host (``"host"``): the
results equal numpy's (reductions bit for bit where the fold order is fixed), ``out=``
and strided inputs work, and the trace and counters say which path ran."""

import numpy as np
import pytest

from mesh import Mesh
from tests import conformance as C
from vcluster import ALGORITHMS

pytestmark = pytest.mark.timeout(900)

ALGS = {c: ("auto",) + ALGORITHMS[c] for c in C.COLLECTIVES if c != "barrier"}
ALGS["barrier"] = ("auto",)
MESHES = {"1": (Mesh((1,), ("x",)), (None,)), "3": (Mesh((3,), ("x",)), (None,)),
          "4": (Mesh((4,), ("x",)), (None, "x")),
          "2x2x2": (Mesh((2, 2, 2), ("a", "b", "c")), (None, "a", ("c", "b"), ("a", "b", "c")))}


@pytest.mark.parametrize("transport", ["ipc", "host"])
@pytest.mark.parametrize("name", list(MESHES))
def test_every_collective_and_algorithm(device_cluster_of, name, transport):
    mesh, axes = MESHES[name]
    cases = []
    for c in C.COLLECTIVES:
        cases += C.enumerate_cases(mesh, c, axes=axes, rotate_axes=True, algorithms=ALGS[c],
                                   exact_algorithms=("shm",), rotate_shapes=True,
                                   dtypes=("float32", "float64", "int64"),
                                   shapes=("scalar", "odd", "3d", "empty", "medium", "large"))
    C.check_cases(device_cluster_of(mesh, transport), mesh, cases)


@pytest.mark.parametrize("transport", ["ipc", "host"])
def test_out_buffers_and_input_layouts(device_cluster_of, transport):
    """out= (device buffers from xp.empty and dev.empty, strided views, in place) and
    inputs in dev.empty memory or strided."""
    mesh, axes = MESHES["3"]
    cases = []
    for c in C.COLLECTIVES:
        for out, layout in (("numpy", "plain"), ("empty", "empty"), ("strided", "strided"),
                            ("inplace", "plain")):
            if out == "inplace" and c not in C.INPLACE_COLLECTIVES:
                continue
            cases += C.enumerate_cases(mesh, c, axes=axes, algorithms=ALGS[c],
                                       exact_algorithms=("shm",), rotate_shapes=True,
                                       dtypes=("float64", "int64"), ops=("sum", "max"),
                                       shapes=("odd", "3d", "large"), out=out, layout=layout)
    C.check_cases(device_cluster_of(mesh, transport), mesh, cases, seed=2)


def test_asynchronous_calls_and_messages(device_cluster_of):
    mesh = Mesh((2, 4), ("dp", "tp"))
    cases = []
    for c in C.COLLECTIVES:
        cases += C.enumerate_cases(mesh, c, axes=C.axis_choices(mesh), rotate_axes=True,
                                   algorithms=ALGS[c], rotate_shapes=True,
                                   dtypes=("float64",), shapes=("odd", "large"))
    C.check_cases(device_cluster_of(mesh), mesh, cases, mode="async", seed=5, overlap_p2p=True)
    C.check_p2p(device_cluster_of(mesh), mesh)


def _resident_all_reduce(dev, n):
    x = dev.empty((n,), np.float64)
    x[...] = dev.rank + 1.0
    y = dev.all_reduce(x, algorithm="shm")
    z = dev.all_reduce(x, algorithm="ring")
    return float(y[0]), float(z[-1]), type(y).__module__.split(".")[0]


@pytest.mark.parametrize("transport", ["ipc", "host"])
def test_trace_and_counters_say_which_path_ran(device_cluster_of, array_module, transport):
    mesh = Mesh((4,), ("x",))
    cluster = device_cluster_of(mesh, transport)
    n = 1 << 15                                       # 256 KiB: past the inline path
    cluster.reset_stats()
    results = cluster.run(_resident_all_reduce, [(n,)] * 4)
    assert all(r[:2] == (10.0, 10.0) for r in results)
    kinds = {"strict": "vcluster", "cupy": "cupy"}[array_module]
    assert {r[2] for r in results} == {kinds}
    events = [e for e in cluster.trace() if getattr(e, "collective", None) == "all_reduce"]
    by_alg = {e.algorithm: e.transport for e in events}
    assert by_alg == {"shm": transport, "ring": "host"}        # message algorithms stage
    stats = cluster.stats()
    # each staged call copies its input out and its result back: 2 of 2 calls on "host",
    # only the ring call on "ipc" (the resident call never touches the host)
    staged = (2 if transport == "host" else 1) * n * 8
    assert (stats["d2h_bytes"] == staged).all() and (stats["h2d_bytes"] == staged).all()
