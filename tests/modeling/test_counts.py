"""The model layer's counts against the closed forms the engines were built on: the
Megatron, Llama and MoE FLOP formulas (pipeline_parallel.gpt), the memory model's
parameters per pipeline rank (vcluster.planner.memory), and hand-worked KV and activation
figures."""

from __future__ import annotations

import pytest

from modeling import (MLP, Attention, Layer, ModelSpec, MoE, activation_bytes_per_layer,
                      flops_per_token, kv_bytes_per_token, kv_cache_bytes, load_model,
                      parameter_count, rank_params)
from pipeline_parallel.gpt import (GPTConfig, ParallelConfig, llama_model_flops,
                                   megatron_model_flops, moe_model_flops)
from vcluster.planner.memory import rank_params as memory_rank_params

B, S = 4, 512


def _gpt(h=256, layers=4, heads=8, vocab=1000, seq=S):
    layer = Layer(Attention(heads, heads, h // heads, qkv_bias=True, out_bias=True),
                  MLP("gelu", 4 * h, bias=True))
    return ModelSpec("gpt", h, vocab, (layer,) * layers, norm="layernorm",
                     positions="learned", max_seq=seq, rope_theta=None)


def _llama(h=256, layers=4, heads=8, kv=2, ffn=704, vocab=1000, experts=0, k=2):
    mlp = MLP("swiglu", ffn)
    if experts:
        mlp = MoE(experts, k, mlp)
    return ModelSpec("llama", h, vocab, (Layer(Attention(heads, kv, h // heads), mlp),) * layers)


def test_gpt_flops_are_megatrons():
    spec = _gpt()
    ours = flops_per_token(spec, S, "megatron").training * B * S
    assert ours == megatron_model_flops(B, S, 4, 256, 1000)


def test_llama_flops_count_causal_attention_at_half():
    spec = _llama()
    ours = flops_per_token(spec, S, "causal").training * B * S
    assert ours == llama_model_flops(B, S, 4, 256, 1000, 8, 2, 704)


@pytest.mark.parametrize("k", [1, 2])
def test_moe_flops_count_the_routed_experts_only(k):
    spec = _llama(experts=8, k=k)
    ours = flops_per_token(spec, S, "causal").training * B * S
    assert ours == moe_model_flops(B, S, 4, 256, 1000, 8, 2, 8, k, 704)


def test_a_window_shortens_the_keys_and_the_cache():
    full, windowed = _llama(), _llama()
    layer = windowed.layers[0]
    win = Layer(Attention(8, 2, 32, window=128), layer.mlp)
    windowed = ModelSpec("w", 256, 1000, (win,) * 4)
    f, w = flops_per_token(full, S), flops_per_token(windowed, S)
    # per layer 2·(2q)·keys: s/2 = 256 keys vs w − w²/2s = 128 − 16 = 112
    assert f.forward - w.forward == pytest.approx(4 * 2 * 2 * 256 * (256 - 112))
    assert kv_cache_bytes(full, 4096) == 4096 * kv_bytes_per_token(full)
    assert kv_cache_bytes(windowed, 4096) == 128 * kv_bytes_per_token(windowed)
    assert kv_bytes_per_token(full) == 4 * 2 * 2 * 32 * 2          # layers·(K,V)·c·bf16


def test_latent_attention_caches_the_latent():
    ds = load_model("deepseek-v3")
    assert kv_bytes_per_token(ds) == 61 * (512 + 64) * 2


@pytest.mark.parametrize("pp, tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("make", [_gpt, _llama])
def test_rank_params_are_the_memory_models(make, pp, tp):
    spec = make()
    arch = "gpt" if make is _gpt else "llama"
    config = GPTConfig(hidden=256, layers=4, heads=8, seq=S, vocab=1000, arch=arch,
                       **({"kv_heads": 2, "ffn_hidden": 704} if arch == "llama" else {}))
    par = ParallelConfig(global_batch=8, pp=pp, tp=tp)
    ours = rank_params(spec, pp, tp)
    assert ours == pytest.approx([memory_rank_params(config, par, r) for r in range(pp)],
                                 rel=1e-12)
    if (pp, tp) == (1, 1):
        assert ours[0] == parameter_count(spec).total


def test_activation_bytes_by_hand():
    """A Llama layer, s·b = X tokens, bf16: norms and block inputs 4Xh, Q K V O
    X(2q + 2c), SwiGLU 3Xf; full recompute keeps Xh; unfused adds the s² scores."""
    spec, X = _llama(), S * 2
    layer = spec.layers[0]
    flash = activation_bytes_per_layer(layer, spec, S, 2)
    assert flash == 2 * (4 * X * 256 + X * (2 * 256 + 2 * 64) + 3 * X * 704)
    unfused = activation_bytes_per_layer(layer, spec, S, 2, attention="unfused")
    assert unfused - flash == 2 * S * X * 8
    assert activation_bytes_per_layer(layer, spec, S, 2, attention="unfused",
                                      recompute="selective") == flash
    assert activation_bytes_per_layer(layer, spec, S, 2, recompute="full") == 2 * X * 256
    tp2 = activation_bytes_per_layer(layer, spec, S, 2, tp=2, sequence_parallel=True)
    assert tp2 == flash / 2
    # torchtitan's per-op policy: x, x W_q, x W_v, the attention's output, x W_gate
    op = activation_bytes_per_layer(layer, spec, S, 2, recompute="op")
    assert op == 2 * (X * 256 + X * (2 * 256 + 64) + X * 704)
    assert activation_bytes_per_layer(layer, spec, S, 2, tp=2, sequence_parallel=True,
                                      recompute="op") == op / 2 + 2 * X * 256 / 2
    moe = ModelSpec(name="moe", hidden=256, vocab=1000, layers=(
        Layer(layer.attention, MoE(experts=4, top_k=2, expert=MLP("swiglu", 128))),))
    with pytest.raises(ValueError, match="recompute 'op'.*runs on a dense layer"):
        activation_bytes_per_layer(moe.layers[0], moe, S, 2, recompute="op")


def test_every_convention_is_named():
    spec = load_model("llama-3.1-8b")
    causal, megatron, palm = (flops_per_token(spec, 8192, c).forward
                              for c in ("causal", "megatron", "palm"))
    assert causal < megatron < palm            # palm adds the embedding table's 2·V·h
    assert palm - megatron == pytest.approx(2 * parameter_count(spec).embedding, rel=1e-3)
