"""Real-GPU measurements (issue 26): the kernel sweep of ``hardware calibrate --gpu`` and
the reference PyTorch GPT step of ``bench gpu-step``. Their whole path runs on the CPU at
tiny sizes here; on a machine with CUDA the GPU commands run too (never skipped there),
and without CUDA they exit 2 naming it."""

import dataclasses
import json
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
    tied = measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, steps=2, warmup=1, device="cpu",
                            tie_embeddings=True)
    assert tied.parameters == m.parameters - 64 * 32 == sum(
        math.prod(s) for s in GPT(dataclasses.replace(cfg, tie_embeddings=True))
        .param_shapes().values())
    assert tied.losses[-1] < tied.losses[0]
    with pytest.raises(ValueError, match="tie_embeddings must be True or False, got .yes."):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, device="cpu", tie_embeddings="yes")
    with pytest.raises(ValueError, match="hidden=30 is not divisible by heads=4"):
        measure_gpt_step(30, 2, 4, 16, 64, micro_batch=2, device="cpu")
    with pytest.raises(ValueError, match="micro_batch must be an int >= 1, got 0"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=0, device="cpu")


def test_reference_llama_is_the_emulators_and_its_checkpointing_is_torchtitans():
    """The torch Llama has exactly pipeline_parallel's Llama parameters; its three
    checkpointing modes train to the same losses (a policy changes what is kept, never a
    number); ``op`` re-runs 3 of a block's 7 matmuls (torchtitan's every second one: W_k,
    W_o, W_up), counted by the FLOPs that reach the kernels in one step."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from pipeline_parallel.llama import llama_param_shapes
    from vcluster.gpu.llama_model import llama_model
    cfg = GPTConfig(hidden=32, layers=2, heads=4, seq=16, vocab=64, arch="llama", kv_heads=2,
                    ffn_hidden=48)
    runs = {ac: measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, steps=3, warmup=1,
                                 device="cpu", arch="llama", kv_heads=2, ffn_hidden=48,
                                 recompute=ac) for ac in ("none", "op", "full")}
    for ac, m in runs.items():
        assert m.parameters == sum(math.prod(s) for s in llama_param_shapes(cfg).values())
        assert (m.arch, m.recompute) == ("llama", ac) and m.losses[-1] < m.losses[0]
        assert m.losses == runs["none"].losses, ac
    flops = {}
    for ac in ("none", "op", "full"):
        torch.manual_seed(0)
        model = llama_model(torch, 32, 2, 4, 2, 48, 16, 64, ac)
        tokens = torch.randint(0, 64, (2, 16))
        with FlopCounterMode(display=False) as counted:     # what reaches the kernels
            model(tokens, tokens).backward()
        flops[ac] = counted.get_total_flops()
    b, s, h, kv, f = 2, 16, 32, 2 * 8, 48                 # kv: the K (or V) width c·d
    assert flops["op"] - flops["none"] == 2 * 2 * b * s * (h * kv + h * h + h * f)
    # torch's non-reentrant checkpoint stops once the backward has what it needs: "full"
    # re-runs every product but W_down's
    assert flops["full"] - flops["none"] == 2 * 2 * b * s * (h * (h + 2 * kv) + h * h
                                                             + 2 * h * f)
    with pytest.raises(ValueError, match="ffn_hidden must be an int >= 1 with arch='llama'"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, device="cpu", arch="llama")
    with pytest.raises(ValueError, match="kv_heads must be an int >= 1 dividing heads=4"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, device="cpu", arch="llama",
                         kv_heads=3, ffn_hidden=48)
    with pytest.raises(ValueError, match=r"recompute='op' is the Llama's"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, device="cpu", recompute="op")
    with pytest.raises(ValueError, match="recompute must be one of"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, device="cpu", arch="llama",
                         ffn_hidden=48, recompute="selective")
    with pytest.raises(ValueError, match="flash must be False, or True on device 'cuda'"):
        measure_gpt_step(32, 2, 4, 16, 64, micro_batch=2, device="cpu", flash=True)


def test_the_sequence_sweep_runs_its_whole_path_on_the_cpu(tmp_path):
    """benchmarks/gpu_llama_sweep.py --quick: every configuration of the GPU sweep at tiny
    sizes on the CPU, one JSON line each, losses equal across checkpointing modes."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                        "gpu_llama_sweep.py")
    spec = importlib.util.spec_from_file_location("gpu_llama_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.jsonl"
    assert sweep.main(["--out", str(out), "--quick"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(sweep.STEPS) and all("error" not in r for r in rows)
    by = {(r["layers"], r["seq"], r["recompute"]): r["losses"] for r in rows
          if not r["compiled"]}
    assert by[(4, 32, "op")] == by[(4, 32, "full")] == by[(4, 32, "none")]


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
    profile prices a traced kernel of each kind by the line through its rows (no table
    read, no analytic fallback) — or, where the CPU's noise made a larger size run faster,
    names the kind as unfitted in its source (on a GPU every kind fits: the GPU test)."""
    import re

    from vcluster.runtime.tracing.kernel import Kernel
    from vcluster.timing.kernel_profile import TABLE_OPS
    from vcluster.timing.kernel_profiles import PROFILE_UNITS, LinearProfile, profile_points
    sweep = sweep_kernels("cpu", tiny=True)
    by_op = {}
    for k in sweep.kernels:
        if k.kind in TABLE_OPS:
            by_op.setdefault(k.kind, {})[k.dims] = k.seconds
    assert {op: len(rows) for op, rows in by_op.items()} == {op: 2 for op in TABLE_OPS}
    profile = load_hardware(calibrated_hardware(sweep, "h100-dgx")).device.kernel_profile()
    points = profile_points(by_op)
    named = re.search(r"no profile for ([\w, ]+):", profile.source)
    unfit = set(named.group(1).split(", ")) if named else set()
    assert set(profile.kinds) | unfit == set(PROFILE_UNITS) and not set(profile.kinds) & unfit
    for name, fitted in profile.kinds.items():
        assert fitted == LinearProfile.fit(points[name], PROFILE_UNITS[name], zero_call=True)
        if fitted.call_s > 0:          # the line through the two rows
            for x, t in points[name]:
                assert fitted.time_s(x) == pytest.approx(t)
    launch = [k.seconds for k in sweep.kernels if k.kind == "launch"][0]
    assert profile.launch_s == launch
    kernels = {"norm": (Kernel.norm(1024, 64), 1024 * 64),
               "attention": (Kernel.attention(4, 256, 256, 16), 4 * 256 * 256 * 16 * 2),
               "elementwise": (Kernel.elementwise(3 * 4096), 3 * 4096)}
    for name, (kernel, size) in kernels.items():
        if name in profile.kinds:
            assert profile.time_s(kernel) == max(profile.kinds[name].time_s(size), launch)


def test_sustained_gemm_row_is_recorded_not_priced():
    """The calibrated file says what share of its burst rate the sustained GEMM kept (the
    rows' own ratio), and prices are the same with the row or without it."""
    sweep = sweep_kernels("cpu", tiny=True)
    (row,) = sweep.of_kind("gemm_sustained")
    (burst,) = [k for k in sweep.of_kind("gemm") if (k.m, k.k, k.n) == (row.m, row.k, row.n)]
    doc = calibrated_hardware(sweep, "h100-dgx")
    assert (f"a GEMM {row.m}x{row.k}x{row.n} sustained for seconds ran at "
            f"{burst.seconds / row.seconds:.1%} of its burst rate") in doc["device"]["source"]
    from vcluster.runtime.tracing.kernel import Kernel
    from vcluster.timing.kernel_profiles import KernelProfile
    kernels = load_hardware(doc).device.kernels
    with_row = KernelProfile.from_timings(kernels)
    without = KernelProfile.from_timings([k for k in kernels if k.kind != "gemm_sustained"])
    for kernel in (Kernel.gemm(1, 256, 128, 256), Kernel.attention(2, 128, 128, 16)):
        assert with_row.time_s(kernel) == without.time_s(kernel)


def test_in_stream_rows_with_a_negative_fixed_cost_fit_a_pure_rate():
    from vcluster.timing.kernel_profiles import KernelProfile
    rows = [KernelTiming("layernorm_fwd", 1.0e-6, dims="100x10"),
            KernelTiming("layernorm_fwd", 2.2e-5, dims="2000x10")]     # a < 0 by least squares
    norm = KernelProfile.from_timings(rows).kinds["norm"]
    assert norm.call_s == 0.0 and norm.unit_s > 0
    with pytest.raises(ValueError, match="unphysical fit"):
        from vcluster.timing.kernel_profiles import LinearProfile
        LinearProfile.fit([(1000, 1.0e-6), (20000, 2.2e-5)])
    # rows that fall with size (noise) give that kind no profile, and the source says so
    noisy = [KernelTiming("layernorm_fwd", 2e-5, dims="64x32"),
             KernelTiming("layernorm_fwd", 1e-5, dims="1024x256"),
             KernelTiming("add", 1e-6, dims="64x32"), KernelTiming("add", 1e-5, dims="1024x256")]
    profile = KernelProfile.from_timings(noisy, "sweep")
    assert sorted(profile.kinds) == ["elementwise"]
    assert profile.source == "sweep (no profile for norm: its rows cannot be fitted)"
    # a backward no slower than its forward leaves too few rows: named too
    flat = [KernelTiming("layernorm_fwd", 1e-5, dims="64x32"),
            KernelTiming("layernorm_fwd", 4e-5, dims="1024x256"),
            KernelTiming("layernorm_fwd_bwd", 0.9e-5, dims="64x32"),
            KernelTiming("layernorm_fwd_bwd", 9e-5, dims="1024x256")]
    profile = KernelProfile.from_timings(flat, "sweep")
    assert sorted(profile.kinds) == ["norm"]
    assert profile.source == "sweep (no profile for norm_backward: its rows cannot be fitted)"


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
    # --force: on a loaded machine the plausibility check may refuse the sweep (exit 1);
    # this test is about the file simulate reads (tests/timing/test_calibrate_checks.py
    # tests the check)
    assert main(["hardware", "calibrate", "--gpu", "--device", "cpu", "--tiny", "--force",
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
    (["bench", "gpu-step", "--hidden", "64", "--layers", "2", "--heads", "4", "--seq", "64",
      "--vocab", "128", "--micro-batch", "2", "--recompute", "op"],
     "--kv-heads, --ffn-hidden and --recompute are the Llama's: add --arch llama"),
    (["bench", "gpu-step", "--arch", "llama", "--hidden", "64", "--layers", "2", "--heads",
      "4", "--seq", "64", "--vocab", "128", "--micro-batch", "2"],
     "--arch llama needs --ffn-hidden"),
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
    compiled = main(["bench", "gpu-step", "--hidden", "64", "--layers", "2", "--heads", "4",
                     "--seq", "64", "--vocab", "128", "--micro-batch", "2", "--steps", "2",
                     "--compile", "--json", str(tmp_path / "compiled.json")])
    llama = main(["bench", "gpu-step", "--arch", "llama", "--hidden", "64", "--layers", "2",
                  "--heads", "4", "--kv-heads", "2", "--ffn-hidden", "96", "--seq", "64",
                  "--vocab", "128", "--micro-batch", "2", "--steps", "2", "--recompute", "op",
                  "--flash", "--json", str(tmp_path / "llama.json")])
    text = capsys.readouterr()
    if cuda_missing():
        assert (calibrate, step, compiled, llama) == (2, 2, 2, 2)
        assert "calibrate --gpu needs CUDA" in text.err and "gpu-step needs a CUDA GPU" in text.err
        assert not out.exists()
    else:
        assert (calibrate, step, compiled) == (0, 0, 0), text.err
        assert json.loads((tmp_path / "step.json").read_text())["precision"] == "torch_amp"
        assert json.loads((tmp_path / "compiled.json").read_text())["precision"] == \
            "torch_compile"     # the compiled step's own policy by default
        assert llama == 0, text.err
        got = json.loads((tmp_path / "llama.json").read_text())
        assert (got["recompute"], got["attention"], got["model"]["kv_heads"]) == (
            "op", "flash2", 2)
        device = load_hardware(str(out)).device
        assert device.gemm_profile().rows == 27
        assert sum(k.kind == "gemm_sustained" for k in device.kernels) == 1
        assert len(device.kernel_profile().kinds) == 8         # every kind of the table
        assert "step time" in text.out and "peak memory" in text.out
