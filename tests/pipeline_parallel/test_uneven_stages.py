"""Pipeline stages of unequal layer counts (ParallelConfig(first_stage_layers=,
last_stage_layers=), Megatron-Core's decoder_first/last_pipeline_num_layers): the split
itself, the emulated training against the numpy reference (dense and MoE, 1F1B and
interleaved), the memory model's parameters per rank, the simulated step's FLOPs, and
the planner's embedding-and-loss split for layer counts pp does not divide."""

import numpy as np
import pytest

from modeling import ConfigError
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from vcluster.planner.candidates import stage_split
from vcluster.planner.memory import rank_params
from vcluster.planner.simulation import simulate_gpt
from vcluster.timing import load_hardware

from .gpt_data import token_data

pytestmark = pytest.mark.timeout(300)

RTOL, ATOL = 1e-9, 1e-12


def test_the_split():
    par = ParallelConfig(global_batch=8, pp=8, schedule="interleaved_1f1b", virtual_stages=2,
                         first_stage_layers=3, last_stage_layers=2)
    assert par.stage_layers(61) == (3,) + (4,) * 14 + (2,)           # DeepSeek-V3's 61
    assert [par.rank_layers(61, r) for r in range(8)] == [7, 8, 8, 8, 8, 8, 8, 6]
    assert ParallelConfig(global_batch=8, pp=4, first_stage_layers=22).stage_layers(94) == \
        (22, 24, 24, 24)
    assert ParallelConfig(global_batch=8, pp=4).stage_layers(8) == (2, 2, 2, 2)
    with pytest.raises(ConfigError, match=r"first_stage_layers=21: .* remaining 73 layers do "
                                          r"not split evenly into 3 stages"):
        ParallelConfig(global_batch=8, pp=4, first_stage_layers=21).stage_layers(94)
    with pytest.raises(ConfigError, match=r"layers=94: .* or first_stage_layers / "
                                          r"last_stage_layers"):
        ParallelConfig(global_batch=8, pp=4).stage_layers(94)
    with pytest.raises(ConfigError, match="last_stage_layers=2: .*none with one pipeline"):
        ParallelConfig(global_batch=8, last_stage_layers=2).stage_layers(4)
    assert stage_split(94, 32) == (2, 2) and stage_split(96, 32) == ()
    assert stage_split(61, 16) == (3, 2) and stage_split(61, 32) is None \
        and stage_split(7, 1) == ()
    # Megatron-Bridge's layouts whose end stages hold the embedding or the head alone:
    # Llama 3.1 405B's 126 layers on pp 16 x vp 8, DeepSeek-V3's 61 on pp 8 x vp 4
    # ("Et|(tt|)*30mL"); the planner's search keeps a layer in every stage
    assert stage_split(126, 128, empty_ends=True) == (0, 0) and stage_split(126, 128) is None
    assert stage_split(61, 32, empty_ends=True) == (1, 0)
    assert stage_split(5, 8, empty_ends=True) is None        # a middle stage would be empty
    for layers in range(2, 70):
        for stages in (2, 3, 4, 8, 16):
            for empty_ends in (False, True):
                ends = stage_split(layers, stages, empty_ends)
                if not ends:
                    continue
                # a valid split: the stages hold every layer, no middle stage empty
                par = ParallelConfig(global_batch=8, pp=stages, first_stage_layers=ends[0],
                                     last_stage_layers=ends[1])
                split = par.stage_layers(layers)
                assert sum(split) == layers and min(split[1:-1], default=1) >= 1
                assert min(split) >= 1 or (empty_ends and (
                    ends == (0, 0) and layers + 2 == stages or split[0] >= 1))


def _llama(**kw):
    return GPTConfig(**{**dict(hidden=16, layers=6, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24), **kw})


# (pp, schedule, v, first, last, layers, experts, ep, dp, micro-batches)
CASES = [
    (2, "1f1b", None, 1, None, 4, 0, 1, 1, 3),
    (2, "1f1b", None, 3, 1, 4, 0, 1, 2, 2),
    (3, "gpipe", None, 1, 1, 5, 0, 1, 1, 2),
    (2, "interleaved_1f1b", 2, 1, 1, 6, 0, 1, 1, 4),
    (2, "1f1b", None, 1, None, 5, 4, 2, 2, 2),
    (2, "interleaved_1f1b", 2, 2, 2, 6, 4, 2, 2, 2),
    # an end stage of no transformer layer (the embedding or the head alone: Megatron's
    # embedding- and loss-accounting split of Llama 3.1 405B's 126 layers on 128 stages)
    (2, "interleaved_1f1b", 2, 0, 0, 4, 0, 1, 1, 4),
    (2, "1f1b", None, 0, None, 3, 0, 1, 2, 3),
    (3, "1f1b", None, 2, 0, 4, 0, 1, 1, 2),
    (2, "interleaved_1f1b", 2, 0, 0, 2, 4, 2, 2, 2),
]


@pytest.mark.parametrize("pp, schedule, v, first, last, layers, experts, ep, dp, m", CASES,
                         ids=[f"pp{c[0]}-{c[1]}{'-v' + str(c[2]) if c[2] else ''}-first{c[3]}"
                              f"-last{c[4]}-l{c[5]}{'-moe' if c[6] else ''}" for c in CASES])
def test_uneven_stages_train_as_the_reference(cluster_of, pp, schedule, v, first, last, layers,
                                              experts, ep, dp, m):
    moe = dict(experts=experts, moe_top_k=2, moe_ffn_hidden=12) if experts else {}
    cfg = _llama(layers=layers, **moe)
    par = ParallelConfig(global_batch=dp * m, micro_batch=1, dp=dp, pp=pp, ep=ep,
                         schedule=schedule, virtual_stages=v, first_stage_layers=first,
                         last_stage_layers=last)
    job = GPT(cfg).train_job(par.mesh(), par)
    assert tuple(len(s) for s in job.specs) == par.stage_layers(layers)
    model, (tokens, targets) = GPT(cfg, seed=4), token_data(cfg, par.global_batch, 1)
    ref = model.fit_reference(tokens, targets, 3, lr=0.1, parallel=par)
    run = model.fit(cluster_of(par.mesh()), tokens, targets, 3, parallel=par, lr=0.1)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL, atol=ATOL)
    for n in ref.params:
        np.testing.assert_allclose(run.grads[n], ref.grads[n], rtol=RTOL, atol=ATOL,
                                   err_msg=n)


@pytest.mark.parametrize("first, last", [(1, 3), (3, 1), (2, None), (0, 2), (2, 0)])
def test_memory_counts_each_ranks_layers(first, last):
    """The parameters of the pipeline ranks add up to the model's, each rank's layers as
    the split gives them."""
    cfg = _llama(layers=8)
    even = ParallelConfig(global_batch=4, pp=4)
    par = ParallelConfig(global_batch=4, pp=4, first_stage_layers=first,
                         last_stage_layers=last)
    total = sum(np.prod(s) for s in GPT(cfg).param_shapes().values())
    assert sum(rank_params(cfg, par, r) for r in range(4)) == pytest.approx(total, rel=1e-12)
    per_layer = (rank_params(cfg, even, 1) - 0) / 2
    for r in range(4):
        assert rank_params(cfg, par, r) - rank_params(cfg, even, r) == pytest.approx(
            (par.rank_layers(8, r) - 2) * per_layer, rel=1e-12)


@pytest.mark.slow
def test_the_simulated_step_executes_every_layer_once():
    """The stitched step's executed FLOPs (no recomputation) equal the model's, whatever
    the split — an end stage of the embedding or the head alone included: the first and
    last traced positions carry their own layer counts, the middle one the others'."""
    cfg = _llama(hidden=256, layers=10, heads=8, seq=256, vocab=1024, kv_heads=4,
                 ffn_hidden=512)
    hw = load_hardware("h100-dgx")
    times = {}
    for first, last, pp in ((1, 1, 4), (2, 2, 3), (4, 3, 5), (0, 0, 7), (0, 1, 5)):
        par = ParallelConfig(global_batch=8, micro_batch=1, pp=pp, first_stage_layers=first,
                             last_stage_layers=last)
        r = simulate_gpt(cfg, par, hw)
        executed = r.hardware_tflops_per_gpu * 1e12 * r.step_time_s * r.gpus
        assert executed == pytest.approx(model_flops(cfg, 8), rel=1e-6), (first, last, pp)
        times[(first, last, pp)] = r.step_time_s
    even = simulate_gpt(cfg, ParallelConfig(global_batch=8, micro_batch=1, pp=5), hw)
    assert times[(4, 3, 5)] > even.step_time_s         # a 4-layer first stage is slower


def test_the_planner_counts_the_embedding_and_the_head_as_layers():
    """6 layers on pp 4 split neither evenly nor at all before; with the embedding and
    the head each counted as a layer, (6 + 2)/4 = 2 per stage: the first and last stage
    hold 1 transformer layer, the middle ones 2."""
    from vcluster.planner.search import plan_gpt
    df = plan_gpt(config=_llama(hidden=64, layers=6, heads=4, seq=64, vocab=256),
                  gpus=4, global_batch=8, hardware="h100-dgx", replay=0, progress=False,
                  schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,))
    pp4 = df[df["pp"] == 4]
    assert len(pp4) and set(pp4["first_stage_layers"]) == {1} \
        and set(pp4["last_stage_layers"]) == {1}
    assert df[df["pp"] == 2]["first_stage_layers"].isna().all()      # 6 = 2 x 3: even


def test_the_command_line_takes_an_end_stage_of_no_layer(capsys):
    """``--first-stage-layers 0``: the embedding alone on the first stage; a negative
    count is refused naming the flag."""
    from vcluster.cli.main import main
    base = ["simulate", "train", "--hidden", "64", "--layers", "4", "--heads", "4",
            "--seq", "64", "--vocab", "256", "--pp", "3", "--global-batch", "6",
            "--hardware", "h100-dgx", "--gpus", "3"]
    assert main(base + ["--first-stage-layers", "0"]) == 0
    assert "step time" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(base + ["--first-stage-layers", "-1"])
    assert "--first-stage-layers: expected an integer >= 0" in capsys.readouterr().err
