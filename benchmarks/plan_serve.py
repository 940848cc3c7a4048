"""Speed of the serving planner (issue 53: ``plan serve`` over <= 500 configurations in
<= 60 s).

Searches Llama-3.1-70B on up to ``--gpus`` H100s (``h100-dgx``) at ``--rate`` requests/s
with P90 TTFT <= 1 s and P90 TPOT <= 50 ms (the issue's question), with prefill:decode
pools (``--disaggregated``), ``--requests`` requests of 1024 prompt and 128 output tokens
per deployment — exactly what

    vcluster plan serve --model llama-3.1-70b --gpus 32 --rate 20 --slo-ttft 1000 \\
        --slo-tpot 50 --disaggregated

runs — and reports its wall time and the number of deployments it simulated, beside a
same-run baseline: one ``simulate_serve`` of the whole workload on one layout (1 replica of
TP 8), i.e. what a hand search pays per configuration. Run from the repository root:

    python benchmarks/plan_serve.py [--gpus 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args(argv)

    from modeling.presets import load_model
    from serving import ServingPlan
    from vcluster.planner.serving import plan_serve
    from vcluster.timing.presets import preset
    from vcluster.timing.serving.deployment import simulate_serve
    from vcluster.timing.serving.workload import Workload

    spec, hw = load_model("llama-3.1-70b"), preset("h100-dgx")
    workload = Workload(args.requests, 1024, 128, rate=args.rate, seed=0)
    t0 = time.perf_counter()
    simulate_serve(spec, hw, ServingPlan(tp=8), workload)
    baseline_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = plan_serve(spec, hw, ServingPlan(), workload, gpus=args.gpus,
                        slo_ttft_ms=1000.0, slo_tpot_ms=50.0, disaggregated=True)
    wall_s = time.perf_counter() - t0
    best = result.best
    figures = {"plan_wall_s": wall_s, "configurations": len(result.candidates),
               "search_space": result.space,
               "baseline_one_simulation_s": baseline_s, "gpus": args.gpus,
               "rate": args.rate, "requests": args.requests,
               "best": None if best is None else best.row(),
               "rejected": result.rejected}
    print(f"plan serve: {len(result.candidates)} of {result.space} deployments of "
          f"llama-3.1-70b on <= {args.gpus} H100s simulated in {wall_s:.1f} s (goal: <= 500 "
          "in <= 60 s); baseline: one "
          f"simulate_serve of the same {args.requests} requests {baseline_s:.2f} s")
    print("best:", "none" if best is None else best.row())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
