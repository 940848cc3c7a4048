"""scenarios/faults.yaml through the real CLI: a crash with restart matches a fault-free
run bit for bit; ``recovery: fail`` names the checkpoint and ``--resume`` continues from
it; bad fault sections exit 2 naming the key path; SIGTERM during ``vcluster run`` leaves
no process, no shared memory and no half-written report."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.interruptible import popen_interruptible
from vcluster.runtime.segments import list_segments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(ROOT, "scenarios", "faults.yaml")

pytestmark = pytest.mark.timeout(300)


def _vcluster(*args, cwd, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "vcluster", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _summary(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)["summary"]


def test_faults_scenario_recovers_bit_identical(tmp_path):
    run = _vcluster("run", FAULTS, "--out", "report", "--quiet",
                    "--set", "checkpoint.dir=ckpt", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    s = _summary(tmp_path / "report")
    assert s["matches_fault_free"] is True and s["checks_passed"] is True
    assert {"kind": "crash", "rank": 3, "at_step": 5} in s["faults_injected"]
    assert {"kind": "slow", "rank": 1, "slowdown": 1.5} in s["faults_injected"]
    [rec] = s["recoveries"]
    assert (rec["rank"], rec["lost_at_step"], rec["resumed_from_step"]) == (3, 5, 4)
    assert rec["checkpoint"].endswith(os.path.join("ckpt", "step-00000004"))
    assert s["final_params_sha256"] == s["fault_free_params_sha256"]
    assert len(s["final_params_sha256"]) == 64
    # the steps table, steps.csv and the headline tell one story: all 8 steps, the one
    # after the restart marked, the last loss the final loss
    with open(tmp_path / "report" / "results.json") as f:
        rows = [r for r in json.load(f)["steps"] if r["source"] == "measured"]
    assert [r["step"] for r in rows] == list(range(8))
    assert [bool(r["note"]) for r in rows] == [k == 4 for k in range(8)]
    assert rows[4]["note"] == "resumed from step 4 after rank 3 was lost at step 5"
    assert rows[-1]["loss"] == pytest.approx(s["final_loss"], rel=1e-12)
    csv = (tmp_path / "report" / "steps.csv").read_text().splitlines()
    assert csv[0] == "source,step,time_s,note,loss" and len(csv) == 1 + 8
    assert "| measured | 8 |" in (tmp_path / "report" / "summary.md").read_text()
    # the goodput table and plot from the measured step, checkpoint and restart times
    report = tmp_path / "report"
    assert (report / "goodput.png").stat().st_size > 1000 and (report / "goodput.csv").is_file()
    with open(report / "results.json") as f:
        goodput = json.load(f)["goodput"]
    assert {row["mtbf_s"] for row in goodput} == {5.0, 30.0, 120.0}
    assert goodput[0]["interval_s"] == pytest.approx(s["goodput_step_time_s"])
    diffs = [(abs(r["goodput_simulated"] - r["goodput_expected"]), r["goodput_expected"],
              r["goodput_stderr"]) for r in goodput if r["goodput_simulated"] is not None]
    assert len(diffs) >= 25                      # few hopeless points are not simulated
    # each Monte Carlo is sized for ~1.5 % relative standard error: within 5 of them
    assert all(se <= 0.03 * e + 0.005 for _, e, se in diffs), diffs
    assert all(d <= 5 * se + 1e-9 and d <= 0.1 * e + 0.02 for d, e, se in diffs), diffs
    assert sum(d for d, _, _ in diffs) / len(diffs) < 0.02
    assert "goodput" in (report / "report.html").read_text()
    # a fault-free run of the same scenario reproduces the hash
    clean = _vcluster("run", FAULTS, "--out", "clean", "--quiet", "--set", "faults=[]",
                      "--set", "checkpoint.dir=ckpt2", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    c = _summary(tmp_path / "clean")
    assert c["final_params_sha256"] == s["final_params_sha256"]
    assert c["faults_injected"] == [] and c["recoveries"] == []


def test_fail_names_the_checkpoint_and_resume_continues(tmp_path):
    failed = _vcluster("run", FAULTS, "--out", "report", "--quiet",
                       "--set", "checkpoint.dir=ckpt", "--set", "checkpoint.recovery=fail",
                       cwd=tmp_path)
    assert failed.returncode == 1
    assert "rank 3 was lost at step 5" in failed.stderr
    assert os.path.join("ckpt", "step-00000004") in failed.stderr
    assert "--resume ckpt" in failed.stderr
    assert not (tmp_path / "report").exists()
    resumed = _vcluster("run", FAULTS, "--out", "report", "--quiet", "--resume", "ckpt",
                        "--set", "faults=[]", "--set", "checkpoint.dir=ckpt", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    r = _summary(tmp_path / "report")
    assert r["resumed_from"] == "ckpt" and r["checks_passed"] is True
    clean = _vcluster("run", FAULTS, "--out", "clean", "--quiet", "--set", "faults=[]",
                      "--set", "checkpoint={}", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    assert _summary(tmp_path / "clean")["final_params_sha256"] == r["final_params_sha256"]


@pytest.mark.parametrize("override,path", [
    ("faults=[{kind: explode, rank: 0}]", "faults[0].kind"),
    ("faults=[{kind: crash, rank: 9, at_step: 1}]", "faults[0].rank"),
    ("faults=[{kind: crash, rank: 1, at_step: 8}]", "faults[0].at_step"),
    ("faults=[{kind: crash, rank: 1}]", "faults[0].at_step"),
    ("faults=[{kind: slow, rank: 1, slowdown: 0.5}]", "faults[0].slowdown"),
    ("faults=[{kind: slow, rank: 1, speed: 2}]", "faults[0].speed"),
    ("faults=[{kind: link, ranks: [1, 1], bandwidth_factor: 0.5}]", "faults[0].ranks"),
    ("faults=[{kind: jitter, max_delay_s: 0}]", "faults[0].max_delay_s"),
    ("faults=[{kind: jitter, max_delay_s: 0.001, probability: 1.5}]", "faults[0].probability"),
    ("checkpoint.every=0", "checkpoint.every"),
    ("checkpoint.recovery=retry", "checkpoint.recovery"),
])
def test_bad_fault_sections_exit_2_naming_the_key(tmp_path, override, path):
    bad = _vcluster("validate", FAULTS, "--set", override, cwd=tmp_path)
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    assert path in bad.stderr, bad.stderr


def test_a_jittered_run_matches_the_fault_free_one(tmp_path):
    """The jitter stress mode: every device pauses at random around its communication;
    the 1F1B pipeline's training still equals the fault-free run bit for bit."""
    run = _vcluster("run", FAULTS, "--out", "report", "--quiet", "--set", "checkpoint={}",
                    "--set", "faults=[{kind: jitter, max_delay_s: 0.002, seed: 3}]",
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    s = _summary(tmp_path / "report")
    assert s["faults_injected"] == [{"kind": "jitter", "max_delay_s": 0.002,
                                     "probability": 0.25, "seed": 3}]
    assert s["matches_fault_free"] is True and s["checks_passed"] is True
    assert s["final_params_sha256"] == s["fault_free_params_sha256"]


def test_faults_only_for_training_workloads(tmp_path):
    scenario = os.path.join(ROOT, "scenarios", "collective_all_reduce.yaml")
    bad = _vcluster("validate", scenario, "--set", "faults=[{kind: slow, rank: 0, "
                    "slowdown: 2}]", cwd=tmp_path)
    assert bad.returncode == 2 and "faults = " in bad.stderr and "mlp" in bad.stderr


def test_simulated_straggler_and_slow_link_lengthen_the_predicted_step():
    from vcluster.scenario import load_scenario, run_scenario
    base = ["run.mode=simulate", "checkpoint={}", "run.check=false"]
    clean = run_scenario(load_scenario(FAULTS, base + ["faults=[]"])).summary
    slow = run_scenario(load_scenario(FAULTS, base + [
        "faults=[{kind: slow, rank: 1, slowdown: 2.0}]"])).summary
    link = run_scenario(load_scenario(FAULTS, base + [
        "faults=[{kind: link, ranks: [0, 2], bandwidth_factor: 0.01}]"])).summary
    assert slow["predicted_step_time_s"] > 1.3 * clean["predicted_step_time_s"]
    assert link["predicted_step_time_s"] > clean["predicted_step_time_s"]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 128 + signal.SIGTERM, "terminated"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_signal_during_vcluster_run_leaves_nothing(tmp_path, sig, code, word):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = popen_interruptible(
        [sys.executable, "-m", "vcluster", "run", FAULTS, "--out", "report", "--quiet",
         "--set", "faults=[]", "--set", "run.steps=400", "--set", "checkpoint.every=1",
         "--set", "checkpoint.dir=ckpt"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ckpt").is_dir() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    family = _descendants(proc.pid)
    assert len(family) >= 5, family                   # launcher + 4 devices at least
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert word in err
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in family if _alive(p)]
    assert not [s for s in list_segments() if s.split("-")[1] == str(proc.pid)]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]   # no report, no temporary report
    assert all(n.startswith("step-") or n.startswith(".") for n in os.listdir(tmp_path / "ckpt"))


def test_faults_need_the_emulator_engine(tmp_path):
    bad = _vcluster("run", FAULTS, "--engine", "torch", "--out", "report", "--quiet",
                    cwd=tmp_path)
    assert bad.returncode == 2 and "--engine = 'torch'" in bad.stderr
    assert not (tmp_path / "report").exists()
