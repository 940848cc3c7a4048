"""``vcluster hardware calibrate``'s checks (issue 56): the install hint without torch, a
calibrated file reported under its own name, and figures no quiet machine produces
(:mod:`vcluster.gpu.plausibility`, :mod:`vcluster.localhost.plausibility`), checked on
synthetic sweeps and specs whose expected verdicts follow from the bounds by hand.
(``--out`` checked before measuring: tests/timing/test_timing_hardware.py.)"""

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.localhost_specs import spec as localhost_spec
from vcluster.cli.main import main
from vcluster.gpu.calibration import calibrated_hardware, check_name, default_name
from vcluster.gpu.kernel_sweep import (GPU_COPY_BYTES, GPU_GEMM_DIMS, TINY_COPY_BYTES,
                                       TINY_GEMM_DIMS, TORCH_INSTALL_HINT, KernelSweep,
                                       sweep_kernels)
from vcluster.gpu.plausibility import (CALL_CEILING_S, GEMM_FLOOR_FLOPS_PER_S,
                                       INVERSION_RATIO, sweep_problems)
from vcluster.localhost import plausibility as localhost_plausibility
from vcluster.timing import PRESET_NAMES, load_hardware
from vcluster.timing.kernel_profile import KernelTiming

ROOT = Path(__file__).parents[2]
DATE = datetime.date(2026, 1, 2)
# A quiet device's figures: the CPU's measured here (98 GFLOP/s, 1.5 us per call, copies
# at ~20 GB/s), the GPU's an H100's (docs/timing.md: 789 TFLOP/s + 4.3 us, 3.73 TB/s)
QUIET = {"cpu": dict(name="CPU (x86_64)", rate=98e9, call_s=1.5e-6, copy_bps=20e9,
                     dims=TINY_GEMM_DIMS, copies=TINY_COPY_BYTES, dtype="fp32"),
         "cuda": dict(name="NVIDIA H100 80GB HBM3", rate=789e12, call_s=4.3e-6,
                      copy_bps=3.73e12, dims=GPU_GEMM_DIMS, copies=GPU_COPY_BYTES,
                      dtype="bf16")}


def _gemm_s(device: str, m: int, k: int, n: int) -> float:
    q = QUIET[device]
    return q["call_s"] + 2 * m * k * n / q["rate"]


def quiet_sweep(device: str, **seconds) -> KernelSweep:
    """A sweep as a quiet ``device`` measures it; ``seconds``: rows replaced, keyed
    ``gemm_MxKxN``, ``copy_BYTES`` (bytes copied, read + written) or ``launch``."""
    q = QUIET[device]
    rows = [KernelTiming("gemm", seconds.pop(f"gemm_{m}x{k}x{n}", _gemm_s(device, m, k, n)),
                         m=m, k=k, n=n, dtype=q["dtype"])
            for m in q["dims"]["m"] for k in q["dims"]["k"] for n in q["dims"]["n"]]
    rows += [KernelTiming("elementwise", seconds.pop(f"copy_{2 * b}",
                                                     q["call_s"] + 2 * b / q["copy_bps"]),
                          bytes=2 * b, dtype="uint8") for b in q["copies"]]
    rows.append(KernelTiming("launch", seconds.pop("launch", q["call_s"]), dtype="fp32"))
    assert not seconds, f"no such rows: {seconds}"
    return KernelSweep(q["name"], "2.13.0", device, q["dtype"], tuple(rows))


# ------------------------------------------------------------------ plausibility: sweeps
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_quiet_sweep_is_plausible(device):
    assert sweep_problems(quiet_sweep(device)) == ()


def test_the_issue_56_stall_is_named_with_the_bound_it_broke():
    """The busy CPU of issue 56: 16 ms for a tiny GEMM. It breaks the per-call bound
    (1 ms + 2*16*32*16 FLOP at 1 GFLOP/s = 1016.4 us) and the order (7.4e3x the time of
    16x32x64, which a quiet CPU runs in 1.5 us + 65536 FLOP / 98 GFLOP/s = 2.17 us)."""
    problems = sweep_problems(quiet_sweep("cpu", gemm_16x32x16=16e-3))
    assert len(problems) == 2
    slow, order = problems
    assert slow == ("GEMM 16x32x16 fp32 took 1.6e+04 us per call (0.00102 GFLOP/s); a quiet cpu "
                    "takes at most 1016 us (< 1000 us per call, >= 1 GFLOP/s)")
    ratio = 16e-3 / _gemm_s("cpu", 16, 32, 64)
    assert order.startswith(f"GEMM 16x32x16 fp32 took 1.6e+04 us per call, {ratio:.3g}x the "
                            "2.169 us of the larger GEMM 16x32x64 fp32")


@pytest.mark.parametrize("device, m, k, n", [("cpu", 256, 128, 256), ("cpu", 16, 32, 16),
                                             ("cuda", 8192, 16384, 8192),
                                             ("cuda", 512, 1024, 1024)])
def test_a_gemm_is_too_slow_just_past_its_bound(device, m, k, n):
    """The bound of each GEMM: CALL_CEILING_S + 2mkn / GEMM_FLOOR_FLOPS_PER_S. Every row
    slowed to the same factor, so no row is out of order and only the bound decides."""
    bound = CALL_CEILING_S[device] + 2 * m * k * n / GEMM_FLOOR_FLOPS_PER_S[device]
    q = QUIET[device]
    for factor, expected in ((0.99, 0), (1.01, 1)):
        # every GEMM as slow as its share of this one's time: the order is kept
        scale = factor * bound / _gemm_s(device, m, k, n)
        rows = {f"gemm_{a}x{b}x{c}": scale * _gemm_s(device, a, b, c)
                for a in q["dims"]["m"] for b in q["dims"]["k"] for c in q["dims"]["n"]}
        named = [p for p in sweep_problems(quiet_sweep(device, **rows))
                 if p.startswith(f"GEMM {m}x{k}x{n} ")]
        assert len(named) == expected, named


def test_a_kernel_out_of_order_is_named_past_the_ratio():
    """16x32x16's larger neighbour that a quiet CPU runs fastest is 16x32x64 (2.17 us): the
    row is named past INVERSION_RATIO times that, not below it; copies likewise."""
    fastest_larger = _gemm_s("cpu", 16, 32, 64)
    for factor, expected in ((0.99, ()), (1.01, ("16x32x16",))):
        sweep = quiet_sweep("cpu", gemm_16x32x16=factor * INVERSION_RATIO * fastest_larger)
        problems = sweep_problems(sweep)
        assert tuple(p.split()[1] for p in problems) == expected
        assert all("of the larger GEMM 16x32x64 fp32 (on a quiet machine at most 3x)" in p
                   for p in problems)
    small, large = 2 * TINY_COPY_BYTES[0], 2 * TINY_COPY_BYTES[1]
    large_s = QUIET["cpu"]["call_s"] + large / QUIET["cpu"]["copy_bps"]
    (problem,) = sweep_problems(quiet_sweep("cpu", **{f"copy_{small}": 4 * large_s}))
    assert problem.startswith(f"copy of {small} B took") and f"larger copy of {large} B" in problem


def test_a_slow_launch_is_named():
    (problem,) = sweep_problems(quiet_sweep("cuda", launch=2e-3))
    assert problem == ("the launch interval was 2000 us; a quiet cuda launches a kernel in "
                       "< 1000 us")


# ------------------------------------------------------------------ plausibility: localhost
def test_localhost_figures_past_their_bounds_are_named():
    floor = localhost_plausibility.GEMM_FLOOR_FLOPS_PER_S
    ceiling = localhost_plausibility.HOST_WORK_CEILING_S
    assert localhost_plausibility.spec_problems(localhost_spec()) == ()
    at_bounds = localhost_spec(gemm_float32_flops_per_s=floor, compute_overhead_s=ceiling,
                               numpy_call_s=ceiling)
    assert localhost_plausibility.spec_problems(at_bounds) == ()
    busy = localhost_spec(compute_overhead_s=16e-3, gemm_float64_flops_per_s=0.99 * floor)
    assert localhost_plausibility.spec_problems(busy) == (
        "gemm_float64_flops_per_s = 0.99 GFLOP/s (a 1024x1024 product on one thread); a "
        "quiet CPU core does at least 1 GFLOP/s",
        "compute_overhead_s = 1.6e+04 us per op; a quiet machine takes at most 1000 us (a "
        "few us here)")


# ------------------------------------------------------------------ the file's own name
def test_a_calibrated_file_has_its_own_name_and_its_base(tmp_path, capsys):
    """Shown, simulated and in JSON under the file's name (``<device>-calibrated-<date>``),
    never the base preset's; the base is in ``base`` and the source."""
    doc = calibrated_hardware(quiet_sweep("cuda"), "h100-dgx", date=DATE)
    name = "nvidia-h100-80gb-hbm3-calibrated-2026-01-02"
    assert (doc["name"], doc["base"]) == (name, "h100-dgx")
    assert "node, links and network of base h100-dgx" in doc["source"]
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_hardware(str(path)).name == name
    assert main(["hardware", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"name: {name}\n") and "base h100-dgx" in shown
    report = tmp_path / "sim.json"
    assert main(["simulate", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--seq", "32", "--vocab", "100", "--global-batch", "2",
                 "--hardware", str(path), "--json", str(report)]) == 0
    assert f" on 1 x {name}: " in capsys.readouterr().out
    assert json.loads(report.read_text())["hardware"] == name
    own = calibrated_hardware(quiet_sweep("cuda"), "h100-dgx", name="lab-h100", date=DATE)
    assert load_hardware(own).name == "lab-h100"


@pytest.mark.parametrize("device_name, expected", [
    ("NVIDIA H200", "nvidia-h200-calibrated-2026-01-02"),
    ("CPU (x86_64)", "cpu-x86_64-calibrated-2026-01-02"),
    ("  ", "device-calibrated-2026-01-02")])
def test_default_name(device_name, expected):
    assert default_name(device_name, DATE) == expected


def test_a_preset_name_or_no_name_is_refused_before_measuring(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"name = 'h100-dgx' is a preset's name; a calibrated "
                                         r"file needs its own \(the presets: a100-40gb-dgx"):
        check_name("h100-dgx")
    with pytest.raises(ValueError, match=r"--name must be a non-empty name on one line, got ''"):
        check_name("", "--name")
    for preset in PRESET_NAMES:
        t0 = time.perf_counter()
        assert main(["hardware", "calibrate", "--gpu", "--device", "cpu", "--tiny", "--name",
                     preset, "--out", str(tmp_path / "x.yaml")]) == 2
        assert time.perf_counter() - t0 < 2.0
        err = capsys.readouterr().err
        assert f"--name = {preset!r} is a preset's name" in err and "timing" not in err
    for flag, value in (("--name", "mine"), ("--repeats", "3")):
        assert main(["hardware", "calibrate", flag, value]) == 2
        assert f"{flag} calibrates a GPU: add --gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hardware", "calibrate", "--gpu", "--repeats", "0", "--out", "x.yaml"])
    assert "--repeats: expected an integer >= 1 (timed streams per kernel)" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=r"repeats must be an int >= 1 \(timed streams per "
                                         r"kernel\), got 0"):
        sweep_kernels("cpu", tiny=True, repeats=0)


@pytest.mark.timeout(300)
def test_cli_writes_the_cpu_sweep_under_its_name(tmp_path, capsys):
    """The real CPU sweep (tiny sizes, each kernel the fastest of 2 streams) written under
    ``--name``; ``--force`` so that a busy machine's figures are saved too (warned)."""
    out = tmp_path / "cpu.yaml"
    assert main(["hardware", "calibrate", "--gpu", "--device", "cpu", "--tiny", "--repeats",
                 "2", "--name", "my-cpu", "--force", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "my-cpu (CPU" in captured.out and "not saved" not in captured.err
    doc = yaml.safe_load(out.read_text())
    assert (doc["name"], doc["base"]) == ("my-cpu", "h100-dgx")
    assert "each the fastest of 2 streams" in doc["device"]["source"]
    assert out.read_text().startswith("# my-cpu: calibrated by vcluster hardware calibrate")
    assert main(["hardware", "show", str(out)]) == 0
    assert capsys.readouterr().out.startswith("name: my-cpu\n")


# ------------------------------------------------------------------ without torch
@pytest.mark.parametrize("argv", [["--gpu", "--device", "cpu", "--tiny"], ["--gpu"]])
def test_calibrate_without_torch_prints_the_install_hint(tmp_path, argv):
    """A Python where ``import torch`` fails (a torch.py first on the path raising
    ModuleNotFoundError, as a missing package does): one line naming the extra and the CPU
    wheel, exit 2, no traceback, nothing written."""
    fake = tmp_path / "no-torch"
    fake.mkdir()
    (fake / "torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(fake), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr
    out = tmp_path / "x.yaml"
    done = subprocess.run([sys.executable, "-m", "vcluster", "hardware", "calibrate", *argv,
                           "--out", str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"vcluster hardware calibrate --gpu: {TORCH_INSTALL_HINT}\n"
    assert "pip install -e '.[torch]'" in TORCH_INSTALL_HINT
    assert "--index-url https://download.pytorch.org/whl/cpu" in TORCH_INSTALL_HINT
    assert not out.exists() and done.stdout == ""
