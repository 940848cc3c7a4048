"""A scenario priced on a cluster file of several GPU kinds (issue 55): ``hardware.file``
names the cluster, mesh rank r runs on the cluster's GPU r and is priced on its own kind.

Held to an independent figure: a transformer whose two data-parallel replicas (tp 8)
run on an A100 node and an H100 node steps exactly as on two A100 nodes (the slower kind
in every respect sets the step; docs/heterogeneous.md), and its MFU is against the two
kinds' mean peak. A mesh of another size than the cluster, or a serving scenario (one
device model), is refused naming the key."""

from pathlib import Path

import pytest
import yaml

from vcluster.scenario import ScenarioError, load_scenario, run_scenario
from vcluster.timing import load_hardware

ROOT = Path(__file__).resolve().parents[2]
A100, H100 = "a100-80gb-dgx", "h100-dgx"

SCENARIO = {
    "name": "mixed",
    "hardware": {"file": "mixed.yaml", "dtype": "bf16"},
    "workload": {"kind": "transformer", "hidden": 512, "layers": 4, "heads": 8, "seq": 256,
                 "vocab": 1024, "batch": 8, "dtype": "float16"},
    "parallel": {"dp": 2, "pp": 1, "tp": 8, "micro_batch": 1},
    "run": {"mode": "simulate"},
}


def _files(tmp_path, first=A100, second=H100) -> Path:
    (tmp_path / "mixed.yaml").write_text(yaml.safe_dump(
        {"name": "mixed", "parts": [{"hardware": first, "nodes": 1},
                                    {"hardware": second, "nodes": 1}]}))
    (tmp_path / "a100.yaml").write_text(yaml.safe_dump(
        {"name": "two-a100", "parts": [{"hardware": A100, "nodes": 2}]}))
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    return path


@pytest.mark.parametrize("order", [(A100, H100), (H100, A100)], ids=["a100-first",
                                                                     "h100-first"])
def test_a_transformer_on_a_cluster_file_steps_at_its_slower_kinds_pace(tmp_path, order):
    path = _files(tmp_path, *order)
    mixed = run_scenario(load_scenario(path)).summary
    a100 = run_scenario(load_scenario(path, ["hardware.file=a100.yaml"])).summary
    assert mixed["hardware"] == "mixed"
    assert mixed["predicted_step_time_s"] == pytest.approx(a100["predicted_step_time_s"],
                                                           rel=1e-12)
    peaks = [load_hardware(k).device.peak_flops("bf16") for k in (A100, H100)]
    # MFU against the mean peak: the same model FLOPs over twice the A100's peak sum
    assert mixed["mfu"] == pytest.approx(a100["mfu"] * 2 * peaks[0] / sum(peaks), rel=1e-9)
    assert mixed["memory_limit_gb"] == pytest.approx(76.0)          # 80 GB less 5% each


def test_a_cluster_of_another_size_or_a_serving_scenario_is_refused(tmp_path):
    path = _files(tmp_path)
    with pytest.raises(ScenarioError, match=r"hardware.file = 'mixed.yaml': cluster 'mixed' "
                                            r"has 16 GPUs; allowed: a cluster of 8 GPUs"):
        run_scenario(load_scenario(path, ["parallel.dp=1"]))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "parts": [{"hardware": A100, "nodes": 0}]}))
    with pytest.raises(ScenarioError, match=r"hardware.file.*nodes: must be an integer >= 1"):
        run_scenario(load_scenario(path, ["hardware.file=bad.yaml"]))
    serving = yaml.safe_load((ROOT / "scenarios" / "serving.yaml").read_text())
    serving["hardware"] = {"file": "mixed.yaml"}
    serving["run"] = {"mode": "simulate"}
    (tmp_path / "serving.yaml").write_text(yaml.safe_dump(serving))
    with pytest.raises(ScenarioError, match=r"hardware.file = 'mixed.yaml': cluster 'mixed' "
                                            r"has 2 GPU kinds; allowed: one GPU kind"):
        run_scenario(load_scenario(tmp_path / "serving.yaml"))
