"""Notebook displays: ``_repr_html_`` of Mesh, TensorSharding, Schedule, the timing model's
SimulationResult and RunRecord; ``sharding.layout_html``.

The HTML is parsed back (stdlib html.parser) and its cells compared with independent
sources: the row-major rank formula, ``shard_slices``, the result's own numbers.
"""

from __future__ import annotations

import itertools
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from mesh import Mesh
from pipelining import make_schedule
from reports import RunRecord
from sharding import TensorSharding as TS
from sharding import layout_html, shard_slices
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace, traces_from_schedule


class _Tables(HTMLParser):
    """Every <table> as a list of rows of cell texts; captions and cell titles kept."""

    def __init__(self, text: str):
        super().__init__()
        self.tables, self.captions, self.titles = [], [], []
        self._cell = self._caption = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
            if dict(attrs).get("title"):
                self.titles.append(dict(attrs)["title"])
        elif tag == "caption":
            self._caption = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None
        elif tag == "caption":
            self.captions.append(self._caption)
            self._caption = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._caption is not None:
            self._caption += data


def _row_major(dims, coords) -> int:
    rank = 0
    for n, c in zip(dims, coords):
        rank = rank * n + c
    return rank


@pytest.mark.parametrize("dims, axes", [((4,), ("pp",)), ((2, 3), ("dp", "tp")),
                                        ((2, 2, 3), ("pp", "dp", "tp")), ((1, 1), ("a", "b"))])
def test_mesh_html_cells_are_row_major_ranks(dims, axes):
    mesh = Mesh(dims, axes)
    parsed = _Tables(mesh._repr_html_())
    leading = list(itertools.product(*(range(n) for n in dims[:-2])))
    assert len(parsed.tables) == len(leading)
    seen = []
    for lead, table in zip(leading, parsed.tables):
        header, *rows = table
        assert header[1:] == [f"{axes[-1]}={c}" for c in range(dims[-1])]
        for i, row in enumerate(rows):
            for j, cell in enumerate(row[1:]):
                coords = lead + ((j,) if len(dims) == 1 else (i, j))
                assert int(cell) == _row_major(dims, coords)
                seen.append(int(cell))
    assert sorted(seen) == list(range(mesh.size))
    assert len(parsed.titles) == mesh.size and "MeshIndex(" in parsed.titles[0]
    if len(dims) > 2:
        assert parsed.captions == [f"{axes[0]}={c}" for c in range(dims[0])]


def test_large_mesh_html_is_one_line():
    text = Mesh((64, 32), ("dp", "tp"))._repr_html_()
    assert "2048 ranks" in text and "<table" not in text


def test_tensor_sharding_html():
    spec = TS(("dp", "tp"), None, partial="pp")
    table = _Tables(spec._repr_html_()).tables[0]
    assert table == [["dim", "layout"], ["0", "split over dp x tp (major first)"],
                     ["1", "replicated"], ["partial", "unreduced sum over pp"]]
    assert _Tables(TS(None)._repr_html_()).tables[0][1:] == [["0", "replicated"]]


@pytest.mark.parametrize("spec, shape", [(TS("tp", None), (8, 6)),
                                         (TS(None, ("dp", "tp")), (4, 8)),
                                         (TS("dp", None, partial="tp"), (6, 2))])
def test_layout_html_blocks_match_shard_slices(spec, shape):
    mesh = Mesh((2, 2), ("dp", "tp"))
    rows = _Tables(layout_html(spec, mesh, shape)).tables[0][1:]
    assert len(rows) == mesh.size
    for r, row in enumerate(rows):
        slices = shard_slices(shape, spec, mesh, r)
        assert row[2] == "[" + ", ".join(f"{s.start}:{s.stop}" for s in slices) + "]"
        if spec.partial:
            assert row[3] == str(list(mesh.group(spec.partial, r)))


def test_layout_html_rejects_uneven_shapes():
    with pytest.raises(ValueError):
        layout_html(TS("tp", None), Mesh((4,), ("tp",)), (6, 2))


def test_schedule_html_is_the_grid():
    schedule = make_schedule("1f1b", ranks=2, microbatches=3)
    table = _Tables(schedule._repr_html_()).tables[0]
    assert table[0] == ["step", "rank 0", "rank 1"]
    cells = [c for row in table[1:] for c in row[1:] if c]
    assert sorted(cells) == sorted(str(a) for row in schedule.actions for a in row)


def test_simulation_result_html():
    schedule = make_schedule("gpipe", ranks=3, microbatches=2)
    result = simulate_trace(traces_from_schedule(schedule, 1.0, 2.0, 0.0),
                            SimpleCostModel.compute_only())
    summary, per_rank = _Tables(result._repr_html_()).tables
    figures = dict(summary[1:])
    # GPipe, unit costs: makespan (m + p - 1)(F + B) = 4 * 3
    assert float(figures["step_time_s"]) == pytest.approx(12.0)
    assert float(figures["step_time_s"]) == pytest.approx(result.step_time_s, rel=1e-3)
    assert [int(row[0]) for row in per_rank[1:]] == [0, 1, 2]
    for row, stats in zip(per_rank[1:], result.stats):
        assert float(row[1]) == pytest.approx(stats.compute_s, rel=1e-3)   # 2 (F + B) = 6
        assert float(row[4]) == pytest.approx(stats.bubble_s, rel=1e-3, abs=1e-9)


def test_run_record_html():
    record = RunRecord(
        name="record <demo>", mode="emulate", scenario={}, summary={"step_time_s": 0.125},
        checks=({"name": "c", "passed": False, "max_abs_error": 0.5, "tolerance": 0.01},),
        devices=pd.DataFrame({"source": ["measured"], "rank": [0], "coords": ["(0,)"],
                              "compute_s": [0.1], "comm_s": [0.02], "exposed_comm_s": [0.02],
                              "bubble_s": [0.005], "bytes_sent": [64],
                              "bytes_received": [64], "messages_sent": [1]}))
    text = record._repr_html_()
    assert "record &lt;demo&gt;" in text and "checks FAILED" in text and "0.125" in text
    devices = _Tables(text).tables[-1]
    assert devices[0][:4] == ["source", "rank", "coords", "compute_s"]
    assert devices[1][:4] == ["measured", "0", "(0,)", "0.1"]
    assert ".vcluster-record h1" in text and "\nbody{" not in text
    assert np.isclose(float(devices[1][6]), 0.005)


def test_pipeline_html_lists_the_rank_groups_and_the_grid():
    from pipelining import Pipeline
    mesh = Mesh((2, 3), ("dp", "pp"))
    pipe = Pipeline(mesh, "pp", microbatches=4)
    text = pipe._repr_html_()
    assert "0 -&gt; 1 -&gt; 2; 3 -&gt; 4 -&gt; 5" in text         # mesh.groups("pp")
    assert [list(g) for g in mesh.groups("pp")] == [[0, 1, 2], [3, 4, 5]]
    grid = _Tables(text).tables[0]
    assert grid[0] == ["step", "rank 0", "rank 1", "rank 2"]
