"""Biases in the mixture of experts of the Llama block (issue 52: GPT-OSS's router and
experts; ``GPTConfig(moe_router_bias=, moe_expert_bias=)``, :mod:`tensor_parallel.moe`).

The router's logits are l = x W_r + b_r; each routed expert is O = (silu(X W_g + b_g) *
(X W_u + b_u)) W_d + b_d, combined as y = Σ_c g_c O_c — b_d inside the routing weight,
as Hugging Face's GptOssExperts adds down_proj_bias before weighting by the routing
weights (checked against a loop written that way). The numpy reference's bias gradients
equal finite differences. The emulated dp x ep x pp x cp x tp training equals the
single-process reference (rtol 1e-9, float64: forward loss, logits, every gradient — the
biases' included — and the parameters after 3 SGD steps) over ep 1, 2, 4; tp 2 with the
experts split over it (etp 2) and folded (etp 1); sequence parallelism; pp 2; dp 2 and 4;
ZeRO 1 and 3 with ep; 1, 2 and 4 micro-batches; the all-gather dispatcher; cp 2; with the
attention's biases too, as GPT-OSS. The experts' biases are reduced with their weights
over the expert-data-parallel group only: a test fails when b_down is reduced with the
replicated parameters instead (checked by breaking it). The traced program moves the
emulator's bytes, rank by rank; the biases add no FLOPs. The memory model's parameters
are the program's pieces; GPT-OSS-20B and -120B load with the model layer's counts and
simulate from the command line."""

import math

import numpy as np
import pytest

from modeling import MLP, Attention, ConfigError, Layer, ModelSpec, MoE, load_model, \
    parameter_count
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from tensor_parallel.moe_layer import moe_piece
from tensor_parallel.moe_reference import moe_reference
from vcluster.planner.memory import rank_params
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, comm_signature,
                                      trace_comm_signature, trace_program)

from .gpt_data import (assert_gradients_central, assert_fit_equals_reference,
                       count_params, token_data)

pytestmark = pytest.mark.timeout(300)

STEPS, LR = 3, 0.1
RTOL, ATOL = 1e-9, 1e-12
BIASES = dict(moe_router_bias=True, moe_expert_bias=True)
OSS = dict(BIASES, qkv_bias=True, out_bias=True)          # GPT-OSS: the attention's too
NAMES = ("b_router", "moe_b_gate", "moe_b_up", "moe_b_down")


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24, experts=8, moe_top_k=2,
                               moe_ffn_hidden=12), **kw})


def _names(shapes, i: int) -> list[str]:
    return [n.split(".")[-1] for n in shapes if n.startswith(f"layers.{i}.")]


# --- configuration -------------------------------------------------------------------------
def test_config_takes_the_biases_in_the_programs_order():
    shapes = GPT(_cfg(**OSS, moe_shared_ffn_hidden=6)).param_shapes()
    assert _names(shapes, 1)[8:] == ["w_router", "b_router", "moe_gate", "moe_up",
                                     "moe_down", "moe_b_gate", "moe_b_up", "moe_b_down",
                                     "shared_gate", "shared_up", "shared_down"]
    assert [shapes[f"layers.0.{n}"] for n in NAMES] == [(8,), (8, 12), (8, 12), (8, 16)]
    assert "layers.0.moe_b_gate" not in GPT(_cfg(moe_router_bias=True)).param_shapes()
    assert "layers.0.b_router" not in GPT(_cfg(moe_expert_bias=True)).param_shapes()
    # pieces: the experts' biases by expert over ep, b_gate/b_up by columns over etp,
    # b_down and the router's whole over tp
    b = np.arange(8 * 12.0).reshape(8, 12)
    assert np.array_equal(moe_piece("layers.0.moe_b_gate", b, 4, 1, 2, 1), b[2:4, 6:])
    d = np.arange(8 * 16.0).reshape(8, 16)
    assert np.array_equal(moe_piece("layers.0.moe_b_down", d, 2, 1, 2, 1), d[4:])
    r = np.arange(8.0)
    assert np.array_equal(moe_piece("layers.0.b_router", r, 4, 3, 2, 1), r)


@pytest.mark.parametrize("kw, match", [
    (dict(experts=0, moe_top_k=2, moe_ffn_hidden=None, moe_router_bias=True),
     "moe_router_bias=True: only a mixture-of-experts model takes it"),
    (dict(experts=0, moe_top_k=2, moe_ffn_hidden=None, moe_expert_bias=True),
     "moe_expert_bias=True: only a mixture-of-experts model takes it"),
    (dict(moe_expert_bias="yes"), "moe_expert_bias='yes': not a boolean"),
])
def test_config_refuses_the_biases_by_field(kw, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _cfg(**kw)


def _spec(mlp, dense=None) -> ModelSpec:
    layers = (Layer(Attention(4, 2, 4), mlp),) * 4
    if dense is not None:
        layers = (Layer(Attention(4, 2, 4), dense),) + layers[1:]
    return ModelSpec("tiny-oss-moe", 16, 32, layers)


def test_from_spec_takes_the_router_and_expert_biases_and_refuses_the_rest():
    expert = MLP("swiglu", 12, True)
    cfg = GPTConfig.from_spec(_spec(MoE(4, 2, expert, router_bias=True)), 8)
    assert (cfg.moe_router_bias, cfg.moe_expert_bias, cfg.experts) == (True, True, 4)
    spec = _spec(MoE(4, 2, expert, router_bias=True))
    assert sum(math.prod(s) for s in GPT(cfg).param_shapes().values()) == \
        parameter_count(spec).total == rank_params(cfg, ParallelConfig(global_batch=4), 0)
    router_only = GPTConfig.from_spec(_spec(MoE(4, 2, MLP("swiglu", 12), router_bias=True)),
                                      8)
    assert (router_only.moe_router_bias, router_only.moe_expert_bias) == (True, False)
    with pytest.raises(ConfigError, match="cannot run biases in the shared experts of a "
                                          "Llama block"):
        GPTConfig.from_spec(_spec(MoE(4, 2, expert, shared_experts=1)), 8)
    with pytest.raises(ConfigError, match="cannot run biases in the dense layers' MLP of a "
                                          "Llama block"):
        GPTConfig.from_spec(_spec(MoE(4, 2, expert), MLP("swiglu", 12, True)), 8)
    with pytest.raises(ConfigError, match="cannot run biases in the MLP of a Llama block"):
        GPTConfig.from_spec(_spec(MLP("swiglu", 24, True)), 8)


# --- the reference -------------------------------------------------------------------------
def _silu(z):
    return z / (1 + np.exp(-z))


def test_reference_adds_the_down_bias_before_the_routing_weight():
    """moe_reference with biases equals a loop written as Hugging Face's GPT-OSS block
    (without its clamp and its (up + 1)·gate·sigmoid(1.702·gate)): router logits x W_r +
    b_r, the top k by logit, their softmax as weights, each chosen expert's
    ((silu(x W_g + b_g) * (x W_u + b_u)) W_d + b_d) times its weight."""
    rng = np.random.default_rng(0)
    n, h, f, e, k = 10, 6, 5, 4, 2
    x, wr, br = rng.standard_normal((n, h)), rng.standard_normal((h, e)), \
        rng.standard_normal(e)
    wg, wu, wd = rng.standard_normal((e, h, f)), rng.standard_normal((e, h, f)), \
        rng.standard_normal((e, f, h))
    bg, bu, bd = rng.standard_normal((e, f)), rng.standard_normal((e, f)), \
        rng.standard_normal((e, h))
    got = moe_reference(x, wr, wg, wu, wd, top_k=k, capacity_factor=None, aux_coef=0.0,
                        b_router=br, b_gate=bg, b_up=bu, b_down=bd)[0].y
    want = np.zeros_like(x)
    for t in range(n):
        logits = x[t] @ wr + br
        top = np.argsort(-logits, kind="stable")[:k]
        weights = np.exp(logits[top] - logits[top].max())
        weights /= weights.sum()
        for j, w in zip(top, weights):
            out = (_silu(x[t] @ wg[j] + bg[j]) * (x[t] @ wu[j] + bu[j])) @ wd[j] + bd[j]
            want[t] += w * out
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_reference_gradients_match_finite_differences():
    """Every entry of the router's and the experts' biases (and some of every other
    parameter) of a tiny GPT-OSS-like model against central differences of the loss."""
    cfg = _cfg(hidden=8, seq=6, vocab=11, ffn_hidden=12, experts=4, moe_ffn_hidden=6,
               **OSS)
    model = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, 2, seed=1)
    grads = assert_gradients_central(model, tokens, targets, NAMES)
    assert min(np.abs(grads[f"layers.1.{n}"]).max() for n in NAMES) > 1e-4


def test_zero_biases_are_the_model_without_them():
    cfg, base = _cfg(**BIASES), _cfg()
    par = ParallelConfig(global_batch=2)
    tokens, targets = token_data(cfg, 2)
    params = GPT(cfg, seed=1).init_params()
    plain = {n: a for n, a in params.items() if n.rsplit(".", 1)[-1] not in NAMES}
    zeros = {n: a if n in plain else np.zeros_like(a) for n, a in params.items()}
    assert GPT(cfg).reference_forward(tokens, targets, zeros, parallel=par)[0] == \
        GPT(base).reference_forward(tokens, targets, plain, parallel=par)[0]
    assert GPT(cfg).reference_forward(tokens, targets, params, parallel=par)[0] != \
        GPT(base).reference_forward(tokens, targets, plain, parallel=par)[0]


# --- emulated training equals the reference ---------------------------------------------------
CASES = [  # GPTConfig fields, ParallelConfig fields (global_batch 4, micro_batch 1 if absent)
    (BIASES, dict(dp=1)),                                               # ep 1, 4 micro-batches
    (OSS, dict(dp=2, ep=2, micro_batch=2)),                             # 1 micro-batch each
    (OSS, dict(dp=4, ep=4)),                                            # ep 4
    (BIASES, dict(dp=4, ep=2, micro_batch=1)),                          # expert dp 2
    (OSS, dict(dp=2, ep=2, tp=2, sequence_parallel=True)),              # etp 2, SP
    (BIASES, dict(dp=2, ep=2, tp=2, micro_batch=2)),                    # etp 2, no SP
    (OSS, dict(dp=2, ep=4, tp=2, etp=1, sequence_parallel=True)),       # folded
    (OSS, dict(dp=2, ep=2, pp=2, schedule="1f1b")),                     # pp 2
    (OSS, dict(dp=2, ep=2, zero_stage=1)),
    (OSS, dict(dp=2, ep=2, tp=2, zero_stage=3, sequence_parallel=True)),
    (BIASES, dict(dp=2, ep=2, moe_dispatcher="allgather", tp=2, sequence_parallel=True)),
    (dict(OSS, seq=16), dict(dp=2, ep=2, cp=2)),
    (dict(BIASES, capacity_factor=1.0), dict(dp=2, ep=2, recompute="full")),
]


def _parallel(**kw) -> ParallelConfig:
    return ParallelConfig(**{"global_batch": 4, "micro_batch": 1, **kw})


def _check_training(cluster, model, par, tokens, targets):
    return assert_fit_equals_reference(cluster, model, par, tokens, targets, steps=STEPS,
                                       lr=LR, rtol=RTOL, atol=ATOL, parallel=par)


@pytest.mark.parametrize("fields, extra", CASES,
                         ids=["-".join(f"{a}={b}" for a, b in e.items()).replace(" ", "")
                              + ("-attn" if "qkv_bias" in f else "") for f, e in CASES])
def test_training_equals_the_reference(cluster_of, fields, extra):
    cfg, par = _cfg(**fields), _parallel(**extra)
    model, (tokens, targets) = GPT(cfg, seed=2), token_data(cfg, 4, seed=0)
    run, ref = _check_training(cluster_of(par.mesh()), model, par, tokens, targets)
    for n in NAMES:
        assert np.abs(ref.grads[f"layers.0.{n}"]).max() > 1e-6, n      # the biases learn


def test_expert_biases_reduce_over_the_expert_data_parallel_group(cluster_of):
    """dp 4, ep 2 (each expert on 2 of the 4 data-parallel ranks): the experts' biases
    join their weights' all-reduce over "dp" (2 ranks), the router's bias the replicated
    parameters' over (dp, ep) (4 ranks); emulated db_down (and every bias) equals the
    reference's. (Checked: with the experts' biases reduced as replicated parameters —
    not marked ``expert`` — db_down mixes two experts' sums and this test fails.)"""
    cfg = _cfg(layers=1, **BIASES)
    par = _parallel(dp=4, ep=2)
    mesh = par.mesh()
    trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par, 1,
                                                                  bucket_bytes=1 << 30))[0]
    by_size = {}
    for op in trace.ops:
        if isinstance(op, TraceCollective) and op.collective == "all_reduce":
            by_size.setdefault(len(op.group), []).append(op.nbytes)
    e_l, h, f, e = cfg.experts // 2, cfg.hidden, cfg.moe_ffn_hidden, cfg.experts
    assert (3 * h * f + 2 * f + h) * e_l * 8 in by_size[2]
    total = sum(math.prod(s) for s in GPT(cfg).param_shapes().values())
    assert (total - (3 * h * f + 2 * f + h) * e) * 8 in by_size[4]
    model, (tokens, targets) = GPT(cfg, seed=4), token_data(cfg, 4, seed=0)
    run = model.fit(cluster_of(mesh), tokens, targets, steps=1, parallel=par, lr=LR)
    ref = model.fit_reference(tokens, targets, steps=1, lr=LR, parallel=par)
    for n in NAMES:
        name = f"layers.0.{n}"
        assert np.abs(ref.grads[name]).max() > 1e-3
        np.testing.assert_allclose(run.grads[name], ref.grads[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)


# --- traffic and FLOPs: trace == emulator --------------------------------------------------
# top-k = E (every token to every expert): the routing, and with it the exchanges' sizes, is
# the trace's default balanced load under any layout; and one call per layer and step with
# top-2, traced with the run's own load
ALL = dict(experts=4, moe_top_k=4)
TRAFFIC = [(dict(OSS, **ALL), dict(dp=2, ep=2, tp=2, sequence_parallel=True)),
           (dict(OSS, **ALL), dict(dp=2, ep=4, tp=2, etp=1, sequence_parallel=True)),
           (dict(BIASES, **ALL), dict(dp=2, ep=2, pp=2, zero_stage=1)),
           (dict(BIASES, **ALL), dict(dp=2, ep=2, tp=2, zero_stage=3, sequence_parallel=True,
                                      moe_dispatcher="allgather")),
           (dict(OSS, **ALL, seq=16), dict(dp=2, ep=2, cp=2)),
           (OSS, dict(dp=2, ep=2, micro_batch=2))]


@pytest.mark.parametrize("fields, extra", TRAFFIC,
                         ids=["tp2-sp", "folded", "pp2-zero1", "zero3-allgather", "cp2",
                              "top2-run-load"])
def test_traced_traffic_equals_the_emulator(cluster_of, fields, extra):
    cfg, par = _cfg(**fields), _parallel(**extra)
    mesh = par.mesh()
    model, (tokens, targets) = GPT(cfg, seed=1), token_data(cfg, 4, seed=0)
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    run = model.fit(cluster, tokens, targets, 1, parallel=par)
    events = cluster.trace()
    load = run.expert_load[0] if cfg.moe_top_k < cfg.experts else None
    traces = trace_program(mesh, train_program, model.meta_args(mesh, par, 1,
                                                                expert_load=load))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank


def test_the_biases_add_no_flops():
    """The traced step's FLOPs are the same with the biases as without (their adds and
    sums are elementwise: 0 FLOPs), and model_flops does not change."""
    par = _parallel(dp=2, ep=2, tp=2, sequence_parallel=True)
    mesh = par.mesh()
    flops = {}
    for name, cfg in (("base", _cfg()), ("biases", _cfg(**BIASES))):
        flops[name] = sum(op.flops for t in trace_program(mesh, train_program,
                                                          GPT(cfg).meta_args(mesh, par))
                          for op in t.ops if isinstance(op, TraceCompute))
    assert flops["biases"] == flops["base"]
    assert model_flops(_cfg(**BIASES), 4) == model_flops(_cfg(), 4)


# --- the memory model and GPT-OSS ----------------------------------------------------------
@pytest.mark.parametrize("extra", [dict(dp=2, ep=2, tp=2), dict(dp=2, ep=4, tp=2, etp=1,
                                                                sequence_parallel=True),
                                   dict(dp=4, ep=4, pp=2)],
                         ids=["etp2", "folded", "pp2-ep4"])
def test_memory_params_are_what_the_program_holds(extra):
    cfg = _cfg(layers=4, **OSS)
    par = _parallel(**extra)
    mesh = par.mesh()
    job = GPT(cfg).meta_args(mesh, par)[0][0]
    ranks = [mesh.rank({a: (p if a == "pp" else 0) for a in mesh.axes})
             for p in range(par.pp)]
    held = [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)
                and op.name == "params")
            for t in trace_program(mesh, count_params, [(job,)] * mesh.size, ranks=ranks)]
    assert held == [rank_params(cfg, par, r) for r in range(par.pp)]


@pytest.mark.parametrize("preset, total", [("gpt-oss-20b", 20_914_757_184),
                                           ("gpt-oss-120b", 116_829_156_672)])
def test_gpt_oss_loads_with_the_model_layers_count(preset, total):
    cfg = GPTConfig.of_model(preset, seq=4096, timing_only=True)
    assert (cfg.moe_router_bias, cfg.moe_expert_bias, cfg.qkv_bias, cfg.out_bias,
            cfg.attention_sinks) == (True,) * 5
    assert parameter_count(load_model(preset)).total == total
    assert sum(math.prod(s) for s in GPT(cfg).param_shapes().values()) == total
    assert rank_params(cfg, ParallelConfig(global_batch=8), 0) == total
    par = ParallelConfig(global_batch=8, dp=8, ep=8, pp=4)
    e = cfg.experts
    experts = (3 * cfg.hidden * cfg.moe_ffn_hidden + 2 * cfg.moe_ffn_hidden + cfg.hidden) \
        * e * cfg.layers
    # ep 8: each rank holds an eighth of the experts (their biases too), all the rest
    assert sum(rank_params(cfg, par, r) for r in range(4)) == total - experts * 7 / 8


def test_gpt_oss_simulates_from_the_command_line(capsys):
    """``vcluster simulate gpt --model gpt-oss-20b`` with ep 8 on one H100 node runs and
    names the biases in its title."""
    from vcluster.cli.main import main
    argv = ["simulate", "gpt", "--model", "gpt-oss-20b", "--seq", "4096", "--ep", "8",
            "--dp", "8", "--micro-batch", "1", "--global-batch", "8", "--hardware",
            "h100-dgx", "--allow-oom"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gpt-oss-20b (Llama h=2880 l=24 a=64 kv=8 f=2880 d=64 window=128 (12/24 layers) " \
        "sinks qkv-bias out-bias router-bias expert-bias s=4096" in out, out
    assert "step time" in out and "32 experts, top-4, ep=8" in out


def test_the_flags_and_the_serving_refusal():
    """--moe-router-bias/--moe-expert-bias reach GPTConfig (and the title); the serving
    program runs them (issue 53)."""
    import argparse

    from pipeline_parallel.decoder import serve_config
    from vcluster.cli.args import add_model_arguments, gpt_config, model_title
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--arch", "llama", "--hidden", "16", "--layers", "2",
                              "--heads", "4", "--vocab", "32", "--seq", "8", "--experts",
                              "4", "--moe-router-bias", "--moe-expert-bias"])
    cfg = gpt_config(args)
    assert (cfg.moe_router_bias, cfg.moe_expert_bias) == (True, True)
    assert "router-bias expert-bias" in model_title(cfg)
    served = serve_config(_cfg(moe_router_bias=True, moe_expert_bias=True))
    assert (served.moe_router_bias, served.moe_expert_bias) == (True, True)
