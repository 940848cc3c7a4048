"""Fused attention priced from published kernel measurements (vcluster.timing.
attention_kernels, data/attention_benchmarks.csv): every profiled GPU prices a causal kernel
inside its measured band, its time grows with the sequence as the measured kernels' does
(no flat rate), the derived curves keep the published totals, and runs name a kernel
(``ParallelConfig.attention``: flash2, flash3, cudnn) or take the device's default."""

import math
import statistics

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.cli.hardware_cmd import format_hardware
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import Kernel, TraceCompute
from vcluster.timing import read_data_csv
from vcluster.timing.attention_kernels import (ATTENTION_TABLE, EXP_PER_S, NAMED_KERNELS,
                                               attention_gpus, attention_prices,
                                               head_dim_check, kernels_of, named_kernel,
                                               scaled_head_dim_rate)
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.presets import PRESET_NAMES, hardware_from_dict, preset

#: the presets whose devices read published curves, and their default kernel
CURVED = [n for n in PRESET_NAMES if preset(n).device.attention_gpu]
FWD_BWD = 3.5


def _published(gpu, kernel):
    """{(direction, causal, head_dim): {seq: [tflops, ...]}} of the table's full-attention
    rows (no sliding window)."""
    out: dict = {}
    for r in read_data_csv(ATTENTION_TABLE)[1]:
        if r["gpu"] == gpu and r["kernel"] == kernel and not r["window"]:
            key = (r["direction"], r["causal"] == "1", int(r["head_dim"]))
            out.setdefault(key, {}).setdefault(int(r["seq"]), []).append(float(r["tflops"]))
    return out


def _op(seq, head_dim=128, causal=True, backward=False, heads=16, batch=1, s_q=None):
    s_q = seq if s_q is None else s_q
    k = Kernel.attention(batch * heads, s_q, seq, head_dim, causal=causal, backward=backward)
    flops = 4.0 * batch * heads * s_q * seq * head_dim * (0.5 if causal else 1.0)
    return TraceCompute("gpt: attention: core", flops * (2.5 if backward else 1.0), 0.0,
                        kernel=k)


def test_the_presets_with_curves_are_the_profiled_gpus():
    assert {preset(n).device.attention_gpu for n in CURVED} == set(attention_gpus())
    assert {"h100-dgx", "h200-dgx", "b200-dgx", "a100-80gb-dgx"} <= set(CURVED)
    for name in CURVED:
        device = preset(name).device
        assert device.attention_kernel in kernels_of(device.attention_gpu)


@pytest.mark.parametrize("name", CURVED)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_a_causal_kernels_priced_rate_stays_in_the_measured_band(name, backward):
    """The acceptance test: on every profiled GPU the default kernel's causal attention,
    priced through the hardware model at each published sequence, runs at the published
    rate (the median of the sources at that point; a derived curve within the band its
    sources span), between published sequences inside the band of its two neighbours,
    and its time grows with the sequence as the measured kernels' does."""
    hw = preset(name)
    device = hw.device
    costs = HardwareCostModel(hw)
    t_k = device.kernel_overhead_us * 1e-6
    prices = attention_prices(device.attention_gpu, device.attention_kernel)
    direction = "bwd" if backward else "fwd"
    curve = prices.curve(direction, True, 128)
    seqs = [s for s, _ in curve.points]

    def rate(seq):
        op = _op(seq, backward=backward)
        return op.flops / (costs.compute_time_s(op) - t_k) / 1e12

    for s, published in curve.points:
        assert rate(s) == pytest.approx(published, rel=1e-9)
    for (s0, r0), (s1, r1) in zip(curve.points, curve.points[1:]):
        mid = round(math.sqrt(s0 * s1))
        assert min(r0, r1) - 1e-9 <= rate(mid) <= max(r0, r1) + 1e-9
    # no flat rate: time grows with the sequence as the curve's rates say, and faster
    # than the FLOPs alone where the rate rises (short sequences)
    times = [costs.compute_time_s(_op(s, backward=backward)) - t_k for s in seqs]
    for (s0, t0), (s1, t1), (_, r0), (_, r1) in zip(zip(seqs, times), zip(seqs[1:], times[1:]),
                                                    curve.points, curve.points[1:]):
        assert t1 / t0 == pytest.approx((s1 / s0) ** 2 * r0 / r1, rel=1e-9)
    assert len({round(r) for _, r in curve.points}) > 2          # not one flat rate
    if not curve.derived:
        published = _published(device.attention_gpu, device.attention_kernel)
        assert curve.points == tuple(sorted(
            (s, sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1:
                                                                       len(v) // 2 + 1]) / 2)
            for s, v in published[(direction, True, 128)].items()))


def test_the_h200_flash2_price_meets_this_projects_own_measurement():
    """Independent of the published table: FlashAttention-2 (PyTorch's SDPA flash backend)
    measured alone on one H200 by ``benchmarks/gpu_llama_sweep.py`` (causal, 32 heads of
    128, batch 1; benchmarks/results/h200-2026-11-30/attention-flash2.jsonl). Priced through
    the H200 preset with ``flash2``, forward and backward are within 10% of it from 8K
    tokens, the lengths long-context training runs at (below, a single 32-head sequence
    fills the GPU worse than the published batches: 21% slower at 4K), and the priced time
    grows with the sequence as the measured one does (within 10%, 8K to 64K)."""
    import json
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results",
                        "h200-2026-11-30", "attention-flash2.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    costs = HardwareCostModel(preset("h200-dgx"), attention_kernel="flash2")
    t_k = preset("h200-dgx").device.kernel_overhead_us * 1e-6
    long = [r for r in rows if r["seq"] >= 8192]
    assert len(long) == 4 and all(r["device"] == "NVIDIA H200" for r in rows)
    for r in long:
        forward_s = r["forward"] / 1e3
        backward_s = (r["forward_backward"] - r["forward"]) / 1e3
        for backward, measured in ((False, forward_s), (True, backward_s)):
            op = _op(r["seq"], heads=32, backward=backward)
            assert costs.compute_time_s(op) - t_k == pytest.approx(measured, rel=0.10), \
                (r["seq"], backward)
    growth = [r["forward_backward"] / long[0]["forward_backward"] for r in long]
    priced = [sum(costs.compute_time_s(_op(r["seq"], heads=32, backward=b)) for b in (0, 1))
              for r in long]
    assert [p / priced[0] for p in priced] == pytest.approx(growth, rel=0.10)


def test_derived_backward_keeps_the_published_forward_plus_backward():
    """Rule 1: FlashAttention-2's causal backward on H100 is its fwd_bwd time less its
    forward time, so forward + backward take exactly the published fwd_bwd time."""
    prices = attention_prices("h100-sxm", "flash2")
    published = _published("h100-sxm", "flash2")
    fb = {s: v[0] for s, v in published[("fwd_bwd", True, 128)].items()}
    f = {s: v[0] for s, v in published[("fwd", True, 128)].items()}
    bwd = prices.curve("bwd", True, 128)
    assert bwd.derived.startswith("backward from fwd_bwd")
    for s in set(fb) & set(f):
        F = 1.0
        assert F / f[s] + 2.5 * F / bwd.tflops(s) == pytest.approx(FWD_BWD * F / fb[s])


def test_the_causal_backward_follows_the_forwards_mask_ratio_where_unpublished():
    """Rule 3: FlashAttention-3 publishes no causal backward; its curve is the non-causal
    backward times the forward's causal / non-causal rate."""
    prices = attention_prices("h100-sxm", "flash3")
    c, nc = prices.curve("bwd", True, 128), prices.curve("bwd", False, 128)
    fc, fnc = prices.curve("fwd", True, 128), prices.curve("fwd", False, 128)
    assert "mask ratio" in c.derived and not nc.derived
    for s, _ in nc.points:
        assert c.tflops(s) == pytest.approx(nc.tflops(s) * fc.tflops(s) / fnc.tflops(s))


def test_blocks_and_windows_are_read_at_their_own_length():
    """A context-parallel block (s_q != s_kv) is the smaller kernel it is: read at
    √(s_q·s_kv); a sliding window at the window; past the published range the rate holds."""
    prices = attention_prices("h200", "cudnn")
    fwd = prices.curve("fwd", False, 128)
    block = Kernel.attention(16, 4096, 16384, 128, causal=False)
    assert prices.rate_tflops(block) == pytest.approx(fwd.tflops(8192))
    windowed = Kernel.attention(16, 65536, 65536, 128, window=4096)
    assert prices.rate_tflops(windowed) == pytest.approx(
        prices.curve("fwd", True, 128).tflops(4096))
    last_s, last_r = fwd.points[-1]
    assert fwd.tflops(4 * last_s) == last_r and fwd.tflops(64) == fwd.points[0][1]


@pytest.mark.parametrize("attention", NAMED_KERNELS)
def test_a_run_names_its_kernel(attention):
    """ParallelConfig.attention flash2, flash3 or cudnn prices the step's attention from
    that kernel's curves: on an H100 at 32K tokens FlashAttention-2 is the slowest and
    FlashAttention-3 the fastest (their published rates), and ``flash`` is the device's
    default (cuDNN: Transformer Engine's choice on Hopper)."""
    cfg = GPTConfig(hidden=2048, layers=2, heads=16, seq=32768, vocab=1024, arch="llama",
                    kv_heads=4, ffn_hidden=5632)
    step = {a: simulate_gpt(cfg, ParallelConfig(global_batch=1, attention=a), "h100-dgx")
            .step_time_s for a in ("flash", *NAMED_KERNELS)}
    assert step["flash2"] > step["cudnn"] > step["flash3"]
    assert step["flash"] == step["cudnn"]
    assert named_kernel(attention) == attention and named_kernel("flash") == ""


def test_a_power_limited_part_runs_the_borrowed_curves_at_its_own_clock():
    """A device whose ``sustained_compute_ratio`` is c reads its ``attention_gpu``'s curves
    (measured on the datasheet part) at c times their rate: each attention kernel's time
    beyond the launch overhead grows 1/c, forward and backward."""
    hw = preset("h100-dgx")
    capped = hardware_from_dict({"base": "h100-dgx", "device": {
        "sustained_compute_ratio": {"value": 0.6, "source": "a test's power limit"}}})
    t_k = hw.device.kernel_overhead_us * 1e-6
    for backward in (False, True):
        op = _op(8192, backward=backward)
        t0, t1 = (HardwareCostModel(h).compute_time_s(op) for h in (hw, capped))
        assert t1 - t_k == pytest.approx((t0 - t_k) / 0.6, rel=1e-12)


def test_clear_errors():
    with pytest.raises(ValueError, match=r"attention 'flash3' is priced from published "
                                         r"curves: mi300x .* has none"):
        HardwareCostModel(preset("mi300x"), attention_kernel="flash3")
    with pytest.raises(ValueError, match="attention_kernel='xformers': not a kernel with "
                                         "published curves; allowed: flash2, flash3, cudnn"):
        HardwareCostModel(preset("h100-dgx"), attention_kernel="xformers")
    with pytest.raises(ValueError, match="attention kernel 'flash3' on a100-80gb: no "
                                         "published curve; kernels with curves on "
                                         "a100-80gb: flash2"):
        HardwareCostModel(preset("a100-80gb-dgx"), attention_kernel="flash3")
    from vcluster.timing.presets import hardware_from_dict
    with pytest.raises(ValueError, match=r"attention_gpu: 'tpu-v5' has no published "
                                         r"attention curves; allowed: a100-80gb"):
        hardware_from_dict({"base": "h100-dgx", "device": {"attention_gpu": "tpu-v5"}})
    with pytest.raises(ValueError, match=r"attention_kernel: 'flash3' has no curves on "
                                         r"a100-80gb; allowed: flash2"):
        hardware_from_dict({"base": "a100-80gb-dgx", "device": {"attention_kernel": "flash3"}})


def test_a_measured_kernel_table_keeps_its_own_attention():
    """Hardware with measured kernels (a shipped kernel table) prices ``flash`` by its own
    attention profile, not by the curves; a named kernel still reads its curves."""
    from vcluster.timing.presets import hardware_from_dict
    hw = hardware_from_dict({"base": "h100-dgx", "device": {"kernel_table": "h100_kernels.csv"}})
    op = _op(8192)
    measured = HardwareCostModel(hw)
    assert measured.compute_time_s(op) == measured.kernel_profile.time_s(op.kernel)
    named = HardwareCostModel(hw, attention_kernel="flash2")
    assert named.compute_time_s(op) == pytest.approx(
        5e-6 + op.flops / (attention_prices("h100-sxm", "flash2").curve("fwd", True, 128)
                           .tflops(8192) * 1e12))


def test_blackwell_racks_read_their_own_published_curves():
    """GB200 and GB300 price fused attention from cudnn-frontend's runs on those GPUs
    (S9-S10), the DGX B300 from GB300's (the same Blackwell Ultra GPU); an MLA kernel
    (DeepSeek-V3: q·k over 192 dims, v over 128) reads the curve published for those head
    dims, written at their mean 160 as the traced program writes such a kernel, not
    Llama's 128. Blackwell Ultra's doubled exponent throughput is in the published
    forward: GB300 faster than GB200 at every published causal sequence, and priced so."""
    assert preset("gb200-nvl72").device.attention_gpu == "gb200"
    assert preset("gb300-nvl72").device.attention_gpu == "gb300"
    assert preset("b300-dgx").device.attention_gpu == "gb300"
    for gpu in ("gb200", "gb300"):
        published = _published(gpu, "cudnn")
        assert {d for _, _, d in published} == {128, 160}
        hw = preset(f"{gpu}-nvl72")
        costs, t_k = HardwareCostModel(hw), hw.device.kernel_overhead_us * 1e-6
        for head_dim in (128, 160):
            for (direction, causal, d), by_seq in published.items():
                if d != head_dim:
                    continue
                for seq, values in by_seq.items():
                    op = _op(seq, head_dim=head_dim, causal=causal,
                             backward=direction == "bwd", heads=128)
                    rate = op.flops / (costs.compute_time_s(op) - t_k) / 1e12
                    assert rate == pytest.approx(statistics.median(values), rel=1e-9)
        # the MLA curve is its own: 160's published rates differ from 128's
        assert published[("bwd", True, 160)] != published[("bwd", True, 128)]
    gb200, gb300 = (HardwareCostModel(preset(n)) for n in ("gb200-nvl72", "gb300-nvl72"))
    for seq in (2048, 4096, 8192, 16384, 32768):
        op = _op(seq)
        assert gb300.compute_time_s(op) < gb200.compute_time_s(op), seq


def test_a_device_reads_one_cudnn_release_where_it_names_one():
    """cuDNN's kernels change between releases (GB200's 8K causal forward: 9.19.1 and
    9.22.0 against B200's 9.13.1): ``attention_cudnn`` prices a device's cuDNN attention by
    that release's published rows alone — a GB200 at 9.19.1 at S9's figure exactly — and
    by default by the median of every release; an unpublished release, a release without
    curves, or a release for another kernel is refused naming what exists."""
    from vcluster.timing import hardware_from_dict
    from vcluster.timing.attention_kernels import cudnn_releases
    assert cudnn_releases("gb200") == ("9.19.1", "9.22.0")
    assert cudnn_releases("b200") == ("9.13.1",) and cudnn_releases("a100-80gb") == ()
    # `vcluster hardware show` names them
    assert ("# cuDNN releases with published curves on gb200 (attention_cudnn): 9.19.1, "
            "9.22.0") in format_hardware(preset("gb200-nvl72"))
    rows = [r for r in read_data_csv(ATTENTION_TABLE)[1] if r["gpu"] == "gb200"
            and r["kernel"] == "cudnn" and r["direction"] == "fwd" and r["causal"] == "1"
            and r["head_dim"] == "128" and r["seq"] == "8192"]
    by_release = {r["cudnn"]: float(r["tflops"]) for r in rows}
    assert set(by_release) == {"9.19.1", "9.22.0"}
    t_k = preset("gb200-nvl72").device.kernel_overhead_us * 1e-6
    op = _op(8192)

    def rate(hw):
        return op.flops / (HardwareCostModel(hw).compute_time_s(op) - t_k) / 1e12

    assert rate(preset("gb200-nvl72")) == pytest.approx(statistics.median(by_release.values()))
    for release, published in by_release.items():
        hw = hardware_from_dict({"base": "gb200-nvl72",
                                 "device": {"attention_cudnn": release}})
        assert rate(hw) == pytest.approx(published, rel=1e-9)
        # the same curve, read from the table directly
        assert attention_prices("gb200", "cudnn", release).curve("fwd", True, 128) \
            .tflops(8192) == pytest.approx(published)
    with pytest.raises(ValueError, match=r"attention_cudnn: '9\.13\.1' has no published "
                                         r"cudnn rows on gb200; allowed: 9\.19\.1, 9\.22\.0"):
        hardware_from_dict({"base": "gb200-nvl72", "device": {"attention_cudnn": "9.13.1"}})
    with pytest.raises(ValueError, match="attention_cudnn: '9.19.1' needs attention_gpu"):
        hardware_from_dict({"base": "mi300x", "device": {"attention_cudnn": "9.19.1"}})
    with pytest.raises(ValueError, match="a cuDNN release selects the curves of the cudnn "
                                         "kernel, not of 'flash2'"):
        attention_prices("b200", "flash2", "9.13.1")


def _windowed(gpu, release=None):
    """{(direction, window, head_dim): {seq: [tflops, ...]}} of the table's cuDNN rows with
    a sliding window on ``gpu`` (of one cuDNN release, or every release's)."""
    out: dict = {}
    for r in read_data_csv(ATTENTION_TABLE)[1]:
        if r["gpu"] == gpu and r["window"] and release in (None, r["cudnn"]):
            key = (r["direction"], int(r["window"]), int(r["head_dim"]))
            out.setdefault(key, {}).setdefault(int(r["seq"]), []).append(float(r["tflops"]))
    return out


def _windowed_op(seq, window, head_dim=64, backward=False, heads=64, batch=2):
    k = Kernel.attention(batch * heads, seq, seq, head_dim, window=window, backward=backward)
    flops = 2.0 * batch * heads * head_dim * (2 * window * seq - window * window)
    return TraceCompute("gpt: attention: core", flops * (2.5 if backward else 1.0), 0.0,
                        kernel=k)


@pytest.mark.parametrize("name", ["gb200-nvl72", "gb300-nvl72", "h200-dgx"])
def test_a_sliding_window_prices_at_its_own_published_curve(name):
    """cudnn-frontend publishes GPT-OSS's windowed kernels (S11: w = 1024 on GB200, GB300
    and H200 under cuDNN 9.19.1; S12: w = 128 on GB200 and GB300 under 9.22.0): a windowed
    kernel of a published window prices at the published median at every published
    sequence, far below the full causal kernel at that sequence (on GB200 at 4K and
    w = 128 about 1/9 of it), where it was read before from the causal curve at the
    window — faster than any published windowed rate. A window with no curve keeps that
    reading (an upper bound)."""
    hw = preset(name)
    gpu = hw.device.attention_gpu
    costs, t_k = HardwareCostModel(hw), hw.device.kernel_overhead_us * 1e-6
    published = _windowed(gpu)
    assert {w for _, w, _ in published} == ({128, 1024} if gpu != "h200" else {1024})
    prices = attention_prices(gpu, "cudnn")
    for (direction, window, d), by_seq in published.items():
        causal = prices.curve(direction, True, 128)
        for seq, values in by_seq.items():
            op = _windowed_op(seq, window, d, backward=direction == "bwd")
            rate = op.flops / (costs.compute_time_s(op) - t_k) / 1e12
            assert rate == pytest.approx(statistics.median(values), rel=1e-9)
            # the windowed kernel is slower than the full one, and than the old reading
            assert rate < causal.tflops(seq) and rate < causal.tflops(window)
    # no curve at this window: the causal curve at the window, as before
    odd = Kernel.attention(128, 16384, 16384, 64, window=512)
    assert prices.rate_tflops(odd) == pytest.approx(prices.curve("fwd", True, 64).tflops(512))
    # a window as long as the sequence is full causal attention
    whole = Kernel.attention(128, 1024, 1024, 64, window=1024)
    assert prices.rate_tflops(whole) == pytest.approx(prices.curve("fwd", True, 64).tflops(1024))


def test_a_smaller_head_dim_is_scaled_by_its_exponentials_as_published():
    """Where the H100 publishes both d = 64 and d = 128 (cuDNN, FlashAttention-2 and -3,
    forward and backward), d = 64 derived from d = 128 by the exponentials' scaling is
    nearer the published d = 64 rate than d = 128's rate read as is (the rule before
    2026-12-01) at every point, within -6% to +33% (the worst: FlashAttention-3's causal
    forward at 512-1,024 tokens), mean |error| under 10%."""
    errors = []
    for kernel in ("cudnn", "flash2", "flash3"):
        published = _published("h100-sxm", kernel)
        checked = head_dim_check("h100-sxm", kernel)
        assert checked, kernel
        for (direction, causal), points in checked.items():
            for seq, err in points:
                own = statistics.median(published[(direction, causal, 64)][seq])
                old = statistics.median(published[(direction, causal, 128)][seq]) / own - 1
                assert abs(err) < abs(old), (kernel, direction, causal, seq, err, old)
                assert -0.06 <= err <= 0.33, (kernel, direction, causal, seq, err)
                errors.append(abs(err))
    assert len(errors) >= 40 and statistics.fmean(errors) < 0.10


@pytest.mark.parametrize("gpu", ["b200", "gb200", "gb300", "h200"])
def test_gpt_oss_head_dim_on_curves_of_128_reads_them_scaled(gpu):
    """These GPUs' cuDNN full-attention curves are at d = 128 (and 160) only: a d = 64
    kernel (GPT-OSS, Llama 3.2) reads d = 128's rate scaled by the exponentials — slower,
    the more so on Blackwell (512 tensor-core FLOPs per exponential) than on Hopper and
    Blackwell Ultra (256) — and the curve says so; d = 128 and larger keep their own."""
    prices = attention_prices(gpu, "cudnn")
    exp_s = 1.0 / EXP_PER_S[gpu]
    for direction, f in (("fwd", 4.0), ("bwd", 10.0)):
        full, small = prices.curve(direction, True, 128), prices.curve(direction, True, 64)
        assert small.derived.startswith("head dim 64 from 128's curve")
        assert prices.curve(direction, True, 256) == prices.curve(direction, True, 160 if
                                                                  160 in prices.head_dims
                                                                  else 128)
        for (seq, r128), (seq64, r64) in zip(full.points, small.points):
            t128 = f * 128 / (r128 * 1e12)
            assert seq64 == seq and r64 == pytest.approx(
                f * 64 / ((t128 - exp_s) / 2 + exp_s) / 1e12, rel=1e-12)
            assert r128 / 2 < r64 < r128
    # a windowed kernel of a published window keeps its own curve; the 1,024-key window
    # at d = 64 (cuDNN 9.19.1), a kernel one masked tile slower than the full one, stays
    # below the full d = 64 rate derived here wherever both exist
    wide = _windowed(gpu).get(("fwd", 1024, 64), {})
    for seq, values in wide.items():
        assert statistics.median(values) < prices.curve("fwd", True, 64).tflops(seq) * 1.1


def test_the_scaling_formula():
    """r(d) = F·d / ((d/d')·(F·d'/r' − e) + e): the identity at d = d'; a rate already past
    the exponentials' bound is kept; halving d at the bound halves nothing of e."""
    assert scaled_head_dim_rate(500.0, 128, 128, 4.0, 1e-13) == pytest.approx(500.0)
    assert scaled_head_dim_rate(9000.0, 128, 64, 4.0, 1e-12) == 9000.0    # t(d') < e
    e, r = 2.0e-13, 1000.0
    t = 4.0 * 128 / (r * 1e12)
    assert scaled_head_dim_rate(r, 128, 64, 4.0, e) == pytest.approx(
        4.0 * 64 / ((t - e) / 2 + e) / 1e12)
    assert EXP_PER_S["h100-sxm"] == pytest.approx(3.865e12, rel=1e-3)  # FA3's "3.9 TFLOPS"


def test_a_selected_release_reads_other_releases_windows_and_says_so():
    """With a cuDNN release selected, a window that release has rows of is read from them
    alone; one it has none of from every release's rows, and the curve says which."""
    at_919 = attention_prices("gb200", "cudnn", "9.19.1")
    w1024, w128 = (at_919.windowed_curve("fwd", w, 64) for w in (1024, 128))
    assert w1024.derived == "" and dict(w1024.points) == {
        s: statistics.median(v) for s, v in _windowed("gb200", "9.19.1")[("fwd", 1024, 64)].items()}
    assert w128.derived == "no rows of cuDNN 9.19.1 at this window: those of 9.22.0"
    assert dict(w128.points) == {
        s: statistics.median(v) for s, v in _windowed("gb200", "9.22.0")[("fwd", 128, 64)].items()}
    assert at_919.windowed_curve("fwd", 4096, 64) is None


# --- a kernel's work, not the count its program declares ----------------------------------
def _flash_ops(cfg, par):
    """Every fused attention op of the simulated step of (cfg, par): one short step's
    templates, as :func:`simulate_gpt` prices them."""
    from vcluster.planner.simulation import (ADAM, TRACED_POSITIONS, _short_layout,
                                             _short_templates)
    reps, _ = _short_layout(par, cfg.layers, TRACED_POSITIONS)
    _, raw = _short_templates(cfg, par, reps, ADAM)
    return [op for ts in raw for t in ts for body in [*t.bodies.values(), t.tail]
            for op in body if isinstance(op, TraceCompute) and op.kernel is not None
            and op.kernel.flash]


def test_a_kernel_is_priced_by_its_own_work_not_the_declared_count():
    """Programs declare a causal kernel's products in their own conventions — the GPT
    block its full s² products (2x FlashAttention's forward count, 1.6x its backward's),
    the grouped-query block half of them with a backward of twice its forward (0.8x),
    a context-parallel diagonal block its full square (2x) — and every one is priced
    t_k + F / r with F FlashAttention's count of the kernel's shape (``kernel_flops``),
    the convention the curves' rates are published in."""
    from vcluster.runtime.tracing.kernel import kernel_flops
    hw = preset("h100-dgx")
    costs, t_k = HardwareCostModel(hw), hw.device.kernel_overhead_us * 1e-6
    prices = attention_prices(hw.device.attention_gpu, hw.device.attention_kernel)
    base = dict(hidden=256, heads=4, seq=512, vocab=512, layers=2)
    runs = {"gpt": (GPTConfig(**base), ParallelConfig(global_batch=1, attention="flash")),
            "llama": (GPTConfig(**base, arch="llama", kv_heads=2),
                      ParallelConfig(global_batch=1, attention="flash")),
            "llama cp2 ring": (GPTConfig(**base, arch="llama", kv_heads=2),
                               ParallelConfig(global_batch=1, cp=2, attention="flash"))}
    declared = set()
    for name, (cfg, par) in runs.items():
        ops = _flash_ops(cfg, par)
        assert ops, name
        for op in ops:
            k = op.kernel
            declared.add(round(op.flops / kernel_flops(k), 3))
            expected = t_k + kernel_flops(k) / (prices.rate_tflops(k) * 1e12)
            assert costs.compute_time_s(op) == pytest.approx(expected, rel=1e-12), (name, k)
    assert {2.0, 1.6, 1.0, 0.8} <= declared      # the conventions differ; the prices do not
    # the same kernel declared three ways costs the same
    for backward in (False, True):
        op = _op(2048, backward=backward)
        assert len({costs.compute_time_s(TraceCompute(op.name, op.flops * f, 0,
                                                      kernel=op.kernel))
                    for f in (0.8, 1.0, 1.6, 2.0)}) == 1


def test_flash2_on_h200_is_priced_as_this_projects_own_measurement():
    """This project's own FlashAttention-2 runs on an H200 (benchmarks/gpu_llama_sweep.py:
    causal, 32 heads of 128, batch 1, PyTorch 2.11; results/h200-2026-11-30) against the
    h200-dgx preset's flash2 price of the same kernels, forward and backward, from 8K
    tokens on (shorter ones fill fewer SMs than the published curves' 16K-token batches):
    within 8% each. With the count the grouped-query block declares (a backward of twice
    its forward) the backward was priced 20% fast."""
    import json
    from pathlib import Path
    from vcluster.runtime.tracing.kernel import kernel_flops
    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-2026-11-30"
            / "attention-flash2.jsonl")
    costs = HardwareCostModel(preset("h200-dgx"), attention_kernel="flash2")
    checked = 0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["seq"] < 8192:
            continue
        bh, s, d = r["batch"] * r["heads"], r["seq"], r["head_dim"]
        measured = {False: r["forward"] * 1e-3,
                    True: (r["forward_backward"] - r["forward"]) * 1e-3}
        for backward, seconds in measured.items():
            k = Kernel.attention(bh, s, s, d, causal=True, flash=True, backward=backward)
            priced = costs.compute_time_s(TraceCompute("core", kernel_flops(k), 0, kernel=k))
            assert priced == pytest.approx(seconds, rel=0.08), (s, backward)
            declared = TraceCompute("core", kernel_flops(k) * (0.8 if backward else 1.0), 0,
                                    kernel=k)
            assert costs.compute_time_s(declared) == priced      # the count does not matter
            checked += 1
    assert checked == 8
