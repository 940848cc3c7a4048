"""ParallelConfig.grad_reduce_dtype: the data-parallel gradient reductions in float32.

Emulated: a float64 model whose reductions run in float32 trains to the numpy reference
within float32 rounding (and not bit for bit: the cast ran), over DDP, a pipeline with
tied embeddings, ZeRO 1-3, context parallelism and experts; a float32 model is unchanged
bit for bit. Traced (16-bit, as the simulator traces): every gradient reduction moves
exactly twice the bytes, every other message the same. Simulated and screened: the step's
communication grows by the gradients' extra bytes; the CLI, the planner and a scenario
take the setting."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from pipeline_parallel.executor import TrainJob, train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.runtime.tracing import TraceCollective, TraceRecv, TraceSend, trace_program

from .gpt_data import assert_same_params_and_grads, token_data

pytestmark = pytest.mark.timeout(600)

B, STEPS, LR = 8, 2, 0.01


def _cfg(**kw):
    return GPTConfig(**{**dict(hidden=16, layers=4, heads=4, seq=8, vocab=32), **kw})


def _fit(cluster_of, cfg, par):
    tokens, targets = token_data(cfg, B)
    return GPT(cfg, seed=1).fit(cluster_of(par.mesh()), tokens, targets, STEPS, par,
                                optimizer="adam", lr=LR)


CASES = {
    "ddp dp2": (dict(), dict(dp=2)),
    "pp2 x dp2 tied": (dict(tie_embeddings=True), dict(dp=2, pp=2)),
    "zero1 pp2 tied": (dict(tie_embeddings=True), dict(dp=2, pp=2, zero_stage=1)),
    "zero2": (dict(), dict(dp=2, zero_stage=2)),
    "zero3 tp2": (dict(), dict(dp=2, tp=2, zero_stage=3)),
    "cp2 dp2": (dict(), dict(dp=2, cp=2)),
    "moe ep2": (dict(arch="llama", kv_heads=2, ffn_hidden=24, experts=2, moe_top_k=1,
                     moe_ffn_hidden=8), dict(dp=2, ep=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_reductions_train_to_the_reference_within_fp32_rounding(cluster_of, case):
    """float64 model, reductions in float32: equal to the unsharded reference to float32
    rounding; differs from the float64 reductions' run (the cast ran)."""
    model, par = CASES[case]
    cfg = _cfg(**model)
    tokens, targets = token_data(cfg, B)
    exact, fp32 = (ParallelConfig(global_batch=B, grad_reduce_dtype=g, **par)
                   for g in ("model", "fp32"))
    ref = GPT(cfg, seed=1).fit_reference(tokens, targets, steps=STEPS, optimizer="adam",
                                         lr=LR, parallel=exact if cfg.experts else None)
    exact, fp32 = _fit(cluster_of, cfg, exact), _fit(cluster_of, cfg, fp32)
    np.testing.assert_allclose(fp32.losses, ref.losses, rtol=1e-6)
    assert_same_params_and_grads(fp32, ref, rtol=1e-4, atol=1e-6)
    assert_same_params_and_grads(exact, ref, rtol=1e-8, atol=1e-11)
    assert any(not np.array_equal(fp32.grads[k], exact.grads[k]) for k in ref.grads), \
        "a float32 reduction of float64 gradients rounds somewhere"


@pytest.mark.parametrize("par", [dict(dp=2), dict(dp=2, zero_stage=3)])
def test_float32_model_is_unchanged_bit_for_bit(cluster_of, par):
    cfg = _cfg(dtype="float32")
    runs = [_fit(cluster_of, cfg, ParallelConfig(global_batch=B, grad_reduce_dtype=g, **par))
            for g in ("model", "fp32")]
    assert np.array_equal(runs[0].losses, runs[1].losses)
    for k in runs[0].params:
        assert np.array_equal(runs[0].params[k], runs[1].params[k]), k


def _bytes(cfg, par):
    """Per rank: {("dp" collective name | "tp ..." | "p2p"): bytes} of a 16-bit trace."""
    mesh = par.mesh()
    traces = trace_program(mesh, train_program,
                           GPT(dataclasses.replace(cfg, dtype="float16")).meta_args(mesh, par))
    out = []
    for tr in traces:
        dp = set(mesh.group(par_axes(par), tr.rank))
        counts = {}
        for op in tr.ops:
            if isinstance(op, TraceCollective):
                key = (("dp " if set(op.group) == dp else "other ") + op.collective)
            elif isinstance(op, (TraceSend, TraceRecv)):
                key = "p2p " + type(op).__name__
            else:
                continue
            counts.setdefault(key, []).append(op.nbytes)
        out.append(counts)
    return out


def par_axes(par):
    return ("dp", "cp") if par.cp > 1 else "dp"


@pytest.mark.parametrize("model, par", [
    (dict(), dict(dp=2, pp=2, tp=2)),
    (dict(), dict(dp=2, cp=2)),
    (dict(), dict(dp=2, zero_stage=1, pp=2)),
    (dict(), dict(dp=4, zero_stage=3)),
])
def test_trace_moves_twice_the_gradient_bytes_and_nothing_else_changes(model, par):
    cfg = _cfg(**model)
    base = _bytes(cfg, ParallelConfig(global_batch=B, **par))
    fp32 = _bytes(cfg, ParallelConfig(global_batch=B, grad_reduce_dtype="fp32", **par))
    reductions = {"dp all_reduce", "dp reduce_scatter"}
    for b, f in zip(base, fp32):
        assert set(b) == set(f)
        assert reductions & set(b), "the trace reduces gradients over dp"
        for key in b:
            expect = [2 * n for n in b[key]] if key in reductions else b[key]
            assert f[key] == expect, key


def test_tied_copies_exchange_their_gradients_in_fp32():
    """pp 2: the first and last stage swap E's gradient (V·h elements) at 4 bytes each."""
    cfg = _cfg(tie_embeddings=True)
    V, h = cfg.vocab, cfg.hidden
    for g, item in (("model", 2), ("fp32", 4)):
        sizes = _bytes(cfg, ParallelConfig(global_batch=B, pp=2, grad_reduce_dtype=g))
        for rank in sizes:
            assert rank["p2p TraceSend"].count(V * h * item) == 1, (g, rank)


def test_errors_name_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"grad_reduce_dtype='bf16': not a known value; "
                                         r"allowed: one of model, fp32"):
        ParallelConfig(global_batch=8, grad_reduce_dtype="bf16")
    with pytest.raises(ValueError, match="grad_reduce_dtype must be None .* got 'int8'"):
        TrainJob(params=(), specs=(), actions=(), loss="mse", optimizer=None, steps=1,
                 microbatches=1, global_batch=1, grad_reduce_dtype="int8")


# --- simulated, screened, planned -----------------------------------------------------------
def _sim(**kw):
    from vcluster.planner.simulation import simulate_gpt
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=2048, vocab=50304)
    par = ParallelConfig(global_batch=64, micro_batch=4, dp=16, **kw)
    return simulate_gpt(cfg, par, "h100-dgx")


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_simulated_step_communicates_more_and_the_memory_is_unchanged(zero):
    base, fp32 = _sim(zero_stage=zero), _sim(zero_stage=zero, grad_reduce_dtype="fp32")
    assert (base.grad_reduce_dtype, fp32.grad_reduce_dtype) == ("model", "fp32")
    assert fp32.comm_s > base.comm_s * 1.05
    assert fp32.step_time_s >= base.step_time_s
    assert fp32.compute_s == pytest.approx(base.compute_s, rel=0.02)
    assert fp32.peak_memory_gb == base.peak_memory_gb


@pytest.mark.parametrize("zero", [0, 1])
def test_screen_prices_the_gradient_reductions_at_four_bytes(zero):
    """The planner's screen: the extra communication of fp32 reductions is exactly the
    reductions priced at 4 bytes less at 2 (DDP's buckets: all-reduces; ZeRO-1: the
    reduce-scatters, the all-gathers of 16-bit parameters unchanged), by hand from the
    collective prices; the screen's step follows the replay's."""
    from vcluster.localhost import load_hardware
    from vcluster.planner.layer_cost import trace_stage_pieces
    from vcluster.planner.screen import _buckets, _rank_modules, screen_estimate
    from vcluster.timing.collective_cost import collective_time_s
    from vcluster.timing.hardware_model import HardwareCostModel
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=2048, vocab=50304)
    hw = load_hardware("h100-dgx")
    group = tuple(range(16))
    est, dp_s = {}, {}
    for g, item in (("model", 2), ("fp32", 4)):
        par = ParallelConfig(global_batch=64, micro_batch=4, dp=16, grad_reduce_dtype=g,
                             zero_stage=zero)
        pieces = trace_stage_pieces(cfg, 1, 4, False, "none", HardwareCostModel(hw))
        est[g] = screen_estimate(cfg, par, pieces, hw)
        mods = [n * item for n in _rank_modules(cfg, par, 0)]
        if zero == 0:
            dp_s[g] = sum(collective_time_s("all_reduce", n, group, hw)
                          for n in _buckets(mods, 1 << 20))
        else:
            dp_s[g] = sum(collective_time_s("reduce_scatter", n, group, hw) for n in mods)
        assert est[g].step_time_s == pytest.approx(_sim(grad_reduce_dtype=g,
                                                        zero_stage=zero).step_time_s,
                                                   rel=0.10)
    assert dp_s["fp32"] > dp_s["model"]
    assert est["fp32"].comm_s - est["model"].comm_s == pytest.approx(
        dp_s["fp32"] - dp_s["model"], rel=1e-9)


def test_cli_and_json_and_plan_take_the_flag(tmp_path):
    out = tmp_path / "r.json"
    args = [sys.executable, "-m", "vcluster", "simulate", "gpt", "--hidden", "512",
            "--layers", "4", "--heads", "8", "--seq", "512", "--vocab", "8192", "--dp", "8",
            "--global-batch", "16", "--micro-batch", "2", "--hardware", "h100-dgx"]
    run = subprocess.run(args + ["--grad-reduce-dtype", "fp32", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "gradients reduced in fp32" in run.stdout
    assert json.loads(out.read_text())["grad_reduce_dtype"] == "fp32"
    bad = subprocess.run(args + ["--grad-reduce-dtype", "bf16"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--grad-reduce-dtype" in bad.stderr \
        and "'model', 'fp32'" in bad.stderr
    plan = tmp_path / "plan.json"
    model = ["--hidden", "512", "--layers", "4", "--heads", "8", "--seq", "512", "--vocab",
             "8192", "--global-batch", "16"]
    run = subprocess.run([sys.executable, "-m", "vcluster", "plan", "gpt", *model,
                          "--gpus", "8", "--top", "2", "--replay", "2", "--workers", "1",
                          "--grad-reduce-dtype", "fp32", "--hardware", "h100-dgx",
                          "--json", str(plan)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "gradients reduced in fp32" in run.stdout
    assert json.loads(plan.read_text())["grad_reduce_dtype"] == "fp32"
    from vcluster.planner import plan_gpt
    df = plan_gpt(hidden=512, layers=4, heads=8, seq=512, vocab=8192, gpus=8,
                  global_batch=16, hardware="h100-dgx", top=2, replay=2, workers=1,
                  progress=False, grad_reduce_dtype="fp32")
    assert df.attrs["grad_reduce_dtype"] == "fp32" and len(df)
    with pytest.raises(ValueError, match="plan_gpt: grad_reduce_dtype must be one of"):
        plan_gpt(hidden=512, layers=4, heads=8, seq=512, vocab=8192, gpus=8,
                 global_batch=16, grad_reduce_dtype="fp16")
