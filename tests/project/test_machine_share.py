"""The locks by which tests share the machine on several workers (tests/machine_share.py):
shared holders run together, an alone holder runs with none, a waiting alone test lets no
new test start, and every wait ends in an error naming who waits (real files, real flock;
flock locks belong to each open file, so threads stand in for workers)."""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

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


# -- the plugin, in a real pytest run on two xdist workers -----------------------------

REPO = Path(__file__).resolve().parents[2]

_INNER_CONFTEST = """
import sys
sys.path.insert(0, {repo!r})
from tests.machine_share import MachineSharePlugin

def pytest_configure(config):
    config.pluginmanager.register(MachineSharePlugin(wait_s={wait_s!r}), "machine-share")
"""

_INNER_LOG = """
import time

def log(event):
    with open({log!r}, "a") as f:
        f.write(f"{{event}} {{time.monotonic()!r}}\\n")
"""


def _inner_run(tmp_path, files: dict, wait_s: float):
    """Run ``pytest -n 2`` over ``files`` in ``tmp_path`` with the plugin registered;
    returns (the completed process, the logged events: name -> time)."""
    log = tmp_path / "events.log"
    (tmp_path / "conftest.py").write_text(
        _INNER_CONFTEST.format(repo=str(REPO), wait_s=wait_s) + _INNER_LOG.format(log=str(log)))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    alone: runs with no other test beside it\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "2", "--dist", "worksteal",
         "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "COLUMNS": "400"})
    events = {}
    if log.exists():
        for line in log.read_text().splitlines():
            name, at = line.rsplit(" ", 1)
            events[name] = float(at)
    return done, events


_ALONE_TEST = """
import time
import pytest
from conftest import log

@pytest.mark.alone
def test_alone():
    log("alone start")
    time.sleep({sleep_s})
    log("alone end")
"""


def test_a_module_fixture_is_set_up_and_torn_down_inside_the_test_s_hold(tmp_path):
    """The hold spans the test's whole protocol: another worker's module-scoped fixture
    (a table simulated once for its module; a cluster closed after its last test) never
    runs beside an alone test (held by a function fixture, it did: fixtures of wider scope
    are set up first)."""
    shared = """
import time
import pytest
from conftest import log

@pytest.fixture(scope="module")
def table():
    log("fixture start")
    time.sleep(0.5)
    yield
    time.sleep(0.3)
    log("fixture end")

def test_uses_the_table(table):
    log("shared test")
"""
    done, events = _inner_run(tmp_path, {"test_a.py": _ALONE_TEST.format(sleep_s=1.5),
                                         "test_b.py": shared}, wait_s=60.0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    alone = (events["alone start"], events["alone end"])
    shared_span = (events["fixture start"], events["fixture end"])
    assert alone[1] <= shared_span[0] or shared_span[1] <= alone[0], events


def test_a_wait_past_its_deadline_fails_the_test_s_setup_naming_who_waits(tmp_path):
    """Whichever of the two takes the machine first holds it for 4 s; the other waits
    0.5 s and fails in setup, before any of its fixtures, with the error naming it."""
    shared = """
import time
import pytest
from conftest import log

@pytest.fixture
def fixture():
    log("fixture of the shared test")

def test_shared(fixture):
    time.sleep(4.0)
"""
    done, events = _inner_run(tmp_path, {"test_a.py": _ALONE_TEST.format(sleep_s=4.0),
                                         "test_b.py": shared}, wait_s=0.5)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed, 1 error" in done.stdout, done.stdout
    assert re.search(r"ERROR .*test_[ab]\.py::test_(alone|shared) - TimeoutError: "
                     r"\S+ waited \d+ s for the (turnstile|machine)", done.stdout), done.stdout
    if "test_b.py::test_shared - TimeoutError" in done.stdout:
        assert "fixture of the shared test" not in events
