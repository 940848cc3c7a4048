"""``vcluster oracle export`` / ``check`` and ``vcluster run --engine torch`` through the
real entry point (subprocesses), on scenario files."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from vcluster.oracle import load_golden, save_golden

pytestmark = pytest.mark.timeout(600)

FFN = textwrap.dedent("""
    name: ffn_oracle
    cluster:
      mesh: {dp: 2, tp: 2}
    workload:
      kind: ffn
      batch: 2
      seq: 4
      d_model: 8
      d_ff: 16
      backward: true
      seed: 5
    parallel:
      tp: tp
      dp: dp
      policy: Megatron
    run:
      mode: emulate
      check: true
    sweep:
      parallel.policy: [Megatron, GSPMD]
""")

MLP = textwrap.dedent("""
    name: mlp_oracle
    cluster:
      mesh: {pp: 4}
    workload:
      kind: mlp
      sizes: [8, 16, 16, 16, 4]
      batch: 16
      optimizer: sgd
      lr: 0.05
    parallel:
      pp: 4
      schedule: 1f1b
      microbatches: 4
    run:
      mode: emulate
      steps: 1
      check: true
""")


def vcluster(*args, cwd):
    return subprocess.run([sys.executable, "-m", "vcluster", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_export_check_round_trip(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "ffn.yaml").write_text(FFN)
    gold = vcluster("oracle", "export", "ffn.yaml", "--out", "gold", cwd=tmp_path)
    assert gold.returncode == 0, gold.stderr
    assert "gold/point1: 4 ranks" in gold.stdout and "engine emulator" in gold.stdout
    actual = vcluster("oracle", "export", "ffn.yaml", "--out", "actual", "--engine", "torch",
                      cwd=tmp_path)
    assert actual.returncode == 0, actual.stderr
    import torch
    manifest = json.loads((tmp_path / "actual" / "point0" / "manifest.json").read_text())
    assert manifest["engine"] == "torch" and manifest["torch_version"] == torch.__version__
    assert manifest["torch_backend"] == "gloo" and manifest["seed"] == 5
    assert manifest["mesh"] == {"shape": [2, 2], "axes": ["dp", "tp"]}
    assert manifest["scenario"]["point"] == {"parallel.policy": "Megatron"}
    assert set(manifest["dtypes"]) == {"y", "dx", "dW1", "db1", "dW2", "db2"}
    assert set(manifest["arrays"][0]["gradients"]) == {"dx", "dW1", "db1", "dW2", "db2"}
    # the same inputs on both engines: equal content hashes
    g_manifest = json.loads((tmp_path / "gold" / "point0" / "manifest.json").read_text())
    assert g_manifest["arrays"][2]["inputs"] == manifest["arrays"][2]["inputs"]
    ok = vcluster("oracle", "check", "gold", "--actual", "actual", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count(": OK, all 24 (rank, tensor) pairs match") == 2

    # a perturbed backend result: exit 1, naming rank, tensor and index
    golden = load_golden(tmp_path / "actual" / "point1")
    golden.arrays[3]["gradients"]["dW1"][2, 7] *= 1 + 1e-7
    save_golden(golden, tmp_path / "actual" / "point1")
    bad = vcluster("oracle", "check", "gold", "--actual", "actual", cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "rank 3, tensor 'dW1', index (2, 7)" in bad.stdout and "ulps" in bad.stdout
    assert "1 of 2 goldens differ" in bad.stderr

    assert vcluster("oracle", "check", "gold", "--actual", "nowhere", cwd=tmp_path).returncode == 2
    missing = vcluster("oracle", "export", "nofile.yaml", "--out", "x", cwd=tmp_path)
    assert missing.returncode == 2 and "nofile.yaml" in missing.stderr


def test_run_engine_torch_and_mlp_golden(tmp_path):
    """``vcluster run FILE --engine torch`` passes its checks; the 1F1B MLP step exported
    from torch matches the emulator's golden."""
    pytest.importorskip("torch")
    (tmp_path / "mlp.yaml").write_text(MLP)
    run = vcluster("run", "mlp.yaml", "--engine", "torch", "--out", "report", "--quiet",
                   cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checks: **PASSED**" in (tmp_path / "report" / "summary.md").read_text()
    summary = json.loads((tmp_path / "report" / "results.json").read_text())["summary"]
    assert summary["measured_bytes_sent"] is None      # torch does not report its traffic
    assert summary.get("traffic_matches") is None
    assert vcluster("oracle", "export", "mlp.yaml", "--out", "gold", cwd=tmp_path).returncode == 0
    assert vcluster("oracle", "export", "mlp.yaml", "--out", "actual", "--engine", "torch",
                    cwd=tmp_path).returncode == 0
    golden = load_golden(tmp_path / "gold")
    assert any(name.startswith("params") for name in golden.results(3))
    check = vcluster("oracle", "check", "gold", "--actual", "actual", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    # the golden is the numpy reference's training step, not just the emulator's word
    assert np.isfinite(golden.results(3)["losses"]).all()


def test_torchrun_launch_matches_the_golden(tmp_path):
    """``torchrun ... -m vcluster.cli.torchrun FILE --out DIR`` (the multi-node entry,
    here one node with 4 processes) writes results that ``oracle check`` accepts; a
    world size that does not fit the mesh is refused, naming both."""
    pytest.importorskip("torch")
    scenario = FFN.split("sweep:")[0]
    (tmp_path / "ffn.yaml").write_text(scenario)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(torchrun + ["--nproc-per-node", "4", "-m", "vcluster.cli.torchrun",
                                      "ffn.yaml", "--out", "tr", "--backend", "gloo"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "tr" / "manifest.json").read_text())
    assert manifest["engine"] == "torch" and manifest["scenario"]["launcher"] == "torchrun"
    assert vcluster("oracle", "export", "ffn.yaml", "--out", "gold", cwd=tmp_path).returncode == 0
    check = vcluster("oracle", "check", "gold", "--actual", "tr", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    wrong = subprocess.run(torchrun + ["--nproc-per-node", "2", "-m", "vcluster.cli.torchrun",
                                       "ffn.yaml", "--out", "tr2"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert wrong.returncode != 0 and "needs [4] devices" in wrong.stderr
    assert "WORLD_SIZE=2" in wrong.stderr
