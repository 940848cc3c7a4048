"""A served model's figures as tables for ``summary.md`` and ``report.html``: the
latencies as ``vllm bench serve`` prints them (TTFT, TPOT, ITL, E2EL; mean, median, std,
P90, P99, ms), the throughputs, the physics beside its floors, the KV cache and memory,
and the emulated run's counts — read from the record's summary (its last point in a
sweep), under the keys of :mod:`vcluster.scenario.serving_records`. A record without them
(every other kind) gets no section.
"""

from __future__ import annotations

import pandas as pd

__all__ = ["serving_sections"]

_LATENCIES = (("TTFT", "ttft"), ("TPOT (excl. 1st token)", "tpot"),
              ("ITL", "itl"), ("E2EL", "e2el"))
_STATS = ("mean", "median", "std", "p90", "p99")
_THROUGHPUT = (("completed requests", "completed", ""), ("duration", "duration", "s"),
               ("request throughput", "request_throughput", "req/s"),
               ("output throughput", "output_throughput", "tok/s"),
               ("total token throughput", "total_token_throughput", "tok/s"),
               ("output throughput per GPU", "output_throughput_per_gpu", "tok/s/GPU"),
               ("GPUs", "num_gpus", ""),
               ("most requests in flight", "max_concurrent_requests", ""))
#: (figure, key of the value, key of its physical floor, unit)
_PHYSICS = (("engine busy", "busy_s", "floor_s", "s"),
            ("decode step (mean)", "decode_step_ms", "decode_step_floor_ms", "ms"),
            ("memory per GPU (weights, activations, one longest request's KV)",
             "predicted_peak_memory_gb", "memory_limit_gb", "GB"),
            ("weights per GPU", "weights_gb_per_gpu", None, "GB"),
            ("KV blocks per replica", "kv_blocks_per_replica", None, ""),
            ("KV tokens per replica", "kv_tokens_per_replica", None, "tokens"),
            ("KV usage (mean, step-time weighted)", "mean_kv_cache_usage", None, "fraction"),
            ("KV usage (peak)", "peak_kv_cache_usage", None, "fraction"),
            ("preemptions", "preemptions", None, ""), ("fits", "fits", None, ""))
_EMULATED = (("engine steps", "emulated_engine_steps"),
             ("output tokens", "emulated_output_tokens"),
             ("preemptions (recomputed)", "emulated_preemptions"),
             ("KV blocks per device (one the null block)", "emulated_kv_blocks"),
             ("blocks used", "emulated_blocks_used"),
             ("blocks reused by a later request", "emulated_blocks_reused"),
             ("KV usage (peak)", "emulated_peak_kv_usage"))


def serving_sections(record) -> list[tuple[str, pd.DataFrame]]:
    """``[(title, table)]`` of the serving figures ``record.summary`` holds ([] for none)."""
    s = record.summary
    out = []
    if "mean_ttft_ms" in s:
        out.append(("Serving: latency (ms, simulated)", pd.DataFrame(
            [{"metric": name, **{stat: s.get(f"{stat}_{key}_ms") for stat in _STATS}}
             for name, key in _LATENCIES])))
        out.append(("Serving: throughput (simulated)", pd.DataFrame(
            [{"figure": name, "value": s.get(key), "unit": unit}
             for name, key, unit in _THROUGHPUT if key in s])))
        out.append(("Serving: physics, KV cache and memory (simulated)", pd.DataFrame(
            [{"figure": name, "value": s.get(key),
              "floor or limit": s.get(floor) if floor else None, "unit": unit}
             for name, key, floor, unit in _PHYSICS if key in s])))
    if "emulated_engine_steps" in s:
        out.append(("Serving: the emulated run", pd.DataFrame(
            [{"figure": name, "value": s.get(key)} for name, key in _EMULATED if key in s])))
    return out
