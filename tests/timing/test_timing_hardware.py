"""vcluster.timing hardware: presets vs hardware.csv, YAML, validation, device model, CLI."""

import csv
import dataclasses
import io
import os
import re
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cli_helpers import run_cli
from vcluster.cli.hardware_cmd import add_parser, format_hardware
from vcluster.cli.main import main
from vcluster.timing import (PRESET_NAMES, DeviceSpec, HardwareSpec, LinkSpec, hardware_from_dict,
                             hardware_to_dict, load_hardware, preset)

REFERENCE = Path("/work/shared/reference")
DATA = resources.files("vcluster.timing").joinpath("data")
PRESET_PARTS = {"a100-40gb-dgx": ("A100-SXM4-40GB", "HDR-4x"),
                "a100-80gb-dgx": ("A100-SXM4-80GB", "HDR-4x"),
                "h100-dgx": ("H100-SXM5-80GB", "NDR-4x"),
                "h200-dgx": ("H200-SXM-141GB", "NDR-4x")}


def _csv_rows(text):
    body = "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))
    return {row["part"]: row for row in csv.DictReader(io.StringIO(body))}


def _hardware_csv():
    return _csv_rows(DATA.joinpath("hardware.csv").read_text("utf-8"))


# ------------------------------------------------------------------ presets vs data
def test_package_data_are_copies_of_the_reference_with_their_source_lines():
    for name in ("hardware.csv", "nccl_a100.csv", "megatron_2020_a100.csv",
                 "megatron_sc21_table1.csv"):
        text = DATA.joinpath(name).read_text("utf-8")
        assert text.startswith("# ")  # the source header line travels with the data
        if (REFERENCE / name).exists():
            assert text == (REFERENCE / name).read_text("utf-8")


@pytest.mark.parametrize("name", sorted(PRESET_PARTS))
def test_presets_match_hardware_csv(name):
    hw, rows = preset(name), _hardware_csv()
    gpu, nic = (rows[p] for p in PRESET_PARTS[name])
    d = hw.device
    assert hw.name == name and d.name == gpu["part"]
    assert d.peak_tflops["bf16"] == float(gpu["bf16_dense_tflops"]) == d.peak_tflops["fp16"]
    assert d.peak_tflops["tf32"] == float(gpu["tf32_dense_tflops"])
    assert d.peak_tflops["fp32"] == float(gpu["fp32_tflops"])
    assert d.peak_flops("bfloat16") == float(gpu["bf16_dense_tflops"]) * 1e12
    assert d.hbm_bytes == float(gpu["hbm_gb"]) * 1e9
    assert d.hbm_bandwidth_gbps == float(gpu["hbm_bandwidth_gbps"])
    assert hw.node.gpus_per_node == 8
    assert hw.node.gpu_link.bandwidth_gbps == float(gpu["nvlink_total_gbps_bidirectional"]) / 2
    assert hw.network.nic.bandwidth_gbps == float(nic["hbm_bandwidth_gbps"])
    assert hw.network.nics_per_node == 8
    assert all(s for s in (hw.source, d.source, hw.node.source, hw.network.source,
                           hw.node.gpu_link.source, hw.network.nic.source))


def test_preset_efficiencies_follow_their_documented_sources():
    a100, h100 = preset("a100-80gb-dgx"), preset("h100-dgx")
    # FORMULAS.md: NCCL gets ~20 GB/s per NVLink on A100 (12 links), ~20.6 on H100 (18).
    assert a100.node.gpu_link.effective_gbps == pytest.approx(12 * 20.0)
    assert h100.node.gpu_link.effective_gbps == pytest.approx(18 * 20.6)
    # hardware.csv notes: HDR ~23.5-24 GB/s, NDR ~46-48.5 GB/s achieved per NIC.
    assert 23.5 <= a100.network.nic.effective_gbps <= 24
    assert 46 <= h100.network.nic.effective_gbps <= 48.5
    assert a100.network.node_bandwidth_gbps == pytest.approx(8 * a100.network.nic.effective_gbps)
    # stas00/ml-engineering MAMF: A100 267.9 / 312, H100 792.1 / 989 TFLOP/s.
    assert a100.device.gemm_max_efficiency == pytest.approx(267.9 / 312, abs=1e-3)
    assert h100.device.gemm_max_efficiency == pytest.approx(792.1 / 989, abs=1e-3)
    # the same table's FP8 MAMF: H100 1402.6 / 1979, H200 1453.4 / 1979; no FP8 on A100
    h200 = preset("h200-dgx")
    assert h100.device.e_max("fp8") == pytest.approx(1402.6 / 1979, abs=1e-3)
    assert h200.device.e_max("fp8") == pytest.approx(1453.4 / 1979, abs=1e-3)
    assert h100.device.e_max("bf16") == h100.device.gemm_max_efficiency
    assert dict(a100.device.gemm_max_efficiency_by_dtype) == {}
    # an FP8 GEMM's time: its FLOPs over the FP8 peak at that share
    big = 2.0 * 16384 ** 3
    assert h100.device.compute_time_s(big, 0, "fp8") == pytest.approx(
        5e-6 + big / (1978.8e12 * h100.device.e_max("fp8")))


def test_gemm_max_efficiency_by_dtype_is_checked_and_overridable(tmp_path):
    h100 = preset("h100-dgx").device
    for bad, says in (({"int4": 0.5}, "gemm_max_efficiency_by_dtype.int4"),
                      ({"fp8": 1.5}, "(0, 1], got 1.5"),
                      ({"fp8": True}, "got True"),
                      ([0.5], "expected a mapping")):
        with pytest.raises(ValueError, match=re.escape(says)):
            dataclasses.replace(h100, gemm_max_efficiency_by_dtype=bad)
    with pytest.raises(ValueError, match=r"no peak_tflops for 'fp8'"):
        dataclasses.replace(preset("a100-80gb-dgx").device,
                            gemm_max_efficiency_by_dtype={"fp8": 0.7})
    path = tmp_path / "fp8.yaml"
    path.write_text("base: h100-dgx\ndevice: {gemm_max_efficiency_by_dtype: {fp8: 0.8, "
                    "tf32: 0.5}}\n")
    hw = load_hardware(path)
    assert (hw.device.e_max("fp8"), hw.device.e_max("tf32"), hw.device.e_max("bf16")) == \
        (0.8, 0.5, h100.gemm_max_efficiency)


def test_a_power_limited_part_sustains_a_share_of_the_datasheet_speed(tmp_path):
    """``sustained_compute_ratio`` (and ``_by_dtype``) scale the achieved GEMM rate of each
    dtype — a compute-bound GEMM takes 1/c as long — while the datasheet peak (what MFU is
    reported against) and the memory-bound kernels stay; bad values name the field."""
    h100 = preset("h100-dgx").device
    assert h100.sustained_ratio("bf16") == h100.sustained_ratio("fp8") == 1.0
    capped = dataclasses.replace(h100, sustained_compute_ratio=0.75,
                                 sustained_compute_ratio_by_dtype={"fp8": 0.8})
    assert capped.peak_flops("bf16") == h100.peak_flops("bf16")
    assert capped.achieved_flops("bf16") == pytest.approx(0.75 * h100.achieved_flops("bf16"))
    assert capped.achieved_flops("fp8") == pytest.approx(0.8 * h100.achieved_flops("fp8"))
    big = (16384, 16384, 16384)
    for dtype, c in (("bf16", 0.75), ("fp8", 0.8)):
        t0, t1 = h100.matmul_time_s(*big, dtype), capped.matmul_time_s(*big, dtype)
        k = h100.kernel_overhead_us * 1e-6
        assert t1 - k == pytest.approx((t0 - k) / c, rel=2e-3)
    assert capped.elementwise_time_s(1e9) == h100.elementwise_time_s(1e9)
    for field, bad, says in (("sustained_compute_ratio", 0, "sustained_compute_ratio: must "
                              "be in (0, 1], got 0"),
                             ("sustained_compute_ratio", 1.2, "got 1.2"),
                             ("sustained_compute_ratio_by_dtype", {"int4": 0.5},
                              "sustained_compute_ratio_by_dtype.int4"),
                             ("sustained_compute_ratio_by_dtype", {"fp8": 0}, "(0, 1], got 0")):
        with pytest.raises(ValueError, match=re.escape(says)):
            dataclasses.replace(h100, **{field: bad})
    path = tmp_path / "capped.yaml"
    path.write_text("base: h100-dgx\ndevice: {sustained_compute_ratio: {value: 0.7, source: "
                    "'a 500 W limit, measured'}, sustained_compute_ratio_by_dtype: {fp8: 0.8}}\n")
    hw = load_hardware(path)
    assert (hw.device.sustained_ratio("bf16"), hw.device.sustained_ratio("fp8")) == (0.7, 0.8)
    assert hw.sources["device.sustained_compute_ratio"] == "a 500 W limit, measured"
    shown = format_hardware(hw)
    assert "sustained_compute_ratio: 0.7" in shown and "# a power-limited part: GEMMs at " \
        "e(F) x bf16 0.7" in shown and "fp8 0.8" in shown
    assert "# a power-limited part" not in format_hardware(preset("h100-dgx"))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError) as err:
        preset("z100-dgx")
    assert all(n in str(err.value) for n in PRESET_NAMES)
    with pytest.raises(ValueError) as err:
        load_hardware("z100-dgx")
    assert all(n in str(err.value) for n in PRESET_NAMES)


def test_specs_are_frozen_hashable_and_independent():
    a, b = preset("a100-80gb-dgx"), preset("a100-80gb-dgx")
    assert a == b and a is not b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "x"
    with pytest.raises(TypeError):
        a.device.peak_tflops["bf16"] = 1.0
    four = a.with_nics_per_node(4)
    assert four.network.nics_per_node == 4 and four.name == "a100-80gb-dgx-4nic"
    assert a.network.nics_per_node == 8 and preset("a100-80gb-dgx") == a
    assert "peak_tflops={'bf16': 312.0" in repr(a) and "nics_per_node=8" in repr(a)
    assert [a.node_of(r) for r in (0, 7, 8, 17)] == [0, 0, 1, 2]


# ------------------------------------------------------------------ YAML
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_yaml_round_trip(name, tmp_path):
    hw = preset(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(hardware_to_dict(hw), sort_keys=False))
    assert load_hardware(path) == hw == load_hardware(str(path))
    assert hardware_from_dict(hardware_to_dict(hw)) == hw == load_hardware(hardware_to_dict(hw))


def test_yaml_base_with_overrides(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: a100-80gb-dgx\nname: four-nics\nnetwork: {nics_per_node: 4}\n"
                    "device: {peak_tflops: {fp8: 624}, hbm_bytes: 8.0e+10}\n")
    hw = load_hardware(path)
    ref = preset("a100-80gb-dgx").with_nics_per_node(4)
    assert hw.name == "four-nics" and hw.network == ref.network and hw.node == ref.node
    assert dict(hw.device.peak_tflops) == {**ref.device.peak_tflops, "fp8": 624.0}
    assert hw.device.hbm_bytes == 80_000_000_000 and isinstance(hw.device.hbm_bytes, int)


def _full_yaml(**edits):
    data = hardware_to_dict(preset("a100-80gb-dgx"))
    for path, value in edits.items():
        *parents, leaf = path.split("__")
        node = data
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[leaf]
        else:
            node[leaf] = value
    return yaml.safe_dump(data)


BAD_YAMLS = [
    ("colour: red\n" + _full_yaml(), ["hardware.colour", "unknown key", "device"]),
    (_full_yaml(device__peak_tflop={"bf16": 1}), ["hardware.device.peak_tflop", "unknown"]),
    (_full_yaml(device__hbm_bytes=KeyError), ["hardware.device.hbm_bytes", "missing"]),
    (_full_yaml(node__gpus_per_node="eight"), ["hardware.node.gpus_per_node", "'eight'",
                                                "integer"]),
    (_full_yaml(node__gpus_per_node=True), ["hardware.node.gpus_per_node", "True"]),
    (_full_yaml(node__gpus_per_node=0), ["hardware.node.gpus_per_node", "> 0", "0"]),
    (_full_yaml(network__nic__bandwidth_gbps=-25), ["hardware.network.nic.bandwidth_gbps",
                                                     "-25", "> 0"]),
    (_full_yaml(node__gpu_link__efficiency=1.5), ["hardware.node.gpu_link.efficiency", "1.5",
                                                   "(0, 1]"]),
    (_full_yaml(node__fabric="infiniband"), ["hardware.node.fabric", "'infiniband'",
                                              "nvswitch"]),
    (_full_yaml(network__topology="torus"), ["hardware.network.topology", "fat_tree"]),
    (_full_yaml(device__peak_tflops={"bf17": 3}), ["hardware.device.peak_tflops.bf17", "bf16"]),
    (_full_yaml(device__peak_tflops={"bf16": "fast"}), ["hardware.device.peak_tflops.bf16",
                                                        "'fast'"]),
    (_full_yaml(network__oversubscription=0.5), ["hardware.network.oversubscription", "0.5",
                                                  ">= 1"]),
    (_full_yaml(network=4), ["hardware.network", "mapping", "4"]),
    ("base: z300-dgx\n", ["hardware.base", "'z300-dgx'", "a100-80gb-dgx"]),
    ("base: h100-dgx\nnetwork: {nics: 4}\n", ["hardware.network.nics", "nics_per_node"]),
    ("- 1\n- 2\n", ["hardware", "mapping"]),
    ("name: [unclosed\n", ["not valid YAML"]),
]


@pytest.mark.parametrize("text,fragments", BAD_YAMLS)
def test_bad_hardware_yaml_names_the_key_path_value_and_rule(text, fragments, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_hardware(path)
    message = str(err.value)
    assert message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_missing_yaml_file_and_wrong_argument_type(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hardware(tmp_path / "nope.yaml")
    with pytest.raises(TypeError):
        load_hardware(42)


# ------------------------------------------------------------------ device model
A100 = preset("a100-80gb-dgx").device


def test_large_gemm_runs_at_max_efficiency():
    m = k = n = 16384
    ideal = 2 * m * k * n / (312e12 * A100.gemm_max_efficiency)
    assert A100.matmul_time_s(m, k, n, "bf16") == pytest.approx(ideal + 5e-6)
    assert A100.gemm_efficiency(m, k, n, "bf16") == pytest.approx(0.859, rel=1e-3)


def test_gemm_efficiency_is_half_at_the_half_size_and_saturates():
    f_half = A100.gemm_half_efficiency_flops("bf16")
    assert f_half == pytest.approx(312e12 * 0.859 * 5e-6)
    m = n = 1024
    k = f_half / (2 * m * n)  # 2mkn == F_half
    e = A100.gemm_max_efficiency * (2 * m * k * n) / (2 * m * k * n + f_half)
    assert e == pytest.approx(A100.gemm_max_efficiency / 2)
    sizes = [64, 256, 1024, 4096, 16384]
    effs = [A100.gemm_efficiency(s, s, s, "bf16") for s in sizes]
    assert effs == sorted(effs) and effs[-1] < A100.gemm_max_efficiency


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 1 << 15), st.integers(1, 1 << 15), st.integers(1, 1 << 15),
       st.sampled_from(["bf16", "fp16", "tf32", "fp32"]))
def test_matmul_time_is_the_roofline_of_compute_and_memory(m, k, n, dtype):
    t = A100.matmul_time_s(m, k, n, dtype)
    size = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}[dtype]
    compute = 2 * m * k * n / (A100.peak_flops(dtype) * A100.gemm_efficiency(m, k, n, dtype))
    memory = 5e-6 + (m * k + k * n + m * n) * size / (2039e9 * 0.9)
    assert t == pytest.approx(max(compute, memory), rel=1e-9)
    assert A100.matmul_time_s(2 * m, k, n, dtype) >= t


def test_memory_bound_kernels():
    # a GEMV (m = 1) is memory-bound: time = t_k + bytes / achieved HBM bandwidth
    k = n = 8192
    assert A100.matmul_time_s(1, k, n, "bf16") == pytest.approx(
        5e-6 + (k + k * n + n) * 2 / (2039e9 * 0.9))
    assert A100.elementwise_time_s(1e9) == pytest.approx(5e-6 + 1e9 / (2039e9 * 0.9))
    assert A100.elementwise_time_s(0) == 0.0 and A100.matmul_time_s(0, 5, 5, "bf16") == 0.0
    assert A100.compute_time_s(1e12, 1e6, "bf16") == pytest.approx(
        5e-6 + 1e12 / (312e12 * 0.859))


def test_device_input_errors():
    with pytest.raises(ValueError, match="dtype 'int4'"):
        A100.matmul_time_s(4, 4, 4, "int4")
    with pytest.raises(ValueError, match="no peak for dtype 'fp8'"):
        A100.peak_flops("fp8")
    with pytest.raises(ValueError, match="dimension k"):
        A100.matmul_time_s(4, -1, 4, "bf16")
    with pytest.raises(ValueError, match="nbytes"):
        A100.elementwise_time_s(-1)
    with pytest.raises(ValueError, match="gemm_max_efficiency"):
        dataclasses.replace(A100, gemm_max_efficiency=1.2)
    with pytest.raises(TypeError, match="gpu_link"):
        dataclasses.replace(preset("h100-dgx").node, gpu_link=None)
    with pytest.raises(ValueError, match="latency_us"):
        LinkSpec(bandwidth_gbps=10, latency_us=-1)
    assert isinstance(A100, DeviceSpec) and isinstance(preset("h100-dgx"), HardwareSpec)


def test_timing_package_imports_no_higher_layer_and_no_pandas():
    code = ("import sys, vcluster.timing\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pandas', 'matplotlib',"
            " 'tensor_parallel', 'pipeline_parallel', 'pipelining')"
            " or m.startswith('vcluster.cli')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ CLI
def _run(argv):
    return run_cli(add_parser, argv)


def test_cli_list_prints_every_preset(capsys):
    assert _run(["hardware", "list"]) == 0
    out = capsys.readouterr().out
    for name in PRESET_NAMES:
        line = next(ln for ln in out.splitlines() if ln.startswith(name))
        hw = preset(name)
        assert hw.device.name in line and f"{hw.device.peak_tflops['bf16']:g}" in line


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_cli_show_prints_every_field_with_units(name, capsys):
    assert _run(["hardware", "show", name]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_hardware(preset(name))

    def keys(d, indent=""):
        for k, v in d.items():
            yield indent + k
            if isinstance(v, dict):
                yield from keys(v, indent + "  ")
    lines = out.splitlines()
    for key in keys(hardware_to_dict(preset(name))):
        assert any(ln.startswith(key + ":") for ln in lines), key
    hw = preset(name)
    assert f"hbm_bandwidth_gbps: {hw.device.hbm_bandwidth_gbps:g} GB/s" in out
    assert f"latency_us: {hw.network.nic.latency_us:g} us" in out
    assert f"bf16: {hw.device.peak_tflops['bf16']:g} TFLOP/s" in out
    assert f"hbm_bytes: {hw.device.hbm_bytes} B" in out
    assert f"gpus_per_node: {hw.gpus_per_node} GPUs" in out
    assert f"domain_gpus: {hw.domain_gpus} GPUs" in out
    # every field a preset has is printed with its source (names and source texts aside)
    paths = [p for p in _field_paths(hardware_to_dict(hw))
             if not p.endswith(("source", "name"))]
    sourced = [ln for ln in lines if "  # source: " in ln]
    assert len(sourced) == len(paths), (len(sourced), len(paths))


def _field_paths(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _field_paths(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def test_cli_show_yaml_file_and_unknown_name(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text("base: h100-dgx\nname: mine\nnetwork: {nics_per_node: 4}\n")
    assert _run(["hardware", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("name: mine") and "nics_per_node: 4 NICs" in out
    with pytest.raises(ValueError) as err:
        _run(["hardware", "show", "tpu-v5"])
    assert all(n in str(err.value) for n in PRESET_NAMES)


@pytest.mark.slow
def test_cli_calibrate_saves_what_it_prints_for_a_scenario(tmp_path, capsys):
    """``hardware calibrate`` measures this machine (a real 2-device calibration), prints
    the figures of the file it writes, and a scenario reuses that file."""
    from vcluster.cli.localhost_spec_text import format_localhost_spec
    from vcluster.scenario import load_scenario, run_scenario
    from vcluster.localhost.cost_model import load_localhost_spec
    path = tmp_path / "machine.yaml"
    assert _run(["hardware", "calibrate", "--devices", "2", "--out", str(path)]) == 0
    captured = capsys.readouterr()
    assert "measuring this machine on 2 devices" in captured.err
    spec = load_localhost_spec(path)
    assert spec.calibration_devices == 2 and spec.group_sizes == (2,)
    assert format_localhost_spec(spec) in captured.out      # the figures that were saved
    assert _run(["hardware", "show", str(path)]) == 0
    assert format_localhost_spec(spec) in capsys.readouterr().out
    assert f"--set hardware.calibration={path}" in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.yaml"]  # no temporary
    s = load_scenario(Path(__file__).parents[2] / "scenarios" / "collective_all_reduce.yaml",
                      ["hardware=localhost", f"hardware.calibration={path}",
                       "run.mode=simulate"])
    summary = run_scenario(s).summary
    assert summary["localhost_calibration"] == f"saved {path}"
    assert summary["predicted_step_time_s"] > 0


def _bad_outs(tmp_path):
    """(--out, what the error says) for paths no file can be written at."""
    (tmp_path / "a-file").write_text("")
    cases = [(tmp_path / "no-such-dir" / "machine.json",
              f"directory {str(tmp_path / 'no-such-dir')!r} does not exist"),
             (tmp_path / "a-file" / "machine.json",
              f"{str(tmp_path / 'a-file')!r} is a file, not a directory"),
             (tmp_path, "is a directory: name a file to write in it")]
    if Path("/proc/self").is_dir():                 # Linux: no file can be created there
        cases.append((Path("/proc/machine.yaml"), "cannot write in directory '/proc'"))
    if hasattr(os, "geteuid") and os.geteuid() != 0:    # root writes in a 0o500 directory
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((locked / "machine.json", f"cannot write in directory {str(locked)!r}"))
    return cases


@pytest.mark.parametrize("gpu", [[], ["--gpu", "--device", "cpu", "--tiny"]])
def test_cli_calibrate_checks_its_arguments_before_measuring(tmp_path, capsys, gpu):
    """A bad --devices or --out fails at once (exit 2, naming the flag and the path), well
    under the measurement (~20 s; --gpu --device cpu --tiny: seconds), writing nothing."""
    if not gpu:
        with pytest.raises(SystemExit):
            _run(["hardware", "calibrate", "--devices", "1"])
        assert "--devices: expected an integer >= 2" in capsys.readouterr().err
    for out, why in _bad_outs(tmp_path):
        before = sorted(tmp_path.rglob("*"))
        t0 = time.perf_counter()
        assert main(["hardware", "calibrate", *gpu, "--out", str(out)]) == 2
        assert time.perf_counter() - t0 < 2.0
        err = capsys.readouterr().err
        assert f"vcluster: error: --out = {str(out)!r}" in err and why in err, err
        assert "measuring" not in err and "timing" not in err      # refused before it
        assert sorted(tmp_path.rglob("*")) == before              # no probe left behind


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_cli_show_prints_a_saved_calibration(tmp_path, capsys, suffix):
    from tests.localhost_specs import spec
    from vcluster.cli.localhost_spec_text import format_localhost_spec
    from vcluster.localhost.cost_model import save_localhost_spec
    path = tmp_path / f"machine{suffix}"
    save_localhost_spec(spec(), path)
    assert _run(["hardware", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"localhost calibration {path} (measured on 8 devices):")
    assert format_localhost_spec(spec()) in out
    assert "2 cores: T(2) = 1.90, T(8) = 1.80; GEMM 125 / 60 GFLOP/s" in out
    assert "barrier/8 B/4 KiB all_reduce (us) by group size 2: 30/70/150" in out


def test_localhost_is_not_a_hardware_description(tmp_path):
    """simulate and plan price presets and YAML descriptions; localhost (or a saved
    calibration) gets an error that says where it belongs, not 'unknown key cores'."""
    from tests.localhost_specs import spec
    from vcluster.localhost import load_hardware, save_localhost_spec
    with pytest.raises(ValueError, match=r"'localhost' is this machine.*vcluster run"):
        load_hardware("localhost")
    path = tmp_path / "machine.json"
    save_localhost_spec(spec(), path)
    with pytest.raises(ValueError, match=r"machine.json is a localhost calibration.*preset"):
        load_hardware(str(path))
