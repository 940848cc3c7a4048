"""In-order list scheduling: the one timing engine behind validate (R4), the grid and simulate.

Dependencies of an action on stage ``s`` of ``S`` stages, micro-batch ``j``:

* ``F(s, j)``   needs ``F(s-1, j)``                       (activations; none for ``s = 0``);
* ``B/I(s, j)`` needs ``F(s, j)`` and the input gradient of ``s+1``, i.e.
  ``B(s+1, j)`` or ``I(s+1, j)``                          (none from ``s+1`` when ``s = S-1``);
* ``W(s, j)``   needs ``I(s, j)``.

Every rank executes its list strictly in order; an action starts as soon as
the rank is free *and* its dependencies have ended (zero communication
latency):

    start(a) = max(end(previous action on the rank), max_{d in deps(a)} end(d)),
    end(a)   = start(a) + duration(a).

These start times are the longest paths of a DAG, so they do not depend on
the order in which ranks are visited.  If some rank can never start its next
action, the lists deadlock; the stuck actions and what they wait for are
returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from .actions import Action, ActionKind

__all__ = ["needs", "describe_need", "Run", "run_in_order"]

# A dependency key: (stage, tag, microbatch); tag "F" = the forward,
# "G" = the input gradient (B or I), "I" = the input-gradient backward.
Key = tuple


def needs(action: Action, stages: int) -> tuple[Key, ...]:
    """The dependency keys of ``action`` in a pipeline of ``stages`` stages (see module doc)."""
    s, j, kind = action.stage, action.microbatch, action.kind
    if kind is ActionKind.F:
        return ((s - 1, "F", j),) if s > 0 else ()
    if kind is ActionKind.W:
        return ((s, "I", j),)
    out: tuple[Key, ...] = ((s, "F", j),)
    if s < stages - 1:
        out += ((s + 1, "G", j),)
    return out


def describe_need(key: Key) -> str:
    """``(1, "G", 0)`` -> ``"1B0 or 1I0"``, ``(0, "F", 2)`` -> ``"0F2"``."""
    s, tag, j = key
    if tag == "G":
        return f"{s}B{j} or {s}I{j}"
    return f"{s}{tag}{j}"


def _provides(action: Action) -> tuple[Key, ...]:
    s, j, kind = action.stage, action.microbatch, action.kind
    if kind is ActionKind.F:
        return ((s, "F", j),)
    if kind is ActionKind.I:
        return ((s, "I", j), (s, "G", j))
    if kind is ActionKind.B:
        return ((s, "G", j),)
    return ()


@dataclass(frozen=True)
class Run:
    """Result of :func:`run_in_order`.

    ``timelines[r]`` holds ``(action, start, end)`` for every action rank ``r``
    managed to run; ``stuck`` one ``(rank, action, missing)`` per rank that
    could not finish, ``missing`` naming the dependencies that never ended.
    """

    timelines: tuple[tuple[tuple[Action, Fraction, Fraction], ...], ...]
    stuck: tuple[tuple[int, Action, tuple[str, ...]], ...]

    @property
    def deadlocked(self) -> bool:
        return bool(self.stuck)


def run_in_order(actions: tuple[tuple[Action, ...], ...], stages: int,
                 duration: Callable[[Action], Fraction]) -> Run:
    """Time per-rank action lists with ``duration(action)`` (see module doc)."""
    p = len(actions)
    pos = [0] * p
    free = [Fraction(0)] * p
    done: dict[Key, Fraction] = {}
    timelines: list[list[tuple[Action, Fraction, Fraction]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            row = actions[r]
            while pos[r] < len(row):
                a = row[pos[r]]
                ready = []
                for key in needs(a, stages):
                    t = done.get(key)
                    if t is None:
                        break
                    ready.append(t)
                else:
                    start = max([free[r], *ready])
                    end = start + duration(a)
                    timelines[r].append((a, start, end))
                    free[r] = end
                    for key in _provides(a):
                        done[key] = end
                    pos[r] += 1
                    progress = True
                    continue
                break
    stuck = []
    for r in range(p):
        if pos[r] < len(actions[r]):
            a = actions[r][pos[r]]
            missing = tuple(describe_need(k) for k in needs(a, stages) if k not in done)
            stuck.append((r, a, missing))
    return Run(tuple(tuple(t) for t in timelines), tuple(stuck))
