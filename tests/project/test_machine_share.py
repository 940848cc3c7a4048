"""The locks by which tests share the machine on several workers (tests/machine_share.py):
shared holders run together, an alone holder runs with none, a waiting alone test lets no
new test start, and every wait ends in an error naming who waits (real files, real flock;
flock locks belong to each open file, so threads stand in for workers)."""

import threading
import time

import pytest

from tests.machine_share import MachineShare, WorkerHolds


def _hold_in_thread(share, who, until, took, **kind):
    def run():
        with share.hold(who, wait_s=10.0, **kind):
            took.set()
            until.wait(10.0)
    t = threading.Thread(target=run)
    t.start()
    return t


def _events(n):
    return [threading.Event() for _ in range(n)]


def test_shared_holders_run_together_and_an_alone_one_waits(tmp_path):
    share, (release, took) = MachineShare(tmp_path), _events(2)
    a = _hold_in_thread(share, "A", release, took)
    assert took.wait(5.0)
    with share.hold("B", wait_s=1.0):                    # a second shared holder: no wait
        pass
    with pytest.raises(TimeoutError, match=r"^C waited 0 s for the machine alone .*another "
                                           r"worker still holds it"):
        with share.hold("C", alone=True, wait_s=0.2):
            pass
    release.set()
    a.join(5.0)
    with share.hold("C", alone=True, wait_s=1.0):        # A is done: C runs alone
        pass


def test_a_waiting_alone_test_lets_no_new_test_start(tmp_path):
    share, (release_a, release_b, took_a, took_b) = MachineShare(tmp_path), _events(4)
    a = _hold_in_thread(share, "A", release_a, took_a)
    assert took_a.wait(5.0)
    b = _hold_in_thread(share, "B", release_b, took_b, alone=True)   # waits, holding the turnstile
    time.sleep(0.2)
    assert not took_b.is_set()
    with pytest.raises(TimeoutError, match="^C waited 0 s for the turnstile"):
        with share.hold("C", wait_s=0.2):
            pass
    release_a.set()
    assert took_b.wait(5.0)                                     # A finished: B runs alone
    with pytest.raises(TimeoutError, match="the last test that held the machine alone: B$"):
        with share.hold("D", wait_s=0.2):
            pass
    release_b.set()
    for t in (a, b):
        t.join(5.0)
    with share.hold("D", wait_s=1.0):
        pass


def test_a_worker_keeps_the_machine_from_one_alone_test_to_the_next(tmp_path):
    """Released between two alone tests, the turnstile could go to another worker's next
    test, and the second alone test would wait for the whole of it; kept, no test starts
    in between, and the worker's next shared test gives it back."""
    share = MachineShare(tmp_path)
    worker = WorkerHolds(share)
    with worker.hold("A", alone=True, then_alone=True):
        pass
    with pytest.raises(TimeoutError, match="^C waited 0 s for the turnstile.* alone: A$"):
        with share.hold("C", wait_s=0.2):
            pass
    with worker.hold("B", alone=True, wait_s=0.2):       # kept for B: no wait
        with pytest.raises(TimeoutError, match="alone: B$"):
            with share.hold("C", wait_s=0.2):
                pass
    with share.hold("C", wait_s=1.0):                    # B was the last alone test
        pass
    with worker.hold("D", alone=True, then_alone=True):
        pass
    with worker.hold("E", wait_s=1.0):                   # a shared test: D's machine given back
        with share.hold("C", wait_s=1.0):
            pass
    with worker.hold("F", alone=True, then_alone=True):
        pass
    worker.close()
    with share.hold("C", wait_s=1.0):
        pass
