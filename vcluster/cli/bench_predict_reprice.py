"""``vcluster bench predict --reprice RECORD``: a saved record's measurements priced again
by this tree's model.

Two versions of the ``localhost`` model measured in two runs of ``bench predict`` differ
by the machine's minutes as much as by the models: a whole round's ratios move together
by 0.73-1.08 from one run to the next on the 2-core development machine. A record written
with ``--json`` keeps every calibration (``specs``) and what each round measured, so the
same measurements can be priced again: every workload is traced and replayed under each
of the record's calibrations with the model of this tree (``--core-queues`` as given
now), and each round's new predictions are paired with that round's measurement exactly
as :func:`~vcluster.cli.bench_predict_stats.paired_ratios` paired the old ones. What
changes between the record and its repricing is the model alone (and the host-timed
traces' own noise: about 1% on the scenario points).

Round ``r``'s measured median is ``measured_round_s[r]`` in records written since this
option exists; in older ones it is recovered from the pairing itself, ``mean(predicted
around r) / round_ratio[r]``, which is exact up to the JSON's rounding. Their CPU by round
is not recorded, so an older record's ``cpu_ratio`` is scaled by the new predicted work
over the old (``predicted_cpu_s``).

The workloads are rebuilt by name: a record of ``--scenarios`` names its files
(``scenario_paths``; an older one's points ``<stem>/<i>`` are looked up among the
bundled scenarios), one of the built-in workloads says whether it was ``tiny``
(older ones: not). The record written with ``--json`` has the keys of a measured one
(:mod:`vcluster.cli.bench_predict`) plus ``repriced_from`` (the record's path) and, per
row, ``recorded_ratio``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .bench_predict_workloads import WORKLOADS

__all__ = ["reprice", "record_workloads", "round_medians", "load_record", "reprice_command"]

#: What ``--reprice`` takes from its record instead: (option, attribute, default).
_MEASURING_OPTIONS = (("--spec", "spec", None), ("--save-spec", "save_spec", None),
                      ("--devices", "devices", 8), ("--workloads", "workloads", list(WORKLOADS)),
                      ("--reps", "reps", 3), ("--tiny", "tiny", False), ("--rounds", "rounds", 1),
                      ("--retries", "retries", 0), ("--steps", "steps", 1),
                      ("--scenarios", "scenarios", False), ("--scenario", "scenario", None))


def round_medians(row: dict) -> list:
    """Each round's median measured run of a record's ``row`` (per step)."""
    if "measured_round_s" in row:
        return [float(m) for m in row["measured_round_s"]]
    predicted, ratios = row["predicted_by_spec_s"], row["round_ratios"]
    if len(predicted) == 1:
        return [predicted[0] / r for r in ratios]
    return [float(np.mean(predicted[r:r + 2])) / ratio for r, ratio in enumerate(ratios)]


def record_workloads(record: dict) -> dict:
    """``{name: BenchWorkload}`` for the rows of ``record``, rebuilt as it was measured (module
    doc); a name that cannot be rebuilt is a ValueError naming it."""
    from .bench_predict_workloads import build_bench_workload
    from .bench_predict_scenarios import SCENARIO_DIR, emulated_scenarios, scenario_workloads
    names = [row["name"] for row in record["workloads"]]
    if any("/" in name for name in names):
        paths = record.get("scenario_paths")
        if paths is None:
            stems = {name.rsplit("/", 1)[0] for name in names}
            paths = [p for p in emulated_scenarios() if p.stem in stems]
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise ValueError(f"bench predict --reprice: the record's scenario file "
                             f"{missing[0]} does not exist; reprice it where it was measured")
        built = {wl.name: wl for wl in scenario_workloads(paths)}
        where = f"the scenarios {', '.join(str(p) for p in paths) or SCENARIO_DIR}"
    else:
        tiny = bool(record.get("tiny", False))
        built = {name: build_bench_workload(name, tiny) for name in names if name in WORKLOADS}
        where = f"the built-in workloads {', '.join(WORKLOADS)}"
    unknown = [name for name in names if name not in built]
    if unknown:
        raise ValueError(f"bench predict --reprice: workload {unknown[0]!r} of the record is "
                         f"not among {where}")
    return built


def reprice(record: dict, core_queues: bool = False, progress=None) -> dict:
    """``record`` (a ``bench predict --json`` record, as a dict) with every prediction made
    again by this tree's model under the record's calibrations, paired with the same
    measurements (module doc). ``progress(row)`` gets each new row."""
    # lazy: keeps vcluster --help fast
    from vcluster.localhost.spec import LocalhostSpec
    from .bench_predict import priced, stepped, workloads_record
    try:
        specs = [LocalhostSpec.from_dict(d) for d in record["specs"]]
        rows, steps = record["workloads"], int(record.get("steps", 1))
    except (KeyError, TypeError) as e:
        raise ValueError(f"bench predict --reprice: not a bench predict record (no {e})") \
            from None
    built = record_workloads(record)
    out = []
    for row in rows:
        wl = stepped(built[row["name"]], steps)
        measured = {k: v for k, v in row.items() if k.startswith("measured_")
                    or k in ("name", "devices", "dtype", "background_cores")}
        measured["measured_round_s"] = round_medians(row)
        new = {**measured, **priced(wl, specs, steps, core_queues, measured)}
        if new["cpu_ratio"] is None:            # an older record: no CPU by round
            new["cpu_ratio"] = row["cpu_ratio"] * new["predicted_cpu_s"] / row["predicted_cpu_s"]
        new["recorded_ratio"] = row["ratio"]
        out.append(new)
        if progress is not None:
            progress(new)
    result = workloads_record(specs, steps, core_queues, out)
    for key in ("tiny", "scenario_paths"):
        if key in record:
            result[key] = record[key]
    if "within_goal" in record:
        from .bench_predict_scenarios import goal_counts
        result.update(goal_counts(out))
    return result


def load_record(path) -> dict:
    """The JSON record at ``path``; a missing or unreadable file is a ValueError naming
    it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"bench predict --reprice: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"bench predict --reprice: {path} is not JSON ({e})") from None


def reprice_command(args) -> int:
    """``vcluster bench predict --reprice RECORD [--core-queues] [--json PATH]``: the
    table with the recorded ratio beside the new one, then the counts within the goal, the
    log-sd of the ratios both ways and the point that moved most."""
    from .bench_predict_print import print_drift, print_header, print_row, write_record
    from .bench_predict_scenarios import GOAL
    given = [option for option, attr, default in _MEASURING_OPTIONS
             if getattr(args, attr) != default]
    if given:
        raise ValueError(f"bench predict: --reprice takes the calibrations, workloads, rounds "
                         f"and steps of its record and measures nothing; drop {given[0]}")
    record = load_record(args.reprice)
    rows = record.get("workloads") or []
    print(f"vcluster bench predict: repricing {args.reprice} ({len(record.get('specs', []))} "
          f"calibrations, {len(rows)} workloads) with this tree's model", flush=True)
    points = any("/" in str(r.get("name", "")) for r in rows)
    width = 28 if points else 22
    print_header("scenario point" if points else "workload", width, note="recorded")
    new = reprice(record, args.core_queues,
                  progress=lambda r: print_row(r, width, note=f"{r['recorded_ratio']:.2f}"))
    new["repriced_from"] = str(args.reprice)
    rows = new["workloads"]
    if rows:
        keys = ("ratio", "recorded_ratio")
        within = [sum(abs(r[key] - 1) <= GOAL for r in rows) for key in keys]
        log_sd = [float(np.std(np.log([r[key] for r in rows]))) for key in keys]
        print(f"{within[0]} of {len(rows)} within {GOAL:.0%} (recorded: {within[1]}); "
              f"max |ratio - 1| = {new['max_error']:.1%} (recorded: {record['max_error']:.1%}); "
              f"log-sd of the ratios {log_sd[0]:.3f} (recorded: {log_sd[1]:.3f})")
        moved = max(rows, key=lambda r: abs(math.log(r["ratio"] / r["recorded_ratio"])))
        print(f"moved most: {moved['name']} {moved['recorded_ratio']:.2f} -> "
              f"{moved['ratio']:.2f}")
    print_drift(new)
    write_record(args.json, new)
    return 0
