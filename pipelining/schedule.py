"""A pipeline schedule: for every pipeline rank, the ordered list of its actions.

Layout.  ``p`` ranks, ``v`` virtual stages (model chunks) per rank, ``S = p * v``
stages numbered ``0 .. S-1`` in model order (stage ``S-1`` computes the loss,
so its backward starts the backward pass).  Stage ``s`` lives on rank
``s mod p``; rank ``r`` holds stages ``r, r + p, ..., r + (v-1) p`` (its
chunks ``0 .. v-1``).  With ``v = 1`` stage ``s`` is rank ``s`` (GPipe, 1F1B,
ZB-H1).  This is Megatron-LM's interleaved layout (Narayanan et al., SC21).

A :class:`Schedule` is plain data; :mod:`pipelining.validate` checks it,
:mod:`pipelining.ideal_timing` times it and ``str(schedule)`` prints its step grid.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterator

from mesh.arguments import as_int

from .actions import Action

__all__ = ["Schedule"]

_FIELDS = ("name", "ranks", "microbatches", "virtual_stages", "actions")


@dataclass(frozen=True, repr=False)
class Schedule:
    """``Schedule(name, ranks, microbatches, virtual_stages, actions)``.

    ``actions[r]`` is rank ``r``'s ordered tuple of :class:`Action`; lists are
    accepted and frozen to tuples.  Construction checks only the shape (``p``
    rank lists of Actions); whether the actions form a correct pipeline is
    :func:`pipelining.validate`'s job, so hand-made broken schedules can be
    built and diagnosed.
    """

    name: str
    ranks: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Schedule: name must be a non-empty str, got {self.name!r}")
        p = as_int(self.ranks, "Schedule: ranks", 1)
        object.__setattr__(self, "ranks", p)
        object.__setattr__(self, "microbatches",
                           as_int(self.microbatches, "Schedule: microbatches", 1))
        object.__setattr__(self, "virtual_stages",
                           as_int(self.virtual_stages, "Schedule: virtual_stages", 1))
        if isinstance(self.actions, (str, bytes)) or not hasattr(self.actions, "__iter__"):
            raise TypeError(
                f"Schedule: actions must be a sequence of {p} per-rank action sequences, "
                f"got {self.actions!r}")
        rows = []
        for r, row in enumerate(self.actions):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
                raise TypeError(
                    f"Schedule: actions[{r}] must be a sequence of Action, got {row!r}")
            row = tuple(row)
            for i, a in enumerate(row):
                if not isinstance(a, Action):
                    raise TypeError(
                        f"Schedule: actions[{r}][{i}] must be an Action, got {a!r} "
                        f"(use Action.parse for text like '1F0')")
            rows.append(row)
        if len(rows) != p:
            raise ValueError(
                f"Schedule: actions must hold one action list per rank, i.e. {p} lists "
                f"for ranks={p}; got {len(rows)}")
        object.__setattr__(self, "actions", tuple(rows))

    # ------------------------------------------------------------ layout
    @property
    def stages(self) -> int:
        """Number of stages ``S = p * v``."""
        return self.ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage``: ``stage mod p``."""
        s = self._check_stage(stage)
        return s % self.ranks

    def chunk_of(self, stage: int) -> int:
        """The chunk (virtual stage) index of ``stage`` on its rank: ``stage // p``."""
        s = self._check_stage(stage)
        return s // self.ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, chunk order: ``(r, r + p, ..., r + (v-1) p)``."""
        r = self._check_rank(rank)
        return tuple(r + c * self.ranks for c in range(self.virtual_stages))

    # ------------------------------------------------------------ access
    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[self._check_rank(rank)]

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.actions)

    @property
    def num_actions(self) -> int:
        """Total number of actions over all ranks."""
        return sum(len(row) for row in self.actions)

    def with_actions(self, actions) -> "Schedule":
        """The same schedule metadata with other per-rank action lists (for experiments)."""
        return Schedule(self.name, self.ranks, self.microbatches, self.virtual_stages, actions)

    @classmethod
    def from_text(cls, name: str, rows, *, microbatches: int,
                  virtual_stages: int = 1) -> "Schedule":
        """Build from per-rank strings, e.g. ``["0F0 0B0", "1F0 1B0"]`` (whitespace-separated)."""
        if isinstance(rows, str):
            raise TypeError("Schedule.from_text: rows must be a list of per-rank strings, "
                            f"got one string {rows!r}")
        actions = [tuple(Action.parse(t) for t in row.split()) for row in rows]
        return cls(name, len(actions), microbatches, virtual_stages, actions)

    # ------------------------------------------------------------ rendering
    def grid(self, empty: str = ".") -> str:
        """The steps x ranks grid of a unit-cost run (see :func:`pipelining.format_grid`)."""
        from .grid import format_grid
        return format_grid(self, empty=empty)

    def __str__(self) -> str:
        from .errors import ScheduleError
        try:
            return self.grid()
        except ScheduleError as exc:
            rows = "\n".join(f"  rank {r}: {' '.join(map(str, row)) or '(none)'}"
                             for r, row in enumerate(self.actions))
            return f"{self!r} -- invalid, no grid: {exc}\n{rows}"

    def _repr_html_(self) -> str:
        from .errors import ScheduleError
        from .grid import format_grid_html
        try:
            return format_grid_html(self)
        except ScheduleError as exc:
            import html
            return f"<pre>{html.escape(str(self))}</pre><p>{html.escape(str(exc))}</p>"

    def __repr__(self) -> str:
        return (f"Schedule(name={self.name!r}, ranks={self.ranks}, "
                f"microbatches={self.microbatches}, virtual_stages={self.virtual_stages}, "
                f"actions=<{self.num_actions} actions on {self.ranks} ranks>)")

    # ------------------------------------------------------------ checks
    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool):
            raise TypeError(f"{self.name}: rank must be an int, got {rank!r}")
        try:
            r = operator.index(rank)
        except TypeError:
            raise TypeError(f"{self.name}: rank must be an int, got {rank!r}") from None
        if not 0 <= r < self.ranks:
            raise ValueError(
                f"{self.name}: rank {r} is out of range; valid ranks are 0..{self.ranks - 1}")
        return r

    def _check_stage(self, stage) -> int:
        if isinstance(stage, bool):
            raise TypeError(f"{self.name}: stage must be an int, got {stage!r}")
        try:
            s = operator.index(stage)
        except TypeError:
            raise TypeError(f"{self.name}: stage must be an int, got {stage!r}") from None
        if not 0 <= s < self.stages:
            raise ValueError(
                f"{self.name}: stage {s} is out of range; valid stages are 0..{self.stages - 1} "
                f"(p={self.ranks} ranks x v={self.virtual_stages} virtual stages)")
        return s


def _generated(name: str, ranks: int, microbatches: int, virtual_stages: int,
               rows) -> Schedule:
    """A :class:`Schedule` made by a generator (:mod:`pipelining.generators`) from counts
    it has checked, its rows tuples of :class:`Action` by construction: the constructor's
    checks are not run a second time (one check per public entry point)."""
    schedule = object.__new__(Schedule)
    for key, value in zip(_FIELDS, (name, ranks, microbatches, virtual_stages, tuple(rows))):
        object.__setattr__(schedule, key, value)
    return schedule
