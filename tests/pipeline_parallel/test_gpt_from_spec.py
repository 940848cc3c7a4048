"""The emulated GPT, Llama and MoE programs built from tiny ``ModelSpec``s (issue 51):
the program's parameters are the model layer's count, and training on several meshes
equals the single-process numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from modeling import MLP, Attention, Layer, ModelSpec, MoE, parameter_count
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig

from .gpt_data import mesh_of, token_data

SEQ, BATCH, STEPS, LR = 8, 4, 2, 0.05
RTOL, ATOL = 1e-9, 1e-12


def _spec(kind: str) -> ModelSpec:
    if kind == "gpt":
        layer = Layer(Attention(4, 4, 4, qkv_bias=True, out_bias=True), MLP("gelu", 64, True))
        return ModelSpec("tiny-gpt", 16, 32, (layer,) * 4, norm="layernorm",
                         positions="learned", max_seq=SEQ, rope_theta=None)
    mlp = MLP("swiglu", 24)
    if kind == "moe":
        mlp = MoE(4, 2, MLP("swiglu", 12), aux_loss_coef=0.01)
    return ModelSpec(f"tiny-{kind}", 16, 32, (Layer(Attention(4, 2, 4), mlp),) * 4)


KINDS = ("gpt", "llama", "moe")


@pytest.mark.parametrize("kind", KINDS)
def test_the_programs_parameters_are_the_model_layers_count(kind):
    spec = _spec(kind)
    config = GPTConfig.from_spec(spec, SEQ)
    shapes = GPT(config).param_shapes()
    assert sum(math.prod(s) for s in shapes.values()) == parameter_count(spec).total


def test_from_spec_is_the_hand_written_config():
    assert GPTConfig.from_spec(_spec("llama"), SEQ) == GPTConfig(
        hidden=16, layers=4, heads=4, seq=SEQ, vocab=32, arch="llama", kv_heads=2,
        ffn_hidden=24, rope_theta=10000.0)
    assert GPTConfig.from_spec(_spec("gpt"), SEQ) == GPTConfig(hidden=16, layers=4, heads=4,
                                                               seq=SEQ, vocab=32)


CASES = [("gpt", "pp2", "1f1b"), ("gpt", "dp2 tp2", "1f1b"), ("llama", "tp2", "gpipe"),
         ("llama", "dp2 pp2", "1f1b"), ("moe", "pp2", "1f1b"), ("moe", "dp2", "1f1b")]


@pytest.mark.parametrize("kind, mesh, schedule", CASES,
                         ids=[f"{k}-{m.replace(' ', '-')}-{s}" for k, m, s in CASES])
def test_training_a_spec_equals_the_reference(cluster_of, kind, mesh, schedule):
    config = GPTConfig.from_spec(_spec(kind), SEQ)
    mesh = mesh_of(mesh)
    model = GPT(config, seed=3)
    tokens, targets = token_data(config, BATCH, seed=5)
    par = ParallelConfig(global_batch=BATCH, micro_batch=1, dp=mesh.shape.get("dp", 1),
                         pp=mesh.shape.get("pp", 1), tp=mesh.shape.get("tp", 1),
                         schedule=schedule)
    run = model.fit(cluster_of(mesh), tokens, targets, steps=STEPS, parallel=par,
                    optimizer="sgd", lr=LR)
    ref = model.fit_reference(tokens, targets, steps=STEPS, optimizer="sgd", lr=LR,
                              **({"parallel": par} if config.experts else {}))
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    for name in ref.params:
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
