"""A progress bar on stderr (rich), silent when asked or when stderr is not a terminal."""

from __future__ import annotations

import sys

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar(total, enabled) as bar: bar.advance("emulate step 1")``.

    Shown only when ``enabled`` and stderr is a terminal; transient (erased at the end).
    """

    def __init__(self, total: int, enabled: bool = True, title: str = "vcluster run"):
        self.enabled = bool(enabled) and sys.stderr.isatty()
        self.total, self.title = max(1, int(total)), title
        self._progress = self._task = None

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"),
                                      TimeElapsedColumn(), transient=True,
                                      console=Console(stderr=True))
            self._progress.__enter__()
            self._task = self._progress.add_task(self.title, total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"{self.title}: {text}")

    def advance(self, text: str | None = None) -> None:
        if self._progress is not None:
            if text:
                self.describe(text)
            self._progress.advance(self._task)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None
