"""Real-GPU measurements (issue 26): the kernel sweep of ``hardware calibrate --gpu`` and
the reference PyTorch GPT step of ``bench gpu-step``. Their whole path runs on the CPU at
tiny sizes here; on a machine with CUDA the GPU commands run too (never skipped there),
and without CUDA they exit 2 naming it."""

import math

import pytest
import yaml

from pipeline_parallel.gpt import GPT, GPTConfig
from vcluster.cli.main import main
from vcluster.gpu import calibrated_hardware, cuda_missing, measure_gpt_step, sweep_kernels
from vcluster.timing import load_hardware
from vcluster.timing.kernel_profile import KernelTiming

pytestmark = pytest.mark.timeout(300)


def test_reference_step_is_the_emulators_gpt_and_trains():
    """The torch model has exactly the parameters of pipeline_parallel's GPT, and training
    a fixed batch lowers its loss."""
    cfg = GPTConfig(hidden=32, layers=2, heads=4, seq=16, vocab=64)
    m = measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, steps=4, warmup=2, device="cpu")
    assert m.parameters == sum(math.prod(s) for s in GPT(cfg).param_shapes().values())
    assert len(m.losses) == 6 and m.losses[-1] < m.losses[0]
    assert len(m.step_times_s) == 4 and m.step_time_s > 0 and m.peak_memory_bytes is None
    with pytest.raises(ValueError, match="hidden=30 is not divisible by heads=4"):
        measure_gpt_step(30, 2, 4, 16, 64, micro_batch=2, device="cpu")
    with pytest.raises(ValueError, match="micro_batch must be an int >= 1, got 0"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=0, device="cpu")


def test_calibration_constants_come_from_the_sweep():
    sweep = sweep_kernels("cpu", tiny=True)
    kinds = [k.kind for k in sweep.kernels]
    assert kinds.count("gemm") == 18 and kinds.count("elementwise") == 3 and "launch" in kinds
    doc = calibrated_hardware(sweep, "h100-dgx")
    hw = load_hardware(doc)
    device, base = hw.device, load_hardware("h100-dgx").device
    profile = device.gemm_profile()
    assert profile.rows == 18
    assert device.gemm_max_efficiency == pytest.approx(profile.flops_per_s / base.peak_flops("fp32"))
    launch = [k.seconds for k in sweep.kernels if k.kind == "launch"][0]
    assert device.kernel_overhead_us == pytest.approx(max(profile.call_s, launch) * 1e6)
    best = max(k.bytes / k.seconds for k in sweep.kernels if k.kind == "elementwise")
    assert device.hbm_efficiency == pytest.approx(min(1.0, best / 3350e9))
    assert hw.node == load_hardware("h100-dgx").node          # the rest is the base's


def test_kernel_rows_are_checked():
    with pytest.raises(ValueError, match=r"device.kernels\[1\]: kind must be one of"):
        load_hardware({"base": "h100-dgx", "device": {"kernels": [
            {"kind": "gemm", "m": 8, "k": 8, "n": 8, "seconds": 1e-5}, {"kind": "fft", "seconds": 1}]}})
    with pytest.raises(ValueError, match="seconds must be a number > 0"):
        KernelTiming("launch", 0.0)
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        KernelTiming("gemm", 1e-5, m=0, k=2, n=2)


def test_calibrate_on_the_cpu_writes_hardware_that_simulate_accepts(tmp_path, capsys):
    out = tmp_path / "cpu.yaml"
    assert main(["hardware", "calibrate", "--gpu", "--device", "cpu", "--tiny",
                 "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["base"] == "h100-dgx" and len(doc["device"]["kernels"]) == 22
    assert main(["simulate", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--seq", "32", "--vocab", "100", "--global-batch", "2",
                 "--hardware", str(out)]) == 0
    assert main(["hardware", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "kernels: 22 measured (18 gemm, 3 elementwise, 1 launch)" in shown
    assert "(calibrated)" in shown


@pytest.mark.parametrize("argv, message", [
    (["hardware", "calibrate", "--gpu", "--devices", "4", "--out", "x.yaml"],
     "--devices sizes the localhost calibration cluster"),
    (["hardware", "calibrate", "--gpu", "--tiny", "--out", "x.yaml"],
     "--tiny runs the sweep at sizes for a CPU"),
    (["hardware", "calibrate", "--tiny"], "--tiny calibrates a GPU"),
    (["hardware", "calibrate", "--gpu"], "calibrate --gpu needs --out FILE"),
])
def test_calibrate_usage_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_gpu_commands_run_on_a_gpu_and_name_cuda_elsewhere(tmp_path, capsys):
    out = tmp_path / "gpu.yaml"
    calibrate = main(["hardware", "calibrate", "--gpu", "--out", str(out)])
    step = main(["bench", "gpu-step", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--seq", "64", "--vocab", "128", "--micro-batch", "2", "--steps", "2",
                 "--json", str(tmp_path / "step.json")])
    text = capsys.readouterr()
    if cuda_missing():
        assert (calibrate, step) == (2, 2)
        assert "calibrate --gpu needs CUDA" in text.err and "gpu-step needs a CUDA GPU" in text.err
        assert not out.exists()
    else:
        assert (calibrate, step) == (0, 0), text.err
        assert load_hardware(str(out)).device.gemm_profile().rows == 27
        assert "step time" in text.out and "peak memory" in text.out
