"""Serving metrics exactly as ``vllm bench serve`` computes them, from per-request records.

Imitated: ``calculate_metrics`` and the result dictionary of ``vllm/benchmarks/serve.py``
(vLLM 0.10–0.11; the same formulas as the older ``benchmarks/benchmark_serving.py``). Per
completed request i, sent at aᵢ, with output-token times τᵢ,₁ < … < τᵢ,ₙᵢ (the client sees
a token when its step ends):

* TTFT  = τᵢ,₁ − aᵢ;   E2EL = τᵢ,ₙᵢ − aᵢ (vLLM's ``latency``);
* TPOT  = (E2EL − TTFT) / (nᵢ − 1), only for nᵢ > 1 (requests of one output token are
  left out of TPOT; vLLM counts them as 0 only for goodput);
* ITL   = every gap τᵢ,ₖ₊₁ − τᵢ,ₖ of every request, pooled (one token per streamed chunk).

Each of the four: mean, median, std (numpy's population std, ddof = 0), and the
percentiles asked (numpy's default linear interpolation), in ms; an empty list reads 0,
as vLLM's ``np.mean(x or 0)`` does. Totals over the duration D: ``request_throughput`` =
completed / D, ``output_throughput`` = Σnᵢ / D, ``total_token_throughput`` = (Σ prompt + Σnᵢ)
/ D. ``max_output_tokens_per_s``: the most output tokens in one whole-second bucket counted
from the first send (⌊τ − min aᵢ⌋); ``max_concurrent_requests``: the most requests in flight
over the half-open intervals [aᵢ, aᵢ + E2ELᵢ) (a departure before an arrival at the same
instant) — both as vLLM computes them.

**Duration.** vLLM's ``benchmark_duration`` runs from the benchmark's start — *before* the
first request's own sampled delay — to the last response. The workloads here put that start
at t = 0 (:mod:`~vcluster.timing.serving.workload`), so D = max finish − ``start_s`` with
``start_s = 0``; pass ``start_s`` = the first send time to measure from the first arrival
instead.

Beyond vLLM's keys: ``output_throughput_per_gpu`` = ``output_throughput`` / GPUs, and the
KV-cache usage (used / usable blocks, vLLM's ``kv_cache_usage`` gauge) as sampled once per
engine step: ``mean_kv_cache_usage`` weighted by the steps' durations
(Σ uₖ·dₖ / Σ dₖ over every replica's steps) and ``peak_kv_cache_usage`` = max uₖ.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from modeling.errors import ConfigError

__all__ = ["RequestRecord", "LatencyStats", "ServingMetrics", "compute_metrics",
           "DEFAULT_PERCENTILES"]

#: Percentiles reported beside the median (vLLM's own default is (99,); 90 is asked here)
DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)
_MS_PER_S = 1000.0


@dataclass(frozen=True)
class RequestRecord:
    """One completed request: sent at ``arrival_s``, ``prompt_len`` input tokens, its
    output tokens seen at ``token_times_s`` (non-decreasing, the first ≥ ``arrival_s``), on
    ``replica`` (the decode replica when disaggregated)."""

    request_id: int
    arrival_s: float
    prompt_len: int
    token_times_s: tuple[float, ...]
    replica: int = 0

    def __post_init__(self):
        owner = f"RequestRecord {self.request_id!r}"
        times = self.token_times_s
        if not times:
            raise ConfigError("token_times_s", times, "at least one token time",
                              "a completed request emitted a token", owner=owner)
        if not times[0] >= self.arrival_s:
            raise ConfigError("token_times_s", times[0], f">= arrival_s={self.arrival_s}",
                              "a token before its request was sent", owner=owner)
        if not all(map(operator.le, times, times[1:])):            # in C: 10^5 tokens a run
            raise ConfigError("token_times_s", times, "non-decreasing times",
                              "tokens out of order", owner=owner)

    @property
    def output_len(self) -> int:
        """Output tokens received."""
        return len(self.token_times_s)

    @property
    def first_token_s(self) -> float:
        return self.token_times_s[0]

    @property
    def finish_s(self) -> float:
        return self.token_times_s[-1]

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2el_s(self) -> float:
        return self.token_times_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(E2EL − TTFT)/(n − 1); None for a single output token."""
        n = len(self.token_times_s)
        return None if n < 2 else (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1)


def _p_word(p: float) -> str:
    """vLLM's key spelling: ``p99``, ``p99.9``."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(frozen=True)
class LatencyStats:
    """mean, median, std and ``percentiles_ms`` ((p, value) pairs) of one latency, ms."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, values_s, percentiles) -> "LatencyStats":
        """Statistics of ``values_s`` (seconds) as vLLM forms them (empty: all 0)."""
        x = np.asarray(values_s, dtype=float)
        if x.size == 0:
            x = np.zeros(1)
        return cls(float(np.mean(x)) * _MS_PER_S, float(np.median(x)) * _MS_PER_S,
                   float(np.std(x)) * _MS_PER_S,
                   tuple((float(p), float(np.percentile(x, p)) * _MS_PER_S)
                         for p in percentiles))

    def percentile(self, p: float) -> float:
        for q, value in self.percentiles_ms:
            if q == p:
                return value
        raise KeyError(f"percentile {p} was not computed; have "
                       f"{[q for q, _ in self.percentiles_ms]}")

    def keys(self, name: str) -> dict[str, float]:
        """vLLM's result keys for metric ``name`` (``ttft``, ``tpot``, ``itl``, ``e2el``)."""
        out = {f"mean_{name}_ms": self.mean_ms, f"median_{name}_ms": self.median_ms,
               f"std_{name}_ms": self.std_ms}
        for p, value in self.percentiles_ms:
            out[f"p{_p_word(p)}_{name}_ms"] = value
        return out


@dataclass(frozen=True)
class ServingMetrics:
    """A run's serving metrics (module docstring); ``as_json()`` gives vLLM's keys."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float       # req/s
    output_throughput: float        # output tok/s
    total_token_throughput: float   # (input + output) tok/s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    num_gpus: int
    output_throughput_per_gpu: float  # output tok/s/GPU
    mean_kv_cache_usage: float        # 0..1, step-duration weighted
    peak_kv_cache_usage: float        # 0..1

    def as_json(self) -> dict:
        """vLLM ``bench serve``'s result keys (``duration``, ``completed``, …,
        ``p99_itl_ms``) plus ``num_gpus``, ``output_throughput_per_gpu``,
        ``mean_kv_cache_usage`` and ``peak_kv_cache_usage``."""
        out = {"duration": self.duration_s, "completed": self.completed,
               "failed": self.failed, "total_input_tokens": self.total_input_tokens,
               "total_output_tokens": self.total_output_tokens,
               "request_throughput": self.request_throughput,
               "output_throughput": self.output_throughput,
               "total_token_throughput": self.total_token_throughput,
               "max_output_tokens_per_s": self.max_output_tokens_per_s,
               "max_concurrent_requests": self.max_concurrent_requests}
        for name in ("ttft", "tpot", "itl", "e2el"):
            out.update(getattr(self, name).keys(name))
        out.update({"num_gpus": self.num_gpus,
                    "output_throughput_per_gpu": self.output_throughput_per_gpu,
                    "mean_kv_cache_usage": self.mean_kv_cache_usage,
                    "peak_kv_cache_usage": self.peak_kv_cache_usage})
        return out

    def __repr__(self) -> str:
        return (f"ServingMetrics(completed={self.completed}, duration_s={self.duration_s:.4g}, "
                f"output_throughput={self.output_throughput:.4g}, "
                f"mean_ttft_ms={self.ttft.mean_ms:.4g}, mean_tpot_ms={self.tpot.mean_ms:.4g}, "
                f"p99_itl_ms={_maybe(self.itl, 99.0)}, "
                f"peak_kv_cache_usage={self.peak_kv_cache_usage:.3g})")


def _maybe(stats: LatencyStats, p: float) -> str:
    try:
        return f"{stats.percentile(p):.4g}"
    except KeyError:
        return "n/a"


def _peak_concurrency(starts: np.ndarray, ends: np.ndarray) -> int:
    """Most intervals [start, end) open at once; a departure precedes an arrival at the
    same instant."""
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones(starts.size, int), -np.ones(ends.size, int)])
    order = np.lexsort((deltas, times))      # by time, then -1 before +1
    return int(max(0, np.max(np.cumsum(deltas[order]))))


def compute_metrics(records, *, start_s: float = 0.0, duration_s: float | None = None,
                    failed: int = 0, percentiles=DEFAULT_PERCENTILES, num_gpus: int = 1,
                    kv_usage=(), kv_weights_s=()) -> ServingMetrics:
    """The metrics of completed ``records`` (module docstring). ``duration_s`` defaults to
    the last finish − ``start_s`` (the benchmark start); ``failed`` counts requests that
    did not complete; ``kv_usage`` / ``kv_weights_s``: per-step KV usage and step
    durations (empty: both usages 0)."""
    records = tuple(records)
    if not records:
        raise ConfigError("records", 0, "at least one completed request",
                          "no metrics without requests", owner="compute_metrics")
    pct = tuple(float(p) for p in percentiles)
    bad = [p for p in pct if not 0 <= p <= 100]
    if bad:
        raise ConfigError("percentiles", bad[0], "numbers in [0, 100]", "not a percentile",
                          owner="compute_metrics")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ConfigError("num_gpus", num_gpus, "an integer >= 1", "not a GPU count",
                          owner="compute_metrics")
    arrivals = np.array([r.arrival_s for r in records])
    firsts = np.array([r.token_times_s[0] for r in records])
    finishes = np.array([r.token_times_s[-1] for r in records])
    outs = np.array([len(r.token_times_s) for r in records])
    total_in = sum(r.prompt_len for r in records)
    total_out = int(outs.sum())
    if duration_s is None:
        duration_s = float(finishes.max()) - start_s
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ConfigError("duration_s", duration_s, "a finite number > 0",
                          "throughputs divide by it", owner="compute_metrics")
    ttft = firsts - arrivals
    e2el = finishes - arrivals
    multi = outs > 1
    tpot = (finishes[multi] - firsts[multi]) / (outs[multi] - 1)
    itl = np.concatenate([np.diff(np.asarray(r.token_times_s)) for r in records])
    # vLLM's per-second output-token buckets, from the first send
    t0 = float(arrivals.min())
    buckets = int(np.ceil(float(finishes.max()) - t0)) + 1
    stamps = np.floor(np.concatenate([np.asarray(r.token_times_s) for r in records])
                      - t0).astype(int)
    per_second = np.bincount(stamps[(stamps >= 0) & (stamps < buckets)], minlength=buckets)
    usage = np.asarray(kv_usage, dtype=float)
    weights = np.asarray(kv_weights_s, dtype=float)
    if usage.shape != weights.shape:
        raise ConfigError("kv_weights_s", weights.size, f"{usage.size} step durations",
                          "one duration per KV-usage sample", owner="compute_metrics")
    mean_kv = float(np.sum(usage * weights) / np.sum(weights)) if weights.sum() > 0 else 0.0
    output_throughput = total_out / duration_s
    return ServingMetrics(
        duration_s=float(duration_s), completed=len(records), failed=int(failed),
        total_input_tokens=int(total_in), total_output_tokens=total_out,
        request_throughput=len(records) / duration_s, output_throughput=output_throughput,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=LatencyStats.of(ttft, pct), tpot=LatencyStats.of(tpot, pct),
        itl=LatencyStats.of(itl, pct), e2el=LatencyStats.of(e2el, pct),
        max_output_tokens_per_s=float(per_second.max()),
        max_concurrent_requests=_peak_concurrency(arrivals, finishes),
        num_gpus=num_gpus, output_throughput_per_gpu=output_throughput / num_gpus,
        mean_kv_cache_usage=mean_kv,
        peak_kv_cache_usage=float(usage.max()) if usage.size else 0.0)
