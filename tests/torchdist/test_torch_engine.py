"""The torch.distributed engine passes the engine-independent conformance suite
(tests/conformance/) with 4 and 8 gloo ranks.

The meshes: (2, 2) ("dp", "tp") — groups of 2 and 4 — and (2, 4) ("dp", "tp") — groups of
2, 4 and 8, with the axes in both orders (so torch's rank order differs from the mesh's).
A representative subset of the emulator's matrix, chosen to keep this file near a minute
on 2 cores: every collective x every axis choice x float32/float64/int64 x shapes 0-d,
(1,), (5,), (3, 7), (2, 3, 5), (0, 3), (33, 17), (40000,) x every op, root and dim
(rotated over groups); out= (numpy, dev.empty, strided, in place); async (all in flight,
random wait order) with overlapping point-to-point traffic; int32/uint8/float16/complex128;
chained all_reduces; barriers; send/recv/isend/irecv in every mode, same-tag FIFO, irecv
post order; the rejected calls of ``check_errors``. Not run here: the emulator-only
checks (algorithm-specific bit-exact folds, arena/zero-copy paths); ``algorithm=`` is
accepted and ignored (gloo picks its own algorithm). Reductions are compared with the
suite's tolerances (gloo's summation order is its own); integers and data movement exactly.
"""

import importlib.util

import numpy as np
import pytest

# A skip mark, not importorskip: the emulator's devices import this module to find its
# programs, and must not pay for importing torch.
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed")]

from tests import conformance as C  # noqa: E402
from mesh import Mesh  # noqa: E402
from vcluster import DeviceContext, Work  # noqa: E402
from vcluster.torchdist import TorchCluster, group_plan  # noqa: E402

pytestmark.append(pytest.mark.timeout(600))

MESHES = {"4": Mesh((2, 2), ("dp", "tp")), "8": Mesh((2, 4), ("dp", "tp"))}
ALGS = {c: ("auto",) for c in C.COLLECTIVES}


@pytest.fixture(scope="module")
def torch_cluster():
    clusters = {}

    def get(name):
        if name not in clusters:
            clusters[name] = TorchCluster(MESHES[name], backend="gloo", timeout_s=60.0,
                                          run_timeout_s=300.0)
        return clusters[name]

    yield get
    for cluster in clusters.values():
        cluster.close()


def test_group_plan_every_axis_group_once():
    """Every axis group with 2..n-1 members, once, in one fixed order."""
    mesh = Mesh((2, 2, 2), ("a", "b", "c"))
    plan = group_plan(mesh)
    assert len(plan) == len(set(plan)) == 3 * 4 + 3 * 2          # 1-axis and 2-axis groups
    assert plan == group_plan(Mesh((2, 2, 2), ("a", "b", "c")))
    assert group_plan(Mesh((8,), ("x",))) == ()                  # the world is the default group
    assert (0, 4) in plan and (0, 1, 2, 3) in plan


def _describe(dev):
    work = dev.barrier(async_op=True)
    assert work.wait() is None and work.is_completed()
    return dev.rank, tuple(dev.index), dev.device, isinstance(dev, DeviceContext), \
        isinstance(work, Work)


@pytest.mark.parametrize("name", list(MESHES))
def test_backend_reported(torch_cluster, name):
    cluster = torch_cluster(name)
    import torch
    assert cluster.info == {"torch_version": torch.__version__, "torch_backend": "gloo"}
    ranks = cluster.run(_describe)
    assert ranks == [(r, tuple(MESHES[name].index(r)), "cpu", True, True)
                     for r in range(MESHES[name].size)]


@pytest.mark.parametrize("name", list(MESHES))
def test_every_collective_every_axis(torch_cluster, name):
    mesh = MESHES[name]
    cases = []
    for c in C.COLLECTIVES:
        cases += C.enumerate_cases(mesh, c, axes=C.axis_choices(mesh), rotate_axes=True)
    C.check_cases(torch_cluster(name), mesh, cases, seed=1)


@pytest.mark.parametrize("name", list(MESHES))
def test_out_and_async(torch_cluster, name):
    """out= in every mode, then the whole batch asynchronous with point-to-point
    traffic while it is in flight, then mixed blocking/asynchronous."""
    mesh, cluster, cases = MESHES[name], torch_cluster(name), []
    for out in ("numpy", "empty", "strided", "inplace"):
        for c in (C.INPLACE_COLLECTIVES if out == "inplace" else C.COLLECTIVES):
            cases += C.enumerate_cases(mesh, c, axes=C.axis_choices(mesh), rotate_axes=True,
                                       dtypes=("float32", "int64"), ops=("sum", "max", "avg"),
                                       shapes=("scalar", "odd", "3d", "large"),
                                       rotate_shapes=True, out=out)
    C.check_cases(cluster, mesh, cases, seed=2)
    C.check_cases(cluster, mesh, cases, mode="async", seed=3, overlap_p2p=True)
    C.check_cases(cluster, mesh, cases, mode="mixed", seed=4)


@pytest.mark.parametrize("name", list(MESHES))
def test_more_dtypes_and_layouts(torch_cluster, name):
    mesh, cases = MESHES[name], []
    for c in C.COLLECTIVES[:-1]:
        for dtypes, ops in ((("int32", "uint8", "float16"), C.OPS),
                            (("complex128",), ("sum", "avg"))):
            cases += C.enumerate_cases(mesh, c, axes=[None, "tp", ("tp", "dp")],
                                       rotate_axes=True, dtypes=dtypes, ops=ops,
                                       shapes=("odd", "3d", "large"), rotate_shapes=True)
        cases += C.enumerate_cases(mesh, c, axes=C.axis_choices(mesh), rotate_axes=True,
                                   dtypes=("float64",), ops=("sum", "min"),
                                   shapes=("odd", "3d", "medium"), layout="strided")
    C.check_cases(torch_cluster(name), mesh, cases, seed=8)


@pytest.mark.parametrize("name", list(MESHES))
def test_chains_and_barriers(torch_cluster, name):
    mesh, cluster = MESHES[name], torch_cluster(name)
    C.check_hierarchical_all_reduce(cluster, mesh, ("tp", "dp"))
    C.check_hierarchical_all_reduce(cluster, mesh, ("dp", "tp"), dtype="int64")
    C.check_barrier(cluster, mesh, C.axis_choices(mesh))
    C.check_barrier(cluster, mesh, C.axis_choices(mesh), async_op=True)


P2P_MODES = [("send", "recv", False), ("isend", "irecv", False), ("send", "irecv", True),
             ("isend", "recv", False), ("send", "recv_out", False)]


@pytest.mark.parametrize("name", list(MESHES))
def test_point_to_point(torch_cluster, name):
    mesh, cluster = MESHES[name], torch_cluster(name)
    for send_mode, recv_mode, use_empty in P2P_MODES:
        C.check_p2p(cluster, mesh, send_mode, recv_mode, use_empty=use_empty)
    C.check_p2p(cluster, mesh, "isend", "irecv", tags=tuple(range(8)), peers="ring")
    C.check_p2p_same_tag_fifo(cluster, mesh)
    C.check_p2p_same_tag_fifo(cluster, mesh, shape=(20000,))
    C.check_irecv_post_order(cluster, mesh)
    calls = [(c, "auto") for c in ("all_reduce", "all_gather", "reduce_scatter",
                                    "all_to_all")] * 5
    C.check_p2p_pending_across_collectives(cluster, mesh, calls)


@pytest.mark.parametrize("name", list(MESHES))
def test_errors(torch_cluster, name):
    """Rejected calls raise the emulator's exception types and messages on every member,
    and the groups work afterwards."""
    mesh = MESHES[name]
    for axis in C.axis_choices(mesh):
        C.check_errors(torch_cluster(name), mesh, axis, ALGS)


def _fail_on(dev, rank):
    if dev.rank == rank:
        raise KeyError("deliberate")
    return dev.all_reduce(np.ones(2), None)


def test_a_failing_rank_is_named_and_the_cluster_restarts():
    """A rank that raises while the others wait for it in a collective: the error
    names it; the waiting ranks are killed (no hang) and ``restart()`` gives a
    working cluster."""
    mesh = Mesh((4,), ("x",))
    with TorchCluster(mesh, backend="gloo", timeout_s=30.0) as cluster:
        text = C.check_run_raises(cluster, mesh, _fail_on, [(2,)] * 4, "KeyError")
        assert "rank 2 raised" in text
        cluster.restart()
        assert [r.tolist() for r in cluster.run(_fail_on, [(9,)] * 4)] == [[4.0, 4.0]] * 4


def test_bench_collectives_engine_torch(tmp_path):
    """``vcluster bench collectives --engine torch``: the torch figures (gloo here unless
    this machine has a GPU per rank) beside the emulator's for the same sizes, from one
    run; a line about the choice only when GPUs are present but too few."""
    import json
    import subprocess
    import sys
    from vcluster.torchdist import backend_choice
    backend, note = backend_choice("auto", 4)
    proc = subprocess.run(
        [sys.executable, "-m", "vcluster", "bench", "collectives", "--engine", "torch",
         "--devices", "4", "--sizes", "8B,64KiB", "--ops", "all_reduce,all_gather",
         "--paths", "copy", "--reps", "3", "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "emulator beside torch" in proc.stdout and f"({backend})" in proc.stdout
    assert ("chose gloo" in proc.stdout) == (note is not None), proc.stdout
    records = json.loads((tmp_path / "b.json").read_text())
    by_engine = {}
    for r in records:
        by_engine.setdefault(r["engine"], set()).add((r["op"], r["path"], r["bytes"]))
        assert r["median_s"] > 0 and r["devices"] == 4
    assert by_engine["emulator"] == by_engine["torch"] and len(by_engine["torch"]) == 4
    assert {r["algorithm"] for r in records if r["engine"] == "torch"} == {backend}
    table = proc.stdout.split("emulator beside torch")[1]
    assert sum(line.startswith(("all_reduce", "all_gather")) for line in table.splitlines()) == 4


def _only_rank0_reduces(dev):
    if dev.rank == 0:
        return dev.all_reduce(np.ones(3), None)
    return None


def _sleep(dev, seconds):
    import time
    time.sleep(seconds)
    return dev.rank


def test_waits_time_out_naming_who_waits_and_no_process_survives():
    """A collective whose peer never comes fails after the group timeout, naming the
    waiting rank, the call and the group; a run over run_timeout_s names the busy ranks;
    after close() no rank and no launcher process is left."""
    import os
    import time
    mesh = Mesh((2,), ("x",))
    cluster = TorchCluster(mesh, backend="gloo", timeout_s=2.0, run_timeout_s=20.0)
    pids, launcher = cluster.pids, cluster._launcher
    assert len(pids) == 2 and all(p > 0 for p in pids)
    start = time.monotonic()
    text = C.check_run_raises(cluster, mesh, _only_rank0_reduces, [()] * 2, "CollectiveTimeout")
    assert time.monotonic() - start < 15
    assert "rank 0: all_reduce over group [0, 1] (axis=None) failed or timed out" in text
    cluster.restart()
    from vcluster.runtime.errors import HostTimeout
    with pytest.raises(HostTimeout, match=r"ranks \[0, 1\] did not finish _sleep within 1 s"):
        cluster.run(_sleep, [(30,)] * 2, timeout_s=1.0)
    pids = cluster.pids
    cluster.close()
    assert launcher.poll() is not None
    for pid in pids + [cluster._launcher.pid]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"process {pid} survived close()")


def test_importable_without_torch():
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import vcluster, vcluster.torchdist, vcluster.oracle\n"
            "from vcluster.torchdist import group_plan\n"
            "from mesh import Mesh\n"
            "print(len(group_plan(Mesh((2, 4), ('dp', 'tp')))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "6", proc.stderr
