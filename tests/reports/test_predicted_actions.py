"""Predicted timelines show each pipeline action over the work it holds (issue 31, item 6).

The executor wraps every schedule action in ``dev.compute("0F1")`` around its matmuls; the
tracer records the block after its contents with ``contains`` = how many ops it holds, and
``reports.spans_from_simulation`` draws the action from its first op's start to its end.
Before, a predicted ``F`` was a zero-length span after its matmuls.
"""

from pathlib import Path

import pytest

from mesh import Mesh
from reports.chrome_trace import chrome_trace
from reports.frames import union_length_s
from vcluster.runtime.tracing import TraceCollective, TraceCompute, trace_program
from vcluster.scenario import load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[2]
ACTIONS = ("F", "B", "I", "W")


def _nested(dev):
    with dev.compute("outer"):
        with dev.compute("inner", flops=10):
            pass
        dev.all_reduce(dev.empty((4,)), "x")
        with dev.compute("inner2", flops=20):
            pass
    with dev.compute("alone", flops=5):
        pass


def test_reports_know_the_tracers_host_op_name():
    from reports.frames import HOST_OP as reports_host_op
    from vcluster.runtime.tracing.host import HOST_OP
    assert reports_host_op == HOST_OP


def test_tracer_counts_the_ops_a_block_holds():
    (trace, _) = trace_program(Mesh((2,), ("x",)), _nested, [()] * 2)
    names = [getattr(op, "name", None) or op.collective for op in trace.ops]
    assert names == ["inner", "all_reduce", "inner2", "outer", "alone"]
    contains = [op.contains for op in trace.ops if isinstance(op, TraceCompute)]
    assert contains == [0, 0, 3, 0]
    assert isinstance(trace.ops[1], TraceCollective)


def _check_actions(spans):
    """Every predicted action has a length and is covered by the work it encloses
    (compute, and the blocking collectives of tensor parallelism inside it)."""
    predicted = spans[spans["source"] == "predicted"]
    actions = predicted[(predicted["stream"] == "compute") & predicted["name"].isin(ACTIONS)]
    work = predicted[~((predicted["stream"] == "compute") & predicted["name"].isin(ACTIONS))]
    assert len(actions) > 0
    assert (actions["end_s"] > actions["start_s"]).all()
    for row in actions.itertuples():
        mine = work[(work["rank"] == row.rank) & (work["start_s"] >= row.start_s - 1e-12)
                    & (work["end_s"] <= row.end_s + 1e-12) & (work["stream"] != "wait")]
        assert (mine["stream"] == "compute").any()
        assert mine["start_s"].min() == pytest.approx(row.start_s, abs=1e-15)
        covered = union_length_s(zip(mine["start_s"], mine["end_s"]))
        assert covered == pytest.approx(row.end_s - row.start_s, rel=1e-9, abs=1e-15)
    return actions


def test_predicted_mlp_actions_span_their_matmuls():
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml",
                             ["run.mode=simulate", "run.steps=1"])
    record = run_scenario(scenario, progress=False)
    actions = _check_actions(record.spans)
    per_rank = actions.groupby("rank")["name"].value_counts().unstack()
    assert (per_rank["F"] == 8).all() and (per_rank["B"] == 8).all()   # 8 micro-batches


def test_predicted_gpt_actions_from_the_planner_traces():
    """A transformer simulated at scale replays the planner's stitched traces; they keep
    the action markers for the report."""
    scenario = load_scenario(ROOT / "scenarios" / "transformer_simulate.yaml",
                             ["sweep={hardware.name: [h100-dgx]}"])
    record = run_scenario(scenario, progress=False)
    actions = _check_actions(record.spans)
    assert set(actions["name"]) == {"F", "B"}
    chrome = chrome_trace(record)
    durations = [e["dur"] for e in chrome["traceEvents"]
                 if e.get("ph") == "X" and e.get("name") == "F"]
    assert durations and min(durations) > 0
