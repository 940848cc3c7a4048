"""``ServingPlan``'s rules: each bad layout is refused with the field, the value and
what is allowed; the derived figures follow the module docstring."""

from __future__ import annotations

import pytest

from modeling.errors import ConfigError
from modeling.presets import load_model
from serving import ServingPlan, make_scheduler


def test_gpus_and_engine_defaults():
    plan = ServingPlan(tp=4, pp=2, replicas=3, prefill_replicas=1)
    assert plan.gpus == 4 * 2 * 4 and plan.gpus_per_replica == 8 and plan.disaggregated
    assert plan.token_budget == 8192
    assert ServingPlan(engine="static").token_budget is None
    assert ServingPlan(max_num_batched_tokens=512).token_budget == 512
    scheduler = make_scheduler(plan.engine, 100, **plan.scheduler_settings())
    assert scheduler.max_num_batched_tokens == 8192 and scheduler.max_num_seqs == 256
    make_scheduler("static", 100, **ServingPlan(engine="static").scheduler_settings())
    assert scheduler.pool.enable_caching                       # vLLM v1's default
    off = ServingPlan(enable_prefix_caching=False).scheduler_settings()
    assert not make_scheduler("vllm-v1", 100, **off).pool.enable_caching
    assert "enable_prefix_caching" not in ServingPlan(engine="static").scheduler_settings()


@pytest.mark.parametrize("kwargs, field", [
    ({"tp": 0}, "tp"), ({"replicas": 1.5}, "replicas"), ({"prefill_replicas": -1},
                                                          "prefill_replicas"),
    ({"engine": "orca"}, "engine"), ({"router": "random"}, "router"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
    ({"tp": 4, "ep": 2}, "ep"), ({"weight_bytes": 3}, "weight_bytes"),
    ({"engine": "static", "prefill_replicas": 1}, "prefill_replicas"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
    ({"expert_weight_bytes": 0.5}, "expert_weight_bytes"),     # MXFP4 is 4.25 bits
])
def test_bad_plans_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ServingPlan(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("model, kwargs, field", [
    ("llama-3.1-8b", {"tp": 3}, "tp"),            # 32 heads
    ("llama-3.1-8b", {"tp": 16}, None),           # 32 heads / 16, 8 KV heads replicated x2
    ("qwen3-30b-a3b", {"tp": 4, "ep": 4}, None),  # 128 experts over 4
    ("llama-3.1-8b", {"tp": 2, "ep": 2}, "ep"),   # dense: no experts
    ("llama-3.1-8b", {"pp": 33}, "pp"),
    ("mixtral-8x7b", {"tp": 16, "ep": 16}, "ep"),  # 8 experts do not split over 16
    ("gpt-oss-120b", {"tp": 1, "expert_weight_bytes": 4.25 / 8}, None),
    ("llama-3.1-8b", {"tp": 1, "expert_weight_bytes": 4.25 / 8}, "expert_weight_bytes"),
])
def test_plans_checked_against_a_model(model, kwargs, field):
    spec = load_model(model)
    if field is None:
        assert ServingPlan(**kwargs).check(spec).tp == kwargs["tp"]
        return
    with pytest.raises(ConfigError) as err:
        ServingPlan(**kwargs).check(spec)
    assert err.value.field == field
