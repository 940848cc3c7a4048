"""``attention="flash-v1"``: fused attention kernels built for Ampere (FlashAttention 1, the
Triton and xformers kernels of 2022-23), computing at the A100's achieved rate times the
device's ``flash_v1_speedup`` (H100 and H200 1.60, from FlashAttention-2's Figs. 4 and 7) —
not at the device's own peak. Same memory and trace as ``flash``. Its reference is the
analytic price of fused attention (a device's achieved GEMM rate): on an A100 flash-v1 is
that price, where ``flash`` now reads the A100's published FlashAttention-2 curves
(tests/timing/test_attention_kernels.py)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mesh import Mesh
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import ATTENTION, GPT, GPTConfig, ParallelConfig
from pipeline_parallel.optim import OptimizerConfig
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import KernelKind, TraceCompute, trace_program
from vcluster.scenario import ScenarioError, run_scenario, scenario_from_dict
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import TRAINING_KERNEL_EFFICIENCY, HardwareCostModel
from vcluster.timing.presets import (FLASH_V1_REFERENCE_PRESET, hardware_from_dict,
                                     hardware_to_dict, preset)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig(hidden=512, layers=2, heads=8, seq=1024, vocab=1024)


def _analytic(name):
    """Preset ``name`` with fused attention priced analytically (no published curves)."""
    return hardware_from_dict({"base": name, "device": {"attention_gpu": "",
                                                         "attention_kernel": ""}})


def _traced_ops(attention="flash-v1"):
    mesh = Mesh((1,), ("dp",))
    par = ParallelConfig(global_batch=2, micro_batch=2, attention=attention)
    args = GPT(GPTConfig(hidden=256, layers=1, heads=2, seq=2048, vocab=512,
                         dtype="float16")).meta_args(mesh, par, 1,
                                                     optimizer=OptimizerConfig("adam"))
    (trace,) = trace_program(mesh, train_program, args)
    return [op for op in trace.ops if isinstance(op, TraceCompute)]


def test_presets_carry_the_speedup_relative_to_the_a100():
    assert "1.20-1.85" in preset("h100-dgx").sources["device.flash_v1_speedup"]
    assert FLASH_V1_REFERENCE_PRESET == "a100-80gb-dgx"
    for name, speedup in (("a100-40gb-dgx", 1.0), ("a100-80gb-dgx", 1.0),
                          ("h100-dgx", 1.60), ("h200-dgx", 1.60)):
        assert preset(name).device.flash_v1_speedup == speedup, name
    hw = preset("h100-dgx")
    assert hardware_from_dict(hardware_to_dict(hw)) == hw
    custom = hardware_from_dict({"base": "h100-dgx", "device": {"flash_v1_speedup": 2}})
    assert custom.device.flash_v1_speedup == 2


@pytest.mark.parametrize("bad", [0, -1.5, "fast", True, float("nan")])
def test_a_bad_speedup_is_refused_naming_the_field(bad):
    with pytest.raises((ValueError, TypeError), match="flash_v1_speedup"):
        hardware_from_dict({"base": "h100-dgx", "device": {"flash_v1_speedup": bad}})


def test_fused_attention_is_the_a100_price_over_the_speedup_and_nothing_else_moves():
    """On the H100 every fused attention kernel (forward and backward) computes at the
    A100 preset's achieved rate times 1.60 (the H100's own launch overhead and HBM term);
    every other op keeps its H100 price."""
    h100 = _analytic("h100-dgx")
    a100 = preset(FLASH_V1_REFERENCE_PRESET).device
    v1, today = HardwareCostModel(h100, flash_v1=True), HardwareCostModel(h100)
    ops = _traced_ops()
    attention = [op for op in ops if op.kernel is not None
                 and op.kernel.kind is KernelKind.ATTENTION]
    assert {op.kernel.backward for op in attention} == {False, True}
    assert any(v1.compute_time_s(op) > today.compute_time_s(op) for op in attention)
    for op in ops:
        if op in attention:
            dev = h100.device
            by_hand = (dev.kernel_overhead_us * 1e-6 + max(
                op.flops / (a100.peak_tflops["bf16"] * 1e12 * a100.gemm_max_efficiency * 1.60),
                op.bytes / (dev.hbm_bandwidth_gbps * 1e9 * dev.hbm_efficiency))
            ) / TRAINING_KERNEL_EFFICIENCY
            assert v1.compute_time_s(op) == pytest.approx(by_hand, rel=1e-12)
            # an Ampere-built kernel gains 1.6x where the H100's peak grew 3.17x: slower
            # where compute-bound, the same where its bytes bind
            assert v1.compute_time_s(op) >= today.compute_time_s(op)
        else:
            assert v1.compute_time_s(op) == today.compute_time_s(op)


def test_unfused_attention_is_not_repriced():
    h100 = load_hardware("h100-dgx")
    ops = _traced_ops("unfused")
    v1, today = HardwareCostModel(h100, flash_v1=True), HardwareCostModel(h100)
    assert [v1.compute_time_s(op) for op in ops] == [today.compute_time_s(op) for op in ops]


@pytest.mark.parametrize("hardware", ["a100-40gb-dgx", "a100-80gb-dgx"])
def test_on_an_a100_flash_v1_is_the_analytic_flash(hardware):
    par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, zero_stage=3)
    flash = simulate_gpt(CFG, par, _analytic(hardware))
    v1 = simulate_gpt(CFG, dataclasses.replace(par, attention="flash-v1"), hardware)
    assert v1.step_time_s == flash.step_time_s
    assert v1.peak_memory_gb == flash.peak_memory_gb


@pytest.mark.parametrize("hardware", ["h100-dgx", "h200-dgx"])
def test_on_hopper_the_step_is_slower_and_the_memory_the_same(hardware):
    for par in (ParallelConfig(global_batch=8, micro_batch=2, dp=2, zero_stage=3),
                ParallelConfig(global_batch=8, micro_batch=1, pp=2, tp=2,
                               recompute="full")):
        flash = simulate_gpt(CFG, par, _analytic(hardware))
        v1 = simulate_gpt(CFG, dataclasses.replace(par, attention="flash-v1"), hardware)
        assert v1.step_time_s > flash.step_time_s
        assert v1.peak_memory_gb == flash.peak_memory_gb and v1.fits == flash.fits
        assert v1.comm_s == pytest.approx(flash.comm_s)


def test_refused_where_it_cannot_be_priced():
    h100 = load_hardware("h100-dgx")
    measured = dataclasses.replace(h100, device=dataclasses.replace(
        h100.device, kernel_table="h100_kernels.csv"))
    with pytest.raises(ValueError, match="flash-v1 is priced by the analytic model"):
        HardwareCostModel(measured, flash_v1=True)
    unknown = hardware_from_dict({"base": "h100-dgx", "device": {"flash_v1_speedup": None}})
    with pytest.raises(ValueError, match="flash_v1_speedup"):
        HardwareCostModel(unknown, flash_v1=True)
    HardwareCostModel(unknown)                                  # flash: no speedup needed
    with pytest.raises(ValueError, match="flash_v1 must be True or False"):
        HardwareCostModel(h100, flash_v1="yes")


def test_cp_takes_either_fused_kernel_and_the_choices_are_named():
    ParallelConfig(global_batch=4, cp=2, attention="flash-v1")
    with pytest.raises(ValueError, match="needs attention='flash' or 'flash-v1'"):
        ParallelConfig(global_batch=4, cp=2, attention="unfused")
    with pytest.raises(ValueError, match="flash-v1"):
        ParallelConfig(global_batch=4, attention="flash4")
    assert ATTENTION == ("flash", "unfused", "flash-v1", "flash2", "flash3", "cudnn")


def _cli(*argv, timeout=200):
    return subprocess.run([sys.executable, "-m", "vcluster", *argv], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))


def test_simulate_and_plan_take_the_flag(tmp_path):
    model = ["--hidden", "2048", "--layers", "2", "--heads", "16", "--seq", "4096",
             "--vocab", "1024", "--global-batch", "8"]
    out = {}
    for attention in ("flash", "flash-v1"):
        path = tmp_path / f"{attention}.json"
        proc = _cli("simulate", "gpt", *model, "--dp", "2", "--micro-batch", "2",
                    "--hardware", "h100-dgx", "--attention", attention, "--json", str(path))
        assert proc.returncode == 0, proc.stderr
        out[attention] = json.loads(path.read_text())
    assert out["flash-v1"]["step_time_s"] > out["flash"]["step_time_s"]
    assert out["flash-v1"]["peak_memory_gb"] == out["flash"]["peak_memory_gb"]
    assert (out["flash"]["attention"], out["flash-v1"]["attention"]) == ("flash", "flash-v1")
    proc = _cli("simulate", "gpt", *model, "--attention", "flash4")
    assert proc.returncode == 2 and "flash-v1" in proc.stderr
    plan = tmp_path / "plan.json"
    proc = _cli("plan", "gpt", *model, "--gpus", "2", "--hardware", "h100-dgx",
                "--attention", "flash-v1", "--replay", "1", "--top", "1", "--quiet",
                "--json", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(plan.read_text())["attention"] == "flash-v1"


def test_a_scenario_names_it_and_localhost_refuses_it():
    doc = {"workload": {"kind": "transformer", "hidden": 256, "heads": 4, "seq": 256,
                        "layers": 2, "dtype": "float16"},
           "parallel": {"dp": 2}, "hardware": {"name": "h100-dgx"},
           "run": {"mode": "simulate"}}
    flash = run_scenario(scenario_from_dict(doc)).summary
    v1 = run_scenario(scenario_from_dict(
        dict(doc, parallel={"dp": 2, "attention": "flash-v1"}))).summary
    assert v1["predicted_step_time_s"] > flash["predicted_step_time_s"]
    with pytest.raises(ScenarioError) as info:
        run_scenario(scenario_from_dict(dict(doc, parallel={"dp": 2, "attention": "flash-v1"},
                                             hardware={"name": "localhost"})))
    assert info.value.path == "parallel.attention" and info.value.value == "flash-v1"
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(dict(doc, parallel={"dp": 2, "attention": "flash4"}))
    assert info.value.path == "parallel.attention" and "flash-v1" in str(info.value)


def test_the_planners_screen_prices_it_as_the_replay_does():
    """plan_gpt(attention="flash-v1"): the screen's estimate of each replayed candidate
    stays within 5% of its replay (the same cost model prices both), and every replayed
    step is slower than under today's kernels on the H100."""
    from vcluster.planner.search import plan_gpt
    common = dict(hidden=512, layers=2, heads=8, seq=4096, vocab=1024, gpus=4,
                  global_batch=8, hardware="h100-dgx", progress=False, replay=3, top=3,
                  workers=1)
    v1 = plan_gpt(attention="flash-v1", **common)
    flash = plan_gpt(attention="flash", **common)
    assert v1.attrs["attention"] == "flash-v1"
    replayed = v1[v1["replayed"]]
    assert len(replayed) == 3
    for _, row in replayed.iterrows():
        assert row["screen_step_time_s"] == pytest.approx(row["step_time_s"], rel=0.05)
    keys = ["tp", "pp", "dp", "micro_batch", "schedule", "recompute", "sequence_parallel"]
    both = replayed.merge(flash[flash["replayed"]], on=keys, suffixes=("_v1", "_flash"))
    assert len(both) >= 1
    assert (both["step_time_s_v1"] > both["step_time_s_flash"]).all()
