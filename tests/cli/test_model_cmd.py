"""The model front door (issue 51): ``vcluster model list/show``, ``--model NAME|PATH`` on
simulate and plan equal to the same shape flags, the plan's rulebook reported under the
flag a user typed, and every closed choice defined once."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from modeling import ConfigError, ParallelConfig, load_model, parameter_count, preset_names
from pipeline_parallel.gpt import GPTConfig
from vcluster.cli.main import main
from vcluster.planner.simulation import gpt_step_traces, simulate_gpt
from vcluster.runtime.tracing import TraceCollective
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["--tp", "8", "--pp", "2", "--dp", "2", "--global-batch", "16", "--seq", "2048",
        "--hardware", "h100-dgx", "--allow-oom"]
#: (preset, the same model as flags), proxies of 4 layers
CASES = {
    "llama-3.1-70b": ["--arch", "llama", "--hidden", "8192", "--heads", "64", "--kv-heads",
                      "8", "--ffn-hidden", "28672", "--vocab", "128256"],
    "mixtral-8x7b": ["--arch", "llama", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
                     "--ffn-hidden", "14336", "--vocab", "32000", "--experts", "8",
                     "--moe-top-k", "2", "--moe-ffn-hidden", "14336"],
}


def _simulate(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["simulate", "train", *args, "--layers", "4", *PLAN, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("preset", sorted(CASES))
def test_a_preset_simulates_as_its_shape_flags(preset, tmp_path, capsys):
    by_name = _simulate(tmp_path, "model", "--model", preset)
    printed = capsys.readouterr().out
    by_flags = _simulate(tmp_path, "flags", *CASES[preset])
    assert printed.startswith(f"{preset} (Llama h=")
    for key in ("step_time_s", "peak_memory_gb", "tflops_per_gpu", "mfu", "zero_stage"):
        assert by_name[key] == by_flags[key], key


def test_plan_takes_a_model_and_gpt_stays_an_alias(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--model", "llama-3.1-8b", "--layers", "4", "--seq", "1024",
                 "--gpus", "8", "--global-batch", "8", "--hardware", "h100-dgx", "--replay",
                 "1", "--workers", "1", "--quiet", "--top", "1", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("llama-3.1-8b (Llama h=4096 l=4")
    assert json.loads(out.read_text())["candidates"]


#: a Llama config.json whose MLP has biases (``mlp_bias``): every preset runs now, this not
MLP_BIAS_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 128, "vocab_size": 256, "mlp_bias": True,
                   "max_position_embeddings": 512, "rms_norm_eps": 1e-5}


def test_a_model_the_program_cannot_run_is_refused_by_name(capsys, tmp_path):
    path = tmp_path / "mlp-bias.json"
    path.write_text(json.dumps(MLP_BIAS_CONFIG))
    assert main(["simulate", "train", "--model", str(path), "--seq", "64",
                 "--global-batch", "8"]) == 2
    assert "--model='mlp-bias': the GPT program cannot run biases in the MLP of a Llama " \
        "block" in capsys.readouterr().err  # GPT-OSS's windows, sinks and biases it runs
    assert main(["simulate", "train", "--hidden", "64", "--seq", "64",
                 "--global-batch", "8"]) == 2
    assert "--layers, --heads, --vocab required (or --model" in capsys.readouterr().err


def test_model_list_and_show(capsys, tmp_path):
    assert main(["model", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in preset_names())
    assert main(["model", "show", "mixtral-8x7b", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    count = parameter_count(load_model("mixtral-8x7b"))
    assert shown["params"]["total"] == count.total and shown["params"]["active"] == count.active
    assert main(["model", "show", "qwen3-30b-a3b"]) == 0
    text = capsys.readouterr().out
    assert "qk-norm" in text and "MoE 128 x swiglu 768, top-8" in text
    assert main(["model", "show", str(tmp_path / "none.json")]) == 2


#: every ZeRO x ep x pp x sp combination; 8 or 16 GPUs, a 4-layer MoE Llama
COMBOS = list(itertools.product((0, 1, 2, 3), (1, 2), (1, 2), (False, True)))


@pytest.mark.parametrize("zero, ep, pp, sp", COMBOS)
def test_the_stage_traced_counted_and_printed_agree(zero, ep, pp, sp):
    """For each combination the rulebook accepts, the traced step runs that ZeRO stage
    (all-gathers of the sharded parameters over dp when zero >= 1, none under DDP), the
    memory model counts it and the result reports it; the rest are refused with a reason."""
    config = GPTConfig(hidden=128, layers=4, heads=4, seq=64, vocab=256, arch="llama",
                       kv_heads=2, ffn_hidden=256, experts=4)
    try:
        par = ParallelConfig(global_batch=8, dp=4, pp=pp, tp=2,
                             sequence_parallel=sp, zero_stage=zero, ep=ep)
    except ConfigError as exc:
        assert exc.field == "zero_stage" and exc.reason
        assert zero >= 2 and (pp > 1 or sp) or zero >= 1 and ep > 1
        return
    hw = load_hardware("h100-dgx")
    r = simulate_gpt(config, par, hw)
    assert r.zero_stage == zero
    traces = gpt_step_traces(config, par, HardwareCostModel(hw, "bf16"))
    gathers = [o for t in traces for o in t.ops if isinstance(o, TraceCollective)
               and o.collective == "all_gather" and len(o.group) == par.dp]
    assert bool(gathers) == (zero >= 1)
    opt = r.memory[0].optimizer_bytes
    plain = simulate_gpt(config, ParallelConfig(global_batch=8, dp=par.dp, pp=pp, tp=2,
                                                sequence_parallel=sp, ep=ep), hw)
    assert (opt < plain.memory[0].optimizer_bytes) == (zero >= 1)


#: closed choices: their texts as a tuple literal must appear only in modeling/choices.py
CHOICE_LITERALS = [r'\(\s*"gpipe",\s*"1f1b",', r'\(\s*"1f1b",\s*"interleaved_1f1b"',
                   r'\(\s*"none",\s*"selective",\s*"full"', r'\(\s*"flash",\s*"unfused"',
                   r'\(\s*"backward",\s*"none"\)', r'\(\s*"model",\s*"fp32"\)',
                   r'\(\s*"ring",\s*"all_gather"\)', r'\(\s*0,\s*1,\s*2,\s*3\)',
                   r'\[\s*"flash",\s*"unfused"', r'\[\s*"backward",\s*"none"\]',
                   r'\[\s*"model",\s*"fp32"\]']


def test_each_closed_choice_is_defined_once():
    found = []
    for top in ("vcluster", "pipelining", "tensor_parallel", "pipeline_parallel", "reports",
                "sharding", "mesh", "modeling"):
        for path in (ROOT / top).rglob("*.py"):
            if path.as_posix().endswith("modeling/choices.py"):
                continue
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}: {p}" for p in CHOICE_LITERALS
                      if re.search(p, text)]
    assert found == []


def test_a_scenario_names_its_model(tmp_path, capsys):
    """workload.model: the preset's shapes, the keys written beside it overriding them; a
    model the program cannot run is refused at check time under workload.model."""
    good = tmp_path / "model.yaml"
    good.write_text("workload: {kind: transformer, model: llama-3.1-8b, layers: 2, seq: 1024, "
                    "batch: 8}\nparallel: {tp: 8, micro_batch: 1}\nrun: {mode: simulate}\n"
                    "hardware: {name: h100-dgx}\n")
    assert main(["run", str(good), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "Llama h=4096 l=2 a=32 kv=8 ffn=14336 s=1024 V=128256" in summary
    bad = tmp_path / "bad.yaml"
    config = tmp_path / "mlp-bias.json"
    config.write_text(json.dumps(MLP_BIAS_CONFIG))
    bad.write_text(f"workload: {{kind: transformer, model: {config}, layers: 2, seq: 64}}\n"
                   "parallel: {tp: 1}\n"
                   "run: {mode: simulate}\nhardware: {name: h100-dgx}\n")
    assert main(["run", str(bad), "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "workload.model = 'mlp-bias': the GPT program cannot run biases in the MLP of " \
        "a Llama block" in err


ARCH_TEST = re.compile(r"""arch[a-z_]*\s*(==|!=|in)\s*\(?["']""")


def test_no_engine_tests_an_architecture_by_name():
    """A model is data: outside the model layer nothing compares an ``arch`` with a name;
    engines ask the block (``config.block.grouped_query``, ``config.block is LLAMA_BLOCK``)."""
    found = [f"{p.relative_to(ROOT)}:{i}" for top in ("vcluster", "pipelining", "tensor_parallel",
                                                     "pipeline_parallel", "reports")
             for p in (ROOT / top).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if ARCH_TEST.search(line)]
    assert found == []
