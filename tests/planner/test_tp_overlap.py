"""Tensor parallelism's backward overlap (``ParallelConfig.tp_overlap``, docs/timing.md):
the input-gradient reductions of the column-parallel linears run during their weight
gradients in the simulated step, the planner's screen counts only what stays exposed, and
the command lines take ``--tp-overlap``. (The traced program: tests/pipeline_parallel/
test_gpt.py; its math equals the reference either way: the same file's training tests.)"""

import argparse
import json

import pytest

from pipeline_parallel.gpt import TP_OVERLAP, GPTConfig, ParallelConfig
from vcluster.cli.args import add_tp_overlap_argument
from vcluster.cli.main import main
from vcluster.planner.layer_cost import trace_stage_pieces
from vcluster.planner.search import plan_gpt
from vcluster.planner.simulation import simulate_gpt
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

pytestmark = pytest.mark.timeout(300)


def test_overlapping_the_input_gradient_reductions_hides_two_all_reduces_of_four():
    """Without sequence parallelism a layer's tensor parallelism all-reduces 4 times (2
    forward, 2 backward); Megatron's asynchronous reduction (``tp_overlap="backward"``)
    hides the backward's two — QKV's and the MLP's input gradients — behind their weight
    gradients, GEMMs longer than the all-reduce here. The emulated math is the same
    (tests/tensor_parallel)."""
    cfg = GPTConfig(hidden=6144, layers=4, heads=64, seq=2048, vocab=51200)
    sims = {o: simulate_gpt(cfg, ParallelConfig(global_batch=4, micro_batch=4, tp=8,
                                                attention="unfused", tp_overlap=o),
                            "a100-80gb-dgx") for o in ("none", "backward")}
    layer_comm = sum(o.comm_s for o in sims["none"].ops if o.op in ("attention", "mlp"))
    assert sims["none"].comm_s == pytest.approx(sims["backward"].comm_s)
    assert sims["none"].exposed_comm_s == pytest.approx(sims["none"].comm_s)
    hidden = sims["none"].exposed_comm_s - sims["backward"].exposed_comm_s
    assert hidden == pytest.approx(layer_comm / 2, rel=0.02)
    assert sims["none"].step_time_s - sims["backward"].step_time_s == pytest.approx(
        hidden, rel=0.02)


def test_the_screen_counts_only_the_exposed_part_of_an_overlapped_reduction():
    """The layer's input-gradient piece: its compute is the same either way, its
    communication is the blocking case's less the two reductions' hidden share (here all
    of them: the weight-gradient GEMMs are longer), and the other pieces are unchanged."""
    cfg = GPTConfig(hidden=6144, layers=4, heads=64, seq=2048, vocab=51200)
    costs = HardwareCostModel(load_hardware("a100-80gb-dgx"))
    pieces = {o: trace_stage_pieces(cfg, 8, 4, False, "none", costs, attention="unfused",
                                    async_grad_reduce=o) for o in (False, True)}
    I_ = {o: pieces[o][("layer", "I")] for o in pieces}
    W = {o: pieces[o][("layer", "W")] for o in pieces}
    assert I_[True].compute_s + W[True].compute_s == pytest.approx(
        I_[False].compute_s + W[False].compute_s)
    assert I_[True].flops + W[True].flops == I_[False].flops + W[False].flops
    assert I_[True].comm_s == pytest.approx(0.0, abs=1e-12)   # both reductions hidden
    assert I_[False].comm_s > 0 and pieces[True][("layer", "F")] == pieces[False][("layer", "F")]


def test_the_command_lines_take_tp_overlap(tmp_path, capsys):
    parser = argparse.ArgumentParser()          # what simulate gpt and plan gpt add
    add_tp_overlap_argument(parser)
    assert tuple(parser._option_string_actions["--tp-overlap"].choices) == TP_OVERLAP
    model = ["--hidden", "256", "--layers", "4", "--heads", "4", "--seq", "128", "--vocab",
             "512", "--global-batch", "8"]
    steps = {}
    for overlap in TP_OVERLAP:
        out = tmp_path / f"{overlap}.json"
        assert main(["simulate", "gpt", *model, "--tp", "4", "--tp-overlap", overlap,
                     "--sequence-parallel", "--json", str(out)]) == 0
        text = capsys.readouterr().out
        assert ("TP backward not overlapped" in text) == (overlap == "none")
        steps[overlap] = json.loads(out.read_text())["step_time_s"]
    # te's chunked GEMMs cost more calls than its rings save on so small a model (its gain
    # on a large one: tests/tensor_parallel/test_collective_matmul.py)
    assert steps["backward"] < steps["none"] and steps["te"] != steps["backward"]
    assert main(["simulate", "gpt", *model, "--tp", "4", "--tp-overlap", "te"]) == 2
    assert "tp_overlap='te' overlaps the sequence-parallel all-gathers" in \
        capsys.readouterr().err
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt", *model, "--gpus", "4", "--quiet", "--replay", "1", "--workers",
                 "1", "--tp-overlap", "none", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["candidates"]
    with pytest.raises(ValueError, match="tp_overlap must be one of"):
        plan_gpt(hidden=64, layers=2, heads=4, seq=16, vocab=64, gpus=2, global_batch=4,
                 tp_overlap="forward", replay=0, progress=False)
    with pytest.raises(ValueError, match="tp_overlap='always': not a known value; allowed: "
                                         "one of backward, te, none"):
        ParallelConfig(global_batch=4, tp_overlap="always")


def test_the_planner_pairs_te_with_sequence_parallelism():
    """plan_gpt(tp_overlap="te"): Transformer Engine's overlap needs sequence parallelism,
    so every candidate with tp > 1 runs it (none is refused for lacking it), and the ones
    with tp = 1 are as under ``backward``."""
    common = dict(hidden=1024, layers=4, heads=16, seq=2048, vocab=1024, gpus=8,
                  global_batch=8, hardware="h100-dgx", progress=False, replay=1, top=1,
                  workers=1)
    te = plan_gpt(tp_overlap="te", **common)
    assert len(te) and te.attrs["tp_overlap"] == "te"
    assert te[te["tp"] > 1]["sequence_parallel"].all() and (te["tp"] > 1).any()
    backward = plan_gpt(tp_overlap="backward", **common)
    assert len(te[te["tp"] == 1]) == len(backward[backward["tp"] == 1])
