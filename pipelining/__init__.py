"""Pipeline-parallel schedules as plain data: generate, validate, time, draw.

* :class:`Action` ``(stage, kind, microbatch)``, kinds F / B / I / W, text ``"1F0"``.
* :class:`Schedule`: per pipeline rank, its ordered actions; generators
  :func:`gpipe` (Huang et al. 2019), :func:`one_f_one_b` (PipeDream-Flush,
  Narayanan et al. 2021), :func:`interleaved_1f1b` (Megatron-LM, Narayanan et
  al. SC21), :func:`zero_bubble` (ZB-H1, Qi et al. 2023); :func:`make_schedule`;
  :func:`combined_1f1b` / :func:`combined_pairs` (Megatron-Core's MoE overlap).
* :func:`validate` / :func:`violations`: rules R0..R4, deadlock included.
* :func:`simulate`: ideal timing (zero latency), bubbles; closed forms beside it.
* :func:`format_grid`: the steps x ranks grid (``str(schedule)``).
* :class:`Pipeline`: a schedule laid over one axis of a :class:`mesh.Mesh`.

Pure: no processes, no clocks, no module-level mutable state.
"""

from .actions import B, F, I, W, Action, ActionKind  # noqa: E741
from .closed_form import (bubble_fraction_closed_form, bubble_time_closed_form,
                          relative_bubble_closed_form)
from .errors import ScheduleError
from .generators import (COMBINED_SCHEDULES, SCHEDULE_NAMES, combined_1f1b, combined_pairs, gpipe,
                         interleaved_1f1b, make_schedule, one_f_one_b, zero_bubble)
from .grid import format_grid, format_grid_html, grid_cells
from .pipeline import Pipeline, PipelineStage
from .schedule import Schedule
from .ideal_timing import (SimulationResult, TimedAction, in_flight_profile, peak_in_flight,
                           simulate, unit_timelines)
from .validate import RULES, Violation, validate, violations

__all__ = [
    "Action", "ActionKind", "F", "B", "I", "W",
    "Schedule", "ScheduleError",
    "SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble", "make_schedule",
    "combined_1f1b", "combined_pairs", "COMBINED_SCHEDULES",
    "RULES", "Violation", "violations", "validate",
    "TimedAction", "SimulationResult", "simulate", "unit_timelines",
    "in_flight_profile", "peak_in_flight",
    "bubble_time_closed_form", "bubble_fraction_closed_form", "relative_bubble_closed_form",
    "grid_cells", "format_grid", "format_grid_html",
    "Pipeline", "PipelineStage",
]
