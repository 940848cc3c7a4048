"""Mixture of experts in simulate and plan: the traced FLOPs of a balanced MoE step equal
6·N_active·tokens + attention (moe_model_flops) and MFU uses them; a skewed load (the
busiest expert 2x the mean) lengthens the simulated step; the memory model counts a
rank's experts; plan searches ep and its JSON carries it."""

import json

import numpy as np
import pytest

from modeling import ConfigError
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops, moe_model_flops
from tensor_parallel.moe_layer import EXPERT_PARAMS
from vcluster.cli.main import main
from vcluster.planner.memory import rank_params
from vcluster.planner.search import plan_gpt
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import TraceCompute, trace_program
from vcluster.timing import load_hardware

pytestmark = pytest.mark.timeout(300)

H100 = "h100-dgx"


def _cfg(**kw):
    return GPTConfig(**{**dict(hidden=256, layers=4, heads=8, seq=128, vocab=1024, arch="llama",
                               kv_heads=4, ffn_hidden=512, experts=8, moe_top_k=2), **kw})


def test_traced_flops_equal_the_active_parameter_closed_form():
    """Dropless, balanced (skew 1): summed over the ranks the step's FLOPs are
    6·N_active·B·s + 6·B·s²·l·h_q (N_active: router + k experts per layer)."""
    cfg = _cfg(hidden=32, layers=2, heads=4, seq=16, vocab=64, kv_heads=2, ffn_hidden=48)
    par = ParallelConfig(global_batch=4, micro_batch=1, dp=4, ep=2)
    mesh = par.mesh()
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    flops = sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))
    want = moe_model_flops(4, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab, cfg.heads,
                           cfg.kv_heads, cfg.experts, cfg.moe_top_k, cfg.moe_ffn_hidden)
    assert flops == want
    assert model_flops(cfg, 4) == flops


def test_memory_counts_the_experts_a_rank_holds():
    """rank_params = every parameter once, the experts' divided by ep (they are split over
    ep, replicated over tp), the rest as the dense Llama's (tp 1 here)."""
    for cfg in (_cfg(), _cfg(kv_heads=8, ffn_hidden=256)):
        for ep in (1, 2, 4, 8):
            par = ParallelConfig(global_batch=8, dp=8, ep=ep)
            want = sum(np.prod(s) / (ep if n.rsplit(".", 1)[-1] in EXPERT_PARAMS else 1)
                       for n, s in GPT(cfg).param_shapes().items())
            assert rank_params(cfg, par, 0) == pytest.approx(want, rel=1e-12), (cfg.arch, ep)


def test_mfu_counts_the_routed_parameters():
    cfg, hw = _cfg(), load_hardware(H100)
    par = ParallelConfig(global_batch=8, dp=4, ep=4)
    r = simulate_gpt(cfg, par, hw)
    flops = moe_model_flops(8, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab, cfg.heads,
                            cfg.kv_heads, cfg.experts, cfg.moe_top_k, cfg.moe_ffn_hidden)
    assert r.mfu == pytest.approx(flops / (4 * hw.device.peak_flops("bf16") * r.step_time_s))


def _simulate(tmp_path, skew):
    out = tmp_path / f"skew{skew}.json"
    rc = main(["simulate", "gpt", "--arch", "llama", "--hidden", "1024", "--layers", "2",
               "--heads", "8", "--kv-heads", "4", "--ffn-hidden", "4096", "--seq", "1024",
               "--vocab", "1024", "--experts", "8", "--moe-top-k", "2", "--ep", "4", "--dp",
               "4", "--global-batch", "8", "--expert-skew", str(skew), "--hardware", H100,
               "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_expert_skew_lengthens_the_step(tmp_path, capsys):
    """The busiest expert (on the traced ep rank 0) gets 2x the mean tokens: its compute,
    which every all_to_all waits for, and its activations grow."""
    even, skewed = _simulate(tmp_path, 1), _simulate(tmp_path, 2)
    assert skewed["step_time_s"] > even["step_time_s"] * 1.05, (skewed["step_time_s"],
                                                              even["step_time_s"])
    assert skewed["peak_memory_gb"] > even["peak_memory_gb"]
    assert "8 experts, top-2, ep=4, expert skew 2" in capsys.readouterr().out


def test_expert_skew_must_be_at_least_one(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4",
              "--heads", "8", "--seq", "128", "--vocab", "1024", "--experts", "8",
              "--global-batch", "8", "--expert-skew", "0.5"])
    assert "expected a number >= 1" in capsys.readouterr().err


def test_plan_searches_ep(tmp_path):
    """--max-ep 4 on 4 GPUs tries ep 1, 2 and 4 where they divide dp (and the experts);
    the JSON candidates carry ep; --max-ep 1 (the default) tries ep 1 only."""
    kw = dict(hidden=256, layers=4, heads=8, seq=128, vocab=1024, gpus=4, global_batch=8,
              hardware=H100, arch="llama", kv_heads=4, ffn_hidden=512, experts=8,
              recompute=("none",), sequence_parallel=(False,), schedules=("1f1b",),
              micro_batches=(1,), replay=2, workers=1, progress=False)
    df = plan_gpt(**kw, max_ep=4)
    seen = set(zip(df["dp"], df["ep"]))
    assert {(4, 1), (4, 2), (4, 4), (2, 2), (1, 1)} <= seen
    assert all(dp % ep == 0 for dp, ep in seen)
    assert set(plan_gpt(**kw)["ep"]) == {1}
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4",
                 "--heads", "8", "--kv-heads", "4", "--ffn-hidden", "512", "--seq", "128",
                 "--vocab", "1024", "--experts", "8", "--gpus", "4", "--global-batch", "8",
                 "--max-ep", "4", "--hardware", H100, "--replay", "1", "--workers", "1",
                 "--quiet", "--json", str(out)]) == 0
    cands = json.loads(out.read_text())["candidates"]
    assert {c["ep"] for c in cands} == {1, 2, 4}


def test_dropless_exchanges_replay_as_all_to_all():
    """The simulated trace of a dropless MoE step has, per layer and micro-batch, four
    all_to_alls over the ep group (dispatch, combine and their gradients) carrying, under
    a balanced load, n/(n−1)·(n−1)·(k·b·s/E)·E_l·h·2 bytes of input each, and no MoE
    send or receive left; the counts' all_to_all stays (E int64)."""
    from collections import Counter

    from vcluster.planner.simulation import gpt_step_traces
    from vcluster.runtime.tracing.ops import TraceCollective, TraceRecv, TraceSend
    from vcluster.timing.hardware_model import HardwareCostModel
    cfg, n = _cfg(), 4
    par = ParallelConfig(global_batch=8, dp=4, ep=n)
    (trace,) = gpt_step_traces(cfg, par, HardwareCostModel(load_hardware(H100), "bf16"))
    ep_group = par.mesh().group("ep", 0)
    a2a = Counter(op.nbytes for op in trace.ops if isinstance(op, TraceCollective)
                  and op.collective == "all_to_all" and op.group == ep_group)
    assert not any(isinstance(op, (TraceSend, TraceRecv)) for op in trace.ops)
    per_expert, e_l = cfg.moe_top_k * cfg.seq // cfg.experts, cfg.experts // n
    rows = (n - 1) * per_expert * e_l                    # sent = received, balanced
    m = par.microbatches
    assert a2a == {rows * cfg.hidden * 2 * n // (n - 1): 4 * cfg.layers * m,
                   cfg.experts * 8: cfg.layers * m}


# --- MoE beside context parallelism and ZeRO (the merge of moeint into cp/ZeRO) -------

def test_plan_with_max_cp_and_max_ep_carries_both_columns(tmp_path):
    """--max-cp and --max-ep together: a dense model searches cp (ep 1); an MoE model
    searches ep and rejects its cp > 1 splits as cp_with_experts; the JSON carries both."""
    kw = dict(hidden=256, layers=4, heads=8, seq=128, vocab=1024, gpus=4, global_batch=8,
              hardware=H100, arch="llama", kv_heads=4, ffn_hidden=512,
              recompute=("none",), sequence_parallel=(False,), schedules=("1f1b",),
              micro_batches=(1,), replay=1, workers=1, progress=False, max_cp=2, max_ep=4)
    dense = plan_gpt(**kw)
    assert {"cp", "ep"} <= set(dense.columns) and set(dense["cp"]) == {1, 2}
    assert set(dense["ep"]) == {1}
    moe = plan_gpt(**kw, experts=8)
    assert set(moe["cp"]) == {1} and set(moe["ep"]) == {1, 2, 4}
    assert moe.attrs["rejected"]["cp_with_experts"] > 0
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4",
                 "--heads", "8", "--kv-heads", "4", "--ffn-hidden", "512", "--seq", "128",
                 "--vocab", "1024", "--experts", "8", "--gpus", "4", "--global-batch", "8",
                 "--max-ep", "2", "--max-cp", "2", "--hardware", H100, "--replay", "1",
                 "--workers", "1", "--quiet", "--json", str(out)]) == 0
    cands = json.loads(out.read_text())["candidates"]
    assert {c["ep"] for c in cands} == {1, 2} and {c["cp"] for c in cands} == {1}


def test_zero_with_expert_parallelism_is_refused_not_priced_as_ddp(capsys):
    """The executor cannot run ZeRO with ep > 1; the simulator once traced such a plan as
    DDP while the memory model counted ZeRO-1 and the printout said "ZeRO stage 1". The
    plan's rulebook now refuses it, so no engine prices what it does not run."""
    with pytest.raises(ConfigError, match=r"zero_stage=1 with expert parallelism \(ep=2\)"):
        ParallelConfig(global_batch=8, dp=4, ep=2, distributed_optimizer=True)
    assert main(["simulate", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4",
                 "--heads", "8", "--kv-heads", "4", "--ffn-hidden", "512", "--seq", "128",
                 "--vocab", "1024", "--experts", "8", "--ep", "2", "--dp", "4",
                 "--global-batch", "8", "--distributed-optimizer", "--hardware", H100]) == 2
    assert "--zero=1: zero_stage=1 with expert parallelism" in capsys.readouterr().err
