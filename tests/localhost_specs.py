"""Localhost specs the tests of several packages price with: a plausible 2-core
calibration (the development machine's figures, rounded), its host-work rates, and the
same saved as a file. Plain values, no fixtures: import what you need."""

from __future__ import annotations

from pathlib import Path

from vcluster.localhost import LocalhostSpec, save_localhost_spec

MIB = 1 << 20
#: The host-work rates of a calibration that measured them (block, numpy call, glue unit).
HOST_RATES = dict(block_overhead_s=3e-6, numpy_call_s=1.5e-6, python_unit_s=25e-6)


def spec(**changes) -> LocalhostSpec:
    """A plausible 2-core spec (figures of the development machine, rounded)."""
    fields = dict(
        cores=2, pool_throughput=((2, 1.9), (8, 1.8)),
        gemm_float32_flops_per_s=125e9, gemm_float64_flops_per_s=60e9,
        vector_float32_flops_per_s=0.8e9, vector_float64_flops_per_s=0.4e9,
        vector_busy_speedup=1.8, memcpy_bytes_per_s=11e9, iadd_bytes_per_s=12e9,
        memcpy_busy_speedup=1.5, compute_overhead_s=3e-6, group_sizes=(2, 4, 8),
        barrier_s=(30e-6, 70e-6, 200e-6), small_all_reduce_s=(70e-6, 160e-6, 450e-6),
        large_all_reduce_s=(150e-6, 400e-6, 1.3e-3), channel_copy_bytes_per_s=6.5e9,
        channel_reduce_bytes_per_s=7e9, channel_all_reduce_bytes_per_s=7.5e9,
        channel_fixed_s=(1e-3, 1.4e-3, 1.2e-3), p2p_latency_s=60e-6,
        p2p_copy_bytes_per_s=7.5e9, calibration_devices=8,
        message_bytes=(256 << 10, 2 * MIB, 32 * MIB))
    fields.update(changes)
    return LocalhostSpec(**fields)


def localhost_spec_file(path: Path) -> Path:
    """:func:`spec` saved at ``path`` (a calibration file as ``vcluster hardware calibrate
    --out`` writes it)."""
    save_localhost_spec(spec(), path)
    return path
