"""``vcluster hardware list``, ``show NAME`` and ``calibrate``: the hardware the timing
model simulates.

    vcluster hardware list
    vcluster hardware show a100-80gb-dgx
    vcluster hardware show my-cluster.yaml
    vcluster hardware calibrate --out localhost.json

``show`` prints every field of the description with its unit (YAML-like; the derived
figures the timing model uses follow as ``#`` comments); a file in the same shape,
or a subset of it under ``base: <preset>``, is what ``load_hardware`` reads.
``show FILE`` also prints a saved calibration. ``calibrate`` measures this machine for
the ``localhost`` hardware (~20 s) and saves the figures, which a scenario then reuses
with ``hardware.calibration: FILE`` instead of measuring again in every ``vcluster
run``; ``calibrate --gpu`` writes a hardware file named for itself (``--name``, default
``<device>-calibrated-<date>``) on a ``base`` preset.

Before measuring, ``calibrate`` checks its flags, that ``--out`` can be written (a file
is created and removed in its directory) and, with ``--gpu``, that torch imports (else a
one-line install hint, exit 2). After measuring, it checks the figures
(:mod:`vcluster.localhost.plausibility`, :mod:`vcluster.gpu.plausibility`): implausible
ones, a busy machine's, are named on stderr and not saved (exit 1) unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType

from vcluster.timing.attention_kernels import cudnn_releases
from vcluster.timing.cluster import ClusterSpec, load_cluster
from vcluster.timing.hardware import HardwareSpec
from vcluster.timing.presets import PRESET_NAMES, hardware_to_dict, preset

from .args import int_at_least

__all__ = ["add_parser", "run_list", "run_show", "run_calibrate", "format_hardware",
           "format_cluster", "format_preset_table"]

_UNITS = (("_gbps", "GB/s"), ("_us", "us"), ("_bytes", "B"), ("peak_tflops", "TFLOP/s"))
_LABELS = MappingProxyType({
    "gpus_per_node": "GPUs", "nics_per_node": "NICs", "nodes_per_leaf_switch": "nodes",
    "gemm_max_efficiency": "(fraction of peak)",
    "gemm_max_efficiency_by_dtype": "(fraction of that dtype's peak)",
    "hbm_efficiency": "(fraction of hbm_bandwidth_gbps)",
    "sustained_compute_ratio": "(x the datasheet part's compute speed: a power-limited part)",
    "sustained_compute_ratio_by_dtype": "(x the datasheet part's speed of that dtype)",
    "flash_v1_speedup": "(x an A100's speed, for attention kernels built for Ampere)",
    "attention_gpu": "(published fused-attention curves, attention_benchmarks.csv)",
    "attention_kernel": "(the kernel attention='flash' runs)",
    "attention_cudnn": "(the cuDNN release whose curves price cudnn attention; \"\": every release's median)",
    "efficiency": "(fraction of bandwidth_gbps)", "oversubscription": "(1 = non-blocking)",
    "domain_gpus": "GPUs (one NVLink / Infinity Fabric domain)",
    "nvls_efficiency": "(NVLink SHARP all_reduce algbw, fraction of gpu_link.bandwidth_gbps)"})


def _unit(key: str) -> str:
    if key == "bandwidth_gbps":
        return "GB/s per direction"
    for suffix, unit in _UNITS:
        if key.endswith(suffix):
            return unit
    return _LABELS.get(key, "")


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str) and (": " in value or " #" in value or not value):
        return json.dumps(value)  # a YAML double-quoted scalar
    return str(value)


def _derived(hw: HardwareSpec) -> dict[str, list[str]]:
    d, link, net = hw.device, hw.node.gpu_link, hw.network
    half = {dt: d.gemm_half_efficiency_flops(dt) / 1e9 for dt in d.peak_tflops}
    device = ["# GEMM efficiency e(F) = e_max * F / (F + F_half), e_max "
              + ", ".join(f"{dt} {d.e_max(dt):g}" for dt in d.peak_tflops)
              + "; F_half: " + ", ".join(f"{dt} {v:.3g} GFLOP" for dt, v in half.items()),
              f"# achieved HBM bandwidth {d.hbm_bandwidth_gbps * d.hbm_efficiency:g} GB/s"]
    ratios = {dt: d.sustained_ratio(dt) for dt in d.peak_tflops}
    if any(c != 1 for c in ratios.values()):
        device.append("# a power-limited part: GEMMs at e(F) x " + ", ".join(
            f"{dt} {c:g}" for dt, c in ratios.items()) + " (achieved "
            + ", ".join(f"{dt} {d.achieved_flops(dt) / 1e12:.0f}" for dt in ratios)
            + f" TFLOP/s), attention curves x {d.sustained_compute_ratio:g}")
    if d.attention_gpu:
        releases = cudnn_releases(d.attention_gpu)
        device.append(f"# cuDNN releases with published curves on {d.attention_gpu} "
                      f"(attention_cudnn): {', '.join(releases) or 'none'}")
    if d.kernel_table:
        compute, memory = d.kernel_table_ratios()
        device.append(f"# traced kernels priced by {d.kernel_table}'s profiles, "
                      + ("as measured" if (compute, memory) == (1, 1) else
                         f"moved here by datasheet ratios: FLOP/s x{compute:.4g}, "
                         f"HBM bandwidth x{memory:.4g}"))
    return {
        "device": device,
        "gpu_link": [f"# effective {link.effective_gbps:g} GB/s per direction per GPU"],
        "network": [f"# inter-node bandwidth per node {net.node_bandwidth_gbps:g} GB/s "
                    f"per direction ({net.nics_per_node} x {net.nic.effective_gbps:g})"],
    }


def format_hardware(hw: HardwareSpec) -> str:
    """Every field of ``hw`` with its unit and, as a ``# source:`` comment, where its value
    comes from (``HardwareSpec.sources``), YAML-like, plus derived figures as comments."""
    derived = _derived(hw)
    lines: list[str] = []

    def sourced(line: str, path: str) -> str:
        source = hw.sources.get(path)
        return line if source is None else f"{line}  # source: {source}"

    def emit(mapping: dict, indent: str, parent: str, prefix: str = "") -> None:
        for key, value in mapping.items():
            path = prefix + key
            if isinstance(value, dict) and value:
                lines.append(f"{indent}{key}:")
                emit(value, indent + "  ", key, path + ".")
                lines.extend(indent + "  " + c for c in derived.get(key, []))
                continue
            if isinstance(value, dict):
                lines.append(sourced(f"{indent}{key}: {{}}", path))
                continue
            if key == "kernels":                 # measured rows: counted, not listed
                if not value:
                    lines.append(sourced(f"{indent}kernels: none measured (datasheet "
                                         f"constants)", path))
                    continue
                kinds = {}
                for row in value:
                    kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
                what = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
                lines.append(f"{indent}kernels: {len(value)} measured ({what})")
                continue
            unit = _unit(parent if parent == "peak_tflops" else key)
            if key.endswith("_bytes") and value is not None:
                unit += f" ({value / 1e9:g} GB)"
            lines.append(sourced(f"{indent}{key}: {_text(value)}" + (f" {unit}" if unit else ""),
                                 path))
    emit(hardware_to_dict(hw), "", "")
    return "\n".join(lines)


def format_preset_table() -> str:
    """One line per preset: GPU, GPUs per node and per scale-up domain, fabric, peaks,
    HBM, scale-up link and NICs."""
    header = (f"{'name':<14} {'device':<15} {'gpus/node':>9} {'domain':>6} {'fabric':<9} "
              f"{'bf16':>7} {'fp8':>7} {'fp4':>7} {'HBM GB':>6} {'HBM GB/s':>8} "
              f"{'link GB/s':>9} {'NICs x GB/s':>11}")
    lines = [header]
    for name in PRESET_NAMES:
        hw = preset(name)
        d, net, peaks = hw.device, hw.network, hw.device.peak_tflops
        low = {dt: f"{peaks[dt]:g}" if dt in peaks else "-" for dt in ("fp8", "fp4")}
        lines.append(
            f"{name:<14} {d.name:<15} {hw.node.gpus_per_node:>9} {hw.domain_gpus:>6} "
            f"{hw.node.fabric.value:<9} {peaks['bf16']:>7g} {low['fp8']:>7} "
            f"{low['fp4']:>7} {d.hbm_bytes / 1e9:>6g} {d.hbm_bandwidth_gbps:>8g} "
            f"{hw.node.gpu_link.bandwidth_gbps:>9g} "
            f"{f'{net.nics_per_node} x {net.nic.bandwidth_gbps:g}':>11}")
    lines.append("(dense TFLOP/s per dtype; domain: GPUs one NVLink / Infinity Fabric joins; "
                 "line rates per direction, per GPU and per node; `vcluster hardware show "
                 "NAME` for every field and its source; localhost, this machine: `vcluster "
                 "hardware calibrate`)")
    return "\n".join(lines)


def run_list(args) -> int:
    print(format_preset_table())
    return 0


def _is_calibration(name: str) -> bool:
    """Whether ``name`` is a file holding a localhost calibration (a LocalhostSpec)."""
    path = Path(name)
    if not path.is_file():
        return False
    import yaml
    try:
        data = yaml.safe_load(path.read_text("utf-8"))   # JSON is YAML too
    except (yaml.YAMLError, UnicodeDecodeError):
        return False
    # lazy: keeps vcluster --help fast
    from vcluster.localhost.spec import is_localhost_spec_data
    return is_localhost_spec_data(data)


def run_show(args) -> int:
    """Print one preset, YAML file or saved localhost calibration; an unknown name raises
    ValueError listing the presets."""
    if _is_calibration(args.name):
        # lazy: keeps vcluster --help fast
        from vcluster.localhost.cost_model import load_localhost_spec

        from .localhost_spec_text import format_localhost_spec
        spec = load_localhost_spec(args.name)
        print(f"localhost calibration {args.name} (measured on {spec.calibration_devices} "
              f"devices):")
        print(format_localhost_spec(spec))
        return 0
    hw = load_cluster(args.name)
    if isinstance(hw, ClusterSpec):
        print(format_cluster(hw))
        return 0
    print(format_hardware(hw))
    return 0


def format_cluster(cluster: ClusterSpec) -> str:
    """A heterogeneous cluster: its name and, per part, its GPU kind, nodes and ranks,
    then every part's fields (:func:`format_hardware`), indented under it."""
    lines = [f"name: {cluster.name} (a cluster of {cluster.gpus} GPUs in "
             f"{len(cluster.parts)} parts; docs/heterogeneous.md)"]
    first = 0
    for i, part in enumerate(cluster.parts):
        hw = part.hardware
        gpus = part.nodes * hw.gpus_per_node
        lines.append(f"parts[{i}]: {hw.name}: {part.nodes} nodes x {hw.gpus_per_node} "
                     f"{hw.device.name}, ranks {first}-{first + gpus - 1}")
        lines.extend("  " + line for line in format_hardware(hw).splitlines())
        first += gpus
    return "\n".join(lines)


def checked_out(value: str) -> Path:
    """``--out``'s path if a file can be written there (atomically: a temporary file in
    its directory, then renamed); else ValueError naming ``--out``, the path and why.
    Checked before measuring, so a bad path costs no measurement."""
    out = Path(value)
    parent = out.parent
    if out.is_dir():
        raise ValueError(f"--out = {value!r} is a directory: name a file to write in it")
    if not parent.exists():
        raise ValueError(f"--out = {value!r}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise ValueError(f"--out = {value!r}: {str(parent)!r} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-", dir=parent)
    except OSError as exc:
        raise ValueError(f"--out = {value!r}: cannot write in directory {str(parent)!r} "
                         f"({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return out


def _implausible(problems: tuple, advice: str, out, force: bool) -> bool:
    """Name each implausible figure on stderr; whether to refuse saving to ``out``."""
    if not problems:
        return False
    print(f"vcluster hardware calibrate: {len(problems)} implausible figure(s):",
          file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    print(f"  the machine was busy: {advice}", file=sys.stderr)
    if out is not None and not force:
        print(f"vcluster hardware calibrate: not saved to {out}; pass --force to save "
              "these figures anyway", file=sys.stderr)
        return True
    return False


_QUIET_ADVICE = "rerun on a quiet machine (nothing else running)"
# calibrate --gpu --device cpu: each kernel the fastest of this many timed streams unless
# --repeats (measured here, load average 6-8 on 2 cores: with one stream three sweeps in
# three were refused, a 64x32x16 GEMM at 14x the time of 64x32x64; with three, none was)
CPU_REPEATS = 3


def run_calibrate(args) -> int:
    """Measure this machine on ``args.devices`` devices, print the figures and, with
    ``args.out``, save them (atomically) for ``hardware.calibration``; with ``--gpu``,
    measure the GPU's kernels instead (:func:`run_calibrate_gpu`)."""
    if args.gpu:
        return run_calibrate_gpu(args)
    for flag, value in (("--base", args.base), ("--device", args.device),
                        ("--name", args.name), ("--repeats", args.repeats)):
        if value is not None:
            raise ValueError(f"{flag} calibrates a GPU: add --gpu")
    if args.tiny:
        raise ValueError("--tiny calibrates a GPU (on the CPU, at tiny sizes): add --gpu "
                         "--device cpu")
    args.devices = 8 if args.devices is None else args.devices
    # lazy: keeps vcluster --help fast
    from vcluster.scenario.hardware import LocalhostCalibrations
    from vcluster.localhost.cost_model import save_localhost_spec
    from vcluster.localhost.plausibility import spec_problems

    from .localhost_spec_text import format_localhost_spec
    out = checked_out(args.out) if args.out else None     # checked before the 20 s
    print(f"vcluster hardware calibrate: measuring this machine on {args.devices} devices "
          "(about 20 s) ...", file=sys.stderr, flush=True)
    spec, measured = LocalhostCalibrations().calibration(args.devices)
    print(f"localhost {measured}:")                       # as summary.localhost_calibration
    print(format_localhost_spec(spec))
    if _implausible(spec_problems(spec), _QUIET_ADVICE, out, args.force):
        return 1
    if out is not None:
        save_localhost_spec(spec, out)
        print(f"wrote {out}; reuse it with hardware.calibration, e.g.\n"
              f"  vcluster run SCENARIO.yaml --set hardware=localhost "
              f"--set hardware.calibration={out}")
    return 0


def run_calibrate_gpu(args) -> int:
    """``calibrate --gpu``: time the kernel sweep on the local CUDA device (or, with
    ``--device cpu --tiny``, on the CPU) and write a hardware YAML whose device constants
    are the measured ones (:mod:`vcluster.gpu.calibration`)."""
    # lazy: keeps vcluster --help fast (torch)
    from vcluster.gpu import calibrated_hardware, cuda_missing, default_base, sweep_kernels
    from vcluster.gpu.calibration import check_name
    from vcluster.gpu.kernel_sweep import torch_missing
    from vcluster.gpu.plausibility import sweep_problems
    from vcluster.runtime.files import write_text_atomic
    if args.devices is not None:
        raise ValueError("--devices sizes the localhost calibration cluster; --gpu measures "
                         "one GPU: drop one of them")
    device = args.device or "cuda"
    if args.tiny and device != "cpu":
        raise ValueError("--tiny runs the sweep at sizes for a CPU: use it with --device cpu")
    if not args.out:
        raise ValueError("calibrate --gpu needs --out FILE (the hardware YAML it writes)")
    if args.name is not None:
        check_name(args.name, "--name")
    out = checked_out(args.out)
    if why := torch_missing():
        print(f"vcluster hardware calibrate --gpu: {why}", file=sys.stderr)
        return 2
    if device == "cuda" and (why := cuda_missing()):
        print(f"vcluster hardware calibrate --gpu needs CUDA: {why}; on a machine without a "
              "GPU, --device cpu --tiny runs the same sweep on the CPU", file=sys.stderr)
        return 2
    print(f"vcluster hardware calibrate --gpu: timing GEMMs, copies, a transformer "
          f"layer's kernels, AdamW and launches on "
          f"{device}{' (tiny sizes)' if args.tiny else ''} ...", file=sys.stderr, flush=True)
    # a CPU is shared with this machine's other processes: the fastest of 3 streams
    repeats = args.repeats or (CPU_REPEATS if device == "cpu" else 1)
    sweep = sweep_kernels(device, tiny=args.tiny, repeats=repeats)
    # a CPU is no preset's device: its sweep (a test of the path) borrows the H100 node
    base = args.base or default_base(sweep.device_name) or ("h100-dgx" if device == "cpu"
                                                            else None)
    if base is None:
        raise ValueError(f"no preset is a {sweep.device_name!r}: name the one whose node, "
                         f"links and network to use with --base ({', '.join(PRESET_NAMES)})")
    if _implausible(sweep_problems(sweep), f"rerun on a quiet machine or pass --repeats "
                    f"{max(5, 2 * repeats + 1)} (each kernel the fastest of that many "
                    "timed streams)", out, args.force):
        return 1
    document = calibrated_hardware(sweep, base, name=args.name)
    import yaml
    d = document["device"]
    header = (f"# {document['name']}: {document['source']}\n# device: {d['source']}\n"
              f"# use it: vcluster simulate gpt ... --hardware {out.name}\n")
    write_text_atomic(str(out), header + yaml.safe_dump(document, sort_keys=False))
    print(f"{document['name']} ({sweep.device_name}): gemm_max_efficiency "
          f"{d['gemm_max_efficiency']:.3f}, "
          f"kernel_overhead_us {d['kernel_overhead_us']:.2f}, hbm_efficiency "
          f"{d['hbm_efficiency']:.3f} (base {base}, {len(sweep.kernels)} kernels)")
    print(f"wrote {out}; use it with --hardware {out}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hardware`` (sub-commands ``list`` and ``show``) on ``subparsers``."""
    parser = subparsers.add_parser(
        "hardware", help="list and show the timing model's hardware; calibrate localhost",
        description="The hardware the timing model simulates: presets built from datasheet "
                    "figures, or your own YAML file.")
    commands = parser.add_subparsers(dest="hardware_command", required=True, metavar="ACTION")
    lister = commands.add_parser("list", help="one line per preset")
    lister.set_defaults(run=run_list)
    show = commands.add_parser("show", help="every field of a preset or YAML file, with units")
    show.add_argument("name", help=f"a preset ({', '.join(PRESET_NAMES)}), a .yaml file, or a "
                                   "localhost calibration saved by calibrate --out")
    show.set_defaults(run=run_show)
    cal = commands.add_parser(
        "calibrate", help="measure this machine for the localhost hardware and save it",
        description="Measure this machine for the localhost hardware (GEMM, elementwise "
                    "and memcpy rates, this project's channel calls, the core pool; about "
                    "20 s) and print the figures; with --out, save them for a scenario's "
                    "hardware.calibration (JSON, or YAML for .yaml/.yml). --out is checked "
                    "before measuring; figures no quiet machine produces are named and "
                    "not saved unless --force. --gpu needs torch (pip install -e "
                    "'.[torch]'; on a CPU-only machine first pip install torch "
                    "--index-url https://download.pytorch.org/whl/cpu).")
    cal.add_argument("--devices", type=int_at_least(2, "devices of the calibration cluster"),
                     default=None,
                     help="devices of the calibration cluster (default 8; not with --gpu)")
    cal.add_argument("--out", metavar="FILE", help="write the calibration here (atomically)")
    cal.add_argument("--gpu", action="store_true",
                     help="measure the local CUDA GPU's kernels instead (GEMMs, copies, "
                     "launches; torch, under a minute) and write a hardware YAML for "
                     "--hardware: a preset with the measured device constants")
    cal.add_argument("--base", choices=PRESET_NAMES, default=None,
                     help="with --gpu: the preset whose node, links and network the file "
                     "keeps (default: the preset of the GPU's name)")
    cal.add_argument("--device", choices=["cuda", "cpu"], default=None,
                     help="with --gpu: cuda (default) or cpu (with --tiny: the whole path "
                     "without a GPU)")
    cal.add_argument("--tiny", action="store_true",
                     help="with --gpu --device cpu: sizes a CPU times in seconds")
    cal.add_argument("--name", default=None,
                     help="with --gpu: the name the file's hardware is reported under "
                     "(default <device>-calibrated-<date>, e.g. "
                     "nvidia-h200-calibrated-2026-11-26; not a preset's name)")
    cal.add_argument("--repeats", type=int_at_least(1, "timed streams per kernel"),
                     default=None,
                     help="with --gpu: time each kernel's stream this many times and keep "
                     "the fastest (default 1 on cuda, 3 on cpu; more steadies a sweep on a busy "
                     "machine)")
    cal.add_argument("--force", action="store_true",
                     help="save the figures even when they look like a busy machine's "
                     "(implausible: named on stderr; without --force they are not saved "
                     "and the exit status is 1)")
    cal.set_defaults(run=run_calibrate)
    return parser
