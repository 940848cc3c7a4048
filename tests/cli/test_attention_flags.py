"""``--head-dim`` and ``--qk-norm`` (issue 52): a Qwen3 preset simulates as its shape
flags, the flags reach GPTConfig and the title, and a GPT block refuses them by flag."""

from __future__ import annotations

import json

from pipeline_parallel.gpt import GPTConfig
from vcluster.cli.main import main

PLAN = ["--tp", "8", "--pp", "2", "--dp", "2", "--global-batch", "16", "--seq", "2048",
        "--hardware", "h100-dgx", "--allow-oom", "--layers", "4"]
#: Qwen3-32B as flags: 64 heads x 128 = 8192 != hidden 5120, QK-norm
QWEN3_32B = ["--arch", "llama", "--hidden", "5120", "--heads", "64", "--kv-heads", "8",
             "--ffn-hidden", "25600", "--vocab", "151936", "--head-dim", "128", "--qk-norm"]


def _simulate(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["simulate", "train", *args, *PLAN, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_qwen3_preset_simulates_as_its_flags(tmp_path, capsys):
    by_name = _simulate(tmp_path, "model", "--model", "qwen3-32b")
    printed = capsys.readouterr().out
    by_flags = _simulate(tmp_path, "flags", *QWEN3_32B)
    flags_printed = capsys.readouterr().out
    assert printed.startswith("qwen3-32b (Llama h=5120 l=4 a=64 kv=8 f=25600 d=128 qk-norm ")
    assert flags_printed.startswith("Llama h=5120 l=4 a=64 kv=8 f=25600 d=128 qk-norm s=2048")
    for key in ("step_time_s", "peak_memory_gb", "tflops_per_gpu", "mfu"):
        assert by_name[key] == by_flags[key], key
    # the head dimension is priced: d = 64 (a = 64 x 64 = 4096) is a smaller model
    smaller = _simulate(tmp_path, "d64", *QWEN3_32B[:-3], "--head-dim", "64")
    assert smaller["peak_memory_gb"] < by_flags["peak_memory_gb"]


def test_the_flags_reach_the_config_and_a_gpt_block_refuses_them(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "train", "--arch", "llama", "--hidden", "64", "--heads", "4",
                 "--layers", "2", "--vocab", "128", "--seq", "64", "--global-batch", "4",
                 "--head-dim", "24", "--qk-norm", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("Llama h=64 l=2 a=4 kv=4 f=256 d=24 qk-norm")
    assert main(["simulate", "train", "--hidden", "64", "--heads", "4", "--layers", "2",
                 "--vocab", "128", "--seq", "64", "--global-batch", "4", "--qk-norm"]) == 2
    assert "qk_norm=True needs arch='llama'" in capsys.readouterr().err
    assert main(["simulate", "train", "--hidden", "64", "--heads", "4", "--layers", "2",
                 "--vocab", "128", "--seq", "64", "--global-batch", "4", "--head-dim",
                 "8"]) == 2
    assert "head_dim=8 needs arch='llama'" in capsys.readouterr().err
    # beside --model: the flags override the preset's
    config = GPTConfig.of_model("qwen3-32b", 64, timing_only=True, head_dim=64)
    assert (config.head_dim, config.qk_norm) == (64, True)


def test_a_scenario_takes_head_dim_and_qk_norm(tmp_path, capsys):
    """workload.head_dim and workload.qk_norm, emulated: the run's summary names them."""
    path = tmp_path / "qk.yaml"
    path.write_text("workload: {kind: transformer, arch: llama, hidden: 16, heads: 4, "
                    "kv_heads: 2, ffn_hidden: 24, head_dim: 6, qk_norm: true, layers: 2, "
                    "seq: 8, vocab: 32, batch: 4}\nparallel: {tp: 2, micro_batch: 2}\n"
                    "run: {mode: emulate}\n")
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "Llama h=16 l=2 a=4 kv=2 ffn=24 d=6 qk-norm s=8 V=32" in summary
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("arch: llama, ", "").replace(
        "kv_heads: 2, ffn_hidden: 24, head_dim: 6, ", ""))
    assert main(["run", str(bad), "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    assert "workload.qk_norm" in capsys.readouterr().err
