"""Issue 26: a table of kernels measured on one GPU prices another by datasheet ratios —
GEMMs and attention by the ratio of achieved FLOP/s, memory-bound kinds by the ratio of
achieved HBM bandwidth, fixed costs and the launch floor unchanged."""

import math

import pytest

from vcluster.runtime.tracing import Kernel
from vcluster.timing import load_hardware
from vcluster.timing.hardware import kernel_tables
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.kernel_profile import H100_KERNEL_TABLE, TABLE_PRESETS
from vcluster.timing.kernel_profiles import (COMPUTE_BOUND, PROFILE_UNITS, KernelProfile,
                                             h100_kernel_profile)
from vcluster.timing.presets import PRESET_NAMES, preset


def _with_table(name):
    return load_hardware({"base": name, "device": {"kernel_table": H100_KERNEL_TABLE}})


def test_every_shipped_table_names_the_preset_of_the_gpu_that_measured_it():
    assert set(TABLE_PRESETS) == set(kernel_tables())
    assert all(p in PRESET_NAMES for p in TABLE_PRESETS.values())


def test_on_the_measuring_gpu_the_table_is_priced_as_measured():
    assert _with_table("h100-dgx").device.kernel_profile() == h100_kernel_profile()


@pytest.mark.parametrize("name", ["h200-dgx", "a100-80gb-dgx", "a100-40gb-dgx"])
def test_another_gpu_moves_each_kind_by_its_datasheet_ratio(name):
    src, dst = preset("h100-dgx").device, preset(name).device
    # the ratios by hand, from the datasheet figures and the presets' efficiencies
    compute = (dst.peak_tflops["bf16"] * dst.gemm_max_efficiency) / \
        (src.peak_tflops["bf16"] * src.gemm_max_efficiency)
    memory = (dst.hbm_bandwidth_gbps * dst.hbm_efficiency) / \
        (src.hbm_bandwidth_gbps * src.hbm_efficiency)
    h100, moved = h100_kernel_profile(), _with_table(name).device.kernel_profile()
    assert moved.gemm.flops_per_s == pytest.approx(h100.gemm.flops_per_s * compute, rel=1e-12)
    assert moved.gemm.call_s == h100.gemm.call_s
    assert moved.launch_s == h100.launch_s
    assert set(moved.kinds) == set(h100.kinds) == set(PROFILE_UNITS)
    for kind, p in h100.kinds.items():
        ratio = compute if kind in COMPUTE_BOUND else memory
        assert moved.kinds[kind].unit_s == pytest.approx(p.unit_s / ratio, rel=1e-12), kind
        assert moved.kinds[kind].call_s == p.call_s
    assert "moved to " + dst.name in moved.source


def test_h200_prices_memory_bound_kernels_faster_and_gemms_alike():
    """The H200 has the H100's compute and 4.8 / 3.35 its HBM bandwidth."""
    h100, h200 = (HardwareCostModel(_with_table(n)) for n in ("h100-dgx", "h200-dgx"))
    big_add = Kernel.elementwise(3 * 8192 * 8192)
    gemm = Kernel.gemm(1, 4096, 4096, 4096)
    ratio = 4800 / 3350
    p100, p200 = h100.kernel_profile.kinds["elementwise"], h200.kernel_profile.kinds["elementwise"]
    assert p200.unit_s == pytest.approx(p100.unit_s / ratio)
    assert h200.kernel_profile.time_s(big_add) < h100.kernel_profile.time_s(big_add)
    assert h200.kernel_profile.time_s(gemm) == pytest.approx(h100.kernel_profile.time_s(gemm))


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "2"])
def test_moved_refuses_a_ratio_that_is_not_a_positive_number(bad):
    p = h100_kernel_profile()
    for args in ((bad, 1.0), (1.0, bad)):
        with pytest.raises(ValueError, match="ratio must be a number > 0"):
            p.moved(*args)


def test_ratios_of_one_give_the_profile_back():
    p = h100_kernel_profile()
    assert p.moved(1, 1.0) is p
    assert isinstance(p.moved(2.0, 0.5, "X"), KernelProfile)


def test_hardware_show_says_how_the_table_prices_this_gpu(tmp_path, capsys):
    from vcluster.cli.main import main
    assert preset("h200-dgx").device.kernel_table_ratios() == (1.0, 1.0)    # no table
    for base, says in (("h100-dgx", "h100_kernels.csv's profiles, as measured"),
                       ("h200-dgx", "moved here by datasheet ratios: FLOP/s x1, HBM "
                                    "bandwidth x1.433")):
        f = tmp_path / f"{base}.yaml"
        f.write_text(f"base: {base}\ndevice:\n  kernel_table: {H100_KERNEL_TABLE}\n")
        assert main(["hardware", "show", str(f)]) == 0
        assert says in capsys.readouterr().out
