"""The simulator prices Megatron-Core's MoE expert-parallel overlap
(``ParallelConfig(moe_comm_overlap=True)``, the combined 1F1B): each steady (F, B) pair is
stitched interleaved, its MoE all_to_alls asynchronous (:func:`vcluster.planner.stitch.
combined_ops`). Exchanges shorter than the other micro-batch's compute hide: the step
drops by the paired micro-batches' exchange time T_x·(m−1)/m (the unpaired F0 and
B(m−1) stay exposed); exchanges longer than compute bound the step from below; the
stitched trace holds the same ops as without the overlap, reordered and made
asynchronous; pipelines of 2 and 4 ranks with m = p, 2p, 3p replay without deadlock."""

import dataclasses
import math
from collections import Counter

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.simulation import gpt_step_traces, simulate_gpt
from vcluster.planner.stitch import is_token_exchange
from vcluster.runtime.tracing.ops import TraceCollective, TraceWait
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

pytestmark = pytest.mark.timeout(300)

H100 = "h100-dgx"


def _cfg(layers=4, **kw):
    return GPTConfig(**{**dict(hidden=256, layers=layers, heads=8, seq=128, vocab=1024,
                               arch="llama", kv_heads=4, ffn_hidden=512, experts=8,
                               moe_top_k=2), **kw})


def _par(m, overlap, pp=1, **kw):
    sched = dict(schedule="interleaved_1f1b") if pp > 1 else {}
    return ParallelConfig(global_batch=2 * m, micro_batch=1, dp=2, ep=2, pp=pp,
                          moe_comm_overlap=overlap, **sched, **kw)


def _exchange_s(cfg, par, hw) -> float:
    """T_x: the step's MoE token all_to_alls (over the ep group; not the int64 counts
    exchange, which stays in the compute node) priced alone, one rank."""
    costs = HardwareCostModel(hw, "bf16")
    (trace,) = gpt_step_traces(cfg, par, costs)
    group = par.mesh().group("ep", 0)
    return sum(costs.collective_time_s(op, 1) for op in trace.ops
               if is_token_exchange(op) and op.group == group)


def _slow_network(hw, gbps=0.005):
    """One GPU per node behind NICs of ``gbps`` GB/s: every all_to_all crosses them."""
    nic = dataclasses.replace(hw.network.nic, bandwidth_gbps=gbps)
    return dataclasses.replace(
        hw, node=dataclasses.replace(hw.node, gpus_per_node=1, domain_gpus=None),
        network=dataclasses.replace(hw.network, nic=nic))


def test_short_exchanges_hide_behind_the_other_micro_batch():
    """T_x ≪ compute: off − on = T_x·(m−1)/m (each pair hides both its exchanges; F0's
    and B(m−1)'s stay exposed) within 10 % of T_x, and the exposed communication drops by
    the same amount, leaving the unpaired T_x/m and the rest."""
    cfg, m, hw = _cfg(), 8, load_hardware(H100)
    off, on = (simulate_gpt(cfg, _par(m, ov), hw) for ov in (False, True))
    t_x = _exchange_s(cfg, _par(m, False), hw)
    assert t_x > 0.05 * off.step_time_s          # the exchanges matter at all
    saved = t_x * (m - 1) / m
    assert off.step_time_s - on.step_time_s == pytest.approx(saved, abs=0.1 * t_x)
    assert off.exposed_comm_s - on.exposed_comm_s == pytest.approx(saved, abs=0.1 * t_x)
    assert on.exposed_comm_s <= off.exposed_comm_s - t_x + t_x / m + 0.1 * t_x
    assert on.comm_s == pytest.approx(off.comm_s, rel=1e-9)      # the same traffic


def test_long_exchanges_bound_the_step():
    """T_x ≫ compute: the overlap cannot beat the communication — the step is at least
    the step's exchanges in series on the FIFO comm stream, and at least the compute."""
    cfg, m = _cfg(), 8
    hw = _slow_network(load_hardware(H100))
    off, on = (simulate_gpt(cfg, _par(m, ov), hw) for ov in (False, True))
    t_x = _exchange_s(cfg, _par(m, False), hw)
    assert t_x > 2 * off.compute_s                # communication-bound
    assert on.step_time_s >= t_x
    assert on.step_time_s >= on.compute_s
    assert on.step_time_s <= off.step_time_s + 1e-12
    # what overlap can hide is at most the compute it runs beside
    assert off.step_time_s - on.step_time_s <= off.compute_s + 1e-12


def _normal(op):
    """An op with its handle dropped (the overlap makes exchanges asynchronous)."""
    if isinstance(op, TraceCollective):
        return dataclasses.replace(op, handle=None)
    return op


@pytest.mark.parametrize("pp, m", [(1, 1), (1, 5), (2, 4), (4, 8)])
def test_stitched_ops_are_the_same_reordered(pp, m):
    """With and without the overlap the stitched trace holds the same multiset of ops
    (collectives with their bytes and groups, compute, messages), waits aside; with it
    the MoE all_to_alls of paired actions are asynchronous, each waited for once."""
    cfg, hw = _cfg(layers=4 * pp), load_hardware(H100)
    costs = HardwareCostModel(hw, "bf16")
    off = gpt_step_traces(cfg, _par(m, False, pp), costs)
    on = gpt_step_traces(cfg, _par(m, True, pp), costs)
    assert len(off) == len(on) == pp
    async_a2a = 0
    for a, b in zip(off, on):
        count = (lambda t: Counter(_normal(o) for o in t.ops if not isinstance(o, TraceWait)))
        assert count(a) == count(b)
        issued = [o.handle for o in b.ops if isinstance(o, TraceCollective)
                  and o.collective == "all_to_all" and o.handle is not None]
        waited = Counter(o.handle for o in b.ops if isinstance(o, TraceWait))
        assert all(waited[h] == 1 for h in issued)
        async_a2a += len(issued)
        if pp == 1 and m == 1:
            assert a.ops == b.ops         # no pair: nothing changes
    assert (async_a2a > 0) == (m > 1)


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (2, 6), (4, 4), (4, 8), (4, 12)])
def test_pipelines_replay_without_deadlock(pp, m):
    """Interleaved pipelines of 2 and 4 ranks, m = p, 2p, 3p (m < p: the interleaved
    schedule needs m a multiple of p): the replay finishes, and never slower than the
    plain interleaved step by more than the extra warm-up forward."""
    cfg, hw = _cfg(layers=4 * pp), load_hardware(H100)
    off, on = (simulate_gpt(cfg, _par(m, ov, pp), hw) for ov in (False, True))
    assert math.isfinite(on.step_time_s) and on.step_time_s > 0
    assert on.step_time_s <= off.step_time_s * 1.05
