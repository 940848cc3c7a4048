"""The Llama block's attention variants of 2026 (issue 52): a head dimension independent of
the hidden size (``GPTConfig.head_dim``: Qwen3 32 x 128 with h 2560, GPT-OSS 64 x 64 with
h 2880) and QK-norm (``qk_norm``: an RMSNorm of width d on each query and key head before
RoPE, Qwen3 and OLMo 2). The numpy reference's QK-norm gradients equal finite
differences; the emulated dp x pp x cp x tp training — GQA, K/V replicas, sequence
parallelism, ZeRO-2 — equals the reference (rtol 1e-9, float64) for each variant alone and
both together; the trace moves the emulator's bytes (QK-norm's one tp all_reduce of the
2d gain gradients per layer and step); the configs refuse what the program cannot run."""

from collections import Counter

import numpy as np
import pytest

from modeling import MLP, Attention, ConfigError, Layer, ModelSpec, parameter_count
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, comm_signature,
                                      trace_comm_signature, trace_program)

from .gpt_data import (assert_central_difference, assert_same_params_and_grads, mesh_of,
                       token_data)

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12
#: the variants: d = 6 with h/a = 4 (h_q = 24 > h = 16), QK-norm, both
VARIANTS = {"head_dim": {"head_dim": 6}, "qk_norm": {"qk_norm": True},
            "both": {"head_dim": 6, "qk_norm": True}}


def _cfg(variant: str, kv_heads: int = 2, **kw) -> GPTConfig:
    return GPTConfig(**{**dict(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=kv_heads, ffn_hidden=24), **VARIANTS[variant], **kw})


# --- configuration -------------------------------------------------------------------------
def test_config_takes_a_head_dim_and_qk_norm():
    c = _cfg("both")
    assert (c.head_dim, c.qk_norm) == (6, True)
    assert (_cfg("qk_norm").head_dim, _cfg("head_dim").qk_norm) == (4, False)   # defaults
    shapes = GPT(c).param_shapes()
    assert (shapes["layers.0.w_q"], shapes["layers.0.w_kv"], shapes["layers.0.w_o"]) == \
        ((16, 24), (16, 2, 12), (24, 16))
    assert shapes["layers.1.q_norm_g"] == shapes["layers.1.k_norm_g"] == (6,)
    assert [n.split(".")[-1] for n in shapes if n.startswith("layers.0.")][:6] == \
        ["attn_norm_g", "w_q", "w_kv", "q_norm_g", "k_norm_g", "w_o"]
    # with its own head dimension, hidden need not split over the heads
    assert GPTConfig(hidden=18, layers=1, heads=4, seq=8, vocab=32, arch="llama",
                     head_dim=8).head_dim == 8


def test_config_refuses_what_the_program_cannot_run():
    base = dict(hidden=16, layers=2, heads=4, seq=8, vocab=32)
    with pytest.raises(ConfigError, match=r"head_dim=8: head_dim=8 needs arch='llama'; "
                                          r"arch='gpt' has head_dim=4"):
        GPTConfig(**base, head_dim=8)
    with pytest.raises(ConfigError, match=r"qk_norm=True: qk_norm=True needs arch='llama'"):
        GPTConfig(**base, qk_norm=True)
    with pytest.raises(ConfigError, match=r"head_dim=5: arch='llama' rotates pairs of the "
                                          r"head dimension \(RoPE\): head_dim = 5 must be even"):
        GPTConfig(**base, arch="llama", head_dim=5)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1, got 0"):
        GPTConfig(**base, arch="llama", head_dim=0)
    with pytest.raises(ValueError, match="qk_norm must be True or False, got 'yes'"):
        GPTConfig(**base, arch="llama", qk_norm="yes")
    with pytest.raises(ConfigError, match="hidden=18 is not divisible by heads=4"):
        GPTConfig(**{**base, "hidden": 18}, arch="llama")      # the default d needs it


# --- the reference ---------------------------------------------------------------------------
def test_reference_qk_norm_gradients_match_finite_differences():
    """Every gradient of the tiny model (QK-norm's gains, and through them W_q, W_kv and
    the inputs), with d = 6 != h/a = 2, against central differences of the loss."""
    cfg = GPTConfig(hidden=8, layers=2, heads=4, seq=5, vocab=11, arch="llama", kv_heads=2,
                    ffn_hidden=12, head_dim=6, qk_norm=True)
    model = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, 2, seed=1)
    params = model.init_params()
    grads = model.fit_reference(tokens, targets, steps=1).grads
    rng = np.random.default_rng(0)
    for name, p in params.items():
        picks = p.size if "norm_g" in name and name.startswith("layers.") else 2
        for _ in range(picks):
            idx = tuple(int(rng.integers(0, n)) for n in p.shape)
            assert_central_difference(model, tokens, targets, params, grads, name, idx,
                                      abs_tol=1e-8)


def _qwen3_logits(cfg, P, tokens):
    """A one-layer Llama with QK-norm written out as Hugging Face's Qwen3 orders it,
    q = rope(q_norm(q_proj(x))), RoPE as complex rotations of the pairs (i, i + d/2)."""
    (a, c, d), L = (cfg.heads, cfg.kv_heads, cfg.head_dim), "layers.0."

    def rms(z, g):
        return g * z / np.sqrt(np.mean(z ** 2, -1, keepdims=True) + cfg.eps)

    def rope(z):                                                      # z (B, s, n, d)
        turn = np.exp(1j * np.arange(z.shape[1])[:, None]
                      * cfg.rope_theta ** (-2 * np.arange(d // 2) / d))[None, :, None]
        zc = (z[..., :d // 2] + 1j * z[..., d // 2:]) * turn
        return np.concatenate([zc.real, zc.imag], -1)

    x = P["wte"][tokens]
    (B, s, _), u = x.shape, rms(x, P[L + "attn_norm_g"])
    q = rope(rms((u @ P[L + "w_q"]).reshape(B, s, a, d), P[L + "q_norm_g"]))
    kv = np.einsum("bsh,htk->bstk", u, P[L + "w_kv"])
    k = np.repeat(rope(rms(kv[:, :, 0].reshape(B, s, c, d), P[L + "k_norm_g"])), a // c, 2)
    v = np.repeat(kv[:, :, 1].reshape(B, s, c, d), a // c, 2)
    S = np.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(d) + np.triu(np.full((s, s), -np.inf), 1)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    x = x + np.einsum("bnqk,bknd->bqnd", A, v).reshape(B, s, a * d) @ P[L + "w_o"]
    u2 = rms(x, P[L + "mlp_norm_g"])
    zg = u2 @ P[L + "w_gate"]
    x = x + (zg / (1 + np.exp(-zg)) * (u2 @ P[L + "w_up"])) @ P[L + "w_down"]
    return rms(x, P["norm_f_g"]) @ P["w_out"]


def test_reference_is_qwen3s_order_norm_then_rope():
    """The reference's logits equal the Qwen3 forward written out (per-head norm of width
    d with its own gains, then RoPE), with d = 6 != h/a and GQA."""
    cfg = _cfg("both", layers=1)
    params = GPT(cfg, seed=2).init_params()
    tokens, targets = token_data(cfg, B, seed=4)
    np.testing.assert_allclose(GPT(cfg).reference_forward(tokens, targets, params)[1],
                               _qwen3_logits(cfg, params, tokens), rtol=1e-12, atol=1e-12)


def test_reference_qk_norm_is_per_head_and_scale_free():
    """Scaling one query head's and one key head's projection leaves a QK-normed model's
    logits unchanged (the norm is per head: eps aside), and changes them without it."""
    tokens, targets = token_data(_cfg("both"), B, seed=4)
    for variant, invariant in (("both", True), ("head_dim", False)):
        cfg = _cfg(variant, eps=1e-300)
        params = GPT(cfg, seed=2).init_params()
        scaled = dict(params)
        scaled["layers.0.w_q"] = params["layers.0.w_q"].copy()
        scaled["layers.0.w_q"][:, 6:12] *= 7.0                          # query head 1
        scaled["layers.1.w_kv"] = params["layers.1.w_kv"].copy()
        scaled["layers.1.w_kv"][:, 0, :6] *= 0.25                       # key head 0
        before = GPT(cfg).reference_forward(tokens, targets, params)[1]
        after = GPT(cfg).reference_forward(tokens, targets, scaled)[1]
        assert np.allclose(before, after, rtol=1e-12, atol=1e-12) == invariant, variant


# --- emulated training equals the reference ---------------------------------------------------
CASES = [  # mesh, variant, kv_heads, extra ParallelConfig fields
    ("pp2", "head_dim", 2, {"schedule": "1f1b"}),
    ("pp2", "qk_norm", 1, {"schedule": "gpipe", "recompute": "full"}),
    ("tp2", "head_dim", 1, {"sequence_parallel": True}),                  # K/V replicated
    ("tp2", "qk_norm", 2, {"recompute": "selective"}),
    ("tp2", "both", 1, {"sequence_parallel": True, "recompute": "full"}),  # replicas + SP
    ("pp2 tp2", "both", 2, {"schedule": "zero_bubble"}),                  # W apart from I
    ("pp2 tp2", "qk_norm", 1, {"schedule": "1f1b", "tp_overlap": "none"}),
    ("dp2 tp2", "both", 1, {"zero_stage": 2}),        # the tp sums every micro-batch
    ("cp2", "both", 2, {"cp_algorithm": "ring", "attention": "flash"}),
    ("cp2 tp2", "head_dim", 2, {"cp_algorithm": "all_gather", "attention": "flash"}),
    ("cp2 tp2", "qk_norm", 1, {"cp_algorithm": "ring", "attention": "flash",
                               "sequence_parallel": True}),
    ("pp2 cp2 tp2", "both", 2, {"cp_algorithm": "ring", "attention": "flash"}),
]


def _parallel(mesh, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=B, micro_batch=kw.pop("micro_batch", 1),
                          **dict(mesh.shape), **kw)


@pytest.fixture(scope="module")
def references():
    """(model, data, forward, 3-step fit) per (variant, kv_heads), computed once."""
    out = {}

    def get(variant, kv):
        if (variant, kv) not in out:
            model = GPT(_cfg(variant, kv), seed=1)
            tokens, targets = token_data(model.config, B, seed=0)
            out[variant, kv] = (model, tokens, targets, model.reference_forward(tokens, targets),
                                model.fit_reference(tokens, targets, steps=STEPS, lr=LR))
        return out[variant, kv]

    return get


@pytest.mark.parametrize("mesh, variant, kv, extra", CASES,
                         ids=[f"{m.replace(' ', '-')}-{v}-kv{k}-" + "-".join(
                             f"{a}={b}" for a, b in e.items()) for m, v, k, e in CASES])
def test_training_equals_the_reference(cluster_of, references, mesh, variant, kv, extra):
    mesh = mesh_of(mesh)
    model, tokens, targets, (ref_loss, ref_logits), ref = references(variant, kv)
    par = _parallel(mesh, **extra)
    cluster = cluster_of(mesh)
    loss, logits = model.forward(cluster, tokens, targets, par)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    run = model.fit(cluster, tokens, targets, steps=STEPS, parallel=par, lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.params.keys() == ref.params.keys() == run.grads.keys()
    assert_same_params_and_grads(run, ref, RTOL, ATOL)
    if model.config.qk_norm:         # the gains learn (their gradients are not all zero)
        assert np.abs(ref.grads["layers.0.q_norm_g"]).min() > 0
        assert np.abs(ref.grads["layers.1.k_norm_g"]).min() > 0


# --- traffic and FLOPs: emulator == trace ----------------------------------------------------
@pytest.mark.parametrize("mesh, kv, sp", [("tp2", 1, True), ("pp2 tp2", 2, False)])
def test_traced_traffic_and_flops_equal_the_emulator(cluster_of, mesh, kv, sp):
    mesh, cfg = mesh_of(mesh), _cfg("both", kv)
    model = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B)
    par = _parallel(mesh, micro_batch=2, sequence_parallel=sp)
    cluster = cluster_of(mesh)
    job = model.train_job(mesh, par, steps=1, bucket_bytes=2048)
    cluster.reset_stats()
    cluster.run(train_program, model.device_args(mesh, job, tokens, targets))
    events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
    traces = trace_program(mesh, train_program, model.meta_args(mesh, par, 1, bucket_bytes=2048))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in traces] == flops


def test_qk_norm_gains_sum_over_tp_once_per_step():
    """QK-norm adds one all_reduce(tp) of the 2d gain gradients per layer and step (d = 6,
    float64: 96 bytes), beside every collective the model without it has; its norms are
    declared (as the block's other norms) with 0 FLOPs, so the FLOPs are the same."""
    m, l, steps = 3, 2, 2
    mesh, par = mesh_of("tp2"), ParallelConfig(global_batch=2 * m, micro_batch=2, tp=2)
    counts, flops, names = {}, {}, {}
    for variant in ("head_dim", "both"):
        trace = trace_program(mesh, train_program, GPT(_cfg(variant, layers=l)).meta_args(
            mesh, par, steps=steps))[0]
        counts[variant] = Counter((op.collective, op.nbytes) for op in trace.ops
                                  if isinstance(op, TraceCollective))
        flops[variant] = sum(op.flops for op in trace.ops if isinstance(op, TraceCompute))
        names[variant] = Counter(op.name for op in trace.ops if isinstance(op, TraceCompute))
    assert counts["both"] - counts["head_dim"] == {("all_reduce", 2 * 6 * 8): steps * l}
    assert counts["head_dim"] - counts["both"] == Counter()
    assert flops["both"] == flops["head_dim"]
    # each norm, its input gradient and its gain gradient once per layer and micro-batch
    for op in ("q norm", "k norm", "q norm grad", "k norm grad", "q norm gain grad",
               "k norm gain grad"):
        assert names["both"][f"gpt: attention: {op}"] == steps * m * l, op


# --- from a ModelSpec ---------------------------------------------------------------------------
def _spec(**attention) -> ModelSpec:
    att = Attention(4, 2, attention.pop("head_dim", 4), **attention)
    return ModelSpec("tiny-qwen3", 16, 32, (Layer(att, MLP("swiglu", 24)),) * 2)


def test_from_spec_passes_head_dim_and_qk_norm():
    spec = _spec(head_dim=6, qk_norm=True)
    config = GPTConfig.from_spec(spec, 8)
    assert config == _cfg("both", rope_theta=spec.rope_theta, eps=spec.norm_eps)
    shapes = GPT(config).param_shapes()
    assert sum(int(np.prod(s)) for s in shapes.values()) == parameter_count(spec).total
    gpt_block = ModelSpec("tiny-gpt-qk", 16, 32, (Layer(
        Attention(4, 4, 4, qkv_bias=True, out_bias=True, qk_norm=True),
        MLP("gelu", 64, True)),) * 2, norm="layernorm", positions="learned", max_seq=8,
        rope_theta=None)
    with pytest.raises(ConfigError, match="cannot run QK-norm in a GPT block"):
        GPTConfig.from_spec(gpt_block, 8)


@pytest.mark.parametrize("preset, d, heads, hidden", [("qwen3-8b", 128, 32, 4096),
                                                       ("qwen3-32b", 128, 64, 5120)])
def test_qwen3_presets_load_with_their_attention(preset, d, heads, hidden):
    config = GPTConfig.of_model(preset, 4096, timing_only=True)
    assert (config.head_dim, config.heads, config.hidden, config.qk_norm) == \
        (d, heads, hidden, True)
    assert GPT(config).param_shapes()["layers.0.w_q"] == (hidden, heads * d)


def test_a_proxy_keeps_a_head_dim_of_its_own_and_follows_a_tied_one():
    """--hidden beside --model: Llama's d = h/a follows the new h, Qwen3-32B's 128 stays."""
    assert GPTConfig.of_model("llama-3.1-8b", 64, timing_only=True, hidden=1024).head_dim == 32
    assert GPTConfig.of_model("qwen3-32b", 64, timing_only=True, hidden=1024).head_dim == 128
    assert GPTConfig.of_model("qwen3-32b", 64, timing_only=True, hidden=1024,
                              head_dim=16).head_dim == 16
