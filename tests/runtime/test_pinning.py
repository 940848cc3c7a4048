"""Devices pinned to CPUs on request (issue 32): when the devices outnumber the cores,
consecutive ranks share a CPU — read inside the devices with ``os.sched_getaffinity``, for the
program's thread and the communication thread alike, and again after a restart;
``pin_devices=False`` (the default) leaves them free, ``None`` pins them when they
outnumber the cores, ``True`` pins them anyway; the CPU sets follow a
closed form. A pinned device's waits yield only toward peers that may run on its CPU, and
any wait stops yielding once a yield took longer than its spin budget."""

import os
import sys

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.cores import device_cpu_sets, usable_cpus

pytestmark = pytest.mark.timeout(120)
linux_only = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"),
                                reason="CPU affinity masks are a Linux feature")


@pytest.mark.parametrize("n, cpus, want", [
    (8, (0, 1), ((0,),) * 4 + ((1,),) * 4),                # one pipeline replica per CPU
    (4, (2, 5), ((2,), (2,), (5,), (5,))),                 # the mask's CPUs, not 0..C-1
    (3, (0, 1), ((0,), (0, 1), (1,))),                     # rank 1's share straddles both
    (2, (0, 1, 2, 3), ((0, 1), (2, 3))),                   # fewer devices: blocks of CPUs
    (1, (7,), ((7,),)),
])
def test_cpu_sets_closed_form(n, cpus, want):
    assert device_cpu_sets(n, cpus) == want


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("c", [1, 2, 3, 4, 16])
def test_cpu_sets_cover_every_cpu_in_rank_order(n, c):
    sets = device_cpu_sets(n, tuple(range(c)))
    assert len(sets) == n and set().union(*sets) == set(range(c))
    firsts = [s[0] for s in sets]
    assert firsts == sorted(firsts)                      # consecutive ranks, CPUs ascending
    for s in sets:                                       # each set a run of CPUs
        assert list(s) == list(range(s[0], s[-1] + 1))
    if n >= c:                                           # at most ceil(n / c) + 1 per CPU
        per_cpu = np.bincount([x for s in sets for x in s], minlength=c)
        assert per_cpu.max() <= -(-n // c) + 1


def test_cpu_sets_refuse_nothing_to_share():
    with pytest.raises(ValueError, match=r"need >= 1 device and >= 1 CPU, got 0 device"):
        device_cpu_sets(0, (0, 1))


def _affinities(dev):
    """The CPUs of every thread of this device (program and communication thread)."""
    dev.all_reduce(np.ones(4), async_op=True).wait()      # start the communication thread
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


@linux_only
def test_devices_outnumbering_the_cores_are_pinned_on_request():
    cpus = usable_cpus()
    n = 2 * len(cpus)
    with VirtualCluster(Mesh((n,), ("x",)), timeout_s=30.0, pin_devices=None) as cluster:
        want = device_cpu_sets(n, cpus)
        assert cluster.options.cpu_sets == want
        assert "cpus=any" not in repr(cluster)
        for rank, threads in enumerate(cluster.run(_affinities)):
            assert len(threads) >= 2, threads             # the program's and the comm thread
            for cpu_list in threads.values():
                assert cpu_list == sorted(want[rank]), (rank, threads)
        cluster.restart()                                 # fresh processes: pinned again
        after = cluster.run(lambda dev: tuple(os.sched_getaffinity(0)))
        assert [sorted(a) for a in after] == [sorted(w) for w in want]


@linux_only
def test_pinning_can_be_turned_off_and_forced():
    cpus = usable_cpus()
    mine = sorted(os.sched_getaffinity(0))
    with VirtualCluster(Mesh((2 * len(cpus),), ("x",)), timeout_s=30.0,
                        pin_devices=False) as cluster:
        assert cluster.options.cpu_sets is None and "cpus=any" in repr(cluster)
        assert all(sorted(a) == mine
                   for a in cluster.run(lambda dev: tuple(os.sched_getaffinity(0))))
    with VirtualCluster(Mesh((1,), ("x",)), timeout_s=30.0, pin_devices=True) as cluster:
        assert cluster.options.cpu_sets == (cpus,)
        assert sorted(cluster.run(lambda dev: tuple(os.sched_getaffinity(0)))[0]) == \
            sorted(cpus)


def test_devices_within_the_cores_are_not_pinned_by_default():
    with VirtualCluster(Mesh((1,), ("x",)), timeout_s=30.0) as cluster:
        assert cluster.options.cpu_sets is None and "cpus=any" in repr(cluster)
    with VirtualCluster(Mesh((1,), ("x",)), timeout_s=30.0, pin_devices=None) as cluster:
        assert cluster.options.cpu_sets is None and "cpus=any" in repr(cluster)


@linux_only
def test_devices_outnumbering_the_cores_are_free_by_default():
    """Pinning is opt-in: the localhost model prices devices the scheduler moves."""
    mine = sorted(os.sched_getaffinity(0))
    with VirtualCluster(Mesh((2 * len(usable_cpus()),), ("x",)), timeout_s=30.0) as cluster:
        assert cluster.options.cpu_sets is None and "cpus=any" in repr(cluster)
        assert all(sorted(a) == mine
                   for a in cluster.run(lambda dev: tuple(os.sched_getaffinity(0))))


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_pin_devices_is_checked(value):
    with pytest.raises(ValueError, match=r"pin_devices must be None \(pin when the devices "
                                         r"outnumber the cores\), True or False, got"):
        VirtualCluster(Mesh((2,), ("x",)), pin_devices=value)


@pytest.mark.skipif(sys.platform.startswith("linux"), reason="the platform without masks")
def test_forced_pinning_without_affinity_masks_is_refused():
    with pytest.raises(ValueError, match="pin_devices=True needs CPU affinity masks"):
        VirtualCluster(Mesh((2,), ("x",)), pin_devices=True)


# --- the waits' yields (vcluster.runtime.fabric): only where a peer may run on the CPU ----

def _fabric(rank: int, n: int, cpu_sets):
    from vcluster.runtime.arena import Arena
    from vcluster.runtime.fabric import Fabric
    from vcluster.runtime.futex import make_waker
    from vcluster.runtime.layout import ControlLayout
    layout = ControlLayout(n, 2)
    return Fabric(rank, layout, np.zeros(layout.total_words, np.int64),
                  [Arena(r, np.zeros(1 << 12, np.uint8)) for r in range(n)],
                  Arena(-1, np.zeros(1 << 12, np.uint8)), make_waker("auto"), 10.0,
                  cpu_sets)


@pytest.mark.parametrize("rank, cpu_sets, peers, yields", [
    (1, None, (5,), 10),                                  # free to migrate: as before
    (1, ((0,),) * 4 + ((1,),) * 4, (2,), 10),             # a pipeline neighbour on my CPU
    (1, ((0,),) * 4 + ((1,),) * 4, (5,), 0),              # my DDP partner on the other CPU
    (1, ((0,),) * 4 + ((1,),) * 4, (1, 5), 0),            # ... as a group with me
    (1, ((0,),) * 4 + ((1,),) * 4, tuple(range(8)), 10),  # a group with one neighbour here
    (0, ((0, 1), (2, 3)), (1,), 10),                      # alone on my CPUs: spin freely
    (1, ((0,), (0, 1), (1,)), (2,), 10),                  # a straddling share meets rank 2
    (0, ((0,), (0, 1), (1,)), (2,), 0),
    (-1, ((0,),) * 4 + ((1,),) * 4, (5,), 10),            # the host is not pinned
])
def test_a_wait_yields_only_where_the_awaited_peer_may_run(rank, cpu_sets, peers, yields):
    n = 8 if cpu_sets is None else len(cpu_sets)
    f = _fabric(rank, n, cpu_sets)
    assert f.yields_for(peers) == yields
    assert f.yields_for(peers) == yields                  # memoised, same answer


def test_a_wait_that_does_not_yield_still_wakes_and_returns():
    f = _fabric(1, 8, ((0,),) * 4 + ((1,),) * 4)
    calls = []

    def blocker():
        calls.append(1)
        return None if len(calls) > 2 else (f.progress_address(5, 0), 0)

    f.wait(blocker, lambda: "test", timeout_s=5.0, peers=(5,))
    assert len(calls) == 3            # checked, slept (a nap: nobody wakes it), checked


@linux_only
def test_pinned_devices_wait_with_their_cpu_sets():
    """The launcher hands each device the cluster's CPU sets: a device yields toward a
    peer on its own CPU and sleeps at once for one on another CPU (two devices per CPU,
    so none is alone on its CPU; on a one-CPU machine every peer shares it)."""
    cpus = usable_cpus()
    n = 2 * len(cpus)
    with VirtualCluster(Mesh((n,), ("x",)), timeout_s=30.0, pin_devices=None) as cluster:
        sets = cluster.options.cpu_sets
        got = cluster.run(lambda dev: [dev._f.yields_for((p,)) for p in range(n)])
    for rank, per_peer in enumerate(got):
        for peer in range(n):
            if peer != rank:
                shared = set(sets[rank]) & set(sets[peer])
                assert per_peer[peer] == (10 if shared else 0), (rank, peer)
    values = {v for rank, per_peer in enumerate(got) for p, v in enumerate(per_peer) if p != rank}
    assert values == ({10, 0} if len(cpus) > 1 else {10})


def test_a_wait_stops_yielding_once_its_spin_budget_is_spent():
    """A yield that gave a CPU-bound process its time slice returns milliseconds later;
    after that the wait sleeps instead of yielding again. Here each check of the blocker
    takes 3 budgets (as such a yield would): the wait yields once, then naps on the word
    (nobody wakes it, so the nap lasts its full length) before the third check."""
    import time

    from vcluster.runtime.fabric import _NAP_S, _SPIN_BUDGET_S
    f = _fabric(-1, 2, None)
    calls = []

    def blocker():
        calls.append(time.perf_counter())
        time.sleep(3 * _SPIN_BUDGET_S)
        return None if len(calls) >= 3 else (f.progress_address(1, 0), 0)

    f.wait(blocker, lambda: "test", timeout_s=5.0)     # unpinned: 10 yields
    assert len(calls) == 3
    assert calls[2] - calls[1] >= 0.8 * _NAP_S        # slept, did not yield a second time
