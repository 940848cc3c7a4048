"""How tests share the machine when the suite runs on several pytest-xdist workers.

Most tests only need a share of the cores. Some need more:

* ``@pytest.mark.alone``: the machine to themselves. Their assertions are wall-clock
  thresholds (a step within 20% of another, an abort within 2 s), count what the whole
  machine holds (shared-memory segments), or start so many processes (256 devices) that
  a test beside them would get no CPU and time out.
* ``@pytest.mark.heavy``: gigabytes of memory (a width-4096 MLP's arenas). They run
  beside ordinary tests, but never two at once.

Locks over files of the run's temporary directory (``flock``, so a worker that dies
releases what it held):

* ``machine.lock``, a readers-writer lock: a test passes a turnstile (exclusive, released
  at once) and holds it shared for its whole run; an alone test holds the turnstile for
  its whole run — so no other test starts after it asked — and takes ``machine.lock``
  exclusive once the tests already running on other workers have finished;
* ``heavy.lock``: exclusive, taken by a heavy test first.

Without workers (``pytest -n 0``) nothing is locked. Every wait has a deadline, and its
error names who waits and the last test that held the lock it waits for.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MachineShare", "WAIT_S", "POLL_S"]

# Longest a test waits for the machine: the longest single test's own timeout (the soaks'
# 900 s) with room to spare; a wait that long means a test on another worker hangs.
WAIT_S = 1200.0
POLL_S = 0.02


@dataclass(frozen=True)
class MachineShare:
    """The lock files of one run (``directory``: shared by its workers)."""

    directory: Path

    @contextmanager
    def hold(self, who: str, alone: bool = False, heavy: bool = False,
             wait_s: float = WAIT_S):
        """Hold the machine for test ``who``: alone (exclusive) or shared; ``heavy``: and
        the heavy lock."""
        d = self.directory
        files = [open(d / name, "a+") for name in ("heavy.lock", "machine.turnstile",
                                                    "machine.lock")]
        heavy_lock, turnstile, machine = files
        deadline = time.monotonic() + wait_s
        held = []
        try:
            if heavy:
                _take(heavy_lock, fcntl.LOCK_EX, who, "the heavy lock", d / "heavy.holder",
                      deadline)
                held.append(heavy_lock)
                (d / "heavy.holder").write_text(who)
            _take(turnstile, fcntl.LOCK_EX, who, "the turnstile", d / "machine.holder",
                  deadline)
            held.append(turnstile)
            _take(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, who,
                  "the machine" + (" alone" if alone else ""), d / "machine.holder", deadline)
            held.append(machine)
            if alone:
                (d / "machine.holder").write_text(who)
            else:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                held.remove(turnstile)
            yield
        finally:
            for f in reversed(held):
                fcntl.flock(f, fcntl.LOCK_UN)
            for f in files:
                f.close()


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
                    f"test that held it exclusively: {last}") from None
            time.sleep(POLL_S)
