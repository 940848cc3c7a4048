"""A hardware description from a kernel sweep: a preset with its device's constants
replaced by what this device measured (``vcluster hardware calibrate --gpu``).

The timing model prices a kernel of F FLOPs and B bytes as
``t = t_k + max(F / (peak · e_max), B / (bandwidth · hbm_efficiency))``
(:mod:`vcluster.timing.hardware`). From the sweep:

* ``gemm_max_efficiency`` e_max = rate / peak, with ``rate`` the sustained FLOP/s of a
  :class:`~vcluster.timing.kernel_profile.GemmProfile` fitted to the GEMM rows (fixed cost
  per call + tile-padded FLOPs at one rate) and ``peak`` the base preset's datasheet peak
  of the sweep's dtype;
* ``kernel_overhead_us`` t_k = the profile's fixed cost per call, at least the measured
  launch interval (a kernel cannot start faster than the host launches it);
* ``hbm_efficiency`` = the fastest copy's bytes per second / the preset's datasheet HBM
  bandwidth (at most 1).

The measured rows travel in the file (``device.kernels``), so the file says what its
constants came from, and the replay prices each traced kernel from them
(:meth:`~vcluster.timing.hardware.DeviceSpec.kernel_profile`: GEMMs by their shape's
profile, attention, norms, GELU, adds, cross-entropy and AdamW by their kind's), the
constants above pricing only what no row measured. Everything else (links, network, node size) is the base preset's.

The file is a hardware of its own: ``name`` (``<device>-calibrated-<date>``, e.g.
``nvidia-h200-calibrated-2026-11-26``, or the caller's) is what ``hardware show``,
``simulate``, ``plan`` and their JSON report, never the base preset's name; ``base``
names the preset it starts from, and ``source`` says both.
"""

from __future__ import annotations

import dataclasses
import datetime
import re

from vcluster.timing import PRESET_NAMES, load_hardware
from vcluster.timing.kernel_profile import TABLE_OPS, GemmProfile

from .kernel_sweep import KernelSweep

__all__ = ["calibrated_hardware", "default_base", "default_name", "check_name",
           "BASE_BY_GPU"]

# GPU name (as torch reports it) -> the preset whose node, links and network it borrows
BASE_BY_GPU = (("H200", "h200-dgx"), ("H100", "h100-dgx"), ("A100-SXM4-40GB", "a100-40gb-dgx"),
               ("A100", "a100-80gb-dgx"))


def default_base(device_name: str) -> str | None:
    """The preset for a GPU named ``device_name`` (None when no preset is that GPU)."""
    for key, preset in BASE_BY_GPU:
        if key in device_name:
            return preset
    return None


def default_name(device_name: str, date: datetime.date) -> str:
    """``<device>-calibrated-<date>``: the device's name in lower case, runs of other
    characters than letters, digits, ``.`` and ``_`` as one ``-`` ("NVIDIA H200" on
    2026-11-26: ``nvidia-h200-calibrated-2026-11-26``)."""
    slug = re.sub(r"[^a-z0-9._]+", "-", device_name.lower()).strip("-") or "device"
    return f"{slug}-calibrated-{date.isoformat()}"


def check_name(name: str, what: str = "name") -> str:
    """``name`` if a calibrated file may carry it: non-empty text on one line, and not a
    preset's name (the file would then be reported as that preset); else ValueError
    naming ``what``, the value and the rule."""
    if not isinstance(name, str) or not name.strip() or "\n" in name:
        raise ValueError(f"{what} must be a non-empty name on one line, got {name!r}")
    if name in PRESET_NAMES:
        raise ValueError(f"{what} = {name!r} is a preset's name; a calibrated file needs its "
                         f"own (the presets: {', '.join(PRESET_NAMES)})")
    return name


def calibrated_hardware(sweep: KernelSweep, base: str, name: str | None = None,
                        date: datetime.date | None = None) -> dict:
    """``{"base": base, "name": ..., "source": ..., "device": {...}}``: a hardware
    description (``load_hardware`` accepts it, as a dict or as YAML) with the sweep's
    constants and rows, named ``name`` (default :func:`default_name` of the sweep's
    device on ``date``, default today)."""
    date = datetime.date.today() if date is None else date
    name = check_name(default_name(sweep.device_name, date) if name is None else name)
    hw = load_hardware(base)
    gemms = [(k.m, k.k, k.n, k.seconds) for k in sweep.of_kind("gemm")]
    profile = GemmProfile.fit(gemms, f"{sweep.device_name}, torch {sweep.torch_version}",
                              zero_call=True)
    launch_s = min((k.seconds for k in sweep.of_kind("launch")), default=0.0)
    copy_bps = max(k.bytes / k.seconds for k in sweep.of_kind("elementwise"))
    peak = hw.device.peak_flops(sweep.dtype)
    layer = sum(k.kind in TABLE_OPS for k in sweep.kernels)
    burst = {(k.m, k.k, k.n): k.seconds for k in sweep.of_kind("gemm")}
    sustained = [f"; a GEMM {m}x{k}x{n} sustained for seconds ran at "
                 f"{burst[(m, k, n)] / t:.1%} of its burst rate"
                 for m, k, n, t in ((r.m, r.k, r.n, r.seconds)
                                    for r in sweep.of_kind("gemm_sustained"))
                 if (m, k, n) in burst]
    fastest = f", each the fastest of {sweep.repeats} streams" if sweep.repeats > 1 else ""
    device = {
        "name": f"{sweep.device_name} (calibrated)",
        "gemm_max_efficiency": min(1.0, profile.flops_per_s / peak),
        "kernel_overhead_us": max(profile.call_s, launch_s) * 1e6,
        "hbm_efficiency": min(1.0, copy_bps / (hw.device.hbm_bandwidth_gbps * 1e9)),
        "source": (f"vcluster hardware calibrate --gpu on {sweep.device_name} ({sweep.device},"
                   f" torch {sweep.torch_version}): {len(gemms)} {sweep.dtype} GEMMs fitted "
                   f"to {profile.flops_per_s / 1e12:.1f} TFLOP/s + {profile.call_s * 1e6:.2f} "
                   f"us per call; launch interval {launch_s * 1e6:.2f} us; best copy "
                   f"{copy_bps / 1e9:.1f} GB/s; {layer} kernels of a transformer layer and its "
                   f"optimizer{''.join(sustained)}{fastest}; peak and bandwidth of {base}"),
        "kernels": [{f: v for f, v in dataclasses.asdict(k).items()
                     if f in ("kind", "seconds") or v not in (0, "")} for k in sweep.kernels],
    }
    source = (f"calibrated by vcluster hardware calibrate --gpu on {date.isoformat()}: the "
              f"device measured on {sweep.device_name}; node, links and network of base "
              f"{base} ({hw.source})")
    return {"base": base, "name": name, "source": source, "device": device}
