"""``vcluster bench predict --scenarios``: the ``localhost`` timing model against the
bundled emulated scenarios.

Every sweep point of every scenario of ``scenarios/`` that emulates (``run.mode`` emulate
or both) is built as the scenario runner builds it
(:func:`vcluster.scenario.build_workload`: the per-device program and its inputs) and
then measured and predicted exactly like the built-in workloads of
:mod:`vcluster.cli.bench_predict`: measured on a :class:`~vcluster.VirtualCluster` from an
instant all devices agree on (median of ``reps`` runs after a warm-up; start-up and host
transfers excluded), predicted by tracing the same program and replaying it with
:class:`~vcluster.localhost.cost_model.LocalhostCostModel` on the machine's core pool. The
goal: every point within 25%. (A scenario's ``faults`` and ``checkpoint`` sections do not
change its program: ``faults.yaml`` is measured as its plain training step.) That the
traffic of these runs equals the trace is a test (tests/timing/test_timing_scenario_traffic.py).

JSON: the record of :func:`~vcluster.cli.bench_predict.run_workloads` (``workloads``
named ``<scenario>/<point>``, ``max_error``) plus ``scenario_paths``, the files measured
(absolute), ``within_goal``, the number of points
within 25%, and ``outside_goal_surely``, the number whose whole ``ratio_interval`` lies
beyond 25% (a miss of the model rather than of the machine's noise, as far as the
rounds can tell).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SCENARIO_DIR", "GOAL", "check_emulates", "emulated_scenarios", "scenario_workloads",
           "run_scenarios_predict", "goal_counts"]

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "scenarios"
GOAL = 0.25                         # |predicted / measured - 1| of every point


def emulated_scenarios(directory: Path = SCENARIO_DIR) -> list[Path]:
    """The bundled scenario files that emulate."""
    # lazy: keeps vcluster --help fast
    from vcluster.scenario import load_scenario
    if not directory.is_dir():
        raise FileNotFoundError(f"bench predict --scenarios: no scenario folder {directory} "
                                "(the bundled scenarios ship with the source tree)")
    return [p for p in sorted(directory.glob("*.yaml"))
            if load_scenario(p).run.mode != "simulate"]


def check_emulates(scenario, path) -> None:
    """Raise unless ``scenario`` (read from ``path``) emulates: there is a run to measure."""
    if scenario.run.mode == "simulate":
        raise ValueError(f"bench predict: scenario {path} has run.mode 'simulate': nothing "
                         "to measure; give one whose run.mode is emulate or both")


def scenario_workloads(paths=None) -> list:
    """One :class:`~vcluster.cli.bench_predict_workloads.BenchWorkload` per sweep point of ``paths``
    (default: :func:`emulated_scenarios`); a scenario that only simulates is an error."""
    # lazy: keeps vcluster --help fast
    from vcluster.scenario import build_workload, load_scenario, sweep_points
    from .bench_predict_workloads import BenchWorkload
    out = []
    for path in paths or emulated_scenarios():
        scenario = load_scenario(Path(path))
        check_emulates(scenario, path)
        for i in range(len(sweep_points(scenario))):
            w = build_workload(scenario, i)
            out.append(BenchWorkload(f"{Path(path).stem}/{i}", w.mesh, w.program,
                                list(w.args_by_rank), list(w.meta_args_by_rank), w.dtype))
    return out


def run_scenarios_predict(spec, reps: int = 3, paths=None, progress=None,
                          retries: int = 0, rounds: int = 1, recalibrate=None,
                          steps: int = 1, core_queues: bool = False) -> dict:
    """Measure and predict every point of ``paths`` on the machine ``spec`` describes
    (``rounds``, ``recalibrate``, ``steps`` and ``core_queues``: see
    :func:`~vcluster.cli.bench_predict.run_workloads`)."""
    from .bench_predict import run_workloads
    paths = [Path(p).resolve() for p in (paths or emulated_scenarios())]
    record = run_workloads(spec, scenario_workloads(paths), reps, progress, retries, rounds,
                           recalibrate, steps, core_queues)
    record["scenario_paths"] = [str(p) for p in paths]
    record.update(goal_counts(record["workloads"]))
    return record


def goal_counts(rows: list) -> dict:
    """``within_goal`` and ``outside_goal_surely`` (module doc) of a record's rows."""
    return {"within_goal": sum(abs(r["ratio"] - 1) <= GOAL for r in rows),
            "outside_goal_surely": sum(lo > 1 + GOAL or hi < 1 - GOAL
                                       for lo, hi in (r["ratio_interval"] for r in rows))}
