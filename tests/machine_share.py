"""How tests share the machine when the suite runs on several pytest-xdist workers.

Most tests only need a share of the cores. Tests marked ``@pytest.mark.alone`` need the
machine to themselves: their assertions are wall-clock thresholds (a step within 20% of
another, an abort within 2 s), they count what the whole machine holds (shared-memory
segments), they take gigabytes (a width-4096 MLP's arenas), or they start so many
processes (256 devices) that a test beside them would get no CPU and time out.

A readers-writer lock over two files of the run's temporary directory (``flock``, so a
worker that dies releases what it held):

* a test that shares the machine passes a turnstile (exclusive, released at once) and
  then holds ``machine.lock`` shared for its whole run;
* an alone test holds the turnstile for its whole run — so no other test starts after it
  asked — and takes ``machine.lock`` exclusive once the tests already running on other
  workers have finished.

An alone test whose worker runs another alone test next keeps both locks for it
(:class:`WorkerHolds`): released in between, the other workers' next test could take the
turnstile first and make the next alone test wait for the whole of it (the suite's alone
tests run back to back on one worker, sorted first: MachineSharePlugin).

A test holds the machine for its whole run protocol — setup, call and teardown, so its
module- and session-scoped fixtures too (a module's table simulated once for its tests,
its clusters closed after its last test) — through :class:`MachineSharePlugin`, which the
suite's conftest registers. The controller makes the run's lock directory and gives its
path to the workers (``workerinput``); a wait that times out fails the test's setup.

Without workers (``pytest -n 0``) nothing is locked. Every wait has a deadline, and its
error names who waits and the last test that held the machine alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["MachineShare", "WorkerHolds", "MachineSharePlugin", "WAIT_S", "POLL_S"]

# Longest a test waits for the machine: the longest single test's own timeout (the soaks'
# 900 s) with room to spare; a wait that long means a test on another worker hangs.
WAIT_S = 1200.0
POLL_S = 0.02


@dataclass(frozen=True)
class MachineShare:
    """The lock files of one run (``directory``: shared by its workers)."""

    directory: Path

    @contextmanager
    def hold(self, who: str, alone: bool = False, wait_s: float = WAIT_S):
        """Hold the machine for test ``who``: alone (exclusive) or shared."""
        held = self.take(who, alone, wait_s)
        try:
            yield
        finally:
            release(held)

    def take(self, who: str, alone: bool = False, wait_s: float = WAIT_S) -> tuple:
        """Take the machine for ``who`` (as :meth:`hold`); returns the open files to give
        to :func:`release`: (turnstile, machine) for an alone holder, (machine,) for a
        shared one."""
        d = self.directory
        turnstile, machine = (open(d / name, "a+") for name in ("machine.turnstile",
                                                                "machine.lock"))
        holder = d / "machine.holder"
        deadline = time.monotonic() + wait_s
        try:
            _take(turnstile, fcntl.LOCK_EX, who, "the turnstile", holder, deadline)
            try:
                _take(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, who,
                      "the machine" + (" alone" if alone else ""), holder, deadline)
            except BaseException:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                raise
        except BaseException:
            turnstile.close()
            machine.close()
            raise
        if alone:
            holder.write_text(who)
            return turnstile, machine
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        turnstile.close()
        return (machine,)


def release(held: tuple) -> None:
    """Unlock and close what :meth:`MachineShare.take` returned, the machine first."""
    for f in reversed(held):
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


class WorkerHolds:
    """One worker's holds, test after test: like :meth:`MachineShare.hold`, except that an
    alone test followed by another alone test on this worker (``then_alone``) keeps the
    turnstile and the machine for it, so that no test of another worker starts in between.
    The one mutable piece of a worker's share (its session fixture owns it); ``close``
    gives back what is kept."""

    def __init__(self, share: MachineShare):
        self.share = share
        self._kept: tuple = ()

    @contextmanager
    def hold(self, who: str, alone: bool = False, then_alone: bool = False,
             wait_s: float = WAIT_S):
        if self._kept and alone:
            held, self._kept = self._kept, ()
            (self.share.directory / "machine.holder").write_text(who)
        else:
            self.close()
            held = self.share.take(who, alone, wait_s)
        try:
            yield
        finally:
            if alone and then_alone:
                self._kept = held
            else:
                release(held)

    def close(self) -> None:
        held, self._kept = self._kept, ()
        if held:
            release(held)


def is_alone(item) -> bool:
    """Whether test ``item`` is marked ``@pytest.mark.alone``."""
    return item.get_closest_marker("alone") is not None


#: the workerinput key that carries the run's lock directory to each worker
DIRECTORY_KEY = "vcluster_machine_directory"
_DIRECTORY = pytest.StashKey[Path]()            # the controller's: made for the run
_HOLDS = pytest.StashKey[WorkerHolds]()          # a worker's
_WAIT_ERROR = pytest.StashKey[BaseException]()   # a test's: its wait for the machine failed


class MachineSharePlugin:
    """The pytest hooks by which a run's tests share the machine (registered by the
    suite's conftest; inert without pytest-xdist workers). ``wait_s``: how long a test
    waits for the machine before its setup fails."""

    def __init__(self, wait_s: float = WAIT_S):
        self.wait_s = wait_s

    def pytest_collection_modifyitems(self, items):
        """Tests marked alone first (in their order), then the rest: on several workers
        one worker runs them back to back at the start (keeping the machine from one to
        the next) while the others wait once, instead of each waiting for whatever long
        test another worker has under way."""
        items.sort(key=lambda item: not is_alone(item))

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        """On the controller, for each worker: the run's lock directory (made once)."""
        config = node.config
        if _DIRECTORY not in config.stash:
            config.stash[_DIRECTORY] = Path(tempfile.mkdtemp(prefix="vcluster-machine-"))
        node.workerinput[DIRECTORY_KEY] = str(config.stash[_DIRECTORY])

    def pytest_configure(self, config):
        directory = getattr(config, "workerinput", {}).get(DIRECTORY_KEY)
        if directory is not None:
            config.stash[_HOLDS] = WorkerHolds(MachineShare(Path(directory)))

    def pytest_unconfigure(self, config):
        holds = config.stash.get(_HOLDS, None)
        if holds is not None:
            holds.close()
        directory = config.stash.get(_DIRECTORY, None)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        """Hold the machine around the test's whole protocol (outside pytest-timeout's
        timer: the wait has its own deadline, WAIT_S)."""
        holds = item.config.stash.get(_HOLDS, None)
        with ExitStack() as stack:
            if holds is not None:
                try:
                    stack.enter_context(holds.hold(
                        item.nodeid, alone=is_alone(item),
                        then_alone=nextitem is not None and is_alone(nextitem),
                        wait_s=self.wait_s))
                except TimeoutError as error:
                    item.stash[_WAIT_ERROR] = error
            yield

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        """A test whose wait for the machine timed out fails here, before any fixture."""
        error = item.stash.get(_WAIT_ERROR, None)
        if error is not None:
            raise error


def _take(f, mode: int, who: str, what: str, holder: Path, deadline: float) -> None:
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                try:
                    last = holder.read_text() or "none yet"
                except OSError:
                    last = "none yet"
                raise TimeoutError(
                    f"{who} waited {time.monotonic() - start:.0f} s for {what} (pid "
                    f"{os.getpid()}): a test on another worker still holds it; the last "
                    f"test that held the machine alone: {last}") from None
            time.sleep(POLL_S)
