"""GPT: the emulated dp x pp x tp training (Megatron TP, sequence parallelism, every
recomputation mode, every schedule) computes what a single-process numpy transformer
computes; its FLOPs are Megatron's formulas; its trace moves exactly the emulator's bytes."""

from collections import Counter

import numpy as np
import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import (GPT, GPTConfig, ParallelConfig, forward_program,
                                   megatron_flops_with_recompute, megatron_model_flops)
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, TraceWait,
                                      comm_signature, trace_comm_signature, trace_program)

from .gpt_data import assert_same_params_and_grads, mesh_of, token_data

pytestmark = pytest.mark.timeout(600)

CFG = GPTConfig(hidden=16, layers=4, heads=4, seq=8, vocab=32)
B, STEPS, LR = 8, 2, 0.1
RTOL, ATOL = 1e-9, 1e-12


def _data(seed=0, batch=B, cfg=CFG):
    return token_data(cfg, batch, seed)


_mesh = mesh_of


def _parallel(mesh, **kw) -> ParallelConfig:
    return ParallelConfig(global_batch=kw.pop("global_batch", B), **dict(mesh.shape), **kw)


@pytest.fixture(scope="module")
def clusters(cluster_of):
    return cluster_of


@pytest.fixture(scope="module")
def reference():
    gpt = GPT(CFG, seed=1)
    tokens, targets = _data()
    return (gpt, tokens, targets, gpt.reference_forward(tokens, targets),
            gpt.fit_reference(tokens, targets, steps=STEPS, optimizer="sgd", lr=LR))


# --- configuration -------------------------------------------------------------------------
def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="hidden=10 is not divisible by heads=4"):
        GPTConfig(hidden=10, layers=2, heads=4, seq=8, vocab=32)
    with pytest.raises(ValueError, match="GPTConfig: vocab must be an int >= 1"):
        GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=0)
    with pytest.raises(ValueError, match="recompute=.*: not a known value; allowed: one of "
                                         "none, selective, full"):
        ParallelConfig(global_batch=8, recompute="some")
    with pytest.raises(ValueError, match="schedule=.*: not a known value; allowed: one of "
                                         "gpipe, 1f1b"):
        ParallelConfig(global_batch=8, schedule="2f2b")
    with pytest.raises(ValueError, match="global_batch=8 does not split into dp=3"):
        ParallelConfig(global_batch=8, dp=3)
    gpt = GPT(CFG)
    with pytest.raises(ValueError, match="4 layers do not split evenly into 8 stages"):
        gpt.train_job(_mesh("pp4"), ParallelConfig(global_batch=8, pp=4,
                                                   schedule="interleaved_1f1b"))
    with pytest.raises(ValueError, match="heads=4 does not split evenly over tp=3"):
        gpt.train_job(_mesh("tp3"), ParallelConfig(global_batch=8, tp=3))
    with pytest.raises(ValueError, match="the mesh's tp axis has size 2"):
        gpt.train_job(_mesh("tp2"), ParallelConfig(global_batch=8, tp=4))
    odd = GPT(GPTConfig(hidden=16, layers=2, heads=4, seq=6, vocab=32))
    with pytest.raises(ValueError, match=r"seq \(sequence parallelism\)=6 does not split"):
        odd.train_job(_mesh("tp4"), ParallelConfig(global_batch=8, tp=4, sequence_parallel=True))
    tokens, targets = _data()
    with pytest.raises(ValueError, match=r"tokens must be ints in \[0, 32\)"):
        gpt.reference_forward(tokens + 32, targets)
    with pytest.raises(ValueError, match=r"of shape \(4, 8\), got int64 \(8, 8\)"):
        gpt.forward(None, tokens, targets, ParallelConfig(global_batch=4))


def test_reference_gradients_match_finite_differences():
    cfg = GPTConfig(hidden=8, layers=2, heads=2, seq=4, vocab=8)
    gpt = GPT(cfg, seed=3)
    tokens, targets = _data(1, batch=2, cfg=cfg)
    params = gpt.init_params()
    grads = gpt.fit_reference(tokens, targets, steps=1).grads
    rng = np.random.default_rng(0)
    for name, p in params.items():
        idx = tuple(int(rng.integers(0, n)) for n in p.shape)
        if name == "wte":
            idx = (int(tokens[0, 0]),) + idx[1:]
        old, e = p[idx], 1e-6
        p[idx] = old + e
        up = gpt.reference_forward(tokens, targets, params)[0]
        p[idx] = old - e
        down = gpt.reference_forward(tokens, targets, params)[0]
        p[idx] = old
        assert (up - down) / (2 * e) == pytest.approx(grads[name][idx], rel=1e-5, abs=1e-8), name


# --- emulated training equals the reference --------------------------------------------------
CASES = [  # mesh, schedule, micro-batch, extra
    ("dp2 pp2 tp2", "1f1b", 2, {}),
    ("dp2 pp2 tp2", "1f1b", 2, {"tp_overlap": "none"}),     # every TP collective blocking
    ("dp2 pp2 tp2", "zero_bubble", 1, {}),
    ("dp2 pp2 tp2", "interleaved_1f1b", 2, {"virtual_stages": 2}),
    ("pp4", "1f1b", 1, {}),
    ("pp4", "gpipe", 2, {}),
    ("pp4", "zero_bubble", 1, {}),
    ("tp4", "1f1b", 2, {}),
    ("dp2 tp2", "1f1b", 1, {}),
    ("dp2 tp2", "gpipe", 2, {}),
]


RUNS = [(m, s, b, x, sp, r) for m, s, b, x in CASES for sp in ((False, True) if "tp" in m
                                                                  else (False,))
        for r in ("none", "selective", "full")] + [
    # PyTorch's non-reentrant full recomputation: W2's product, its reduction, not re-run
    ("dp2 pp2 tp2", "1f1b", 1, {}, True, "full-torch"),
    ("pp4", "zero_bubble", 1, {}, False, "full-torch")]


@pytest.mark.parametrize("mesh, schedule, b, extra, sp, recompute", RUNS,
                         ids=[f"{m}-{s}-b{b}-{'sp' if sp else 'nosp'}-{r}"
                              + ("-blocking" if x.get("tp_overlap") == "none" else "")
                              for m, s, b, x, sp, r in RUNS])
def test_training_equals_reference(clusters, reference, mesh, schedule, b, extra, sp, recompute):
    mesh = _mesh(mesh)
    gpt, tokens, targets, (ref_loss, ref_logits), ref = reference
    par = _parallel(mesh, micro_batch=b, schedule=schedule, sequence_parallel=sp,
                    recompute=recompute, **extra)
    cluster = clusters(mesh)
    loss, logits = gpt.forward(cluster, tokens, targets, par)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    run = gpt.fit(cluster, tokens, targets, steps=STEPS, parallel=par, optimizer="sgd", lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.params.keys() == ref.params.keys() == run.grads.keys()
    assert_same_params_and_grads(run, ref, RTOL, ATOL)
    assert ref.losses[-1] < ref.losses[0]


def test_training_on_64_devices_equals_reference():
    """tp 2 x pp 4 x dp 8 (issue 30): 64 device processes on this machine train one step
    of the tiny GPT (4 micro-batches per replica, 1F1B) and land where the single-process
    reference does."""
    from vcluster import VirtualCluster
    gpt = GPT(CFG, seed=1)
    tokens, targets = _data(batch=32)
    ref = gpt.fit_reference(tokens, targets, steps=1, optimizer="sgd", lr=LR)
    mesh = _mesh("dp8 pp4 tp2")
    with VirtualCluster(mesh, timeout_s=60.0, run_timeout_s=600.0) as cluster:
        run = gpt.fit(cluster, tokens, targets, steps=1, optimizer="sgd", lr=LR,
                      parallel=_parallel(mesh, global_batch=32, micro_batch=1))
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    for name in ref.params:
        np.testing.assert_allclose(run.grads[name], ref.grads[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)


def test_recomputation_keeps_fewer_activations(clusters, reference):
    gpt, tokens, targets, _, _ = reference
    mesh = _mesh("pp2 tp2")
    peaks = {}
    for mode in ("none", "selective", "full"):
        run = gpt.fit(clusters(mesh), tokens, targets, steps=1, parallel=_parallel(
            mesh, micro_batch=2, recompute=mode, sequence_parallel=True))
        peaks[mode] = run.memory["activations_peak_bytes"].max()
        assert run.memory["peak_in_flight"].max() <= 2          # 1F1B: at most p in flight
    assert peaks["full"] < peaks["selective"] < peaks["none"]


# --- FLOPs and traffic: emulator == trace == Megatron -----------------------------------------
TRAFFIC = [("dp2 pp2 tp2", "1f1b", False, "none"), ("dp2 pp2 tp2", "zero_bubble", True, "full"),
           ("dp2 pp2 tp2", "interleaved_1f1b", True, "selective"), ("tp4", "gpipe", True, "none"),
           ("pp4", "1f1b", False, "full"), ("dp2 tp2", "1f1b", False, "selective"),
           ("dp2 pp2 tp2", "1f1b", True, "full-torch")]


@pytest.mark.parametrize("mesh, schedule, sp, recompute", TRAFFIC,
                         ids=["-".join(map(str, c)) for c in TRAFFIC])
def test_flops_and_traced_traffic_equal_the_emulator(clusters, reference, mesh, schedule, sp,
                                                     recompute):
    gpt, tokens, targets, _, _ = reference
    mesh = _mesh(mesh)
    par = _parallel(mesh, micro_batch=2, schedule=schedule, sequence_parallel=sp,
                    recompute=recompute)
    cluster = clusters(mesh)
    job = gpt.train_job(mesh, par, steps=1, bucket_bytes=4096)
    cluster.reset_stats()
    cluster.run(train_program, gpt.device_args(mesh, job, tokens, targets))
    events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
    traces = trace_program(mesh, train_program, gpt.meta_args(mesh, par, 1, bucket_bytes=4096))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in traces] == flops
    c = CFG
    model = megatron_model_flops(B, c.seq, c.layers, c.hidden, c.vocab)
    assert model == pytest.approx(72 * B * c.seq * c.layers * c.hidden ** 2 * (
        1 + c.seq / (6 * c.hidden) + c.vocab / (12 * c.layers * c.hidden)), rel=1e-12)
    expected = {"none": model,
                "selective": model + 4 * B * c.seq ** 2 * c.hidden * c.layers,
                "full": megatron_flops_with_recompute(B, c.seq, c.layers, c.hidden, c.vocab)}
    # full-torch: the full count less W2's forward product, 2·B·s·4h·h per layer
    expected["full-torch"] = expected["full"] - 8 * B * c.seq * c.hidden ** 2 * c.layers
    assert sum(flops) == expected[recompute]
    assert expected["full"] == pytest.approx(96 * B * c.seq * c.layers * c.hidden ** 2 * (
        1 + c.seq / (6 * c.hidden) + c.vocab / (16 * c.layers * c.hidden)), rel=1e-12)


def test_forward_program_traces_like_it_runs(clusters, reference):
    gpt, tokens, targets, _, _ = reference
    mesh = _mesh("pp2 tp2")
    par = _parallel(mesh, micro_batch=4, sequence_parallel=True)
    cluster = clusters(mesh)
    cluster.reset_stats()
    cluster.run(forward_program, gpt.device_args(mesh, gpt.train_job(mesh, par), tokens, targets))
    events = cluster.trace()
    for t in trace_program(mesh, forward_program, gpt.meta_args(mesh, par)):
        assert trace_comm_signature(t) == comm_signature(events, t.rank)


@pytest.mark.parametrize("sp, recompute", [(False, "none"), (True, "none"), (False, "full"),
                                           (True, "selective")])
def test_megatron_tp_collectives_per_layer(sp, recompute):
    """Per layer and micro-batch: 2 all-reduces forward, 2 backward (SP: each an all-gather
    plus a reduce-scatter), of b·s·h elements; full recomputation repeats the forward's."""
    l, b, m, t = 4, 2, 3, 2
    cfg = GPTConfig(hidden=16, layers=l, heads=4, seq=8, vocab=32)
    mesh = _mesh("tp2")
    par = ParallelConfig(global_batch=b * m, micro_batch=b, tp=t, sequence_parallel=sp,
                         recompute=recompute)
    trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))[0]
    ops = [op for op in trace.ops if isinstance(op, TraceCollective)]
    kinds = Counter(op.collective for op in ops)
    layer = m * l * (2 + 2 + (2 if recompute == "full" else 0))
    act = b * cfg.seq * cfg.hidden * 8
    # the ends: embedding (1 forward [+1 backward with SP]), cross-entropy (max, sums),
    # head (1 backward [+1 forward with SP]); SP: the partial LN / position grads per step
    if sp:
        assert kinds == {"all_gather": layer + 2 * m, "reduce_scatter": layer + 2 * m,
                         "all_reduce": 2 * m + l + 2}
        assert {op.nbytes for op in ops if op.collective == "reduce_scatter"} == {act}
        assert {op.nbytes for op in ops if op.collective == "all_gather"} == {act // t}
    else:
        assert kinds == {"all_reduce": layer + 4 * m}
        assert Counter(op.nbytes for op in ops)[act] == layer + 2 * m


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("schedule, overlap, issued", [("1f1b", "backward", True),
                                                       ("1f1b", "none", False),
                                                       ("zero_bubble", "backward", False)])
def test_input_gradient_reductions_overlap_the_weight_gradients(sp, schedule, overlap, issued):
    """tp_overlap="backward": per layer and micro-batch the backward's two input-gradient
    reductions (all-reduce, SP reduce-scatter) are asynchronous, and the weight-gradient
    GEMM of the same linear (dW_qkv = x^T dqkv, dW1 = u^T dh) runs between each and its
    wait; "none", and the zero-bubble schedule (its W pass runs apart), keep them
    blocking. The collectives themselves are the same either way."""
    l, b, m = 2, 2, 2
    cfg = GPTConfig(hidden=16, layers=l, heads=4, seq=8, vocab=32)
    mesh = _mesh("tp2")
    par = ParallelConfig(global_batch=b * m, micro_batch=b, tp=2, sequence_parallel=sp,
                         schedule=schedule, tp_overlap=overlap)
    ops = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))[0].ops
    blocking = ParallelConfig(global_batch=b * m, micro_batch=b, tp=2, sequence_parallel=sp,
                              schedule=schedule, tp_overlap="none")
    reference = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, blocking))[0].ops
    signature = [(o.collective, o.nbytes) for o in ops if isinstance(o, TraceCollective)]
    assert signature == [(o.collective, o.nbytes) for o in reference
                         if isinstance(o, TraceCollective)]
    issued_at = {o.handle: i for i, o in enumerate(ops)
                 if isinstance(o, TraceCollective) and o.handle is not None}
    assert len(issued_at) == (2 * l * m if issued else 0)
    between = [[o.name for o in ops[issued_at[w.handle] + 1:i] if isinstance(o, TraceCompute)]
               for i, w in enumerate(ops) if isinstance(w, TraceWait)]
    assert len(between) == len(issued_at)
    assert sorted(n[0] for n in between) == sorted(
        ["gpt: mlp: dW1 = u^T dh", "gpt: attention: dW_qkv = x^T dqkv"] * l * m * issued)


def test_traces_at_scale_one_rank_per_stage():
    """A 7B-like model on 4096 GPUs, one traced rank per stage: FLOPs match Megatron's."""
    cfg = GPTConfig(hidden=4096, layers=32, heads=32, seq=2048, vocab=51200, dtype="float16")
    mesh = _mesh("dp64 pp8 tp8")
    par = ParallelConfig(global_batch=1024, micro_batch=2, dp=64, pp=8, tp=8,
                         schedule="interleaved_1f1b", virtual_stages=2, sequence_parallel=True,
                         recompute="full")
    ranks = [mesh.rank({"dp": 0, "pp": p, "tp": 0}) for p in range(8)]
    traces = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par), ranks=ranks)
    total = sum(op.flops for t in traces for op in t.ops if isinstance(op, TraceCompute))
    h, s, l, V = cfg.hidden, cfg.seq, cfg.layers, cfg.vocab
    assert total * 64 * 8 == megatron_flops_with_recompute(1024, s, l, h, V)
    assert max(len(t) for t in traces) < 60_000
