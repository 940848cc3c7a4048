"""Issue 52, validation: published mixture-of-experts training on DGX H100
(megatron_bridge_h100_moe.csv) predicted by ``validate_moe`` and printed in its own
section of ``vcluster validate-model``; every row predicted or refused with its reason,
every row held out."""

import json
import math
import os
import subprocess
import sys

import pytest

from modeling import load_model
from pipeline_parallel.gpt import GPTConfig, model_flops
from vcluster.planner.validation import MOE_METRICS, MOE_TABLE, moe_row_config
from vcluster.timing import read_data_csv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = ("model", "preset", "precision", "gpus", "global_batch", "micro_batch", "seq", "tp",
           "pp", "cp", "vp", "ep", "etp", "fsdp", "recompute", "tokens_per_s_per_gpu",
           "model_tflops_per_gpu", "step_s", "note", "release", "source",
           "moe_a2a_overlap", "moe_dispatcher", "recipe_source",
           "recompute_granularity", "recompute_modules", "recompute_source")


def _row(**changes):
    """The table's first row (Mixtral 8x22B, BF16) with ``changes``."""
    return read_data_csv(MOE_TABLE)[1][0] | changes


def test_the_moe_table_has_every_column_a_source_and_published_figures():
    comments, rows = read_data_csv(MOE_TABLE)
    text = " ".join(comments)
    assert "NVIDIA-NeMo/Megatron-Bridge" in text and "067f987df03b8355" in text
    assert "yanring/Megatron-MoE-ModelZoo" in text and "e8650517d60d71ab" in text
    assert len(rows) == 14
    for r in rows:
        assert tuple(r) == COLUMNS
        assert r["source"].startswith("https://github.com/") and r["release"], r["model"]
        assert any(r[m] for m in MOE_METRICS), r["model"]
        assert all(float(r[m]) > 0 for m in MOE_METRICS if r[m])
        tp, pp, cp, ep, gpus = (int(r[k]) for k in ("tp", "pp", "cp", "ep", "gpus"))
        assert gpus % (tp * pp * cp) == 0 and int(r["vp"]) >= 1 and ep >= 1
        assert r["etp"] in ("", "1") and r["fsdp"] in ("0", "1")
        load_model(r["preset"])                       # a shipped preset
    assert {r["preset"] for r in rows} == {"mixtral-8x22b", "gpt-oss-120b", "qwen3-30b-a3b",
                                            "qwen3-235b-a22b", "deepseek-v3"}


def test_the_published_tflops_are_the_presets_model_flops():
    """Model TFLOP/s over tokens/s (Megatron-Bridge), or x GPUs x step / tokens (Model Zoo),
    is the preset's model FLOPs per token within the rounding of the published TFLOP/s;
    Megatron-LM's own count for Mixtral 8x22B (num_floating_point_operations: 3 x forward,
    causal attention halved, the top-2 experts, the logits) is the simulator's."""
    for r in read_data_csv(MOE_TABLE)[1]:
        if not r["preset"].startswith("qwen3"):
            continue
        per_token = model_flops(GPTConfig.of_model(r["preset"], seq=int(r["seq"]),
                                                   timing_only=True), 1) / int(r["seq"])
        tflops = float(r["model_tflops_per_gpu"]) * 1e12
        if r["tokens_per_s_per_gpu"]:
            published = tflops / float(r["tokens_per_s_per_gpu"])
        else:
            published = tflops * int(r["gpus"]) * float(r["step_s"]) / (
                int(r["global_batch"]) * int(r["seq"]))
        assert published == pytest.approx(per_token, rel=0.008), r["model"]
    h, layers, heads, groups, d, ffn, vocab, s = 6144, 56, 48, 8, 128, 16384, 32000, 4096
    megatron = 3 * (layers * (2 * (h * d * (heads + 2 * groups) + heads * d * h)
                              + 2 * heads * d * s / 2 * 2 + 4 * h * ffn * 2 * 1.5)
                    + 2 * h * vocab)
    cfg = GPTConfig.of_model("mixtral-8x22b", seq=s, timing_only=True)
    assert model_flops(cfg, 1) / s == pytest.approx(megatron, rel=1e-3)


def test_a_row_is_planned_as_published_with_the_documented_defaults():
    cfg, par, fp8, refusals = moe_row_config(_row())
    assert refusals == [] and not fp8 and cfg.experts == 8 and cfg.moe_top_k == 2
    assert (par.gpus, par.dp, par.tp, par.pp, par.ep, par.etp, par.chunks) == \
        (128, 8, 2, 8, 8, 1, 7)
    assert par.folded and par.sequence_parallel and par.schedule == "interleaved_1f1b"
    assert par.zero_stage == 1 and par.recompute == "none" and par.microbatches == 32
    assert moe_row_config(_row(precision="FP8-blockwise"))[2] is True


def test_context_and_expert_parallelism_together_are_planned():
    cfg, par, _, refusals = moe_row_config(_row(cp="2", gpus="256"))
    assert refusals == [] and (par.cp, par.ep, par.expert_axes) == (2, 8, ("ep", "cp", "tp"))


def test_module_recomputation_runs_as_megatrons_recompute_modules():
    """The Model Zoo's "norm, act" (Megatron-Core's --recompute-modules layernorm moe_act)
    runs as recompute="selective" with those modules (refused before 2026-11-30)."""
    _, par, _, refusals = moe_row_config(_row(recompute="norm, act"))
    assert refusals == []
    assert (par.recompute, par.recompute_modules) == ("selective", ("moe_act", "layernorm"))


@pytest.mark.parametrize("changes, reason", [
    ({"preset": "deepseek-v3"}, "61 layers do not split evenly into 56 stages"),
    ({"recompute": "norm, moe"}, "a recomputation not modelled"),
    ({"precision": "not stated"}, "does not state the precision"),
    ({"vp": "4"}, "56 layers do not split evenly into 32 stages"),
    ({"global_batch": "12"}, "does not split into dp=8"),
    ({"global_batch": "16"}, "runs micro-batches in rounds of pp=8"),
])
def test_what_the_program_cannot_run_is_refused_with_its_reason(changes, reason):
    _, _, _, refusals = moe_row_config(_row(**changes))
    assert any(reason in msg for msg in refusals), refusals


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """``validate-model --table megatron_bridge_h100_moe.csv --json``, run once for the
    module: (the process, its JSON). Its ``moe`` rows are ``validate_moe()``'s."""
    out = tmp_path_factory.mktemp("moe") / "v.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "validate-model", "--table",
                           MOE_TABLE, "--json", str(out), "--quiet"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def moe_rows(moe_run):
    return moe_run[1]["moe"]["rows"]


@pytest.mark.slow
def test_validate_moe_predicts_or_refuses_every_row(moe_rows):
    table = read_data_csv(MOE_TABLE)[1]
    assert len(moe_rows) == len(table)
    for i, (got, r) in enumerate(zip(moe_rows, table), 1):
        metric = next(m for m in MOE_METRICS if r[m])
        assert got["case"].startswith(f"#{i} {r['model']} ") and got["metric"] == metric
        assert got["published"] == float(r[metric]) and got["url"] == r["source"]
        assert got["role"] == "held_out" and got["source"] == MOE_TABLE
        if got["status"] == "predicted":
            assert math.isfinite(got["predicted"]) and got["predicted"] > 0
            assert got["rel_error"] == pytest.approx(got["predicted"] / got["published"] - 1)
            assert got["reason"] == "" and got["predicted_tflops"] > 0
        else:
            assert got["status"] in ("refused", "failed") and got["reason"]
            assert got["predicted"] is None and got["rel_error"] is None
    # the models the program runs are predicted: Mixtral (BF16 and FP8) at least
    assert all(g["status"] == "predicted" for g in moe_rows if g["preset"] == "mixtral-8x22b")
    assert sum(g["preset"] == "mixtral-8x22b" for g in moe_rows) == 2
    # Qwen3-235B's 94 layers on 32 stages: Megatron's embedding-and-loss split
    assert any(g["status"] == "predicted" for g in moe_rows if g["preset"] == "qwen3-235b-a22b")
    # GPT-OSS since its experts' and router's biases run (issue 52)
    assert all(g["status"] == "predicted" for g in moe_rows if g["preset"] == "gpt-oss-120b")
    # and what it cannot run yet is refused, not dropped
    refused = {g["preset"] for g in moe_rows if g["status"] == "refused"}
    assert "deepseek-v3" in refused


@pytest.mark.slow
def test_validate_model_prints_the_moe_section_apart(moe_run):
    proc, data = moe_run
    assert data["rows"] == [] and data["mean_abs_rel_error"] is None
    moe = data["moe"]
    assert moe["table"] == MOE_TABLE and moe["role"] == "held_out" and len(moe["rows"]) == 14
    assert moe["predicted"] + moe["refused"] + moe["failed"] == 14 and moe["predicted"] >= 2
    errors = sorted(abs(r["rel_error"]) for r in moe["rows"] if r["status"] == "predicted")
    n = len(errors)
    assert moe["median_abs_rel_error"] == pytest.approx(
        (errors[(n - 1) // 2] + errors[n // 2]) / 2)
    assert moe["max_abs_rel_error"] == pytest.approx(errors[-1])
    assert f"mixture of experts ({MOE_TABLE}, held_out): {moe['predicted']} of 14 rows " \
        "predicted" in proc.stdout
    assert "#1 Mixtral-8x22B BF16 128xH100" in proc.stdout
    deepseek = next(line for line in proc.stdout.splitlines() if "#9 DeepSeekV3" in line)
    # its 61 layers split as its recipe's layout "Et|(tt|)*30mL" (1, 2 x 30, 0: the last
    # stage the head alone; refused before 2026-12-01); the precision it ran in is unstated
    assert "refused: " in deepseek and "precision='not stated'" in deepseek \
        and "do not split evenly" not in deepseek
