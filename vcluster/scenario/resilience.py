"""The ``faults:`` and ``checkpoint:`` sections of a scenario, and the resilient run.

    faults:
      - {kind: crash, rank: 3, at_step: 4}
      - {kind: slow, rank: 1, slowdown: 2.0}
      - {kind: link, ranks: [0, 1], bandwidth_factor: 0.5}
    checkpoint: {every: 2, dir: runs/faults.checkpoints, recovery: restart}

Emulation (``kind: mlp``): the training runs through ``MLP.fit`` with these faults,
checkpoints and recovery policy (:mod:`pipeline_parallel.resilient`); with faults, a
fault-free run of the same scenario runs first on the same cluster and the summary says
whether its final parameters are bit-identical (``matches_fault_free``). Simulation: slow
devices are stragglers and slow links scale bandwidth in the replay
(:func:`vcluster.timing.faults.impact.simulate_with_faults`); a crash is an emulation event.

Summary keys added: ``faults`` (the faults of the scenario), ``faults_injected`` (those
that took effect: slow devices and links, and every crash that fired), ``recoveries``
(one record per lost device: rank, step, checkpoint resumed from, restart seconds),
``checkpoints_written``, ``checkpoint_dir``, ``final_params_sha256`` (sha256 of the
canonical bytes of the final parameters, :func:`pipeline_parallel.checkpoint.params_sha256`),
``matches_fault_free``, ``fault_free_params_sha256``, ``measured_wall_s`` and
``fault_free_wall_s``. With ``checkpoint.mtbf_s`` the report also holds a goodput table
and plot (goodput against the checkpoint interval, per MTBF) built from the measured
``goodput_step_time_s``, ``goodput_checkpoint_s`` and ``goodput_restart_s``.
"""

from __future__ import annotations

import os
import time

from .errors import ScenarioError
from .timed_runs import all_running, step_times

__all__ = ["FAULTS_SCHEMA", "CHECKPOINT_SCHEMA", "RECOVERY", "check_faults",
           "wants_resilience", "checkpoint_dir", "run_resilient"]

RECOVERY = ("restart", "fail")
_FAULT_KINDS = ("crash", "slow", "link", "jitter")

FAULTS_SCHEMA = {
    "type": "array", "default": [],
    "description": "faults to inject (workload kind mlp): crash {rank, at_step}, slow "
                   "{rank, slowdown}, link {ranks: [a, b], bandwidth_factor}, jitter "
                   "{max_delay_s, probability, seed}",
    "items": {
        "type": "object", "additionalProperties": False, "required": ["kind"],
        "description": "one fault: kind crash | slow | link | jitter and its keys",
        "properties": {
            "kind": {"enum": list(_FAULT_KINDS), "description": "what goes wrong"},
            "rank": {"type": "integer", "minimum": 0, "description": "crash, slow: the device"},
            "at_step": {"type": "integer", "minimum": 0,
                        "description": "crash: the 0-based step at whose start it dies"},
            "slowdown": {"type": "number", "minimum": 1,
                         "description": "slow: compute takes this many times as long"},
            "ranks": {"type": "array", "items": {"type": "integer", "minimum": 0},
                      "minItems": 2, "maxItems": 2,
                      "description": "link: the two ranks the link joins"},
            "bandwidth_factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                 "description": "link: the fraction of bandwidth left"},
            "max_delay_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                            "description": "jitter: the longest random pause (s) a device "
                                           "takes before and after each send, receive, "
                                           "collective and compute block"},
            "probability": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                            "default": 0.25,
                            "description": "jitter: the share of those points that pause"},
            "seed": {"type": "integer", "minimum": 0, "default": 0,
                     "description": "jitter: seeds each device's stream of pauses (with "
                                    "its rank)"},
        },
    },
}

CHECKPOINT_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "description": "checkpoints of the training state and the recovery policy (mlp)",
    "properties": {
        "every": {"type": "integer", "minimum": 1,
                  "description": "steps between checkpoints (omit: none)"},
        "dir": {"type": "string", "description": "where checkpoints go (default "
                "runs/<name>.checkpoints; relative to the working directory)"},
        "recovery": {"enum": list(RECOVERY), "default": "fail",
                     "description": "on a lost device: restart (replace the process, resume "
                                    "from the last checkpoint) or fail (stop, naming it)"},
        "mtbf_s": {"type": "array", "minItems": 1,
                   "items": {"type": "number", "exclusiveMinimum": 0},
                   "description": "job MTBFs (s) for the goodput table and plot: the "
                                  "measured step, checkpoint and restart times in the "
                                  "closed form and the SimPy Monte Carlo"},
    },
}

#: checkpoint intervals (steps) of the goodput table
GOODPUT_INTERVALS = tuple(2 ** i for i in range(11))


def wants_resilience(scenario) -> bool:
    return bool(scenario.faults) or bool(scenario.checkpoint)


def checkpoint_dir(scenario) -> str:
    return scenario.checkpoint.get("dir") or os.path.join("runs", f"{scenario.name}.checkpoints")


def check_faults(scenario, mesh) -> None:
    """Cross-field rules: faults only for mlp, ranks in the mesh, crashes within the run."""
    # lazy: keeps vcluster --help fast
    from vcluster.runtime.faults import CrashFault, parse_faults
    if not wants_resilience(scenario):
        return
    if scenario.workload.kind != "mlp":
        key = "faults" if scenario.faults else "checkpoint"
        raise ScenarioError(key, [dict(f) for f in scenario.faults] or dict(scenario.checkpoint),
                            "workload kind mlp (or omit the section)",
                            f"workload kind {scenario.workload.kind} has no faults or "
                            "checkpoints")
    try:
        faults = parse_faults([dict(f) for f in scenario.faults], "faults", mesh.size)
    except (TypeError, ValueError) as exc:
        path, _, rest = str(exc).partition(": ")
        raise ScenarioError(path, _value_at(scenario, path), rest) from None
    for i, f in enumerate(faults):
        if isinstance(f, CrashFault) and f.at_step >= scenario.run.steps:
            raise ScenarioError(f"faults[{i}].at_step", f.at_step,
                                f"0..{scenario.run.steps - 1} (run.steps = "
                                f"{scenario.run.steps})", "the crash would never fire")


def _value_at(scenario, path: str):
    import re
    m = re.match(r"faults\[(\d+)\](?:\.(\w+))?", path)
    if not m:
        return list(scenario.faults)
    item = dict(scenario.faults[int(m.group(1))])
    return item.get(m.group(2)) if m.group(2) else item


def named_params_sha256(named) -> str | None:
    """``final_params_sha256`` of a training workload's named outputs (W0, b0, W1, ...),
    None when they are not an MLP's."""
    # lazy: keeps vcluster --help fast
    from pipeline_parallel.checkpoint import params_sha256
    layers = sum(1 for k in named if k.startswith("W") and k[1:].isdigit())
    if not layers or any(f"b{l}" not in named for l in range(layers)):
        return None
    return params_sha256([(named[f"W{l}"], named[f"b{l}"]) for l in range(layers)])


def run_resilient(workload, point, engine_name: str, resume: str | None) -> dict:
    """With faults, a fault-free training first (the baseline), then the faulty (or
    checkpointed) one on the same cluster.

    Returns the emulation dict of the runner (``outputs`` as the reference's names,
    ``events``, ``first_events``, ``step_times``) plus ``summary``, the keys above.
    """
    # lazy: keeps vcluster --help fast
    from pipeline_parallel.checkpoint import params_sha256
    from vcluster.runtime.faults import CrashFault, parse_faults
    from .engines import make_engine
    if engine_name != "emulator":
        raise ScenarioError("--engine", engine_name, "emulator (or remove the faults and "
                            "checkpoint sections and --resume)", "faults, checkpoints and "
                            "recovery kill and restart emulated device processes")
    faults = parse_faults([dict(f) for f in point.faults], "faults")
    ckpt = point.checkpoint
    directory = checkpoint_dir(point) if ckpt.get("every") or resume else None
    with make_engine(engine_name, workload.mesh,
                     array_module=point.cluster.array_module) as engine:
        clean = None
        if faults:                        # the baseline first: it also warms the devices up
            t0 = time.perf_counter()
            clean = workload.fit(engine)
            clean_s = time.perf_counter() - t0
        engine.reset_stats()
        segments = []

        def on_segment(first: int, end: int, recovery) -> None:
            # read before a restart replaces the processes (and their events)
            segments.append((first, end, recovery, engine.trace()))
            engine.reset_stats()

        t0 = time.perf_counter()
        fit = workload.fit(engine, checkpoint_every=ckpt.get("every"),
                           checkpoint_dir=directory, faults=faults,
                           recovery=ckpt.get("recovery", "fail"), resume_from=resume,
                           on_segment=on_segment)
        wall_s = time.perf_counter() - t0
        events = [e for *_, got in segments for e in got]
        steps = _segment_steps(segments)
        summary = {
            "faults": [f.to_dict() for f in faults],
            "faults_injected": [f.to_dict() for f in faults if not isinstance(f, CrashFault)]
            + [{"kind": "crash", "rank": r.rank, "at_step": r.lost_at_step}
               for r in fit.recoveries],
            "recoveries": [r.to_dict() for r in fit.recoveries],
            "checkpoints_written": len(fit.checkpoints),
            "checkpoint_dir": directory,
            "resumed_from": resume,
            "final_params_sha256": params_sha256(fit.params),
            "measured_wall_s": wall_s,
        }
        if ckpt.get("mtbf_s"):
            summary.update(_goodput_inputs(engine, fit, steps["step_times"]))
        if clean is not None:
            summary["fault_free_wall_s"] = clean_s
            summary["fault_free_params_sha256"] = params_sha256(clean.params)
            summary["matches_fault_free"] = summary["final_params_sha256"] == \
                summary["fault_free_params_sha256"]
    out = {"fit": fit, "events": events, "first_events": events, "summary": summary, **steps}
    if ckpt.get("mtbf_s"):
        # lazy: keeps vcluster --help fast
        from vcluster.timing.faults.impact import goodput_table
        out["goodput"] = goodput_table(
            summary["goodput_step_time_s"], summary["goodput_checkpoint_s"],
            summary["goodput_restart_s"], list(ckpt["mtbf_s"]), GOODPUT_INTERVALS,
            seed=point.workload.seed)
    return out


def _segment_steps(segments) -> dict:
    """The run's steps from its completed segments (first_step, end_step, recovery,
    events): ``step_times`` (each segment's steps from the instant every device ran,
    :func:`~.timed_runs.all_running`: the host's wake-up is start-up, not step 0),
    ``step_numbers`` (the global step of each) and ``step_notes`` (on the first step a
    segment resumed after a lost device: who was lost, at which step, and from which
    checkpoint step training resumed; "" elsewhere). A segment that a lost device cut
    short left no events (its processes were replaced); its steps are counted once, by
    the segment that ran them again."""
    times, numbers, notes = [], [], []
    for first, end, recovery, got in segments:
        times += step_times(got, True, end - first, start=all_running(got))
        numbers += range(first, end)
        notes += ["" if recovery is None or k != first else
                  f"resumed from step {recovery.resumed_from_step} after rank "
                  f"{recovery.rank} was lost"
                  + ("" if recovery.lost_at_step is None else f" at step {recovery.lost_at_step}")
                  for k in range(first, end)]
    return {"step_times": times, "step_numbers": numbers, "step_notes": notes}


def _goodput_inputs(engine, fit, times: list) -> dict:
    """Measured inputs of the goodput model: the median step time (of the completed
    segments' steps), the time to write one checkpoint (the last one, written again to a
    temporary directory), the mean restart time (of the recoveries, else of one restart)."""
    # lazy: keeps vcluster --help fast
    import statistics
    import tempfile
    from pipeline_parallel.checkpoint import load_checkpoint, save_checkpoint
    if not times:
        raise ScenarioError("checkpoint.mtbf_s", None, "a run of at least 1 step",
                            "no step time to build the goodput table from")
    state = load_checkpoint(fit.checkpoints[-1]) if fit.checkpoints else None
    checkpoint_s = 0.0
    if state is not None:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            save_checkpoint(tmp, state)
            checkpoint_s = time.perf_counter() - t0
    if fit.recoveries:
        restart_s = statistics.mean(r.restart_s for r in fit.recoveries)
    else:
        t0 = time.perf_counter()
        engine.restart()
        restart_s = time.perf_counter() - t0
    return {"goodput_step_time_s": statistics.median(times), "goodput_checkpoint_s": checkpoint_s,
            "goodput_restart_s": restart_s}
