"""Hardware presets built from datasheet figures, and user hardware from YAML.

Presets (``PRESET_NAMES``) are built on each call from ``data/hardware.csv`` (datasheet
figures; its header lines name the sources) plus the named constants below, each with
its source. ``load_hardware`` accepts a preset name, a YAML file path or a dict::

    base: a100-80gb-dgx          # optional: start from a preset, override what follows
    name: my-cluster
    network: {nics_per_node: 4}

A full description has the keys of ``hardware_to_dict(preset("a100-80gb-dgx"))``.
Validation is strict: an unknown key, a wrong type or a bad value raises ValueError
naming the key path (``hardware.network.nic.bandwidth_gbps``), the value and what is
allowed.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Mapping
from enum import Enum
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from .hardware import DeviceSpec, HardwareSpec, LinkSpec, NetworkSpec, NodeSpec

__all__ = ["PRESET_NAMES", "preset", "load_hardware", "hardware_from_dict",
           "hardware_to_dict", "read_data_csv"]

# --- constants (units in names; each with its source) --------------------------------
# Best achieved dense BF16 GEMM / peak ("MAMF"), stas00/ml-engineering,
# compute/accelerator/README.md: A100 SXM 267.9/312 = 85.9 %, H100 SXM 792.1/989 = 80.1 %
# (CUDA 12.1). H200 has the same GH100 compute (hardware.csv notes): H100's figure.
A100_GEMM_MAX_EFFICIENCY = 0.859
H100_GEMM_MAX_EFFICIENCY = 0.801
# Dense FP8 Tensor Core peak over dense BF16: NVIDIA H100 SXM datasheet, FP8 3,958 and
# BF16 1,979 TFLOPS (both with sparsity; dense is half of each); the H200's are the same.
# The A100 has no FP8 Tensor Cores: its presets have no "fp8" peak.
HOPPER_FP8_OVER_BF16_PEAK = 2.0
# Best achieved dense FP8 (float8_e4m3fn) GEMM / FP8 peak, the same table's FP8 "MAMF"
# (stas00/ml-engineering, compute/accelerator/README.md, torch 2.7): H100 SXM
# 1402.6/1979 = 70.9 %, H200 SXM 1453.4/1979 = 73.4 % — below BF16's share (before
# 2026-11-28 FP8 GEMMs were assumed to reach BF16's e_max).
H100_FP8_GEMM_MAX_EFFICIENCY = 0.709
H200_FP8_GEMM_MAX_EFFICIENCY = 0.734
# Attention kernels built for Ampere (mma.sync, no TMA or wgmma) on Hopper: FlashAttention
# 1 ran 1.60x as fast on an H100 SXM5 as on an A100 SXM4 (Dao 2023, "FlashAttention-2",
# arXiv 2307.08691: the FlashAttention bars of Fig. 4 (A100) and Fig. 7 (H100), forward +
# backward TFLOP/s, median of the 20 ratios at head dimension 64 and 128, causal or not,
# sequences 512-8k; range 1.20-1.85), where the dense BF16 peak grows 3.17x. The paper's
# FlashAttention-2 bars, also built for Ampere, give 1.6-1.7x. The H200 takes the H100's
# figure (the same GH100 SMs and clocks; the kernel is compute-bound): an assumption.
HOPPER_FLASH_V1_SPEEDUP = 1.60
# The device those speedups are relative to (whose analytic attention price they divide)
FLASH_V1_REFERENCE_PRESET = "a100-80gb-dgx"
# Fixed cost of one kernel (launch, first-wave ramp, epilogue): a tiny cuBLAS GEMM takes
# ~5-7 us (e.g. cublasLt 128^3 in 6.5 us, AD2605/gemm-zoo benchmarks.md); CUDA launch
# latency alone is ~3-5 us. Sets the GEMM half-efficiency size F_half = peak*e_max*t_k.
KERNEL_OVERHEAD_US = 5.0
# Streaming kernels reach ~90 % of datasheet HBM bandwidth (BabelStream-class copy/triad
# measurements on A100/H100).
HBM_EFFICIENCY = 0.9
# NCCL's achieved bandwidth per NVLink, GB/s per direction (FORMULAS.md, from NCCL's
# topology model): A100 ~20 (12 links), H100 ~20.6 (18 links); line rate is
# nvlink_total_gbps_bidirectional / 2 / nvlink_links = 25 on both.
A100_NCCL_NVLINK_GBPS_PER_LINK = 20.0
H100_NCCL_NVLINK_GBPS_PER_LINK = 20.6
# Per-step latency of NCCL's Simple protocol (NVIDIA/nccl src/graph/tuning.cc, hwLat,
# Ring/Simple): NVLink 3.4 us, network 9.6 us (FORMULAS.md: "a few us", "order of 10 us").
NVLINK_STEP_LATENCY_US = 3.4
NET_STEP_LATENCY_US = 9.6
# Achieved NCCL bandwidth per NIC (hardware.csv notes): HDR "about 23.5-24 GB/s" of 25,
# NDR "about 46-48.5 GB/s" of 50. We take the lower end of each range.
HDR_NCCL_ACHIEVED_GBPS = 23.5
NDR_NCCL_ACHIEVED_GBPS = 46.0
# DGX A100 and DGX H100 both carry 8 compute NICs (ConnectX-6 HDR / ConnectX-7 NDR),
# one per GPU (NVIDIA DGX A100 / DGX H100 user guides).
DGX_NICS_PER_NODE = 8
DGX_GPUS_PER_NODE = 8  # hardware.csv notes: "via NVSwitch in DGX/HGX ... (8 GPUs)"
# NVIDIA DGX SuperPOD reference architectures: a scalable unit of 20 DGX A100 / 32 DGX H100
# nodes shares its rail leaf switches; full fat tree (non-blocking).
A100_NODES_PER_LEAF_SWITCH = 20
H100_NODES_PER_LEAF_SWITCH = 32
# Port-to-port latency of an NVIDIA Quantum InfiniBand switch (QM8700 HDR datasheet:
# 130 ns); assumed the same for NDR Quantum-2.
IB_SWITCH_LATENCY_US = 0.13

BYTES_PER_GB = 1e9  # datasheet GB are decimal
_DATA_PACKAGE = "vcluster.timing"
_PRESETS = MappingProxyType({  # name -> (hardware.csv GPU part, NIC part, generation)
    "a100-40gb-dgx": ("A100-SXM4-40GB", "HDR-4x", "A100"),
    "a100-80gb-dgx": ("A100-SXM4-80GB", "HDR-4x", "A100"),
    "h100-dgx": ("H100-SXM5-80GB", "NDR-4x", "H100"),
    "h200-dgx": ("H200-SXM-141GB", "NDR-4x", "H100"),
})
PRESET_NAMES = tuple(_PRESETS)
_GENERATION = MappingProxyType({  # generation -> (e_max, NCCL GB/s per NVLink, nodes/leaf)
    "A100": (A100_GEMM_MAX_EFFICIENCY, A100_NCCL_NVLINK_GBPS_PER_LINK,
             A100_NODES_PER_LEAF_SWITCH),
    "H100": (H100_GEMM_MAX_EFFICIENCY, H100_NCCL_NVLINK_GBPS_PER_LINK,
             H100_NODES_PER_LEAF_SWITCH),
})
_FP8_OVER_BF16_PEAK = MappingProxyType({"H100": HOPPER_FP8_OVER_BF16_PEAK})  # by generation
_FP8_GEMM_MAX_EFFICIENCY = MappingProxyType({  # hardware.csv GPU part -> FP8 e_max
    "H100-SXM5-80GB": H100_FP8_GEMM_MAX_EFFICIENCY,
    "H200-SXM-141GB": H200_FP8_GEMM_MAX_EFFICIENCY})
_FLASH_V1_SPEEDUP = MappingProxyType({"A100": 1.0,   # by generation: the A100 is the unit
                                      "H100": HOPPER_FLASH_V1_SPEEDUP})
_NIC_ACHIEVED_GBPS = MappingProxyType({"HDR-4x": HDR_NCCL_ACHIEVED_GBPS,
                                       "NDR-4x": NDR_NCCL_ACHIEVED_GBPS})


def read_data_csv(filename: str) -> tuple[list[str], list[dict[str, str]]]:
    """(header comment lines without '#', rows as dicts) of ``vcluster/timing/data/<filename>``."""
    text = resources.files(_DATA_PACKAGE).joinpath("data", filename).read_text("utf-8")
    lines = text.splitlines()
    comments = [ln.lstrip("#").strip() for ln in lines if ln.startswith("#")]
    body = "\n".join(ln for ln in lines if ln.strip() and not ln.startswith("#"))
    return comments, list(csv.DictReader(io.StringIO(body)))


def preset(name: str) -> HardwareSpec:
    """The preset ``name`` (one of ``PRESET_NAMES``), built from data/hardware.csv."""
    if name not in _PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    gpu_part, nic_part, generation = _PRESETS[name]
    comments, rows = read_data_csv("hardware.csv")
    parts = {row["part"]: row for row in rows}
    gpu, nic = parts[gpu_part], parts[nic_part]
    e_max, nvlink_per_link_gbps, nodes_per_leaf = _GENERATION[generation]
    csv_source = "hardware.csv (" + " ".join(comments) + ")"
    peaks = {"bf16": float(gpu["bf16_dense_tflops"]),
             "fp16": float(gpu["bf16_dense_tflops"]),  # datasheet: FP16 == BF16
             "tf32": float(gpu["tf32_dense_tflops"]),
             "fp32": float(gpu["fp32_tflops"])}
    if generation in _FP8_OVER_BF16_PEAK:
        peaks["fp8"] = peaks["bf16"] * _FP8_OVER_BF16_PEAK[generation]
    device = DeviceSpec(
        name=gpu_part,
        peak_tflops=peaks,
        hbm_bytes=int(round(float(gpu["hbm_gb"]) * BYTES_PER_GB)),
        hbm_bandwidth_gbps=float(gpu["hbm_bandwidth_gbps"]),
        gemm_max_efficiency=e_max, kernel_overhead_us=KERNEL_OVERHEAD_US,
        gemm_max_efficiency_by_dtype=(
            {"fp8": _FP8_GEMM_MAX_EFFICIENCY[gpu_part]} if "fp8" in peaks else {}),
        hbm_efficiency=HBM_EFFICIENCY, flash_v1_speedup=_FLASH_V1_SPEEDUP[generation],
        source=f"{csv_source}; efficiencies: vcluster.timing.presets constants")
    links = int(gpu["nvlink_links"])
    per_direction_gbps = float(gpu["nvlink_total_gbps_bidirectional"]) / 2
    gpu_link = LinkSpec(
        bandwidth_gbps=per_direction_gbps, latency_us=NVLINK_STEP_LATENCY_US,
        efficiency=round(nvlink_per_link_gbps * links / per_direction_gbps, 6),
        source=f"{links} NVLinks x {per_direction_gbps / links:g} GB/s per direction; "
               f"NCCL achieves {nvlink_per_link_gbps:g} GB/s per link")
    nic_line_gbps = float(nic["hbm_bandwidth_gbps"])  # the CSV's bandwidth column
    network = NetworkSpec(
        nics_per_node=DGX_NICS_PER_NODE,
        nic=LinkSpec(bandwidth_gbps=nic_line_gbps, latency_us=NET_STEP_LATENCY_US,
                     efficiency=round(_NIC_ACHIEVED_GBPS[nic_part] / nic_line_gbps, 6),
                     source=f"{nic_part}: {nic['notes']}"),
        nodes_per_leaf_switch=nodes_per_leaf, switch_latency_us=IB_SWITCH_LATENCY_US,
        source="DGX SuperPOD reference architecture: rail-optimized, non-blocking fat tree")
    node = NodeSpec(gpus_per_node=DGX_GPUS_PER_NODE, gpu_link=gpu_link,
                    source=f"hardware.csv {gpu_part}: {links} NVLinks, "
                           f"{gpu['nvlink_total_gbps_bidirectional']} GB/s bidirectional; "
                           f"{gpu['notes']}")
    return HardwareSpec(name=name, device=device, node=node, network=network,
                        source=f"DGX with 8x {gpu_part} and {DGX_NICS_PER_NODE}x {nic_part}")


# --- YAML / dict ----------------------------------------------------------------------
_NESTED = MappingProxyType({
    HardwareSpec: {"device": DeviceSpec, "node": NodeSpec, "network": NetworkSpec},
    NodeSpec: {"gpu_link": LinkSpec}, NetworkSpec: {"nic": LinkSpec}})


def hardware_to_dict(hardware: HardwareSpec) -> dict:
    """Plain nested dict (str, int, float) that ``hardware_from_dict`` turns back."""
    def plain(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                v = plain(v)
            elif isinstance(v, Enum):
                v = v.value
            elif isinstance(v, Mapping):
                v = dict(v)
            elif isinstance(v, tuple) and all(dataclasses.is_dataclass(x) for x in v):
                v = [plain(x) for x in v]          # DeviceSpec.kernels
            out[f.name] = v
        return out
    return plain(hardware)


def hardware_from_dict(data: Mapping, path: str = "hardware") -> HardwareSpec:
    """Build and validate a HardwareSpec; ``base: <preset>`` starts from that preset."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of keys, got {data!r}")
    data = dict(data)
    if "base" in data:
        base = data.pop("base")
        if not isinstance(base, str) or base not in _PRESETS:
            raise ValueError(f"{path}.base: must be one of {', '.join(PRESET_NAMES)}, "
                             f"got {base!r}")
        data = _merge(hardware_to_dict(preset(base)), data, path)
    return _build(HardwareSpec, data, path)


def _merge(base: dict, over: Mapping, path: str) -> dict:
    out = dict(base)
    for key, value in over.items():
        if key not in base:
            raise ValueError(f"{path}.{key}: unknown key {key!r}; allowed: {', '.join(base)}")
        if isinstance(base[key], dict):
            if not isinstance(value, Mapping):
                raise ValueError(f"{path}.{key}: expected a mapping, got {value!r}")
            out[key] = ({**base[key], **value}          # dtypes may be added
                        if key in ("peak_tflops", "gemm_max_efficiency_by_dtype")
                        else _merge(base[key], value, f"{path}.{key}"))
        else:
            out[key] = value
    return out


def _build(cls, data, path):
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ValueError(f"{path}.{key}: unknown key {key!r}; allowed: {', '.join(fields)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{path}.{missing[0]}: missing; required keys: {', '.join(required)}")
    kwargs = {}
    for key, value in data.items():
        sub = _NESTED.get(cls, {}).get(key)
        kwargs[key] = _build(sub, value, f"{path}.{key}") if sub else _coerce(value)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # messages start with the field name
        raise ValueError(f"{path}.{exc}") from None


def _coerce(value):
    # PyYAML (YAML 1.1) reads "80e9" as a string: accept scientific notation as a number.
    if isinstance(value, str) and "e" in value.lower():
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    return value


def load_hardware(spec) -> HardwareSpec:
    """A HardwareSpec from a preset name, a YAML file path, a dict, or a HardwareSpec."""
    if isinstance(spec, HardwareSpec):
        return spec
    if isinstance(spec, Mapping):
        return hardware_from_dict(spec)
    if isinstance(spec, (str, Path)):
        if isinstance(spec, str) and spec in _PRESETS:
            return preset(spec)
        path = Path(spec)
        if path.suffix.lower() in (".yaml", ".yml") or path.exists():
            if not path.is_file():
                raise ValueError(f"hardware file {str(path)!r} does not exist")
            import yaml  # lazy: only user files need it
            try:
                data = yaml.safe_load(path.read_text("utf-8"))
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML: {exc}") from None
            return hardware_from_dict(data, path=f"{path}: hardware")
        raise ValueError(f"unknown hardware {str(spec)!r}: not a preset "
                         f"({', '.join(PRESET_NAMES)}) nor a .yaml file")
    raise TypeError(f"hardware must be a preset name, a YAML path, a dict or a HardwareSpec, "
                    f"got {spec!r}")
