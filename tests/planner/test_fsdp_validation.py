"""MosaicML LLM Foundry's measured MPT throughput under FSDP (``llm_foundry_mpt.csv``,
:func:`vcluster.planner.validation.validate_fsdp`): the shipped rows are the published
ones, the architecture the simulator runs is MPT's (parameter for parameter), and a row's
prediction is what ``vcluster simulate gpt`` says for the same command line."""

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.memory import rank_params
from vcluster.planner.validation import FSDP_HARDWARE, FSDP_TABLE, validate_fsdp
from vcluster.timing import read_data_csv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)


def _table():
    return read_data_csv(FSDP_TABLE)[1]


def test_the_three_published_tables_are_shipped_whole_with_their_source():
    comments, rows = read_data_csv(FSDP_TABLE)
    assert "mosaicml/llm-foundry" in comments[0] and "061f2c7ce64e6551" in comments[0]
    assert Counter(r["gpu"] for r in rows) == {"h100_80gb": 52, "a100_80gb": 61,
                                               "a100_40gb": 78}
    assert set(FSDP_HARDWARE) == {r["gpu"] for r in rows}
    # the first and last rows of the README's tables, as published
    assert (rows[0]["model"], rows[0]["gpus"], rows[0]["tokens_per_s"]) == ("70b", "64", "66523")
    assert (rows[-1]["model"], rows[-1]["seq"], rows[-1]["tokens_per_s"]) == \
        ("125m", "512", "1253886")
    for r in rows:
        mb, ga, gpus = int(r["micro_batch"]), int(r["grad_accum"]), int(r["gpus"])
        assert int(r["global_batch"]) == mb * ga * gpus, r
        assert r["activation_checkpointing"] in ("0", "1")


def test_each_row_is_mpts_architecture_parameter_for_parameter():
    """MPT ties its output head to the input embedding, as the modelled GPT with
    tie_embeddings: its count (the memory model's, on one stage) is the published
    NumParams exactly; untied, one vocab x hidden more."""
    for r in _table():
        cfg = GPTConfig(hidden=int(r["hidden"]), layers=int(r["layers"]),
                        heads=int(r["heads"]), seq=int(r["seq"]), vocab=int(r["vocab"]),
                        tie_embeddings=True)
        par = ParallelConfig(global_batch=1)
        assert rank_params(cfg, par, 0) == int(r["num_params"]), r
        untied = rank_params(dataclasses.replace(cfg, tie_embeddings=False), par, 0)
        assert untied - cfg.vocab * cfg.hidden == int(r["num_params"]), r


@pytest.mark.parametrize("index", [0, 52 + 10, 52 + 61 + 45])   # an H100, A100-80GB, A100-40GB
def test_a_row_is_the_simulate_command_a_user_types(index, tmp_path):
    r = _table()[index]
    (row,) = validate_fsdp([r])
    assert row["source"] == FSDP_TABLE and row["metric"] == "tokens_per_s"
    assert row["published"] == float(r["tokens_per_s"])
    assert row["rel_error"] == pytest.approx(row["predicted"] / row["published"] - 1)
    assert row["gpu"] == r["gpu"] and isinstance(row["fits"], bool)
    out = tmp_path / "sim.json"
    argv = ["--hidden", r["hidden"], "--layers", r["layers"], "--heads", r["heads"],
            "--seq", r["seq"], "--vocab", r["vocab"], "--dp", r["gpus"], "--zero", "3",
            "--micro-batch", r["micro_batch"], "--global-batch", r["global_batch"],
            "--hardware", FSDP_HARDWARE[r["gpu"]], "--tie-embeddings", "--allow-oom",
            "--attention", "flash-v1", "--json", str(out)]
    if r["activation_checkpointing"] == "1":
        argv += ["--recompute", "full"]
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *argv],
                          capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    sim = json.loads(out.read_text())
    tokens = int(r["global_batch"]) * int(r["seq"])
    assert row["predicted"] == pytest.approx(tokens / sim["step_time_s"], rel=1e-9)
    assert row["fits"] == sim["fits"]
    assert row["case"].startswith(f"MPT-{r['model']} s={r['seq']} {r['gpus']}x")


def test_validate_model_keeps_only_the_tables_asked_for(tmp_path):
    """One table asked for (NCCL's, the quickest: collectives alone) and nothing else run,
    the FSDP section included."""
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "validate-model", "--table",
                           "nccl_a100.csv", "--json", str(out)], capture_output=True,
                          text=True, timeout=250, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {r["table"] for r in data["rows"]} == {"nccl_a100.csv"}
    assert len(data["rows"]) == 5 and data["fsdp"] is None
    assert data["fit_mean_abs_rel_error"] is None
    assert "fit (0 rows): -" in proc.stdout and "by GPU" not in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "vcluster", "validate-model", "--table",
                           "nope.csv"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "invalid choice: 'nope.csv'" in proc.stderr
