"""``plan_serve``: the layouts it tries, the bisections it runs, the ranking it returns,
and the same answer from one process or several."""

from __future__ import annotations

import pytest

from modeling.errors import ConfigError
from modeling.presets import load_model
from serving import ServingPlan
from vcluster.planner.serving import plan_serve, serving_layouts
from vcluster.timing.presets import preset
from vcluster.timing.serving.workload import Workload

pytestmark = pytest.mark.timeout(600)
H100 = preset("h100-dgx")


def test_layouts_follow_the_heads_the_gpus_and_the_experts():
    dense = serving_layouts(load_model("llama-3.1-8b"), 8, 8)
    assert {(tp, pp) for tp, pp, _ in dense} == {
        (tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if tp * pp <= 8}
    assert {ep for *_, ep in dense} == {1}
    moe = serving_layouts(load_model("qwen3-30b-a3b"), 4, 4)
    assert (4, 1, 4) in moe and (4, 1, 1) in moe and (2, 2, 2) in moe
    assert serving_layouts(load_model("llama-3.1-8b"), 8, 2) == [
        (tp, pp, 1) for tp in (1, 2) for pp in (1, 2, 4, 8) if tp * pp <= 8]


@pytest.fixture(scope="module")
def searched():
    spec = load_model("llama-3.1-8b")
    work = Workload(num_requests=240, input_len=2048, output_len=32, rate=40.0, seed=3)
    kwargs = dict(gpus=4, slo_ttft_ms=150.0, slo_tpot_ms=15.0, max_tp=2, disaggregated=True)
    return (plan_serve(spec, H100, ServingPlan(), work, workers=1, **kwargs),
            plan_serve(spec, H100, ServingPlan(), work, workers=2, **kwargs))


def test_one_process_or_two_find_the_same(searched):
    one, two = searched
    assert [c.row() for c in one.candidates] == [c.row() for c in two.candidates]
    assert one.space == two.space > len(one.candidates) / 2


def test_the_ranking_puts_the_most_goodput_per_gpu_that_meets_first(searched):
    result = searched[0]
    meets = [c for c in result.candidates if c.meets_slo]
    assert meets and result.best is meets[0]
    assert [c.goodput_per_gpu for c in meets] == sorted((c.goodput_per_gpu for c in meets),
                                                        reverse=True)
    first_miss = next((i for i, c in enumerate(result.candidates) if not c.meets_slo),
                      len(result.candidates))
    assert first_miss < len(result.candidates)          # the search also shows misses
    assert all(not c.meets_slo for c in result.candidates[first_miss:])
    for c in result.candidates:
        assert c.goodput_rps == pytest.approx(40.0 * c.attainment)
        assert c.gpus == (c.plan.replicas + c.plan.prefill_replicas) * c.plan.tp * c.plan.pp


def test_the_disaggregated_bisection_finds_the_fewest_prefill_replicas(searched):
    result = searched[0]
    for tp, pp in {(c.plan.tp, c.plan.pp) for c in result.candidates if c.plan.prefill_replicas}:
        splits = sorted((c.plan.prefill_replicas, c.ttft_ms <= 150.0) for c in result.candidates
                        if (c.plan.tp, c.plan.pp) == (tp, pp) and c.plan.prefill_replicas)
        oks = [p for p, ok in splits if ok]
        if oks:
            assert not any(ok for p, ok in splits if p < min(oks))


def test_bad_slos_and_gpus_are_refused():
    spec, work = load_model("llama-3.1-8b"), Workload(10, 64, 8, rate=1.0)
    for kwargs, field in (({"slo_ttft_ms": 0.0}, "slo_ttft_ms"), ({"gpus": 0}, "gpus"),
                          ({"slo_percentile": 120.0}, "slo_percentile")):
        args = dict(gpus=2, slo_ttft_ms=100.0, slo_tpot_ms=10.0, workers=1) | kwargs
        with pytest.raises(ConfigError) as err:
            plan_serve(spec, H100, ServingPlan(), work, **args)
        assert err.value.field == field


def test_nothing_meets_an_impossible_slo():
    result = plan_serve(load_model("llama-3.1-8b"), H100, ServingPlan(),
                        Workload(40, 256, 16, rate=5.0), gpus=2, slo_ttft_ms=0.001,
                        slo_tpot_ms=0.001, workers=1)
    assert result.best is None and result.candidates
    assert "none meets the SLOs" in result.describe()
