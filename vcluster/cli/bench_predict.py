"""``vcluster bench predict``: the ``localhost`` timing model against the emulator itself.

For each bundled workload, the same per-device program is

* **measured** on a :class:`~vcluster.VirtualCluster`: the devices agree on a start
  instant, sleep until shortly before it and spin the rest (so that all are
  runnable at that instant, as in the replay: leaving a barrier instead staggers them by
  up to ~10 ms on 2 cores busy with 8 devices, and waking from ``time.sleep`` alone
  comes ~0.25 ms late on a virtual machine's timers), run the program, note its end and
  wait in a barrier (a futex: no CPU) until every device has ended, so that a device
  done early does not answer the host while the others still run; the wall time is
  ``max(end) - start`` (cluster start-up, host transfers and the synchronisation before
  and after excluded; :func:`~vcluster.localhost.start.timed_run`); the median of
  ``reps`` runs after one warm-up (:mod:`vcluster.cli.bench_predict_measure`);
* **predicted** by tracing it on shape-only arrays, with the program's own host work
  (:func:`~vcluster.localhost.cost_model.localhost_traces`), and replaying the traces with
  :class:`~vcluster.localhost.cost_model.LocalhostCostModel` on the machine's core pool.
  Neither side re-plans a sharded op's redistributions run after run: plans are
  memoised per process (``MatMulSharding.plan``), filled on the devices by the warm-up
  run and in the predicting process by a first, untimed trace.

``ratio`` is predicted over measured time (with ``--rounds``: paired round by round,
below); the goal is every workload within 25%. The machine is
calibrated first (:func:`~vcluster.localhost.calibrate.calibrate_localhost`), or
its spec read from ``--spec``. The workloads: :mod:`vcluster.cli.bench_predict_workloads`
(``--tiny`` shrinks each one to a smoke test, not a benchmark).

The model assumes the machine is otherwise idle: ``background_cores`` is the number of
cores the machine's other processes used during the timed runs (Linux; ``None``
elsewhere), flagged when above :data:`BUSY_MACHINE_CORES`.

``--rounds R`` measures every workload in R rounds and, unless ``--spec`` is given,
calibrates again after each round: this machine's speed drifts by tens of per cent over
minutes, so the calibrations bracket the measurements. Each round is compared with the
calibrations around it: its ratio is the mean of the predictions from the calibration
before it and the one after it, over the median of its runs (with ``--spec``: the one
spec's prediction over it), and a workload's ``ratio`` is the median of its rounds'
ratios (``round_ratios``). ``measured`` is the median of all runs and ``predicted`` the
median over the calibrations, shown for scale; ``unpaired_ratio`` is the second over the
first, which compares runs with calibrations taken minutes apart.

How sure a ratio is: ``ratio_interval`` is a distribution-free interval for the median
of the round ratios (:func:`median_interval`: two of their order statistics), covering it
with probability ``ratio_interval_level`` if the rounds were independent draws (adjacent
rounds share a calibration, so read it as a guide). Eight rounds give a 93% interval from
the second-lowest to the second-highest ratio, three rounds only a 75% one from the
lowest to the highest. With more than three rounds the table prints the interval in the
``by round`` column. On this machine a round's ratio moves by ~15-25% (log sd) from one
round to the next, so with three rounds even an exact model leaves a point or two of 27
beyond 25% by chance; a point whose interval lies wholly outside 0.75-1.25 is a miss of
the model.

What moved a whole round, and what sets a point apart (:func:`round_drift`):
``round_median_ratios`` holds each round's median ratio over the points. The machine's
speed drifting between a calibration and the round after it scales every point of that
round alike (0.77-1.08 over one 8-round run), so these show the drift; a point's
``relative_ratio`` is the median over rounds of its ratio over its round's median: how
the model prices this program against the others, the drift taken out. With two rounds
or more the summary prints both.

JSON (``--json``): ``{"spec": the first LocalhostSpec's fields, "specs": every
calibration's, "steps", "core_queues", "tiny", "workloads": [{"name", "devices", "dtype",
"measured_s", "measured_runs_s", "measured_iqr_s", "measured_round_s", "predicted_s",
"predicted_by_spec_s", "ratio", "round_ratios", "unpaired_ratio", "ratio_interval",
"ratio_interval_level", "relative_ratio", "measured_cpu_s", "measured_cpu_round_s",
"predicted_cpu_s", "cpu_ratio", "background_cores"}], "round_median_ratios",
"max_error"}`` with ``max_error = max |ratio - 1|``; ``measured_round_s`` and
``measured_cpu_round_s`` are each round's median run and median CPU (what ``--reprice``
pairs new predictions with); ``measured_iqr_s`` = [25th, 75th] percentile of the measured runs. The
table's ``spread`` column is half that range over the median: how far the machine's own
run-to-run noise reaches, to read a ratio against.

``cpu ratio`` splits a miss in two: ``measured_cpu_s`` is the devices' CPU in the timed
program (process time, summed over the devices; the median over the runs),
``predicted_cpu_s`` the work the replay's core pool served (single-core seconds), and
``cpu_ratio`` the second over the first (paired round by round as ``ratio`` is). A ratio off while the CPU ratio is near 1 is
the scheduling of the cores (how much of the wall they stood idle); a CPU ratio off as
far as the ratio is the work's price.

``--scenarios`` predicts the bundled emulated scenarios instead
(:mod:`vcluster.cli.bench_predict_scenarios`).

``--steps K`` runs each program K times back to back inside one timed run, measured and
predicted alike (the steady state of a training loop rather than one cold run: the start
of the run and its first, colder step weigh 1/K); every time in the table and the JSON
is then per step (the run's over K), and the record says ``"steps": K``.

``--core-queues`` predicts on per-core run queues placed as the calibration counted the
devices per core at a start (:mod:`vcluster.timing.core_queues`) instead of one
pool of cores; the record says ``"core_queues": true``.

``--reprice RECORD`` measures nothing: it prices a saved record's measurements again with
this tree's model, under the record's own calibrations, so that two versions of the model
are compared on the same measurements (:mod:`vcluster.cli.bench_predict_reprice`).
"""

from __future__ import annotations

import time

import numpy as np

from .args import csv_of, positive_int
from .bench_predict_measure import BUSY_MACHINE_CORES, measure_workload
from .bench_predict_print import (print_drift, print_header, print_row,
                                  write_record, spread)
from .bench_predict_stats import interval_fields, median_interval, paired_ratios, round_drift
from .bench_predict_workloads import WORKLOADS, BenchWorkload, build_bench_workload
from .localhost_spec_text import format_localhost_spec

__all__ = ["add_parser", "WORKLOADS", "BenchWorkload", "build_bench_workload", "measure_workload",
           "predict_workload", "predict_run", "run_predict", "run_workloads", "spread", "stepped",
           "paired_ratios", "median_interval"]

RETRY_PAUSE_S = 5.0                     # before measuring a disturbed workload again


# --- measuring and predicting ----------------------------------------------------------
def predict_workload(wl: BenchWorkload, spec, core_queues: bool = False) -> float:
    """The replayed step time of ``wl``'s traces with the localhost cost model (the
    programs' own host work included when the spec has its rates; ``core_queues``: on
    per-core queues, :mod:`vcluster.timing.core_queues`)."""
    return predict_run(wl, spec, core_queues)[0]


def predict_run(wl: BenchWorkload, spec, core_queues: bool = False) -> tuple[float, float]:
    """(step time, the core pool's work: single-core seconds) of ``wl``'s replay."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing.engine import simulate_trace
    from vcluster.localhost.cost_model import localhost_model, localhost_traces
    model = localhost_model(spec, wl.mesh.size, wl.dtype, core_queues)
    traces = localhost_traces(model, wl.mesh, wl.program, wl.meta_args)
    result = simulate_trace(traces, model, mesh=wl.mesh, core_pool=model.core_pool,
                            timeline=False)
    return result.step_time_s, result.pool_work_s


def run_predict(spec, names, reps: int = 3, tiny: bool = False, progress=None,
                retries: int = 0, rounds: int = 1, recalibrate=None, steps: int = 1,
                core_queues: bool = False) -> dict:
    """Measure and predict every workload of ``names``; the JSON record (module doc)."""
    record = run_workloads(spec, [build_bench_workload(name, tiny) for name in names], reps,
                           progress, retries, rounds, recalibrate, steps, core_queues)
    record["tiny"] = bool(tiny)
    return record


def _steps(dev, program, steps: int, *args) -> None:
    """``program(dev, *args)`` ``steps`` times back to back."""
    for _ in range(steps):
        program(dev, *args)


def stepped(wl: BenchWorkload, steps: int) -> BenchWorkload:
    """``wl`` whose program runs ``steps`` times back to back (``wl`` itself for 1)."""
    if steps == 1:
        return wl
    return BenchWorkload(wl.name, wl.mesh, _steps, [(wl.program, steps) + tuple(a) for a in wl.args],
                    [(wl.program, steps) + tuple(a) for a in wl.meta_args], wl.dtype)


def run_workloads(spec, workloads, reps: int = 3, progress=None, retries: int = 0,
                  rounds: int = 1, recalibrate=None, steps: int = 1,
                  core_queues: bool = False) -> dict:
    """Measure and predict each :class:`BenchWorkload` (devices kept per mesh).

    ``rounds`` measurement rounds, each over every workload in turn (``reps`` runs each);
    with ``recalibrate`` (a callable returning a fresh spec) the machine is calibrated
    again after every round, so calibrations bracket the measurements: this machine's
    speed drifts by tens of per cent over minutes (its neighbours), and a prediction can
    only be as good as the calibration it was made from. A workload's measured time is
    the median of all its runs, its predicted time the median over the specs. A
    measurement disturbed by this machine's other processes (above
    :data:`BUSY_MACHINE_CORES`) is taken again up to ``retries`` times after a pause of
    :data:`RETRY_PAUSE_S`, keeping the quietest. ``progress(row)`` gets each final row.
    ``steps``: each program's back-to-back steps per timed run (times per step).
    ``core_queues``: predict on per-core queues (:mod:`vcluster.timing.core_queues`).
    """
    # lazy: keeps vcluster --help fast
    from vcluster import VirtualCluster
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"run_workloads: rounds must be an int >= 1, got {rounds!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"run_workloads: steps must be an int >= 1, got {steps!r}")
    workloads = [stepped(wl, steps) for wl in workloads]
    specs, clusters = [spec], {}
    runs = {wl.name: [] for wl in workloads}            # per round: that round's runs
    cpus = {wl.name: [] for wl in workloads}
    loads: dict = {wl.name: [] for wl in workloads}
    try:
        for r in range(rounds):
            for wl in workloads:
                if wl.mesh not in clusters:
                    clusters[wl.mesh] = VirtualCluster(wl.mesh)
                got, cpu, background = measure_workload(clusters[wl.mesh], wl, reps)
                for _ in range(retries):
                    if background is None or background <= BUSY_MACHINE_CORES:
                        break
                    time.sleep(RETRY_PAUSE_S)
                    again = measure_workload(clusters[wl.mesh], wl, reps)
                    if again[2] is not None and again[2] < background:
                        got, cpu, background = again
                runs[wl.name].append(got)
                cpus[wl.name].append(cpu)
                loads[wl.name].append(background)
            if recalibrate is not None:
                specs.append(recalibrate())
    finally:
        for cluster in clusters.values():
            cluster.close()
    rows = []
    for wl in workloads:
        by_round = [[r / steps for r in got] for got in runs[wl.name]]
        cpu_by_round = [[c / steps for c in got] for got in cpus[wl.name]]
        all_runs = [r for got in by_round for r in got]
        known = [b for b in loads[wl.name] if b is not None]
        measured = {"name": wl.name, "devices": wl.mesh.size, "dtype": wl.dtype,
                    "measured_s": float(np.median(all_runs)), "measured_runs_s": all_runs,
                    "measured_iqr_s": [float(q) for q in np.percentile(all_runs, (25, 75))],
                    "measured_round_s": [float(np.median(got)) for got in by_round],
                    "measured_cpu_s": float(np.median([c for got in cpu_by_round
                                                       for c in got])),
                    "measured_cpu_round_s": [float(np.median(got)) for got in cpu_by_round],
                    "background_cores": max(known) if known else None}
        rows.append({**measured, **priced(wl, specs, steps, core_queues, measured)})
        if progress is not None:
            progress(rows[-1])
    return workloads_record(specs, steps, core_queues, rows)


def priced(wl: BenchWorkload, specs: list, steps: int, core_queues: bool, measured: dict) -> dict:
    """The prediction keys of a record's row: ``wl`` (already :func:`stepped`) replayed
    under each of ``specs`` and paired with the row's ``measured`` keys
    (``measured_s``, ``measured_round_s``: each round's median run, and
    ``measured_cpu_round_s``, per step; without the last, ``cpu_ratio`` is None)."""
    parts = [predict_run(wl, s, core_queues) for s in specs]
    predicted = [step / steps for step, _ in parts]
    work = [w / steps for _, w in parts]
    round_ratios = paired_ratios(predicted, [[m] for m in measured["measured_round_s"]])
    cpu = measured.get("measured_cpu_round_s")
    return {"predicted_s": float(np.median(predicted)), "predicted_by_spec_s": predicted,
            "ratio": float(np.median(round_ratios)), "round_ratios": round_ratios,
            "unpaired_ratio": float(np.median(predicted)) / measured["measured_s"],
            **interval_fields(round_ratios),
            "predicted_cpu_s": float(np.median(work)),
            "cpu_ratio": None if cpu is None else
            float(np.median(paired_ratios(work, [[c] for c in cpu])))}


def workloads_record(specs: list, steps: int, core_queues: bool, rows: list) -> dict:
    """The JSON record (module doc) of ``rows`` priced under ``specs``; adds each row's
    ``relative_ratio``."""
    medians = []
    if rows:
        medians, relative = round_drift([r["round_ratios"] for r in rows])
        for row, rel in zip(rows, relative):
            row["relative_ratio"] = rel
    return {"spec": specs[0].to_dict(), "specs": [s.to_dict() for s in specs],
            "steps": steps, "core_queues": bool(core_queues), "workloads": rows,
            "round_median_ratios": medians,
            "max_error": max((abs(r["ratio"] - 1) for r in rows), default=0.0)}


# --- the command -----------------------------------------------------------------------
def add_parser(kinds) -> None:
    """Register ``predict`` on the ``vcluster bench`` sub-commands ``kinds``."""
    p = kinds.add_parser(
        "predict", help="the localhost timing model against measured emulator runs",
        description="Calibrate this machine (or read --spec), then measure each bundled "
                    "emulated workload and predict its wall time by tracing and replaying "
                    "it with the localhost hardware; prints measured, predicted, ratio.")
    p.add_argument("--spec", metavar="FILE", help="a saved LocalhostSpec (.json/.yaml) "
                   "instead of calibrating")
    p.add_argument("--save-spec", metavar="FILE", help="write the calibrated spec")
    p.add_argument("--devices", type=positive_int, default=8,
                   help="devices of the calibration cluster (8)")
    p.add_argument("--workloads", type=csv_of(WORKLOADS, "workload"), default=list(WORKLOADS),
                   help="workloads to run (default: all): " + ",".join(WORKLOADS))
    p.add_argument("--reps", type=positive_int, default=3, help="timed runs (3)")
    p.add_argument("--tiny", action="store_true", help="shrink every workload (smoke test)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="measurement rounds over all workloads, the machine calibrated "
                        "again after each (without --spec): calibrations bracket the "
                        "measurements on a machine whose speed drifts (default 1; each "
                        "ratio then gets an interval from its rounds: 8 rounds give a "
                        "93%% one)")
    p.add_argument("--retries", type=int, default=0,
                   help="measure a workload disturbed by other processes again, up to this "
                        "many times, keeping the quietest (default 0)")
    p.add_argument("--steps", type=positive_int, default=1,
                   help="run each program this many times back to back in one timed run, "
                        "measured and predicted alike (steady state; times per step; "
                        "default 1: single runs)")
    p.add_argument("--scenarios", action="store_true",
                   help="predict the bundled emulated scenarios (scenarios/*.yaml, every "
                        "sweep point, through vcluster run) instead of the workloads")
    p.add_argument("--scenario", metavar="FILE", action="append",
                   help="predict this scenario file's points instead (repeatable; any "
                        "scenario that emulates, yours too; implies --scenarios)")
    p.add_argument("--core-queues", action="store_true",
                   help="replay on per-core run queues placed as the calibration counted "
                        "devices per core at a start, instead of one pool of cores "
                        "(experimental: see docs/timing.md)")
    p.add_argument("--reprice", metavar="RECORD",
                   help="measure nothing: price the measurements of a record saved with "
                        "--json again with this tree's model, under the record's own "
                        "calibrations (compare two models on the same measurements)")
    p.add_argument("--json", metavar="PATH", help="also write the record as JSON")
    p.set_defaults(run=_predict)


def _predict(args) -> int:
    if args.reprice:
        from .bench_predict_reprice import reprice_command
        return reprice_command(args)
    # lazy: keeps vcluster --help fast
    from vcluster.localhost.cost_model import load_localhost_spec, save_localhost_spec
    from vcluster.localhost.calibrate import calibrate_localhost
    def calibrate_again():
        print("vcluster bench predict: calibrating again", flush=True)
        return calibrate_localhost(args.devices)

    if args.scenario:                           # checked before a calibration's 20 s
        # lazy: keeps vcluster --help fast
        from vcluster.scenario import load_scenario
        from .bench_predict_scenarios import check_emulates
        for path in args.scenario:
            check_emulates(load_scenario(path), path)
    if args.spec:
        spec, recalibrate = load_localhost_spec(args.spec), None
        print(f"vcluster bench predict: spec from {args.spec}", flush=True)
    else:
        t0 = time.perf_counter()
        spec, recalibrate = calibrate_localhost(args.devices), calibrate_again
        print(f"vcluster bench predict: calibrated in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if args.save_spec:
        save_localhost_spec(spec, args.save_spec)
    print(format_localhost_spec(spec), flush=True)
    if args.scenarios or args.scenario:
        return _predict_scenarios(args, spec, recalibrate)
    print_header("workload", 22)
    record = run_predict(spec, args.workloads, args.reps, args.tiny, progress=print_row,
                         retries=args.retries, rounds=args.rounds, recalibrate=recalibrate,
                         steps=args.steps, core_queues=args.core_queues)
    print(f"max |ratio - 1| = {record['max_error']:.1%} (goal: 25%); measured runs' "
          f"spread: median ±{np.median([spread(r) for r in record['workloads']]):.0%}")
    print_drift(record)
    write_record(args.json, record)
    return 0


def _predict_scenarios(args, spec, recalibrate) -> int:
    from .bench_predict_scenarios import run_scenarios_predict
    print_header("scenario point", 28)
    record = run_scenarios_predict(spec, args.reps, args.scenario,
                                   progress=lambda r: print_row(r, width=28),
                                   retries=args.retries, rounds=args.rounds,
                                   recalibrate=recalibrate, steps=args.steps,
                                   core_queues=args.core_queues)
    rows = record["workloads"]
    surely = (f" ({record['outside_goal_surely']} beyond it over the whole interval of "
              f"their rounds)" if args.rounds > 1 else "")
    print(f"{record['within_goal']} of {len(rows)} points within 25%{surely}; "
          f"max |ratio - 1| = {record['max_error']:.1%}; measured runs' spread: median "
          f"±{np.median([spread(r) for r in rows]):.0%}")
    print_drift(record)
    write_record(args.json, record)
    return 0
