"""A long pipelined step extrapolated from three short ones (vcluster/timing/steady_state.py,
``simulate_gpt``'s default) equals the step replayed whole (``full_replay=True``), figure
for figure, to rounding: swept over schedules, pipeline depths, micro-batch counts (past
the samples by a multiple of the period and not), tensor, context, data and expert
parallelism, ZeRO, MoE overlap and a cluster of two GPU kinds; and where the premise
fails — a figure not affine in the samples — nothing is extrapolated."""

import dataclasses
import math

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.cli.main import main
from vcluster.planner.simulation import (gpt_step_traces, simulate_gpt,
                                         steady_state_microbatches)
from vcluster.timing import load_hardware
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.steady_state import NotAffine, extrapolated, extrapolated_result

pytestmark = pytest.mark.timeout(600)

H100, A100 = "h100-dgx", "a100-80gb-dgx"
MIXED = {"name": "mixed", "parts": [{"hardware": A100, "nodes": 1},
                                    {"hardware": H100, "nodes": 1}]}
RTOL = 1e-9
FIGURES = ("step_time_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s",
           "tflops_per_gpu", "mfu", "model_tflops_per_gpu", "tokens_per_s_per_gpu",
           "compute_comm_ratio", "peak_memory_gb")


def _dense(pp, v=1, **kw):
    return GPTConfig(**{**dict(hidden=64, layers=pp * v * 2, heads=4, seq=32, vocab=128), **kw})


def _moe(layers):
    return GPTConfig(hidden=256, layers=layers, heads=8, seq=128, vocab=1024, arch="llama",
                     kv_heads=4, ffn_hidden=512, experts=8, moe_top_k=2)


def _assert_equal_to_the_whole_step(cfg, par, hardware=H100, **kw):
    fast = simulate_gpt(cfg, par, hardware, **kw)
    whole = simulate_gpt(cfg, par, hardware, full_replay=True, **kw)
    assert fast.replayed_microbatches == steady_state_microbatches(par) != None   # noqa: E711
    assert whole.replayed_microbatches == ()
    for name in FIGURES:
        assert math.isclose(getattr(fast, name), getattr(whole, name), rel_tol=RTOL,
                            abs_tol=RTOL * whole.step_time_s), name
    assert [o.op for o in fast.ops] == [o.op for o in whole.ops]
    for a, b in zip(fast.ops, whole.ops):
        assert math.isclose(a.compute_s, b.compute_s, rel_tol=RTOL, abs_tol=1e-15), a.op
        assert math.isclose(a.comm_s, b.comm_s, rel_tol=RTOL, abs_tol=1e-15), a.op
    rest = {f.name for f in dataclasses.fields(fast)} - set(FIGURES) - {
        "ops", "replayed_microbatches"}
    assert {n: getattr(fast, n) for n in rest} == {n: getattr(whole, n) for n in rest}
    return fast


@pytest.mark.parametrize("pp, schedule, v, m", [
    (2, "1f1b", None, 16),           # samples 4, 5, 6: the smallest m that uses them
    (4, "1f1b", None, 28),
    (4, "1f1b", None, 41),
    (8, "1f1b", None, 57),
    (4, "gpipe", None, 31),
    (4, "interleaved_1f1b", 2, 40),  # samples 8, 12, 16 (rounds of p)
    (4, "interleaved_1f1b", 3, 52),
    (2, "interleaved_1f1b", 4, 20),
    (1, "1f1b", None, 10),           # no pipeline: gradient accumulation, samples 2, 3, 4
])
def test_schedules_and_depths(pp, schedule, v, m):
    par = ParallelConfig(global_batch=2 * m, micro_batch=1, dp=2, pp=pp, schedule=schedule,
                         virtual_stages=v)
    _assert_equal_to_the_whole_step(_dense(pp, v or 1), par)


@pytest.mark.parametrize("kw", [
    dict(pp=4, tp=2, sequence_parallel=True, tp_overlap="te", dp=1),
    dict(pp=2, tp=2, recompute="selective", dp=2, zero_stage=1),
    dict(pp=1, dp=4, zero_stage=3),
    dict(pp=1, dp=2, zero_stage=2, grad_reduce_dtype="fp32"),
    dict(pp=2, cp=2, dp=1, schedule="interleaved_1f1b", virtual_stages=2),
], ids=["tp-te-overlap", "zero1-recompute", "zero3", "zero2-fp32", "cp-ring"])
def test_tensor_context_and_data_parallelism(kw):
    m = 32
    dp = kw.pop("dp")
    pp, v = kw["pp"], kw.get("virtual_stages") or 1
    par = ParallelConfig(global_batch=dp * m, micro_batch=1, dp=dp, **kw)
    _assert_equal_to_the_whole_step(_dense(pp, v), par)


@pytest.mark.parametrize("overlap", [False, True])
def test_moe_with_and_without_the_exchange_overlapped(overlap):
    m = 24
    par = ParallelConfig(global_batch=2 * m, micro_batch=1, dp=2, ep=2, pp=2,
                         schedule="interleaved_1f1b", virtual_stages=2,
                         moe_comm_overlap=overlap)
    _assert_equal_to_the_whole_step(_moe(4), par, expert_skew=1.5)


def test_a_cluster_of_two_kinds_split_by_stages():
    par = ParallelConfig(global_batch=30, micro_batch=1, dp=1, pp=2, tp=8)
    fast = _assert_equal_to_the_whole_step(_dense(2, hidden=128, heads=8), par,
                                           hardware=MIXED)
    assert [s.hardware for s in fast.stages] == [A100, H100]


def test_when_nothing_is_extrapolated():
    """A step no longer than the samples, and the zero-bubble schedule (its waits' split
    into exposed communication and bubble settles only from about 4p), are replayed whole."""
    def par(m, **kw):
        return ParallelConfig(global_batch=m, micro_batch=1, dp=1, **kw)
    assert steady_state_microbatches(par(27, pp=4)) is None          # 8 + 9 + 10 = 27
    assert steady_state_microbatches(par(28, pp=4)) == (8, 9, 10)
    assert steady_state_microbatches(par(36, pp=4, schedule="interleaved_1f1b",
                                         virtual_stages=2)) is None  # 8 + 12 + 16
    assert steady_state_microbatches(par(40, pp=4, schedule="interleaved_1f1b",
                                         virtual_stages=2)) == (8, 12, 16)
    assert steady_state_microbatches(par(64, pp=4, schedule="zero_bubble")) is None
    r = simulate_gpt(_dense(4), par(27, pp=4), H100)
    assert r.replayed_microbatches == () and r.microbatches == 27
    with pytest.raises(ValueError, match="full_replay must be True or False, got 'yes'"):
        simulate_gpt(_dense(4), par(28, pp=4), H100, full_replay="yes")


def test_a_figure_not_affine_in_the_samples_is_not_extrapolated():
    """The zero-bubble schedule at pp 4: its exposed communication grows by 5.9 µs from 10
    to 11 micro-batches and by 8.9 µs from 11 to 12 (its step time by the same 594 µs
    each): the replays of 10, 11 and 12 give no extrapolation; those of 17, 18, 19 (settled)
    give the replay of 31."""
    cfg, costs = _dense(4), HardwareCostModel(load_hardware(H100), "bf16")

    def replays(ms):
        out = []
        for m in ms:
            par = ParallelConfig(global_batch=m, micro_batch=1, dp=1, pp=4,
                                 schedule="zero_bubble")
            out.append(simulate_trace(gpt_step_traces(cfg, par, costs), costs,
                                      mesh=par.mesh(), symmetric=True, timeline=False))
        return out

    early = replays((10, 11, 12))
    steps = [r.step_time_s for r in early]
    assert math.isclose(steps[2] - steps[1], steps[1] - steps[0], rel_tol=1e-12)
    assert extrapolated_result(early, (10, 11, 12), 31) is None
    late = replays((17, 18, 19, 31))
    ext = extrapolated_result(late[:3], (17, 18, 19), 31)
    assert ext is not None and ext.timelines == ((),) * len(ext.ranks)
    assert math.isclose(ext.step_time_s, late[3].step_time_s, rel_tol=RTOL)
    for a, b in zip(ext.stats, late[3].stats):
        for f in ("compute_s", "comm_s", "exposed_comm_s", "bubble_s", "idle_s", "end_s"):
            assert math.isclose(getattr(a, f), getattr(b, f), rel_tol=RTOL,
                                abs_tol=RTOL * b.end_s), f


def test_the_arithmetic_and_its_errors():
    assert extrapolated([1.0, 3.0, 5.0], 1, 4, 1e-12) == 13.0
    with pytest.raises(NotAffine, match="second difference 1 > 0.5"):
        extrapolated([1.0, 3.0, 6.0], 1, 4, 0.5)
    with pytest.raises(ValueError, match=r"micro-batches \(8, 9, 11\) must be equally spaced"):
        extrapolated_result([None] * 3, (8, 9, 11), 20)
    with pytest.raises(ValueError, match=r"m=21 at or past the last by a multiple"):
        extrapolated_result([None] * 3, (8, 12, 16), 21)
    with pytest.raises(ValueError, match="three replays"):
        extrapolated_result([None] * 2, (8, 9, 10), 20)


def test_the_cli_says_what_it_replayed(capsys):
    base = ("simulate train --hidden 64 --layers 8 --heads 4 --seq 32 --vocab 128 --pp 4 "
            "--dp 2 --global-batch 80 --hardware h100-dgx").split()
    assert main(base) == 0
    fast = capsys.readouterr().out
    assert ("the step of 40 micro-batches extrapolated from replays of 8, 9, 10 (affine "
            "past the warm-up, checked; --full-replay replays it whole)") in fast
    assert main(base + ["--full-replay"]) == 0
    whole = capsys.readouterr().out
    assert "extrapolated" not in whole
    step = [line for line in whole.splitlines() if "step time" in line]
    assert step and step[0] in fast
