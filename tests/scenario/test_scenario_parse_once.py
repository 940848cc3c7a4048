"""Parse once (issue 25): a scenario's ``parallel.microbatches`` and ``parallel.schedule``
are validated once by the parser per sweep point, and at most once by each public
algorithm entry point that a point's build and run reach; the model is typed (enums).

The counts are taken on the real code paths: every JSON-Schema pass over a document that
holds those keys (``jsonschema.Draft202012Validator.iter_errors``, whoever calls it),
every cross-field check of the MLP workload (``workloads.mlp.validate``), and the
algorithm layers' own checks (``pipeline_parallel.plan.plan_training``,
``pipelining.make_schedule``, and the micro-batch count checks inside ``pipelining``:
the generators' and ``Schedule``'s calls of :func:`mesh.arguments.as_int` on it).
"""

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

import pipeline_parallel.gpt
import pipeline_parallel.plan
import pipelining
import pipelining.generators
import pipelining.schedule
from vcluster.scenario import (ScenarioError, build_workload, load_scenario, run_scenario,
                               scenario_from_dict, sweep_points)
from vcluster.scenario.choices import Algorithm, ArrayModule, Mode, Recompute, ScheduleName
from vcluster.scenario.workloads import workload_module

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "scenarios" / "mlp_schedules.yaml"
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]     # the file's sweep
pytestmark = pytest.mark.timeout(300)


class Counts:
    """Counters by schedule name (one counter per kind of check)."""

    def __init__(self):
        self.schema, self.semantics = Counter(), Counter()
        self.plan, self.make_schedule, self.microbatch_checks = Counter(), Counter(), Counter()
        self.current = None          # the schedule whose make_schedule is running
        self.depth = 0               # nesting of jsonschema's iter_errors


@pytest.fixture
def counts(monkeypatch):
    c = Counts()

    iter_errors = jsonschema.Draft202012Validator.iter_errors

    def counting_iter_errors(self, instance, *args, **kwargs):
        """One count per schema pass over a whole document (not its nested descents)."""
        par = instance.get("parallel") if isinstance(instance, dict) else None
        if c.depth == 0 and isinstance(par, dict) and ("microbatches" in par
                                                       or "schedule" in par):
            c.schema[str(par.get("schedule"))] += 1
        c.depth += 1
        try:
            yield from iter_errors(self, instance, *args, **kwargs)
        finally:
            c.depth -= 1

    monkeypatch.setattr(jsonschema.Draft202012Validator, "iter_errors", counting_iter_errors)

    mlp_module = workload_module("mlp")
    validate = mlp_module.validate

    def counting_validate(scenario, mesh):
        c.semantics[str(scenario.parallel["schedule"])] += 1
        return validate(scenario, mesh)

    monkeypatch.setattr(mlp_module, "validate", counting_validate)

    plan_training = pipeline_parallel.plan.plan_training

    def counting_plan(mlp, mesh, batch, microbatches, schedule, virtual_stages):
        c.plan[str(schedule)] += 1
        return plan_training(mlp, mesh, batch, microbatches, schedule, virtual_stages)

    monkeypatch.setattr(pipeline_parallel.plan, "plan_training", counting_plan)
    monkeypatch.setattr(mlp_module, "plan_training", counting_plan, raising=False)

    make_schedule = pipelining.generators.make_schedule

    def counting_make_schedule(name, *args, **kwargs):
        c.make_schedule[str(name)] += 1
        c.current = str(name)
        try:
            return make_schedule(name, *args, **kwargs)
        finally:
            c.current = None

    for module in (pipelining, pipelining.generators, pipeline_parallel.plan,
                   pipeline_parallel.gpt):        # every module that binds the name
        monkeypatch.setattr(module, "make_schedule", counting_make_schedule)

    as_int = pipelining.generators.as_int

    def counting_as_int(value, what, *args, **kwargs):
        if "microbatches" in what:
            c.microbatch_checks[c.current] += 1
        return as_int(value, what, *args, **kwargs)

    for module in (pipelining.generators, pipelining.schedule):
        monkeypatch.setattr(module, "as_int", counting_as_int)
    return c


def _once_each(counter: Counter, names=SCHEDULES) -> bool:
    return counter == Counter({n: 1 for n in names})


def test_a_sweep_is_validated_once_per_point_by_the_parser(counts):
    scenario = load_scenario(SWEEP)
    assert _once_each(counts.schema), counts.schema    # was 5: the file, then each point
    assert _once_each(counts.semantics), counts.semantics
    assert not counts.plan and not counts.make_schedule      # nothing is built while parsing
    points = sweep_points(scenario)
    assert [str(p.parallel["schedule"]) for _, p in points] == SCHEDULES
    assert _once_each(counts.schema) and _once_each(counts.semantics)   # was 9 and 8


def test_building_every_point_checks_nothing_again_and_each_entry_point_once(counts):
    scenario = load_scenario(SWEEP)
    for i in range(len(SCHEDULES)):
        build_workload(scenario, i)
    assert _once_each(counts.schema), counts.schema    # was 21: each build re-parsed all
    assert _once_each(counts.semantics), counts.semantics
    assert _once_each(counts.plan), counts.plan
    assert _once_each(counts.make_schedule), counts.make_schedule
    # one micro-batch check inside pipelining per make_schedule (was 2: generator + Schedule)
    assert _once_each(counts.microbatch_checks), counts.microbatch_checks


def test_running_one_point_validates_once_per_layer(counts):
    scenario = load_scenario(SWEEP, [("sweep", {"parallel.schedule": ["zero_bubble"]}),
                                     ("run.steps", 1)])
    record = run_scenario(scenario)                      # emulate and simulate (mode both)
    assert record.summary["checks_passed"] is True
    assert record.summary["traffic_matches"] is True
    one = ["zero_bubble"]
    assert _once_each(counts.schema, one), counts.schema
    assert _once_each(counts.semantics, one), counts.semantics
    assert _once_each(counts.plan, one), counts.plan
    assert _once_each(counts.make_schedule, one), counts.make_schedule
    assert _once_each(counts.microbatch_checks, one), counts.microbatch_checks


def test_closed_choices_are_str_enums():
    scenario = load_scenario(SWEEP)
    _, point = sweep_points(scenario)[2]
    assert point.run.mode is Mode.BOTH and point.run.mode == "both"
    assert point.parallel["schedule"] is ScheduleName.INTERLEAVED_1F1B
    assert point.cluster.array_module is ArrayModule.NUMPY
    assert f"{point.parallel['schedule']}" == "interleaved_1f1b"
    assert json.dumps({"mode": point.run.mode}) == '{"mode": "both"}'
    assert pipelining.make_schedule(point.parallel["schedule"], 4, 8).name == "interleaved_1f1b"
    gpt = scenario_from_dict({"workload": {"kind": "transformer"},
                              "parallel": {"pp": 2, "recompute": "full"}})
    assert gpt.parallel["recompute"] is Recompute.FULL
    coll = scenario_from_dict({"cluster": {"mesh": {"x": 2}}, "workload": {"kind": "collective"},
                               "parallel": {"algorithm": "ring"}})
    assert coll.parallel["algorithm"] is Algorithm.RING


def test_a_bad_choice_names_the_key_path_the_value_and_the_allowed_values():
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict({"workload": {"kind": "mlp"},
                            "parallel": {"pp": 2, "schedule": "2f2b"}})
    assert (info.value.path, info.value.value) == ("parallel.schedule", "2f2b")
    assert "sweep point" not in str(info.value)
    with pytest.raises(ScenarioError) as info:
        load_scenario(SWEEP, [("sweep", {"parallel.schedule": ["gpipe", "2f2b"]})])
    err = info.value
    assert err.path == "parallel.schedule" and err.value == "2f2b"
    assert err.allowed == ", ".join(ScheduleName.values())
    assert "sweep point parallel.schedule='2f2b'" in str(err)
    with pytest.raises(ScenarioError) as info:
        run_scenario(load_scenario(SWEEP), mode="fast")
    assert info.value.path == "--mode" and info.value.allowed == "emulate, simulate, both"


def test_the_enums_name_what_the_layers_below_accept():
    """The scenario's closed choices are the algorithm and engine layers' own lists, so the
    file format cannot drift from what the code runs."""
    from tensor_parallel.transformer import RECOMPUTE
    from vcluster.runtime.algorithm import ALGORITHMS
    assert set(ScheduleName.values()) == set(pipelining.SCHEDULE_NAMES)
    assert set(Recompute.values()) == set(RECOMPUTE)
    assert set(Algorithm.values()) == {"auto"} | {a for v in ALGORITHMS.values() for a in v}
    assert set(ArrayModule.values()) >= {"numpy", "cupy"}
    assert set(Mode.values()) == {"emulate", "simulate", "both"}
