"""Megatron-Core's selective recomputation by module (``ParallelConfig(recompute=
"selective", recompute_modules=...)``; Megatron-LM's ``--recompute-modules``): every
combination trains equal to the single-process reference (rtol 1e-9: losses, logits,
every gradient, 3 SGD steps) on the GPT, Llama, MLA and MoE programs under tp 2 with
sequence parallelism, pp 2 and ep 2; the trace moves the emulator's bytes and declares
its FLOPs; the traced FLOPs grow by exactly the recomputed modules' forward products
(closed forms); the program keeps fewer bytes; the configs refuse what is not modelled
or what the model lacks."""

import pytest

from modeling import ConfigError
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.runtime.tracing import TraceCompute, comm_signature, trace_comm_signature, \
    trace_program

from .gpt_data import assert_fit_equals_reference, mesh_of, token_data

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12
MLA = dict(kv_lora_rank=6, q_lora_rank=5, qk_nope_head_dim=3, qk_rope_head_dim=2,
           v_head_dim=4)
MOE = dict(experts=4, moe_top_k=2, moe_ffn_hidden=12)


def _cfg(kind: str, **kw) -> GPTConfig:
    base = dict(hidden=16, layers=2, heads=4, seq=8, vocab=32)
    extra = {"gpt": {}, "llama": dict(arch="llama", ffn_hidden=24, kv_heads=2),
             "mla": dict(arch="llama", ffn_hidden=24, **MLA),
             "mla_no_q_lora": dict(arch="llama", ffn_hidden=24, **{**MLA, "q_lora_rank": None}),
             "moe": dict(arch="llama", ffn_hidden=24, **MOE),
             "mla_moe": dict(arch="llama", ffn_hidden=24, moe_dense_layers=(0,), **MLA,
                             **MOE)}[kind]
    return GPTConfig(**{**base, **extra, **kw})


CASES = [  # model, mesh, recompute_modules, extra ParallelConfig fields
    ("gpt", "tp2", ("layernorm", "mlp", "core_attn"), {"sequence_parallel": True}),
    ("gpt", "pp2", ("layernorm",), {"schedule": "1f1b"}),
    ("gpt", "dp2 tp2", ("mlp",), {}),
    ("gpt", "tp2", (), {"sequence_parallel": True}),
    ("llama", "tp2", ("layernorm", "mlp"), {"sequence_parallel": True}),
    ("llama", "pp2 tp2", ("mlp", "core_attn"), {"schedule": "zero_bubble"}),
    ("llama", "tp2", ("layernorm",), {"sequence_parallel": True, "tp_overlap": "none"}),
    ("mla", "tp2", ("mla_up_proj", "layernorm"), {"sequence_parallel": True}),
    ("mla", "pp2", ("mla_up_proj", "core_attn", "mlp"), {}),
    ("mla_no_q_lora", "tp2", ("mla_up_proj", "layernorm", "mlp", "core_attn"), {}),
    ("mla", "cp2 tp2", ("mla_up_proj", "core_attn"), {"attention": "flash",
                                                      "sequence_parallel": True}),
]

MOE_CASES = [  # model, ParallelConfig fields, recompute_modules
    ("moe", dict(dp=2, ep=2, tp=2, sequence_parallel=True), ("moe_act", "layernorm")),
    ("moe", dict(dp=2, ep=2, tp=2, sequence_parallel=True, etp=1), ("moe_act",)),
    ("moe", dict(dp=2, ep=2, pp=2), ("moe_act", "layernorm", "core_attn")),
    ("moe", dict(dp=2, ep=2, moe_dispatcher="allgather"), ("moe_act",)),
    # the flex dispatcher (DeepEP / HybridEP) with the MoE overlap, as GPT-OSS's BF16
    # recipes on GB200 and B200 run them (layernorm and moe_act recomputed)
    ("moe", dict(dp=2, ep=2, moe_dispatcher="flex", moe_comm_overlap=True),
     ("moe_act", "layernorm")),
    ("mla_moe", dict(dp=2, ep=2, tp=2, sequence_parallel=True),
     ("moe_act", "layernorm", "mla_up_proj", "mlp")),
]


def _ids(cases):
    return ["-".join(str(x).replace(" ", "") for x in c[:3]) for c in cases]


def _check_training(cluster_of, cfg, par, seed=1):
    model = GPT(cfg, seed=seed)
    tokens, targets = token_data(cfg, B)
    assert_fit_equals_reference(cluster_of(par.mesh()), model, par, tokens, targets,
                                steps=STEPS, lr=LR, rtol=RTOL, atol=ATOL, parallel=par)


def _par(mesh, modules, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=kw.pop("global_batch", B), micro_batch=kw.pop(
        "micro_batch", 1), recompute="selective", recompute_modules=modules,
        **dict(mesh.shape), **kw)


@pytest.mark.parametrize("kind, mesh, modules, extra", CASES, ids=_ids(CASES))
def test_training_equals_the_reference(cluster_of, kind, mesh, modules, extra):
    _check_training(cluster_of, _cfg(kind), _par(mesh_of(mesh), modules, **extra))


@pytest.mark.parametrize("kind, fields, modules", MOE_CASES, ids=_ids(MOE_CASES))
def test_moe_training_equals_the_reference(cluster_of, kind, fields, modules):
    par = ParallelConfig(global_batch=4, micro_batch=1, recompute="selective",
                         recompute_modules=modules, **fields)
    _check_training(cluster_of, _cfg(kind), par, seed=3)


# --- traffic and FLOPs: emulator == trace == closed form -----------------------------------
TRACE = [("gpt", "tp2", ("layernorm", "mlp"), dict(sequence_parallel=True)),
         ("llama", "pp2 tp2", ("layernorm", "mlp", "core_attn"), {}),
         ("mla", "tp2", ("mla_up_proj", "layernorm"), dict(sequence_parallel=True)),
         ("mla_moe", "dp2 tp2", ("moe_act", "layernorm", "mla_up_proj", "mlp"),
          dict(ep=2, sequence_parallel=True))]


@pytest.mark.parametrize("kind, mesh, modules, extra", TRACE, ids=_ids(TRACE))
def test_traced_traffic_and_flops_equal_the_emulator(cluster_of, kind, mesh, modules, extra):
    """(The MoE case traces the run's own routing: its ExpertLoad per layer.)"""
    cfg = _cfg(kind)
    par = ParallelConfig(global_batch=B, micro_batch=2, recompute="selective",
                         recompute_modules=modules, **{**dict(mesh_of(mesh).shape), **extra})
    mesh = par.mesh()
    model = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B)
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    run = model.fit(cluster, tokens, targets, 1, parallel=par, lr=LR)
    events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
    load = {"expert_load": run.expert_load[0]} if cfg.experts else {}
    traces = trace_program(mesh, train_program, model.meta_args(mesh, par, 1, **load))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute))
            for t in traces] == flops


def _traced_flops(cfg, mesh, **kw) -> int:
    mesh = mesh_of(mesh)
    par = ParallelConfig(global_batch=8, micro_batch=2, **dict(mesh.shape), **kw)
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))
    return sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))


def _up_flops(cfg, tokens: int) -> int:
    """MLA's up-projections' forward FLOPs over every layer: 2·T·l·(r_q·a·d_qk + r_kv·a·
    (d_n + d_v)) (without r_q: h·a·d_qk for the first)."""
    a, d_qk = cfg.heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q_in = cfg.q_lora_rank or cfg.hidden
    return 2 * tokens * cfg.layers * a * (q_in * d_qk + cfg.kv_lora_rank * (
        cfg.qk_nope_head_dim + cfg.v_head_dim))


FLOPS = [  # model, mesh, modules, extra; the extra FLOPs: f(cfg, T) over the whole step
    ("gpt", "tp2", ("mlp",), {"sequence_parallel": True},
     lambda c, T: 2 * T * c.layers * 2 * c.hidden * 4 * c.hidden),          # W1, W2
    ("gpt", "pp2", ("layernorm",), {}, lambda c, T: 0),
    ("llama", "tp2", ("mlp", "layernorm"), {"sequence_parallel": True},
     lambda c, T: 2 * T * c.layers * 3 * c.hidden * c.ffn_hidden),          # gate, up, down
    ("mla", "tp2", ("mla_up_proj",), {}, _up_flops),
    ("mla_no_q_lora", "pp2 tp2", ("mla_up_proj", "layernorm"), {"sequence_parallel": True},
     _up_flops),
    ("moe", "tp2", ("moe_act", "layernorm"), {"sequence_parallel": True}, lambda c, T: 0),
    ("mla_moe", "tp2", ("moe_act", "mla_up_proj", "mlp"), {},   # layer 0 dense
     lambda c, T: _up_flops(c, T) + 2 * T * 3 * c.hidden * c.ffn_hidden),
]


@pytest.mark.parametrize("kind, mesh, modules, extra, more", FLOPS, ids=_ids(FLOPS))
def test_traced_flops_grow_by_the_recomputed_forwards(kind, mesh, modules, extra, more):
    """Σ over ranks of one step's traced FLOPs with ``modules`` recomputed = the same
    with none recomputed (``recompute_modules=()``) + the modules' forward products over
    the step's T = B·s tokens (closed form): layernorm and moe_act add none."""
    cfg = _cfg(kind)
    base = _traced_flops(cfg, mesh, recompute="selective", recompute_modules=(), **extra)
    got = _traced_flops(cfg, mesh, recompute="selective", recompute_modules=modules, **extra)
    assert got - base == more(cfg, 8 * cfg.seq)
    none = _traced_flops(cfg, mesh, **extra)
    assert base == none          # no module recomputed: "none"'s FLOPs


def test_core_attn_is_the_default_selective():
    """Megatron's default: recompute_modules ("core_attn",); every plan's existing
    "selective" is it, and its traced FLOPs are unchanged."""
    cfg = _cfg("llama")
    par = ParallelConfig(global_batch=4, recompute="selective")
    assert par.recompute_modules == ("core_attn",)
    assert par == ParallelConfig(global_batch=4, recompute="selective",
                                 recompute_modules=["core_attn"])
    assert _traced_flops(cfg, "tp2", recompute="selective") == _traced_flops(
        cfg, "tp2", recompute="selective", recompute_modules="core_attn")


KEPT = [("gpt", ("layernorm",)), ("gpt", ("mlp",)), ("llama", ("layernorm", "mlp")),
        ("mla", ("mla_up_proj",)), ("moe", ("moe_act",))]


@pytest.mark.parametrize("kind, modules", KEPT, ids=_ids(KEPT))
def test_the_program_keeps_fewer_bytes(cluster_of, kind, modules):
    """A recomputed module's kept activations leave the emulated program's saved state:
    the peak of the activations held (GPipe: the step's four micro-batches' forwards in
    flight at once) drops."""
    cfg = _cfg(kind)

    def kept(mods):
        par = ParallelConfig(global_batch=4, tp=2, recompute="selective", schedule="gpipe",
                             recompute_modules=mods)
        return _activation_peak(cluster_of, cfg, par)

    assert kept(modules) < kept(())


def _activation_peak(cluster_of, cfg, par) -> float:
    model = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B)
    cluster = cluster_of(par.mesh())
    cluster.reset_stats()
    model.fit(cluster, tokens, targets, 1, parallel=par, lr=LR)
    return max(cluster.stats()["peak_activations_bytes"].tolist())


# --- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("value, match", [
    (("moe",), "'moe'.*not modelled"), (("shared_experts",), "not modelled"),
    (("mhc",), "not modelled"), (("attention",), "not one of Megatron-Core's"),
    (("mlp", "mlp"), "twice"), (3, "not a list")])
def test_config_refuses_what_is_not_modelled(value, match):
    with pytest.raises(ConfigError, match=match) as e:
        ParallelConfig(global_batch=4, recompute="selective", recompute_modules=value)
    assert "recompute_modules" in str(e.value)
    assert "core_attn, moe_act, layernorm, mla_up_proj, mlp" in str(e.value)


def test_config_refuses_modules_without_selective():
    with pytest.raises(ConfigError, match="recompute_modules.*recompute='full'"):
        ParallelConfig(global_batch=4, recompute="full", recompute_modules=("mlp",))
    assert ParallelConfig(global_batch=4, recompute_modules="core_attn").recompute_modules \
        == ("core_attn",)


@pytest.mark.parametrize("kind, modules, match", [
    ("llama", ("mla_up_proj",), "no latent attention"), ("gpt", ("moe_act",), "no experts"),
    ("moe", ("mlp",), "every layer of the model is MoE")])
def test_config_refuses_modules_the_model_lacks(kind, modules, match):
    par = ParallelConfig(global_batch=4, recompute="selective", recompute_modules=modules)
    with pytest.raises(ConfigError, match=match) as e:
        par.check(_cfg(kind), par.mesh())
    assert "recompute_modules" in str(e.value)


# --- the memory model (Korthikanti's count, 16-bit) --------------------------------------------
def test_memory_model_drops_the_recomputed_modules_kept_bytes():
    """layer_activation_bytes with modules = the default's minus, per layer and micro-batch
    (σ = t under SP): layernorm 4·s·b·h/σ; mlp the dense SwiGLU's 6·s·b·f/t (GPT: 16·s·b·h/t);
    mla_up_proj 2·s·b·a·(2·d_qk + d_v)/t; moe_act 2·R·f_e/etp over the MoE layers (R the
    routed rows of ep rank 0: moe_routed_rows); without core_attn unfused attention keeps
    its scores 2·a·s²·b/t (flash: none either way)."""
    from vcluster.planner.memory import layer_activation_bytes, moe_routed_rows
    s, b, t = 64, 2, 2

    def act(cfg, modules, **kw):
        par = ParallelConfig(global_batch=4, micro_batch=b, tp=t, sequence_parallel=True,
                             recompute="selective", recompute_modules=modules, **kw)
        return layer_activation_bytes(cfg, par, 0)

    for kind in ("llama", "gpt"):
        cfg = _cfg(kind, seq=s)
        h, f = cfg.hidden, cfg.ffn_hidden
        base = act(cfg, ("core_attn",))
        assert base - act(cfg, ("core_attn", "layernorm")) == pytest.approx(4 * s * b * h / t)
        mlp = 6 * s * b * f / t if kind == "llama" else 16 * s * b * h / t
        assert base - act(cfg, ("core_attn", "mlp")) == pytest.approx(mlp)
        assert act(cfg, ()) == base                          # flash keeps no scores
        unfused = act(cfg, (), attention="unfused") - act(cfg, ("core_attn",),
                                                          attention="unfused")
        assert unfused == pytest.approx((2 if kind == "llama" else 5) * cfg.heads * s * s * b / t)
    cfg = _cfg("mla", seq=s)
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert act(cfg, ()) - act(cfg, ("mla_up_proj",)) == pytest.approx(
        2 * s * b * cfg.heads * (2 * d_qk + cfg.v_head_dim) / t)
    cfg = _cfg("moe", seq=s)
    kw = dict(dp=2, ep=2)
    par = ParallelConfig(global_batch=4, micro_batch=b, tp=t, sequence_parallel=True, **kw)
    rows = moe_routed_rows(cfg, par)
    assert act(cfg, (), **kw) - act(cfg, ("moe_act",), **kw) == pytest.approx(
        2 * rows * cfg.moe_ffn_hidden / t)
    # the dense layers of an MoE model: mlp drops their MLP only (layer 0 of 2)
    cfg = _cfg("mla_moe", seq=s)
    assert act(cfg, (), **kw) - act(cfg, ("mlp",), **kw) == pytest.approx(
        6 * s * b * cfg.ffn_hidden / t / 2)


def test_emulator_counts_refuse_other_modules():
    from vcluster.planner.memory import emulator_activation_bytes
    par = ParallelConfig(global_batch=4, recompute="selective", recompute_modules=("mlp",))
    with pytest.raises(ValueError, match="recompute_modules"):
        emulator_activation_bytes(_cfg("gpt"), par, 0, 1)
