"""reports/: RunRecord tables from real runs, and the report directory write_report makes.

Records come from real runs: collectives and a pipelined MLP on VirtualCluster processes
(measured), their traces replayed by the timing model (predicted), and a pipeline schedule
replayed with known action costs. Figures are checked against independent sources: the
cluster's own byte counters, closed-form bytes per algorithm, the schedule's costs.
"""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

import reports
import reports.write
from mesh import Mesh
from pipelining import make_schedule
from reports import RunRecord, write_report
from reports.results_json import RESULT_KEYS
from vcluster.runtime.tracing import meta_like, trace_program
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace, traces_from_schedule
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.presets import load_hardware

N = 16                                      # rows of each rank's (N, N) float32 input


def _program(dev, x):
    with dev.compute("matmul", flops=2 * N ** 3, bytes=3 * x.nbytes):
        y = x @ x.T
    handle = dev.all_reduce(y, axis="tp", async_op=True)
    with dev.compute("scale", flops=y.size, bytes=2 * y.nbytes):
        y = y * 2
    total = handle.wait()
    gathered = dev.all_gather(total, axis="dp", dim=0)
    ring = dev.all_reduce(x, axis=None, algorithm="ring")
    return gathered.shape, ring.shape


@pytest.fixture(scope="module")
def run(cluster_of):
    return emulated_run(cluster_of)


def emulated_run(cluster_of):
    """One real emulated run of ``_program`` on a 2x2 mesh, and its replay on H100s."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    args = [(np.full((N, N), r + 1, np.float32),) for r in range(mesh.size)]
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    cluster.run(_program, args)
    events, stats = cluster.trace(), cluster.stats()
    traces = trace_program(mesh, _program, [(meta_like(a),) for (a,) in args])
    result = simulate_trace(traces, HardwareCostModel(load_hardware("h100-dgx")), mesh=mesh)
    return mesh, events, stats, result


def _record(run, **over) -> RunRecord:
    mesh, events, _, result = run
    measured_end = max(e.end for e in events) - min(e.start for e in events)
    fields = dict(
        name="collectives 2x2", mode="both", scenario={"cluster": {"shape": [2, 2]}},
        summary={**result.summary(), "measured_step_time_s": measured_end},
        hardware="h100-dgx",
        checks=({"name": "all_gather", "passed": True, "max_abs_error": 0.0,
                 "tolerance": 1e-6},),
        devices=pd.concat([reports.devices_from_events(events, mesh),
                           reports.devices_from_simulation(result, mesh)], ignore_index=True),
        collectives=pd.concat([reports.collectives_from_events(events, mesh),
                               reports.collectives_from_simulation(result, mesh)],
                              ignore_index=True),
        steps=pd.DataFrame({"source": ["measured", "predicted"], "step": [0, 0],
                            "time_s": [measured_end, result.step_time_s]}),
        spans=pd.concat([reports.spans_from_events(events),
                         reports.spans_from_simulation(result)], ignore_index=True))
    fields.update(over)
    return RunRecord(**fields)


# ---------------------------------------------------------------- tables from real runs


def test_device_traffic_matches_the_cluster_counters(run):
    mesh, events, stats, _ = run
    devices = reports.devices_from_events(events, mesh)
    assert list(devices["rank"]) == list(range(4))
    for column in ("bytes_sent", "bytes_received", "messages_sent"):
        assert devices[column].tolist() == stats[column].tolist()
    assert devices["coords"].tolist() == ["(0, 0)", "(0, 1)", "(1, 0)", "(1, 1)"]


def test_measured_time_accounting_adds_up(run):
    mesh, events, _, _ = run
    devices = reports.devices_from_events(events, mesh)
    span = max(e.end for e in events) - min(e.start for e in events)
    total = devices["compute_s"] + devices["exposed_comm_s"] + devices["bubble_s"]
    np.testing.assert_allclose(total, span, rtol=1e-9)
    for r in range(4):                                  # non-nested compute: plain sums
        own = [e for e in events if e.rank == r]
        compute = sum(e.end - e.start for e in own if hasattr(e, "flops"))
        comm = sum(e.end - e.start for e in own if not hasattr(e, "flops"))
        row = devices[devices["rank"] == r].iloc[0]
        assert row["compute_s"] == pytest.approx(compute, rel=1e-9)
        assert row["comm_s"] == pytest.approx(comm, rel=1e-9)
        assert 0 <= row["exposed_comm_s"] <= row["comm_s"] + 1e-12


def test_union_length_counts_overlaps_once():
    assert reports.frames.union_length_s([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert reports.frames.union_length_s([]) == 0.0


def test_collective_bytes_follow_the_closed_forms(run):
    mesh, events, _, _ = run
    table = reports.collectives_from_events(events, mesh).set_index(["collective", "group"])
    x = N * N * 4                                      # one rank's input bytes
    # shm all_gather over n members: each reads the n-1 other shards of x bytes
    for group in ("[0, 2]", "[1, 3]"):
        row = table.loc[("all_gather", group)]
        assert (row["axis"], row["algorithm"], row["calls"]) == ("dp", "shm", 1)
        assert row["bytes"] == 2 * 1 * x
    # ring all_reduce over n members: each sends 2(n-1)/n of x
    row = table.loc[("all_reduce", "[0, 1, 2, 3]")]
    assert (row["axis"], row["algorithm"]) == ("dp,tp", "ring")
    assert row["bytes"] == 4 * 2 * 3 * x // 4
    assert table.loc[("all_reduce", "[0, 1]"), "axis"] == "tp"
    assert (table["time_s"] > 0).all()


def test_predicted_tables_equal_the_simulation_result(run):
    mesh, _, _, result = run
    devices = reports.devices_from_simulation(result, mesh).set_index("rank")
    per_rank = result.per_rank
    for column in ("compute_s", "comm_s", "exposed_comm_s", "bubble_s"):
        np.testing.assert_allclose(devices[column], per_rank[column])
    spans = reports.spans_from_simulation(result)
    assert len(spans) == sum(len(t) for t in result.timelines)
    assert set(spans["stream"]) <= {"compute", "comm", "p2p", "wait"}
    coll = reports.collectives_from_simulation(result, mesh)
    assert sorted(coll["collective"]) == ["all_gather", "all_gather", "all_reduce",
                                          "all_reduce", "all_reduce"]
    assert (coll["calls"] == 1).all() and (coll["time_s"] > 0).all()


def test_pipeline_actions_become_f_b_w_spans():
    """A zero-bubble schedule replayed with known costs: every action is one span."""
    schedule = make_schedule("zero_bubble", ranks=3, microbatches=4)
    cost = {"F": 1.0, "B": 2.0, "W": 0.75}
    result = simulate_trace(traces_from_schedule(schedule, cost["F"], cost["B"], cost["W"]),
                            SimpleCostModel.compute_only())
    spans = reports.spans_from_simulation(result)
    work = spans[spans["stream"] == "compute"]
    assert len(work) == sum(len(a) for a in schedule.actions)
    dur = {"F": cost["F"], "I": cost["B"] - cost["W"], "W": cost["W"], "B": cost["B"]}
    for row in work.itertuples():
        assert row.end_s - row.start_s == pytest.approx(dur[row.name])
    assert set(work["name"]) == {"F", "I", "W"}
    assert sorted(work.loc[work["name"] == "F", "microbatch"].unique()) == [0, 1, 2, 3]
    assert sorted(work["stage"].unique()) == [0, 1, 2]


def test_emulated_mlp_pipeline_spans(cluster_of):
    from pipeline_parallel import MLP
    mesh = Mesh((2,), ("pp",))
    cluster = cluster_of(mesh)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((12, 4)), rng.standard_normal((12, 2))
    cluster.reset_stats()
    MLP([4, 8, 8, 8, 2], seed=0).fit(cluster, X, Y, steps=1, microbatches=3, schedule="1f1b")
    spans = reports.spans_from_events(cluster.trace())
    actions = spans[spans["name"].isin(["F", "B"])]
    for rank in (0, 1):                               # stage = rank; 3 F and 3 B each
        mine = actions[actions["rank"] == rank]
        assert sorted(mine["name"]) == ["B"] * 3 + ["F"] * 3
        assert set(mine["stage"]) == {rank}
        assert sorted(mine["microbatch"]) == [0, 0, 1, 1, 2, 2]
    assert {"send", "recv"} <= set(spans.loc[spans["stream"] == "p2p", "name"])
    assert spans["start_s"].min() == 0.0


# ---------------------------------------------------------------- the report directory


def _is_png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 5, path.name
    return pixels


def _strict_json(path):
    def refuse(token):
        raise ValueError(f"{path.name}: non-standard JSON constant {token}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_full_report(run, tmp_path):
    record = _record(run)
    out = write_report(record, tmp_path / "report")
    names = {p.name for p in out.iterdir()}
    assert names == {"summary.md", "report.html", "results.json", "devices.csv",
                     "collectives.csv", "steps.csv", "trace.json", "timeline.png",
                     "time_breakdown.png", "predicted_vs_measured.png"}
    for name in ("devices", "collectives", "steps"):
        back = pd.read_csv(out / f"{name}.csv")
        assert list(back.columns) == list(getattr(record, name).columns)
        assert len(back) == len(getattr(record, name))
    np.testing.assert_allclose(pd.read_csv(out / "devices.csv")["compute_s"],
                               record.devices["compute_s"])
    for png in ("timeline", "time_breakdown", "predicted_vs_measured"):
        _is_png(out / f"{png}.png")

    results = _strict_json(out / "results.json")
    assert set(RESULT_KEYS) <= set(results)
    assert (results["name"], results["mode"], results["hardware"], results["passed"]) == \
        ("collectives 2x2", "both", "h100-dgx", True)
    for key, value in record.summary.items():
        if isinstance(value, float):
            assert results["summary"][key] == pytest.approx(value)
        else:
            assert results["summary"][key] == value
    assert results["files"]["tables"] == {"devices": "devices.csv",
                                          "collectives": "collectives.csv",
                                          "steps": "steps.csv"}
    assert len(results["devices"]) == 8 and results["sweep"] is None
    for file_name in [*results["files"]["tables"].values(), *results["files"]["plots"].values(),
                      results["files"]["trace"], results["files"]["report_html"]]:
        assert (out / file_name).is_file()

    summary = (out / "summary.md").read_text()
    assert "step_time_s" in summary and "h100-dgx" in summary and "PASSED" in summary
    assert f"{record.summary['step_time_s']:.4g}" in summary

    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert f"{record.summary['step_time_s']:.4g}" in html


#: The parts of the Trace Event Format (Chrome tracing / Perfetto JSON importer) we emit.
TRACE_SCHEMA = {
    "type": "object", "required": ["traceEvents"],
    "properties": {"traceEvents": {"type": "array", "items": {"oneOf": [
        {"type": "object", "required": ["ph", "name", "cat", "ts", "dur", "pid", "tid"],
         "properties": {"ph": {"const": "X"}, "name": {"type": "string"},
                        "cat": {"type": "string"}, "ts": {"type": "number"},
                        "dur": {"type": "number", "minimum": 0},
                        "pid": {"type": "integer"}, "tid": {"type": "integer"},
                        "args": {"type": "object"}}},
        {"type": "object", "required": ["ph", "name", "pid", "tid", "args"],
         "properties": {"ph": {"const": "M"},
                        "name": {"enum": ["process_name", "thread_name",
                                          "process_sort_index", "thread_sort_index"]},
                        "pid": {"type": "integer"}, "tid": {"type": "integer"},
                        "args": {"type": "object"}}}]}},
        "displayTimeUnit": {"enum": ["ms", "ns"]}}}


def test_trace_json_has_one_track_per_device(run, tmp_path):
    import jsonschema
    record = _record(run)
    out = write_report(record, tmp_path / "r", formats=["trace"])
    trace = _strict_json(out / "trace.json")
    jsonschema.validate(trace, TRACE_SCHEMA)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(record.spans)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(p.split()[0] for p in processes.values()) == ["measured", "predicted"]
    for pid in processes:
        assert sorted(tid for p, tid in names if p == pid) == [0, 1, 2, 3]
    assert {(e["pid"], e["tid"]) for e in complete} == set(names)
    spans = record.spans.sort_values(["source", "rank", "start_s"])
    starts = sorted(e["ts"] for e in complete if e["pid"] == 1 and e["tid"] == 2)
    np.testing.assert_allclose(
        starts, sorted(spans.loc[(spans.source == "measured") & (spans["rank"] == 2),
                                 "start_s"] * 1e6))
    for e in complete:
        assert e["dur"] >= 0 and isinstance(e["ts"], float) and e["cat"] == e["args"]["stream"]


@pytest.mark.parametrize("formats, files", [
    (["md"], {"summary.md", "results.json"}),
    (["json"], {"results.json"}),
    ("csv,trace", {"results.json", "devices.csv", "collectives.csv", "steps.csv",
                   "trace.json"}),
    (["png"], {"results.json", "timeline.png", "time_breakdown.png",
               "predicted_vs_measured.png"}),
    (["html"], {"results.json", "report.html"}),
])
def test_formats_select_files(run, tmp_path, formats, files):
    out = write_report(_record(run), tmp_path / "r", formats=formats)
    assert {p.name for p in out.iterdir()} == files
    written = _strict_json(out / "results.json")["files"]
    assert ("report_html" in written) == ("report.html" in files)


def test_a_record_without_checks_never_reads_as_passed(run, tmp_path):
    """Issue 31, item 4: a simulate-only report checks nothing; it used to show a green
    "checks passed" badge and "checks: **PASSED** (0/0)"."""
    record = _record(run, checks=())
    assert record.checks_status == "none" and "checks=none ran" in repr(record)
    out = write_report(record, tmp_path / "r", formats=["md", "html", "json"])
    summary = (out / "summary.md").read_text()
    assert "checks: **none ran**" in summary and "PASSED" not in summary
    html = (out / "report.html").read_text()
    assert 'class="badge none">no checks ran<' in html and "checks passed" not in html
    assert _strict_json(out / "results.json")["checks_status"] == "none"
    failed = _record(run, checks=({"name": "x", "passed": False, "max_abs_error": 1.0,
                                   "tolerance": 0.0},))
    assert failed.checks_status == "failed"
    assert _record(run).checks_status == "passed"


def test_the_scenario_description_is_shown(run, tmp_path):
    """Issue 31, item 9: ``description`` is documented as "shown in the report"."""
    text = "MLP of 8 layers <trained> with 1F1B"
    record = _record(run, scenario={"cluster": {"shape": [2, 2]}, "description": text})
    out = write_report(record, tmp_path / "r", formats=["md", "html"])
    assert text in (out / "summary.md").read_text()
    assert "MLP of 8 layers &lt;trained&gt; with 1F1B" in (out / "report.html").read_text()


def test_html_without_png_files_still_embeds_plots(run, tmp_path):
    out = write_report(_record(run), tmp_path / "r", formats=["html"])
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 3


@pytest.mark.parametrize("formats", [["pdf"], ["md", "xlsx"], 7])
def test_bad_formats_name_the_argument(run, tmp_path, formats):
    with pytest.raises((ValueError, TypeError), match="formats") as info:
        write_report(_record(run), tmp_path / "r", formats=formats)
    if isinstance(formats, list):
        assert "allowed" in str(info.value) and "trace" in str(info.value)
    assert not (tmp_path / "r").exists()
