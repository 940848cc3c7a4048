"""256 virtual devices on one machine (issue 30): the host holds more than 1024 file
descriptors then, where ``select`` stops (``ValueError: filedescriptor out of range in
select()`` before); the host and the launcher wait with ``poll``. Every collective runs
once on them and closing leaves nothing behind; a request beyond what the machine holds
fails before anything starts, naming how many devices fit."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.capacity import BYTES_PER_DEVICE, check_capacity
from vcluster.runtime.segments import list_segments
from vcluster.runtime.wire import readable, send_msg

from .processes import wait_dead

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(240)


def _sum_of_ranks(dev):
    return float(dev.all_reduce(np.array([float(dev.rank)]), "x")[0])


def _every_collective(dev, n):
    """Each collective once (and a send/recv pair), with what it returned, to compare with
    closed forms."""
    r = dev.rank
    got = {"all_reduce": dev.all_reduce(np.array([float(r)]), "x")[0],
           "all_gather": dev.all_gather(np.array([float(r)]), "x").sum(),
           "reduce_scatter": dev.reduce_scatter(np.full(n, float(r)), "x")[0],
           "all_to_all": dev.all_to_all(np.arange(n, dtype=float) + r * n, "x"),
           "broadcast": dev.broadcast(np.array([float(r)]), "x", root=0)[0],
           "scatter": np.asarray(dev.scatter(np.arange(n, dtype=float) if r == 0
                                             else np.zeros(n), "x", root=0)).ravel()[0]}
    gathered = dev.gather(np.array([float(r)]), "x", root=0)
    reduced = dev.reduce(np.array([float(r)]), "x", root=0)
    got["gather"] = None if gathered is None else np.asarray(gathered).ravel()
    got["reduce"] = None if reduced is None else float(np.asarray(reduced).ravel()[0])
    dev.barrier("x")
    if r % 2 == 0:
        dev.send(np.array([float(r)]), r + 1)
    else:
        got["recv"] = float(dev.recv(r - 1)[0])
    return got


@pytest.mark.slow
@pytest.mark.alone       # 256 device processes: ~5 GB, and they starve any test beside them
def test_256_devices_run_every_collective_and_leave_nothing():
    n = 256
    total = n * (n - 1) / 2
    with VirtualCluster(Mesh((n,), ("x",)), timeout_s=120) as cluster:
        pids = cluster.pids
        results = cluster.run(_every_collective, [(n,)] * n)
    for r, got in enumerate(results):
        assert got["all_reduce"] == got["all_gather"] == got["reduce_scatter"] == total
        # rank r receives element r of every rank i: r + i*n
        np.testing.assert_array_equal(got["all_to_all"], r + n * np.arange(n))
        assert got["broadcast"] == 0.0 and got["scatter"] == float(r)
        if r == 0:
            np.testing.assert_array_equal(got["gather"], np.arange(n))
            assert got["reduce"] == total
        else:
            assert got["gather"] is None and got["reduce"] is None
        if r % 2:
            assert got["recv"] == float(r - 1)
    assert wait_dead(pids) == [], "device processes outlived the cluster"
    assert not [s for s in list_segments() if s.split("-")[1] == str(os.getpid())]


@pytest.mark.alone       # counts the machine's segments; a bring-up within 1 s
def test_more_devices_than_the_open_files_limit_fail_before_starting():
    """Under ``ulimit -n 256`` a 100-device cluster (3 files a device + 64) is refused at
    once, naming the 64 devices that fit; nothing starts and no segment is made."""
    code = textwrap.dedent("""
        import resource, time
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        from mesh import Mesh
        from vcluster import VirtualCluster
        from vcluster.runtime.segments import list_segments
        t = time.monotonic()
        try:
            VirtualCluster(Mesh((100,), ("x",)))
        except ValueError as exc:
            print(exc)
        print(round(time.monotonic() - t, 3), len(list_segments()))
    """)
    before = len(list_segments())
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    message, last = done.stdout.strip().splitlines()
    assert message == ("VirtualCluster: 100 devices need about 364 open files in this "
                       "process (3 per device + 64), but its limit (ulimit -n) is 256: at "
                       "most 64 devices fit; raise the limit (ulimit -n 364) for more")
    seconds, segments = last.split()
    assert float(seconds) < 1.0 and int(segments) == before


def test_a_program_failing_everywhere_names_the_other_ranks_in_ranges():
    from vcluster.runtime.errors import DeviceProgramError
    e = DeviceProgramError(0, "f", "tb", {0: "X", 1: "A", 2: "A", 3: "B", 4: "A", 6: "A"})
    assert str(e) == "rank 0 raised in f:\ntb\nother ranks: ranks 1-2, 4, 6: A; rank 3: B"


def test_capacity_in_memory_names_how_many_fit():
    with pytest.raises(ValueError, match=r"1000 devices need about 7.8 GiB of memory "
                                         r"\(8 MiB per device process before its arrays\), "
                                         r"but 1.0 GiB is available: at most 128 devices fit"):
        check_capacity(1000, 1 << 30, None)
    check_capacity(128, 128 * BYTES_PER_DEVICE, 3 * 128 + 64)        # exactly fits
    with pytest.raises(ValueError, match="at most 127 devices fit"):
        check_capacity(128, 128 * BYTES_PER_DEVICE, 3 * 127 + 64)
    check_capacity(10 ** 6, None, None)                                # nothing to check


def test_readable_takes_descriptors_beyond_select():
    a, b = socket.socketpair()
    fillers = [socket.socket() for _ in range(1100)]       # push the pair's copies past 1024
    try:
        high_a = socket.socket(fileno=os.dup(a.fileno()))
        high_b = socket.socket(fileno=os.dup(b.fileno()))
        assert high_a.fileno() > 1024
        assert not readable(high_a, 0.01)
        send_msg(high_b, ("hello",))
        assert readable(high_a, 1.0)
        high_a.close()
        high_b.close()
    finally:
        for s in fillers:
            s.close()
        a.close()
        b.close()
