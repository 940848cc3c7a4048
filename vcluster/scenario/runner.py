"""``run_scenario``: emulate and/or simulate a scenario (every sweep point) into a RunRecord.

Per point (``mode``):

* **emulate** — the workload's program on an engine (:func:`~vcluster.scenario.engines.
  make_engine`): one run per step (a training workload runs every step in one run);
  a step's measured time is, over every device's events, last end - first start (for
  training, step k ends at the last device's k-th ``optimizer`` event); with
  ``check: true`` the outputs are compared with the unsharded numpy reference;
* **simulate** — the same program traced on shape-only arrays and replayed on the
  hardware (:func:`~vcluster.timing.engine.simulate_trace`); one traced step stands for
  every step of a non-training workload;
* **both** — also compares the traffic: the bytes and messages the emulator moved in one
  step equal the trace's, per device and collective (``traffic_matches``).

A served model (``kind: inference``, :mod:`.workloads.inference`) adds its serving
records (:mod:`.serving_records`): the emulated run's engine steps and requests, and the
serving simulation (:func:`~vcluster.timing.serving.deployment.simulate_serve`), which in
``simulate`` mode replaces the trace's replay (a whole serving run of a full-size model is
the simulator's, not a trace's); the record's ``requests`` and ``engine_steps`` tables.

The summary's keys are listed in :data:`SUMMARY_KEYS` (docs/scenario.md explains each).
A sweep's record has one ``sweep`` row per point (the varied key paths, then that
point's summary); its tables and checks are those of every point, with a ``point`` column
in the tables, and its summary is the last point's with ``points`` and ``checks_passed``
over all points.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

import numpy as np

from .choices import Engine, Mode, parse_choice
from .serving_records import EMULATED_SUMMARY_KEYS, SERVING_SUMMARY_KEYS
from .timed_runs import (WARMUP_RUNS, all_running, emulate_timed, is_update,
                         measures_like_localhost, step_times)
from .workloads.base import compare

__all__ = ["run_scenario", "SUMMARY_KEYS", "RATIO_FLAG"]

RATIO_FLAG = 10.0          # the rule compute / communication >= 10 (planner.simulation)
SYMMETRIC_FROM_DEVICES = 16   # simulate-only training above this many devices: symmetric

#: summary keys by the modes that fill them (absent keys are not written)
SUMMARY_KEYS = {
    "always": ("kind", "workload", "mesh", "devices", "dtype", "steps", "mode"),
    "emulate": ("measured_step_time_s", "measured_total_s", "measured_bytes_sent",
                "measured_bytes_received", "measured_messages_sent", "measured_flops",
                "checks_passed", "max_abs_error", "final_loss", "final_params_sha256"),
    "simulate": ("hardware", "predicted_step_time_s", "predicted_total_s",
                 "predicted_compute_s", "predicted_comm_s", "predicted_exposed_comm_s",
                 "predicted_bubble_s", "predicted_bubble_fraction", "compute_comm_ratio",
                 "compute_comm_ratio_low", "predicted_exposed_comm_fraction",
                 "predicted_bytes_sent", "predicted_bytes_received",
                 "predicted_messages_sent", "localhost_calibration"),
    "both": ("traced_bytes_sent", "traffic_matches", "predicted_over_measured"),
    "memory": ("predicted_peak_memory_gb", "memory_limit_gb", "fits", "mfu"),  # simulate,
                                                     # transformer on a hardware model
    "training": ("data_parallel",),                  # mlp, transformer
    "roles": ("measured_server_bytes_sent", "measured_worker_bytes_sent",   # data_parallel
              "predicted_server_bytes_sent", "predicted_worker_bytes_sent"),  # mode ps
    # the inference kind (serving_records): its emulated serving run (emulate, both), and
    # the serving simulation (simulate; both on a GPU model), which replaces the simulate
    # keys above in a simulate-only run
    "emulated_serving": EMULATED_SUMMARY_KEYS,
    "serving": SERVING_SUMMARY_KEYS,
}


@dataclass
class _Point:
    """What one sweep point produced (mutable while it is filled)."""

    summary: dict
    checks: tuple = ()
    tables: dict = field(default_factory=dict)     # name -> list of DataFrames


def _finite(x):
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _units(point, training: bool, engine: str) -> int:
    from .resilience import wants_resilience
    mode, steps = point.run.mode, point.run.steps
    if wants_resilience(point):
        warmup = 0
    elif measures_like_localhost(point, engine):
        warmup = WARMUP_RUNS                     # emulate_timed's own warm-up runs
    else:
        warmup = point.run.warmup
    emulate = (1 if training else steps) + (1 if point.run.check else 0) + warmup
    # the inference kind in mode both: the trace's replay and the serving simulation
    serving_both = point.workload.kind == "inference" and mode == "both"
    return (emulate if mode != "simulate" else 0) + (1 if mode != "emulate" else 0) \
        + (1 if serving_both else 0)


# --- emulation ---------------------------------------------------------------------------
class _Engines:
    """The engine of a sweep's current (mesh, array module): consecutive points on one
    mesh reuse the same device processes; a new mesh closes the old engine first (one
    cluster's processes at a time)."""

    def __init__(self, name: str):
        self.name, self._open = name, {}

    def get(self, mesh, array_module: str):
        from .engines import make_engine
        key = (mesh, array_module)
        if key not in self._open:
            self.__exit__()
            self._open[key] = make_engine(self.name, mesh, array_module=array_module)
        return self._open[key]

    def __enter__(self) -> "_Engines":
        return self

    def __exit__(self, *exc) -> None:
        for engine in self._open.values():
            engine.close()
        self._open.clear()


def _emulate(workload, point, engines: _Engines, bar) -> dict:
    steps, training = point.run.steps, workload.training
    events, first_events, times, outputs = [], None, [], None
    engine = engines.get(workload.mesh, point.cluster.array_module)
    for k in range(point.run.warmup):     # untimed: the first run pays for start-up
        engine.run(workload.program, list(workload.args_by_rank))
        bar.advance(f"warm-up {k + 1}")
    for step in range(1 if training else steps):
        engine.reset_stats()
        outputs = engine.run(workload.program, list(workload.args_by_rank))
        got = engine.trace()
        # a training run's steps from the instant every device runs (the host's wake-up
        # of the devices one by one is start-up: timed_runs.all_running)
        times += step_times(got, training, steps, start=all_running(got) if training else None,
                            updates_per_step=workload.updates_per_step)
        events += got
        first_events = got if first_events is None else first_events
        bar.advance(f"emulate step {step + 1}")
    from .engines import RECORDS_TRAFFIC
    return {"outputs": outputs, "events": events, "first_events": first_events,
            "step_times": times, "records_traffic": engines.name in RECORDS_TRAFFIC}


def _emulate_resilient(workload, point, engine_name: str, resume, bar) -> dict:
    """Training through the model's ``fit`` with checkpoints / faults
    (:mod:`vcluster.scenario.resilience`): every step the run completed, each segment's
    events read before a restart could take them."""
    from .resilience import run_resilient
    emu = run_resilient(workload, point, engine_name, resume)
    emu["assembled"] = workload.fit_outputs(emu["fit"])
    bar.advance("emulate (resilient)")
    return emu


def _measured(point: _Point, workload, emu: dict, scenario) -> None:
    # lazy: keeps vcluster --help fast
    import pandas as pd
    from reports import collectives_from_events, devices_from_events, spans_from_events
    mesh, events = workload.mesh, emu["events"]
    comm = [e for e in events if hasattr(e, "sent")]
    times = emu["step_times"]
    s = point.summary
    s["measured_step_time_s"] = statistics.median(times) if times else None
    s["measured_total_s"] = sum(times)
    traffic = emu.get("records_traffic", True)    # None: the engine does not report it
    s["measured_bytes_sent"] = sum(e.bytes_sent for e in comm) if traffic else None
    s["measured_bytes_received"] = sum(e.bytes_received for e in comm) if traffic else None
    s["measured_messages_sent"] = sum(e.messages_sent for e in comm) if traffic else None
    s["measured_flops"] = sum(e.flops for e in events if hasattr(e, "flops"))
    numbers = list(emu.get("step_numbers", range(len(times))))
    steps = pd.DataFrame({"source": "measured", "step": numbers, "time_s": times})
    if "step_notes" in emu:             # a resilient run: the steps after a recovery
        steps["note"] = emu["step_notes"]
    if workload.training:
        assembled = emu.get("assembled") or workload.assemble(emu["outputs"])
        losses = np.asarray(assembled["loss"], np.float64)
        steps["loss"] = losses[numbers]
        s["final_loss"] = float(losses[-1])
        if workload.fit_outputs is not None:      # an MLP: the hash a fault-free run gives
            from .resilience import named_params_sha256
            s["final_params_sha256"] = named_params_sha256(assembled)
    if getattr(workload, "roles", None) is not None and traffic:
        sent = {}
        for e in comm:
            sent[e.rank] = sent.get(e.rank, 0) + e.bytes_sent
        s.update(_by_role("measured", sent, workload.roles))
    point.tables["steps"].append(steps)
    point.tables["devices"].append(devices_from_events(events, mesh, range(mesh.size)).assign(
        steps_covered=len(times) or 1))
    # steps_covered: how many steps the rows' times sum over (a per-step plot divides)
    point.tables["collectives"].append(collectives_from_events(events, mesh).assign(
        steps_covered=len(times) or 1))
    point.tables["spans"].append(spans_from_events(events))


# --- simulation --------------------------------------------------------------------------
def _representative_ranks(workload, scenario, setup):
    """Ranks to trace at cluster scale: a training workload simulated alone on more than
    :data:`SYMMETRIC_FROM_DEVICES` devices of a hardware model traces one pipeline (the
    ranks of rank 0's ``pp`` group) and replays in symmetric mode — data- and
    tensor-parallel peers mirror them (equal to the full replay, tests/planner/test_simulate.py);
    ``None`` (every rank) otherwise, and for ranks of different roles (a parameter server's
    servers and workers mirror nothing)."""
    mesh = workload.mesh
    if (not workload.training or scenario.run.mode != "simulate" or setup.core_pool is not None
            or mesh.size <= SYMMETRIC_FROM_DEVICES or getattr(scenario, "faults", ())
            or getattr(workload, "roles", None) is not None     # ranks differ: trace each
            or getattr(setup.costs, "rank_costs", None) is not None):  # GPUs of several kinds
        return None
    return list(mesh.group("pp", 0)) if "pp" in mesh.axes else [0]


def _simulate(workload, scenario, bar) -> tuple:
    """Trace and replay; slow devices and links of ``faults`` slow the replay."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing import model_traces
    from vcluster.timing.engine import simulate_trace
    from .hardware import cost_setup
    mesh = workload.mesh
    setup = cost_setup(scenario, mesh, workload.dtype, workload.fp8_gemms, workload.flash_v1,
                       workload.gemm_format, workload.attention_kernel)
    ranks = _representative_ranks(workload, scenario, setup)
    if ranks is not None and workload.step_traces is not None:   # as simulate gpt does
        traces = workload.step_traces(setup.costs)
    else:
        traces = model_traces(setup.costs, mesh, workload.program,
                              list(workload.meta_args_by_rank), ranks=ranks)
    if scenario.faults:
        # lazy: keeps vcluster --help fast
        from vcluster.timing.faults.impact import simulate_with_faults
        result = simulate_with_faults(traces, setup.costs, [dict(f) for f in scenario.faults],
                                      mesh=mesh, core_pool=setup.core_pool)
    else:
        result = simulate_trace(traces, setup.costs, mesh=mesh, core_pool=setup.core_pool,
                                symmetric=ranks is not None)
    bar.advance("simulate")
    return traces, result, setup


def _predicted_steps(result, training: bool, steps: int) -> list[float]:
    if not training:
        return [result.step_time_s] * steps
    ends_by_rank = {}
    for rank, timeline in zip(result.ranks, result.timelines):
        for iv in timeline:
            if str(iv.stream) == "compute" and is_update(getattr(iv.op, "name", None)):
                ends_by_rank.setdefault(rank, []).append(iv.end_s)
    if not ends_by_rank:
        return [result.step_time_s / steps] * steps
    ends = [max(sorted(v)[k] for v in ends_by_rank.values() if len(v) > k)
            for k in range(steps)]
    ends[-1] = result.step_time_s
    return [b - a for a, b in zip([0.0] + ends[:-1], ends)]


def _by_role(source: str, sent_by_rank: dict, roles) -> dict:
    """``{source}_{role}_bytes_sent``: the bytes one device of each role sent (the mean
    over the role's devices), every step."""
    out = {}
    for role in dict.fromkeys(roles):
        ranks = [r for r, of in enumerate(roles) if of == role]
        out[f"{source}_{role}_bytes_sent"] = sum(sent_by_rank.get(r, 0)
                                                 for r in ranks) / len(ranks)
    return out


def _trace_sent_by_rank(traces, costs) -> dict:
    """Bytes each traced rank sends, counted as :func:`_trace_traffic` counts them."""
    return {t.rank: _trace_traffic([t], costs)[0] for t in traces}


def _trace_traffic(traces, costs) -> tuple[int, int, int | None]:
    """(bytes sent, bytes received, messages sent) over every traced rank.

    On a hardware model, what its collectives carry on the links
    (:meth:`~vcluster.timing.hardware_model.HardwareCostModel.wire_bytes`: sent equals
    received) and no message count (the collective library chunks as it likes); else what
    the emulator's algorithms move, one-sided ``shm`` reads included."""
    # lazy: keeps vcluster --help fast
    from vcluster.runtime.tracing import TraceCollective, TraceSend, trace_comm_signature
    wire = getattr(costs, "wire_bytes", None)
    if wire is not None:
        total = sum(wire(op) if isinstance(op, TraceCollective) else op.nbytes
                    for t in traces for op in t.ops
                    if isinstance(op, TraceSend) or (isinstance(op, TraceCollective)
                                                     and len(op.group) > 1))
        return round(total), round(total), None
    sent_b = received_b = messages = 0
    for t in traces:
        for entries in trace_comm_signature(t).values():
            for _, _, sent, received in entries:
                sent_b += sum(b for _, b, _ in sent)
                received_b += sum(b for _, b, _ in received)
                messages += sum(m for _, _, m in sent)
    return sent_b, received_b, messages


def _predicted(point: _Point, workload, traces, result, setup, scenario) -> None:
    # lazy: keeps vcluster --help fast
    import pandas as pd
    from reports import (collectives_from_simulation, devices_from_simulation,
                         spans_from_simulation)
    mesh, steps, training = workload.mesh, scenario.run.steps, workload.training
    times = _predicted_steps(result, training, steps)
    summary = result.summary()
    repeat = 1 if training else steps
    nbytes, received, messages = _trace_traffic(traces, setup.costs)
    ratio = result.compute_comm_ratio
    point.summary.update(
        hardware=setup.label, predicted_step_time_s=statistics.median(times),
        predicted_total_s=sum(times), predicted_compute_s=summary["compute_s_mean"],
        predicted_comm_s=summary["comm_s_mean"],
        predicted_exposed_comm_s=summary["exposed_comm_s_mean"],
        predicted_bubble_s=summary["bubble_s_mean"],
        predicted_bubble_fraction=summary["bubble_fraction"],
        compute_comm_ratio=ratio,
        compute_comm_ratio_low=bool(math.isfinite(ratio) and ratio < RATIO_FLAG),
        predicted_exposed_comm_fraction=(summary["exposed_comm_s_mean"] / result.step_time_s
                                         if result.step_time_s > 0 else 0.0),
        predicted_bytes_sent=nbytes * repeat, predicted_bytes_received=received * repeat,
        predicted_messages_sent=None if messages is None else messages * repeat,
        localhost_calibration=setup.calibration)
    point.summary.update(_memory_and_mfu(workload, setup, statistics.median(times)))
    if getattr(workload, "roles", None) is not None:
        sent = {r: n * repeat for r, n in _trace_sent_by_rank(traces, setup.costs).items()}
        point.summary.update(_by_role("predicted", sent, workload.roles))
    point.tables["steps"].append(pd.DataFrame({"source": "predicted", "step": range(steps),
                                               "time_s": times}))
    point.tables["devices"].append(devices_from_simulation(result, mesh).assign(
        steps_covered=steps if training else 1))
    # one traced step stands for every step of an op; a training program traces them all
    point.tables["collectives"].append(collectives_from_simulation(
        result, mesh, algorithm_of=getattr(setup.costs, "collective_algorithm", None)).assign(
        steps_covered=steps if training else 1))
    point.tables["spans"].append(spans_from_simulation(result))


def _memory_and_mfu(workload, setup, step_time_s: float) -> dict:
    """Peak memory per device, the memory it must fit (the device's less the planner's
    headroom) and whether it does, and MFU — for a workload that knows its memory on a
    hardware model (a transformer); {} otherwise (localhost: the emulator's own memory)."""
    hardware = getattr(setup.costs, "hardware", None)
    cluster = getattr(setup.costs, "cluster", None)        # several GPU kinds
    if workload.peak_memory_bytes is None or setup.localhost or (hardware is None
                                                                 and cluster is None):
        return {}
    # lazy: keeps vcluster --help fast
    from vcluster.planner.memory import usable_memory_bytes
    # every rank on its own GPU: the smallest holds what the mesh's busiest rank holds, and
    # MFU is against the GPUs' mean peak
    kinds = [hardware] * workload.mesh.size if cluster is None else [
        cluster.hardware_of(setup.costs.device(r)) for r in range(workload.mesh.size)]
    peak = workload.peak_memory_bytes()
    limit = min(usable_memory_bytes(h.device.hbm_bytes) for h in kinds)
    out = {"predicted_peak_memory_gb": peak / 1e9, "memory_limit_gb": limit / 1e9,
           "fits": bool(peak <= limit)}
    if workload.model_flops is not None and step_time_s > 0:
        peak_flops = sum(h.device.peak_flops(setup.costs.dtype) for h in kinds)
        out["mfu"] = workload.model_flops / (peak_flops * step_time_s)
    return out


def _traffic_matches(traces, events) -> bool:
    """Per rank, the trace's (collective, algorithm, sent, received) sequence per group
    equals the emulator's events of one step."""
    # lazy: keeps vcluster --help fast
    from vcluster.runtime.tracing import comm_signature, trace_comm_signature
    return all(trace_comm_signature(t) == comm_signature(events, t.rank) for t in traces)


# --- one point ---------------------------------------------------------------------------
def _run_point(point, engines: _Engines, bar, resume: str | None = None) -> _Point:
    from .resilience import wants_resilience
    from .semantics import resolve_mesh
    from .workloads import workload_module
    mesh = resolve_mesh(point)
    workload = workload_module(point.workload.kind).build(point, mesh)
    mode = point.run.mode
    out = _Point(summary={
        "kind": workload.kind, "workload": workload.description,
        "mesh": " x ".join(f"{a}={n}" for a, n in mesh.shape.items()),
        "devices": mesh.size, "dtype": workload.dtype, "steps": point.run.steps,
        "mode": str(mode)}, tables={k: [] for k in ("steps", "devices", "collectives", "spans")})
    if workload.training:
        out.summary["data_parallel"] = _data_parallel_label(point)
    serving = getattr(workload, "serving", None)   # the inference kind's records' hooks
    emu = None
    if mode in ("emulate", "both"):
        resilient = wants_resilience(point) or resume is not None
        if resilient:
            emu = _emulate_resilient(workload, point, engines.name, resume, bar)
        elif measures_like_localhost(point, engines.name):     # warm-up, common start
            emu = emulate_timed(workload, point,
                                engines.get(mesh, point.cluster.array_module), bar)
        elif engines.name == "emulator":                       # the same, measured once
            emu = emulate_timed(workload, point,
                                engines.get(mesh, point.cluster.array_module), bar,
                                warmup=point.run.warmup, repeats=1, steady=True)
        else:
            emu = _emulate(workload, point, engines, bar)
        _measured(out, workload, emu, point)
        out.summary.update(emu.get("summary", {}))
        if emu.get("goodput") is not None:
            out.tables["goodput"] = [emu["goodput"]]
        if point.run.check:
            tolerance = point.run.tolerance_for(workload.dtype)
            out.checks = (compare(emu["assembled"], workload.reference(), tolerance)
                          if resilient else workload.check(emu["outputs"], tolerance))
            bar.advance("check")
        out.summary["checks_passed"] = all(c["passed"] for c in out.checks) \
            if point.run.check else None
        out.summary["max_abs_error"] = max((c["max_abs_error"] for c in out.checks),
                                           default=None)
        if serving is not None:     # the emulated serving run's steps, requests, KV usage
            _add_records(out, *serving.emulated(emu["outputs"]))
    if serving is not None and serving.simulated is not None:   # the serving simulation
        _add_records(out, *serving.simulated())
        bar.advance("simulate serving")
    # a served model simulated alone is the serving simulation above; with emulation (both)
    # its emulated run's trace is replayed too, as every kind's
    if mode == "both" or (mode == "simulate" and serving is None):
        traces, result, setup = _simulate(workload, point, bar)
        _predicted(out, workload, traces, result, setup, point)
        if emu is not None and "fit" not in emu:    # segmented / restarted runs: not one trace
            if emu.get("records_traffic", True):
                # both counted the emulator's way (shm reads peers' buffers in place), the
                # trace's over as many runs as the measured events hold
                # (None when only some ranks were traced: their signatures still compare)
                runs = 1 if workload.training else point.run.steps
                traced = _trace_traffic(traces, None)[0] * runs \
                    if len(traces) == mesh.size else None
                out.summary["traced_bytes_sent"] = traced
                out.summary["traffic_matches"] = bool(
                    _traffic_matches(traces, emu["first_events"])
                    and traced in (None, out.summary["measured_bytes_sent"]))
            else:
                out.summary["traffic_matches"] = None
            measured = out.summary["measured_step_time_s"]
            out.summary["predicted_over_measured"] = (
                out.summary["predicted_step_time_s"] / measured
                if setup.localhost and measured else None)
    out.summary = {k: _finite(v) for k, v in out.summary.items()}
    return out


def _add_records(point: _Point, summary: dict, tables: dict) -> None:
    """A serving run's summary keys and tables (``requests``, ``engine_steps``) into
    ``point`` (the inference kind, :mod:`vcluster.scenario.serving_records`)."""
    point.summary.update(summary)
    for name, frame in tables.items():
        point.tables.setdefault(name, []).append(frame)


def _data_parallel_label(point) -> str:
    """What combined the replicas: ``ddp``, ``zero-2``, ``ps (1 server, staleness 0)``
    (a transformer's ``parallel.distributed_optimizer`` is ZeRO-1)."""
    if point.data_parallel.mode == "ddp" and point.parallel.get("distributed_optimizer"):
        return "zero-1"
    return point.data_parallel.label


def _concat(frames: list, point_index: int | None):
    import pandas as pd
    frames = [f for f in frames if len(f)]
    if not frames:
        return None
    out = pd.concat(frames, ignore_index=True)
    if point_index is not None:
        out.insert(0, "point", point_index)
    return out


def _sharing_calibrations(points: list) -> list:
    """The sweep points, those on ``localhost`` without a saved ``calibration`` sharing one
    :class:`~vcluster.scenario.hardware.LocalhostCalibrations` (one per run)."""
    from .hardware import LOCALHOST, LocalhostCalibrations
    shared = LocalhostCalibrations()
    return [(values, replace(point, hardware=replace(point.hardware, measured=shared)))
            if point.hardware.name == LOCALHOST and point.hardware.calibration is None
            else (values, point) for values, point in points]


def run_scenario(scenario, *, mode: str | None = None, engine: str = "emulator",
                 progress: bool = False, resume: str | None = None):
    """Run every sweep point of ``scenario`` and return a :class:`reports.RunRecord`.

    ``mode`` overrides ``run.mode``; ``engine`` names the emulation engine
    (:data:`~vcluster.scenario.engines.ENGINES`); ``progress`` shows a bar on a terminal;
    ``resume`` (a checkpoint directory) continues a training run from its newest
    checkpoint (:mod:`vcluster.scenario.resilience`).
    """
    # lazy: keeps vcluster --help fast
    import pandas as pd
    from reports import RunRecord
    from .load import scenario_from_dict, sweep_points
    from .progress import ProgressBar
    engine = parse_choice(Engine, engine, "--engine", "unknown engine")
    if mode is not None and mode != scenario.run.mode:      # another document: parsed once
        mode = parse_choice(Mode, mode, "--mode", "unknown mode")
        scenario = scenario_from_dict(dict(scenario.document), scenario.name,
                                      [("run.mode", mode)], scenario.base_dir)
    points = _sharing_calibrations(sweep_points(scenario))
    from .workloads import workload_module  # noqa: F401  (registry import before the bar)
    training = scenario.workload.kind in ("mlp", "transformer")
    total = sum(_units(p, training, engine) for _, p in points)
    results, rows = [], []
    with ProgressBar(total, progress, f"vcluster run {scenario.name}") as bar, \
            _Engines(engine) as engines:
        for values, point in points:
            res = _run_point(point, engines, bar, resume)
            results.append(res)
            rows.append({**values, **res.summary})
    sweeping = bool(scenario.sweep)
    tables = {}
    for name in ("steps", "devices", "collectives", "spans", "goodput", "requests",
                 "engine_steps"):
        parts = [_concat(r.tables.get(name, []), i if sweeping else None)
                 for i, r in enumerate(results)]
        parts = [p for p in parts if p is not None]
        if parts:
            tables[name] = pd.concat(parts, ignore_index=True)
    checks = tuple(dict(c, name=(f"point {i}: " if sweeping else "") + c["name"])
                   for i, r in enumerate(results) for c in r.checks)
    summary = dict(results[-1].summary)
    if sweeping:
        summary["points"] = len(results)
        checked = [r.summary.get("checks_passed") for r in results]
        summary["checks_passed"] = None if all(c is None for c in checked) \
            else all(c is not False for c in checked)
    last = points[-1][1]
    return RunRecord(
        name=scenario.name, mode=str(last.run.mode),      # reports get plain text
        scenario=dict(scenario.document), summary=summary,
        hardware=summary.get("hardware"), checks=checks,
        sweep=pd.DataFrame(rows) if sweeping else None,
        sweep_keys=tuple(path for path, _ in scenario.sweep), **tables)
