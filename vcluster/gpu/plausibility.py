"""Whether a kernel sweep's figures are plausible, or those of a busy machine.

A sweep taken while other processes share the device (a CPU sweep on a loaded machine,
most often) records some streams stalled, and the replay then prices every kernel on
them (issue 56: a CPU calibration on a busy machine recorded 16 ms per tiny matmul, and
the quickstart priced on it predicted 2.48 s per step against 0.052 s measured).
:func:`sweep_problems` names every figure that no quiet device of its kind would produce:

* too slow: a GEMM that took longer than ``CALL_CEILING_S + 2·m·k·n / GEMM_FLOOR_FLOPS_PER_S``
  (a call costs less than the ceiling and the FLOPs run at no less than the floor), or a
  launch interval above ``CALL_CEILING_S``;
* out of order: a GEMM (or copy) that took more than ``INVERSION_RATIO`` times as long as
  one at least as large in every dimension (in bytes) measured in the same sweep — on a
  quiet machine a larger kernel never runs faster by that much; a stalled stream does.

The check is pure (a sweep in, sentences out), so a synthetic sweep tests it.
"""

from __future__ import annotations

from types import MappingProxyType

from .kernel_sweep import KernelSweep

__all__ = ["sweep_problems", "GEMM_FLOOR_FLOPS_PER_S", "CALL_CEILING_S", "INVERSION_RATIO"]

# The slowest GEMM rate a quiet device of the kind reaches, per device. CPU: 1 GFLOP/s of
# fp32, one thread — measured here (AMD EPYC, 2 cores, numpy and torch 2.13 with one
# thread): a 256x256x256 fp32 GEMM at 101-103 GFLOP/s and the tiny sweep's 256x128x256 at
# 98 GFLOP/s, 100x the floor; a core of the last decade with AVX2 does tens of GFLOP/s,
# and even scalar code a few. cuda: 1 TFLOP/s of bf16 — one H200 sustained 741 TFLOP/s and
# one H100 789 in this sweep (docs/timing.md), 700x the floor.
GEMM_FLOOR_FLOPS_PER_S = MappingProxyType({"cpu": 1e9, "cuda": 1e12})
# The most one call may cost besides its FLOPs: measured here, 1.5 us for the tiny sweep's
# 16x32x16 GEMM and ~1 us per launch on the CPU; 5.3 us per GEMM and a 5.7 us launch
# interval on an H200 (docs/timing.md). 1 ms is ~200x the slowest of them.
CALL_CEILING_S = MappingProxyType({"cpu": 1e-3, "cuda": 1e-3})
# A kernel may take at most this many times as long as one at least as large in every
# dimension. Measured here: on the quiet machine the tiny sweep's 18 GEMMs are in order
# (ratio <= 1); with four busy processes on its 2 cores, 16x32x16 took 62 us against
# 2.1 us for 16x32x64 (30x) and six GEMMs were out of order by 3.5-30x.
INVERSION_RATIO = 3.0


def sweep_problems(sweep: KernelSweep) -> tuple[str, ...]:
    """One sentence per implausible figure of ``sweep`` (empty when all are plausible):
    the figure, what it measured and what a quiet device measures (module docstring)."""
    return _too_slow(sweep) + _out_of_order(sweep, "gemm") + _out_of_order(sweep, "elementwise")


def _gemm_label(row) -> str:
    return f"GEMM {row.m}x{row.k}x{row.n} {row.dtype}"


def _too_slow(sweep: KernelSweep) -> tuple[str, ...]:
    floor, ceiling = GEMM_FLOOR_FLOPS_PER_S[sweep.device], CALL_CEILING_S[sweep.device]
    out = []
    for row in sweep.of_kind("gemm") + sweep.of_kind("gemm_sustained"):
        flops = 2 * row.m * row.k * row.n
        limit_s = ceiling + flops / floor
        if row.seconds > limit_s:
            out.append(f"{_gemm_label(row)}{' (sustained)' * (row.kind != 'gemm')} took "
                       f"{row.seconds * 1e6:.4g} us per call ({flops / row.seconds / 1e9:.3g} "
                       f"GFLOP/s); a quiet {sweep.device} takes at most {limit_s * 1e6:.4g} us "
                       f"(< {ceiling * 1e6:g} us per call, >= {floor / 1e9:g} GFLOP/s)")
    for row in sweep.of_kind("launch"):
        if row.seconds > ceiling:
            out.append(f"the launch interval was {row.seconds * 1e6:.4g} us; a quiet "
                       f"{sweep.device} launches a kernel in < {ceiling * 1e6:g} us")
    return tuple(out)


def _size(row) -> tuple[int, ...]:
    return (row.m, row.k, row.n) if row.kind == "gemm" else (row.bytes,)


def _label(row) -> str:
    return _gemm_label(row) if row.kind == "gemm" else f"copy of {row.bytes} B"


def _out_of_order(sweep: KernelSweep, kind: str) -> tuple[str, ...]:
    """Each row that took more than INVERSION_RATIO x as long as a row at least as large
    in every dimension (the larger row it exceeds the most)."""
    rows, out = sweep.of_kind(kind), []
    for small in rows:
        larger = [big for big in rows if _size(big) != _size(small)
                  and all(s <= b for s, b in zip(_size(small), _size(big)))]
        if not larger:
            continue
        big = min(larger, key=lambda r: r.seconds)
        ratio = small.seconds / big.seconds
        if ratio > INVERSION_RATIO:
            out.append(f"{_label(small)} took {small.seconds * 1e6:.4g} us per call, "
                       f"{ratio:.3g}x the {big.seconds * 1e6:.4g} us of the larger "
                       f"{_label(big)} (on a quiet machine at most {INVERSION_RATIO:g}x)")
    return tuple(out)
