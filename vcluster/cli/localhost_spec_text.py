"""A ``localhost`` calibration (:class:`~vcluster.localhost.cost_model.LocalhostSpec`) in a few
lines of text: what ``vcluster hardware calibrate`` and ``vcluster bench predict`` print."""

from __future__ import annotations

from vcluster.scenario.units import format_size

__all__ = ["format_localhost_spec"]


def format_localhost_spec(spec) -> str:
    """The spec's figures, indented two spaces: the core pool's throughput T(k) with k
    devices busy, the GEMM, elementwise and memcpy rates, the calls' latencies by group
    size, the channel's copy rates, and (when measured) each message side's CPU and how
    devices start spread over the cores."""
    pool = ", ".join(f"T({k}) = {t:.2f}" for k, t in spec.pool_throughput)
    cores = f"{spec.cores} core" + ("s" if spec.cores != 1 else "")
    lines = [
        f"  {cores}: {pool}; GEMM {spec.gemm_float32_flops_per_s / 1e9:.0f} / "
        f"{spec.gemm_float64_flops_per_s / 1e9:.0f} GFLOP/s (f32/f64); elementwise "
        f"{spec.vector_float32_flops_per_s / 1e9:.2f} / "
        f"{spec.vector_float64_flops_per_s / 1e9:.2f} GFLOP/s (busy speedup "
        f"{spec.vector_busy_speedup:.2f}); memcpy {spec.memcpy_bytes_per_s / 1e9:.1f} GB/s "
        f"(busy speedup {spec.memcpy_busy_speedup:.2f})"]
    lat = ", ".join(f"{n}: {b * 1e6:.0f}/{s * 1e6:.0f}/{g * 1e6:.0f}" for n, b, s, g in
                    zip(spec.group_sizes, spec.barrier_s, spec.small_all_reduce_s,
                        spec.large_all_reduce_s))
    lines.append(f"  barrier/8 B/4 KiB all_reduce (us) by group size {lat}")
    lines.append(
        f"  channel copy/reduce/all_reduce {spec.channel_copy_bytes_per_s / 1e9:.2f}/"
        f"{spec.channel_reduce_bytes_per_s / 1e9:.2f}/"
        f"{spec.channel_all_reduce_bytes_per_s / 1e9:.2f} GB/s per core; p2p "
        f"{spec.p2p_latency_s * 1e6:.0f} us, {spec.p2p_copy_bytes_per_s / 1e9:.2f} GB/s")
    if spec.message_side_cpu_s is not None:
        sides = ", ".join(f"{format_size(b)} {s * 1e6:.0f}" for b, s in spec.message_side_cpu_s)
        lines.append(f"  message side in a ring (us): {sides}")
    if spec.start_split is not None:
        splits = "; ".join(f"{d} devices " + ", ".join(
            f"{':'.join(map(str, split))} x{n}" for dd, split, n in spec.start_split if dd == d)
            for d in sorted({d for d, _, _ in spec.start_split}))
        lines.append(f"  devices per core at a start (runs): {splits}")
    return "\n".join(lines)
