"""Simulating deep pipelines fast: the traces stitched from three traced pipeline positions
(first, one middle, last) equal those of the whole pipeline traced, op for op, so the
replay and every figure are unchanged."""

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.simulation import gpt_step_traces, simulate_gpt
from vcluster.timing import load_hardware
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.planner.precision import MEGATRON

pytestmark = pytest.mark.timeout(600)
#: the optimizer's bytes a parameter under simulate_gpt's default policy
B_OPT = MEGATRON.optimizer_step_bytes
COSTS = HardwareCostModel(load_hardware("a100-80gb-dgx"), "bf16")


@pytest.mark.parametrize("pp, schedule, v, sp, recompute, m", [
    (4, "interleaved_1f1b", 2, False, "full", 8),
    (5, "interleaved_1f1b", 2, True, "selective", 10),
    (6, "interleaved_1f1b", 3, True, "none", 6),
    (8, "interleaved_1f1b", 2, False, "none", 16),
    (5, "1f1b", None, False, "full", 7),
    (6, "zero_bubble", None, True, "none", 9),
    (7, "gpipe", None, False, "selective", 3),
])
def test_three_traced_positions_equal_the_whole_pipeline(pp, schedule, v, sp, recompute, m):
    cfg = GPTConfig(hidden=64, layers=pp * (v or 1) * 2, heads=4, seq=32, vocab=128)
    par = ParallelConfig(global_batch=2 * m, micro_batch=1, dp=2, pp=pp, tp=2,
                         schedule=schedule, virtual_stages=v, sequence_parallel=sp,
                         recompute=recompute)
    fast = gpt_step_traces(cfg, par, COSTS)
    full = gpt_step_traces(cfg, par, COSTS, traced_positions=None)
    assert [t.rank for t in fast] == [t.rank for t in full] == list(par.mesh().group("pp", 0))
    for a, b in zip(fast, full):
        assert a.ops == b.ops, a.rank
    mesh = par.mesh()
    r_fast = simulate_trace(fast, COSTS, mesh=mesh, symmetric=True, timeline=False)
    r_full = simulate_trace(full, COSTS, mesh=mesh, symmetric=True, timeline=False)
    assert r_fast.step_time_s == r_full.step_time_s
    assert r_fast.stats == r_full.stats


def test_one_middle_position_stands_for_many():
    """pp 12: the ten middle positions are all renamed copies of the traced middle one,
    and the step time matches the whole pipeline traced."""
    cfg = GPTConfig(hidden=64, layers=24, heads=4, seq=16, vocab=64)
    par = ParallelConfig(global_batch=24, micro_batch=1, dp=2, pp=12, tp=1,
                         schedule="interleaved_1f1b", virtual_stages=2)
    fast = gpt_step_traces(cfg, par, COSTS, optimizer_step_bytes=B_OPT)
    full = gpt_step_traces(cfg, par, COSTS, traced_positions=None, optimizer_step_bytes=B_OPT)
    assert all(a.ops == b.ops for a, b in zip(fast, full))
    assert simulate_gpt(cfg, par, "a100-80gb-dgx").step_time_s == simulate_trace(
        full, COSTS, mesh=par.mesh(), symmetric=True, timeline=False).step_time_s


def test_traced_positions_is_checked():
    cfg = GPTConfig(hidden=64, layers=4, heads=4, seq=16, vocab=64)
    par = ParallelConfig(global_batch=4, pp=4)
    with pytest.raises(ValueError, match="traced_positions must be an int >= 3"):
        gpt_step_traces(cfg, par, COSTS, traced_positions=2)
    with pytest.raises(ValueError, match="do not split evenly"):
        gpt_step_traces(GPTConfig(hidden=64, layers=6, heads=4, seq=16, vocab=64), par, COSTS)
