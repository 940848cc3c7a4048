"""The models of 2026 at scale (issue 52): wall time and peak memory of simulating
DeepSeek-V3 on 1,024 H100s (tp 2, pp 8 interleaved, ep 64, the expert group folded over
tp) and of planning Qwen3-235B-A22B on 256 H100s, beside a same-run baseline: a dense
Llama-3.1-70B simulated on 1,024 H100s by the same machinery. Targets (the issue):
DeepSeek-V3 in <= 10 s with <= 2 GB, the plan in <= 120 s. Each case runs in a fresh
process (its own peak RSS). Run from the repository root:

    python benchmarks/moe_2026.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {
    "baseline: llama-3.1-70b dense, 1024 x H100 (tp 8, pp 8, dp 16)": """
from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.simulation import simulate_gpt
cfg = GPTConfig.of_model("llama-3.1-70b", seq=4096, timing_only=True)
par = ParallelConfig(global_batch=1024, micro_batch=1, dp=16, pp=8, tp=8,
                     sequence_parallel=True, schedule="interleaved_1f1b", virtual_stages=2,
                     recompute="selective")
r = simulate_gpt(cfg, par, "h100-dgx")
figure = r.tokens_per_s_per_gpu
""",
    "deepseek-v3, 1024 x H100 (tp 2, pp 8 v 2, ep 64, etp 1)": """
from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.simulation import simulate_gpt
cfg = GPTConfig.of_model("deepseek-v3", seq=4096, timing_only=True)
par = ParallelConfig(global_batch=8192, micro_batch=1, dp=64, pp=8, tp=2, ep=64, etp=1,
                     sequence_parallel=True, schedule="interleaved_1f1b", virtual_stages=2,
                     first_stage_layers=3, last_stage_layers=2, recompute="selective")
r = simulate_gpt(cfg, par, "h100-dgx")
figure = r.tokens_per_s_per_gpu
""",
    "plan qwen3-235b-a22b, 256 x H100 (max ep 64)": """
from pipeline_parallel.gpt import GPTConfig
from vcluster.planner.search import plan_gpt
cfg = GPTConfig.of_model("qwen3-235b-a22b", seq=4096, timing_only=True)
df = plan_gpt(config=cfg, gpus=256, global_batch=1024, hardware="h100-dgx", max_ep=64,
              progress=False)
figure = float(df["step_time_s"].iloc[0])
""",
}

_RUN = """
import json, resource, time
t0 = time.perf_counter()
{body}
print(json.dumps({{"wall_s": time.perf_counter() - t0, "figure": figure,
                   "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records as JSON")
    args = parser.parse_args(argv)
    records = []
    print(f"{'case':<62}{'wall s':>8}{'peak GB':>9}  figure")
    for name, body in CASES.items():
        proc = subprocess.run([sys.executable, "-c", _RUN.format(body=body)],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr[-2000:]}")
            return 1
        rec = dict(json.loads(proc.stdout.strip().splitlines()[-1]), case=name)
        records.append(rec)
        unit = "s/step (best plan)" if name.startswith("plan") else "tokens/s per GPU"
        print(f"{name:<62}{rec['wall_s']:>8.1f}{rec['peak_rss_gb']:>9.2f}  "
              f"{rec['figure']:,.1f} {unit}", flush=True)
    if args.json:
        from vcluster.runtime.files import write_json
        write_json(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
