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

Without workers (``pytest -n 0``) nothing is locked. Every wait has a deadline, and its
error names who waits and the last test that held the machine alone.
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
    def hold(self, who: str, alone: bool = False, wait_s: float = WAIT_S):
        """Hold the machine for test ``who``: alone (exclusive) or shared."""
        d = self.directory
        turnstile, machine = (open(d / name, "a+") for name in ("machine.turnstile",
                                                                "machine.lock"))
        holder = d / "machine.holder"
        deadline = time.monotonic() + wait_s
        held = []
        try:
            _take(turnstile, fcntl.LOCK_EX, who, "the turnstile", holder, deadline)
            held.append(turnstile)
            _take(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, who,
                  "the machine" + (" alone" if alone else ""), holder, deadline)
            held.append(machine)
            if alone:
                holder.write_text(who)
            else:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                held.remove(turnstile)
            yield
        finally:
            for f in reversed(held):
                fcntl.flock(f, fcntl.LOCK_UN)
            turnstile.close()
            machine.close()


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
