"""Context parallelism in the simulator and the planner: the stitched traces (every cp
rank of each traced pipeline position, the K/V ring inside the actions) equal the
program traced in full; `vcluster simulate gpt --cp 2` halves the activation memory of
--cp 1, and its activations are what the program keeps; the GPU count is checked;
`plan gpt --max-cp` searches cp (default: none)."""

import dataclasses
import json

import pytest

from mesh import Mesh
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.llama import llama_param_shapes
from tensor_parallel.attention import TransformerOps
from tensor_parallel.context_parallel import ContextParallelAttention, sequence_positions
from tensor_parallel.llama import llama_piece, llama_stage
from vcluster.cli.main import main
from vcluster.planner.memory import (CP_RING_BUFFERS, LSE_BYTES, cp_buffer_bytes,
                                     llama_activation_bytes_per_layer, rank_memory)
from vcluster.planner.search import plan_gpt
from vcluster.planner.simulation import gpt_step_traces, simulate_gpt
from vcluster.runtime.tracing import (MetaArray, TraceCompute, TraceRecv, TraceSend,
                                      TraceWait, trace_program)
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

pytestmark = pytest.mark.timeout(300)


def _by_issue(ops) -> list:
    """``ops`` with each asynchronous op's handle renumbered by issue (0, 1, ...) and each
    wait pointed at the latest issue of its handle: the stitched step reuses a template's
    handle in every copy of it (issued and waited in the same action), the program traced
    in full numbers them all."""
    out, n, latest = [], 0, {}
    for o in ops:
        if isinstance(o, TraceWait):
            o = TraceWait(latest[o.handle])
        elif getattr(o, "handle", None) is not None:
            latest[o.handle] = n
            o, n = dataclasses.replace(o, handle=n), n + 1
        out.append(o)
    return out

COSTS = HardwareCostModel(load_hardware("h100-dgx"), "bf16")
LLAMA = dict(hidden=64, heads=4, seq=32, vocab=128, dtype="float16", arch="llama", kv_heads=2)


@pytest.mark.parametrize("arch, algorithm, pp, schedule", [
    ("gpt", "ring", 4, "1f1b"), ("llama", "all_gather", 4, "interleaved_1f1b")])
def test_stitched_cp_traces_equal_the_traced_step(arch, algorithm, pp, schedule):
    """Three traced positions of a short step stand for the 4 of a 8-micro-batch step:
    every communication op (pipeline messages, the ring's K/V, tp and dp x cp
    collectives), in order, and the FLOPs equal the whole program traced."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    cfg = GPTConfig(**{**LLAMA, "layers": pp * v, **(
        {"arch": "gpt", "kv_heads": None} if arch == "gpt" else {})})
    par = ParallelConfig(global_batch=16, micro_batch=1, dp=2, pp=pp, tp=2, cp=2,
                         cp_algorithm=algorithm, schedule=schedule)
    fast = gpt_step_traces(cfg, par, COSTS)
    mesh = par.mesh()
    assert [t.rank for t in fast] == [mesh.rank({"dp": 0, "pp": q, "cp": c, "tp": 0})
                                      for c in range(2) for q in range(pp)]
    direct = {t.rank: t for t in trace_program(mesh, train_program, GPT(cfg).meta_args(
        mesh, par), ranks=[t.rank for t in fast])}
    for t in fast:
        full = direct[t.rank]
        assert _by_issue([o for o in t.ops if not isinstance(o, TraceCompute)]) == \
            _by_issue([o for o in full.ops if not isinstance(o, TraceCompute)]), t.rank
        assert sum(o.flops for o in t.ops if isinstance(o, TraceCompute)) == pytest.approx(
            sum(o.flops for o in full.ops if isinstance(o, TraceCompute)), rel=1e-12)
    ring = [o for o in fast[0].ops if isinstance(o, (TraceSend, TraceRecv))
            and o.peer == mesh.rank({"dp": 0, "pp": 0, "cp": 1, "tp": 0})]
    assert bool(ring) == (algorithm == "ring")


def _simulate(tmp_path, capsys, *flags):
    path = tmp_path / f"sim{len(list(tmp_path.iterdir()))}.json"
    code = main(["simulate", "gpt", "--arch", "llama", "--hidden", "1024", "--layers", "8",
                 "--heads", "16", "--kv-heads", "4", "--seq", "8192", "--vocab", "32000",
                 "--tp", "2", "--pp", "2", "--global-batch", "8", "--hardware", "h100-dgx",
                 "--allow-oom", "--json", str(path), *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(path.read_text()), out


def test_simulate_cp2_halves_the_activation_memory(tmp_path, capsys):
    one, _ = _simulate(tmp_path, capsys)
    two, out = _simulate(tmp_path, capsys, "--cp", "2", "--gpus", "8")
    assert "cp=2 (ring)" in out and two["gpus"] == 2 * one["gpus"] == 8
    a1, a2 = (r["memory_breakdown_gb"]["activations"] for r in (one, two))
    assert a2 == pytest.approx(a1 / 2, rel=0.10)
    # closed form: exactly half, plus the ring's K/V buffers of one layer
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=8192, vocab=32000, arch="llama",
                    kv_heads=4)
    par = ParallelConfig(global_batch=8, tp=2, pp=2, cp=2)
    x = 2 * 1 * (4 // 2) * 64 * 8192 / 2
    assert cp_buffer_bytes(cfg, par) == CP_RING_BUFFERS * x
    assert cp_buffer_bytes(cfg, ParallelConfig(global_batch=8, tp=2, pp=2, cp=2,
                                               cp_algorithm="all_gather")) == 4 * 2 * x
    m1 = rank_memory(cfg, ParallelConfig(global_batch=8, tp=2, pp=2), 0, 2)
    m2 = rank_memory(cfg, par, 0, 2)
    assert m2.activations_bytes == m1.activations_bytes // 2 + CP_RING_BUFFERS * x
    assert m2.params_bytes == m1.params_bytes


def test_simulate_checks_the_gpu_count(capsys):
    code = main(["simulate", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4",
                 "--seq", "32", "--vocab", "128", "--tp", "2", "--cp", "2", "--dp", "2",
                 "--global-batch", "4", "--gpus", "16"])
    assert code == 2
    assert "--gpus 16 is not tp·pp·cp·dp = 2·1·2·2 = 8" in capsys.readouterr().err


def test_ring_transfers_overlap_the_attention():
    """The ring's K/V transfers hide behind the attention blocks: the replayed step's
    exposed communication is less than the ring's transfer time alone."""
    cfg = GPTConfig(hidden=1024, layers=2, heads=16, seq=8192, vocab=32000)
    par = ParallelConfig(global_batch=2, tp=1, cp=4)
    r = simulate_gpt(cfg, par, "h100-dgx")
    ring_s = sum(COSTS.p2p_time_s(o.peer, 0, o.nbytes) for t in gpt_step_traces(
        cfg, par, COSTS)[:1] for o in t.ops if isinstance(o, TraceSend))
    assert ring_s > 0 and r.exposed_comm_s < ring_s


def test_plan_searches_cp_only_when_asked():
    small = dict(hidden=256, layers=4, heads=8, seq=2048, vocab=1024, gpus=8, global_batch=8,
                 hardware="h100-dgx", top=3, replay=2, workers=1, progress=False,
                 schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,))
    default = plan_gpt(**small)
    assert set(default["cp"]) == {1}
    df = plan_gpt(**small, max_cp=4)
    assert set(df["cp"]) == {1, 2, 4}
    assert all(r.tp * r.pp * r.dp * r.cp == 8 for r in df.itertuples())
    assert len(df[df.cp == 1]) == len(default)
    with pytest.raises(ValueError, match="max_cp=2 needs attention='flash'"):
        plan_gpt(**small, max_cp=2, attention="unfused")
    odd = plan_gpt(**{**small, "seq": 2044, "replay": 0}, max_cp=4)
    assert odd.attrs["rejected"]["cp_not_dividing_seq"] > 0 and set(odd["cp"]) == {1, 2}


def test_plan_cli_table_and_json_carry_cp(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", "gpt", "--hidden", "256", "--layers", "4", "--heads", "8", "--seq",
            "2048", "--vocab", "1024", "--gpus", "4", "--global-batch", "4", "--hardware",
            "h100-dgx", "--top", "2", "--replay", "1", "--workers", "1", "--quiet"]
    assert main(argv + ["--json", str(path)]) == 0
    head = capsys.readouterr().out.splitlines()[1].split()
    assert head[:6] == ["#", "tp", "pp", "dp", "b", "m"]
    assert {c["cp"] for c in json.loads(path.read_text())["candidates"]} == {1}
    assert main(argv + ["--max-cp", "2", "--json", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:6] == ["#", "tp", "pp", "dp", "cp",
                                                                   "b"]
    assert {c["cp"] for c in json.loads(path.read_text())["candidates"]} == {1, 2}


def _layer_activations(dev, cfg, b, cp):
    """Declare the bytes one Llama layer with context parallelism keeps after one
    micro-batch's forward (this rank's s/cp rows)."""
    ops = TransformerOps(dev, "tp", False)
    t, shapes = ops.tp_size, llama_param_shapes(dataclasses.replace(cfg, layers=1))
    meta = {n.rsplit(".", 1)[-1]: llama_piece(n, MetaArray(s), t, ops.tp_rank, cfg.kv_heads)
            for n, s in shapes.items()}
    op = ContextParallelAttention(cfg.heads // t, cfg.head_dim, "ring",
                                  group=cfg.heads // t // max(cfg.kv_heads // t, 1))
    positions = sequence_positions(cfg.seq, cp, dev.mesh.group_position("cp", dev.rank))
    _, layer, _ = llama_stage(ops, lambda names, prefix="": {n: meta[n] for n in names}, [0],
                              True, True, cfg.heads, cfg.kv_heads, cfg.hidden, cfg.rope_theta,
                              "none", cfg.eps, 1, cfg.seq, op, positions).modules
    layer.forward(ops, 0, MetaArray((b, cfg.seq // cp, cfg.hidden)))
    with dev.compute("activations", flops=layer.activation_bytes):
        pass


@pytest.mark.parametrize("kv, tp, cp", [(2, 2, 2), (8, 1, 4), (1, 2, 2)])
def test_activation_memory_is_what_the_cp_layer_keeps(kv, tp, cp):
    """The program's float64 tensors kept for the backward, at 2 bytes an element, equal
    the flash formula at s/cp rows, but for the log-sum-exp (kept in the program's dtype,
    2 bytes here, where the formula counts fp32) and the two RMSNorms' 1/rms per row that
    the formula leaves out (2·2·s/cp·b bytes)."""
    cfg, b = GPTConfig(hidden=64, layers=4, heads=8, seq=16, vocab=96, arch="llama",
                       kv_heads=kv, ffn_hidden=80), 2
    mesh = Mesh((cp, tp), ("cp", "tp"))
    traces = trace_program(mesh, _layer_activations, [(cfg, b, cp)] * mesh.size,
                           ranks=list(mesh.group("cp", 0)))
    s_l = cfg.seq // cp
    for t in traces:
        kept = sum(o.flops for o in t.ops if isinstance(o, TraceCompute) and o.name ==
                   "activations")
        formula = llama_activation_bytes_per_layer(dataclasses.replace(cfg, seq=s_l), b, tp,
                                                   "none", False, "flash")
        lse = b * cfg.heads * s_l // tp
        assert kept / 4 == formula - LSE_BYTES * lse + 2 * lse + 2 * 2 * s_l * b
