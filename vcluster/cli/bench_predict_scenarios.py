"""``vcluster bench predict --scenarios``: the ``localhost`` timing model against the
bundled emulated scenarios.

Every scenario of ``scenarios/`` that emulates (``run.mode`` emulate or both) runs through
the scenario runner (:func:`vcluster.scenario.run_scenario`) in mode ``both`` on
``localhost`` hardware with one calibration for all: each sweep point is emulated (its
measured step time: the median step, from the devices' events) and traced and replayed
on the machine's core pool (its predicted step time), and the runner reports
``predicted_over_measured`` and whether the traffic matched the trace. The goal: every
point within 25%. ``faults.yaml`` runs without its faults and checkpoints (a crash and
restart is not one step to predict). The machine is assumed otherwise idle; each row shows the 1-minute load
average when it started.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SCENARIO_DIR", "emulated_scenarios", "run_scenarios_predict"]

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "scenarios"


def emulated_scenarios(directory: Path = SCENARIO_DIR) -> list[Path]:
    """The bundled scenario files that emulate."""
    from vcluster.scenario import load_scenario
    if not directory.is_dir():
        raise FileNotFoundError(f"bench predict --scenarios: no scenario folder {directory} "
                                "(the bundled scenarios ship with the source tree)")
    return [p for p in sorted(directory.glob("*.yaml"))
            if load_scenario(p).run.mode != "simulate"]


def run_scenarios_predict(spec_path: str, paths=None, progress=None) -> dict:
    """Run each scenario of ``paths`` (default: :func:`emulated_scenarios`) as described
    in the module doc, with the LocalhostSpec saved at ``spec_path``."""
    from vcluster.scenario import load_scenario, run_scenario
    rows = []
    for path in paths or emulated_scenarios():
        path = Path(path)
        overrides = [("hardware", {"name": "localhost", "calibration": str(spec_path)}),
                     ("run.mode", "both")]
        scenario = load_scenario(path, overrides)
        if scenario.faults or scenario.checkpoint:       # one plain step, not a recovery
            scenario = load_scenario(path, overrides + [("faults", []), ("checkpoint", {})])
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        record = run_scenario(scenario)
        points = record.sweep.to_dict("records") if record.sweep is not None \
            else [dict(record.summary)]
        for i, s in enumerate(points):
            rows.append({"scenario": path.stem, "point": i, "devices": s.get("devices"),
                         "measured_s": s.get("measured_step_time_s"),
                         "predicted_s": s.get("predicted_step_time_s"),
                         "ratio": s.get("predicted_over_measured"),
                         "traffic_matches": s.get("traffic_matches"), "load_average": load})
            if progress is not None:
                progress(rows[-1])
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    return {"scenarios": rows, "max_error": max((abs(x - 1) for x in ratios), default=None),
            "within_25_percent": sum(abs(x - 1) <= 0.25 for x in ratios),
            "points": len(rows)}
