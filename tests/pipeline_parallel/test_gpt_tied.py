"""Tied embeddings (GPTConfig.tie_embeddings: logits = x E^T): the numpy reference's
gradients against finite differences; the emulated training against the reference over
dp, pp (fewer, as many and more micro-batches than stages, interleaved, one rank holding
both ends), tp, cp, ZeRO 1-3, GPT, Llama and MoE; the two copies of E on a pipeline stay
bit for bit equal; the trace moves the copies' gradients once per step; the memory model
holds what the program holds."""

import numpy as np
import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.planner.memory import rank_params
from vcluster.runtime.tracing import TraceCompute, TraceRecv, TraceSend, trace_program

from .gpt_data import assert_same_params_and_grads, mesh_of, token_data

pytestmark = pytest.mark.timeout(600)

B, STEPS, LR = 8, 2, 0.01
RTOL, ATOL = 1e-8, 1e-11


def _cfg(arch="gpt", tie=True, **kw):
    extra = {"kv_heads": 2} if arch == "llama" else {}
    return GPTConfig(**{**dict(hidden=16, layers=4, heads=4, seq=8, vocab=32, arch=arch,
                               tie_embeddings=tie), **extra, **kw})


@pytest.fixture(scope="module")
def clusters(cluster_of):
    return cluster_of


# --- the model --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_tied_model_has_no_w_out_and_v_h_fewer_parameters(arch):
    tied, untied = GPT(_cfg(arch)), GPT(_cfg(arch, tie=False))
    assert set(untied.param_shapes()) - set(tied.param_shapes()) == {"w_out"}
    size = lambda m: sum(int(np.prod(s)) for s in m.param_shapes().values())  # noqa: E731
    assert size(untied) - size(tied) == 32 * 16


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_reference_gradient_of_e_matches_finite_differences(arch):
    """dE = the embedding's scatter-add plus the head's dlogits^T x: checked on rows E
    is looked up at and on rows it is not (only the head's term)."""
    cfg = _cfg(arch, hidden=8, layers=2, heads=2, seq=4, vocab=8)
    gpt = GPT(cfg, seed=3)
    tokens, targets = token_data(cfg, 2, 1)
    params = gpt.init_params()
    grads = gpt.fit_reference(tokens, targets, steps=1).grads
    unseen = sorted(set(range(cfg.vocab)) - set(tokens.ravel().tolist()))
    rows = [int(tokens[0, 0]), int(tokens[1, 2])] + unseen[:1]
    assert unseen, "the data leave a vocabulary row only the head uses"
    for row in rows:
        for col in (0, cfg.hidden - 1):
            p, e = params["wte"], 1e-6
            old = p[row, col]
            p[row, col] = old + e
            up = gpt.reference_forward(tokens, targets, params)[0]
            p[row, col] = old - e
            down = gpt.reference_forward(tokens, targets, params)[0]
            p[row, col] = old
            assert (up - down) / (2 * e) == pytest.approx(grads["wte"][row, col], rel=1e-5,
                                                          abs=1e-9), (row, col)


def test_config_errors_name_the_value_and_the_alternatives():
    with pytest.raises(ValueError, match="tie_embeddings must be True or False, got 'yes'"):
        _cfg(tie="yes")
    gpt = GPT(_cfg())
    for zero in (1, 2):
        par = ParallelConfig(global_batch=8, dp=2, schedule="interleaved_1f1b",
                             virtual_stages=2, zero_stage=zero)
        with pytest.raises(ValueError, match=rf"tie_embeddings with zero_stage={zero} on 2 "
                                             rf"stages .*use one stage, zero_stage 0, or "
                                             rf"zero_stage 1 with pp > 1"):
            gpt.train_job(par.mesh(), par)


# --- emulated training equals the reference ------------------------------------------------
CASES = [  # arch, mesh, micro-batch, extra ParallelConfig fields
    ("gpt", "dp2 tp2", 2, {}),                                    # one stage holds both ends
    ("gpt", "pp2 tp2", 4, {}),                                    # m = 2: as many as stages
    ("gpt", "pp4", 4, {"schedule": "gpipe"}),                     # m = 2 < 4 stages
    ("gpt", "pp2", 1, {"schedule": "zero_bubble"}),               # m = 8 > 2 stages
    ("gpt", "dp2 pp2", 2, {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
    ("gpt", "pp1", 2, {"schedule": "interleaved_1f1b", "virtual_stages": 2}),  # 2 on 1 rank
    ("gpt", "pp2 tp2", 2, {"sequence_parallel": True, "recompute": "full"}),
    ("gpt", "pp2 cp2", 2, {}),
    ("gpt", "dp2 pp2", 2, {"zero_stage": 1}),
    ("gpt", "dp2 pp2 tp2", 2, {"zero_stage": 1, "schedule": "interleaved_1f1b",
                               "virtual_stages": 2}),
    ("gpt", "dp2", 2, {"zero_stage": 2}),
    ("gpt", "dp2 tp2", 2, {"zero_stage": 3}),
    ("llama", "pp2 tp2", 2, {}),
    ("llama", "dp2", 1, {"zero_stage": 3}),
    ("moe", "pp2", 2, {}),
]


def _case_config(arch):
    if arch == "moe":
        return _cfg("llama", experts=4, moe_top_k=2, moe_ffn_hidden=8)
    return _cfg(arch)


@pytest.mark.parametrize("arch, mesh, b, extra", CASES,
                         ids=[f"{a}-{m.replace(' ', '')}-b{b}-" + "-".join(
                             f"{k}={v}" for k, v in x.items()) for a, m, b, x in CASES])
def test_training_equals_reference(clusters, arch, mesh, b, extra):
    cfg, mesh = _case_config(arch), mesh_of(mesh)
    gpt = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B, 0)
    par = ParallelConfig(global_batch=B, micro_batch=b, **dict(mesh.shape), **extra)
    ref = gpt.fit_reference(tokens, targets, steps=STEPS, optimizer="adam", lr=LR,
                            parallel=par if cfg.experts else None)
    if not par.zero_stage:                       # the forward alone: loss and logits
        loss, logits = gpt.forward(clusters(mesh), tokens, targets, par)
        ref_loss, ref_logits = gpt.reference_forward(tokens, targets,
                                                     parallel=par if cfg.experts else None)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
        np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    run = gpt.fit(clusters(mesh), tokens, targets, steps=STEPS, parallel=par,
                  optimizer="adam", lr=LR)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.params.keys() == ref.params.keys() and "w_out" not in run.params
    assert_same_params_and_grads(run, ref, RTOL, ATOL)
    assert ref.losses[-1] < ref.losses[0]


@pytest.mark.parametrize("mesh, extra", [
    ("pp2 tp2", {}), ("dp2 pp2", {"zero_stage": 1}),
    ("pp2", {"schedule": "interleaved_1f1b", "virtual_stages": 2})])
def test_the_two_copies_of_e_stay_bit_for_bit_equal(clusters, mesh, extra):
    cfg, mesh = _cfg(), mesh_of(mesh)
    gpt = GPT(cfg, seed=2)
    tokens, targets = token_data(cfg, B, 3)
    par = ParallelConfig(global_batch=B, micro_batch=2, **dict(mesh.shape), **extra)
    results = clusters(mesh).run(train_program, gpt.device_args(
        mesh, gpt.train_job(mesh, par, steps=3), tokens, targets))
    from pipeline_parallel.zero import unshard_results
    if par.zero_stage:
        results = unshard_results(mesh, "dp", results)
    p = mesh.shape["pp"]
    for r, res in enumerate(results):
        if mesh.group_position("pp", r) != p - 1:
            continue
        first = mesh.group("pp", r)[0]
        assert np.array_equal(res["params"]["wte"], results[first]["params"]["wte"])
        assert np.array_equal(res["grads"]["wte"], results[first]["grads"]["wte"])


# --- trace and memory ----------------------------------------------------------------------
def test_trace_exchanges_the_copies_gradients_once_per_step():
    """pp 2, tp 2: per step, pipeline rank 0 and 1 of each tp piece send each other their
    E piece's gradient (V/t x h), once, beside the pipeline's activations; untied, no
    message of that size."""
    V, h, t, steps = 32, 16, 2, 2
    par = ParallelConfig(global_batch=8, micro_batch=4, pp=2, tp=t)
    mesh = par.mesh()
    sizes = {}
    for tie in (True, False):
        gpt = GPT(_cfg(tie=tie))
        traces = trace_program(mesh, train_program, gpt.meta_args(mesh, par, steps=steps))
        sizes[tie] = [[op.nbytes for op in tr.ops if isinstance(op, (TraceSend, TraceRecv))]
                      for tr in traces]
        sums = [sum(1 for op in tr.ops if isinstance(op, TraceCompute)
                    and op.name == "tied grads: sum") for tr in traces]
        assert sums == [steps if tie else 0] * mesh.size
    piece = V // t * h * 8                                   # float64
    for rank in range(mesh.size):
        assert sizes[True][rank].count(piece) == 2 * steps   # one send, one receive a step
        assert sizes[False][rank].count(piece) == 0


def _count_params(dev, job):
    """Declare the parameters this rank's stages hold (the GPT program's own stages)."""
    pp = dev.mesh.group("pp", dev.rank)
    held = sum(int(a.size) for s in range(pp.index(dev.rank), job.n_stages, len(pp))
               for arrays in job.stage_factory(dev, job, s).params for a in arrays)
    with dev.compute("params", flops=held):
        pass


@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_memory_model_holds_what_the_program_holds(pp, v):
    """rank_params of a tied model = the parameters the program's stages hold (traced):
    one stage, E once; a pipeline (or two stages on one rank), E on the first and the
    last stage, as untied W_out."""
    cfg = _cfg(hidden=32, vocab=96)
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    par = ParallelConfig(global_batch=4, pp=pp, tp=2, schedule=schedule, virtual_stages=v)
    mesh = par.mesh()
    job = GPT(cfg).meta_args(mesh, par)[0][0]
    ranks = [mesh.rank({"dp": 0, "pp": p, "tp": 0}) for p in range(pp)]
    held = [sum(op.flops for op in t.ops if isinstance(op, TraceCompute) and op.name == "params")
            for t in trace_program(mesh, _count_params, [(job,)] * mesh.size, ranks=ranks)]
    assert held == [rank_params(cfg, par, p) for p in range(pp)]
    untied = rank_params(_cfg(hidden=32, vocab=96, tie=False), par, pp - 1)
    assert untied - rank_params(cfg, par, pp - 1) == (96 * 32 / 2 if pp * v == 1 else 0)


def test_scenario_key_trains_a_tied_model_and_traces_its_traffic():
    """scenarios/transformer.yaml (dp 2 x pp 2 x tp 2, SP) with workload.tie_embeddings:
    the emulated run equals the numpy reference and moves what its trace moves (the
    copies' exchange included)."""
    from pathlib import Path

    from vcluster.scenario import load_scenario, run_scenario
    root = Path(__file__).resolve().parents[2]
    s = load_scenario(root / "scenarios" / "transformer.yaml",
                      ["workload.tie_embeddings=true", "run.steps=1"])
    assert s.workload.options["tie_embeddings"] is True
    record = run_scenario(s)
    assert record.passed and record.summary["traffic_matches"] is True


def test_parameter_server_trains_the_tied_model(clusters):
    """A worker's one stage holds both ends: E once, as in the reference."""
    from mesh import Mesh
    cfg = _cfg(layers=2)
    gpt = GPT(cfg, seed=1)
    tokens, targets = token_data(cfg, B, 0)
    ref = gpt.fit_reference(tokens, targets, steps=STEPS, lr=0.1)
    run = gpt.fit_parameter_server(clusters(Mesh((3,), ("ps",))), tokens, targets,
                                   steps=STEPS, servers=1, lr=0.1)
    assert run.params.keys() == ref.params.keys()
    for name in ref.params:
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
