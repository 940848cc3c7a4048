"""Progress as short lines on stderr, for a long command whose output goes to a pipe or a
file (issue 56: ``vcluster plan ... | tee`` and ``vcluster validate-model > log`` printed
nothing until the end, minutes later).

A terminal gets rich's live bar (:func:`vcluster.planner.search.plan_gpt`'s ``progress``);
a bar on a pipe would be escape codes, so there :class:`ProgressLines` prints a line per
task at most every ``every_s`` seconds, and one when the task completes::

    plan: 480/480 candidates screened in 0.4 s
    plan: 4/10 candidates replayed (5 s)
    plan: 10/10 candidates replayed in 11.2 s

It answers the calls of rich's ``Progress`` that the planner makes (``add_task``,
``advance``, ``start``, ``stop``), so either can be handed to it. Each object keeps its own
tasks and clock: two runs in one process do not share a counter.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

__all__ = ["ProgressLines", "PROGRESS_EVERY_S"]

#: the least time between two lines of one task (the completion line is always printed)
PROGRESS_EVERY_S = 5.0


@dataclass
class _Task:
    description: str          # what is counted, in the plural: "candidates replayed"
    total: int | None         # None: open-ended (finish() prints the last line)
    started_s: float
    last_line_s: float
    done: int = 0
    finished: bool = False


class ProgressLines:
    """Progress lines ``"<prefix>: <done>/<total> <description> (<elapsed> s)"`` on
    ``stream`` (default: ``sys.stderr`` when a line is printed), at most one per task every
    ``every_s`` seconds, and ``"... in <elapsed> s"`` when a task reaches its total (or
    :meth:`finish` ends it). ``clock``: seconds, monotonic (a test passes its own)."""

    def __init__(self, prefix: str, stream=None, every_s: float = PROGRESS_EVERY_S,
                 clock=time.monotonic):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"ProgressLines: prefix must be a non-empty str, got {prefix!r}")
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s < 0:
            raise ValueError(f"ProgressLines: every_s must be seconds >= 0, got {every_s!r}")
        self.prefix, self.stream, self.every_s, self.clock = prefix, stream, every_s, clock
        self._tasks: list[_Task] = []

    def add_task(self, description: str, total: int | None = None, **_fields) -> int:
        """A new task counting ``description`` up to ``total`` (None: open-ended); its id.
        Other keyword arguments (rich's) are ignored."""
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < 0):
            raise ValueError(f"ProgressLines: total must be an int >= 0 or None, got {total!r}")
        now = self.clock()
        self._tasks.append(_Task(str(description), total, now, now))
        return len(self._tasks) - 1

    def advance(self, task: int, advance: int = 1) -> None:
        """``advance`` more items of ``task`` done: a line when ``every_s`` has passed since
        the task's last one, or when it reaches its total."""
        t = self._tasks[task]
        t.done += advance
        now = self.clock()
        if t.total is not None and t.done >= t.total:
            self.finish(task)
        elif now - t.last_line_s >= self.every_s:
            t.last_line_s = now
            self._print(f"{self._count(t)} {t.description} ({now - t.started_s:.0f} s)")

    def finish(self, task: int) -> None:
        """End ``task``: its last line, ``"... in <elapsed> s"`` (once)."""
        t = self._tasks[task]
        if not t.finished:
            t.finished = True
            self._print(f"{self._count(t)} {t.description} in "
                        f"{self.clock() - t.started_s:.1f} s")

    def start(self) -> None:
        """Nothing to start (rich's Progress starts its live display here)."""

    def stop(self) -> None:
        """Nothing to stop: each task printed its own last line."""

    @staticmethod
    def _count(t: _Task) -> str:
        return f"{t.done}" if t.total is None else f"{t.done}/{t.total}"

    def _print(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.stream or sys.stderr, flush=True)
