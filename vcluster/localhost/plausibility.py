"""Whether a localhost calibration's figures are plausible, or those of a busy machine.

A calibration taken while other processes load the machine can record figures no quiet
machine produces (issue 56: a CPU calibration on a busy machine recorded 16 ms per tiny
matmul, and the quickstart priced on it predicted 2.48 s per step against 0.052 s
measured). :func:`spec_problems` names every figure past a bound that any machine of
the last decade keeps when quiet:

* the GEMM rates of one device alone (``gemm_float32_flops_per_s``,
  ``gemm_float64_flops_per_s``) at least ``GEMM_FLOOR_FLOPS_PER_S``;
* the host work of one op or call (``compute_overhead_s``, ``block_overhead_s``,
  ``numpy_call_s``, ``python_unit_s``) at most ``HOST_WORK_CEILING_S``.

The check is pure (a spec in, sentences out), so a synthetic spec tests it.
"""

from __future__ import annotations

from .spec import LocalhostSpec

__all__ = ["spec_problems", "GEMM_FLOOR_FLOPS_PER_S", "HOST_WORK_CEILING_S"]

# A (1024, 1024) @ (1024, 1024) product on one BLAS thread, float32 or float64. Measured
# here (AMD EPYC, 2 cores, numpy with one thread): float32 at 62 GFLOP/s (the shipped test
# spec, this machine rounded: 125 float32, 60 float64); a 256x256x256 float32 product at
# 101 GFLOP/s. A core of the last decade with AVX2 does tens of GFLOP/s, and even scalar
# code a few: 1 GFLOP/s is 60x below what this machine does.
GEMM_FLOOR_FLOPS_PER_S = 1e9
# The host work of one tiny op or call. Measured here: 2.6 us for the three numpy calls of
# compute_overhead_s's op (8x16 @ 16x16 float64, a bias add, a ReLU) alone in a loop, and
# 3 us (empty block), 1.5 us (numpy call), 25 us (glue pass) in the test spec's host
# rates. 1 ms is 40x the largest of them and 300x compute_overhead_s.
HOST_WORK_CEILING_S = 1e-3

_GEMMS = ("gemm_float32_flops_per_s", "gemm_float64_flops_per_s")
_HOST_WORK = ("compute_overhead_s", "block_overhead_s", "numpy_call_s", "python_unit_s")


def spec_problems(spec: LocalhostSpec) -> tuple[str, ...]:
    """One sentence per implausible figure of ``spec`` (empty when all are plausible):
    the figure, what it measured and the bound a quiet machine keeps."""
    out = []
    for name in _GEMMS:
        rate = getattr(spec, name)
        if rate < GEMM_FLOOR_FLOPS_PER_S:
            out.append(f"{name} = {rate / 1e9:.3g} GFLOP/s (a 1024x1024 product on one "
                       f"thread); a quiet CPU core does at least "
                       f"{GEMM_FLOOR_FLOPS_PER_S / 1e9:g} GFLOP/s")
    for name in _HOST_WORK:
        seconds = getattr(spec, name)
        if seconds is not None and seconds > HOST_WORK_CEILING_S:
            out.append(f"{name} = {seconds * 1e6:.4g} us per op; a quiet machine takes at "
                       f"most {HOST_WORK_CEILING_S * 1e6:g} us (a few us here)")
    return tuple(out)
