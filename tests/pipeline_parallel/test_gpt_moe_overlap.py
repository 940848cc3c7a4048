"""Megatron-Core's MoE expert-parallel overlap (``ParallelConfig(moe_comm_overlap=True)``,
the combined 1F1B schedule, :func:`pipelining.combined_1f1b`): the emulated MoE training
runs the combined action order (a forward issued before the previous micro-batch's
backward) and equals the single-process reference at rtol 1e-9; its traced traffic equals
the emulator's; the rulebook refuses the plans Megatron refuses, naming the setting."""

import pytest

from modeling import ConfigError
from pipeline_parallel.gpt import GPT, ParallelConfig
from pipelining import combined_pairs, make_schedule

from ..tensor_parallel.moe_data import trace_moves_the_runs_messages
from .test_gpt_moe import _cfg, _data, _trains_as_reference

pytestmark = pytest.mark.timeout(300)

# (dp, ep, pp, schedule, virtual stages, layers, micro-batches m): no pipelining with
# m = 1 (no pair), 2, 3; interleaved pp 2 with m = p and m > p (m < p: interleaved needs
# m a multiple of p, refused below), pp 4 with m = p
CASES = [
    (2, 2, 1, "1f1b", None, 2, 1),
    (2, 2, 1, "1f1b", None, 2, 2),
    (2, 2, 1, "1f1b", None, 2, 3),
    (2, 2, 2, "interleaved_1f1b", 2, 4, 2),
    (2, 2, 2, "interleaved_1f1b", 2, 4, 4),
    (2, 2, 4, "interleaved_1f1b", 2, 8, 4),
]


def _par(dp, ep, pp, schedule, v, m, **kw):
    return ParallelConfig(global_batch=dp * m, micro_batch=1, dp=dp, ep=ep, pp=pp,
                          schedule=schedule, virtual_stages=v, moe_comm_overlap=True, **kw)


@pytest.mark.parametrize("dp, ep, pp, schedule, v, layers, m", CASES,
                         ids=[f"pp{c[2]}-{c[3]}-m{c[6]}" for c in CASES])
def test_overlapped_training_equals_reference(cluster_of, dp, ep, pp, schedule, v, layers, m):
    cfg = _cfg(2, None, layers=layers)
    par = _par(dp, ep, pp, schedule, v, m)
    model, (tokens, targets) = GPT(cfg, seed=3), _data(cfg, batch=par.global_batch)
    job = model.meta_args(par.mesh(), par)[0][0]
    sched = make_schedule(schedule, pp, m, v, combined=True)
    assert job.actions == sched.actions
    if pp == 1 and m > 1:        # F0, F1, B0, F2, B1, ...: the next forward first
        assert [str(a) for a in job.actions[0][:3]] == ["0F0", "0F1", "0B0"]
    pairs = sum(map(len, combined_pairs(sched)))
    assert pairs == m - 1 if pp == 1 else pairs > 0
    _trains_as_reference(cluster_of(par.mesh()), model, tokens, targets, par, forward=False,
                         steps=2)


@pytest.mark.parametrize("pp, schedule, v, layers, m", [(1, "1f1b", None, 2, 3),
                                                         (2, "interleaved_1f1b", 2, 4, 4)])
def test_overlap_with_the_flex_dispatcher_equals_reference(cluster_of, pp, schedule, v,
                                                           layers, m):
    """The combined schedule with Megatron-Core's flex dispatcher (DeepEP / HybridEP, the
    recipes that turn the overlap on mostly run it): the same numbers as the reference."""
    cfg = _cfg(2, None, layers=layers)
    par = _par(2, 2, pp, schedule, v, m, moe_dispatcher="flex")
    model, (tokens, targets) = GPT(cfg, seed=3), _data(cfg, batch=par.global_batch)
    _trains_as_reference(cluster_of(par.mesh()), model, tokens, targets, par, forward=False,
                         steps=2)


@pytest.mark.parametrize("pp, schedule, v, layers, m", [(1, "1f1b", None, 2, 3),
                                                         (2, "interleaved_1f1b", 2, 4, 4)])
def test_overlapped_traffic_equals_trace(cluster_of, pp, schedule, v, layers, m):
    """The trace of the combined schedule moves the emulator's messages, rank by rank
    (capacity-padded exchanges: their sizes do not depend on each micro-batch's routing,
    which a trace's one ExpertLoad per layer does not follow over several micro-batches)."""
    cfg = _cfg(2, 1.0, layers=layers)
    par = _par(2, 2, pp, schedule, v, m)
    mesh, model = par.mesh(), GPT(cfg, seed=5)
    tokens, targets = _data(cfg, batch=par.global_batch)
    trace_moves_the_runs_messages(cluster_of(mesh), model, par, tokens, targets)


def test_overlap_is_refused_by_name():
    """ep 1, the allgather dispatcher, full recomputation, 1F1B with pp > 1 and the other
    schedules are refused naming ``moe_comm_overlap``, its value and what is allowed; a
    dense model too (the model's check); interleaved with m < p by the microbatches rule."""
    bad = [dict(dp=2, ep=1), dict(dp=2, ep=2, moe_dispatcher="allgather"),
           dict(dp=2, ep=2, recompute="full"), dict(dp=2, ep=2, pp=2),
           dict(dp=2, ep=2, pp=2, schedule="gpipe"), dict(dp=2, ep=2, schedule="zero_bubble"),
           dict(dp=2, ep=2, pp=2, schedule="interleaved_1f1b", virtual_stages=1)]
    for kw in bad:
        with pytest.raises(ConfigError) as e:
            ParallelConfig(global_batch=4, moe_comm_overlap=True, **kw)
        assert e.value.field == "moe_comm_overlap" and e.value.value is True, kw
        assert "moe_comm_overlap=True" in str(e.value), kw
        assert f"allowed: {e.value.allowed}" in str(e.value) and e.value.allowed, kw
    with pytest.raises(ConfigError, match="moe_comm_overlap"):
        ParallelConfig(global_batch=4, moe_comm_overlap="yes")
    par = ParallelConfig(global_batch=4, dp=2, ep=2, moe_comm_overlap=True)
    with pytest.raises(ConfigError) as e:
        par.check(_cfg(experts=0), par.mesh())
    assert e.value.field == "moe_comm_overlap"
    with pytest.raises(ConfigError) as e:
        _par(2, 2, 2, "interleaved_1f1b", 2, 1).check_microbatches()
    assert e.value.field == "microbatches"
