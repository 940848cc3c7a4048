"""Steps x ranks grid of a schedule, as text or as an HTML table.

Timing is the unit-cost run of :func:`pipelining.ideal_timing.unit_timelines`:
every action takes one step and starts as soon as its rank is free and its
dependencies are done, so pipeline bubbles show as empty cells.  Row ``t``
shows, for each rank, the action running during step ``t``.
"""

from __future__ import annotations

import html

from .actions import Action, ActionKind
from .ideal_timing import unit_timelines
from .schedule import Schedule

__all__ = ["grid_cells", "format_grid", "format_grid_html"]

_COLOURS = {ActionKind.F: "#cfe2ff", ActionKind.B: "#d1e7dd", ActionKind.I: "#d1e7dd",
            ActionKind.W: "#ffe5b4"}


def grid_cells(schedule: Schedule) -> tuple[tuple[Action | None, ...], ...]:
    """``cells[t][r]``: the action rank ``r`` runs in step ``t`` (None = idle)."""
    timelines = unit_timelines(schedule)
    steps = max((step + 1 for row in timelines for _, step in row), default=0)
    cells = [[None] * schedule.ranks for _ in range(steps)]
    for r, row in enumerate(timelines):
        for a, step in row:
            cells[step][r] = a
    return tuple(tuple(row) for row in cells)


def format_grid(schedule: Schedule, empty: str = ".") -> str:
    """The grid as text: a header ``step rank 0 rank 1 ...``, then one line per step.

    Idle cells print ``empty``.  Raises :class:`ScheduleError` if the schedule
    is invalid (it cannot be timed).
    """
    cells = grid_cells(schedule)
    heads = [f"rank {r}" for r in range(schedule.ranks)]
    width = max([len(h) for h in heads] + [len(str(a)) for row in cells for a in row if a]
                + [len(empty)])
    step_w = max(len("step"), len(str(max(len(cells) - 1, 0))))
    lines = ["step".rjust(step_w) + "  " + "  ".join(h.ljust(width) for h in heads)]
    for t, row in enumerate(cells):
        text = "  ".join((str(a) if a else empty).ljust(width) for a in row)
        lines.append(f"{str(t).rjust(step_w)}  {text}".rstrip())
    return "\n".join(line.rstrip() for line in lines)


def format_grid_html(schedule: Schedule) -> str:
    """The grid as an HTML table (F blue, B/I green, W orange, idle blank) with a caption."""
    cells = grid_cells(schedule)
    cap = html.escape(f"{schedule.name}: p={schedule.ranks}, m={schedule.microbatches}, "
                      f"v={schedule.virtual_stages}, {len(cells)} unit steps")
    out = ['<table class="pipelining-schedule" style="border-collapse:collapse;'
           'font-family:monospace;font-size:12px">',
           f"<caption>{cap}</caption>",
           "<tr><th>step</th>" + "".join(f"<th>rank {r}</th>" for r in range(schedule.ranks))
           + "</tr>"]
    for t, row in enumerate(cells):
        tds = []
        for a in row:
            if a is None:
                tds.append('<td style="border:1px solid #ccc"></td>')
            else:
                tds.append(f'<td style="border:1px solid #ccc;padding:0 4px;'
                           f'background:{_COLOURS[a.kind]}">{html.escape(str(a))}</td>')
        out.append(f"<tr><th>{t}</th>{''.join(tds)}</tr>")
    out.append("</table>")
    return "\n".join(out)
