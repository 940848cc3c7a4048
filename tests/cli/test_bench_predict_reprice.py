"""``vcluster bench predict --reprice RECORD`` (vcluster/cli/bench_predict_reprice.py): a
saved record's real measurements priced again under its own calibrations. Checked
against the record itself (the same model gives back the same ratios), against
predictions made directly with ``predict_workload`` divided by the round's measured
median (another model gives those), on records of today's form and of the older one,
from the command line and for a scenario file's points."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.cli_helpers import run_cli
from tests.localhost_specs import spec

from vcluster.cli.bench_cmd import add_parser
from vcluster.cli.bench_predict import (build_bench_workload, predict_workload, run_workloads,
                                        stepped)
from vcluster.cli.bench_predict_reprice import record_workloads, reprice, round_medians

pytestmark = pytest.mark.timeout(180)

NAMES = ("all_reduce-1MiB", "all_gather-1MiB")
PREDICTED = ("predicted_by_spec_s", "round_ratios", "ratio", "cpu_ratio", "predicted_cpu_s")


@pytest.fixture(scope="module")
def record():
    """Two tiny workloads, two rounds of two runs, three calibrations (before, between and
    after the rounds), measured for real; specs without host rates price
    deterministically."""
    given = [spec(p2p_latency_s=60e-6), spec(p2p_latency_s=90e-6), spec(p2p_latency_s=120e-6)]
    later = iter(given[1:])
    rec = run_workloads(given[0], [build_bench_workload(n, tiny=True) for n in NAMES], reps=2,
                        rounds=2, recalibrate=lambda: next(later), steps=2)
    rec["tiny"] = True
    return json.loads(json.dumps(rec))                  # as read back from --json


def test_the_same_model_gives_the_record_back(record):
    again = reprice(record)
    assert again["specs"] == record["specs"] and again["steps"] == 2
    for new, old in zip(again["workloads"], record["workloads"]):
        for key in PREDICTED:
            assert new[key] == pytest.approx(old[key], rel=1e-12), key
        assert new["recorded_ratio"] == old["ratio"]
        assert new["measured_runs_s"] == old["measured_runs_s"]      # measurements kept
    assert again["round_median_ratios"] == pytest.approx(record["round_median_ratios"])


def test_another_model_is_paired_with_the_same_rounds(record):
    """Calibrations whose channels copy and reduce 2.5-3x slower: each round's ratio is
    the mean of the new predictions around it over that round's median run, made here
    directly."""
    slower = [spec(channel_copy_bytes_per_s=c, channel_reduce_bytes_per_s=c,
                   channel_all_reduce_bytes_per_s=c) for c in (2e9, 2.5e9, 3e9)]
    changed = dict(record, specs=[s.to_dict() for s in slower])
    again = reprice(changed)
    for new, old in zip(again["workloads"], record["workloads"]):
        wl = stepped(build_bench_workload(old["name"], tiny=True), 2)
        predicted = [predict_workload(wl, s) / 2 for s in slower]
        runs = np.reshape(old["measured_runs_s"], (2, 2))            # 2 rounds of 2 runs
        expect = [np.mean(predicted[r:r + 2]) / np.median(runs[r]) for r in range(2)]
        assert new["round_ratios"] == pytest.approx(expect, rel=1e-12)
        assert new["ratio"] == pytest.approx(np.median(expect), rel=1e-12)
        assert new["ratio"] > old["ratio"]
    assert again["max_error"] == max(abs(r["ratio"] - 1) for r in again["workloads"])


def test_an_older_record_recovers_its_rounds_from_the_pairing(record):
    """Records written before ``measured_round_s`` existed: the round medians come back
    from the predictions and ratios, and the CPU ratio scales with the predicted work."""
    old = json.loads(json.dumps(record))
    for row in old["workloads"]:
        expect = row.pop("measured_round_s")
        row.pop("measured_cpu_round_s")
        assert round_medians(row) == pytest.approx(expect, rel=1e-12)
    again = reprice(old)
    for new, was in zip(again["workloads"], record["workloads"]):
        for key in PREDICTED:
            assert new[key] == pytest.approx(was[key], rel=1e-9), key
    one_spec = {"predicted_by_spec_s": [2.0], "round_ratios": [0.5, 1.0]}
    assert round_medians(one_spec) == [4.0, 2.0]


def test_workloads_are_rebuilt_by_name_or_refused(record):
    built = record_workloads(record)
    assert list(built) == list(NAMES) and built[NAMES[0]].mesh.size == 8
    odd = dict(record, workloads=[dict(record["workloads"][0], name="all_reduce-3MiB")])
    with pytest.raises(ValueError, match="'all_reduce-3MiB' of the record is not among"):
        reprice(odd)
    with pytest.raises(ValueError, match="not a bench predict record"):
        reprice({"workloads": []})


def test_command_line_prints_both_ratios_and_writes_the_record(record, tmp_path, capsys):
    path, out = tmp_path / "record.json", tmp_path / "again.json"
    path.write_text(json.dumps(record))
    assert run_cli(add_parser, ["bench", "predict", "--reprice", str(path),
                                "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    within = sum(abs(r["ratio"] - 1) <= 0.25 for r in record["workloads"])
    assert f"{within} of 2 within 25% (recorded: {within})" in printed     # the same model
    assert printed.splitlines()[1].rstrip().endswith("recorded")             # the header
    again = json.loads(out.read_text())
    assert again["repriced_from"] == str(path) and again["tiny"] is True
    assert [r["recorded_ratio"] for r in again["workloads"]] == \
        [r["ratio"] for r in record["workloads"]]
    # what it would measure is the record's: an option that measures is refused
    for extra in (["--rounds", "3"], ["--scenarios"], ["--tiny"], ["--spec", str(path)]):
        with pytest.raises(ValueError, match=f"--reprice .* drop {extra[0]}"):
            run_cli(add_parser, ["bench", "predict", "--reprice", str(path)] + extra)
    with pytest.raises(ValueError, match="cannot read .*nowhere.json"):
        run_cli(add_parser, ["bench", "predict", "--reprice", str(tmp_path / "nowhere.json")])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        run_cli(add_parser, ["bench", "predict", "--reprice", str(tmp_path / "bad.json")])


def test_a_scenario_record_is_repriced_from_its_files(tmp_path, capsys):
    """A user's scenario file measured for real: the record names the file, and its
    points are rebuilt from it."""
    from vcluster.cli.bench_predict_scenarios import run_scenarios_predict
    mine = tmp_path / "my_all_gather.yaml"
    mine.write_text("name: my_all_gather\ncluster:\n  mesh: {x: 4}\nworkload:\n"
                    "  kind: collective\n  op: all_gather\n  size: 64KiB\n  calls: 2\n"
                    "run:\n  mode: emulate\nsweep:\n  workload.size: [64KiB, 1MiB]\n")
    rec = json.loads(json.dumps(run_scenarios_predict(spec(), reps=1, paths=[mine])))
    assert rec["scenario_paths"] == [str(mine.resolve())]
    again = reprice(rec)
    assert [r["name"] for r in again["workloads"]] == ["my_all_gather/0", "my_all_gather/1"]
    for new, old in zip(again["workloads"], rec["workloads"]):
        assert new["ratio"] == pytest.approx(old["ratio"], rel=1e-12)
    assert again["within_goal"] == rec["within_goal"]
    path = tmp_path / "record.json"
    path.write_text(json.dumps(rec))
    capsys.readouterr()
    assert run_cli(add_parser, ["bench", "predict", "--reprice", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("scenario point") and lines[3].startswith("my_all_gather/1")
    mine.unlink()
    with pytest.raises(ValueError, match="my_all_gather.yaml does not exist"):
        reprice(rec)
