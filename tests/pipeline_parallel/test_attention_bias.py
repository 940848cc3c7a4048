"""Biases on the attention's projections in the Llama block (issue 52: Qwen2/Qwen2.5's q, k,
v biases; GPT-OSS's q, k, v and output biases; ``GPTConfig(qkv_bias=, out_bias=)``,
:mod:`tensor_parallel.gqa`).

The numpy reference's bias gradients equal finite differences. The emulated dp x pp x cp
x tp training equals the reference (rtol 1e-9, float64: forward loss, logits, every
gradient — the biases' included — and the parameters after 3 SGD steps) over tp 1, 2, 4
with K/V heads split (kv_heads >= tp) and replicated (kv_heads < tp), sequence
parallelism on and off, cp 2 (ring), pp 2, dp 2 with ZeRO stages 1 and 3, 1, 2 and 4
micro-batches, QK-norm, the recomputation policies and an MoE model. Under sequence
parallelism db_o is partial over tp: a test fails if it is not summed. The traced
program moves the emulator's bytes, rank by rank, and the biases add exactly their
closed-form bytes (the K/V replicas' db_kv, the sequence-parallel db_o) and no FLOPs.
The memory model's parameters are the program's and the model layer's count (Qwen2.5-32B:
32,763,876,352); Qwen2.5-32B loads and simulates. (GPT-OSS's experts' and router's biases:
test_moe_bias.py.)"""

import math

import numpy as np
import pytest

from modeling import (MLP, Attention, ConfigError, Layer, ModelSpec, MoE, load_model,
                      parameter_count)
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from tensor_parallel.llama import llama_piece, llama_split_dim
from vcluster.planner.memory import rank_params
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, comm_signature,
                                      trace_comm_signature, trace_program)

from .gpt_data import (assert_gradients_central, assert_fit_equals_reference,
                       count_params, mesh_of, token_data)

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12
QKV = dict(qkv_bias=True)
BOTH = dict(qkv_bias=True, out_bias=True)


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24), **kw})


def _names(shapes, i: int) -> list[str]:
    return [n.split(".")[-1] for n in shapes if n.startswith(f"layers.{i}.")]


# --- configuration -------------------------------------------------------------------------
def test_config_takes_the_biases_in_the_programs_order():
    shapes = GPT(_cfg(**BOTH, qk_norm=True, attention_sinks=True)).param_shapes()
    assert _names(shapes, 1)[:11] == ["attn_norm_g", "w_q", "b_q", "w_kv", "b_kv", "q_norm_g",
                                      "k_norm_g", "w_o", "b_o", "sinks", "mlp_norm_g"]
    assert (shapes["layers.0.b_q"], shapes["layers.0.b_kv"], shapes["layers.0.b_o"]) == \
        ((16,), (2, 8), (16,))
    assert "layers.0.b_o" not in GPT(_cfg(**QKV)).param_shapes()
    moe = GPT(_cfg(**BOTH, experts=4, moe_ffn_hidden=12)).param_shapes()
    assert _names(moe, 1)[:8] == ["attn_norm_g", "w_q", "b_q", "w_kv", "b_kv", "w_o", "b_o",
                                  "mlp_norm_g"]
    # over tp: b_q by heads, b_kv as W_kv's last dimension, b_o whole
    assert [llama_split_dim(f"layers.0.{n}") for n in ("b_q", "b_kv", "b_o")] == [0, 1, None]
    b_kv = np.arange(16.0).reshape(2, 8)          # kv_heads 2 of d 4: [k0 k1 | v0 v1]
    assert np.array_equal(llama_piece("layers.0.b_kv", b_kv, 4, 3, 2), b_kv[:, 4:])
    assert np.array_equal(llama_piece("layers.0.b_kv", b_kv, 2, 0, 2), b_kv[:, :4])


@pytest.mark.parametrize("kw, match", [
    (dict(qkv_bias=True, arch="gpt", kv_heads=None, ffn_hidden=None),
     "qkv_bias=True: qkv_bias needs arch='llama': the GPT block's attention always has its "
     "biases"),
    (dict(out_bias=True, arch="gpt", kv_heads=None, ffn_hidden=None),
     "out_bias=True: out_bias needs arch='llama'"),
    (dict(qkv_bias="yes"), "qkv_bias='yes': not a boolean"),
    (dict(out_bias=1.5), "out_bias=1.5: not a boolean"),
    (dict(qkv_bias=True, kv_heads=None, kv_lora_rank=6, qk_nope_head_dim=2,
          qk_rope_head_dim=2, v_head_dim=4),
     "qkv_bias=True: multi-head latent attention has no sliding-window, sink or bias form"),
])
def test_config_refuses_biases_where_they_do_not_fit_by_field(kw, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _cfg(**kw)


def test_qwen2_5_loads_with_its_q_k_v_biases_and_its_count():
    """Qwen2.5-32B (q, k, v biases, no output bias): the config, the program's parameters,
    the memory model's (one rank; and its pipeline ranks summed) and the model layer's
    count agree: 32,763,876,352."""
    cfg = GPTConfig.of_model("qwen2.5-32b", seq=4096, timing_only=True)
    assert (cfg.qkv_bias, cfg.out_bias, cfg.arch) == (True, False, "llama")
    total = parameter_count(load_model("qwen2.5-32b")).total
    assert total == 32_763_876_352
    assert sum(math.prod(s) for s in GPT(cfg).param_shapes().values()) == total
    assert rank_params(cfg, ParallelConfig(global_batch=8), 0) == total
    par = ParallelConfig(global_batch=8, pp=4)
    assert sum(rank_params(cfg, par, r) for r in range(4)) == total
    # tp 8 (kv_heads 8): each rank holds its share of every bias vector but b_o (none)
    t8 = ParallelConfig(global_batch=8, tp=8)
    h, d, layers = cfg.hidden, cfg.head_dim, cfg.layers
    assert rank_params(cfg, t8, 0) - rank_params(GPTConfig.of_model(
        "qwen2.5-32b", seq=4096, timing_only=True, qkv_bias=False), t8, 0) == \
        layers * (h + 2 * d * cfg.kv_heads) / 8


def test_gpt_oss_loads_with_its_attention_biases():
    """GPT-OSS loads with q, k, v and output biases (its experts' and router's:
    test_moe_bias.py)."""
    for preset in ("gpt-oss-20b", "gpt-oss-120b"):
        cfg = GPTConfig.of_model(preset, 4096, timing_only=True)
        assert (cfg.qkv_bias, cfg.out_bias) == (True, True)


def _spec(qkv: bool, out: bool, mlp=None) -> ModelSpec:
    return ModelSpec("tiny-qwen2", 16, 32, (Layer(Attention(4, 2, 4, qkv_bias=qkv,
                                                            out_bias=out),
                                                  mlp or MLP("swiglu", 24)),) * 4)


@pytest.mark.parametrize("qkv, out", [(True, False), (True, True), (False, True)])
def test_from_spec_takes_the_biases_and_counts_them(qkv, out):
    spec = _spec(qkv, out)
    cfg = GPTConfig.from_spec(spec, 8)
    assert (cfg.qkv_bias, cfg.out_bias) == (qkv, out)
    total = parameter_count(spec).total
    assert sum(math.prod(s) for s in GPT(cfg).param_shapes().values()) == total
    assert rank_params(cfg, ParallelConfig(global_batch=4), 0) == total
    # MoE with or without expert and router biases runs (test_moe_bias.py); a dense MLP
    # with biases is refused by name
    moe = GPTConfig.from_spec(_spec(qkv, out, MoE(4, 2, MLP("swiglu", 12))), 8)
    assert (moe.qkv_bias, moe.out_bias, moe.experts) == (qkv, out, 4)
    routed = GPTConfig.from_spec(_spec(qkv, out, MoE(4, 2, MLP("swiglu", 12),
                                                     router_bias=True)), 8)
    assert (routed.moe_router_bias, routed.moe_expert_bias) == (True, False)
    with pytest.raises(ConfigError, match="cannot run biases in the MLP of a Llama block"):
        GPTConfig.from_spec(_spec(qkv, out, MLP("swiglu", 24, True)), 8)


# --- the reference -------------------------------------------------------------------------
def test_reference_gradients_match_finite_differences():
    """Every entry of every bias (and some of every other parameter) of a tiny model with
    q, k, v and output biases and QK-norm (the biases enter before the norm) against
    central differences of the loss."""
    cfg = GPTConfig(hidden=8, layers=2, heads=4, seq=6, vocab=11, arch="llama", kv_heads=2,
                    ffn_hidden=12, qk_norm=True, **BOTH)
    model = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, 2, seed=1)
    grads = assert_gradients_central(model, tokens, targets, ("b_q", "b_kv", "b_o"))
    assert min(np.abs(grads[f"layers.1.{n}"]).max() for n in ("b_q", "b_kv", "b_o")) > 1e-4


def test_the_biases_change_the_model():
    """Biases of zero are the model without them, bit for bit; the seed's are not."""
    cfg, base = _cfg(**BOTH), _cfg()
    tokens, targets = token_data(cfg, 2)
    params = GPT(cfg, seed=1).init_params()
    plain = {n: a for n, a in params.items() if n.rsplit(".", 1)[-1] not in ("b_q", "b_kv",
                                                                               "b_o")}
    zeros = {n: a if n in plain else np.zeros_like(a) for n, a in params.items()}
    assert GPT(cfg).reference_forward(tokens, targets, zeros)[0] == \
        GPT(base).reference_forward(tokens, targets, plain)[0]
    assert GPT(cfg).reference_forward(tokens, targets, params)[0] != \
        GPT(base).reference_forward(tokens, targets, plain)[0]


# --- emulated training equals the reference ---------------------------------------------------
CASES = [  # mesh, GPTConfig fields, extra ParallelConfig fields (micro_batch: 1 if absent)
    ("tp1", QKV, {}),                                                     # 4 micro-batches
    ("tp1", BOTH, {"micro_batch": 4}),                                    # 1 micro-batch
    ("tp2", dict(BOTH, kv_heads=1), {"sequence_parallel": True}),         # K/V replicas, SP
    ("tp2", dict(BOTH, kv_heads=2), {"micro_batch": 2}),                  # split, no SP, m 2
    ("tp4", dict(BOTH, kv_heads=2), {"sequence_parallel": True, "micro_batch": 2}),
    ("tp4", dict(QKV, kv_heads=4), {"attention": "unfused", "recompute": "selective"}),
    ("tp4", dict(QKV, kv_heads=1), {"tp_overlap": "none"}),
    ("tp2", dict(BOTH, qk_norm=True), {"sequence_parallel": True, "recompute": "op"}),
    ("tp2", dict(BOTH, kv_heads=1), {"recompute": "op"}),
    ("tp2", BOTH, {"sequence_parallel": True, "recompute": "full"}),
    ("pp2", dict(BOTH, layers=4), {"schedule": "1f1b"}),
    ("pp2 tp2", dict(BOTH, layers=4, kv_heads=1), {"schedule": "zero_bubble",
                                                   "sequence_parallel": True}),
    ("cp2", dict(BOTH, seq=16), {"cp_algorithm": "ring"}),
    ("cp2 tp2", dict(BOTH, seq=16, kv_heads=1), {"cp_algorithm": "ring",
                                                 "sequence_parallel": True}),
    ("dp2", BOTH, {"zero_stage": 1}),
    ("dp2 tp2", dict(BOTH, kv_heads=1), {"zero_stage": 3, "sequence_parallel": True}),
    ("dp2 tp2", QKV, {"zero_stage": 1, "sequence_parallel": True, "micro_batch": 2}),
]


def _parallel(mesh, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=B, micro_batch=kw.pop("micro_batch", 1),
                          **dict(mesh.shape), **kw)


def _check_training(cluster, model, par, tokens, targets, **ref_kw):
    return assert_fit_equals_reference(cluster, model, par, tokens, targets, steps=STEPS,
                                       lr=LR, rtol=RTOL, atol=ATOL, **ref_kw)


@pytest.mark.parametrize("mesh, fields, extra", CASES,
                         ids=[f"{m.replace(' ', '-')}-" + "-".join(
                             f"{a}={b}" for a, b in {**f, **e}.items()).replace(" ", "")
                              for m, f, e in CASES])
def test_training_equals_the_reference(cluster_of, mesh, fields, extra):
    mesh, cfg = mesh_of(mesh), _cfg(**fields)
    model = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B, seed=0)
    par = _parallel(mesh, **extra)
    run, ref = _check_training(cluster_of(mesh), model, par, tokens, targets)
    for n in ("b_q", "b_kv") + (("b_o",) if cfg.out_bias else ()):
        assert np.abs(ref.grads[f"layers.0.{n}"]).max() > 1e-6, n      # the biases learn


def test_moe_training_with_attention_biases_equals_the_reference(cluster_of):
    """experts = 4, top-2, ep 2 (dp 2), tp 2 with sequence parallelism, q, k, v and output
    biases."""
    cfg = _cfg(experts=4, moe_top_k=2, moe_ffn_hidden=12, **BOTH)
    par = ParallelConfig(global_batch=B, micro_batch=1, dp=2, ep=2, tp=2,
                         sequence_parallel=True)
    model, (tokens, targets) = GPT(cfg, seed=3), token_data(cfg, B, seed=0)
    _check_training(cluster_of(par.mesh()), model, par, tokens, targets, parallel=par)


@pytest.mark.parametrize("zero", [0, 2], ids=["once-per-step", "zero2-per-microbatch"])
def test_sequence_parallel_db_o_is_summed_over_tp(cluster_of, zero):
    """tp 2 with sequence parallelism, 2 micro-batches: each rank's dy holds half of the
    rows, so its own db_o is a partial sum; the emulated db_o equals the reference's whole
    one only when the ranks' parts are summed over tp (the layer's ``seq_partial``, once
    per step — or every micro-batch under ZeRO-2, whose gradients leave the rank each
    micro-batch). (Checked: without the sum this test fails.)"""
    cfg = _cfg(**BOTH)
    model, (tokens, targets) = GPT(cfg, seed=1), token_data(cfg, B, seed=0)
    mesh = mesh_of("dp2 tp2") if zero else mesh_of("tp2")
    par = _parallel(mesh, sequence_parallel=True, micro_batch=1 if zero else 2,
                    zero_stage=zero)
    run = model.fit(cluster_of(mesh), tokens, targets, steps=1, parallel=par, lr=LR)
    ref = model.fit_reference(tokens, targets, steps=1, lr=LR)
    for i in range(cfg.layers):
        name = f"layers.{i}.b_o"
        assert np.abs(ref.grads[name]).max() > 1e-3
        np.testing.assert_allclose(run.grads[name], ref.grads[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)


# --- traffic and FLOPs: trace == emulator, closed forms ------------------------------------
TRAFFIC = [("tp2", dict(BOTH, kv_heads=1), {"sequence_parallel": True, "micro_batch": 2}),
           ("tp4", dict(QKV, kv_heads=2), {"micro_batch": 2}),
           ("pp2 tp2", dict(BOTH, layers=4), {"sequence_parallel": True}),
           ("cp2 tp2", dict(BOTH, seq=16, kv_heads=1), {"sequence_parallel": True}),
           ("dp2 tp2", dict(BOTH, kv_heads=1), {"zero_stage": 3, "sequence_parallel": True})]


@pytest.mark.parametrize("mesh, fields, extra", TRAFFIC,
                         ids=[f"{m.replace(' ', '-')}-{i}" for i, (m, _, _) in
                              enumerate(TRAFFIC)])
def test_traced_traffic_equals_the_emulator(cluster_of, mesh, fields, extra):
    mesh, cfg = mesh_of(mesh), _cfg(**fields)
    model, (tokens, targets) = GPT(cfg, seed=1), token_data(cfg, B, seed=0)
    par = _parallel(mesh, **extra)
    cluster = cluster_of(mesh)
    job = model.train_job(mesh, par, steps=1, bucket_bytes=4096)
    cluster.reset_stats()
    cluster.run(train_program, model.device_args(mesh, job, tokens, targets))
    events = cluster.trace()
    for t in trace_program(mesh, train_program, model.meta_args(mesh, par, 1,
                                                                bucket_bytes=4096)):
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank


def _tp_all_reduce_bytes(cfg, par) -> int:
    mesh = par.mesh()
    trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par), ranks=[0])[0]
    tp = tuple(mesh.group("tp", 0))
    return sum(op.nbytes for op in trace.ops if isinstance(op, TraceCollective)
               and op.collective == "all_reduce" and op.group == tp)


@pytest.mark.parametrize("kv, sp, m", [(1, True, 2), (1, False, 1), (4, True, 4),
                                       (2, False, 2)])
def test_the_biases_add_their_closed_form_bytes_and_no_flops(kv, sp, m):
    """tp 4, one step: the tp all-reduces grow by, per layer, the K/V replicas' db_kv
    slots (kv_heads·2·d when kv_heads < tp, once per step) and the sequence-parallel db_o
    (h, once per step, joined to the norms' gains); the step's traced FLOPs are the same
    with or without biases (their adds and row sums are elementwise: 0 FLOPs), i.e.
    model_flops (plus the K/V replicas' redundant products)."""
    base = _cfg(kv_heads=kv, layers=2)
    cfg = _cfg(kv_heads=kv, layers=2, **BOTH)
    par = ParallelConfig(global_batch=4, micro_batch=4 // m, tp=4, sequence_parallel=sp)
    extra = _tp_all_reduce_bytes(cfg, par) - _tp_all_reduce_bytes(base, par)
    itemsize = np.dtype(cfg.dtype).itemsize
    per_layer = (kv * 2 * cfg.head_dim if kv < 4 else 0) + (cfg.hidden if sp else 0)
    assert extra == cfg.layers * per_layer * itemsize
    mesh = par.mesh()
    traces, flops = {}, {}
    for c in (base, cfg):
        traces[c] = trace_program(mesh, train_program, GPT(c).meta_args(mesh, par))
        flops[c] = sum(op.flops for t in traces[c] for op in t.ops
                       if isinstance(op, TraceCompute))
    assert flops[cfg] == flops[base] and model_flops(cfg, 4) == model_flops(base, 4)
    # K/V replicas (kv_heads < tp) recompute their head's K and V: (t - c)·6·B·s·h·2d more
    redundant = (4 - kv) * 6 * 4 * cfg.seq * cfg.hidden * 2 * cfg.head_dim * cfg.layers \
        if kv < 4 else 0
    assert flops[cfg] == model_flops(cfg, 4) + redundant
    traces = traces[cfg]
    adds = [op for op in traces[0].ops if isinstance(op, TraceCompute)
            and op.name in ("gpt: attention: + b_q", "gpt: attention: + b_kv",
                            "gpt: attention: + b_o", "gpt: attention: db_o")]
    assert {op.name for op in adds} == {"gpt: attention: + b_q", "gpt: attention: + b_kv",
                                        "gpt: attention: + b_o", "gpt: attention: db_o"}
    assert all(op.flops == 0 and op.kernel.kind.value == "elementwise" for op in adds)


@pytest.mark.parametrize("kv, tp", [(2, 2), (1, 4), (4, 4)])
def test_memory_params_are_what_the_program_holds(kv, tp):
    """pp 2 x tp: the memory model's parameters per pipeline rank = the pieces the
    program's stages hold (b_q, b_kv split or replicated as W_q, W_kv; b_o whole)."""
    cfg = _cfg(kv_heads=kv, layers=4, **BOTH)
    par = ParallelConfig(global_batch=4, pp=2, tp=tp)
    mesh = par.mesh()
    job = GPT(cfg).meta_args(mesh, par)[0][0]
    ranks = [mesh.rank({"dp": 0, "pp": p, "tp": 0}) for p in range(2)]
    held = [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)
                and op.name == "params")
            for t in trace_program(mesh, count_params, [(job,)] * mesh.size, ranks=ranks)]
    assert held == [rank_params(cfg, par, r) for r in range(2)]


def test_qwen2_5_simulates_from_the_command_line(capsys):
    """``vcluster simulate gpt --model qwen2.5-32b`` on one H100 node with tp 8 runs and
    names the biases in its title (the plan does not fit in 80 GB: --allow-oom)."""
    from vcluster.cli.main import main
    argv = ["simulate", "gpt", "--model", "qwen2.5-32b", "--seq", "4096", "--tp", "8",
            "--dp", "1", "--micro-batch", "1", "--global-batch", "8", "--hardware",
            "h100-dgx"]
    assert main(argv + ["--allow-oom"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-32b (Llama h=5120 l=64 a=40 kv=8 f=27648 qkv-bias s=4096" in out, out
    assert "step time" in out


def test_the_flags_and_the_serving_refusal():
    """--qkv-bias/--out-bias reach GPTConfig (and the title); the serving program runs
    the attention biases (Qwen2.5's config is served), and GPT-OSS's (with its windows,
    sinks and MoE biases, issue 53) when traced."""
    import argparse

    from pipeline_parallel.decoder import serve_config
    from vcluster.cli.args import add_model_arguments, gpt_config, model_title
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--arch", "llama", "--hidden", "16", "--layers", "2",
                              "--heads", "4", "--vocab", "32", "--seq", "8", "--qkv-bias",
                              "--out-bias"])
    cfg = gpt_config(args)
    assert (cfg.qkv_bias, cfg.out_bias) == (True, True)
    assert "qkv-bias out-bias" in model_title(cfg)
    assert serve_config("qwen2.5-32b", timing_only=True).qkv_bias
    assert serve_config("gpt-oss-20b", timing_only=True).attention_sinks
