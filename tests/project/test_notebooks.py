"""The notebooks in notebooks/ run end to end (nbclient, a real python3 kernel).

Each notebook asserts its own numbers against independent references (numpy, closed
forms, hardware orderings), so a notebook that runs is a notebook whose checks passed.
The notebooks are stored without outputs (strip them before committing).
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120          # per cell; the slowest cell trains an MLP on 4 processes


def test_there_are_at_least_three_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"01_sharding_policies.ipynb",
                                          "02_pipeline_schedules.ipynb",
                                          "03_gpt_what_if.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{path.name} cell {i} has stored outputs; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()                     # raises CellExecutionError naming the failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    rich = [o for o in outputs if "data" in o and {"text/html", "image/png"} & set(o["data"])]
    assert len(rich) >= 3, f"{path.name} displayed fewer than 3 tables or plots"
