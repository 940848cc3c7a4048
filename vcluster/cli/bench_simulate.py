"""``vcluster bench simulate-scale``: how long the timing model takes at cluster scale.

Each case simulates one GPT training iteration with
:func:`vcluster.planner.simulation.simulate_gpt` in a fresh Python process, which
reports its wall time and its peak resident memory (``VmHWM`` of /proc/self/status:
``ru_maxrss`` of a process started by vfork and exec, as ``subprocess`` starts it, keeps
the parent's peak when that is higher). The targets of the
timing model: GPT-3 175B on 1,024 GPUs in ≤ 10 s and ≤ 4 GB; any configuration up to
6,144 GPUs and 512 micro-batches in ≤ 30 s. The baseline, measured in the same run
(``--baseline``), is the interleaved 6,144-GPU case traced the previous way: every one of
its 64 pipeline positions traced instead of three.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from vcluster.runtime.cores import usable_cores

from .args import csv_of

__all__ = ["add_parser", "CASES", "ScaleCase", "run_case"]

GPT3 = dict(hidden=12288, layers=96, heads=96, seq=2048, vocab=51200)
ONE_T = dict(hidden=25600, layers=128, heads=160, seq=2048, vocab=51200)


@dataclass(frozen=True)
class ScaleCase:
    """One configuration: model, degrees, micro-batches m (global batch m·dp), schedule,
    and the time goal in seconds."""

    name: str
    model: dict
    tp: int
    pp: int
    dp: int
    microbatches: int
    schedule: str
    virtual_stages: int | None
    goal_s: float
    recompute: str = "full"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


CASES = {c.name: c for c in (
    ScaleCase("gpt3-1024-1f1b", GPT3, 8, 8, 16, 96, "1f1b", None, 10.0),
    ScaleCase("1t-6144-1f1b", ONE_T, 8, 64, 12, 512, "1f1b", None, 30.0),
    ScaleCase("1t-6144-interleaved", ONE_T, 8, 64, 12, 512, "interleaved_1f1b", 2, 30.0),
    ScaleCase("1t-6144-zero-bubble", ONE_T, 8, 64, 12, 512, "zero_bubble", None, 30.0),
    ScaleCase("1t-6144-gpipe", ONE_T, 8, 64, 12, 512, "gpipe", None, 30.0),
)}

_CHILD = """
import json, resource, sys, time
from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.simulation import simulate_gpt
case = json.loads(sys.argv[1])
cfg = GPTConfig(**case["model"])
par = ParallelConfig(global_batch=case["microbatches"] * case["dp"], micro_batch=1,
                     dp=case["dp"], pp=case["pp"], tp=case["tp"], schedule=case["schedule"],
                     virtual_stages=case["virtual_stages"], recompute=case["recompute"])
t0 = time.perf_counter()
r = simulate_gpt(cfg, par, "a100-80gb-dgx",
                 traced_positions=None if case["all_positions"] else 3)
wall = time.perf_counter() - t0
try:    # this process's own peak: after a vfork + exec Linux keeps the parent's in ru_maxrss
    with open("/proc/self/status") as f:
        peak = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024)     # bytes on macOS, KiB on Linux
print(json.dumps({"wall_s": wall, "peak_rss_bytes": peak, "step_time_s": r.step_time_s,
                  "mfu": r.mfu}))
"""


def run_case(case: ScaleCase, all_positions: bool = False, timeout_s: float = 600.0) -> dict:
    """Run ``case`` in a fresh interpreter; its wall time, peak RSS and results."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    arg = json.dumps({**case.__dict__, "all_positions": all_positions})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench simulate-scale: case {case.name} did not finish in "
                           f"{timeout_s:g} s") from None
    if done.returncode:
        raise RuntimeError(f"bench simulate-scale: case {case.name} failed:\n{done.stderr}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"case": case.name, "gpus": case.gpus, "microbatches": case.microbatches,
            "schedule": case.schedule, "virtual_stages": case.virtual_stages,
            "goal_s": case.goal_s, "all_positions_traced": all_positions, **out}


def add_parser(kinds) -> None:
    """Register ``simulate-scale`` on the ``vcluster bench`` sub-commands ``kinds``."""
    p = kinds.add_parser(
        "simulate-scale", help="time and memory of simulating GPT iterations at scale",
        description=__doc__.split("\n\n")[1])
    p.add_argument("--cases", type=csv_of(tuple(CASES), "case"), default=list(CASES),
                   help="cases to run (default: all): " + ",".join(CASES))
    p.add_argument("--baseline", action="store_true",
                   help="also run the interleaved 6144-GPU case with every pipeline "
                        "position traced (the previous way; about a minute)")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    p.set_defaults(run=_simulate_scale)


def _simulate_scale(args) -> int:
    print(f"vcluster bench simulate-scale: load average {os.getloadavg()[0]:.1f} on "
          f"{usable_cores()} cores", flush=True)
    print(f"{'case':<34}{'GPUs':>6}{'m':>5}{'wall':>9}{'goal':>7}{'peak RSS':>10}"
          f"{'step time':>11}{'MFU':>7}", flush=True)
    rows = []
    runs = [(CASES[n], False) for n in args.cases]
    if args.baseline:
        runs.append((CASES["1t-6144-interleaved"], True))
    for case, all_positions in runs:
        r = run_case(case, all_positions)
        rows.append(r)
        name = case.name + (" (all traced)" if all_positions else "")
        print(f"{name:<34}{r['gpus']:>6}{r['microbatches']:>5}{r['wall_s']:>8.1f}s"
              f"{r['goal_s']:>6.0f}s{r['peak_rss_bytes'] / 1e9:>8.2f}GB"
              f"{r['step_time_s']:>10.2f}s{100 * r['mfu']:>6.1f}%", flush=True)
    if args.baseline:
        base, fast = rows[-1], next((r for r in rows[:-1]
                                     if r["case"] == "1t-6144-interleaved"), None)
        if fast is not None:
            print(f"interleaved 6144: {base['wall_s'] / fast['wall_s']:.1f}x faster than "
                  f"tracing every position; same step time: "
                  f"{base['step_time_s'] == fast['step_time_s']}")
    if args.json:
        # lazy: keeps vcluster --help fast
        from vcluster.runtime.files import write_json
        write_json(args.json, rows)
        print(f"wrote {args.json}")
    return 0
