"""`vcluster simulate gpt --zero 0|1|2|3` and the planner searching the ZeRO stage."""

import json

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.cli.main import main
from vcluster.planner.search import plan_gpt
from vcluster.planner.simulation import gpt_step_traces
from vcluster.runtime.tracing.ops import TraceCollective, TraceWait
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

# Many layers and a small vocabulary: the largest module ZeRO-2/3 hold whole (one layer)
# is small beside a dp shard of the whole model, so the division by dp shows.
H, L, A, S, V, DP = 1024, 48, 16, 512, 1024, 4
MODEL = ["--hidden", str(H), "--layers", str(L), "--heads", str(A), "--seq", str(S),
         "--vocab", str(V)]


def _simulate(tmp_path, *flags, name="sim"):
    path = tmp_path / f"{name}.json"
    rc = main(["simulate", "gpt", *MODEL, "--dp", str(DP), "--global-batch", "8",
               "--hardware", "h100-dgx", "--json", str(path), *flags])
    assert rc == 0
    return json.loads(path.read_text())


def test_simulate_zero_stages_shrink_the_peak_and_zero3_divides_by_dp(tmp_path, capsys):
    docs = {z: _simulate(tmp_path, "--zero", str(z), name=f"z{z}") for z in (0, 1, 2, 3)}
    out = capsys.readouterr().out
    assert "ZeRO stage 3" in out and "ZeRO-3" in out
    assert [docs[z]["zero_stage"] for z in range(4)] == [0, 1, 2, 3]
    peaks = [docs[z]["peak_memory_gb"] for z in (0, 1, 2, 3)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks
    m0, m3 = docs[0]["memory"][0], docs[3]["memory"][0]
    layer = 12 * H * H + 13 * H            # the largest module here: one layer (tp = 1)
    params = m0["params_bytes"] / 2        # 2 bytes per weight without ZeRO
    assert layer > V * H + S * H           # larger than the embedding
    # ZeRO-3: every part is the DDP part over dp, plus the modules held whole — two layers'
    # weights (the one computing, the prefetched next) and one layer's gradients (between
    # its accumulation and its reduce-scatter); the optimizer state exactly over dp.
    assert m3["optimizer_bytes"] == pytest.approx(m0["optimizer_bytes"] / DP, abs=2)
    assert m3["params_bytes"] == pytest.approx(m0["params_bytes"] / DP + 2 * 2 * layer, abs=2)
    assert m3["grads_bytes"] == pytest.approx(m0["grads_bytes"] / DP + 4 * layer, abs=2)
    # the tolerance, relative to the shard: 2·layer·dp / P for the weights, half that for
    # the gradients — 17% and 8% for this model (48 layers over dp = 4)
    tol = 2 * layer * DP / params
    assert tol < 0.2
    assert m3["params_bytes"] <= m0["params_bytes"] / DP * (1 + tol) + 2
    assert m3["grads_bytes"] <= m0["grads_bytes"] / DP * (1 + tol / 2) + 2
    # ZeRO-3 really moves more: the replay prices its all-gathers
    assert docs[3]["comm_s"] > docs[2]["comm_s"] > docs[1]["comm_s"]


def test_distributed_optimizer_is_zero_1(tmp_path):
    assert _simulate(tmp_path, "--distributed-optimizer")["zero_stage"] == 1
    assert _simulate(tmp_path, "--distributed-optimizer", "--zero", "1",
                     name="both")["zero_stage"] == 1


@pytest.mark.parametrize("flags,words", [
    (["--zero", "2", "--distributed-optimizer"], "--distributed-optimizer"),
    (["--zero", "2", "--pp", "2"], "pp=2"),
])
def test_simulate_refuses_unsupported_zero(flags, words, capsys):
    rc = main(["simulate", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4", "--seq",
               "16", "--vocab", "64", "--global-batch", "4", *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert words in err and "--zero" in err


@pytest.mark.parametrize("zero", [2, 3])
def test_stitched_zero_step_has_every_microbatch_collective(zero):
    """The planner's fast path traces two micro-batches and stitches m: ZeRO-2/3 issue a
    reduce-scatter per module per micro-batch (ZeRO-3 also all-gathers), every one with a
    handle of its own, each waited for once."""
    cfg = GPTConfig(hidden=64, layers=4, heads=4, seq=16, vocab=64)
    costs = HardwareCostModel(load_hardware("h100-dgx"))

    def counts(m):
        par = ParallelConfig(global_batch=2 * m, dp=2, zero_stage=zero)
        (trace,) = gpt_step_traces(cfg, par, costs)
        issued = [op.handle for op in trace.ops
                  if isinstance(op, TraceCollective) and op.handle is not None]
        waited = [op.handle for op in trace.ops if isinstance(op, TraceWait)]
        assert len(set(issued)) == len(issued) and sorted(waited) == sorted(issued)
        return {c: sum(1 for op in trace.ops if isinstance(op, TraceCollective)
                       and op.collective == c) for c in ("reduce_scatter", "all_gather")}

    one, many = counts(1), counts(5)
    assert one["reduce_scatter"] > 0
    assert many["reduce_scatter"] == 5 * one["reduce_scatter"]
    if zero == 3:     # per micro-batch: each module gathered for its forward and backward
        assert many["all_gather"] == 5 * one["all_gather"]


def test_plan_7b_on_8_h100_needs_zero_without_tp_or_pp():
    """A 7B model on one 8-GPU H100 node: plain DDP (18 bytes a parameter, 121 GB) does not
    fit an 80 GB GPU, so every tp = pp = 1 candidate shards, the best one included."""
    kwargs = dict(hidden=4096, layers=32, heads=32, seq=2048, vocab=32000, gpus=8,
                  global_batch=64, hardware="h100-dgx", max_tp=2, micro_batches=(1, 2),
                  recompute=("selective", "full"), schedules=("1f1b",), sequence_parallel=(False,),
                  replay=2, workers=1, progress=False)
    df = plan_gpt(**kwargs)
    assert "zero_stage" in df.columns
    assert set(df["zero_stage"]) <= {0, 1, 2, 3}
    assert (df["distributed_optimizer"] == (df["zero_stage"] >= 1)).all()
    assert (df[df["zero_stage"] >= 2]["pp"] == 1).all()
    pure = df[(df["tp"] == 1) & (df["pp"] == 1)]
    assert len(pure) and (pure["zero_stage"] >= 1).all()
    assert pure.iloc[0]["zero_stage"] >= 1
    ddp = plan_gpt(**kwargs | dict(zero_stages=(0,), replay=0))
    assert not len(ddp[(ddp["tp"] == 1) & (ddp["pp"] == 1)])
    assert (ddp["zero_stage"] == 0).all()


def test_plan_cli_lists_the_zero_stage(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc = main(["plan", "gpt", "--hidden", "256", "--layers", "4", "--heads", "4", "--seq",
               "128", "--vocab", "512", "--gpus", "4", "--global-batch", "8", "--quiet",
               "--replay", "1", "--workers", "1", "--zero-stages", "0,3", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert " zero " in out.splitlines()[1]
    doc = json.loads(path.read_text())
    assert doc["candidates"] and all("zero_stage" in c for c in doc["candidates"])
    assert {c["zero_stage"] for c in doc["candidates"]} <= {0, 3}


def test_plan_zero_stage_arguments_are_checked(capsys):
    with pytest.raises(ValueError, match="zero_stages"):
        plan_gpt(hidden=64, layers=2, heads=4, seq=16, vocab=64, gpus=2, global_batch=4,
                 zero_stages=(4,), replay=0, progress=False)
    with pytest.raises(ValueError, match="not both"):
        plan_gpt(hidden=64, layers=2, heads=4, seq=16, vocab=64, gpus=2, global_batch=4,
                 zero_stages=(1,), distributed_optimizer=True, replay=0, progress=False)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4", "--seq",
              "16", "--vocab", "64", "--gpus", "2", "--global-batch", "4",
              "--zero-stages", "1,5"])
    assert exit_.value.code == 2
    assert "--zero-stages" in capsys.readouterr().err


def test_fsdp_with_tensor_and_sequence_parallelism(tmp_path):
    """ZeRO-3 beside tp 2 with sequence parallelism (FSDP2 + TP + SP, torchtitan's 2D) is
    simulated, not refused: its parameters and optimizer state are sharded over dp on top
    of tp (the peak under ZeRO-1's with the same tp), and ZeRO-3 moves more data-parallel
    bytes than ZeRO-1 (the weights gathered for the forward and again for the backward)."""
    flags = ("--tp", "2", "--sequence-parallel")
    z1, z3 = (_simulate(tmp_path, "--zero", z, *flags, name=f"sp{z}") for z in ("1", "3"))
    assert (z1["zero_stage"], z3["zero_stage"]) == (1, 3)
    assert z3["peak_memory_gb"] < z1["peak_memory_gb"]
    dp_comm = {z: sum(o["comm_s"] for o in doc["ops"] if o["op"].endswith("(dp)"))
               for z, doc in ((1, z1), (3, z3))}
    assert dp_comm[3] > dp_comm[1] > 0
