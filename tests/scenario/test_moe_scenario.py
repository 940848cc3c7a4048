"""A fine-grained mixture of experts as a scenario: the workload's MoE keys (top-k to E,
a sigmoid router, a routed scaling, a shared expert, no aux loss) and parallel.etp reach
the program; emulated with check it equals the reference, folded (etp 1) and split
(etp = tp); a folded ep that is not tp x a divisor of dp is named by key."""

import pytest

from vcluster.scenario import ScenarioError, run_scenario, scenario_from_dict

pytestmark = pytest.mark.timeout(300)

FINE = {"kind": "transformer", "arch": "llama", "hidden": 32, "layers": 2, "heads": 4,
        "kv_heads": 2, "ffn_hidden": 48, "seq": 8, "vocab": 32, "batch": 4, "experts": 8,
        "moe_top_k": 4, "moe_router": "sigmoid", "moe_routed_scaling": 2.5,
        "moe_shared_ffn_hidden": 16, "moe_aux_coef": 0.0}


@pytest.mark.parametrize("parallel, mesh", [
    ({"dp": 2, "tp": 2, "ep": 4, "etp": 1}, {"dp": 1, "ep": 2, "tp": 2}),
    ({"dp": 2, "tp": 2, "ep": 2}, {"dp": 1, "ep": 2, "tp": 2}),
], ids=["folded-etp1", "split-etp-tp"])
def test_fine_grained_moe_scenario_equals_the_reference(parallel, mesh):
    doc = {"workload": FINE,
           "parallel": {**parallel, "sequence_parallel": True, "micro_batch": 1},
           "run": {"mode": "emulate", "steps": 2, "check": True, "warmup": 0}}
    scenario = scenario_from_dict(doc)
    assert {a: n for a, n in scenario.mesh.shape.items() if a != "pp"} == mesh
    s = run_scenario(scenario).summary
    assert s["checks_passed"] is True
    assert "experts=8 top-4" in s["workload"]


def test_a_folded_ep_must_be_whole_tp_groups():
    doc = {"workload": FINE, "parallel": {"dp": 2, "tp": 2, "ep": 3, "etp": 1,
                                          "sequence_parallel": True}}
    with pytest.raises(ScenarioError, match=r"parallel.ep = 3.*parallel.tp=2 x a divisor"):
        scenario_from_dict(doc)
