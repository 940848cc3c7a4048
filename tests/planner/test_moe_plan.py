"""Mixture of experts in simulate and plan: the traced FLOPs of a balanced MoE step equal
6·N_active·tokens + attention (moe_model_flops) and MFU uses them; a skewed load (the
busiest expert 2x the mean) lengthens the simulated step; the memory model counts a
rank's experts; plan searches ep and its JSON carries it."""

import json

import numpy as np
import pytest

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


@pytest.mark.parametrize("top_k, fs, router", [(8, 0, "sigmoid"), (4, 40, "softmax"),
                                               (3, 24, "sigmoid")])
def test_fine_grained_traced_flops_equal_the_closed_form(top_k, fs, router):
    """Top-k up to E and a shared expert of width F_s: the traced step's FLOPs are
    moe_model_flops with k·3·h·f_e + 3·h·F_s per token and layer, under ep and pp."""
    cfg = _cfg(hidden=32, layers=2, heads=4, seq=16, vocab=64, kv_heads=2, ffn_hidden=48,
               moe_top_k=top_k, moe_ffn_hidden=12, moe_shared_ffn_hidden=fs,
               moe_router=router)
    par = ParallelConfig(global_batch=4, micro_batch=1, dp=2, ep=2, pp=2)
    mesh = par.mesh()
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    flops = sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))
    want = moe_model_flops(4, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab, cfg.heads,
                           cfg.kv_heads, cfg.experts, top_k, 12, shared_ffn_hidden=fs)
    assert flops == want == model_flops(cfg, 4)
    dense = moe_model_flops(4, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab, cfg.heads,
                            cfg.kv_heads, cfg.experts, top_k, 12)
    assert want - dense == 6 * 4 * cfg.seq * cfg.layers * 3 * cfg.hidden * fs


@pytest.mark.parametrize("fs", [0, 32])
def test_a_ranks_expert_flops_shrink_with_tp(fs):
    """The experts (and the shared expert) are split over tp (etp = tp), never
    replicated: a rank's traced expert FLOPs times tp is the same for tp 1, 2 and 4, and
    the router's do not change."""
    cfg = _cfg(hidden=32, layers=2, heads=4, seq=16, vocab=64, kv_heads=4, ffn_hidden=48,
               moe_top_k=4, moe_ffn_hidden=16, moe_shared_ffn_hidden=fs)
    per_tp = {}
    for tp in (1, 2, 4):
        par = ParallelConfig(global_batch=2, micro_batch=1, dp=2, ep=2, tp=tp,
                             sequence_parallel=tp > 1)
        mesh = par.mesh()
        trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))[0]
        ops = [op for op in trace.ops if isinstance(op, TraceCompute)]
        per_tp[tp] = (sum(op.flops for op in ops if "moe: expert" in op.name),
                      sum(op.flops for op in ops if "moe: router" in op.name))
    assert per_tp[1][0] > 0
    assert {tp * e for tp, (e, _) in per_tp.items()} == {per_tp[1][0]}
    assert {r for _, r in per_tp.values()} == {per_tp[1][1]}


def test_a_ranks_expert_flops_do_not_grow_with_tp_when_folded():
    """etp = 1: the same model and global batch on 4 GPUs as tp 1 (ep 4 over dp), tp 2 and
    tp 4 (the expert group folded over the tp ranks): rank 0's expert FLOPs per step are
    the same — each rank routes its sequence slice and holds E/ep whole experts — and
    equal etp = tp's at tp 2 (experts split over tp instead)."""
    cfg = _cfg(hidden=32, layers=2, heads=4, seq=16, vocab=64, kv_heads=4, ffn_hidden=48,
               moe_top_k=2, moe_ffn_hidden=16)

    def expert_flops(**kw):
        par = ParallelConfig(global_batch=4, micro_batch=1, **kw)
        mesh = par.mesh()
        trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))[0]
        return sum(op.flops for op in trace.ops
                   if isinstance(op, TraceCompute) and "moe: expert" in op.name)

    folded = {tp: expert_flops(dp=4 // tp, tp=tp, ep=4, etp=1, sequence_parallel=tp > 1)
              for tp in (1, 2, 4)}
    assert folded[1] > 0 and set(folded.values()) == {folded[1]}
    assert expert_flops(dp=2, tp=2, ep=2, sequence_parallel=True) == folded[1]


@pytest.mark.parametrize("pp, first", [(1, None), (2, None), (2, 1)])
def test_dense_first_layers_flops_and_memory(pp, first):
    """DeepSeek-style dense-first layers: the traced step's FLOPs equal moe_model_flops
    with those layers' MLP dense (3·h·f), and each pipeline rank's parameters count its
    own dense and MoE layers (summed: the model's, the experts' divided by ep)."""
    cfg = _cfg(hidden=32, layers=4, heads=4, seq=16, vocab=64, kv_heads=2, ffn_hidden=48,
               moe_top_k=4, moe_ffn_hidden=12, moe_shared_ffn_hidden=12,
               moe_dense_layers=(0, 1))
    par = ParallelConfig(global_batch=4, micro_batch=1, dp=2, ep=2, pp=pp,
                         first_stage_layers=first)
    mesh = par.mesh()
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    flops = sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))
    assert flops == model_flops(cfg, 4) == moe_model_flops(
        4, cfg.seq, 4, cfg.hidden, cfg.vocab, cfg.heads, cfg.kv_heads, cfg.experts, 4, 12,
        shared_ffn_hidden=12, dense_layers=2, ffn_hidden=48)
    want = sum(np.prod(s) / (2 if n.rsplit(".", 1)[-1] in EXPERT_PARAMS else 1)
               for n, s in GPT(cfg).param_shapes().items())
    assert sum(rank_params(cfg, par, r) for r in range(pp)) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("pp, dense, first", [(4, (0, 1), None), (5, (0, 1, 2), 3)])
def test_the_simulated_step_runs_the_dense_first_layers_where_they_are(pp, dense, first):
    """The short pipeline the simulator traces keeps the first stage's dense layers: the
    stitched step executes exactly the model's FLOPs (no recomputation)."""
    cfg = _cfg(layers=11 if first else 8, moe_top_k=4, moe_ffn_hidden=128,
               moe_dense_layers=dense)
    par = ParallelConfig(global_batch=8, micro_batch=1, dp=2, ep=2, pp=pp,
                         first_stage_layers=first)
    r = simulate_gpt(cfg, par, load_hardware(H100))
    executed = r.hardware_tflops_per_gpu * 1e12 * r.step_time_s * r.gpus
    assert executed == pytest.approx(model_flops(cfg, 8), rel=1e-6)


def test_deepseek_v3_loads_with_its_dense_first_layers():
    cfg = GPTConfig.of_model("deepseek-v3", seq=4096, timing_only=True)
    assert (cfg.layers, cfg.moe_dense_layers, cfg.ffn_hidden, cfg.moe_ffn_hidden) == \
        (61, (0, 1, 2), 18432, 2048)
    assert (cfg.experts, cfg.moe_top_k, cfg.moe_shared_ffn_hidden, cfg.moe_router,
            cfg.moe_routed_scaling) == (256, 8, 2048, "sigmoid", 2.5)
    assert GPTConfig.of_model("deepseek-v3", seq=4096, timing_only=True,
                              layers=4).moe_dense_layers == (0, 1, 2)


def test_memory_counts_the_experts_a_rank_holds():
    """rank_params = every parameter once, the experts' divided by ep·tp (split over ep
    by expert and over tp by their hidden dimension), the shared expert's by tp, the rest
    as the dense Llama's."""
    for cfg in (_cfg(), _cfg(kv_heads=8, ffn_hidden=256),
                _cfg(moe_top_k=8, moe_shared_ffn_hidden=96, moe_ffn_hidden=64)):
        for ep in (1, 2, 4, 8):
            par = ParallelConfig(global_batch=8, dp=8, ep=ep)
            want = sum(np.prod(s) / (ep if n.rsplit(".", 1)[-1] in EXPERT_PARAMS else 1)
                       for n, s in GPT(cfg).param_shapes().items())
            assert rank_params(cfg, par, 0) == pytest.approx(want, rel=1e-12), (cfg.arch, ep)
    # tp 2: a layer's MoE block on a rank (its parameters less the dense MLP's 3·h·f/t)
    cfg, tp, ep = _cfg(moe_top_k=8, moe_shared_ffn_hidden=96, moe_ffn_hidden=64), 2, 4
    par = ParallelConfig(global_batch=8, dp=4, ep=ep, tp=tp)
    dense = _cfg(experts=0, moe_top_k=2, moe_ffn_hidden=None)
    h, layers = cfg.hidden, cfg.layers
    moe_block = rank_params(cfg, par, 0) - rank_params(dense, par, 0) \
        + layers * 3 * h * dense.ffn_hidden / tp
    assert moe_block == pytest.approx(layers * (h * cfg.experts + 3 * h * 64 * cfg.experts
                                                / (ep * tp) + 3 * h * 96 / tp), rel=1e-12)


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
    searches ep and cp together, an ep group taking whole cp groups (ep = cp × a divisor
    of dp); the JSON carries both."""
    kw = dict(hidden=256, layers=4, heads=8, seq=128, vocab=1024, gpus=4, global_batch=8,
              hardware=H100, arch="llama", kv_heads=4, ffn_hidden=512,
              recompute=("none",), sequence_parallel=(False,), schedules=("1f1b",),
              micro_batches=(1,), replay=1, workers=1, progress=False, max_cp=2, max_ep=4)
    dense = plan_gpt(**kw)
    assert {"cp", "ep"} <= set(dense.columns) and set(dense["cp"]) == {1, 2}
    assert set(dense["ep"]) == {1}
    moe = plan_gpt(**kw, experts=8)
    assert set(moe["cp"]) == {1, 2} and set(moe["ep"]) == {1, 2, 4}
    assert set(moe[moe["cp"] == 2]["ep"]) == {1, 2, 4}     # no group, cp x 1, cp x 2
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4",
                 "--heads", "8", "--kv-heads", "4", "--ffn-hidden", "512", "--seq", "128",
                 "--vocab", "1024", "--experts", "8", "--gpus", "4", "--global-batch", "8",
                 "--max-ep", "2", "--max-cp", "2", "--hardware", H100, "--replay", "1",
                 "--workers", "1", "--quiet", "--json", str(out)]) == 0
    cands = json.loads(out.read_text())["candidates"]
    assert {c["ep"] for c in cands} == {1, 2} and {c["cp"] for c in cands} == {1, 2}


def test_distributed_optimizer_with_expert_parallelism_is_simulated_as_it_runs(tmp_path):
    """The executor runs ZeRO-1 with ep > 1 (the experts' state over the expert-data-
    parallel ranks); the simulator once traced such a plan as DDP while the memory model
    counted ZeRO-1. Now the traced step is the program's: the optimizer state is smaller
    than DDP's, and ZeRO-3 shards the weights too."""
    base = ["simulate", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4",
            "--heads", "8", "--kv-heads", "4", "--ffn-hidden", "512", "--seq", "128",
            "--vocab", "1024", "--experts", "8", "--ep", "2", "--dp", "4",
            "--global-batch", "8", "--hardware", H100]
    docs = {}
    for name, flags in (("ddp", []), ("zero1", ["--distributed-optimizer"]),
                        ("zero3", ["--zero", "3"])):
        assert main(base + flags + ["--json", str(tmp_path / f"{name}.json")]) == 0
        docs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert [docs[k]["zero_stage"] for k in ("ddp", "zero1", "zero3")] == [0, 1, 3]
    mem = {k: d["memory"][0] for k, d in docs.items()}
    assert mem["zero1"]["optimizer_bytes"] < mem["ddp"]["optimizer_bytes"]
    assert mem["zero3"]["params_bytes"] < mem["zero1"]["params_bytes"]
