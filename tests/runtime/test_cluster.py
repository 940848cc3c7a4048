"""VirtualCluster as a user meets it: the README snippet, stats, trace, validation."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mesh import Mesh
from vcluster import (ALGORITHMS, CommEvent, ComputeEvent, DeviceContext, VirtualCluster,
                      choose_algorithm)
from vcluster.runtime.algorithm import AlgorithmSettings

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

README_SNIPPET = '''
import numpy as np
from mesh import Mesh
from vcluster import VirtualCluster

mesh = Mesh((2, 4), ("dp", "tp"))             # 8 virtual devices

def step(dev, x):                              # runs on every device; dev is its context
    total = dev.all_reduce(x, axis="tp")       # sum over the 4 devices sharing dp
    both = dev.all_gather(x, axis="dp", dim=0) # concatenation over the 2 dp members
    return total, both

with VirtualCluster(mesh) as cluster:
    results = cluster.run(step, [(np.full(3, r, np.float32),) for r in range(mesh.size)])
    print(results[5], cluster.stats().to_string())
'''


def _run_script(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)


def test_readme_snippet_runs_as_a_plain_script_without_main_guard(tmp_path):
    marker = "print('SCRIPT TOP LEVEL RAN', flush=True)\n"
    proc = _run_script(tmp_path, marker + README_SNIPPET)
    assert proc.returncode == 0, proc.stderr
    # functions from __main__ travel by value: the devices never re-run the script
    assert proc.stdout.count("SCRIPT TOP LEVEL RAN") == 1
    assert "(array([22., 22., 22.], dtype=float32), array([1., 1., 1., 5., 5., 5.], " \
           "dtype=float32))" in proc.stdout
    assert "messages_sent" in proc.stdout and "d2h_bytes" in proc.stdout


def test_snippet_from_python_dash_c_like_a_notebook_cell():
    """Code with no file at all (as in a notebook) works the same."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = README_SNIPPET.replace("print(results[5], cluster.stats().to_string())",
                                  "print(results[5][0].tolist(), results[5][1].tolist())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "[22.0, 22.0, 22.0] [1.0, 1.0, 1.0, 5.0, 5.0, 5.0]" in proc.stdout


@pytest.fixture(scope="module")
def cluster():
    with VirtualCluster(Mesh((2, 2), ("dp", "tp")), timeout_s=10) as c:
        yield c


def test_device_context_satisfies_protocol(cluster):
    def check(dev):
        return (isinstance(dev, DeviceContext), dev.rank, tuple(dev.index), dev.xp.__name__,
                dev.index["tp"], dev.mesh.size)
    out = cluster.run(check)
    assert out[3] == (True, 3, (1, 1), "numpy", 1, 4)


def test_stats_follow_the_closed_forms(cluster):
    """shm all_reduce of |x| bytes over n members: each device reads and writes
    (n-1)/n |x| to its peers; h2d/d2h count the arrays that crossed host<->device."""
    n_elems = 1 << 16                 # 512 KiB float64, divisible by the group size
    nbytes = n_elems * 8

    def prog(dev, x):
        with dev.compute("scale", flops=x.size, bytes=2 * x.nbytes):
            y = x * 2
        return dev.all_reduce(y, axis=("dp", "tp"), algorithm="shm")

    cluster.reset_stats()
    xs = [np.full(n_elems, float(r)) for r in range(4)]
    out = cluster.run(prog, [(x,) for x in xs])
    np.testing.assert_array_equal(out[0], np.full(n_elems, 12.0))
    st = cluster.stats()
    assert list(st.columns) == ["rank", "messages_sent", "bytes_sent", "messages_received",
                                "bytes_received", "h2d_bytes", "d2h_bytes", "flops",
                                "arena_bytes_in_use", "arena_peak_bytes",
                                "arena_committed_bytes", "peak_params_bytes",
                                "peak_grads_bytes", "peak_optimizer_bytes",
                                "peak_activations_bytes"]
    assert st["arena_bytes_in_use"].tolist() == [0] * 4      # results released after the run
    assert (st["arena_peak_bytes"] >= 2 * nbytes).all()      # input + result, at least
    assert st["bytes_sent"].tolist() == [3 * nbytes // 4] * 4
    assert st["bytes_received"].tolist() == [3 * nbytes // 4] * 4
    assert st["messages_sent"].tolist() == [3] * 4
    assert st["h2d_bytes"].tolist() == [nbytes] * 4
    assert st["d2h_bytes"].tolist() == [nbytes] * 4
    assert st["flops"].tolist() == [n_elems] * 4
    peers = cluster.stats(per_peer=True)
    assert list(peers.columns) == ["rank", "peer", "messages_sent", "bytes_sent",
                                   "messages_received", "bytes_received"]
    assert len(peers) == 12
    assert (peers["bytes_sent"] == nbytes // 4).all()


@pytest.mark.parametrize("n_axes", [("tp",), ("dp", "tp")])
def test_ring_all_reduce_bytes_equal_2_n_minus_1_over_n(cluster, n_axes):
    n = 2 if len(n_axes) == 1 else 4
    x_bytes = 4096 * 8

    def prog(dev):
        return dev.all_reduce(np.ones(4096), axis=n_axes, algorithm="ring")

    cluster.reset_stats()
    out = cluster.run(prog)
    np.testing.assert_array_equal(out[1], np.full(4096, float(n)))
    st = cluster.stats()
    assert st["bytes_sent"].tolist() == [2 * (n - 1) * x_bytes // n] * 4
    assert st["messages_sent"].tolist() == [2 * (n - 1)] * 4
    assert st["bytes_received"].tolist() == st["bytes_sent"].tolist()


def test_trace_records_compute_and_comm_events(cluster):
    def prog(dev):
        with dev.compute("matmul", flops=2 * 8 * 8 * 8, bytes=3 * 8 * 8 * 8):
            a = np.ones((8, 8)) @ np.ones((8, 8))
        dev.all_reduce(a, axis="tp")
        if dev.rank == 0:
            dev.send(np.arange(3), to=1, tag=5)
        if dev.rank == 1:
            dev.recv(0, tag=5)
        return None

    cluster.reset_stats()
    cluster.run(prog)
    events = cluster.trace()
    assert events == sorted(events, key=lambda e: (e.start, e.rank))
    compute = [e for e in events if isinstance(e, ComputeEvent)]
    comm = [e for e in events if isinstance(e, CommEvent)]
    assert sorted(e.rank for e in compute) == [0, 1, 2, 3]
    assert all(e.name == "matmul" and e.flops == 1024 and e.end >= e.start for e in compute)
    ar = [e for e in comm if e.collective == "all_reduce"]
    assert sorted(e.rank for e in ar) == [0, 1, 2, 3]
    assert {e.group for e in ar} == {(0, 1), (2, 3)}
    assert all(e.algorithm == "shm" and e.nbytes == 512 for e in ar)
    send = [e for e in comm if e.collective == "send"]
    recv = [e for e in comm if e.collective == "recv"]
    assert len(send) == len(recv) == 1
    assert send[0].sent == ((1, 24, 1),) and send[0].tag == 5
    assert recv[0].received == ((0, 24, 1),)
    cluster.reset_stats()
    assert cluster.trace() == []


def test_run_validates_its_arguments(cluster):
    with pytest.raises(ValueError, match="args_per_rank has 2 entries; the mesh has 4"):
        cluster.run(lambda dev, x: x, [(1,), (2,)])
    with pytest.raises(TypeError, match=r"args_per_rank\[0\] must be a tuple"):
        cluster.run(lambda dev, x: x, [1, 2, 3, 4])
    with pytest.raises(TypeError, match="fn must be callable"):
        cluster.run(42)


@pytest.mark.parametrize("kwargs, message", [
    ({"array_module": "jax"}, "array_module must be one of"),
    ({"timeout_s": 0}, "timeout_s must be a positive number"),
    ({"algorithm": "butterfly"}, "algorithm must be one of"),
    ({"arena_bytes": 1000}, "arena_bytes must be an int >= 4194304"),
    ({"wait": "spin"}, "wait must be one of"),
    ({"threads_per_device": 0}, "threads_per_device must be an int >= 1, got 0"),
    ({"threads_per_device": 1.5}, "threads_per_device must be an int >= 1, got 1.5"),
])
def test_cluster_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VirtualCluster(Mesh((2,), ("x",)), **kwargs)


def test_mesh_must_be_a_mesh():
    with pytest.raises(TypeError, match="mesh must be a mesh.Mesh"):
        VirtualCluster((2, 4))


def _cupy_with_gpu():
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


@pytest.mark.skipif(_cupy_with_gpu() is not None,
                    reason="CuPy with a GPU is present: covered by test_cupy_devices")
def test_cupy_request_without_cupy_is_a_clear_error():
    with pytest.raises(ValueError, match="array_module='cupy' needs CuPy and a CUDA device"):
        VirtualCluster(Mesh((2,), ("x",)), array_module="cupy")


def test_poll_waiter_works_too():
    """The portable fallback (no futexes) gives the same results."""
    with VirtualCluster(Mesh((4,), ("x",)), wait="poll", timeout_s=10) as c:
        out = c.run(lambda dev: (dev.all_reduce(np.arange(3.0) + dev.rank),
                                 dev.all_gather(np.ones(40000) * dev.rank, algorithm="ring")))
    np.testing.assert_array_equal(out[2][0], np.arange(3.0) * 4 + 6)
    np.testing.assert_array_equal(out[2][1], np.repeat([0.0, 1.0, 2.0, 3.0], 40000))


def test_choose_algorithm_is_a_pure_function_of_its_inputs():
    for collective, algorithms in ALGORITHMS.items():
        assert choose_algorithm(collective, 1 << 20, 1) == "local"
        assert choose_algorithm(collective, 1 << 20, 8) == "shm"
        for alg in algorithms:
            assert choose_algorithm(collective, 8, 8, requested=alg) == alg
    assert choose_algorithm("all_reduce", 8, 4, AlgorithmSettings("ring")) == "ring"
    assert choose_algorithm("barrier", 8, 4, AlgorithmSettings("ring")) == "shm"
    with pytest.raises(ValueError, match="all_gather has no algorithm 'tree'"):
        choose_algorithm("all_gather", 8, 4, requested="tree")


def test_cluster_algorithm_preference_is_used(cluster):
    with VirtualCluster(Mesh((2,), ("x",)), algorithm="ring") as c:
        c.run(lambda dev: dev.all_reduce(np.ones(1000)))
        assert {e.algorithm for e in c.trace()} == {"ring"}


def test_bench_cli_writes_json(tmp_path):
    import json
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vcluster", "bench", "collectives", "--devices", "4",
         "--sizes", "8B,256KiB", "--ops", "all_reduce,all_gather", "--reps", "3",
         "--json", str(out)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert len(records) == 2 * 2 * 2
    keys = {"op", "path", "algorithm", "dtype", "devices", "bytes", "median_s", "algbw_gbps",
            "busbw_gbps", "memcpy_gbps", "engine", "array_module", "transport", "round"}
    assert all(set(r) == keys and r["engine"] == "emulator" and r["round"] == 1
               for r in records)
    assert {(r["array_module"], r["transport"]) for r in records} == {("numpy", "host")}
    ar = [r for r in records if r["op"] == "all_reduce" and r["bytes"] == 256 * 1024]
    for r in ar:   # busbw = algbw * 2(n-1)/n and algbw = bytes / median
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 1.5)
    ag = [r for r in records if r["op"] == "all_gather"]
    assert {r["bytes"] for r in ag} == {16, 256 * 1024}      # 8B rounded to 4 float32
    assert "busbw" in proc.stdout


def test_bench_cli_compares_transports(tmp_path):
    """--array-module strict --transport ipc,host: both transports, read from the trace,
    and the table of busbw relative to the host-staged run."""
    import json
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vcluster", "bench", "collectives", "--devices", "4",
         "--sizes", "8B,1MiB", "--ops", "all_reduce", "--reps", "3", "--array-module",
         "strict", "--transport", "ipc,host", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert {(r["transport"], r["bytes"], r["path"]) for r in records} == {
        (t, b, p) for t in ("ipc", "host") for b in (8, 1 << 20) for p in ("resident", "copy")}
    assert {r["array_module"] for r in records} == {"strict"}
    assert "busbw by transport (GB/s; x = relative to host)" in proc.stdout


def test_bench_cli_rejects_bad_sizes():
    proc = subprocess.run([sys.executable, "-m", "vcluster", "bench", "collectives",
                           "--sizes", "12parsecs"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    assert "size '12parsecs' is not a byte count" in proc.stderr



@pytest.mark.skipif(_cupy_with_gpu() is None, reason="needs CuPy and a CUDA device")
def test_cupy_devices():
    cupy = _cupy_with_gpu()
    with VirtualCluster(Mesh((2,), ("x",)), array_module="cupy") as c:
        out = c.run(lambda dev: (dev.xp.__name__,
                                 dev.xp.asnumpy(dev.all_reduce(dev.xp.ones(3) * (dev.rank + 1)))))
    assert out[0][0] == "cupy"
    np.testing.assert_array_equal(out[1][1], np.full(3, 3.0))
    assert cupy is not None


def test_every_rank_receives_its_own_strided_arguments(cluster):
    """Strided arrays travel as contiguous copies that the pickler frees at once; the
    next copy of the same size often gets the freed address. The run's "copy a shared
    array to the arena once" table must not take that address for the same array (it
    did: ranks 1 and 3 received ranks 0 and 2's data, silently)."""
    rng = np.random.default_rng(0)
    n = cluster.mesh.size
    # 256 x 64 float64 = 128 KiB per view: past the out-of-band threshold (64 KiB)
    per_rank = [[(rng.standard_normal((256, 128)) + 10 * (r * 3 + i))[:, ::2] for i in range(3)]
                for r in range(n)]
    shared = rng.standard_normal((256, 128))[:, 1::2]          # one strided array, every rank

    def prog(dev, views, common):
        return [float(v.sum()) for v in views], float(common.sum())

    out = cluster.run(prog, [(views, shared) for views in per_rank])
    for r, (sums, common) in enumerate(out):
        assert sums == pytest.approx([float(v.sum()) for v in per_rank[r]], rel=1e-12), r
        assert common == pytest.approx(float(shared.sum()), rel=1e-12), r
