"""The measured one-GPU PyTorch steps (``validate-model``'s GPU-step tables) predicted
under each way of pricing kernels, with and without plain PyTorch's autocast kernels
(:mod:`vcluster.planner.autocast_kernels`; on a compiled row, under the ``torch_compile``
policy, those kernels as Inductor fuses them: :mod:`vcluster.planner.inductor_kernels`).

Pricings: the GPU's preset (analytic, over ``TRAINING_KERNEL_EFFICIENCY``: what
``validate-model`` reports); the preset with the shipped ``h100_kernels.csv`` moved to
its GPU by datasheet ratios; and each ``hardware calibrate --gpu`` file kept under
``benchmarks/results`` (for the rows of its own GPU). Every row of these tables was
measured before the autocast kernels were written: read the figures as checked, not held
out (docs/timing.md).

    python benchmarks/gpu_steps_by_pricing.py [--rows]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from vcluster.planner.simulation import simulate_gpt
from vcluster.planner.validation import GPU_STEP_TABLES, gpu_steps
from vcluster.timing import load_hardware

RESULTS = Path(__file__).resolve().parent / "results"
CALIBRATED = {"H100": RESULTS / "h100-2026-11-26" / "calibrated-final.yaml",
              "H200": RESULTS / "h200-2026-11-26" / "calibrated.yaml"}


def _pricings(preset: str) -> dict:
    gpu = "H100" if preset.startswith("h100") else "H200"
    return {"preset": preset,
            "h100_kernels.csv moved": load_hardware({"base": preset, "device": {
                "kernel_table": "h100_kernels.csv"}}),
            f"calibrated {gpu}": load_hardware(str(CALIBRATED[gpu]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="print every row's error too")
    args = parser.parse_args(argv)
    errors: dict = {}
    pricings = {preset: _pricings(preset) for preset, _ in GPU_STEP_TABLES.values()}
    for table, preset, precision, r, cfg, par, case in gpu_steps():
        measured = float(r["step_ms"]) / 1e3
        for pricing, hw in pricings[preset].items():
            for autocast in (False, True):
                sim = simulate_gpt(cfg, par, hw, precision=precision, autocast_kernels=autocast)
                e = sim.step_time_s / measured - 1.0
                errors.setdefault((table, pricing, autocast), []).append(e)
                if args.rows:
                    print(f"{table + ' ' + case:55s} {pricing:24s} autocast={autocast!s:5s} "
                          f"{100 * e:+6.1f}%")
    print(f"{'table':24s} {'pricing':24s} {'without autocast kernels':>26s} "
          f"{'with them':>22s}")
    for (table, pricing, autocast), e in errors.items():
        if autocast:
            continue
        cells = []
        for a in (False, True):
            v = errors[(table, pricing, a)]
            cells.append(f"{100 * statistics.mean(map(abs, v)):5.1f}% "
                         f"({100 * min(v):+.1f}..{100 * max(v):+.1f})")
        print(f"{table:24s} {pricing:24s} {cells[0]:>26s} {cells[1]:>22s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
