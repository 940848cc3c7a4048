"""Transformer Engine's tensor-parallel overlap (``ParallelConfig.tp_overlap="te"``,
:mod:`tensor_parallel.collective_matmul`): the sequence-parallel gathers and
reduce-scatters run as ring steps between chunked GEMMs. The emulated math equals the
single-process reference (GPT and Llama, every recomputation mode, several meshes and
micro-batches); each ring moves the bytes NCCL's ring collective would; the replayed step
hides most of a Llama 70B layer's tensor-parallel communication on 8 H100s, and the
planner's screen prices it as the replay does."""

import dataclasses

import numpy as np
import pytest

from modeling import ConfigError
from modeling.presets import load_model
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from tensor_parallel.collective_matmul import TAG_GATHER, TAG_REDUCE
from vcluster.planner.layer_cost import trace_stage_pieces
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import (RING_TAG_BASE, DeviceTrace, TraceCollective, TraceRecv,
                                      TraceSend, trace_program)
from vcluster.timing.engine import simulate_trace
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.presets import preset

from ..pipeline_parallel.gpt_data import mesh_of, token_data

pytestmark = pytest.mark.timeout(600)

B, STEPS, LR = 8, 2, 0.1
RTOL = 1e-9
GPT_CFG = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32)
LLAMA_CFG = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                      kv_heads=2, ffn_hidden=24)


@pytest.fixture(scope="module")
def clusters(cluster_of):
    return cluster_of


def _reference(cfg):
    model = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B, 0)
    return (model, tokens, targets, model.reference_forward(tokens, targets),
            model.fit_reference(tokens, targets, steps=STEPS, optimizer="sgd", lr=LR))


@pytest.fixture(scope="module")
def references():
    return {"gpt": _reference(GPT_CFG), "llama": _reference(LLAMA_CFG)}


RUNS = [("gpt", "tp2", 2, r) for r in ("none", "selective", "full")] + [
    ("gpt", "tp4", 1, "none"), ("gpt", "tp4", 4, "full"), ("gpt", "dp2 pp2 tp2", 2, "none"),
    ("llama", "tp2", 2, "none"), ("llama", "tp4", 1, "selective"),
    ("llama", "dp2 tp2", 4, "full"), ("llama", "pp2 tp2", 2, "none")]


@pytest.mark.parametrize("arch, mesh, b, recompute", RUNS,
                         ids=[f"{a}-{m.replace(' ', '-')}-b{b}-{r}" for a, m, b, r in RUNS])
def test_training_equals_the_reference(clusters, references, arch, mesh, b, recompute):
    model, tokens, targets, (ref_loss, ref_logits), ref = references[arch]
    mesh = mesh_of(mesh)
    par = ParallelConfig(global_batch=B, micro_batch=b, **dict(mesh.shape),
                         sequence_parallel=True, recompute=recompute, tp_overlap="te")
    assert par.use_tp_comm_overlap and par.use_async_grad_reduce
    cluster = clusters(mesh)
    loss, logits = model.forward(cluster, tokens, targets, par)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=1e-12)
    run = model.fit(cluster, tokens, targets, steps=STEPS, parallel=par, optimizer="sgd",
                    lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    for name in ref.params:
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=1e-8,
                                   atol=1e-12, err_msg=name)


def _layer_trace(cfg, tp: int, overlap: str, b: int = 2):
    """Every rank's trace of one training step (shape-only)."""
    mesh = mesh_of(f"tp{tp}")
    par = ParallelConfig(global_batch=b, micro_batch=b, tp=tp, sequence_parallel=True,
                         tp_overlap=overlap)
    return trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_ring_moves_what_the_ring_collective_would(arch, tp):
    """Under te no tensor-parallel all_gather or reduce_scatter is left in a layer; each
    became t−1 sends and t−1 receives of one rank's chunk (|x|/t), the bytes a ring
    all-gather or reduce-scatter carries per member; the sends go to the next tp rank."""
    cfg = GPT_CFG if arch == "gpt" else LLAMA_CFG
    cfg = dataclasses.replace(cfg, layers=1)
    base, te = (_layer_trace(cfg, tp, o) for o in ("backward", "te"))
    for rank in range(tp):
        colls = [op for op in base[rank].ops if isinstance(op, TraceCollective)
                 and op.collective in ("all_gather", "reduce_scatter") and len(op.group) == tp]
        left = [op for op in te[rank].ops if isinstance(op, TraceCollective)
                and op.collective in ("all_gather", "reduce_scatter") and len(op.group) == tp]
        sends = [op for op in te[rank].ops if isinstance(op, TraceSend)]
        recvs = [op for op in te[rank].ops if isinstance(op, TraceRecv)]
        assert {op.tag for op in sends} == {TAG_GATHER, TAG_REDUCE} and TAG_GATHER > RING_TAG_BASE
        assert all(op.peer == (rank + 1) % tp for op in sends)
        assert all(op.peer == (rank - 1) % tp for op in recvs)
        # the layer's 4 forward and 2 backward gathers/reduce-scatters became rings (the
        # input gradients' reduce-scatters stay collectives, overlapped with the weight
        # gradients, as do the embedding's and head's, which no GEMM follows); a ring
        # member's wire bytes: (t−1)/t of a gather's output or a reduce-scatter's input
        def wire(calls):
            return sum(op.nbytes * (tp - 1) // (1 if op.collective == "all_gather" else tp)
                       for op in calls)
        assert len(colls) - len(left) == 6 and len(sends) == len(recvs) == 6 * (tp - 1)
        assert sum(op.nbytes for op in sends) == sum(op.nbytes for op in recvs) \
            == wire(colls) - wire(left)


def _layer_exposed_s(overlap: str) -> tuple[float, float, float]:
    """(exposed communication, step time, communication) of one Llama 3.1 70B layer (2
    layers less 1) on 8 H100s, tp 8 with sequence parallelism, seq 8192, micro-batch 1."""
    base = GPTConfig.from_spec(load_model("llama-3.1-70b"), seq=8192, timing_only=True)
    out = []
    for layers in (1, 2):
        sim = simulate_gpt(dataclasses.replace(base, layers=layers),
                           ParallelConfig(global_batch=1, tp=8, sequence_parallel=True,
                                          tp_overlap=overlap), "h100-dgx")
        out.append((sim.exposed_comm_s, sim.step_time_s, sim.comm_s))
    return tuple(b - a for a, b in zip(*out))


def test_te_hides_most_of_a_llama_70b_layers_tensor_parallel_communication():
    """The acceptance figure: with the TE setting the layer's exposed TP communication is
    below 25% of its unoverlapped time (tp_overlap none: every collective blocking), and
    the layer is faster than under Megatron's backward-only overlap."""
    exposed = {o: _layer_exposed_s(o) for o in ("none", "backward", "te")}
    assert exposed["none"][0] > 1e-3                     # milliseconds of TP communication
    assert exposed["te"][0] < 0.25 * exposed["none"][0]
    assert exposed["te"][0] < exposed["backward"][0] < exposed["none"][0]
    assert exposed["te"][1] < exposed["backward"][1] < exposed["none"][1]
    # the rings move what the collectives moved, counted once per member (a ring step's
    # receive runs beside the member's own send): point-to-point steps take a little longer
    assert exposed["none"][2] < exposed["te"][2] < 1.25 * exposed["none"][2]


def test_the_screen_prices_the_rings_as_the_replay_does():
    """The planner's screen walks rank 0's ring steps with its own send times standing for
    its peer's: the layer's TP communication it counts under te is within 25% of the
    replay's exposed figure, and far below its blocking count."""
    cfg = GPTConfig.from_spec(load_model("llama-3.1-70b"), seq=8192, timing_only=True)
    costs = HardwareCostModel(preset("h100-dgx"))
    pieces = {te: trace_stage_pieces(cfg, 8, 1, True, "none", costs, tp_comm_overlap=te)
              for te in (False, True)}
    comm = {te: sum(p[("layer", a)].comm_s for a in "FIW") for te, p in pieces.items()}
    replay = _layer_exposed_s("te")[0]
    assert comm[True] == pytest.approx(replay, rel=0.25)
    assert comm[True] < 0.3 * comm[False]
    assert pieces[True][("layer", "W")] == pieces[False][("layer", "W")]


def test_te_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match=r"tp_overlap='te' overlaps the sequence-parallel "
                                          r"all-gathers .* needs sequence_parallel=True "
                                          r"with tp=2"):
        ParallelConfig(global_batch=4, tp=2, tp_overlap="te")
    assert not ParallelConfig(global_batch=4, tp_overlap="te").use_tp_comm_overlap   # tp 1


def test_a_ring_receive_from_an_untraced_rank_mirrors_the_own_send():
    """Symmetric replay: rank 0 sends its chunk to untraced rank 1 and receives the next
    from untraced rank 3 — which mirrors its own send (ends when it ends); the same
    receive before any send, or with an ordinary tag, is an error naming the fix."""
    tag = TAG_GATHER
    costs = SimpleCostModel(flops_per_s=1e9, bytes_per_s=1e9, alpha_s=0.0,
                            link_bytes_per_s=1e6)
    ring = [TraceSend(1, 1000, tag), TraceRecv(3, 1000, tag)]
    res = simulate_trace({0: _trace(0, ring)}, costs, mesh=mesh_of("tp4"), symmetric=True)
    assert res.step_time_s == pytest.approx(1e-3)
    assert res.stats_of(0).exposed_comm_s == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="before rank 0 has sent a tag-.* message to an "
                                         "untraced rank.*trace rank 3 too"):
        simulate_trace({0: _trace(0, ring[::-1])}, costs, mesh=mesh_of("tp4"), symmetric=True)
    with pytest.raises(ValueError, match="receives from rank 3, which has no trace"):
        simulate_trace({0: _trace(0, [TraceSend(1, 1000, 7), TraceRecv(3, 1000, 7)])}, costs,
                       mesh=mesh_of("tp4"), symmetric=True)


def _trace(rank, ops):
    return DeviceTrace(rank, tuple(ops))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_mixture_of_experts_trains_as_its_reference(clusters, recompute):
    """A Llama MoE (4 experts, top-2) on dp 2 × ep 2 × tp 2 with sequence parallelism: the
    attention's gathers and reduce-scatters run as rings under te, the MoE block keeps its
    collectives; losses, gradients and parameters equal the reference routing the same."""
    cfg = GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama", kv_heads=2,
                    ffn_hidden=24, experts=4, moe_top_k=2, moe_ffn_hidden=12)
    par = ParallelConfig(global_batch=4, micro_batch=2, dp=2, ep=2, tp=2,
                         sequence_parallel=True, recompute=recompute, tp_overlap="te")
    model = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, par.global_batch, 0)
    ref = model.fit_reference(tokens, targets, STEPS, lr=LR, parallel=par)
    run = model.fit(clusters(par.mesh()), tokens, targets, STEPS, parallel=par, lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    for name in ref.params:
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=1e-8,
                                   atol=1e-12, err_msg=name)
