"""GPT and Llama with context parallelism (the sequence split over a mesh axis ``cp``,
Megatron's load-balanced chunks): forward loss and logits, gradients and a 3-step
training run equal the unsplit single-process numpy reference, for cp 2 and 4, the ring
and all-gather algorithms, with tp, pp and dp; the traced program moves exactly the
emulator's bytes."""

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from tensor_parallel.context_parallel import ContextParallelAttention
from vcluster.runtime.tracing import (TraceCollective, TraceCompute, TraceSend,
                                      comm_signature, trace_comm_signature, trace_program)

from .gpt_data import token_data

pytestmark = pytest.mark.timeout(600)

CFGS = {"gpt": GPTConfig(hidden=16, layers=2, heads=4, seq=16, vocab=32),
        "llama": GPTConfig(hidden=16, layers=2, heads=4, seq=16, vocab=32, arch="llama",
                           kv_heads=2, ffn_hidden=24)}
B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12


def _data(cfg, seed=0):
    return token_data(cfg, B, seed)


def _parallel(spec: str, **kw) -> ParallelConfig:
    """"dp2 cp2" -> ParallelConfig(dp=2, cp=2, ...)."""
    sizes = {p[:2]: int(p[2:]) for p in spec.split()}
    return ParallelConfig(global_batch=B, micro_batch=kw.pop("micro_batch", 2), **sizes, **kw)


@pytest.fixture(scope="module")
def reference():
    out = {}
    for arch, cfg in CFGS.items():
        gpt = GPT(cfg, seed=1)
        tokens, targets = _data(cfg)
        out[arch] = (gpt, tokens, targets, gpt.reference_forward(tokens, targets),
                     gpt.fit_reference(tokens, targets, steps=STEPS, lr=LR))
    return out


# (arch, mesh, algorithm, extra ParallelConfig fields): every cp value and algorithm for
# both archs, with tp 2 (heads split; Llama's GQA group 2 per rank), pp 2 and dp 2,
# sequence parallelism and recomputation in some
CASES = [
    ("gpt", "cp2", "ring", {}),
    ("gpt", "cp4", "all_gather", {}),
    ("gpt", "cp2 tp2", "all_gather", {"sequence_parallel": True, "recompute": "selective"}),
    ("gpt", "pp2 cp2 tp2", "ring", {"schedule": "1f1b"}),
    ("gpt", "dp2 cp4", "ring", {"micro_batch": 1, "recompute": "full"}),
    ("llama", "cp2", "all_gather", {}),
    ("llama", "cp4", "ring", {"recompute": "selective"}),
    ("llama", "cp2 tp2", "ring", {"sequence_parallel": True}),
    ("llama", "dp2 pp2 cp2", "all_gather", {"micro_batch": 1, "recompute": "full"}),
]


@pytest.mark.parametrize("arch, spec, algorithm, extra", CASES,
                         ids=["-".join([a, s.replace(" ", "_"), g] + list(e)) for a, s, g, e in
                              CASES])
def test_forward_and_training_equal_the_reference(cluster_of, reference, arch, spec, algorithm,
                                                  extra):
    gpt, tokens, targets, (ref_loss, ref_logits), ref = reference[arch]
    par = _parallel(spec, cp_algorithm=algorithm, **extra)
    cluster = cluster_of(par.mesh())
    loss, logits = gpt.forward(cluster, tokens, targets, par)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    run = gpt.fit(cluster, tokens, targets, steps=STEPS, parallel=par, lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    for n in ref.params:
        np.testing.assert_allclose(run.grads[n], ref.grads[n], rtol=RTOL, atol=ATOL, err_msg=n)
        np.testing.assert_allclose(run.params[n], ref.params[n], rtol=RTOL, atol=ATOL, err_msg=n)


def test_a_rank_holds_its_chunks_of_every_sequence():
    """cp 2, s 16: rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11."""
    gpt = GPT(CFGS["gpt"])
    par = _parallel("cp2")
    mesh = par.mesh()
    tokens = np.arange(B * 16).reshape(B, 16) % 32
    args = gpt.device_args(mesh, gpt.train_job(mesh, par), tokens, tokens)
    np.testing.assert_array_equal(args[0][1][0], [0, 1, 2, 3, 12, 13, 14, 15])
    np.testing.assert_array_equal(args[1][1][0], [4, 5, 6, 7, 8, 9, 10, 11])


# --- traffic: emulator == trace ----------------------------------------------------------
TRAFFIC = [("gpt", "pp2 cp2 tp2", "ring", {}), ("llama", "dp2 cp2", "all_gather", {}),
           ("llama", "cp4", "ring", {"recompute": "full"})]


@pytest.mark.parametrize("arch, spec, algorithm, extra", TRAFFIC,
                         ids=["-".join([a, s.replace(" ", "_"), g] + list(e)) for a, s, g, e in
                              TRAFFIC])
def test_traced_traffic_and_flops_equal_the_emulator(cluster_of, reference, arch, spec,
                                                     algorithm, extra):
    gpt, tokens, targets, _, _ = reference[arch]
    par = _parallel(spec, cp_algorithm=algorithm, **extra)
    mesh = par.mesh()
    cluster = cluster_of(mesh)
    job = gpt.train_job(mesh, par, steps=1, bucket_bytes=4096)
    cluster.reset_stats()
    cluster.run(train_program, gpt.device_args(mesh, job, tokens, targets))
    events, flops = cluster.trace(), cluster.stats()["flops"].tolist()
    traces = trace_program(mesh, train_program, gpt.meta_args(mesh, par, 1, bucket_bytes=4096))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in traces] == flops


def test_ring_traffic_and_gradient_group_closed_forms():
    """cp 2 (ring), dp 2, tp 1, one layer, m micro-batches: per layer and micro-batch the
    ring sends K, V forward (cp−1)·2X and K, V plus the dK, dV accumulators backward
    (2cp−1)·2X (X = b·a·s/cp·d·itemsize); the gradients are all-reduced over the 4 ranks
    of dp × cp."""
    cfg = GPTConfig(hidden=16, layers=1, heads=4, seq=16, vocab=32)
    par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, cp=2)
    mesh = par.mesh()
    trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par), ranks=[0, 1])[0]
    m, cp, b = par.microbatches, 2, 2
    x = b * cfg.heads * (cfg.seq // cp) * cfg.head_dim * 8
    op = ContextParallelAttention(cfg.heads, cfg.head_dim, "ring")
    shape = (b * cfg.heads, cfg.seq // cp, cfg.head_dim)
    expected = m * (op.sent_bytes(shape, cp, 8) + op.sent_bytes(shape, cp, 8, backward=True))
    assert expected == m * (2 * x * (cp - 1) + 2 * x * (2 * cp - 1))
    assert sum(o.nbytes for o in trace.ops if isinstance(o, TraceSend)) == expected
    grads = [o for o in trace.ops if isinstance(o, TraceCollective)]
    assert {o.group for o in grads} == {tuple(mesh.group(("dp", "cp"), 0))} == {(0, 1, 2, 3)}
    assert sum(o.nbytes for o in grads) == sum(
        int(np.prod(s)) * 8 for s in GPT(cfg).param_shapes().values())


# --- configuration -------------------------------------------------------------------------
def test_cp_config_errors_are_clear():
    with pytest.raises(ValueError, match="cp_algorithm=.*: not a known value; allowed: one "
                                         "of ring, all_gather"):
        ParallelConfig(global_batch=4, cp=2, cp_algorithm="tree")
    with pytest.raises(ValueError, match="ParallelConfig: cp=0: not a positive integer; "
                                         "allowed: an integer >= 1"):
        ParallelConfig(global_batch=4, cp=0)
    gpt = GPT(GPTConfig(hidden=16, layers=2, heads=4, seq=12, vocab=32))
    par = ParallelConfig(global_batch=4, cp=4)
    with pytest.raises(ValueError, match=r"seq=12 does not split into 2·cp = 8 chunks"):
        gpt.train_job(par.mesh(), par)
    with pytest.raises(ValueError, match="ParallelConfig says cp=2 but the mesh's cp axis has "
                                         "size 1"):
        gpt.train_job(Mesh((2,), ("dp",)), ParallelConfig(global_batch=4, dp=2, cp=2))
    par = ParallelConfig(global_batch=4, cp=2, tp=4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"seq/cp \(sequence parallelism\)=6 does not split "
                                         "evenly over tp=4"):
        gpt.train_job(par.mesh(), par)


def test_mesh_orders_tp_innermost_then_cp():
    par = ParallelConfig(global_batch=4, dp=2, pp=2, cp=2, tp=2)
    assert par.mesh() == Mesh((2, 2, 2, 2), ("dp", "pp", "cp", "tp")) and par.gpus == 16
    assert ParallelConfig(global_batch=4, dp=2, tp=2).mesh() == Mesh((2, 1, 2),
                                                                     ("dp", "pp", "tp"))
