"""Scenario files: ``vcluster run scenario.yaml`` (the front door; docs/scenario.md).

Stable interfaces (other commands and helpers build on them):

* ``load_scenario(path, overrides=()) -> Scenario`` — read YAML, apply ``--set``
  overrides (``"key.path=value"`` strings or ``(path, value)`` pairs; values parsed as
  YAML), and parse once: validate against the JSON Schema (:func:`scenario_schema`,
  printed by ``vcluster schema``) and the cross-field rules (mesh sizes, divisibility,
  policies, schedules, hardware) of every sweep point, into a frozen, typed model (enums
  for closed choices: :mod:`.choices`). Raises :class:`ScenarioError` with ``.path`` (key
  path), ``.value`` and ``.allowed``; the CLI maps it to exit code 2. Nothing downstream
  (``sweep_points``, ``build_workload``, the runner) validates the scenario again.
* ``build_workload(scenario, point=0) -> Workload`` (of sweep point ``point``) — ``.mesh``,
  the per-device ``.program(dev, *args)``, ``.args_by_rank`` (real per-rank inputs; empty
  with ``run.mode: simulate``), ``.meta_args_by_rank`` (shape-only twins for the tracer), ``.assemble(outputs_by_rank)`` (named global
  arrays), ``.reference()`` (the same names, unsharded numpy) and ``.check(outputs_by_rank,
  tolerance)``. Per-rank outputs are what ``program`` returns on each rank.
* ``run_scenario(scenario, *, mode=None, engine="emulator", progress=False,
  resume=None) -> reports.RunRecord`` — emulate and/or simulate every sweep point
  (``resume``: a checkpoint directory, docs/faults.md). Engines are made in one place,
  :func:`vcluster.scenario.engines.make_engine` (``ENGINES``).

A scenario is built from sections (``cluster, hardware, workload, parallel, run, faults,
checkpoint, data_parallel, sweep, report``); a new section is one more property in :mod:`.schema` and one more field of
:class:`Scenario`.
"""

from .errors import ScenarioError
from .load import load_scenario, parse_override, scenario_from_dict, sweep_points
from .model import Scenario
from .schema import scenario_schema
from .semantics import resolve_mesh as _resolve_mesh

__all__ = ["ScenarioError", "Scenario", "load_scenario", "scenario_from_dict",
           "parse_override", "sweep_points", "scenario_schema", "build_workload",
           "run_scenario", "resolve_mesh"]


def build_workload(scenario, point: int = 0):
    """The :class:`~vcluster.scenario.workloads.Workload` of ``scenario`` (of sweep point
    ``point`` when it sweeps)."""
    from .workloads import workload_module  # lazy: keeps vcluster --help fast (numpy)
    _, p = sweep_points(scenario)[point]
    return workload_module(p.workload.kind).build(p, _resolve_mesh(p))


def resolve_mesh(scenario):
    """The :class:`mesh.Mesh` the scenario runs on (the parser resolved it)."""
    return _resolve_mesh(scenario)


def run_scenario(scenario, *, mode=None, engine="emulator", progress=False, resume=None):
    """See the module docstring and :mod:`vcluster.scenario.runner`."""
    from .runner import run_scenario as _run  # lazy: keeps vcluster --help fast (pandas)
    return _run(scenario, mode=mode, engine=engine, progress=progress, resume=resume)
