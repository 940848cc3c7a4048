"""ZeRO-1/2/3 (FSDP) data parallelism: training equals the single-process reference (MLP
for dp 1-8 and every optimizer, with pp and tp where supported; GPT); each rank sends
the closed-form bytes per step with the ring algorithm; peak parameter, gradient and
optimizer bytes per rank follow the closed forms; the traced program moves what the
emulator moves and holds what it holds; bad input is refused by name."""

from dataclasses import replace

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.executor import TrainJob, train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.optim import OptimizerConfig
from pipeline_parallel.plan import plan_training
from pipeline_parallel.zero import FlatLayout, ShardedState, check_zero_stage
from vcluster.planner.memory import gpt_memory
from vcluster.planner.precision import PrecisionPolicy
from vcluster.planner.simulation import gpt_schedule
from vcluster.runtime.tracing import (MetaArray, comm_signature, trace_comm_signature,
                                      trace_program)

pytestmark = pytest.mark.timeout(300)

SIZES = [6, 16, 16, 5]            # modules of 112, 272, 85 elements: 85 pads for n = 4, 8
BATCH, STEPS, ITEM = 16, 2, 8     # fp64
OPTIMIZERS = {"sgd": dict(optimizer="sgd", lr=0.05, momentum=0.0),
              "momentum": dict(optimizer="sgd", lr=0.05, momentum=0.9),
              "adam": dict(optimizer="adam", lr=0.01)}
SLOTS = {"sgd": 1, "momentum": 1, "adam": 2}
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(scope="module")
def ring(cluster_of):
    """One ring-algorithm cluster per mesh (the traffic formulas are the ring's)."""
    return lambda mesh: cluster_of(mesh, algorithm="ring")


def _data(sizes=SIZES, batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, sizes[0])), rng.standard_normal((batch, sizes[-1]))


def _modules(sizes):
    """Elements of each layer's flat parameter (W and b)."""
    return [a * b + b for a, b in zip(sizes[:-1], sizes[1:])]


def _shard_bytes(sizes, n):
    """P'/n: this rank's share of the padded flat parameters, in bytes."""
    return sum(FlatLayout((N,), n).shard for N in _modules(sizes)) * ITEM


def assert_same(run, ref):
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
    for (w, b), (rw, rb) in zip(run.params, ref.params, strict=True):
        np.testing.assert_allclose(w, rw, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(b, rb, rtol=RTOL, atol=ATOL)


def expected_peaks(modules, n, zero, slots):
    """Closed forms per rank (pp = 1; ``modules``: elements of each flat parameter):
    parameters, gradients, optimizer state."""
    N = [x * ITEM for x in modules]
    P, share = sum(N), sum(FlatLayout((x,), n).shard for x in modules) * ITEM
    pair = max(a + b for a, b in zip(N, N[1:]))           # a module + the prefetched next
    return {"peak_params_bytes": share + pair if zero == 3 else P,
            "peak_grads_bytes": share + max(N) if zero >= 2 else P,
            "peak_optimizer_bytes": slots * (share if zero else P)}


def expected_sent_per_step(sizes, n, zero, m):
    """Ring bytes sent per rank per step: ZeRO-1 (n-1)/n·P' each for reduce-scatter and
    all-gather; ZeRO-2 a reduce-scatter per micro-batch; ZeRO-3 per micro-batch a
    gather in forward, one in backward and a reduce-scatter, no gather after the step."""
    padded = _shard_bytes(sizes, n) * n
    times = {1: 2, 2: m + 1, 3: 3 * m}[zero]
    return times * (n - 1) * padded // n


@pytest.mark.parametrize("n", [1, 2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_mlp_every_stage_and_optimizer_equals_reference(ring, n):
    """dp = n, pp = 1, 2 micro-batches: losses and parameters as fit_reference; bytes
    sent and peak bytes per rank as the closed forms."""
    mlp, (X, Y) = MLP(SIZES, activation="tanh", seed=1), _data()
    cluster, m = ring(Mesh((n, 1), ("dp", "pp"))), 2
    for name, kw in OPTIMIZERS.items():
        ref = mlp.fit_reference(X, Y, steps=STEPS, **kw)
        for zero in (1, 2, 3):
            cluster.reset_stats()
            run = mlp.fit(cluster, X, Y, steps=STEPS, microbatches=m, zero_stage=zero, **kw)
            assert_same(run, ref)
            st = cluster.stats()
            want = expected_peaks(_modules(SIZES), n, zero, SLOTS[name])
            for col, v in want.items():
                assert st[col].tolist() == [v] * n, (name, zero, col)
                assert run.memory[col].tolist() == [v] * n
            # activations: the executor's own peak (ZeRO does not touch them)
            assert (st["peak_activations_bytes"] == run.memory["activations_peak_bytes"]).all()
            assert (st["peak_activations_bytes"] > 0).all()
            sent = expected_sent_per_step(SIZES, n, zero, m) * STEPS
            assert st["bytes_sent"].tolist() == [sent] * n, (name, zero)
            assert st["arena_bytes_in_use"].tolist() == [0] * n   # nothing kept after a run


@pytest.mark.parametrize("m", [1, 2])
def test_traffic_is_ddp_and_one_and_a_half_ddp(ring, m):
    """Modules divisible by n (no padding), P = parameter bytes: DDP sends 2(n-1)/n·P per
    step; ZeRO-1 the same, ZeRO-2 (m+1)(n-1)/n·P, ZeRO-3 3m(n-1)/n·P (1.5x DDP at m=1)."""
    sizes, n = [8, 16, 16, 8], 4                           # 144, 272, 136 elements
    P = sum(_modules(sizes)) * ITEM
    assert all(N % n == 0 for N in _modules(sizes))
    mlp, (X, Y) = MLP(sizes, seed=2), _data(sizes)
    cluster, sent = ring(Mesh((n, 1), ("dp", "pp"))), {}
    for zero in (0, 1, 2, 3):
        cluster.reset_stats()
        mlp.fit(cluster, X, Y, steps=1, microbatches=m, zero_stage=zero, bucket_bytes=1 << 30)
        sent[zero] = set(cluster.stats()["bytes_sent"])
    ddp = 2 * (n - 1) * P // n
    assert sent == {0: {ddp}, 1: {ddp}, 2: {(m + 1) * (n - 1) * P // n},
                    3: {3 * m * (n - 1) * P // n}}
    if m == 1:
        assert sent[3] == {3 * ddp // 2}


def _meta_mlp_args(mlp, mesh, m, zero, kw):
    plan = plan_training(mlp, mesh, BATCH, m, "1f1b", None)
    params = tuple((MetaArray(w.shape, w.dtype), MetaArray(b.shape, b.dtype))
                   for w, b in mlp.init_params())
    job = TrainJob(params=params, specs=plan.stage_specs, actions=plan.actions,
                   loss=mlp.loss, optimizer=OptimizerConfig(kw["optimizer"], kw["lr"]),
                   steps=STEPS, microbatches=m, global_batch=BATCH, dp_axis=plan.dp_axis,
                   tp_axis=plan.tp_axis, zero_stage=zero)
    X = MetaArray((BATCH, mlp.sizes[0]), np.float64)
    return plan.device_args(job, X, MetaArray((BATCH, mlp.sizes[-1]), np.float64))


MESHES = [((4, 1), ("dp", "pp"), (1, 2, 3)),
          ((2, 2), ("dp", "pp"), (1,)),
          ((2, 1, 2), ("dp", "pp", "tp"), (1, 2, 3))]


@pytest.mark.parametrize("shape, axes, stages", MESHES, ids=["dp4", "dp2-pp2", "dp2-tp2"])
def test_mlp_with_pp_and_tp_equals_reference_and_traces_like_it_runs(ring, shape, axes,
                                                                     stages):
    """ZeRO-1 with pp = 2 (Megatron's distributed optimizer), every stage with tp = 2:
    the reference's training; the traced program's messages and peak bytes are the
    emulator's, rank by rank."""
    sizes = [8, 16, 16, 16, 8]
    mlp, (X, Y), kw = MLP(sizes, activation="gelu", seed=4), _data(sizes), OPTIMIZERS["adam"]
    mesh = Mesh(shape, axes)
    cluster, ref = ring(mesh), mlp.fit_reference(X, Y, steps=STEPS, **kw)
    for zero in stages:
        cluster.reset_stats()
        run = mlp.fit(cluster, X, Y, steps=STEPS, microbatches=2, zero_stage=zero, **kw)
        assert_same(run, ref)
        events, st = cluster.trace(), cluster.stats()
        traces = trace_program(mesh, train_program, _meta_mlp_args(mlp, mesh, 2, zero, kw),
                               algorithm="ring")
        for t in traces:
            assert trace_comm_signature(t) == comm_signature(events, t.rank), (zero, t.rank)
            row = st.iloc[t.rank]
            assert {f"peak_{k}_bytes": v for k, v in t.peak_bytes} == {
                c: row[c] for c in st.columns if c.startswith("peak_")}, (zero, t.rank)


GPT_CFG = GPTConfig(hidden=8, layers=2, heads=2, seq=4, vocab=16)
GPT_CASES = [("dp2", (2,), ("dp",), {}, (1, 2, 3)),
             ("dp2-tp2", (2, 2), ("dp", "tp"), {}, (2, 3)),
             pytest.param("dp2-pp2-tp2", (2, 2, 2), ("dp", "pp", "tp"),
                          {"sequence_parallel": True}, (1,), marks=pytest.mark.slow)]


def _assert_equal_run(run, ref, what: str = "") -> None:
    """A GPT run's losses, final parameters and last-step gradients equal the reference's."""
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL, err_msg=what)
    for kind in ("params", "grads"):
        for k, v in getattr(ref, kind).items():
            np.testing.assert_allclose(getattr(run, kind)[k], v, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{kind} {k} {what}")


@pytest.mark.parametrize("name, shape, axes, extra, stages", GPT_CASES,
                         ids=["dp2", "dp2-tp2", "dp2-pp2-tp2"])
def test_gpt_equals_reference(ring, name, shape, axes, extra, stages):
    """GPT: losses, final parameters and last-step gradients (joined from the shards) as
    the single-process transformer's; emulated traffic and peaks as traced."""
    gpt, rng = GPT(GPT_CFG, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, GPT_CFG.vocab, (8, GPT_CFG.seq)) for _ in range(2))
    kw = dict(optimizer="sgd", lr=0.1, momentum=0.9)     # Adam would amplify rounding of
    ref = gpt.fit_reference(tokens, targets, steps=STEPS, **kw)  # the 0 gradients of unused
                                                                 # token rows
    mesh = Mesh(shape, axes)
    cluster = ring(mesh)
    for zero in stages:
        par = ParallelConfig(global_batch=8, micro_batch=2, **dict(mesh.shape),
                             zero_stage=zero, **extra)
        cluster.reset_stats()
        run = gpt.fit(cluster, tokens, targets, steps=STEPS, parallel=par, **kw)
        _assert_equal_run(run, ref, f"zero={zero}")
        events, st = cluster.trace(), cluster.stats()
        traces = trace_program(mesh, train_program, gpt.meta_args(
            mesh, par, STEPS, OptimizerConfig("sgd", 0.1, 0.9)), algorithm="ring")
        for t in traces:
            assert trace_comm_signature(t) == comm_signature(events, t.rank), (zero, t.rank)
            assert dict(t.peak_bytes)["optimizer"] == st["peak_optimizer_bytes"][t.rank]
        P, n, M = run.memory["params_bytes"], 2, 4 * ITEM    # <= 4 modules, < n pad each
        if name == "dp2":                     # modules: embedding, layers, head
            want = expected_peaks(_gpt_modules(gpt), n, zero, 1)   # momentum: one slot
            assert {c: st[c].tolist() for c in want} == {c: [v] * n for c, v in want.items()}
        assert ((st["peak_optimizer_bytes"] >= P / n)
                & (st["peak_optimizer_bytes"] < P / n + M)).all()
        for have, sharded in (("grads", zero >= 2), ("params", zero == 3)):
            got = st[f"peak_{have}_bytes"]
            assert ((got > P / n) if sharded else (got == P)).all(), (zero, have)


def _gpt_modules(gpt):
    """Elements of the flat parameters of a whole GPT on one rank: embedding, layers, head."""
    sizes = {}
    for name, shape in gpt.param_shapes().items():
        key = name.rsplit(".", 1)[0] if name.startswith("layers.") else \
            ("emb" if name in ("wte", "wpe") else "head")
        sizes[key] = sizes.get(key, 0) + int(np.prod(shape))
    layers = [sizes[f"layers.{i}"] for i in range(gpt.config.layers)]
    return [sizes["emb"], *layers, sizes["head"]]


def test_bad_input_is_refused_by_name(ring):
    for bad in (4, -1, 1.5, "1", True, None):
        with pytest.raises(ValueError, match=r"zero_stage=.*: not a known value; allowed: "
                                             r"one of 0, 1, 2, 3"):
            check_zero_stage(bad, "MLP.fit")
    mlp, (X, Y) = MLP([4, 4, 4], seed=0), _data([4, 4, 4])
    with pytest.raises(ValueError, match=r"MLP.fit: zero_stage=7: not a known value"):
        mlp.fit(ring(Mesh((4, 1), ("dp", "pp"))), X, Y, steps=1, microbatches=1, zero_stage=7)
    for zero in (2, 3):
        with pytest.raises(ValueError, match=rf"zero_stage={zero} with pipeline parallelism "
                                             r"\(pp=2\).*allowed: 0 or 1 with pp > 1"):
            mlp.fit(ring(Mesh((2, 2), ("dp", "pp"))), X, Y, steps=1, microbatches=2,
                    zero_stage=zero)
        with pytest.raises(ValueError, match=rf"ParallelConfig: zero_stage={zero}: "
                                             rf"zero_stage={zero} with "
                                             r"pipeline parallelism \(pp=2\)"):
            ParallelConfig(global_batch=8, pp=2, zero_stage=zero)
    with pytest.raises(ValueError, match=r"zero_stage=1 cannot be combined with checkpoints"):
        mlp.fit(ring(Mesh((4, 1), ("dp", "pp"))), X, Y, steps=1, microbatches=1,
                zero_stage=1, batch_size=8)


def test_zero3_needs_stages_with_a_param_hook():
    class Stage:                       # parameters and gradients, no param_hook
        params, grads = [[np.zeros(3)]], [[np.zeros(3)]]

    class Dev:
        rank = 0

    with pytest.raises(TypeError, match=r"zero_stage=3: stage 0 \(Stage\) has no param_hook"):
        ShardedState(Dev(), 3, None, {0: Stage()}, OptimizerConfig(), ledger=None)


def test_distributed_optimizer_is_zero_stage_1():
    par = ParallelConfig(global_batch=8, dp=2, distributed_optimizer=True)
    assert (par.zero_stage, par.distributed_optimizer) == (1, True)
    assert ParallelConfig(global_batch=8, dp=2).zero_stage == 0
    assert ParallelConfig(global_batch=8, dp=2, zero_stage=3).distributed_optimizer is True
    assert ParallelConfig(global_batch=8, dp=2, zero_stage=0).distributed_optimizer is False
    # the planner's replace(par, distributed_optimizer=True) turns DDP into ZeRO-1
    assert replace(ParallelConfig(global_batch=8, dp=2), distributed_optimizer=True) == par


def test_flat_layout_pads_to_a_multiple_of_dp():
    for N in range(1, 40):
        for n in (1, 2, 3, 4, 8):
            lay = FlatLayout((N,), n)
            assert lay.padded % n == 0 and 0 <= lay.padded - N < n
            assert [lay.owned(d).start for d in range(n)] == [d * lay.padded // n
                                                             for d in range(n)]
    lay, arrays = FlatLayout((6, 3), 4), [np.arange(6.0).reshape(2, 3), np.arange(3.0) + 6]
    flat = lay.flatten(arrays)
    np.testing.assert_array_equal(flat, list(range(9)) + [0, 0, 0])
    out = [np.zeros((2, 3)), np.zeros(3)]
    lay.unflatten_into(flat, out)
    np.testing.assert_array_equal(np.concatenate([a.ravel() for a in out]), np.arange(9.0))


def test_llama_kv_replicas_summed_under_every_stage(ring):
    """Llama with kv_heads 1 < tp 2 (each KV head replicated over tp): ZeRO-2/3 reduce
    every micro-batch's gradient, so the replicas' dW_kv are summed every micro-batch
    there (once per step used to lose all but the last micro-batch's share)."""
    cfg = GPTConfig(hidden=16, layers=2, heads=4, seq=4, vocab=16, arch="llama", kv_heads=1,
                    ffn_hidden=24)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    kw = dict(optimizer="sgd", lr=0.1, momentum=0.9)
    ref = gpt.fit_reference(tokens, targets, steps=STEPS, **kw)
    mesh = Mesh((2, 2), ("dp", "tp"))
    for zero in (1, 2, 3):
        par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, tp=2, zero_stage=zero)
        run = gpt.fit(ring(mesh), tokens, targets, steps=STEPS, parallel=par, **kw)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
        for k, v in ref.params.items():
            np.testing.assert_allclose(run.params[k], v, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{k} zero={zero}")


def _small_gpt(arch: str, kv_heads: int, batch: int):
    """(model, tokens, targets, its SGD-momentum reference run, the fit's keywords) of a
    2-layer h16 GPT or Llama (``kv_heads`` K/V heads, SwiGLU 24) on ``batch`` sequences
    of 8."""
    extra = {"kv_heads": kv_heads, "ffn_hidden": 24} if arch == "llama" else {}
    cfg = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=16, arch=arch, **extra)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (batch, cfg.seq)) for _ in range(2))
    kw = dict(optimizer="sgd", lr=0.1, momentum=0.9)
    return gpt, tokens, targets, gpt.fit_reference(tokens, targets, steps=STEPS, **kw), kw


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_zero_shards_over_dp_and_cp(ring, arch):
    """With context parallelism the gradients are partial over dp x cp, and ZeRO shards
    (and reduce-scatters, and gathers) over that group, as Megatron's distributed
    optimizer does: every stage equals the reference."""
    gpt, tokens, targets, ref, kw = _small_gpt(arch, 2, 4)
    for zero in (1, 2, 3):
        par = ParallelConfig(global_batch=4, dp=2, cp=2, zero_stage=zero)
        run = gpt.fit(ring(par.mesh()), tokens, targets, steps=STEPS, parallel=par, **kw)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
        for k, v in ref.params.items():
            np.testing.assert_allclose(run.params[k], v, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{k} zero={zero}")


def test_llama_moe_kv_replicas_summed_every_micro_batch_under_zero_2(ring):
    """The MoE Llama layer sums its K/V replicas on the same cadence (kv_heads 1 < tp 2,
    experts on ep 1 sharded by ZeRO like every parameter)."""
    cfg = GPTConfig(hidden=16, layers=2, heads=4, seq=4, vocab=16, arch="llama", kv_heads=1,
                    ffn_hidden=24, experts=2, moe_top_k=1, moe_ffn_hidden=8)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    mesh = Mesh((2, 2), ("dp", "tp"))
    for zero in (2, 3):
        par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, tp=2, zero_stage=zero)
        ref = gpt.fit_reference(tokens, targets, steps=STEPS, lr=0.1, parallel=par)
        run = gpt.fit(ring(mesh), tokens, targets, steps=STEPS, parallel=par, lr=0.1)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
        for k, v in ref.params.items():
            np.testing.assert_allclose(run.params[k], v, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{k} zero={zero}")


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_sequence_parallel_under_every_stage(ring, arch):
    """tp 2 with sequence parallelism (FSDP2 + TP + SP, torchtitan's 2D): the LayerNorm
    (RMSNorm) gains' gradients are partial over tp; ZeRO-2/3 reduce-scatter every
    micro-batch's gradients, so they are summed over tp every micro-batch there (once per
    step would drop all but the last micro-batch's share). 1, 2 and 4 micro-batches, the
    TE overlap too: losses, parameters and last-step gradients equal the reference, and the
    traced program moves the emulator's bytes."""
    gpt, tokens, targets, ref, kw = _small_gpt(arch, 1, 8)
    mesh = Mesh((2, 1, 2), ("dp", "pp", "tp"))
    cluster = ring(mesh)
    cases = [(zero, mb, "backward") for zero in (1, 2, 3) for mb in (4, 2, 1)]
    cases += [(3, 2, "te")]
    for zero, mb, overlap in cases:
        par = ParallelConfig(global_batch=8, micro_batch=mb, dp=2, tp=2, zero_stage=zero,
                             sequence_parallel=True, tp_overlap=overlap)
        cluster.reset_stats()
        run = gpt.fit(cluster, tokens, targets, steps=STEPS, parallel=par, **kw)
        what = f"zero={zero} micro-batches={par.microbatches} {overlap}"
        _assert_equal_run(run, ref, what)
        if mb == 2:
            events = cluster.trace()
            traces = trace_program(mesh, train_program, gpt.meta_args(
                mesh, par, STEPS, OptimizerConfig("sgd", 0.1, 0.9)), algorithm="ring")
            for t in traces:
                assert trace_comm_signature(t) == comm_signature(events, t.rank), (what,
                                                                                   t.rank)


def test_llama_moe_with_sequence_parallelism_under_zero_2_and_3(ring):
    """The MoE Llama layer beside sequence parallelism (its norms' gradients tp-partial,
    its K/V head replicated over tp 2): ZeRO-2/3 equal the reference."""
    cfg = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=16, arch="llama", kv_heads=1,
                    ffn_hidden=24, experts=2, moe_top_k=1, moe_ffn_hidden=8)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    for zero in (2, 3):
        par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, tp=2, zero_stage=zero,
                             sequence_parallel=True)
        ref = gpt.fit_reference(tokens, targets, steps=STEPS, lr=0.1, parallel=par)
        run = gpt.fit(ring(par.mesh()), tokens, targets, steps=STEPS, parallel=par, lr=0.1)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
        for k, v in ref.params.items():
            np.testing.assert_allclose(run.params[k], v, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{k} zero={zero}")


MOE_ZERO = [({"dp": 4, "ep": 2}, 2, 1), ({"dp": 4, "ep": 4}, 2, 1), ({"dp": 4, "ep": 2}, 1, 1),
            ({"dp": 2, "ep": 2, "pp": 2}, 2, 1), ({"dp": 2, "ep": 2, "cp": 2}, 2, 1),
            ({"dp": 2, "tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True}, 2, 1),
            ({"dp": 4, "ep": 2}, 1, 2), ({"dp": 4, "ep": 2}, 2, 3),
            ({"dp": 2, "ep": 2, "cp": 2}, 1, 3),
            ({"dp": 2, "tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True}, 2, 3)]


@pytest.mark.parametrize("degrees, micro_batch, zero", MOE_ZERO,
                         ids=["dp4-ep2", "dp4-ep4", "dp4-ep2-m4", "dp2-pp2-ep2", "dp2-cp2-ep2",
                              "dp2-tp2-ep2-folded", "z2-dp4-ep2-m4", "z3-dp4-ep2",
                              "z3-dp2-cp2-ep2-m2", "z3-dp2-tp2-ep2-folded"])
def test_moe_zero_shards_the_experts_over_their_own_group(cluster_of, degrees, micro_batch,
                                                          zero):
    """ZeRO with expert parallelism (Megatron's distributed optimizer, ZeRO-1, and
    Megatron-FSDP, ZeRO-2/3, on an MoE): each MoE module is two flat parameters, its
    experts' sharded (reduce-scattered, updated, gathered) over the expert-data-parallel
    ranks and the rest over dp (× cp). Losses, parameters and last-step gradients equal
    the reference; the traced program moves the emulator's bytes; and the optimizer state
    each rank holds is the memory model's (experts' state over dp/ep ranks, the rest over
    dp), independently counted, within the flat parameters' padding."""
    cfg = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=16, arch="llama", kv_heads=2,
                    ffn_hidden=24, experts=4, moe_top_k=2, moe_ffn_hidden=8)
    gpt, rng = GPT(cfg, seed=1), np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    par = ParallelConfig(global_batch=8, micro_batch=micro_batch, zero_stage=zero, **degrees)
    assert par.distributed_optimizer
    mesh = par.mesh()
    cluster = cluster_of(mesh)
    ref = gpt.fit_reference(tokens, targets, steps=STEPS, lr=0.01, parallel=par,
                            optimizer="adam")
    cluster.reset_stats()
    run = gpt.fit(cluster, tokens, targets, steps=STEPS, parallel=par, lr=0.01,
                  optimizer="adam")
    _assert_equal_run(run, ref)
    events, st = cluster.trace(), cluster.stats()
    traces = trace_program(mesh, train_program, gpt.meta_args(
        mesh, par, STEPS, OptimizerConfig("adam", 0.01)))

    def zero_ops(signature):      # the MoE exchange's sizes follow the routing: left out
        return {group: [c for c in calls if c[0] in ("reduce_scatter", "all_gather")]
                for group, calls in signature.items()}
    for t in traces:
        traced = zero_ops(trace_comm_signature(t))
        assert traced == zero_ops(comm_signature(events, t.rank)), t.rank
        assert sum(len(calls) for calls in traced.values()) > 0
    # the emulated program's bytes per parameter (fp64, Adam); the activations counted as
    # Korthikanti's (the emulated count covers the dense GPT only; not compared here)
    policy = replace(PrecisionPolicy.emulated(cfg.dtype, "adam"),
                     activation_count="korthikanti", activation_bytes=2)
    for rank in range(mesh.size):
        pos = mesh.group("pp", rank).index(rank) if "pp" in mesh.axes else 0
        want = gpt_memory(cfg, par, gpt_schedule(par), precision=policy)[pos].optimizer_bytes
        got = int(st["peak_optimizer_bytes"][rank])
        assert want == pytest.approx(got, abs=2 * 16 * 4 * mesh.size), (rank, want, got)
    ddp = ParallelConfig(global_batch=8, micro_batch=micro_batch, zero_stage=0, **degrees)
    whole = gpt_memory(cfg, ddp, gpt_schedule(ddp), precision=policy)[0].optimizer_bytes
    assert st["peak_optimizer_bytes"].max() < whole          # the state is sharded
    if zero >= 2:     # the gradients too (the weights at 3: two layers, both gathered
        #                 at once, current and prefetched, hide it at this size)
        one = ParallelConfig(global_batch=8, micro_batch=micro_batch, zero_stage=1, **degrees)
        m1 = gpt_memory(cfg, one, gpt_schedule(one), precision=policy)[0]
        assert st["peak_grads_bytes"].max() < m1.grads_bytes
