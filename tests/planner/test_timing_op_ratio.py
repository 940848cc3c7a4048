"""T_compute / T_comm per op: the attribution rule on a hand-computed trace, the GPT's
per-op figures against closed-form counts of its collectives, and the command line."""

import json
import math
import os
import subprocess
import sys

import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.planner.simulation import (ADAM, OP_KINDS, gpt_op_kind, gpt_step_traces,
                                              simulate_gpt)
from vcluster.runtime.tracing import trace_program
from vcluster.runtime.tracing.ops import (DeviceTrace, TraceCollective, TraceCompute, TraceRecv,
                                          TraceSend, TraceWait)
from vcluster.timing import load_hardware
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import HardwareCostModel

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 1 FLOP/s, 1 byte/s links, no latency: a compute op of f FLOPs takes f s; an all_reduce
# of n bytes over 2 ranks 2(p-1)/p n = n s; a transfer of n bytes n s.
UNIT = SimpleCostModel(1.0, math.inf, 0.0, 1.0)


def _kind(name):
    return None if name == "residual" else name.split(":")[0]


def _by_op(result):
    return {o.op: (o.compute_s, o.comm_s) for o in result.op_stats}


def test_hand_computed_attribution():
    """rank 0: attention 4 s, all_reduce 2 s, residual 1 s (inherits attention), mlp 6 s,
    send 3 s, async all_reduce 1 s; rank 1: embedding 2 s, all_reduce 2 s, receive 3 s
    (charged to the op after it: logits), logits 5 s, async all_reduce 1 s."""
    ar = lambda n, h=None: TraceCollective("all_reduce", (0, 1), n, 1, "ring", 0, h)  # noqa
    r0 = DeviceTrace(0, (TraceCompute("attention: qkv", 4, 0), ar(2),
                         TraceCompute("residual", 1, 0), TraceCompute("mlp: fc", 6, 0),
                         TraceSend(1, 3, 7), ar(1, 0), TraceWait(0)))
    r1 = DeviceTrace(1, (TraceCompute("embedding", 2, 0), ar(2), TraceRecv(0, 3, 7),
                         TraceCompute("logits", 5, 0), ar(1, 0), TraceWait(0)))
    res = simulate_trace([r0, r1], UNIT, op_kind=_kind, timeline=False)
    assert _by_op(res) == {"attention": (5.0, 2.0), "mlp": (6.0, 4.0),
                           "embedding": (2.0, 2.0), "logits": (5.0, 4.0)}
    ratios = {o.op: o.compute_comm_ratio for o in res.op_stats}
    assert ratios == {"attention": 2.5, "mlp": 1.5, "embedding": 1.0, "logits": 1.25}
    assert [o.op for o in res.op_stats] == ["mlp", "logits", "attention", "embedding"]
    assert sum(o.compute_s for o in res.op_stats) == sum(res.compute_s.values()) == 18.0
    assert sum(o.comm_s for o in res.op_stats) == sum(res.comm_s.values()) == 12.0


def test_communication_before_any_compute_and_receives_at_the_end():
    """A collective before the first compute op is "other"; a receive with no compute op
    after it goes to the last compute op's kind; without op_kind there are no op stats."""
    ar = TraceCollective("all_reduce", (0, 1), 4, 1, "ring")
    r0 = DeviceTrace(0, (ar, TraceCompute("mlp", 2, 0), TraceSend(1, 5, 0)))
    r1 = DeviceTrace(1, (ar, TraceCompute("attention", 1, 0), TraceRecv(0, 5, 0)))
    res = simulate_trace([r0, r1], UNIT, op_kind=_kind)
    assert _by_op(res) == {"other": (0.0, 8.0), "mlp": (2.0, 5.0), "attention": (1.0, 5.0)}
    assert simulate_trace([r0, r1], UNIT).op_stats == ()
    with pytest.raises(TypeError, match="op_kind must be a function"):
        simulate_trace([r0, r1], UNIT, op_kind="mlp")
    with pytest.raises(ValueError, match="not available with a core_pool"):
        simulate_trace([r0, r1], UNIT, op_kind=_kind, core_pool=2)


def test_gpt_op_kinds_name_every_compute_op():
    cfg = GPTConfig(hidden=32, layers=2, heads=2, seq=8, vocab=32, dtype="float16")
    names = set()
    for recompute in ("none", "selective", "full"):
        for sp in (False, True):
            par = ParallelConfig(global_batch=4, dp=2, pp=2, tp=2, schedule="zero_bubble",
                                 recompute=recompute, sequence_parallel=sp)
            mesh = par.mesh()
            for t in trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par),
                                   ranks=list(mesh.group("pp", 0))):
                names |= {op.name for op in t.ops if isinstance(op, TraceCompute)
                          and op.name.startswith(("gpt:", "optimizer"))}
    kinds = {n: gpt_op_kind(n) for n in names}
    assert {k for k in kinds.values()} == set(OP_KINDS) | {None}
    assert [n for n, k in kinds.items() if k is None] == ["gpt: residual"]
    assert gpt_op_kind("gpt: something else") == "other"
    assert gpt_op_kind("0F3") is gpt_op_kind("compute") is None       # markers, merged runs


def test_gpt_per_op_comm_follows_the_collective_counts():
    """tp 2 only, no recomputation: per micro-batch, attention and the MLP each close with
    one all_reduce of the activations (b·s·h 16-bit values) forward and one backward per
    layer, the embedding with one forward; the vocabulary-parallel head one backward (its
    input gradient) and its cross-entropy two small ones (row max: b·s values; sum exp and
    target logit: 2·b·s)."""
    h, layers, s, b, m = 256, 3, 64, 2, 4
    cfg = GPTConfig(hidden=h, layers=layers, heads=4, seq=s, vocab=512)
    par = ParallelConfig(global_batch=b * m, micro_batch=b, tp=2)
    hw = load_hardware("h100-dgx")
    costs = HardwareCostModel(hw)
    r = simulate_gpt(cfg, par, hw)

    def ar(values):
        return costs.collective_time_s(TraceCollective("all_reduce", (0, 1), 2 * values, 2,
                                                       "auto"), 1)
    ops = {o.op: o for o in r.ops}
    assert ops["attention"].comm_s == pytest.approx(m * layers * 2 * ar(b * s * h), rel=1e-12)
    assert ops["mlp"].comm_s == pytest.approx(m * layers * 2 * ar(b * s * h), rel=1e-12)
    assert ops["embedding"].comm_s == pytest.approx(m * ar(b * s * h), rel=1e-12)
    assert ops["logits"].comm_s == pytest.approx(
        m * (ar(b * s * h) + ar(b * s) + ar(2 * b * s)), rel=1e-12)
    assert ops["optimizer"].comm_s == 0.0
    assert sum(o.compute_s for o in r.ops) == pytest.approx(r.compute_s, rel=1e-12)
    assert sum(o.comm_s for o in r.ops) == pytest.approx(r.comm_s, rel=1e-12)
    assert all(o.compute_comm_ratio == o.compute_s / o.comm_s for o in r.ops if o.comm_s)


@pytest.mark.parametrize("schedule, v, sp, recompute", [("1f1b", None, False, "full"),
                                                        ("interleaved_1f1b", 2, True, "none")])
def test_coalesced_stitched_step_keeps_the_per_op_split(schedule, v, sp, recompute):
    """The simulator's traces (stitched, compute runs merged per kind) give the same
    per-op figures as the training step traced in full, op by op."""
    cfg = GPTConfig(hidden=64, layers=8, heads=4, seq=32, vocab=128, dtype="float16")
    par = ParallelConfig(global_batch=16, micro_batch=2, dp=2, pp=4, tp=2, schedule=schedule,
                         virtual_stages=v, sequence_parallel=sp, recompute=recompute)
    mesh, costs = par.mesh(), HardwareCostModel(load_hardware("a100-80gb-dgx"))
    raw = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par, optimizer=ADAM),
                        ranks=list(mesh.group("pp", 0)))
    kw = dict(mesh=mesh, symmetric=True, timeline=False, op_kind=gpt_op_kind)
    full = _by_op(simulate_trace(raw, costs, **kw))
    # the traced program's own optimizer bytes, as the full trace has them
    fast = _by_op(simulate_trace(gpt_step_traces(cfg, par, costs, optimizer_step_bytes=None),
                                 costs, **kw))
    assert set(full) == set(fast) == set(OP_KINDS)
    for op in full:
        assert fast[op] == pytest.approx(full[op], rel=1e-9, abs=1e-15), op


def test_simulate_cli_prints_and_writes_the_per_op_table(tmp_path):
    out = tmp_path / "gpt.json"
    done = subprocess.run(
        [sys.executable, "-m", "vcluster", "simulate", "gpt", "--hidden", "1024", "--layers",
         "4", "--heads", "16", "--seq", "512", "--vocab", "8192", "--tp", "8", "--pp", "2",
         "--global-batch", "8", "--json", str(out)], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    rows = {row["op"]: row for row in data["ops"]}
    assert set(rows) == set(OP_KINDS)
    assert rows["optimizer"]["compute_comm_ratio"] is None          # no communication
    for row in rows.values():
        assert set(row) == {"op", "compute_s", "comm_s", "compute_comm_ratio", "low_ratio"}
        if row["comm_s"]:
            assert row["compute_comm_ratio"] == pytest.approx(row["compute_s"] / row["comm_s"])
            assert row["low_ratio"] == (row["compute_comm_ratio"] < 10)
    table = done.stdout[done.stdout.index("compute/comm"):]
    for op, row in rows.items():
        line = next(ln for ln in table.splitlines() if ln.split()[:1] == [op])
        assert line.endswith("below the rule (>= 10)") == row["low_ratio"], line
