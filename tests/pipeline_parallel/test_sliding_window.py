"""Sliding-window attention (a per-layer pattern) and attention sinks in the Llama block
(issue 52: Mistral's and GPT-OSS's attention; ``GPTConfig(window=, window_layers=,
attention_sinks=)``, :mod:`tensor_parallel.gqa`, :mod:`tensor_parallel.context_parallel`).

The numpy reference's window mask equals a brute-force loop over (query, key) pairs and a
sink written as one more softmax column; its gradients (the sinks' included) equal finite
differences. The emulated dp x pp x cp x tp (x ep) training equals the reference (rtol
1e-9, float64: forward loss, logits, every gradient, 3 SGD steps) with the window on every
layer (tp 1, tp 2 with GQA and sequence parallelism, unfused), alternating windowed and
full layers on a pipeline, the window under context parallelism (ring and all_gather,
narrower and wider than a chunk), sinks alone and with a window, and an MoE model. The
traced FLOPs of a step equal ``model_flops`` (with cp 2: the projections' share of it
plus the context-parallel blocks' closed form, which counts each visible c × c chunk
pair whole), ``modeling.counts`` agrees with ``model_flops``, the fused kernels carry the
window, and a window >= seq is no window, bit for bit."""

import numpy as np
import pytest

from mesh import Mesh
from modeling import MLP, Attention, ConfigError, Layer, ModelSpec, MoE, flops_per_token
from modeling.counts import activation_bytes_per_layer, causal_square
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from tensor_parallel.context_parallel import ContextParallelAttention as CPA
from tensor_parallel.context_parallel import causal_chunk_pairs, chunk_ids
from vcluster.planner.memory import llama_activation_bytes_per_layer, rank_params
from vcluster.runtime.tracing import TraceCompute, trace_program
from vcluster.runtime.tracing.kernel import attention_flops

from .gpt_data import (assert_central_difference, assert_fit_equals_reference,
                       assert_same_params_and_grads, mesh_of, token_data)

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12


def _cfg(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24), **kw})


# --- configuration -------------------------------------------------------------------------
def test_config_takes_a_window_pattern_and_sinks():
    c = _cfg(layers=4, window=3, window_layers=[2, 0, 2], attention_sinks=True)
    assert (c.window, c.window_layers, c.attention_sinks) == (3, (0, 2), True)
    assert [c.layer_window(i) for i in range(4)] == [3, None, 3, None]
    assert c.windowed_layers() == 2 and _cfg(window=3).windowed_layers() == 2
    assert _cfg(window=3).layer_window(1) == 3 and _cfg().windowed_layers() == 0
    shapes = GPT(c).param_shapes()
    assert [n.split(".")[-1] for n in shapes if n.startswith("layers.3.")][:6] == \
        ["attn_norm_g", "w_q", "w_kv", "w_o", "sinks", "mlp_norm_g"]
    assert shapes["layers.0.sinks"] == (4,)
    moe = GPT(_cfg(attention_sinks=True, experts=4, moe_ffn_hidden=12)).param_shapes()
    assert [n.split(".")[-1] for n in moe if n.startswith("layers.1.")][:6] == \
        ["attn_norm_g", "w_q", "w_kv", "w_o", "sinks", "mlp_norm_g"]


@pytest.mark.parametrize("kw, match", [
    (dict(window=0), "window must be an int >= 1, got 0"),
    (dict(window_layers=(0,)), r"window_layers=\(0,\): the layers a window applies to need "
                               "a window"),
    (dict(window=2, window_layers=(0, 2)), r"window_layers=\(0, 2\): .*allowed: layer "
                                           "indices 0 to 1"),
    (dict(window=2, window_layers=()), "window_layers=()"),
    (dict(window=2, arch="gpt", kv_heads=None, ffn_hidden=None),
     "window=2: window needs arch='llama'"),
    (dict(attention_sinks=True, arch="gpt", kv_heads=None, ffn_hidden=None),
     "attention_sinks=True: attention_sinks needs arch='llama'"),
    (dict(attention_sinks="yes"), "attention_sinks='yes': not a boolean"),
    (dict(window=4, kv_heads=None, kv_lora_rank=6, qk_nope_head_dim=2, qk_rope_head_dim=2,
          v_head_dim=4), "window=4: multi-head latent attention has no sliding-window"),
])
def test_config_refuses_a_bad_window_or_sinks_by_field(kw, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _cfg(**kw)


# --- the reference -------------------------------------------------------------------------
def _rope(z, theta):
    """RoPE of z (B, s, n, d) as complex rotations of the pairs (i, i + d/2)."""
    d = z.shape[-1]
    turn = np.exp(1j * np.arange(z.shape[1])[:, None]
                  * theta ** (-2 * np.arange(d // 2) / d))[None, :, None]
    zc = (z[..., :d // 2] + 1j * z[..., d // 2:]) * turn
    return np.concatenate([zc.real, zc.imag], -1)


def _brute_force_logits(cfg, P, tokens):
    """A one-layer Llama whose attention is a loop over (batch, head, query) and, for each,
    over the keys in its window max(0, i − w + 1)..i; the sink is one more term of the
    softmax's denominator, exp(σ_n), whose probability no value receives."""
    (a, c, d), L = (cfg.heads, cfg.kv_heads, cfg.head_dim), "layers.0."

    def rms(z, g):
        return g * z / np.sqrt(np.mean(z ** 2, -1, keepdims=True) + cfg.eps)

    x = P["wte"][tokens]
    (Bn, s, _), u = x.shape, rms(x, P[L + "attn_norm_g"])
    q = _rope((u @ P[L + "w_q"]).reshape(Bn, s, a, d), cfg.rope_theta)
    kv = np.einsum("bsh,htk->bstk", u, P[L + "w_kv"])
    k = _rope(kv[:, :, 0].reshape(Bn, s, c, d), cfg.rope_theta)
    v = kv[:, :, 1].reshape(Bn, s, c, d)
    w = cfg.layer_window(0) or s
    ctx = np.zeros((Bn, s, a, d))
    for b in range(Bn):
        for n in range(a):
            for i in range(s):
                keys = range(max(0, i - w + 1), i + 1)
                scores = [q[b, i, n] @ k[b, j, n // (a // c)] / np.sqrt(d) for j in keys]
                sink = [P[L + "sinks"][n]] if cfg.attention_sinks else []
                top = max(scores + sink)
                den = sum(np.exp(z - top) for z in scores + sink)
                for j, z in zip(keys, scores):
                    ctx[b, i, n] += np.exp(z - top) / den * v[b, j, n // (a // c)]
    x = x + ctx.reshape(Bn, s, a * d) @ P[L + "w_o"]
    u2 = rms(x, P[L + "mlp_norm_g"])
    zg = u2 @ P[L + "w_gate"]
    x = x + (zg / (1 + np.exp(-zg)) * (u2 @ P[L + "w_up"])) @ P[L + "w_down"]
    return rms(x, P["norm_f_g"]) @ P["w_out"]


@pytest.mark.parametrize("kw", [dict(window=1), dict(window=3), dict(window=3, kv_heads=1),
                                dict(attention_sinks=True),
                                dict(window=2, attention_sinks=True)],
                         ids=["w1", "w3", "w3-mqa", "sinks", "w2-sinks"])
def test_reference_equals_a_brute_force_loop_over_query_key_pairs(kw):
    cfg = _cfg(layers=1, **kw)
    params = GPT(cfg, seed=2).init_params()
    if cfg.attention_sinks:                 # sinks of every sign and size
        params["layers.0.sinks"] = np.array([-1.0, 0.5, 2.0, 0.0])
    tokens, targets = token_data(cfg, 2, seed=4)
    np.testing.assert_allclose(GPT(cfg).reference_forward(tokens, targets, params)[1],
                               _brute_force_logits(cfg, params, tokens), rtol=1e-11,
                               atol=1e-12)


def test_reference_gradients_match_finite_differences():
    """Every gradient of a tiny model with a window on layer 0 (w = 2) and sinks on both
    layers — every sink logit, and some entries of every other parameter — against
    central differences of the loss."""
    cfg = GPTConfig(hidden=8, layers=2, heads=4, seq=6, vocab=11, arch="llama", kv_heads=2,
                    ffn_hidden=12, window=2, window_layers=(0,), attention_sinks=True)
    model = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, 2, seed=1)
    params = model.init_params()
    for i in range(cfg.layers):             # sinks that matter: p_sink from ~0.05 to ~0.9
        params[f"layers.{i}.sinks"] = np.array([-2.0, 0.3, 1.5, 3.0])
    grads = model._reference(params, tokens, targets, backward=True)[2]
    rng = np.random.default_rng(0)
    for name, p in params.items():
        picks = [np.unravel_index(j, p.shape) for j in range(p.size)] if "sinks" in name \
            else [tuple(int(rng.integers(0, n)) for n in p.shape) for _ in range(3)]
        for idx in picks:
            assert_central_difference(model, tokens, targets, params, grads, name, idx,
                                      abs_tol=1e-9)
    assert np.abs(grads["layers.1.sinks"]).min() > 1e-4       # the sinks learn


def test_a_window_at_least_seq_is_no_window_exactly():
    """w = s and w > s: the reference's values, the emulated step's and the declared
    FLOPs are those of no window, bit for bit (the cp ring's too)."""
    base = _cfg()
    tokens, targets = token_data(base, B)
    ref = GPT(base, seed=1).fit_reference(tokens, targets, steps=2, lr=LR)
    for w in (base.seq, base.seq + 5):
        cfg = _cfg(window=w)
        got = GPT(cfg, seed=1).fit_reference(tokens, targets, steps=2, lr=LR)
        assert np.array_equal(got.losses, ref.losses)
        assert all(np.array_equal(got.grads[n], ref.grads[n]) for n in ref.grads)
        for mesh, extra in (("tp2", {"attention": "unfused"}), ("tp2", {}),
                            ("cp2", {"cp_algorithm": "ring"})):
            mesh = mesh_of(mesh)
            par = ParallelConfig(global_batch=B, micro_batch=2, **dict(mesh.shape), **extra)
            flops = [[sum(op.flops for op in t.ops if isinstance(op, TraceCompute))
                      for t in trace_program(mesh, train_program, GPT(c).meta_args(mesh, par))]
                     for c in (base, cfg)]
            assert flops[0] == flops[1], (w, mesh)
        assert model_flops(cfg, B) == model_flops(base, B)


# --- emulated training equals the reference ---------------------------------------------------
CASES = [  # mesh, GPTConfig fields, extra ParallelConfig fields
    ("tp1", dict(window=3), {}),                                          # every layer
    ("tp2", dict(window=3, kv_heads=1), {"sequence_parallel": True}),     # GQA replicas, SP
    ("tp2", dict(window=2), {"attention": "unfused", "recompute": "selective"}),
    ("pp2", dict(layers=4, window=3, window_layers=(0, 2)), {"schedule": "1f1b"}),
    ("pp2 tp2", dict(layers=4, window=2, window_layers=(1, 3), attention_sinks=True),
     {"schedule": "zero_bubble"}),
    ("tp2", dict(attention_sinks=True), {"recompute": "full"}),           # sinks alone
    ("tp1", dict(window=3, attention_sinks=True), {"attention": "unfused"}),
    # cp 2 with s = 16: 4 chunks of c = 4 rows; windows narrower and wider than a chunk
    ("cp2", dict(seq=16, window=3), {"cp_algorithm": "ring"}),
    ("cp2", dict(seq=16, window=6), {"cp_algorithm": "ring"}),
    ("cp2", dict(seq=16, window=3), {"cp_algorithm": "all_gather"}),
    ("cp2", dict(seq=16, window=9, window_layers=(1,)), {"cp_algorithm": "all_gather"}),
    ("cp2 tp2", dict(seq=16, window=5, attention_sinks=True),
     {"cp_algorithm": "ring", "sequence_parallel": True}),
]


def _parallel(mesh, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=B, micro_batch=kw.pop("micro_batch", 1),
                          **dict(mesh.shape), **kw)


@pytest.mark.parametrize("mesh, fields, extra", CASES,
                         ids=[f"{m.replace(' ', '-')}-" + "-".join(
                             f"{a}={b}" for a, b in {**f, **e}.items()).replace(" ", "")
                              for m, f, e in CASES])
def test_training_equals_the_reference(cluster_of, mesh, fields, extra):
    mesh, cfg = mesh_of(mesh), _cfg(**fields)
    model = GPT(cfg, seed=1)
    if cfg.attention_sinks:                 # sinks that weigh: a seed's are ~0.1
        model.init_params = _with_sinks(model.init_params, cfg)
    tokens, targets = token_data(cfg, B, seed=0)
    par = _parallel(mesh, **extra)
    cluster = cluster_of(mesh)
    ref_loss, ref_logits = model.reference_forward(tokens, targets)
    loss, logits = model.forward(cluster, tokens, targets, par)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    ref = model.fit_reference(tokens, targets, steps=STEPS, lr=LR)
    run = model.fit(cluster, tokens, targets, steps=STEPS, parallel=par, lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.params.keys() == ref.params.keys() == run.grads.keys()
    assert_same_params_and_grads(run, ref, RTOL, ATOL)
    if cfg.attention_sinks:
        assert np.abs(ref.grads["layers.0.sinks"]).min() > 0


def _with_sinks(init, cfg):
    def params():
        p = init()
        for i in range(cfg.layers):
            p[f"layers.{i}.sinks"] = np.linspace(-1.5, 2.0, cfg.heads) + 0.1 * i
        return p
    return params


def test_moe_training_with_a_window_equals_the_reference(cluster_of):
    """experts = 4, top-2, ep 2 (dp 2), a window on layer 1 and sinks."""
    cfg = _cfg(experts=4, moe_top_k=2, moe_ffn_hidden=12, window=3, window_layers=(1,),
               attention_sinks=True)
    par = ParallelConfig(global_batch=B, micro_batch=1, dp=2, ep=2)
    model, (tokens, targets) = GPT(cfg, seed=3), token_data(cfg, B, seed=0)
    assert_fit_equals_reference(cluster_of(par.mesh()), model, par, tokens, targets,
                                steps=STEPS, lr=LR, rtol=RTOL, atol=ATOL, parallel=par)


# --- FLOPs: trace == closed form --------------------------------------------------------------
def _traced(cfg, mesh, **extra) -> int:
    mesh = mesh_of(mesh)
    par = ParallelConfig(global_batch=8, micro_batch=2, **dict(mesh.shape), **extra)
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    return sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))


FLOPS = [  # mesh, GPTConfig fields, extra ParallelConfig fields
    ("tp1", dict(window=5), {}),
    ("tp2", dict(window=5, window_layers=(0, 2)), {"attention": "unfused"}),
    ("pp2", dict(window=3, window_layers=(1, 3), attention_sinks=True), {}),
    ("pp2 tp2", dict(window=11), {"recompute": "selective", "attention": "unfused"}),
    ("tp1", dict(window=1, attention_sinks=True, experts=4, moe_ffn_hidden=12), {}),
]


@pytest.mark.parametrize("mesh, fields, extra", FLOPS,
                         ids=[f"{m.replace(' ', '-')}-{i}" for i, (m, _, _) in enumerate(FLOPS)])
def test_traced_flops_equal_model_flops(mesh, fields, extra):
    """Σ over ranks of one step's traced FLOPs = model_flops: each windowed layer's causal
    core at 2·m·s − m² (m = min(s, w)) instead of s² — and selective recomputation adds
    the windowed core's forward, 2·B·h_q·Σ_l causal_square(s, w_l)."""
    cfg = _cfg(**{**dict(layers=4, seq=16, kv_heads=4), **fields})
    traced = _traced(cfg, mesh, **extra)
    extra_flops = 0
    if extra.get("recompute") == "selective":
        extra_flops = 2 * 8 * cfg.heads * cfg.head_dim * sum(
            causal_square(cfg.seq, cfg.layer_window(i)) for i in range(cfg.layers))
    assert traced == model_flops(cfg, 8) + extra_flops
    assert model_flops(cfg, 8) < model_flops(_cfg(**{**dict(layers=4, seq=16, kv_heads=4),
                                                     **fields, "window": None,
                                                     "window_layers": None}), 8)


@pytest.mark.parametrize("fields, algorithm", [
    (dict(window=3), "ring"), (dict(window=6, window_layers=(0, 2)), "all_gather"),
    (dict(window=1, attention_sinks=True), "ring"), (dict(window=16), "ring")])
def test_traced_flops_with_cp2_equal_the_closed_forms(fields, algorithm):
    """cp 2 (chunks of c = 4): the traced step = model_flops less its causal core, plus
    the context-parallel blocks' closed form (:meth:`ContextParallelAttention.flops`: each
    visible c × c chunk pair counted whole; :func:`causal_chunk_pairs` with the window)
    over the ranks, layers and micro-batches — and those pairs are the chunk pairs with
    some (query, key) in the window, counted by brute force."""
    cp, b, m = 2, 2, 4                       # micro-batch 2, 4 micro-batches of 8 sequences
    cfg = _cfg(**{**dict(layers=4, seq=16, kv_heads=2), **fields})
    s, hq, c = cfg.seq, cfg.heads * cfg.head_dim, cfg.seq // (2 * cp)
    core = 3 * 8 * 2 * hq * sum(causal_square(s, cfg.layer_window(i)) for i in range(4))
    blocks = 0
    for i in range(cfg.layers):
        op = CPA(cfg.heads, cfg.head_dim, algorithm, group=cfg.heads // cfg.kv_heads,
                 window=cfg.layer_window(i))
        local = (b * cfg.kv_heads, s // cp, cfg.head_dim)
        blocks += m * sum(op.flops(local, cp, r) + op.flops(local, cp, r, backward=True)
                          for r in range(cp))
    assert _traced(cfg, "cp2", cp_algorithm=algorithm) == model_flops(cfg, 8) - core + blocks
    for i in range(cfg.layers):
        w = cfg.layer_window(i) or s
        for r in range(cp):
            brute = sum(any(qi - w < kj <= qi for qi in range(Q * c, (Q + 1) * c)
                            for kj in range(K * c, (K + 1) * c))
                        for Q in chunk_ids(cp, r) for K in range(2 * cp))
            assert causal_chunk_pairs(cp, r, True, cfg.layer_window(i), c) == brute


def test_fused_kernels_carry_the_window_and_are_priced_by_it():
    """The flash forward's kernel has the window, and the price's FLOPs (the kernel
    profiles') equal the block's declared FLOPs: the kernel time follows the window."""
    cfg = _cfg(layers=1, seq=16, window=5)
    mesh = mesh_of("tp1")
    par = ParallelConfig(global_batch=2, micro_batch=2)
    trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))[0]
    fwd = [op for op in trace.ops if isinstance(op, TraceCompute)
           and op.name == "gpt: attention: flash forward"]
    assert fwd and all(op.kernel.window == 5 for op in fwd)
    assert all(attention_flops(op.kernel) == op.flops for op in fwd)
    assert "window 5" in repr(fwd[0].kernel)


# --- the model layer and the memory model -----------------------------------------------------
def _oss_like(sinks: bool = True, windows=(4, None)) -> ModelSpec:
    """A tiny GPT-OSS-like spec: alternating windowed and full layers, sinks, MoE, no
    biases."""
    moe = MoE(4, 2, MLP("swiglu", 12))
    layers = tuple(Layer(Attention(4, 2, 6, window=windows[i % len(windows)], sinks=sinks),
                         moe) for i in range(4))
    return ModelSpec("tiny-oss", 16, 32, layers)


def test_from_spec_takes_the_window_pattern_and_sinks():
    spec = _oss_like()
    cfg = GPTConfig.from_spec(spec, 16)
    assert (cfg.window, cfg.window_layers, cfg.attention_sinks, cfg.head_dim) == \
        (4, (0, 2), True, 6)
    every = GPTConfig.from_spec(_oss_like(windows=(4,)), 16)
    assert (every.window, every.window_layers) == (4, None)
    # the model layer's FLOPs per token agree with model_flops for the windowed spec
    for s in (16, 3):
        config = GPTConfig.from_spec(spec, s)
        assert model_flops(config, 2) == pytest.approx(
            3 * flops_per_token(spec, s).forward * 2 * s, rel=1e-12)
    with pytest.raises(ConfigError, match=r"cannot run sliding windows of different widths "
                                          r"\(\[4, 8\]\)"):
        GPTConfig.from_spec(_oss_like(windows=(4, 8)), 16)
    gpt_block = ModelSpec("tiny-gpt-w", 16, 32, (Layer(
        Attention(4, 4, 4, qkv_bias=True, out_bias=True, window=4), MLP("gelu", 64, True)),)
        * 2, norm="layernorm", positions="learned", max_seq=16, rope_theta=None)
    with pytest.raises(ConfigError, match="cannot run sliding-window attention in a GPT "
                                          "block"):
        GPTConfig.from_spec(gpt_block, 16)


def test_gpt_oss_loads_with_its_window_pattern_and_sinks():
    for preset, layers in (("gpt-oss-20b", 24), ("gpt-oss-120b", 36)):
        cfg = GPTConfig.of_model(preset, 4096, timing_only=True)
        assert (cfg.window, cfg.window_layers, cfg.attention_sinks) == \
            (128, tuple(range(0, layers, 2)), True)


def test_memory_follows_the_window_and_counts_the_sinks():
    """Unfused: a windowed layer keeps b·a·s·w scores (2 bytes), not s²; flash keeps none
    either way. The sinks add a/t parameters per layer."""
    cfg, windowed = _cfg(seq=16), _cfg(seq=16, window=4, window_layers=(0,))
    b, t, a, s = 2, 2, cfg.heads, cfg.seq
    full, half = (llama_activation_bytes_per_layer(c, b, t, "none", False, "unfused")
                  for c in (cfg, windowed))
    assert full - half == pytest.approx(2 * a * s * (s - 4) * b / t / 2)   # 1 of 2 layers
    assert llama_activation_bytes_per_layer(cfg, b, t, "none", False, "flash") == \
        llama_activation_bytes_per_layer(windowed, b, t, "none", False, "flash")
    spec, s = _oss_like(), 16             # the model layer's count: layer 0 windowed (4)
    windowed_layer, full_layer = (activation_bytes_per_layer(spec.layers[i], spec, s, b, t,
                                                             attention="unfused")
                                  for i in (0, 1))
    assert full_layer - windowed_layer == 2 * s * (s - 4) * b * 4 / t
    par = ParallelConfig(global_batch=4, tp=2)
    assert rank_params(_cfg(attention_sinks=True), par, 0) - rank_params(_cfg(), par, 0) == \
        2 * 4 / 2
    assert sum(int(np.prod(x)) for n, x in GPT(_cfg(attention_sinks=True)).param_shapes()
               .items()) - sum(int(np.prod(x)) for x in GPT(_cfg()).param_shapes().values()) \
        == 2 * 4


def test_the_planner_prices_the_mean_layer_of_a_window_pattern():
    """Alternating windows: the layer's traced costs are the mean of a windowed and a full
    layer's (FLOPs and seconds), below the full layer's."""
    from vcluster.planner.layer_cost import trace_stage_pieces
    from vcluster.timing.hardware_model import HardwareCostModel
    from vcluster.timing.presets import load_hardware
    costs = HardwareCostModel(load_hardware("h100-dgx"), "bf16")
    cfg = _cfg(layers=4, seq=64, window=8, window_layers=(0, 2))
    got, every, none = (trace_stage_pieces(c, 2, 1, False, "none", costs) for c in (
        cfg, _cfg(layers=4, seq=64, window=8), _cfg(layers=4, seq=64)))
    for action in ("F", "I", "W"):
        key = ("layer", action)
        assert got[key].flops == pytest.approx((every[key].flops + none[key].flops) / 2)
        assert got[key].seconds == pytest.approx((every[key].seconds + none[key].seconds) / 2)
    assert every[("layer", "F")].flops < none[("layer", "F")].flops
    assert got[("emb", "F")] == none[("emb", "F")]


def test_a_cp_window_shorter_than_a_chunk_skips_whole_blocks():
    """w = 1 with c = 4: each query chunk sees its own chunk only, so the load-balanced
    ranks compute 2 pairs each instead of 2·cp + 1."""
    assert [causal_chunk_pairs(2, r, True, 1, 4) for r in range(2)] == [2, 2]
    assert [causal_chunk_pairs(2, r, True, 5, 4) for r in range(2)] == [3, 4]
    assert [causal_chunk_pairs(2, r) for r in range(2)] == [5, 5]
    assert CPA(2, 4, window=3).windowed(None).window is None
    assert "window=3" in repr(CPA(2, 4).windowed(3))
    assert Mesh((2,), ("cp",)).size == 2
