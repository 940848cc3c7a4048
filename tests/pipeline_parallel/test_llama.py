"""Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases): the emulated
dp x pp x tp training — K/V heads split over tp or replicated when kv_heads < tp, with and
without sequence parallelism, every recomputation mode — computes what a single-process
numpy Llama computes; its FLOPs are the closed form 6·N·tokens + 6·B·s²·l·h_q; its trace
moves exactly the emulator's bytes."""

from collections import Counter

import numpy as np
import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import (GPT, GPTConfig, ParallelConfig, llama_ffn_hidden,
                                   llama_model_flops, model_flops)
from pipeline_parallel.llama import _rotations
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, comm_signature,
                                      trace_comm_signature, trace_program)

from .gpt_data import (assert_central_difference, mesh_of, token_data)

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12


def _cfg(kv_heads, layers=2, **kw):
    return GPTConfig(**{**dict(hidden=16, layers=layers, heads=4, seq=8, vocab=32,
                               arch="llama", kv_heads=kv_heads, ffn_hidden=24), **kw})


def _data(cfg, seed=0, batch=B):
    return token_data(cfg, batch, seed)


_mesh = mesh_of


def _parallel(mesh, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=kw.pop("global_batch", B), **dict(mesh.shape), **kw)


@pytest.fixture(scope="module")
def clusters(cluster_of):
    return cluster_of


# --- configuration -------------------------------------------------------------------------
def test_config_defaults_and_errors():
    gpt = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32)
    assert (gpt.arch, gpt.kv_heads, gpt.ffn_hidden) == ("gpt", 4, 64)
    llama = GPTConfig(hidden=4096, layers=32, heads=32, seq=4096, vocab=32000, arch="llama")
    assert (llama.kv_heads, llama.ffn_hidden) == (32, 11008)      # Llama-2 7B's published
    assert llama_ffn_hidden(5120) == 13824                           # Llama-2 13B's
    assert "arch='llama', kv_heads=32, ffn_hidden=11008, rope_theta=10000.0" in repr(llama)
    base = dict(hidden=16, layers=2, heads=4, seq=8, vocab=32)
    with pytest.raises(ValueError, match=r"arch='bert': not a block the GPT program runs; "
                                         r"allowed: one of gpt, llama"):
        GPTConfig(**base, arch="bert")
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        GPTConfig(**base, arch="llama", kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads must be an int >= 1, got 0"):
        GPTConfig(**base, arch="llama", kv_heads=0)
    with pytest.raises(ValueError, match="ffn_hidden must be an int >= 1, got -2"):
        GPTConfig(**base, arch="llama", ffn_hidden=-2)
    with pytest.raises(ValueError, match="kv_heads=2 needs arch='llama'"):
        GPTConfig(**base, kv_heads=2)
    with pytest.raises(ValueError, match="ffn_hidden=24 needs arch='llama'"):
        GPTConfig(**base, ffn_hidden=24)
    with pytest.raises(ValueError, match="rope_theta must be a number > 0, got 0"):
        GPTConfig(**base, arch="llama", rope_theta=0)
    with pytest.raises(ValueError, match="hidden/heads = 3 must be even"):
        GPTConfig(hidden=12, layers=2, heads=4, seq=8, vocab=32, arch="llama")
    model = GPT(GPTConfig(hidden=48, layers=2, heads=12, seq=8, vocab=32, arch="llama",
                          kv_heads=3, ffn_hidden=32))
    with pytest.raises(ValueError, match="kv_heads=3 >= tp=2 must be a multiple of tp"):
        model.train_job(_mesh("tp2"), ParallelConfig(global_batch=4, tp=2))
    with pytest.raises(ValueError, match="kv_heads=3 < tp=4 must divide tp"):
        model.train_job(_mesh("tp4"), ParallelConfig(global_batch=4, tp=4))
    with pytest.raises(ValueError, match="ffn_hidden=30 does not split evenly over tp=4"):
        GPT(GPTConfig(hidden=48, layers=2, heads=12, seq=8, vocab=32, arch="llama",
                      kv_heads=4, ffn_hidden=30)).train_job(
            _mesh("tp4"), ParallelConfig(global_batch=4, tp=4))


def test_reference_gradients_match_finite_differences():
    cfg = GPTConfig(hidden=8, layers=2, heads=4, seq=5, vocab=11, arch="llama", kv_heads=2,
                    ffn_hidden=12)
    model = GPT(cfg, seed=3)
    tokens, targets = _data(cfg, 1, batch=2)
    params = model.init_params()
    grads = model.fit_reference(tokens, targets, steps=1).grads
    rng = np.random.default_rng(0)
    for name, p in params.items():
        idx = tuple(int(rng.integers(0, n)) for n in p.shape)
        assert_central_difference(model, tokens, targets, params, grads, name, idx,
                                  abs_tol=1e-8)


def test_reference_rope_is_the_complex_rotation():
    """RoPE: (x_i + i·x_{i+d/2})·exp(i·p·theta^(-2i/d)), pair by pair."""
    s, d, theta = 6, 8, 500.0
    x = np.random.default_rng(0).standard_normal((s, d))
    z = (x[:, :d // 2] + 1j * x[:, d // 2:]) * np.exp(
        1j * np.arange(s)[:, None] * theta ** (-2 * np.arange(d // 2) / d))
    np.testing.assert_allclose(np.einsum("pij,pj->pi", _rotations(s, d, theta), x),
                               np.concatenate([z.real, z.imag], axis=1), rtol=1e-12)


def test_reference_gqa_is_attention_with_repeated_kv_heads():
    """kv_heads = c equals kv_heads = a with each K/V head repeated a/c times."""
    gqa, mha = _cfg(kv_heads=1), _cfg(kv_heads=4)
    tokens, targets = _data(gqa)
    params = GPT(gqa, seed=2).init_params()
    wide = dict(params)
    for i in range(gqa.layers):
        w = params[f"layers.{i}.w_kv"]                                  # (h, 2, d)
        wide[f"layers.{i}.w_kv"] = np.concatenate([w] * 4, axis=2)
    loss, logits = GPT(gqa).reference_forward(tokens, targets, params)
    loss4, logits4 = GPT(mha).reference_forward(tokens, targets, wide)
    np.testing.assert_allclose(loss4, loss, rtol=RTOL)
    np.testing.assert_allclose(logits4, logits, rtol=RTOL, atol=ATOL)


# --- emulated training equals the reference --------------------------------------------------
CASES = [  # mesh, kv_heads, sequence parallel, recompute, schedule, micro-batch
    ("pp2", 1, False, "none", "1f1b", 1),
    ("tp2", 4, False, "none", "1f1b", 2),
    ("tp2", 1, True, "full", "gpipe", 2),               # kv_heads < tp, SP
    ("tp2", 1, False, "selective", "1f1b", 1),           # kv_heads < tp, no SP
    ("tp4", 2, True, "none", "1f1b", 2),                 # kv_heads < tp, SP
    ("tp4", 1, False, "full", "1f1b", 2),                # kv_heads < tp, no SP
    ("tp4", 4, True, "selective", "1f1b", 1),
    ("pp2 tp2", 1, False, "none", "zero_bubble", 1),     # W split from I, kv replicated
    ("dp2 pp2 tp2", 1, True, "none", "1f1b", 1),         # replicas' sum, then dp's
    ("pp2", 2, False, "op", "1f1b", 1),                  # torchtitan's per-op policy
    ("tp2", 1, True, "op", "1f1b", 2),                   # y kept, the gathers re-run
    ("tp2", 2, False, "op", "gpipe", 2),                 # W_o and its all-reduce re-run
    ("pp2 tp2", 1, True, "op", "zero_bubble", 1),
    ("pp2 tp2", 1, True, "full-torch", "1f1b", 1),       # PyTorch's: W_down not re-run
    ("tp2", 2, False, "full-torch", "zero_bubble", 2),
]


@pytest.mark.parametrize("mesh, kv, sp, recompute, schedule, b", CASES,
                         ids=[f"{m.replace(' ', '-')}-kv{k}-{'sp' if sp else 'nosp'}-{r}-{s}"
                              for m, k, sp, r, s, _ in CASES])
def test_training_equals_reference(clusters, mesh, kv, sp, recompute, schedule, b):
    mesh, cfg = _mesh(mesh), _cfg(kv)
    model = GPT(cfg, seed=1)
    tokens, targets = _data(cfg)
    par = _parallel(mesh, micro_batch=b, schedule=schedule, sequence_parallel=sp,
                    recompute=recompute)
    cluster = clusters(mesh)
    loss, logits = model.forward(cluster, tokens, targets, par)
    ref_loss, ref_logits = model.reference_forward(tokens, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    run = model.fit(cluster, tokens, targets, steps=STEPS, parallel=par, optimizer="sgd", lr=LR)
    ref = model.fit_reference(tokens, targets, steps=STEPS, optimizer="sgd", lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.params.keys() == ref.params.keys() == run.grads.keys()
    for name in ref.params:
        assert run.params[name].shape == ref.params[name].shape, name
        np.testing.assert_allclose(run.grads[name], ref.grads[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    assert ref.losses[-1] < ref.losses[0]


# --- FLOPs and traffic: emulator == trace == closed form --------------------------------------
def _layer_params(cfg) -> int:
    """Per layer, the parameters that enter a product: h·(h_q + 2·c·d) + h_q·h + 3·h·f,
    h_q = a·d (h itself unless the config has a head_dim of its own)."""
    h, d = cfg.hidden, cfg.head_dim
    hq = cfg.heads * d
    return h * (hq + 2 * cfg.kv_heads * d) + hq * h + 3 * h * cfg.ffn_hidden


def _expected_flops(cfg, batch, tp, recompute, sp=False) -> int:
    """The closed form, + recomputation (full: every layer's forward; full-torch: every
    layer's forward but W_down's product; selective: the core attention's forward; op: the
    K, W_up and — without sequence parallelism — W_o products), + the K/V products the
    kv_heads < tp replicas repeat (op: their K again)."""
    h, s, l, d = cfg.hidden, cfg.seq, cfg.layers, cfg.head_dim
    hq = cfg.heads * d
    model = llama_model_flops(batch, s, l, h, cfg.vocab, cfg.heads, cfg.kv_heads,
                              cfg.ffn_hidden, head_dim=d)
    n = l * _layer_params(cfg) + h * cfg.vocab
    assert model == 6 * n * batch * s + 6 * batch * s * s * l * hq
    assert model == model_flops(cfg, batch)
    attention = 2 * batch * s * s * l * hq
    op = 2 * batch * s * l * (h * cfg.kv_heads * d + h * cfg.ffn_hidden + (0 if sp else hq * h))
    full = 2 * l * _layer_params(cfg) * batch * s + attention
    extra = {"none": 0, "selective": attention, "op": op, "full": full,
             "full-torch": full - 2 * l * h * cfg.ffn_hidden * batch * s}[recompute]
    rerun = recompute in ("full", "full-torch")
    replicas = max(tp - cfg.kv_heads, 0) * (6 + 2 * rerun) * batch * s * h \
        * 2 * d * l + max(tp - cfg.kv_heads, 0) * 2 * batch * s * h * d * l * (recompute == "op")
    return model + extra + replicas


FLOPS = [  # mesh, kv_heads, sequence parallel, recompute[, attention variant (issue 52)]
    ("tp1", 2, False, "none"), ("dp2 pp2 tp2", 2, True, "none"), ("tp4", 4, False, "full"),
    ("pp2 tp2", 1, True, "selective"), ("tp4", 2, False, "none"), ("tp4", 1, True, "full"),
    ("tp2", 2, True, "selective", {"head_dim": 12}),                  # h_q = 48 > h = 32
    ("pp2 tp4", 1, False, "full", {"head_dim": 4, "qk_norm": True}),  # h_q = 16 < h
    ("tp1", 4, False, "none", {"head_dim": 10, "qk_norm": True}),
    ("tp1", 2, False, "op"), ("tp2", 1, True, "op"), ("pp2 tp2", 2, False, "op"),
    ("tp4", 2, False, "op", {"head_dim": 10, "qk_norm": True}),
    ("tp4", 2, False, "full-torch"), ("pp2 tp2", 1, True, "full-torch")]


@pytest.mark.parametrize("mesh, kv, sp, recompute, variant",
                         [f + ({},) * (5 - len(f)) for f in FLOPS],
                         ids=[f"{m.replace(' ', '-')}-kv{k}-{'sp' if sp else 'nosp'}-{r}"
                              + "".join(f"-{a}={b}" for a, b in (v[0] if v else {}).items())
                              for m, k, sp, r, *v in FLOPS])
def test_traced_flops_equal_the_closed_form(mesh, kv, sp, recompute, variant):
    """With a head_dim of its own (h_q = a·d != h) and QK-norm (declared 0 FLOPs, as every
    norm) too."""
    mesh = _mesh(mesh)
    cfg = _cfg(kv, layers=4, hidden=32, vocab=64, ffn_hidden=40, **variant)
    par = _parallel(mesh, global_batch=8, micro_batch=2, sequence_parallel=sp,
                    recompute=recompute)
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    total = sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))
    assert total == _expected_flops(cfg, 8, mesh.shape.get("tp", 1), recompute, sp)


TRAFFIC = [("pp2 tp2", 2, True, "full", "1f1b"), ("tp4", 1, True, "none", "zero_bubble"),
           ("dp2 tp2", 1, False, "selective", "1f1b"), ("tp2", 1, True, "op", "1f1b"),
           ("pp2 tp2", 2, False, "op", "zero_bubble"),
           ("pp2 tp2", 2, True, "full-torch", "1f1b"), ("tp2", 1, False, "full-torch", "1f1b")]


@pytest.mark.parametrize("mesh, kv, sp, recompute, schedule", TRAFFIC,
                         ids=["-".join(map(str, c)).replace(" ", "-") for c in TRAFFIC])
def test_traced_traffic_and_flops_equal_the_emulator(clusters, mesh, kv, sp, recompute, schedule):
    mesh, cfg = _mesh(mesh), _cfg(kv)
    model = GPT(cfg, seed=1)
    tokens, targets = _data(cfg)
    par = _parallel(mesh, micro_batch=2 if "dp" not in mesh.axes else 1, schedule=schedule,
                    sequence_parallel=sp, recompute=recompute)
    cluster = clusters(mesh)
    job = model.train_job(mesh, par, steps=1, bucket_bytes=2048)
    cluster.reset_stats()
    cluster.run(train_program, model.device_args(mesh, job, tokens, targets))
    events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
    traces = trace_program(mesh, train_program, model.meta_args(mesh, par, 1, bucket_bytes=2048))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in traces] == flops
    assert sum(flops) == _expected_flops(cfg, B, mesh.shape.get("tp", 1), recompute, sp)


def test_kv_replicas_sum_once_per_step():
    """kv_heads < tp: one all_reduce(tp) per layer and step of the kv_heads stacked dW_kv
    (2·h·d each) beside Megatron's per-micro-batch collectives; none when kv_heads >= tp."""
    m, l, steps = 3, 2, 2
    mesh, par = _mesh("tp2"), ParallelConfig(global_batch=2 * m, micro_batch=2, tp=2)
    counts = {}
    for kv in (1, 2, 4):
        trace = trace_program(mesh, train_program,
                              GPT(_cfg(kv, layers=l)).meta_args(mesh, par, steps=steps))[0]
        counts[kv] = Counter((op.collective, op.nbytes) for op in trace.ops
                             if isinstance(op, TraceCollective))
    cfg = _cfg(1)
    assert counts[1] - counts[4] == {("all_reduce", 2 * cfg.hidden * cfg.head_dim * 8): steps * l}
    assert counts[4] - counts[1] == Counter() and counts[2] == counts[4]


def test_full_torch_recompute_is_the_dense_layers():
    """PyTorch's non-reentrant full recomputation stops before the MLP's last GEMM: the
    dense GPT and Llama layers run it (tests above), an MoE model asking for it is refused
    naming the field; the plan keeps what "full" keeps."""
    from modeling import ConfigError
    mesh = _mesh("tp2")
    moe = _cfg(2, experts=4, moe_ffn_hidden=12, moe_top_k=2)
    with pytest.raises(ConfigError, match=r"recompute='full-torch'.*dense GPT and Llama "
                                          r"layers'.*allowed: none, selective or full"):
        trace_program(mesh, train_program,
                      GPT(moe).meta_args(mesh, _parallel(mesh, recompute="full-torch")))
    from vcluster.planner.memory import gpt_memory
    from vcluster.planner.simulation import gpt_schedule
    cfg = _cfg(2)
    full, torch_full = (_parallel(mesh, recompute=r) for r in ("full", "full-torch"))
    assert gpt_memory(cfg, full, gpt_schedule(full)) == \
        gpt_memory(cfg, torch_full, gpt_schedule(torch_full))


@pytest.mark.parametrize("cfg", [GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32),
                                 _cfg(2, experts=4, moe_ffn_hidden=12, moe_top_k=2)],
                         ids=["gpt", "moe"])
def test_op_recompute_is_the_dense_llama_layers(cfg):
    """torchtitan's per-op policy runs on the dense Llama layer alone: a GPT or an MoE model
    asking for it is refused, naming the field, its value and what is allowed."""
    from modeling import ConfigError
    mesh = _mesh("tp2")
    with pytest.raises(ConfigError, match=r"recompute.*'op'.*none, selective or full"):
        trace_program(mesh, train_program,
                      GPT(cfg).meta_args(mesh, _parallel(mesh, recompute="op")))
