"""Memory in every GPT prediction (issue 31, item 1): a 70B-like model with tp = pp = 1 on
64 H100s used to exit 0 with a step time and no memory anywhere in the report. Now the
summary has the peak per device, the usable memory and ``fits``; the point is flagged in
summary.md, report.html and results.json; ``vcluster run`` exits 1 unless --allow-oom."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

SCENARIO = """\
name: oom70b
hardware: {name: h100-dgx, dtype: bf16}
workload: {kind: transformer, hidden: 8192, layers: 80, heads: 64, seq: 4096,
           vocab: 32000, batch: 64, dtype: float16}
parallel: {dp: 64, pp: 1, tp: 1}
run: {mode: simulate}
"""


def _run(tmp_path, *extra):
    path = tmp_path / "oom.yaml"
    path.write_text(SCENARIO)
    out = tmp_path / ("report" + "".join(extra).replace("-", "_"))
    proc = subprocess.run([sys.executable, "-m", "vcluster", "run", str(path), "--out",
                           str(out), "--quiet", *extra], capture_output=True, text=True,
                          timeout=280)
    return proc, out


def test_a_prediction_that_does_not_fit_is_flagged_and_fails(tmp_path):
    proc, out = _run(tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert ("does not fit the device memory: 1261.7 GB per device > 76.0 GB usable"
            in proc.stderr)
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["fits"] is False
    assert summary["predicted_peak_memory_gb"] == pytest.approx(1261.7, abs=0.1)
    assert summary["memory_limit_gb"] == pytest.approx(76.0)
    assert 0 < summary["mfu"] < 1
    assert "**Does not fit the device memory**" in (out / "summary.md").read_text()
    assert 'class="oom"' in (out / "report.html").read_text()
    assert not (out / "trace.json").exists()          # simulate-only: not unless asked


def test_allow_oom_reports_and_exits_0(tmp_path):
    proc, out = _run(tmp_path, "--allow-oom")
    assert proc.returncode == 0, proc.stderr
    assert "(--allow-oom: reported only)" in proc.stderr


def test_the_distributed_optimizer_key_shards_the_optimizer_state(tmp_path):
    """parallel.distributed_optimizer (issue 26): the optimizer's 12 bytes per parameter
    over dp = 64 ranks. By hand, the one pipeline rank holds 80 layers of 12h² + 13h, both
    embeddings and the head: the peak falls by 12 (1 - 1/64) bytes per parameter."""
    _, out = _run(tmp_path, "--allow-oom")
    _, sharded = _run(tmp_path, "--allow-oom", "--set", "parallel.distributed_optimizer=true")
    before = json.loads((out / "results.json").read_text())["summary"]
    after = json.loads((sharded / "results.json").read_text())["summary"]
    h, layers, V, s = 8192, 80, 32000, 4096
    params = layers * (12 * h * h + 13 * h) + V * h + s * h + V * h + 2 * h
    saved_gb = 12 * params * (1 - 1 / 64) / 1e9
    assert before["predicted_peak_memory_gb"] - after["predicted_peak_memory_gb"] == \
        pytest.approx(saved_gb, rel=1e-6)
