"""Multi-head latent attention (MLA, DeepSeek-V2/V3; issue 52) in the Llama program
(``GPTConfig(kv_lora_rank=...)``, :mod:`tensor_parallel.mla`). The numpy reference's
gradients equal finite differences, and its forward equals Hugging Face's
DeepseekV3Attention written out; the emulated dp x pp x cp x tp (x ep) training equals the
reference (rtol 1e-9, float64: loss, logits, every gradient, 3 SGD steps) — tp 2 and cp 2
(the issue's acceptance), tp 1, pp 2, sequence parallelism, ZeRO-2, with and without query
compression, in an MoE model; context-parallel attention with values of their own width;
the trace moves the emulator's bytes and declares its FLOPs, which equal the closed form
(+ the tp ranks' redundant down-projections); the memory model's parameters are what the
program holds and the model layer counts; the configs refuse what MLA cannot be; the
DeepSeek-V3 preset loads with its attention."""

import dataclasses
from collections import Counter

import numpy as np
import pytest

from mesh import Mesh
from modeling import (MLP, ConfigError, LatentAttention, Layer, ModelSpec, flops_per_token,
                      load_model, parameter_count)
from modeling.counts import rank_params as spec_rank_params
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from pipeline_parallel.llama import _mla_backward, _mla_forward, _rotations
from tensor_parallel.context_parallel import ContextParallelAttention as CPA
from vcluster.planner.memory import cp_buffer_bytes, rank_params
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, comm_signature,
                                      meta_like, trace_comm_signature, trace_program)

from .gpt_data import (assert_central_difference, assert_fit_equals_reference,
                       assert_same_params_and_grads, count_params, mesh_of, token_data)

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12
#: r_q 5, r_kv 6, d_n 3 + d_r 2 = d_qk 5 != d_v 4 (and != h/a = 4): every width distinct
MLA = dict(kv_lora_rank=6, q_lora_rank=5, qk_nope_head_dim=3, qk_rope_head_dim=2,
           v_head_dim=4)


def _cfg(q_lora: bool = True, **kw) -> GPTConfig:
    return GPTConfig(**{**dict(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                               ffn_hidden=24), **MLA, "q_lora_rank": 5 if q_lora else None,
                        **kw})


# --- configuration -------------------------------------------------------------------------
def test_config_and_parameter_shapes():
    c = _cfg()
    assert (c.head_dim, c.kv_heads, c.qk_norm) == (5, 4, False)
    assert c.latent_attention() == LatentAttention(4, 5, 6, 3, 2, 4)
    shapes = GPT(c).param_shapes()
    assert [(n.split(".")[-1], s) for n, s in shapes.items() if n.startswith("layers.1.")] == [
        ("attn_norm_g", (16,)), ("w_q_a", (16, 5)), ("q_a_norm_g", (5,)), ("w_q_b", (5, 20)),
        ("w_kv_a", (16, 8)), ("kv_a_norm_g", (6,)), ("w_kv_b", (6, 28)), ("w_o", (16, 16)),
        ("mlp_norm_g", (16,)), ("w_gate", (16, 24)), ("w_up", (16, 24)), ("w_down", (24, 16))]
    plain = GPT(_cfg(q_lora=False)).param_shapes()
    assert plain["layers.0.w_q"] == (16, 20) and "layers.0.w_q_a" not in plain
    assert _cfg(hidden=18).head_dim == 5        # h need not split over the heads


@pytest.mark.parametrize("kw, match", [
    (dict(arch="gpt"), r"kv_lora_rank=6: multi-head latent attention needs arch='llama'"),
    (dict(qk_rope_head_dim=None), r"qk_rope_head_dim=None: .* needs qk_rope_head_dim"),
    (dict(v_head_dim=None), r"needs v_head_dim"),
    (dict(qk_rope_head_dim=3), r"qk_rope_head_dim=3: RoPE rotates pairs"),
    (dict(kv_heads=2), r"kv_heads=2: multi-head latent attention's kv_heads is heads"),
    (dict(qk_norm=True), r"qk_norm=True: .*no QK-norm"),
    (dict(head_dim=4), r"head_dim=4: .*the query/key head width d_n \+ d_r"),
    (dict(kv_lora_rank=None), r"q_lora_rank=5: q_lora_rank is multi-head latent attention's"),
    (dict(kv_lora_rank=0), r"kv_lora_rank must be an int >= 1, got 0"),
])
def test_config_refuses_what_mla_cannot_be(kw, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _cfg(**kw)


def test_tp_must_split_the_heads():
    with pytest.raises(ConfigError, match="heads=4 does not split evenly over tp=8"):
        ParallelConfig(global_batch=4, tp=8).check(_cfg(), Mesh((8,), ("tp",)))


# --- the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_reference_gradients_match_finite_differences(q_lora):
    """Every parameter of a tiny two-layer model (each latent gain entry, two random
    entries of every other tensor) and the attention block's input u (every entry),
    against central differences."""
    cfg = GPTConfig(hidden=8, layers=2, heads=2, seq=5, vocab=11, arch="llama",
                    ffn_hidden=12, kv_lora_rank=4, q_lora_rank=3 if q_lora else None,
                    qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=5)
    model = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, 2, seed=1)
    params = model.init_params()
    grads = model.fit_reference(tokens, targets, steps=1).grads
    rng = np.random.default_rng(0)
    for name, p in params.items():
        picks = p.size if name.endswith("_a_norm_g") else 2
        for _ in range(picks):
            idx = tuple(int(rng.integers(0, n)) for n in p.shape)
            assert_central_difference(model, tokens, targets, params, grads, name, idx,
                                      abs_tol=1e-8)
    # the block alone: d<w, ctx(u) W_o>/du for a fixed random w, every entry of u
    L = {n.split(".", 2)[2]: a for n, a in params.items() if n.startswith("layers.0.")}
    u = rng.standard_normal((2, cfg.seq, cfg.hidden))
    R, causal = _rotations(cfg.seq, 2, cfg.rope_theta), np.tril(np.ones((5, 5), bool))
    w = rng.standard_normal((2, cfg.seq, cfg.hidden))

    def f(u):
        return float(np.sum(w * (_mla_forward(cfg, L, u, R, causal)[0] @ L["w_o"])))

    du, _ = _mla_backward(cfg, L, u, R, _mla_forward(cfg, L, u, R, causal)[1], w @ L["w_o"].T)
    for idx in np.ndindex(u.shape):
        old = u[idx]
        u[idx] = old + 1e-6
        up = f(u)
        u[idx] = old - 1e-6
        down = f(u)
        u[idx] = old
        assert (up - down) / 2e-6 == pytest.approx(du[idx], rel=1e-5, abs=1e-8), idx


def _deepseek_logits(cfg, P, tokens):
    """A one-layer MLA model written out as Hugging Face's DeepseekV3Attention orders it:
    q_pe and k_pe rotated as complex numbers of the pairs (i, i + d_r/2), k_pe expanded to
    every head, query_states = [q_nope | q_pe], key_states = [k_nope | k_pe]."""
    L, a, eps = "layers.0.", cfg.heads, cfg.eps
    dn, dr, dv, r_kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
        cfg.kv_lora_rank

    def rms(z, g):
        return g * z / np.sqrt(np.mean(z ** 2, -1, keepdims=True) + eps)

    def rope(z):                                                      # z (B, s, n, d_r)
        turn = np.exp(1j * np.arange(z.shape[1])[:, None]
                      * cfg.rope_theta ** (-2 * np.arange(dr // 2) / dr))[None, :, None]
        zc = (z[..., :dr // 2] + 1j * z[..., dr // 2:]) * turn
        return np.concatenate([zc.real, zc.imag], -1)

    x = P["wte"][tokens]
    (Bn, s, _), u = x.shape, rms(x, P[L + "attn_norm_g"])
    q = (rms(u @ P[L + "w_q_a"], P[L + "q_a_norm_g"]) @ P[L + "w_q_b"]).reshape(Bn, s, a, -1)
    ckv = u @ P[L + "w_kv_a"]
    k_pe = rope(ckv[..., r_kv:].reshape(Bn, s, 1, dr))
    kv = (rms(ckv[..., :r_kv], P[L + "kv_a_norm_g"]) @ P[L + "w_kv_b"]).reshape(Bn, s, a, -1)
    query = np.concatenate([q[..., :dn], rope(q[..., dn:])], -1)
    key = np.concatenate([kv[..., :dn], np.repeat(k_pe, a, axis=2)], -1)
    S = np.einsum("bqnd,bknd->bnqk", query, key) / np.sqrt(dn + dr) \
        + np.triu(np.full((s, s), -np.inf), 1)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    x = x + np.einsum("bnqk,bknd->bqnd", A, kv[..., dn:]).reshape(Bn, s, a * dv) @ P[L + "w_o"]
    u2 = rms(x, P[L + "mlp_norm_g"])
    zg = u2 @ P[L + "w_gate"]
    x = x + (zg / (1 + np.exp(-zg)) * (u2 @ P[L + "w_up"])) @ P[L + "w_down"]
    return rms(x, P["norm_f_g"]) @ P["w_out"]


def test_reference_is_deepseek_v3s_attention():
    cfg = _cfg(layers=1, qk_rope_head_dim=4)
    params = GPT(cfg, seed=2).init_params()
    tokens, targets = token_data(cfg, B, seed=4)
    np.testing.assert_allclose(GPT(cfg).reference_forward(tokens, targets, params)[1],
                               _deepseek_logits(cfg, params, tokens), rtol=1e-12, atol=1e-12)


# --- emulated training equals the reference ---------------------------------------------------
CASES = [  # mesh, query compression, extra ParallelConfig fields
    ("tp2", True, {}),                                                    # acceptance
    ("cp2", True, {"cp_algorithm": "ring", "attention": "flash"}),        # acceptance
    ("pp2", True, {"schedule": "1f1b"}),                                  # tp 1, pp 2
    ("dp2", False, {"recompute": "full"}),                                # tp 1
    ("tp2", False, {"sequence_parallel": True, "recompute": "selective"}),
    ("tp2", True, {"sequence_parallel": True, "tp_overlap": "none"}),     # dx reduced apart
    ("pp2 tp2", True, {"schedule": "zero_bubble"}),                       # W apart from I
    ("dp2 tp2", False, {"zero_stage": 2}),         # the tp sums every micro-batch
    ("cp2", False, {"cp_algorithm": "all_gather", "attention": "flash"}),
    ("cp2 tp2", True, {"cp_algorithm": "ring", "attention": "flash",
                       "sequence_parallel": True}),
    ("cp2 tp2", False, {"cp_algorithm": "all_gather", "attention": "flash",
                        "recompute": "selective"}),           # the core re-run under cp
    ("dp2 tp2", True, {"zero_stage": 3}),
]


def _parallel(mesh, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=kw.pop("global_batch", B),
                          micro_batch=kw.pop("micro_batch", 1), **dict(mesh.shape), **kw)


@pytest.fixture(scope="module")
def references():
    """(model, data, forward, 3-step fit) per query compression, computed once."""
    out = {}

    def get(q_lora):
        if q_lora not in out:
            model = GPT(_cfg(q_lora), seed=1)
            tokens, targets = token_data(model.config, B, seed=0)
            out[q_lora] = (model, tokens, targets, model.reference_forward(tokens, targets),
                           model.fit_reference(tokens, targets, steps=STEPS, lr=LR))
        return out[q_lora]

    return get


@pytest.mark.parametrize("mesh, q_lora, extra", CASES,
                         ids=[f"{m.replace(' ', '-')}-{'q_lora' if q else 'no_q_lora'}-"
                              + "-".join(f"{a}={b}" for a, b in e.items()) for m, q, e in CASES])
def test_training_equals_the_reference(cluster_of, references, mesh, q_lora, extra):
    mesh = mesh_of(mesh)
    model, tokens, targets, (ref_loss, ref_logits), ref = references(q_lora)
    par = _parallel(mesh, **extra)
    cluster = cluster_of(mesh)
    loss, logits = model.forward(cluster, tokens, targets, par)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    run = model.fit(cluster, tokens, targets, steps=STEPS, parallel=par, lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.params.keys() == ref.params.keys() == run.grads.keys()
    assert_same_params_and_grads(run, ref, RTOL, ATOL)
    assert ref.losses[-1] < ref.losses[0]
    for n in ("layers.0.kv_a_norm_g", "layers.1.w_kv_a") + (
            ("layers.0.q_a_norm_g",) if q_lora else ()):      # the latents learn
        assert np.abs(ref.grads[n]).min() > 0, n


@pytest.mark.parametrize("dense", [(), (0,)], ids=["all_moe", "dense_first"])
def test_moe_training_equals_the_reference(cluster_of, dense):
    """DeepSeek-V3's combination: MLA with routed experts (E 4, top-2, ep 2, tp 2), every
    layer MoE or the first dense."""
    cfg = _cfg(experts=4, moe_top_k=2, moe_ffn_hidden=12, moe_dense_layers=dense)
    par = ParallelConfig(global_batch=4, micro_batch=1, dp=2, ep=2, tp=2)
    model, (tokens, targets) = GPT(cfg, seed=3), token_data(cfg, 4)
    _, ref = assert_fit_equals_reference(cluster_of(par.mesh()), model, par, tokens, targets,
                                         steps=STEPS, lr=LR, rtol=RTOL, atol=ATOL,
                                         parallel=par)
    assert {"w_q_b", "w_kv_b", "moe_gate"} <= {n.rsplit(".", 1)[-1] for n in ref.params}


# --- context-parallel attention with values of their own width --------------------------------
def _attention(q, k, v, dy):
    """O and (dq, dk, dv) of causal softmax(q k^T / sqrt(d)) v, v of any width."""
    s, d = q.shape[1], q.shape[2]
    z = np.einsum("bid,bjd->bij", q, k) / np.sqrt(d) + np.triu(np.full((s, s), -np.inf), 1)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bid,bjd->bij", dy, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    return (np.einsum("bij,bjd->bid", p, v), np.einsum("bij,bjd->bid", ds, k),
            np.einsum("bij,bid->bjd", ds, q), np.einsum("bij,bid->bjd", p, dy))


@pytest.mark.parametrize("algorithm", ["ring", "all_gather"])
@pytest.mark.parametrize("flash", [False, True], ids=["unfused", "flash"])
def test_context_parallel_attention_takes_a_value_width_of_its_own(cluster_of, algorithm,
                                                                   flash):
    """d = 5, d_v = 3 over cp 2: O, dq, dk, dv equal the unsharded attention; the declared
    FLOPs equal the closed form 2·B·c²·(d + d_v)·N_r forward, 2·B·c²·(3d + 2d_v)·N_r
    backward; the bytes sent equal the trace's and the closed form (|K| + |V|)."""
    cp, b, c, d, dv = 2, 3, 2, 5, 3
    mesh = Mesh((cp,), ("cp",))
    op = CPA(1, d, algorithm, collective_algorithm="ring", flash=flash, v_head_dim=dv)
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((b, 2 * cp * c, d)) for _ in range(2))
    v, dy = (rng.standard_normal((b, 2 * cp * c, dv)) for _ in range(2))
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    got = op.backward(cluster, q, k, v, dy)
    for name, x, want in zip(("O", "dq", "dk", "dv"), got, _attention(q, k, v, dy)):
        np.testing.assert_allclose(x, want, rtol=1e-9, atol=1e-12, err_msg=name)
    stats, events = cluster.stats(), cluster.trace()
    local = (b, 2 * c, d)
    metas = [meta_like(np.empty(s)) for s in (local, local, local[:2] + (dv,),
                                               local[:2] + (dv,))]
    traces = trace_program(mesh, op.forward_backward_local, [tuple(metas)] * cp)
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank)
        flops = sum(o.flops for o in t.ops if isinstance(o, TraceCompute))
        pairs = 2 * cp + 1
        assert flops == 2 * b * c * c * pairs * ((d + dv) + (3 * d + 2 * dv)) == \
            op.flops(local, cp, 0) + op.flops(local, cp, 0, backward=True)
    assert stats["bytes_sent"].tolist() == [op.sent_bytes(local, cp, 8)
                                            + op.sent_bytes(local, cp, 8, backward=True)] * cp
    assert op.sent_bytes(local, cp, 8) == b * 2 * c * (d + dv) * 8 * (cp - 1)   # |K| + |V|


# --- traffic and FLOPs: emulator == trace == closed form -----------------------------------
@pytest.mark.parametrize("mesh, sp", [("tp2", True), ("pp2 tp2", False)])
def test_traced_traffic_and_flops_equal_the_emulator(cluster_of, mesh, sp):
    mesh, cfg = mesh_of(mesh), _cfg()
    model = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B)
    par = _parallel(mesh, micro_batch=2, sequence_parallel=sp)
    cluster = cluster_of(mesh)
    job = model.train_job(mesh, par, steps=1, bucket_bytes=2048)
    cluster.reset_stats()
    cluster.run(train_program, model.device_args(mesh, job, tokens, targets))
    events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
    traces = trace_program(mesh, train_program,
                           model.meta_args(mesh, par, 1, bucket_bytes=2048))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute))
            for t in traces] == flops


FLOPS = [  # mesh, query compression, extra ParallelConfig fields
    ("tp1", True, {}), ("pp2", False, {}), ("tp2", True, {"sequence_parallel": True}),
    ("pp2 tp4", False, {"attention": "flash"}), ("tp4", True, {"attention": "unfused"}),
    ("dp2 tp2", True, {"attention": "flash", "tp_overlap": "none"})]


@pytest.mark.parametrize("mesh, q_lora, extra", FLOPS,
                         ids=[f"{m.replace(' ', '-')}-{'q_lora' if q else 'no_q_lora'}-"
                              + "-".join(f"{a}={b}" for a, b in e.items()) for m, q, e in FLOPS])
def test_traced_flops_equal_the_closed_form(mesh, q_lora, extra):
    """Σ over ranks of the traced FLOPs of one step = model_flops (the projections 6·N·B·s,
    the core 3·B·s²·l·a·(d_qk + d_v)) + what the tp ranks repeat: each computes the
    replicated down-projections, 6·B·s·l·h·(r_q + r_kv + d_r) per extra rank. (Context
    parallelism's chunk pairs count their diagonal blocks whole: see the cp test above.)"""
    mesh = mesh_of(mesh)
    cfg = _cfg(q_lora, layers=4, hidden=32, heads=8, vocab=64, ffn_hidden=40, seq=16)
    par = _parallel(mesh, global_batch=8, micro_batch=2, **extra)
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    total = sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))
    h, s, l, t = cfg.hidden, cfg.seq, cfg.layers, mesh.shape.get("tp", 1)
    replicated = 6 * 8 * s * l * h * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank
                                      + cfg.qk_rope_head_dim)
    assert total == model_flops(cfg, 8) + (t - 1) * replicated


def test_latent_gradients_sum_over_tp_once_per_step():
    """tp 2: beside the dense model's collectives, one all_reduce(tp) per layer and step of
    the replicated projections' gradients (h·(r_q + r_kv + d_r) + r_q + r_kv elements)."""
    m, l, steps = 3, 2, 2
    mesh, par = mesh_of("tp2"), ParallelConfig(global_batch=2 * m, micro_batch=2, tp=2)
    trace = trace_program(mesh, train_program, GPT(_cfg(layers=l)).meta_args(
        mesh, par, steps=steps))[0]
    sums = Counter(op.nbytes for op in trace.ops if isinstance(op, TraceCollective)
                   and op.collective == "all_reduce")
    latent = (16 * (5 + 6 + 2) + 5 + 6) * 8
    assert sums[latent] == steps * l


# --- memory and the model layer's counts -------------------------------------------------
def _spec(q_lora=5, layers=4, mlp=None) -> ModelSpec:
    att = LatentAttention(8, q_lora, 6, 3, 2, 4)
    return ModelSpec("tiny-mla", 32, 64, (Layer(att, mlp or MLP("swiglu", 40)),) * layers)


@pytest.mark.parametrize("q_lora", [5, None], ids=["q_lora", "no_q_lora"])
def test_from_spec_and_the_model_layers_counts(q_lora):
    """A spec of MLA layers: the config takes its fields; the program's parameters are
    counts.py's total; one step's closed form is 3·flops_per_token·B·s (causal)."""
    spec = _spec(q_lora)
    cfg = GPTConfig.from_spec(spec, 16)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim, cfg.head_dim, cfg.kv_heads) == (6, q_lora, 3, 2, 4, 5, 8)
    assert cfg.latent_attention() == spec.layers[0].attention
    total = parameter_count(spec).total
    assert sum(int(np.prod(s)) for s in GPT(cfg).param_shapes().values()) == total
    assert rank_params(cfg, ParallelConfig(global_batch=4), 0) == total
    assert model_flops(cfg, 4) == pytest.approx(3 * flops_per_token(spec, 16).forward * 4 * 16,
                                                rel=1e-12)


@pytest.mark.parametrize("q_lora, tp", [(5, 2), (None, 2), (5, 4)])
def test_memory_params_are_what_the_program_holds(q_lora, tp):
    """pp 2 x tp: the memory model's parameters per pipeline rank = the pieces the program's
    stages hold (traced) = counts.py's rank_params (down-projections whole, heads split)."""
    spec = _spec(q_lora)
    cfg = GPTConfig.from_spec(spec, 16)
    par = ParallelConfig(global_batch=4, pp=2, tp=tp)
    mesh = par.mesh()
    job = GPT(cfg).meta_args(mesh, par)[0][0]
    ranks = [mesh.rank({"dp": 0, "pp": p, "tp": 0}) for p in range(2)]
    held = [sum(op.flops for op in t.ops
                if isinstance(op, TraceCompute) and op.name == "params")
            for t in trace_program(mesh, count_params, [(job,)] * mesh.size, ranks=ranks)]
    assert held == [rank_params(cfg, par, r) for r in range(2)] \
        == spec_rank_params(spec, pp=2, tp=tp)


def test_cp_buffers_hold_the_up_projected_k_and_v():
    """cp 2, ring: 4 K blocks (a_l·d_qk) and 4 V blocks (a_l·d_v) of s/cp rows, 2 bytes."""
    cfg, b = _cfg(), 2
    par = ParallelConfig(global_batch=4, micro_batch=b, cp=2, tp=2, attention="flash")
    assert cp_buffer_bytes(cfg, par) == 4 * 2 * b * (4 // 2) * (5 + 4) * 8 / 2


# --- the DeepSeek-V3 preset -----------------------------------------------------------------
def test_deepseek_v3_loads_with_its_attention():
    """DeepSeek-V3's MLA: 128 heads, r_q 1536, r_kv 512, d_n 128 + d_r 64, d_v 128 (its
    first three layers dense: if the program still refuses layers that differ, its MoE
    layer repeated), traced for one step of its four layers at seq 256 with 8 experts."""
    try:
        cfg = GPTConfig.of_model("deepseek-v3", seq=4096, timing_only=True, layers=4)
    except ConfigError as e:
        assert "layers that differ" in str(e)
        spec = load_model("deepseek-v3")
        cfg = GPTConfig.from_spec(dataclasses.replace(spec, layers=(spec.layers[-1],) * 4),
                                  4096, timing_only=True)
    assert (cfg.heads, cfg.kv_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.head_dim) == \
        (128, 128, 1536, 512, 128, 64, 128, 192)
    shapes = GPT(cfg).param_shapes()
    assert (shapes["layers.3.w_q_b"], shapes["layers.3.w_kv_a"], shapes["layers.3.w_kv_b"],
            shapes["layers.3.w_o"]) == ((1536, 128 * 192), (7168, 576), (512, 128 * 256),
                                        (128 * 128, 7168))
    proxy = dataclasses.replace(cfg, seq=256, experts=8, moe_top_k=2)
    par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, ep=2, tp=2,
                         sequence_parallel=True)
    mesh = par.mesh()
    trace = trace_program(mesh, train_program, GPT(proxy).meta_args(mesh, par),
                          ranks=[0])[0]
    names = Counter(op.name for op in trace.ops if isinstance(op, TraceCompute))
    assert names["gpt: attention: c_kv @ W_kvb"] == 4 * 2      # 4 layers x 2 micro-batches


# --- the command line -----------------------------------------------------------------------
def test_simulate_takes_the_latent_flags(tmp_path, capsys):
    """--kv-lora-rank, --q-lora-rank and the head dims reach GPTConfig and the title; the
    config's rule comes back named by its flag."""
    import json

    from vcluster.cli.main import main
    flags = ["simulate", "train", "--arch", "llama", "--hidden", "64", "--heads", "4",
             "--layers", "2", "--vocab", "128", "--seq", "64", "--global-batch", "4",
             "--tp", "2", "--kv-lora-rank", "16", "--qk-nope-head-dim", "8",
             "--v-head-dim", "12"]
    out = tmp_path / "mla.json"
    assert main([*flags, "--q-lora-rank", "24", "--qk-rope-head-dim", "4",
                 "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith(
        "Llama h=64 l=2 a=4 kv=4 f=256 d=12 mla(r_q=24, r_kv=16, d_v=12) s=64")
    assert json.loads(out.read_text())["step_time_s"] > 0
    assert main([*flags, "--qk-rope-head-dim", "3"]) == 2
    assert "--qk-rope-head-dim=3: RoPE rotates pairs" in capsys.readouterr().err
