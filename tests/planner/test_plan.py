"""The auto-parallel planner: enumeration, memory filter, screen against replay, plan_gpt,
``vcluster plan gpt`` (JSON schema, plot, exit codes), Megatron's published configurations."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter

import pytest
from scipy.stats import spearmanr

from pipeline_parallel.gpt import (GPTConfig, ParallelConfig, megatron_flops_with_recompute,
                                   megatron_model_flops)
from vcluster.planner.candidates import SearchSpace, divisors, enumerate_candidates, stage_split
from vcluster.planner.layer_cost import trace_stage_pieces
from vcluster.planner.memory import gpt_memory
from vcluster.planner.search import COLUMNS, plan_gpt
from vcluster.planner.screen import peak_memory_bytes, screen_estimate
from vcluster.planner.simulation import simulate_gpt
from pipelining import make_schedule
from vcluster.cli.main import main
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

pytestmark = pytest.mark.timeout(600)    # a replay worker that hangs fails the test

A100 = "a100-80gb-dgx"
SMALL = dict(hidden=1024, layers=12, heads=16, seq=512, vocab=32000)


def _schedule(par):
    return make_schedule(par.schedule, par.pp, par.microbatches,
                         virtual_stages=par.chunks if par.schedule == "interleaved_1f1b" else None)


def _gpt_memory_peak(cfg, par) -> int:
    return max(m.total_bytes for m in gpt_memory(cfg, par, _schedule(par)))


# --- enumeration and memory -----------------------------------------------------------
@pytest.mark.parametrize("gpus,batch,hbm_gb", [(32, 64, 80), (24, 48, 16), (16, 96, 4)])
def test_every_candidate_is_valid_and_rejections_are_counted(gpus, batch, hbm_gb):
    cfg = GPTConfig(**SMALL)
    space = SearchSpace(max_tp=8)
    cands, rejected = enumerate_candidates(cfg, gpus, batch, space, hbm_gb * 10**9)
    assert len(set(cands)) == len(cands)
    for p in cands:
        assert p.tp * p.pp * p.dp == gpus and cfg.heads % p.tp == 0 and cfg.vocab % p.tp == 0
        assert p.tp <= 8 and cfg.layers % (p.pp * p.chunks) == 0
        assert batch % (p.dp * p.micro_batch) == 0 and p.micro_batch <= 8
        assert not p.sequence_parallel or (p.tp > 1 and cfg.seq % p.tp == 0)
        assert p.pp > 1 or p.schedule == "1f1b"
        if p.schedule == "interleaved_1f1b":
            assert p.chunks >= 2 and p.microbatches % p.pp == 0
    # independent count: every (tp, pp) split by the first rule it breaks; every knob
    # combination of a valid split either fits (gpt_memory with the real schedule) or not
    expect, fits = Counter(), 0
    for tp, pp in ((t, q) for t in divisors(gpus) for q in divisors(gpus // t)):
        dp = gpus // (tp * pp)
        rules = [("tp_not_dividing_heads", cfg.heads % tp), ("tp_not_dividing_vocab", cfg.vocab % tp),
                 ("tp_larger_than_node", tp > 8), ("pp_not_dividing_layers", cfg.layers % pp),
                 ("dp_not_dividing_batch", batch % dp)]
        broken = [name for name, bad in rules if bad]
        if broken:
            expect[broken[0]] += 1
            continue
        scheds = [("1f1b", None)] if pp == 1 else [("1f1b", None), ("zero_bubble", None)] + [
            ("interleaved_1f1b", v) for v in range(2, 9) if (cfg.layers // pp) % v == 0]
        for b, (name, v), sp, rc in itertools.product(
                [b for b in range(1, 9) if (batch // dp) % b == 0], scheds,
                [False, True] if tp > 1 and cfg.seq % tp == 0 else [False],
                ["none", "selective", "full"]):
            m = batch // (dp * b)
            if name == "interleaved_1f1b" and m % pp:
                expect["interleaved_microbatches"] += 1
                continue
            par = ParallelConfig(global_batch=batch, micro_batch=b, dp=dp, pp=pp, tp=tp,
                                 schedule=name, virtual_stages=v, sequence_parallel=sp,
                                 recompute=rc)
            sharded = dataclasses.replace(par, distributed_optimizer=True)
            if _gpt_memory_peak(cfg, par) <= hbm_gb * 10**9:
                fits += 1
            elif dp > 1 and _gpt_memory_peak(cfg, sharded) <= hbm_gb * 10**9:
                fits += 1                       # the planner shards the optimizer state
                assert sharded in cands
            else:
                expect["out_of_memory"] += 1
    assert len(cands) == fits
    assert dict(rejected) == {k: v for k, v in expect.items() if v}


@pytest.mark.parametrize("schedule,v", [("1f1b", None), ("zero_bubble", None),
                                        ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
@pytest.mark.parametrize("tp,pp,b,sp,rc,att,dopt", [
    (1, 2, 1, False, "none", "flash", False), (2, 4, 2, True, "selective", "unfused", True),
    (4, 2, 4, False, "full", "flash", True), (8, 3, 1, True, "none", "unfused", False)])
def test_peak_memory_equals_gpt_memory(schedule, v, tp, pp, b, sp, rc, att, dopt):
    cfg = GPTConfig(hidden=1024, layers=24, heads=16, seq=512, vocab=32000)
    ends = stage_split(cfg.layers, pp * (v or 1)) or (None, None)   # 24 on 9: 2, 3 x 7, 1
    for m in (pp, 2 * pp, 3 * pp + (0 if v else 1)):
        par = ParallelConfig(global_batch=m * b * 2, micro_batch=b, dp=2, pp=pp, tp=tp,
                             schedule=schedule, virtual_stages=v, sequence_parallel=sp,
                             recompute=rc, attention=att, distributed_optimizer=dopt,
                             first_stage_layers=ends[0], last_stage_layers=ends[1])
        assert peak_memory_bytes(cfg, par) == _gpt_memory_peak(cfg, par)


# --- the screen ---------------------------------------------------------------------------
@pytest.mark.parametrize("tp,b,sp,rc", [(1, 1, False, "none"), (2, 2, True, "selective"),
                                         (4, 1, False, "full"), (8, 4, True, "none")])
def test_traced_piece_flops_are_megatrons(tp, b, sp, rc):
    cfg = GPTConfig(**SMALL)
    pieces = trace_stage_pieces(cfg, tp, b, sp, rc, HardwareCostModel(load_hardware(A100)))
    h, s, l, V = cfg.hidden, cfg.seq, 1, cfg.vocab
    layer = sum(pieces[("layer", a)].flops for a in "FIW")
    head = sum(pieces[("head", a)].flops for a in "FIW")
    model = megatron_model_flops(b, s, l, h, V)
    extra = {"none": 0, "selective": 4 * b * s * s * h,
             "full": megatron_flops_with_recompute(b, s, l, h, V) - model}[rc]
    assert (layer + head) * tp == pytest.approx(model + extra, rel=1e-12)
    assert head * tp == 6 * b * s * h * V


SCREEN_CASES = [  # 1.7B-like model on 32 GPUs: splits, schedules, micro-batches, recompute
    dict(tp=1, pp=1, dp=32, micro_batch=2, recompute="none"),
    dict(tp=2, pp=1, dp=16, micro_batch=4, sequence_parallel=True, recompute="selective"),
    dict(tp=2, pp=2, dp=8, micro_batch=1, schedule="interleaved_1f1b", virtual_stages=3),
    dict(tp=4, pp=2, dp=4, micro_batch=2, schedule="zero_bubble", recompute="full"),
    dict(tp=8, pp=4, dp=1, micro_batch=1, recompute="full"),
    dict(tp=1, pp=4, dp=8, micro_batch=1, recompute="selective"),
]


def test_screen_tracks_the_replay():
    cfg = GPTConfig(hidden=2304, layers=24, heads=24, seq=2048, vocab=51200)
    hw = load_hardware(A100)
    costs = HardwareCostModel(hw)
    screened, replayed = [], []
    for knobs in SCREEN_CASES:
        par = ParallelConfig(global_batch=512, **knobs)
        pieces = trace_stage_pieces(cfg, par.tp, par.micro_batch, par.sequence_parallel,
                                    par.recompute, costs,
                                    async_grad_reduce=par.use_async_grad_reduce)
        est = screen_estimate(cfg, par, pieces, hw)
        sim = simulate_gpt(cfg, par, hw)
        screened.append(est.step_time_s)
        replayed.append(sim.step_time_s)
        assert est.step_time_s == pytest.approx(sim.step_time_s, rel=0.10), knobs
        assert est.mfu == pytest.approx(sim.mfu, rel=0.10)
    assert spearmanr(screened, replayed).statistic >= 0.9


ZERO_CASES = [  # a 0.4B model on 64 A100s: DP communication is a large share of the step
    dict(tp=1, pp=1, dp=64, micro_batch=1, global_batch=256),
    dict(tp=2, pp=1, dp=32, micro_batch=2, global_batch=256),
    dict(tp=2, pp=2, dp=16, micro_batch=1, global_batch=64),
]


@pytest.mark.parametrize("knobs", ZERO_CASES)
def test_screen_prices_each_zero_stage_like_the_replay(knobs):
    cfg = GPTConfig(hidden=1024, layers=24, heads=16, seq=512, vocab=51200)
    hw = load_hardware(A100)
    costs = HardwareCostModel(hw)
    pieces = trace_stage_pieces(cfg, knobs["tp"], knobs["micro_batch"], False, "none", costs)
    comm = {}
    for zero in (0, 1, 2, 3) if knobs["pp"] == 1 else (0, 1):
        par = ParallelConfig(zero_stage=zero, **knobs)
        est = screen_estimate(cfg, par, pieces, hw)
        assert est.step_time_s == pytest.approx(simulate_gpt(cfg, par, hw).step_time_s,
                                                rel=0.12), zero
        comm[zero] = est.comm_s
    # a reduce-scatter and an all-gather move the bytes of one all-reduce, which NCCL
    # may also run as a tree: never cheaper than DDP
    assert comm[1] >= comm[0]
    if knobs["pp"] == 1:        # ZeRO-3 gathers twice per micro-batch: more than ZeRO-1
        assert comm[3] > comm[2] > comm[1]


def test_screen_zero3_moves_one_and_a_half_times_zero1_with_one_micro_batch():
    cfg = GPTConfig(hidden=1024, layers=24, heads=16, seq=512, vocab=51200)
    hw = load_hardware(A100)
    pieces = trace_stage_pieces(cfg, 1, 1, False, "none", HardwareCostModel(hw))
    comm = [screen_estimate(cfg, ParallelConfig(zero_stage=z, dp=64, micro_batch=1,
                                                global_batch=64), pieces, hw).comm_s
            for z in (1, 3)]
    assert comm[1] == pytest.approx(1.5 * comm[0], rel=1e-9)


# --- plan_gpt -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_plan():
    return plan_gpt(**SMALL, gpus=16, global_batch=64, top=3, replay=4, workers=2, progress=False)


def test_plan_gpt_orders_replayed_first(small_plan):
    df = small_plan
    assert list(df.columns) == list(COLUMNS)
    assert df.attrs["replayed"] == 4 and df["replayed"].sum() == 4
    assert df["replayed"].iloc[:4].all() and not df["replayed"].iloc[4:].any()
    assert df["step_time_s"].iloc[:4].is_monotonic_increasing
    assert df["step_time_s"].iloc[4:].is_monotonic_increasing
    assert len(df) == df.attrs["candidates"] and sum(df.attrs["rejected"].values()) > 0
    assert (df["peak_memory_gb"] <= 80).all()
    # the replayed figures are simulate_gpt's
    r = df.iloc[0]
    par = ParallelConfig(global_batch=64, micro_batch=int(r.micro_batch), dp=int(r.dp),
                         pp=int(r.pp), tp=int(r.tp), schedule=r.schedule,
                         virtual_stages=int(r.virtual_stages) if r.schedule ==
                         "interleaved_1f1b" else None, sequence_parallel=bool(r.sequence_parallel),
                         recompute=r.recompute)
    sim = simulate_gpt(GPTConfig(**SMALL), par, A100)
    assert r.step_time_s == pytest.approx(sim.step_time_s, rel=1e-12)
    assert r.mfu == pytest.approx(sim.mfu, rel=1e-12)


def test_plan_gpt_replays_at_least_ten_by_default():
    df = plan_gpt(**SMALL, gpus=8, global_batch=16, top=2, workers=1, progress=False,
                  recompute=("selective",), schedules=("1f1b",))
    assert df.attrs["replayed"] == min(10, len(df)) and df["replayed"].sum() == min(10, len(df))
    assert set(df.recompute) == {"selective"}


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpus=0), "gpus must be a positive int"),
    (dict(top=-1), "top must be a positive int"),
    (dict(replay=-2), "replay must be an int >= 0"),
    (dict(recompute=("some",)), "recompute must be a non-empty selection"),
    (dict(heads=7), "hidden=1024 is not divisible by heads=7"),
    (dict(hardware="no-such-gpu"), "no-such-gpu"),
])
def test_plan_gpt_bad_input(kwargs, message):
    args = dict(SMALL, gpus=8, global_batch=16, replay=0, progress=False) | kwargs
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        plan_gpt(**args)


# --- the command -------------------------------------------------------------------------------
PLAN_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["candidates", "rejected"],
    "properties": {
        "precision": {"enum": ["megatron", "torch_amp", "fp64", "fp32"]},
        "fp8": {"type": "boolean"},
        "gemm_format": {"enum": [None, "fp8", "fp8-row", "fp8-block", "mxfp8", "nvfp4", "mxfp4"]},
        "cluster_parts": {"type": ["array", "null"]},
        "grad_reduce_dtype": {"enum": ["model", "fp32"]},
        "attention": {"enum": ["flash", "unfused", "flash-v1", "flash2", "flash3", "cudnn"]},
        "tp_overlap": {"enum": ["backward", "te", "none"]},
        "rejected": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
        "candidates": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["tp", "pp", "dp", "micro_batch", "schedule", "virtual_stages",
                         "sequence_parallel", "recompute", "step_time_s", "tflops_per_gpu",
                         "mfu", "peak_memory_gb", "replayed"],
            "properties": {
                **{k: {"type": "integer", "minimum": 1}
                   for k in ("tp", "pp", "dp", "micro_batch", "virtual_stages")},
                "schedule": {"enum": ["1f1b", "interleaved_1f1b", "zero_bubble"]},
                "recompute": {"enum": ["none", "selective", "full"]},
                "sequence_parallel": {"type": "boolean"}, "replayed": {"type": "boolean"},
                **{k: {"type": "number", "exclusiveMinimum": 0}
                   for k in ("step_time_s", "tflops_per_gpu", "mfu", "peak_memory_gb")}}}}}}

CLI = ["plan", "gpt", "--hidden", "1024", "--layers", "12", "--heads", "16", "--seq", "512",
       "--vocab", "32000", "--gpus", "16", "--global-batch", "64", "--quiet"]


def test_cli_writes_json_and_plot(tmp_path, capsys):
    import jsonschema
    out, path = tmp_path / "out", tmp_path / "plan.json"
    assert main(CLI + ["--top", "3", "--replay", "2", "--json", str(path),
                       "--out", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert "rejected:" in text and doc["rejected"] and "replay" in text
    assert all(f"{n}  {reason}:" in text for reason, n in doc["rejected"].items())
    jsonschema.validate(doc, PLAN_SCHEMA)
    assert doc == json.loads((out / "plan.json").read_text())
    steps = [c["step_time_s"] for c in doc["candidates"]]
    assert [c["replayed"] for c in doc["candidates"][:3]] == [True, True, False]
    assert steps[:2] == sorted(steps[:2]) and steps[2:] == sorted(steps[2:])
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("argv,code,message", [
    (["--gpus", "0"], 2, "expected a positive integer, got 0"),
    (["--top", "x"], 2, "expected a positive integer, got 'x'"),
    (["--hardware", "no-such-gpu"], 2, "no-such-gpu"),
    (["--replay", "-1"], 2, "--replay must be >= 0, got -1"),
    (["--heads", "7"], 2, "hidden=1024 is not divisible by heads=7"),
])
def test_cli_bad_flags(argv, code, message, capsys):
    args = CLI[:]
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    try:
        got = main(args)
    except SystemExit as exc:       # argparse's own usage errors
        got = exc.code
    assert got == code
    assert message in capsys.readouterr().err


def test_cli_nothing_fits(capsys):
    args = ["plan", "gpt", "--hidden", "12288", "--layers", "96", "--heads", "96", "--seq",
            "2048", "--vocab", "51200", "--gpus", "8", "--global-batch", "8", "--quiet"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "no configuration fits" in out and "out_of_memory" in out


# --- Megatron's published configurations -------------------------------------------------------
def _check_published(row):
    from vcluster.planner.search_validation import plan_against_published
    r = plan_against_published(row, workers=2, progress=False)
    assert r["best_vs_published"] <= 0, r
    assert r["split_rank"] is not None and (r["split_rank"] <= 5 or r["split_vs_best"] <= 0.05), r
    return r


def test_megatron_smallest_published_configuration():
    from vcluster.planner.search_validation import published_rows
    (row,) = published_rows(["1.7B"])
    _check_published(row)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["3.6B", "7.5B", "18B", "39B", "76B", "145B", "310B"])
# (<= 1920 GPUs; the full table, to 3072: python benchmarks/plan_megatron.py, 2.5 min)
def test_megatron_published_configurations(model):
    from vcluster.planner.search_validation import published_rows
    (row,) = published_rows([model])
    _check_published(row)


def test_plan_with_no_divisible_configuration_says_so():
    """Issue 31, item 9: on 7 GPUs every rejection is a count that does not divide; the
    message used to blame the device memory."""
    import subprocess
    import sys
    args = list(CLI)
    args[args.index("--gpus") + 1] = "7"
    args[args.index("--layers") + 1] = "6"      # 6 layers split into 7 stages no way
    proc = subprocess.run([sys.executable, "-m", "vcluster", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "no configuration divides this model and batch over 7 GPUs" in proc.stdout
    assert "memory" not in proc.stdout.splitlines()[-1]


def test_plan_piped_into_head_ends_quietly():
    """Issue 31, item 9: ``vcluster plan ... | head -1`` ended in BrokenPipeError."""
    import subprocess
    import sys
    cmd = " ".join([sys.executable, "-m", "vcluster", *CLI, "--top", "300", "--replay", "0"]) \
        + " | head -1"
    proc = subprocess.run(["bash", "-c", "set -o pipefail; " + cmd], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("GPT h=1024")
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 141                   # 128 + SIGPIPE, as Unix tools end


def test_plan_keeps_the_memory_headroom(capsys, tmp_path):
    """Issue 31, item 9: the planner kept no headroom (79.3 of 80 GB); now every candidate
    leaves 5% (or --memory-headroom) of the device memory free."""
    args = ["plan", "gpt", "--hidden", "4096", "--layers", "32", "--heads", "32", "--seq",
            "2048", "--vocab", "51200", "--gpus", "8", "--global-batch", "16", "--quiet",
            "--replay", "0", "--top", "1", "--zero-stages", "0,1"]   # ZeRO-3 fits all
    counts = {}
    for headroom in ("0", "0.05", "0.3"):
        path = tmp_path / f"{headroom}.json"
        assert main(args + ["--memory-headroom", headroom, "--json", str(path)]) in (0, 1)
        doc = json.loads(path.read_text())
        limit = 80e9 * (1 - float(headroom)) / 1e9
        assert all(c["peak_memory_gb"] <= limit + 1e-9 for c in doc["candidates"])
        counts[headroom] = (len(doc["candidates"]), doc["rejected"].get("out_of_memory", 0))
    assert counts["0"][0] >= counts["0.05"][0] > counts["0.3"][0]
    assert counts["0"][1] <= counts["0.05"][1] < counts["0.3"][1]
    assert "(5% headroom)" in capsys.readouterr().out


# --- issue 56: tokens/s per GPU, honest TFLOP/s, progress when piped -----------------------------
def test_cli_gives_tokens_per_gpu_and_both_tflops(tmp_path, capsys):
    """Every JSON candidate: tokens/s per GPU = B·s / (step · GPUs), model TFLOP/s per GPU =
    72·B·s·l·h²·(1 + s/6h + V/12lh) / (step · GPUs) (MFU's numerator: mfu · the A100's
    312), hardware TFLOP/s per GPU = the earlier ``tflops_per_gpu`` (FLOPs executed), never
    below the model's and above it exactly when the candidate recomputes; the table's
    tok/s/GPU column holds the first, under a header and legend that name the others."""
    path = tmp_path / "plan.json"
    assert main(CLI + ["--top", "3", "--replay", "2", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(path.read_text())
    B, s, gpus = 64, 512, 16
    model = megatron_model_flops(B, s, SMALL["layers"], SMALL["hidden"], SMALL["vocab"])
    for c in doc["candidates"]:
        step = c["step_time_s"]
        assert c["tokens_per_s_per_gpu"] == pytest.approx(B * s / (step * gpus), rel=1e-12)
        assert c["model_tflops_per_gpu"] == pytest.approx(model / (step * gpus) / 1e12,
                                                          rel=1e-12)
        assert c["model_tflops_per_gpu"] == pytest.approx(c["mfu"] * 312, rel=1e-9)
        assert c["hardware_tflops_per_gpu"] == c["tflops_per_gpu"]
        assert c["hardware_tflops_per_gpu"] >= c["model_tflops_per_gpu"] * (1 - 1e-9)
        if c["recompute"] == "none":
            assert c["hardware_tflops_per_gpu"] == pytest.approx(c["model_tflops_per_gpu"],
                                                                 rel=1e-9)
    lines = text.splitlines()
    head = next(ln for ln in lines if ln.lstrip().startswith("#"))
    assert "tok/s/GPU" in head and "hw TFLOP/s" in head
    first = lines[lines.index(head) + 1].split()
    col = head.split().index("tok/s/GPU") - 1      # the header's "step s" is two words
    assert first[col] == f"{doc['candidates'][0]['tokens_per_s_per_gpu']:,.0f}"
    assert first[col + 1] == f"{doc['candidates'][0]['hardware_tflops_per_gpu']:.1f}"
    legend = lines[lines.index(head) + 4]
    assert "tok/s/GPU: global batch · seq / (step · GPUs)" in legend
    assert "hw TFLOP/s: hardware TFLOP/s per GPU, the FLOPs executed (with recomputation)" \
        in legend


def _plan_piped(*extra):
    """``vcluster plan`` with stdout and stderr pipes (not terminals), as under ``| tee``."""
    import subprocess
    import sys
    args = [a for a in CLI if a != "--quiet"] + ["--top", "1", "--replay", "1",
                                                 "--workers", "1", *extra]
    return subprocess.run([sys.executable, "-m", "vcluster", *args], capture_output=True,
                          text=True, timeout=240)


def test_plan_prints_progress_lines_when_piped():
    """Issue 56: piped, the plan printed nothing until its end (the bar is for terminals
    only). Now stderr gets a line per stage (and one every few seconds in between)."""
    import re
    proc = _plan_piped()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(ln.startswith("plan: ") for ln in lines), proc.stderr
    screened = re.fullmatch(r"plan: (\d+)/(\d+) candidates screened in \d+\.\d s",
                            next(ln for ln in lines if "screened in" in ln))
    assert screened and screened[1] == screened[2] and int(screened[1]) > 1
    assert re.fullmatch(r"plan: 1/1 candidates replayed in \d+\.\d s", lines[-1]), lines
    assert f"{screened[1]} configurations fit" in proc.stdout
    assert "plan:" not in proc.stdout


def test_plan_quiet_prints_no_progress():
    proc = _plan_piped("--quiet")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_progress_lines_are_throttled_and_end_with_the_count():
    """ProgressLines: at most one line per task every ``every_s`` seconds, a final line
    when the task reaches its total (or finish() ends an open one), each object its own."""
    import io

    from vcluster.planner.progress import ProgressLines
    now = [0.0]
    out = io.StringIO()
    p = ProgressLines("plan", stream=out, every_s=5.0, clock=lambda: now[0])
    task = p.add_task("candidates replayed", total=4)
    for t in (1.0, 6.0, 7.0, 12.5):
        now[0] = t
        p.advance(task)
    assert out.getvalue().splitlines() == ["plan: 2/4 candidates replayed (6 s)",
                                           "plan: 4/4 candidates replayed in 12.5 s"]
    other = ProgressLines("validate-model", stream=io.StringIO(), clock=lambda: now[0])
    rows = other.add_task("rows predicted")
    other.advance(rows, 3)
    other.finish(rows)
    other.finish(rows)                                  # once
    assert other.stream.getvalue() == "validate-model: 3 rows predicted in 0.0 s\n"
    assert len(out.getvalue().splitlines()) == 2        # the first object's untouched
    with pytest.raises(ValueError, match="every_s must be seconds >= 0, got -1"):
        ProgressLines("plan", every_s=-1)
