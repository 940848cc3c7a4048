"""Goldens from scenario files, and checking one golden directory against another.

``export_scenario(FILE, DIR, engine)`` runs every sweep point of a scenario file
(:func:`vcluster.scenario.build_workload`) on the engine and saves one golden per point:
``DIR`` itself for a single point, ``DIR/point<i>`` for a sweep. With the emulator the
results are first checked against the workload's unsharded numpy reference (at the
scenario's tolerance), so a golden is never written from a wrong run; with ``torch`` the
same files hold what the real engine computed, to be checked with :func:`check_dirs`.
"""

from __future__ import annotations

import json
import os


from vcluster.oracle.capture import engine_description, golden_from_run
from vcluster.oracle.compare import Comparison, Mismatch, compare
from vcluster.oracle.golden import load_golden, save_golden

__all__ = ["export_scenario", "check_dirs", "golden_dirs", "describe_engine",
           "scenario_layouts", "ExportError"]


class ExportError(RuntimeError):
    """The emulator's results disagree with the numpy reference: no golden is written."""


def scenario_layouts(point, workload) -> dict:
    """What a golden records as layouts: the scenario's parallel section and the
    operation (its repr names every tensor's layout)."""
    out = {f"parallel.{k}": json.dumps(v, default=str) for k, v in dict(point.parallel).items()}
    for arg in workload.args_by_rank[0]:
        if hasattr(arg, "sharding"):
            out["operation"] = repr(arg)
    return out


def export_scenario(path, out_dir, engine: str = "emulator", overrides=()) -> list[str]:
    """Write the goldens of scenario ``path`` (see the module docstring); return their dirs."""
    # lazy: keeps vcluster --help fast
    from vcluster.scenario import build_workload, load_scenario, sweep_points
    from vcluster.scenario.engines import make_engine
    scenario = load_scenario(path, overrides)
    points = sweep_points(scenario)
    engines, written = {}, []
    try:
        for i, (values, point) in enumerate(points):
            workload = build_workload(scenario, i)
            key = (workload.mesh, point.cluster.array_module)
            if key not in engines:
                engines[key] = make_engine(engine, workload.mesh,
                                           array_module=point.cluster.array_module)
            cluster = engines[key]
            outputs = cluster.run(workload.program, list(workload.args_by_rank))
            if engine == "emulator":
                tolerance = point.run.tolerance_for(workload.dtype)
                bad = [c for c in workload.check(outputs, tolerance) if not c["passed"]]
                if bad:
                    raise ExportError(f"{path} point {i} {values}: the emulator disagrees with "
                                      f"the numpy reference ({bad[0]}); no golden written")
            golden = golden_from_run(
                workload.mesh, workload.args_by_rank, outputs, name=scenario.name,
                seed=point.workload.seed, layouts=scenario_layouts(point, workload),
                scenario={"file": os.path.abspath(os.fspath(path)), "point": values,
                          "document": point.document},
                engine=engine_description(cluster))
            dest = os.fspath(out_dir) if len(points) == 1 else os.path.join(out_dir, f"point{i}")
            written.append(save_golden(golden, dest))
    finally:
        for cluster in engines.values():
            cluster.close()
    return written


def golden_dirs(directory) -> list[str]:
    """``directory`` when it holds a golden, else its ``point<i>`` goldens in order."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, "manifest.json")):
        return [directory]
    points = sorted((d for d in os.listdir(directory) if d.startswith("point")
                     and d[5:].isdigit()), key=lambda d: int(d[5:])) \
        if os.path.isdir(directory) else []
    if not points:
        raise FileNotFoundError(f"{directory!r} holds no golden (no manifest.json, no "
                                "point<i>/ directories); write one with `vcluster oracle export`")
    return [os.path.join(directory, d) for d in points]


def _input_mismatches(golden, actual) -> list[Mismatch]:
    """The actual run must have started from the golden's inputs (by content hash)."""
    out = []
    g, a = golden.manifest["arrays"], actual.manifest["arrays"]
    for r in range(min(len(g), len(a))):
        want, got = g[r].get("inputs", {}), a[r].get("inputs", {})
        for name, meta in want.items():
            if got.get(name, {}).get("sha256") != meta["sha256"]:
                out.append(Mismatch(r, f"inputs/{name}", None, reason="the actual run's input "
                                    "differs from the golden's (sha256)"))
    return out


def check_dirs(golden_dir, actual_dir) -> list[tuple[str, str, Comparison]]:
    """Compare every golden under ``golden_dir`` with its counterpart under ``actual_dir``:
    ``[(golden path, actual path, Comparison)]``."""
    goldens, actuals = golden_dirs(golden_dir), golden_dirs(actual_dir)
    if len(goldens) != len(actuals):
        raise ValueError(f"{golden_dir} holds {len(goldens)} goldens, {actual_dir} holds "
                         f"{len(actuals)}; export both from the same scenario file")
    out = []
    for g_path, a_path in zip(goldens, actuals):
        golden, actual = load_golden(g_path), load_golden(a_path)
        if golden.manifest["mesh"] != actual.manifest["mesh"]:
            raise ValueError(f"{a_path}: mesh {actual.manifest['mesh']} differs from the "
                             f"golden's {golden.manifest['mesh']}")
        result = compare(actual.results_by_rank(), golden)
        bad = _input_mismatches(golden, actual)
        if bad:
            result = Comparison(tuple(bad) + result.mismatches, result.checked + len(bad))
        out.append((g_path, a_path, result))
    return out


def describe_engine(manifest: dict) -> str:
    if manifest.get("engine") == "torch":
        return f"torch {manifest.get('torch_version')} ({manifest.get('torch_backend')})"
    return str(manifest.get("engine"))


