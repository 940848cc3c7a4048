"""``plan_serve``: the serving layout with the most goodput per GPU under latency SLOs.

The question it answers: *how many GPUs, at what TP, PP and EP, in how many replicas (or
prefill:decode pools), to serve this model at R requests/s with P90 TTFT ≤ a and P90
TPOT ≤ b?*

* **Goodput** (DistServe, Zhong et al. OSDI'24): the rate of requests that meet *both*
  SLOs — R × attainment, attainment being the share of requests with TTFT ≤ a and TPOT ≤
  b. A candidate *meets the SLOs* when the ``slo_percentile`` (default 90) of TTFT and of
  TPOT are within them. Candidates are ranked: those that meet the SLOs first, by goodput
  per GPU (R × attainment / GPUs), then by fewer GPUs and lower P90 TTFT.
* **Layouts**: tp a power of two up to ``max_tp`` (default: the GPUs of one node, the NVLink
  domain) that the model's heads allow; pp ∈ {1, 2, 4, 8} with tp·pp ≤ the GPUs; ep ∈ {1,
  tp} for an MoE whose experts it divides (:class:`serving.ServingPlan`). A layout whose
  weights leave no KV cache for the workload's longest request is rejected ("does not
  fit").
* **Replicas**: under round-robin routing replica 0 of n serves requests 0, n, 2n, … and
  the replicas are identical, so n replicas are priced by simulating replica 0 on that
  subsequence (exact for replica 0; the others see statistically the same load). For each
  layout the fewest replicas that meet the SLOs are found by bisection (latency falls as
  replicas are added — the load per replica falls), every simulated n is a candidate.
* **Disaggregated** (``disaggregated=True``): for each layout, its most replicas R = GPUs
  // (tp·pp) split into p prefill and R − p decode replicas, each split simulated whole
  (both pools and the KV transfers; under round robin p prefill and d decode replicas
  are g = gcd(p, d) like sub-deployments of p/g and d/g, each serving every g-th request,
  so one of them is simulated). TTFT falls as p grows and TPOT rises (fewer decode
  replicas), so bisection finds the fewest prefill replicas that meet the TTFT SLO: that
  split meets both SLOs if any does; every simulated split is a candidate.
* Layouts are searched side by side on ``workers`` processes.

The workload's requests are the same for every candidate (one seed).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace

import numpy as np

from modeling.errors import ConfigError
from modeling.spec import ModelSpec, MoE
from serving import ServingPlan
from vcluster.runtime.cores import usable_cores
from vcluster.timing.hardware import HardwareSpec
from vcluster.timing.serving.deployment import serving_capacity, serving_pricer, simulate_serve

from .search import process_pool

__all__ = ["ServeCandidate", "ServePlanResult", "plan_serve", "serving_layouts"]

_PIPELINE_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ServeCandidate:
    """One simulated deployment: its ``plan``, the SLO percentile's TTFT and TPOT (ms),
    ``attainment`` (share of requests within both SLOs), ``goodput_rps`` (rate ×
    attainment), output throughput and whether it ``meets_slo``."""

    plan: ServingPlan
    ttft_ms: float
    tpot_ms: float
    attainment: float
    goodput_rps: float
    output_throughput: float
    meets_slo: bool
    kv_blocks: int

    @property
    def gpus(self) -> int:
        return self.plan.gpus

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.gpus

    def row(self) -> dict:
        p = self.plan
        return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "replicas": p.replicas,
                "prefill_replicas": p.prefill_replicas, "gpus": self.gpus,
                "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "attainment": self.attainment, "goodput_rps": self.goodput_rps,
                "goodput_per_gpu": self.goodput_per_gpu,
                "output_throughput": self.output_throughput, "meets_slo": self.meets_slo,
                "kv_blocks": self.kv_blocks}


@dataclass(frozen=True)
class ServePlanResult:
    """Every simulated candidate, best first; ``rejected`` layouts by reason; the search's
    settings and wall time."""

    model: str
    hardware: str
    rate: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    slo_percentile: float
    candidates: tuple[ServeCandidate, ...]
    rejected: dict = field(default_factory=dict)
    wall_s: float = 0.0
    space: int = 0      # deployments of the layouts that fit (bisection simulates fewer)

    @property
    def best(self) -> ServeCandidate | None:
        """The best candidate that meets the SLOs (None when none does)."""
        return next((c for c in self.candidates if c.meets_slo), None)

    def as_json(self) -> dict:
        return {"model": self.model, "hardware": self.hardware, "rate": self.rate,
                "slo_ttft_ms": self.slo_ttft_ms, "slo_tpot_ms": self.slo_tpot_ms,
                "slo_percentile": self.slo_percentile,
                "candidates": [c.row() for c in self.candidates],
                "rejected": dict(self.rejected), "wall_s": self.wall_s,
                "space": self.space}

    def describe(self, top: int = 10) -> str:
        p = f"P{self.slo_percentile:g}"
        lines = [f"plan serve: {self.model} on {self.hardware} at {self.rate:g} req/s; SLOs "
                 f"{p} TTFT <= {self.slo_ttft_ms:g} ms, {p} TPOT <= {self.slo_tpot_ms:g} ms; "
                 f"{len(self.candidates)} of {self.space} deployments simulated (bisection) in "
                 f"{self.wall_s:.1f} s"]
        header = (f"{'tp':>3} {'pp':>3} {'ep':>3} {'repl':>5} {'pre':>4} {'GPUs':>5} "
                  f"{p + ' TTFT ms':>13} {p + ' TPOT ms':>13} {'attain':>7} "
                  f"{'goodput/GPU':>12} {'out tok/s':>10}  SLO")
        lines.append(header)
        for c in self.candidates[:top]:
            q = c.plan
            lines.append(f"{q.tp:>3} {q.pp:>3} {q.ep:>3} {q.replicas:>5} "
                         f"{q.prefill_replicas:>4} {c.gpus:>5} {c.ttft_ms:>13.1f} "
                         f"{c.tpot_ms:>13.2f} {c.attainment:>7.1%} "
                         f"{c.goodput_per_gpu:>12.3f} {c.output_throughput:>10.0f}  "
                         + ("meets" if c.meets_slo else "misses"))
        for reason, count in sorted(self.rejected.items()):
            lines.append(f"rejected: {count} layout(s): {reason}")
        best = self.best
        lines.append("best: " + ("none meets the SLOs at this rate" if best is None else
                                 f"tp {best.plan.tp} x pp {best.plan.pp}"
                                 + (f" (ep {best.plan.ep})" if best.plan.ep > 1 else "")
                                 + f", {best.plan.replicas} replica(s)"
                                 + (f" + {best.plan.prefill_replicas} prefill"
                                    if best.plan.prefill_replicas else "")
                                 + f" = {best.gpus} GPUs"))
        return "\n".join(lines)


def serving_layouts(spec: ModelSpec, gpus: int, max_tp: int) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) the search tries (module docstring), refused layouts left out."""
    out = []
    moe = any(isinstance(x.mlp, MoE) for x in spec.layers)
    tp = 1
    while tp <= min(max_tp, gpus):
        for pp in _PIPELINE_DEGREES:
            if tp * pp > gpus:
                continue
            for ep in ((1, tp) if moe and tp > 1 else (1,)):
                try:
                    ServingPlan(tp=tp, pp=pp, ep=ep).check(spec)
                except ConfigError:
                    continue
                out.append((tp, pp, ep))
        tp *= 2
    return out


def _candidate(plan: ServingPlan, report, rate: float, slo_ttft_ms: float,
               slo_tpot_ms: float, q: float, scale: int) -> ServeCandidate:
    """Figures of a simulated ``report``; ``scale``: replicas the simulated one stands for."""
    result = report.result
    frame = result.requests_frame()
    ttft = frame["ttft_s"].to_numpy() * 1e3
    tpot = frame["tpot_s"].to_numpy() * 1e3
    tpot_known = tpot[~np.isnan(tpot)]
    ttft_q = float(np.percentile(ttft, q))
    tpot_q = float(np.percentile(tpot_known, q)) if tpot_known.size else 0.0
    ok = (ttft <= slo_ttft_ms) & (np.isnan(tpot) | (tpot <= slo_tpot_ms))
    attainment = float(ok.mean())
    return ServeCandidate(plan, ttft_q, tpot_q, attainment, rate * attainment,
                          result.metrics.output_throughput * scale,
                          ttft_q <= slo_ttft_ms and tpot_q <= slo_tpot_ms,
                          report.capacity.num_blocks)


_NO_FIT = "does not fit: weights leave no KV cache for the longest request"
#: how long the search waits for one layout's worker before it says which layout hangs
LAYOUT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class _Job:
    """One layout's search: everything a worker process needs."""

    spec: ModelSpec
    hardware: HardwareSpec
    plan: ServingPlan              # the layout, 1 replica, no prefill pool
    requests: tuple
    most: int                      # replicas the GPUs allow
    rate: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    slo_percentile: float
    disaggregated: bool


def _search_layout(job: _Job) -> tuple[list[ServeCandidate], str | None]:
    """The candidates of one layout (module docstring), or why it was rejected."""
    spec, hw, plan, requests = job.spec, job.hardware, job.plan, job.requests
    longest = max(r.prompt_len + r.output_len for r in requests)
    cap = serving_capacity(spec, hw, plan, plan.max_model_len)
    if cap.num_blocks * cap.block_size < min(longest, plan.max_model_len or longest) \
            or cap.num_blocks < 2:
        return [], _NO_FIT
    figures = (job.rate, job.slo_ttft_ms, job.slo_tpot_ms, job.slo_percentile)
    seen: dict[int, ServeCandidate] = {}
    # one replica's step prices, whatever the replica counts: one model for the layout,
    # its memo of step prices (ServingCostModel) kept from one simulation to the next
    pricer = serving_pricer(spec, hw, plan)

    def colocated(n: int) -> ServeCandidate:
        if n not in seen:
            report = simulate_serve(spec, hw, plan, requests[0::n], pricer=pricer)
            seen[n] = _candidate(replace(plan, replicas=n), report, *figures, n)
        return seen[n]

    lo, hi = 1, job.most                # the fewest replicas that meet the SLOs (none if
    if colocated(hi).meets_slo:         # the most do not: fewer replicas only add load)
        while lo < hi:
            mid = (lo + hi) // 2
            if colocated(mid).meets_slo:
                hi = mid
            else:
                lo = mid + 1
    out = list(seen.values())
    if job.disaggregated and job.most >= 2:
        split: dict[int, ServeCandidate] = {}

        def pools(p: int) -> ServeCandidate:
            if p not in split:
                d = job.most - p
                g = math.gcd(p, d)          # g like sub-deployments, each every g-th request
                unit = replace(plan, replicas=d // g, prefill_replicas=p // g)
                report = simulate_serve(spec, hw, unit, requests[0::g], pricer=pricer)
                split[p] = _candidate(replace(plan, replicas=d, prefill_replicas=p), report,
                                      *figures, g)
            return split[p]

        def ttft_ok(c: ServeCandidate) -> bool:
            return c.ttft_ms <= job.slo_ttft_ms

        lo, hi = 1, job.most - 1        # the fewest prefill replicas that meet the TTFT SLO
        if ttft_ok(pools(hi)):
            while lo < hi:
                mid = (lo + hi) // 2
                if ttft_ok(pools(mid)):
                    hi = mid
                else:
                    lo = mid + 1
            pools(lo)
        out += list(split.values())
    return out, None


def plan_serve(spec: ModelSpec, hardware: HardwareSpec, base: ServingPlan, workload, *,
               gpus: int, slo_ttft_ms: float, slo_tpot_ms: float,
               slo_percentile: float = 90.0, max_tp: int | None = None,
               disaggregated: bool = False, workers: int | None = None,
               progress=None) -> ServePlanResult:
    """Search deployments of ``spec`` on at most ``gpus`` GPUs of ``hardware`` (module
    docstring); ``base`` carries the engine settings, ``workload`` the load (its
    ``rate`` is the whole deployment's). ``workers``: processes searching layouts side by
    side (default: the cores this process may use; 1: this process). ``progress``: a
    stream for one line per layout."""
    start = time.perf_counter()
    for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(name, value, "a number of milliseconds > 0", "not an SLO")
    if not 0 < slo_percentile <= 100:
        raise ConfigError("slo_percentile", slo_percentile, "in (0, 100]", "not a percentile")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError("gpus", gpus, "an integer >= 1", "not a GPU count")
    max_tp = max_tp or hardware.domain_gpus        # tp inside one NVLink domain
    requests = workload.requests()
    rate = float(getattr(workload, "rate", math.inf))
    layouts = serving_layouts(spec, gpus, max_tp)
    if not layouts:
        raise ConfigError("gpus", gpus, "enough GPUs for one replica",
                          f"no layout of {spec.name} fits the search's limits")
    jobs = [_Job(spec, hardware, replace(base, tp=tp, pp=pp, ep=ep, replicas=1,
                                         prefill_replicas=0),
                 requests, gpus // (tp * pp), rate, slo_ttft_ms, slo_tpot_ms,
                 slo_percentile, disaggregated) for tp, pp, ep in layouts]
    cands: list[ServeCandidate] = []
    rejected: dict[str, int] = {}
    space = 0

    def collect(k: int, found, reason) -> None:
        nonlocal space
        cands.extend(found)
        if reason:
            rejected[reason] = rejected.get(reason, 0) + 1
        else:
            space += jobs[k].most + (jobs[k].most - 1 if disaggregated else 0)
        if progress is not None:
            p = jobs[k].plan
            print(f"plan serve: layout {k + 1}/{len(jobs)} (tp {p.tp}, pp {p.pp}, ep {p.ep}) "
                  f"done, {len(cands)} deployments in {time.perf_counter() - start:.1f} s",
                  file=progress, flush=True)

    pool = process_pool(workers or usable_cores(), len(jobs), "plan serve")
    if pool is not None:
        with pool:
            futures = [pool.submit(_search_layout, job) for job in jobs]
            for k, fut in enumerate(futures):
                try:
                    collect(k, *fut.result(timeout=LAYOUT_TIMEOUT_S))
                except FutureTimeout:
                    for f in futures:
                        f.cancel()
                    p = jobs[k].plan
                    raise TimeoutError(f"plan serve: waited {LAYOUT_TIMEOUT_S:.0f} s for the "
                                       f"worker searching tp {p.tp}, pp {p.pp}, ep {p.ep}; it "
                                       "did not finish") from None
    else:
        for k, job in enumerate(jobs):
            collect(k, *_search_layout(job))
    cands.sort(key=lambda c: (not c.meets_slo, -c.goodput_per_gpu, c.gpus, c.ttft_ms))
    return ServePlanResult(spec.name, hardware.name, rate, slo_ttft_ms, slo_tpot_ms,
                           slo_percentile, tuple(cands), rejected,
                           time.perf_counter() - start, space)
