"""Speed of the serving simulator (issue 53: 1,000 requests simulated in <= 2 s).

Llama-3.1-8B on one H100 (``h100-dgx``), vLLM v1 defaults, 1,000 requests of 512 prompt
and 128 output tokens at Poisson rate 10 req/s, each step priced by the serving cost
model (:class:`vcluster.timing.serving.step_cost.ServingCostModel`) and the KV blocks from
:func:`serving.memory.kv_capacity` (the GPU memory torch reports,
:func:`~vcluster.timing.serving.deployment.reported_memory_bytes`). Reported beside same-run baselines: the time to
generate the workload, and the time to price the run's steps alone (the same
``EngineStep`` objects, recorded during the run, priced again in a plain loop with a fresh
pricer) — what is left is the scheduler and the SimPy loop. Medians over ``--rounds``.
Run from the repository root:

    python benchmarks/serve_simulate.py [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


class RecordingPricer:
    """Prices through ``inner`` and keeps every step it was asked about."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def step_time(self, step):
        self.steps.append(step)
        return self.inner.step_time(step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args(argv)

    from modeling.presets import load_model
    from serving.memory import kv_capacity
    from vcluster.timing.presets import preset
    from vcluster.timing.serving.deployment import reported_memory_bytes
    from vcluster.timing.serving.simulator import simulate_serving
    from vcluster.timing.serving.step_cost import ServingCostModel
    from vcluster.timing.serving.workload import Workload

    spec, hw = load_model("llama-3.1-8b"), preset("h100-dgx")
    blocks = kv_capacity(spec, gpu_memory_bytes=reported_memory_bytes(hw)).num_blocks
    workload = Workload(args.requests, 512, 128, rate=args.rate, seed=0)
    walls, gens, prices, result, steps = [], [], [], None, 0
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        workload.requests()
        gens.append(time.perf_counter() - t0)
        pricer = RecordingPricer(ServingCostModel(spec, hw))
        t0 = time.perf_counter()
        result = simulate_serving(workload, pricer=pricer, num_blocks=blocks)
        walls.append(time.perf_counter() - t0)
        fresh = ServingCostModel(spec, hw)
        t0 = time.perf_counter()
        for step in pricer.steps:
            fresh.step_time(step)
        prices.append(time.perf_counter() - t0)
        steps = len(pricer.steps)
    m = result.metrics
    figures = {
        "simulate_wall_s": statistics.median(walls),
        "baseline_generate_workload_s": statistics.median(gens),
        "baseline_price_steps_alone_s": statistics.median(prices),
        "engine_steps": steps, "requests": args.requests, "num_blocks": blocks,
        "walls_s": walls, "metrics": m.as_json(),
        "floors": {"busy_s": result.floors.busy_s, "floor_s": result.floors.floor_s,
                   "per_token_decode_s": result.floors.per_token_decode_s,
                   "per_token_decode_floor_s": result.floors.per_token_decode_floor_s},
    }
    print(f"llama-3.1-8b on 1 x H100, vllm-v1, {args.requests} requests 512/128 at "
          f"{args.rate:g} req/s, {blocks} KV blocks")
    print(f"  simulate:                 {figures['simulate_wall_s']:.3f} s wall "
          f"({steps} engine steps; target <= 2 s)")
    print(f"  baseline, workload alone: {figures['baseline_generate_workload_s']:.4f} s")
    print(f"  baseline, pricing alone:  {figures['baseline_price_steps_alone_s']:.3f} s "
          f"(the same {steps} steps, fresh pricer)")
    print(f"  predicted: mean TTFT {m.ttft.mean_ms:.2f} ms, mean TPOT {m.tpot.mean_ms:.2f} ms "
          f"(decode floor {1e3 * (result.floors.per_token_decode_floor_s or float('nan')):.2f}"
          f" ms), output {m.output_throughput:.0f} tok/s, peak KV "
          f"{100 * m.peak_kv_cache_usage:.1f} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
