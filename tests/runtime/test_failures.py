"""Failures are reported, never hung on, and leave no process or shared memory behind.

Each test checks the error names the right rank (and peer, tag, collective where it
applies), that the cluster is usable afterwards or says it must be restarted, and that
closing it leaves no device process and no /dev/shm segment.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mesh import Mesh
from vcluster import (ClusterBrokenError, CollectiveTimeout, DeviceLostError,
                      DeviceProgramError, VirtualCluster)
from tests.interruptible import popen_interruptible
from vcluster.runtime.segments import list_segments

from .processes import wait_dead as _wait_dead

# alone: aborts timed against the wall clock
pytestmark = [pytest.mark.alone, pytest.mark.timeout(120)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _my_segments() -> list[str]:
    return [s for s in list_segments() if s.split("-")[1] == str(os.getpid())]


@pytest.fixture
def cluster4():
    cluster = VirtualCluster(Mesh((4,), ("x",)), timeout_s=2.0)
    pids = cluster.pids
    yield cluster
    cluster.close()
    assert _wait_dead(pids) == [], "device processes outlived the cluster"
    assert _my_segments() == []


def _raise_on_2(dev):
    if dev.rank == 2:
        raise ValueError("bad value on purpose")
    return dev.all_reduce(np.ones(3))


def _sum(dev):
    return dev.all_reduce(np.full(2, float(dev.rank)))


def test_exception_in_one_program_names_rank_and_traceback(cluster4):
    t0 = time.monotonic()
    with pytest.raises(DeviceProgramError) as info:
        cluster4.run(_raise_on_2)
    assert time.monotonic() - t0 < 2.0, "peers waited for the timeout instead of aborting"
    err = info.value
    assert err.rank == 2
    assert "rank 2 raised in _raise_on_2" in str(err)
    assert "ValueError: bad value on purpose" in err.remote_traceback
    assert "_raise_on_2" in err.remote_traceback
    # the cluster stays usable, with consistent collectives
    assert cluster4.run(_sum)[0].tolist() == [6.0, 6.0]


def _kill_1_mid_collective(dev):
    x = np.ones(1 << 18)
    dev.all_reduce(x)
    if dev.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return dev.all_reduce(x)


def test_device_killed_mid_collective(cluster4):
    t0 = time.monotonic()
    with pytest.raises(DeviceLostError) as info:
        cluster4.run(_kill_1_mid_collective)
    assert time.monotonic() - t0 < 5.0
    assert info.value.rank == 1
    assert "rank 1 died (killed by SIGKILL)" in str(info.value)
    with pytest.raises(ClusterBrokenError, match="must be restarted"):
        cluster4.run(_sum)
    cluster4.restart()
    assert cluster4.run(_sum)[3].tolist() == [6.0, 6.0]


def _mismatch_skip(dev):
    if dev.rank == 0:
        return None                       # never joins the collective
    return dev.all_reduce(np.ones(3))


def test_missing_member_times_out_with_diagnostic(cluster4):
    t0 = time.monotonic()
    with pytest.raises(DeviceProgramError) as info:
        cluster4.run(_mismatch_skip)
    elapsed = time.monotonic() - t0
    assert 1.5 < elapsed < 6.0
    text = str(info.value)
    assert "CollectiveTimeout" in text
    assert "timed out after 2 s in all_reduce" in text
    assert "waiting for rank(s) [0]" in text
    assert "group (0, 1, 2, 3)" in text
    assert cluster4.run(_sum)[1].tolist() == [6.0, 6.0]


def _mismatch_ops(dev):
    if dev.rank == 3:
        return dev.all_gather(np.ones(3))
    return dev.all_reduce(np.ones(3))


def test_mismatched_collectives_are_named(cluster4):
    with pytest.raises(DeviceProgramError) as info:
        cluster4.run(_mismatch_ops)
    text = str(info.value)
    assert "CollectiveMismatch" in text
    assert "all_gather" in text and "all_reduce" in text and "rank 3" in text
    assert cluster4.run(_sum)[2].tolist() == [6.0, 6.0]


def _recv_never_sent(dev):
    if dev.rank == 1:
        return dev.recv(0, tag=7)
    return None


def test_receive_timeout_names_waiter_peer_and_tag(cluster4):
    with pytest.raises(DeviceProgramError) as info:
        cluster4.run(_recv_never_sent)
    err = info.value
    assert err.rank == 1
    assert "CollectiveTimeout: rank 1 timed out after 2 s in recv (tag 7) waiting for rank 0 (tag 7)" \
        in err.remote_traceback
    assert cluster4.run(_sum)[0].tolist() == [6.0, 6.0]


def test_timeout_error_type_inside_device(cluster4):
    def catch(dev):
        if dev.rank == 0:
            try:
                dev.recv(1, tag=3)
            except CollectiveTimeout as exc:
                return str(exc)
        return None
    assert "waiting for rank 1" in cluster4.run(catch)[0]


def test_two_clusters_side_by_side_do_not_interfere():
    a = VirtualCluster(Mesh((2, 2), ("dp", "tp")), timeout_s=5)
    b = VirtualCluster(Mesh((3,), ("x",)), timeout_s=5)
    try:
        ra = a.run(lambda dev: dev.all_reduce(np.array([dev.rank + 1.0]), axis="tp"))
        rb = b.run(lambda dev: dev.all_gather(np.array([dev.rank * 10]), axis="x"))
        ra2 = a.run(lambda dev: dev.all_reduce(np.array([dev.rank + 1.0])))
        assert [r.tolist() for r in ra] == [[3.0], [3.0], [7.0], [7.0]]
        assert [r.tolist() for r in rb] == [[0, 10, 20]] * 3
        assert [r.tolist() for r in ra2] == [[10.0]] * 4
        assert set(a.pids).isdisjoint(b.pids)
    finally:
        pids = a.pids + b.pids
        a.close()
        b.close()
    assert _wait_dead(pids) == []
    assert _my_segments() == []


def test_closed_cluster_says_so():
    c = VirtualCluster(Mesh((2,), ("x",)))
    c.close()
    c.close()   # idempotent
    with pytest.raises(ClusterBrokenError, match="closed"):
        c.run(_sum)


def _script(body: str) -> str:
    return textwrap.dedent(body)


def test_sigint_during_run_leaves_nothing_behind(tmp_path):
    """Ctrl-C in the host while devices compute: KeyboardInterrupt, no orphans, no shm."""
    script = tmp_path / "interrupted.py"
    script.write_text(_script(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from mesh import Mesh
        from vcluster import VirtualCluster
        def slow(dev):
            time.sleep(30)
        with VirtualCluster(Mesh((4,), ("x",))) as c:
            print("PIDS", " ".join(map(str, c.pids)), flush=True)
            try:
                c.run(slow)
            except KeyboardInterrupt:
                print("INTERRUPTED", flush=True)
                raise
    """))
    proc = popen_interruptible([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "INTERRUPTED" in out
    assert proc.returncode != 0
    assert _wait_dead(pids) == []
    assert not [s for s in list_segments() if s.split("-")[1] == str(proc.pid)]


def test_host_killed_leaves_no_device_behind(tmp_path):
    """kill -9 of the host: the launcher and every device go too; no segment remains."""
    script = tmp_path / "killed.py"
    script.write_text(_script(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from mesh import Mesh
        from vcluster import VirtualCluster
        c = VirtualCluster(Mesh((4,), ("x",)))
        print("PIDS", " ".join(map(str, c.pids)), flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 4
    proc.kill()
    proc.wait(timeout=10)
    assert _wait_dead(pids) == []
    assert not [s for s in list_segments() if s.split("-")[1] == str(proc.pid)]
