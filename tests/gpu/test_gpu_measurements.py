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
    assert len(kinds) == 39 and kinds.count("gemm_sustained") == 1
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


def test_the_sweep_measures_every_table_kernel_and_the_replay_prices_them():
    """The tiny sweep times each kind of the measured table twice; the calibrated file's
    profile prices a traced kernel of each kind from those rows, by the kind's fitted line
    (no table was read, no analytic fallback)."""
    from vcluster.runtime.tracing.kernel import Kernel
    from vcluster.timing.kernel_profile import TABLE_OPS
    from vcluster.timing.kernel_profiles import LinearProfile, profile_points
    sweep = sweep_kernels("cpu", tiny=True)
    by_op = {}
    for k in sweep.kernels:
        if k.kind in TABLE_OPS:
            by_op.setdefault(k.kind, {})[k.dims] = k.seconds
    assert {op: len(rows) for op, rows in by_op.items()} == {op: 2 for op in TABLE_OPS}
    profile = load_hardware(calibrated_hardware(sweep, "h100-dgx")).device.kernel_profile()
    points = profile_points(by_op)
    assert set(profile.kinds) == set(points) == {
        "attention", "attention_backward", "norm", "norm_backward", "activation",
        "elementwise", "cross_entropy", "optimizer"}
    # the norm profile is the line through its two rows (a negative fixed cost becomes 0)
    (x0, t0), (x1, t1) = sorted(points["norm"])
    expected = LinearProfile.fit([(x0, t0), (x1, t1)], zero_call=True)
    assert profile.kinds["norm"] == LinearProfile(expected.call_s, expected.unit_s,
                                                  "element", 2)
    if expected.call_s > 0:
        assert expected.time_s(x0) == pytest.approx(t0) and expected.time_s(x1) == pytest.approx(t1)
    launch = [k.seconds for k in sweep.kernels if k.kind == "launch"][0]
    assert profile.launch_s == launch
    norm = Kernel.norm(1024, 64)
    assert profile.time_s(norm) == max(expected.time_s(1024 * 64), launch)
    attention = Kernel.attention(4, 256, 256, 16)         # compute-bound: sustained rate
    assert 0 < profile.sustained_fraction <= 1
    assert profile.time_s(attention) == max(profile.kinds["attention"].time_s(
        4 * 256 * 256 * 16 * 2) / profile.sustained_fraction, launch)


def test_sustained_gemm_row_stretches_compute_bound_prices_only():
    """gemm_sustained at 1.25x its burst row's seconds: GEMM and attention prices / 0.8,
    the norm's and the launch floor unchanged; without the pair the fraction is 1."""
    from vcluster.runtime.tracing.kernel import Kernel
    from vcluster.timing.kernel_profiles import KernelProfile
    rows = [KernelTiming("gemm", 1e-5, m=128, k=128, n=128),
            KernelTiming("gemm", 1e-3, m=4096, k=4096, n=4096),
            KernelTiming("gemm_sustained", 1.25e-3, m=4096, k=4096, n=4096),
            KernelTiming("attn_fwd", 2e-5, dims="1x4x256x64"),
            KernelTiming("attn_fwd", 1e-4, dims="4x4x512x64"),
            KernelTiming("layernorm_fwd", 1e-5, dims="1024x256"),
            KernelTiming("layernorm_fwd", 4e-5, dims="8192x256")]
    sustained = KernelProfile.from_timings(rows)
    burst = KernelProfile.from_timings([r for r in rows if r.kind != "gemm_sustained"])
    assert sustained.sustained_fraction == pytest.approx(0.8) and burst.sustained_fraction == 1.0
    for kernel in (Kernel.gemm(1, 2048, 4096, 1024), Kernel.attention(8, 1024, 1024, 64)):
        assert sustained.time_s(kernel) == pytest.approx(burst.time_s(kernel) / 0.8)
    norm = Kernel.norm(4096, 256)
    assert sustained.time_s(norm) == burst.time_s(norm)
    with pytest.raises(ValueError, match=r"sustained_fraction must be in \(0, 1\]"):
        KernelProfile(sustained_fraction=1.5)


def test_in_stream_rows_with_a_negative_fixed_cost_fit_a_pure_rate():
    from vcluster.timing.kernel_profiles import KernelProfile
    rows = [KernelTiming("layernorm_fwd", 1.0e-6, dims="100x10"),
            KernelTiming("layernorm_fwd", 2.2e-5, dims="2000x10")]     # a < 0 by least squares
    norm = KernelProfile.from_timings(rows).kinds["norm"]
    assert norm.call_s == 0.0 and norm.unit_s > 0
    with pytest.raises(ValueError, match="unphysical fit"):
        from vcluster.timing.kernel_profiles import LinearProfile
        LinearProfile.fit([(1000, 1.0e-6), (20000, 2.2e-5)])


def test_kernel_rows_are_checked():
    with pytest.raises(ValueError, match=r"device.kernels\[1\]: kind must be one of"):
        load_hardware({"base": "h100-dgx", "device": {"kernels": [
            {"kind": "gemm", "m": 8, "k": 8, "n": 8, "seconds": 1e-5}, {"kind": "fft", "seconds": 1}]}})
    with pytest.raises(ValueError, match="seconds must be a number > 0"):
        KernelTiming("launch", 0.0)
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        KernelTiming("gemm", 1e-5, m=0, k=2, n=2)
    with pytest.raises(ValueError, match="a attn_fwd kernel's dims are 4 integers >= 1"):
        KernelTiming("attn_fwd", 1e-5, dims="4x16x2048")
    with pytest.raises(ValueError, match="dims is for the kinds"):
        KernelTiming("launch", 1e-5, dims="8")


def test_calibrate_on_the_cpu_writes_hardware_that_simulate_accepts(tmp_path, capsys):
    out = tmp_path / "cpu.yaml"
    assert main(["hardware", "calibrate", "--gpu", "--device", "cpu", "--tiny",
                 "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["base"] == "h100-dgx" and len(doc["device"]["kernels"]) == 39
    assert main(["simulate", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--seq", "32", "--vocab", "100", "--global-batch", "2",
                 "--hardware", str(out)]) == 0
    assert main(["hardware", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert ("kernels: 39 measured (18 gemm, 1 gemm_sustained, 3 elementwise, 2 attn_fwd, 2 attn_fwd_bwd, "
            "2 layernorm_fwd, 2 layernorm_fwd_bwd, 2 gelu_fwd, 2 add, 2 cross_entropy_fwd_bwd, "
            "2 adamw_fused_step, 1 launch)") in shown
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
