"""One unit per plot (issue 56): every bar of ``predicted_vs_measured.png`` is seconds per
step. The collectives' bars put a whole run's measured time beside a per-step step bar,
and an op's measured time over all its steps beside one predicted step; now each source's
time is divided by the steps its rows cover (``steps_covered``)."""

import os

import pytest

from reports.plots import comparison_rows
from vcluster.scenario import load_scenario, run_scenario

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name, steps, traced_steps", [
    ("quickstart", 3, 3),              # training: the trace holds every step
    ("collective_all_reduce", 2, 1),   # an op: one traced step stands for each
])
def test_every_bar_is_seconds_per_step(name, steps, traced_steps):
    record = run_scenario(load_scenario(os.path.join(ROOT, "scenarios", f"{name}.yaml")),
                          progress=False)
    coll = record.collectives
    assert set(coll.loc[coll["source"] == "measured", "steps_covered"]) == {steps}
    assert set(coll.loc[coll["source"] == "predicted", "steps_covered"]) == {traced_steps}
    rows = {label: (m, p) for label, m, p in comparison_rows(record)}
    assert "step (median)" in rows and len(rows) > 1
    for (collective, axis), group in coll.groupby(["collective", coll["axis"].fillna("-")]):
        label = f"{collective} [{axis}]"
        if label not in rows:
            continue
        total = group.groupby("source")["time_s"].sum()
        assert rows[label] == pytest.approx((total["measured"] / steps,
                                             total["predicted"] / traced_steps))
