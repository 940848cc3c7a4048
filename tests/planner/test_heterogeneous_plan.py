"""Uneven pipeline stages of any split (``ParallelConfig.layers_per_stage``) and the
planner on a heterogeneous cluster (issue 55): the rulebook, emulated training against
the numpy reference, a stitched step from a few traced positions against the whole
pipeline traced, the greedy balance against brute force, and the planner moving layers
to the faster GPU kind — the balanced split simulating faster than the even one."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import yaml

from modeling import ConfigError
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.cli.main import main
from vcluster.planner.candidates import balance_layers, stage_kinds
from vcluster.planner.search import plan_gpt
from vcluster.planner.simulation import gpt_step_traces, simulate_gpt
from vcluster.timing import load_hardware
from vcluster.timing.cluster import load_cluster
from vcluster.timing.engine import simulate_trace
from vcluster.timing.hardware_model import HardwareCostModel

from tests.pipeline_parallel.gpt_data import token_data

A100, H100 = "a100-80gb-dgx", "h100-dgx"
MIXED = {"name": "mixed", "parts": [{"hardware": A100, "nodes": 1},
                                    {"hardware": H100, "nodes": 1}]}
RTOL, ATOL = 1e-9, 1e-12


# --- the plan's rule ----------------------------------------------------------------------
def test_layers_per_stage_is_one_count_per_stage():
    par = ParallelConfig(global_batch=4, pp=3, layers_per_stage=[2, 5, 1])
    assert par.layers_per_stage == (2, 5, 1) and par.stage_layers(8) == (2, 5, 1)
    assert [par.rank_layers(8, r) for r in range(3)] == [2, 5, 1]
    cases = [
        (dict(pp=2, layers_per_stage=(3,)), r"layers_per_stage=\(3,\): 1 counts for 2 "
                                            r"pipeline stages; allowed: 2 counts \(pp=2\)"),
        (dict(pp=2, layers_per_stage=(0, 4)), r"0 is not a layer count >= 1"),
        (dict(pp=2, layers_per_stage=(1, 3), last_stage_layers=3),
         r"give one of them; allowed: none with first_stage_layers or last_stage_layers"),
        (dict(pp=2, schedule="interleaved_1f1b", layers_per_stage=(1, 3)),
         r"allowed: none with 2 stages per rank \(interleaved_1f1b\)"),
        (dict(pp=2, layers_per_stage="13"), r"not a list of counts"),
    ]
    for kw, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            ParallelConfig(global_batch=4, **kw)
        assert err.value.field == "layers_per_stage"
    with pytest.raises(ConfigError, match=r"the counts add up to 8 layers, the model has 9"):
        par.stage_layers(9)


def _llama(**kw):
    return GPTConfig(**{**dict(hidden=16, layers=4, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24), **kw})


@pytest.mark.parametrize("schedule, dp", [("1f1b", 1), ("gpipe", 2)])
def test_layers_per_stage_trains_as_the_reference(cluster_of, schedule, dp):
    """pp 2 with 1 and 3 layers (the split a slow and a fast GPU kind balance): the
    emulated step's losses and gradients equal the single-device reference's."""
    cfg = _llama()
    par = ParallelConfig(global_batch=2 * dp, micro_batch=1, dp=dp, pp=2, schedule=schedule,
                         layers_per_stage=(1, 3))
    job = GPT(cfg).train_job(par.mesh(), par)
    assert tuple(len(s) for s in job.specs) == (1, 3)
    model, (tokens, targets) = GPT(cfg, seed=5), token_data(cfg, par.global_batch, 1)
    ref = model.fit_reference(tokens, targets, 2, lr=0.1, parallel=par)
    run = model.fit(cluster_of(par.mesh()), tokens, targets, 2, parallel=par, lr=0.1)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
    for n in ref.params:
        np.testing.assert_allclose(run.grads[n], ref.grads[n], rtol=RTOL, atol=ATOL,
                                   err_msg=n)


def test_a_few_traced_positions_stand_for_every_stage_of_an_uneven_split():
    """pp 6 with middle stages of two layer counts: the first, one middle position per
    count and the last are traced, and the stitched step equals all six traced."""
    cfg = GPTConfig(hidden=64, layers=14, heads=4, seq=32, vocab=128)
    par = ParallelConfig(global_batch=12, micro_batch=1, dp=2, pp=6, tp=2,
                         layers_per_stage=(1, 2, 4, 2, 4, 1))
    costs = HardwareCostModel(load_hardware(H100))
    fast = gpt_step_traces(cfg, par, costs)
    full = gpt_step_traces(cfg, par, costs, traced_positions=None)
    assert all(a.ops == b.ops for a, b in zip(fast, full))
    mesh = par.mesh()
    assert simulate_trace(fast, costs, mesh=mesh, symmetric=True).step_time_s == \
        simulate_trace(full, costs, mesh=mesh, symmetric=True).step_time_s


# --- the balance --------------------------------------------------------------------------
@pytest.mark.parametrize("layers, t, c", [(7, (3.0, 1.0), (0.5, 0.0)),
                                          (10, (2.0, 1.0, 1.0), (1.0, 0.0, 2.5)),
                                          (9, (1.0, 1.0, 3.0, 1.5), (0.0, 0.0, 0.0, 4.0)),
                                          (5, (1.0, 1.0), (0.0, 0.0))])
def test_balance_layers_minimises_the_slowest_stage(layers, t, c):
    split = balance_layers(layers, t, c)
    assert sum(split) == layers and min(split) >= 1

    def slowest(n):
        return max(k * ts + cs for k, ts, cs in zip(n, t, c))
    best = min(slowest(n) for n in itertools.product(range(1, layers + 1), repeat=len(t))
               if sum(n) == layers)
    assert slowest(split) == best
    with pytest.raises(ValueError, match="do not give each of 2 stages one"):
        balance_layers(1, (1.0, 1.0))


def test_stage_kinds_follow_the_pipeline_major_placement():
    c = load_cluster({"name": "c", "parts": [{"hardware": A100, "nodes": 2},
                                             {"hardware": H100, "nodes": 2}]})
    assert stage_kinds(c, 2) == (0, 1) and stage_kinds(c, 4) == (0, 0, 1, 1)
    assert stage_kinds(c, 1) is None and stage_kinds(c, 3) is None


# --- the planner --------------------------------------------------------------------------
CFG = GPTConfig(hidden=2048, layers=16, heads=16, seq=2048, vocab=32000)


def test_the_planner_moves_layers_to_the_faster_kind():
    """An A100 node and an H100 node, pp 2 (tp 1, dp 8): the H100 stage gets more layers
    than the A100 stage, and the simulated step with the balanced split is faster than
    with the even split."""
    df = plan_gpt(config=CFG, gpus=16, global_batch=32, hardware=MIXED, replay=1, workers=1,
                  progress=False, schedules=("1f1b",), recompute=("none",),
                  sequence_parallel=(False,), micro_batches=(1,), max_tp=1)
    assert set(df["pp"]) >= {2} and df.attrs["hardware"] == "mixed"
    assert df.attrs["cluster_parts"] == [
        {"hardware": A100, "device": "A100-SXM4-80GB", "nodes": 1, "gpus": 8},
        {"hardware": H100, "device": "H100-SXM5-80GB", "nodes": 1, "gpus": 8}]
    # pp 1: each stage on both kinds, so each (one-GPU) data-parallel replica on one kind
    assert set(df.loc[df["pp"] == 1, "cluster_split"]) == {"replicas"}
    assert set(df.loc[df["pp"] == 2, "cluster_split"]) == {"stages"}
    row = df[df["pp"] == 2].iloc[0]
    a100_layers, h100_layers = row["layers_per_stage"]
    assert h100_layers > a100_layers and a100_layers + h100_layers == 16
    even = ParallelConfig(global_batch=32, micro_batch=1, dp=8, pp=2, tp=1)
    balanced = ParallelConfig(global_batch=32, micro_batch=1, dp=8, pp=2, tp=1,
                              layers_per_stage=(a100_layers, h100_layers))
    t_even = simulate_gpt(CFG, even, MIXED).step_time_s
    t_balanced = simulate_gpt(CFG, balanced, MIXED).step_time_s
    assert t_balanced < 0.9 * t_even


def test_the_planner_splits_by_replicas_where_stages_would_straddle_kinds():
    """The same cluster and model, tp up to 8: searched by replicas only, every candidate
    keeps each data-parallel replica on one kind and the replayed best equals
    ``simulate_gpt(..., cluster_split="replicas")`` of its knobs; searched by stages only,
    the pp 1 candidates are rejected as before; a bad split value is refused."""
    kw = dict(config=CFG, gpus=16, global_batch=32, hardware=MIXED, replay=1, workers=1,
              progress=False, schedules=("1f1b",), recompute=("none",),
              micro_batches=(1,), max_tp=8)
    df = plan_gpt(**kw, cluster_splits=("replicas",))
    assert len(df) and set(df["cluster_split"]) == {"replicas"}
    best = df.iloc[0]
    assert best["replayed"]
    par = ParallelConfig(global_batch=32, micro_batch=1, dp=int(best["dp"]),
                         pp=int(best["pp"]), tp=int(best["tp"]),
                         sequence_parallel=bool(best["sequence_parallel"]),
                         zero_stage=int(best["zero_stage"]))
    assert best["step_time_s"] == pytest.approx(
        simulate_gpt(CFG, par, MIXED, cluster_split="replicas").step_time_s, rel=1e-12)
    stages = plan_gpt(**kw, cluster_splits=("stages",))
    assert set(stages["cluster_split"]) == {"stages"} and set(stages["pp"]) >= {2}
    assert stages.attrs["rejected"]["stage_spans_gpu_kinds"] >= 1     # pp 1: both kinds
    with pytest.raises(ValueError, match=r"cluster_splits=\('pipes',\); allowed: a non-empty "
                                         r"subset of \('stages', 'replicas'\)"):
        plan_gpt(**kw, cluster_splits=("pipes",))


def test_the_cli_names_the_cluster_and_its_parts(tmp_path, capsys):
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(MIXED))
    shape = ["--hidden", "512", "--layers", "8", "--heads", "8", "--seq", "512",
             "--vocab", "4096", "--global-batch", "16"]
    out = tmp_path / "sim.json"
    assert main(["simulate", "train", *shape, "--tp", "4", "--pp", "2", "--dp", "2",
                 "--hardware", str(path), "--layers-per-stage", "3,5",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "on 16 x mixed:" in printed
    assert "part 0: 1 x a100-80gb-dgx (A100-SXM4-80GB), GPUs 0-7: stage 0 with 3 layers" \
        in printed
    assert "part 1: 1 x h100-dgx (H100-SXM5-80GB), GPUs 8-15: stage 1 with 5 layers" \
        in printed
    stages = json.loads(out.read_text())["stages"]
    assert [(s["hardware"], s["layers"]) for s in stages] == [(A100, 3), (H100, 5)]
    plan = tmp_path / "plan.json"
    assert main(["plan", "train", *shape, "--gpus", "16", "--hardware", str(path),
                 "--replay", "1", "--workers", "1", "--quiet", "--top", "3",
                 "--cluster-split", "stages", "--json", str(plan)]) == 0
    printed = capsys.readouterr().out
    assert "on 16 x mixed:" in printed and "layers per stage" in printed
    assert "cluster mixed: 16 GPUs of 2 kinds" in printed
    assert "part 1: 1 x h100-dgx (H100-SXM5-80GB), GPUs 8-15: stage" in printed
    result = json.loads(plan.read_text())
    assert result["cluster_parts"][1]["hardware"] == H100
    assert "layers_per_stage" in result["candidates"][0]
    assert {c["cluster_split"] for c in result["candidates"]} == {"stages"}
    assert main(["plan", "train", *shape, "--gpus", "16", "--hardware", str(path),
                 "--replay", "1", "--workers", "1", "--quiet", "--top", "3",
                 "--cluster-split", "replicas", "--json", str(plan)]) == 0
    printed = capsys.readouterr().out
    assert "the best configuration's data-parallel replicas" in printed
    assert "replicas on kinds" in printed
    best = json.loads(plan.read_text())["candidates"][0]
    assert best["cluster_split"] == "replicas"
    half = best["dp"] // 2          # the dp axis's replicas: half on each kind (no experts)
    assert (f"a100-80gb-dgx: replicas 0-{half - 1}" if half > 1
            else "a100-80gb-dgx: replica 0") in printed
    assert (f"h100-dgx: replicas {half}-{2 * half - 1}" if half > 1
            else "h100-dgx: replica 1") in printed
