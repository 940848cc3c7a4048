"""The ``inference`` kind's records: what an emulated and a simulated serving run report.

* **emulated** (:func:`emulated_records`) — from the devices' outputs (rank 0's engine
  steps, every request's tokens) and a host replay of the same scheduler on the same
  requests (:func:`replay_schedule`; pure, :mod:`serving`): per request its arrival,
  first-token and finish *steps* and its tokens; per step its batch and the KV-cache usage
  after the step's allocation, u = used / usable blocks (vLLM's ``kv_cache_usage`` gauge,
  sampled where the simulator samples it). The emulator has no clock per step, so these
  are counted in engine steps.
* **simulated** (:func:`simulated_records`) — :func:`~vcluster.timing.serving.deployment.
  simulate_serve` on the scenario's hardware: vLLM ``bench serve``'s keys, the floors, the
  KV cache, and per request / per step records in seconds.

Each returns ``(summary, tables)``: flat summary keys (:data:`SERVING_SUMMARY_KEYS`,
:data:`EMULATED_SUMMARY_KEYS`) and ``{"requests": DataFrame, "engine_steps": DataFrame}``,
their rows tagged ``source`` ``emulated`` or ``simulated`` (the columns in
docs/scenario.md ("kind: inference")).

Memory (``predicted_peak_memory_gb`` beside ``memory_limit_gb``, as the training kinds
say it): the binding GPU of a replica holds its weights, vLLM's activation peak, the
non-torch memory and the KV blocks of one longest request,
``W + A + N + ceil(L / block_size) * bytes_per_block``, against the share of its memory
the engine may use, ``ceil(memory * gpu_memory_utilization)``; it ``fits`` exactly when
the KV cache vLLM sizes holds that request (blocks = floor(budget / bytes_per_block)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

__all__ = ["ServingRun", "SERVING_SUMMARY_KEYS", "EMULATED_SUMMARY_KEYS", "replay_schedule",
           "emulated_records", "simulated_records", "step_rows"]

_LATENCY = tuple(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                 for stat in ("mean", "median", "std", "p90", "p99"))
#: the serving simulation's summary keys: vLLM bench serve's result keys
#: (:meth:`~vcluster.timing.serving.metrics.ServingMetrics.as_json`), the deployment and the
#: physics (:meth:`~vcluster.timing.serving.deployment.ServeReport.as_json`, less tp, pp
#: and ep, which the summary's mesh gives), and the memory
SERVING_SUMMARY_KEYS = (
    "hardware", "model", "engine", "replicas", "prefill_replicas", "num_gpus", "duration",
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "output_throughput_per_gpu",
    "max_output_tokens_per_s", "max_concurrent_requests", *_LATENCY,
    "mean_kv_cache_usage", "peak_kv_cache_usage", "kv_blocks_per_replica", "kv_block_size",
    "kv_tokens_per_replica", "weights_gb_per_gpu", "preemptions", "busy_s", "floor_s",
    "decode_step_ms", "decode_step_floor_ms", "fits", "predicted_peak_memory_gb",
    "memory_limit_gb")
#: the emulated serving run's summary keys (counts; the peak KV usage as a fraction)
EMULATED_SUMMARY_KEYS = ("emulated_engine_steps", "emulated_output_tokens",
                         "emulated_preemptions", "emulated_kv_blocks", "emulated_blocks_used",
                         "emulated_blocks_reused", "emulated_peak_kv_usage")
_DROPPED = ("tp", "pp", "ep")     # as_json keys the summary's mesh gives


@dataclass(frozen=True)
class ServingRun:
    """The runner's hooks of a serving workload: ``emulated(outputs_by_rank)`` and
    ``simulated()`` (None: no serving simulation, as on ``localhost`` hardware), each
    returning ``(summary, tables)`` (module docstring)."""

    emulated: Callable[[list], tuple[dict, dict]]
    simulated: Callable[[], tuple[dict, dict]] | None

    def __repr__(self) -> str:
        return f"ServingRun(simulated={'yes' if self.simulated is not None else 'no'})"


# --- emulated -----------------------------------------------------------------------------
def replay_schedule(requests, engine: str, num_blocks: int, settings: dict) -> tuple:
    """``(steps, kv_usage, outcomes)``: the scheduler ``engine`` (its ``settings``, ``num_blocks``
    blocks) run on the host over ``requests`` exactly as the serving program runs it on
    every rank (:func:`pipeline_parallel.decoder.serve_program`): before step i the
    requests with ``arrival_step <= i`` join, then ``schedule()``, the usage after its
    allocation, ``finish_step()`` — one entry per step, empty steps included."""
    # lazy: keeps vcluster --help fast
    from serving import make_scheduler, steps_by_arrival
    sched = make_scheduler(engine, num_blocks, **settings)
    steps, usage, outcomes = [], [], []
    for step in steps_by_arrival(sched, requests, "replay_schedule"):
        usage.append(sched.pool.usage)
        outcomes.append(sched.finish_step(step))
        steps.append(step)
    return steps, usage, outcomes


def step_rows(steps):
    """The batch of every step as numbers, one row per scheduled request ``(step,
    request, new tokens, computed tokens, samples, decode, blocks, sum of block ids)`` and
    per preempted one ``(step, request, -1, ...)`` — what two runs of a scheduler compare
    (an (n, 8) float array)."""
    import numpy as np  # lazy: keeps vcluster --help fast
    rows = []
    for k, step in enumerate(steps):
        for s in step.scheduled:
            rows.append((k, s.request_id, s.num_new_tokens, s.num_computed_tokens,
                         int(s.samples), int(s.is_decode), len(s.block_table),
                         sum(s.block_table)))
        rows += [(k, rid, -1, -1, -1, -1, -1, -1) for rid in step.preempted]
    return np.array(rows, dtype=np.float64).reshape(len(rows), 8)


def emulated_records(outputs_by_rank: list, requests, engine: str, num_blocks: int,
                     settings: dict) -> tuple[dict, dict]:
    """``(summary, tables)`` of an emulated serving run (module docstring): rank 0's
    engine steps and tokens, the host replay's KV usage and per-request steps."""
    # lazy: keeps vcluster --help fast
    import pandas as pd
    from pipeline_parallel.decoder import ServeRun
    first = outputs_by_rank[0]
    steps = tuple(first["steps"])
    run = ServeRun(MappingProxyType(dict(first["outputs"])), steps, first["preemptions"],
                   MappingProxyType({}))
    replayed, usage, outcomes = replay_schedule(requests, engine, num_blocks, settings)
    emitted_at, finished_at, preempted = {}, {}, {}
    for k, (step, outcome) in enumerate(zip(replayed, outcomes)):
        for rid in outcome.emitted:
            emitted_at.setdefault(rid, k)
        for rid in outcome.finished:
            finished_at[rid] = k
        for rid in step.preempted:
            preempted[rid] = preempted.get(rid, 0) + 1
    requests_frame = pd.DataFrame([{
        "source": "emulated", "request_id": r.request_id, "prompt_len": r.prompt_len,
        "output_len": r.output_len, "arrival_step": r.arrival_step,
        "first_token_step": emitted_at.get(r.request_id),
        "finish_step": finished_at.get(r.request_id),
        "preemptions": preempted.get(r.request_id, 0),
        "tokens": " ".join(map(str, run.outputs[r.request_id]))} for r in requests])
    steps_frame = pd.DataFrame([{
        "source": "emulated", "pool": "", "replica": 0, "step": k,
        "prefill_tokens": s.prefill_tokens, "decode_seqs": s.decode_seqs,
        "num_scheduled_tokens": s.num_scheduled_tokens, "num_seqs": len(s.scheduled),
        "kv_usage": u, "preempted": len(s.preempted)} for k, (s, u) in
        enumerate(zip(steps, usage))])
    summary = {"emulated_engine_steps": len(steps),
               "emulated_output_tokens": sum(map(len, run.outputs.values())),
               "emulated_preemptions": run.preemptions, "emulated_kv_blocks": num_blocks,
               "emulated_blocks_used": len(run.blocks_used),
               "emulated_blocks_reused": len(run.blocks_reused),
               "emulated_peak_kv_usage": max(usage, default=0.0)}
    return summary, {"requests": _counts(requests_frame), "engine_steps": _counts(steps_frame)}


def _counts(frame):
    """``frame`` with its integer columns nullable (pandas ``Int64``): emulated and
    simulated rows, which fill different columns, stay integers side by side."""
    import pandas as pd  # lazy: keeps vcluster --help fast
    return frame.astype({c: "Int64" for c in frame.columns
                         if pd.api.types.is_integer_dtype(frame[c])
                         and not pd.api.types.is_bool_dtype(frame[c])})


# --- simulated ----------------------------------------------------------------------------
def simulated_records(spec, hardware, plan, source, seed: int) -> tuple[dict, dict]:
    """``(summary, tables)`` of :func:`~vcluster.timing.serving.deployment.simulate_serve`
    of ``spec`` on ``hardware`` (a HardwareSpec) with ``plan`` under ``source`` (a
    Workload, TraceWorkload or requests). A deployment that does not fit is simulated
    anyway (a replica given the blocks of one longest request) and says ``fits`` false,
    as a training prediction that does not fit does."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing.serving.deployment import simulate_serve
    report = simulate_serve(spec, hardware, plan, source, allow_oom=True, seed=seed)
    summary = {k: v for k, v in report.as_json().items() if k not in _DROPPED}
    c = report.capacity
    need = c.weights_bytes + c.activation_peak_bytes + c.non_torch_bytes \
        + math.ceil(report.longest_tokens / c.block_size) * c.bytes_per_block
    summary.update(predicted_peak_memory_gb=need / 1e9, memory_limit_gb=c.requested_bytes / 1e9)
    result = report.result
    requests = result.requests_frame()
    requests.insert(0, "source", "simulated")
    steps = result.steps_frame().rename(columns={"index": "step"})
    steps.insert(0, "source", "simulated")
    return summary, {"requests": _counts(requests), "engine_steps": _counts(steps)}
