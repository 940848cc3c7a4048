"""reports/: how write_report writes — atomically (a failure leaves nothing, or the
previous report whole) — and its edge cases (empty, non-finite, sweep-only records, many
checks). The tables and the full report: test_reports.py."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import reports
import reports.write
from pipelining import make_schedule
from reports import RunRecord, write_report

from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace, traces_from_schedule

from tests.reports.test_reports import _is_png, _record, _strict_json, emulated_run


@pytest.fixture(scope="module")
def run(cluster_of):
    return emulated_run(cluster_of)


# ---------------------------------------------------------------- atomic behaviour


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_failing_writer_leaves_nothing(run, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in the html writer")
    monkeypatch.setattr(reports.write, "report_html", broken)
    with pytest.raises(RuntimeError, match="injected"):
        write_report(_record(run), tmp_path / "report", formats=["md", "html"])
    assert _leftovers(tmp_path) == []


def test_a_failure_keeps_the_previous_report(run, tmp_path, monkeypatch):
    out = tmp_path / "report"
    write_report(_record(run, name="first"), out, formats=["md", "trace"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(reports.write, "write_chrome_trace",
                        lambda *a: (_ for _ in ()).throw(OSError("disk full (injected)")))
    with pytest.raises(OSError, match="injected"):
        write_report(_record(run, name="second"), out)
    assert _leftovers(tmp_path) == ["report"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_existing_report_is_replaced_whole(run, tmp_path):
    out = tmp_path / "report"
    write_report(_record(run, name="first"), out, formats=["csv"])
    (out / "stale.txt").write_text("from an older run")
    write_report(_record(run, name="second"), out, formats=["md"])
    assert _leftovers(tmp_path) == ["report"]
    assert {p.name for p in out.iterdir()} == {"summary.md", "results.json"}
    assert _strict_json(out / "results.json")["name"] == "second"


def test_out_dir_that_is_a_file_is_refused(run, tmp_path):
    target = tmp_path / "report"
    target.write_text("not a directory")
    with pytest.raises(FileExistsError, match="report"):
        write_report(_record(run), target)
    assert target.read_text() == "not a directory" and _leftovers(tmp_path) == ["report"]


# ---------------------------------------------------------------- edge cases


def test_empty_record(tmp_path):
    record = RunRecord(name="nothing", mode="emulate", scenario={}, summary={})
    out = write_report(record, tmp_path / "r")
    assert {p.name for p in out.iterdir()} == {"summary.md", "report.html", "results.json",
                                               "devices.csv", "collectives.csv", "steps.csv",
                                               "trace.json"}
    assert [e for e in _strict_json(out / "trace.json")["traceEvents"] if e["ph"] == "X"] == []
    results = _strict_json(out / "results.json")
    assert results["devices"] == [] and results["passed"] is True
    assert results["files"]["plots"] == {}
    assert list(pd.read_csv(out / "devices.csv").columns) == list(record.devices.columns)


def test_non_finite_figures_are_null(tmp_path):
    record = RunRecord(name="ratios", mode="simulate", scenario={"k": (1, 2)},
                       summary={"ratio": math.inf, "missing": math.nan, "n": np.int64(3),
                                "ok": np.bool_(True)},
                       checks=({"name": "c", "passed": False, "max_abs_error": 0.5,
                                "tolerance": 1e-3},))
    out = write_report(record, tmp_path / "r", formats=["md", "html"])
    results = _strict_json(out / "results.json")
    assert results["summary"] == {"ratio": None, "missing": None, "n": 3, "ok": True}
    assert results["passed"] is False and results["scenario"] == {"k": [1, 2]}
    assert "FAILED" in (out / "summary.md").read_text()
    assert "checks FAILED" in (out / "report.html").read_text()


def _sweep_record(two_keys: bool) -> RunRecord:
    """A sweep whose figures are closed forms of the varied keys (1F1B bubble)."""
    from pipelining import bubble_fraction_closed_form
    rows = []
    for p in (2, 4):
        for m in ((2, 4, 8, 16) if two_keys else (8,)):
            rows.append({"parallel.stages": p, "parallel.microbatches": m,
                         "bubble_fraction": bubble_fraction_closed_form("1f1b", p, m),
                         "step_time_s": (m + p - 1) * 1e-3})
    sweep = pd.DataFrame(rows)
    if not two_keys:
        sweep = sweep.drop(columns="parallel.microbatches")
    return RunRecord(name="sweep", mode="simulate", scenario={}, summary={"points": len(rows)},
                     sweep=sweep)


@pytest.mark.parametrize("two_keys", [False, True])
def test_sweep_only_record(tmp_path, two_keys):
    record = _sweep_record(two_keys)
    out = write_report(record, tmp_path / "r")
    assert {"sweep.csv", "sweep.png", "results.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "timeline.png").exists()
    _is_png(out / "sweep.png")
    back = pd.read_csv(out / "sweep.csv")
    np.testing.assert_allclose(back["bubble_fraction"], record.sweep["bubble_fraction"])
    results = _strict_json(out / "results.json")
    assert results["files"]["tables"]["sweep"] == "sweep.csv"
    assert results["sweep_keys"] == [c for c in record.sweep.columns if c.startswith("parallel")]
    assert [r["bubble_fraction"] for r in results["sweep"]] == \
        pytest.approx(record.sweep["bubble_fraction"].tolist())
    assert "## Sweep" in (out / "summary.md").read_text()


def test_sweep_points_get_their_own_processes(run, tmp_path):
    """A sweep's tables carry a ``point`` column: one trace process per (point, source)."""
    base = _record(run)
    two = lambda frame: pd.concat([frame.assign(point=0), frame.assign(point=1)],  # noqa: E731
                                  ignore_index=True)[["point", *frame.columns]]
    record = _record(run, spans=two(base.spans), devices=two(base.devices),
                     steps=two(base.steps), collectives=two(base.collectives),
                     sweep=pd.DataFrame({"workload.size": [1, 2], "step_time_s": [0.1, 0.3]}))
    out = write_report(record, tmp_path / "r")
    events = _strict_json(out / "trace.json")["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(processes) == [1, 2, 3, 4]
    assert [processes[p].split(" (")[0] for p in (1, 2, 3, 4)] == \
        ["measured, point 0", "predicted, point 0", "measured, point 1", "predicted, point 1"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 2 * len(base.spans)
    for pid in processes:
        assert sorted({e["tid"] for e in complete if e["pid"] == pid}) == [0, 1, 2, 3]
    for name in ("timeline", "time_breakdown", "predicted_vs_measured", "sweep"):
        _is_png(out / f"{name}.png")


def test_timeline_draws_pipeline_actions_in_their_colours(tmp_path):
    schedule = make_schedule("zero_bubble", ranks=2, microbatches=3)
    result = simulate_trace(traces_from_schedule(schedule, 1.0, 2.0, 0.5),
                            SimpleCostModel.compute_only())
    record = RunRecord(name="zb", mode="simulate", scenario={}, summary={},
                       spans=reports.spans_from_simulation(result))
    out = write_report(record, tmp_path / "r", formats=["png"])
    pixels = _is_png(out / "timeline.png")[..., :3]
    for colour in ("#4c72b0", "#8fd18f", "#dd8452"):       # F, I, W (reports/plots.py)
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255
        assert (np.abs(pixels - rgb) < 0.02).all(axis=-1).sum() > 500, colour


@pytest.mark.parametrize("failing", [(), (3, 17)])
def test_many_checks_list_the_failures(tmp_path, failing):
    checks = tuple({"name": f"rank{i}", "passed": i not in failing, "max_abs_error": 0.0,
                    "tolerance": 1e-6} for i in range(40))
    record = RunRecord(name="many", mode="emulate", scenario={}, summary={}, checks=checks)
    out = write_report(record, tmp_path / "r", formats=["md", "html"])
    md, html = (out / "summary.md").read_text(), (out / "report.html").read_text()
    listed = [f"rank{i}" for i in range(40) if f"| rank{i} |" in md]
    expected = [f"rank{i}" for i in failing] or [f"rank{i}" for i in range(12)]
    assert listed == expected
    assert f"{40 - len(expected)} more checks, all passed" in md
    assert html.count("<td class=\"bad\">FAIL</td>") == len(failing)
    assert len(_strict_json(out / "results.json")["checks"]) == 40
