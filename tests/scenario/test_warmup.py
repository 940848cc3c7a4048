"""Measurements exclude start-up (issue 31, item 2): the quick start's step 0 took 0.154 s
against 0.013-0.014 s for the others (devices up to 129 ms apart, rank 2 waiting 132 ms
in its first recv), and the chart showed the mean step while the headline was the
median. Now a warm-up run precedes the measured one, which starts at an instant all
devices agree on, and the chart shows the headline's statistic."""

import os

import numpy as np
import pytest

from reports.plots import comparison_rows
from vcluster.scenario import load_scenario, run_scenario

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "scenarios", "quickstart.yaml")
# alone: the test compares step times with each other
pytestmark = [pytest.mark.alone, pytest.mark.timeout(300)]


def _measured(record):
    steps = record.steps
    return steps.loc[steps["source"] == "measured", "time_s"].to_numpy()


@pytest.mark.alone          # holds the wall clock to account: no test beside it
def test_quickstart_steps_agree_after_the_warm_up():
    """Step 0 carries no start-up: before the warm-up it was 5-10x the other steps in every
    run (0.154 s against 0.013-0.014 s); now step 0 / the median of the others <= 2,
    judged on the best of five runs. The bound separates that bug from this machine's
    noise, not steps from each other: with another CPU-bound process beside the suite the
    max / median of three steps measured 1.2-1.9 (issue 56), so a tighter bound failed
    on noise alone. The 8 devices share 2 cores, and any other process takes cores from
    them."""
    ratios = []
    for _ in range(5):
        record = run_scenario(load_scenario(QUICKSTART), progress=False)
        times = _measured(record)
        assert len(times) == 3
        ratios.append(float(times[0] / np.median(times[1:])))
        if ratios[-1] <= 2.0:
            break
    assert min(ratios) <= 2.0, ratios
    # the headline and the chart show the same statistic: the median
    assert record.summary["measured_step_time_s"] == pytest.approx(float(np.median(times)))
    label, measured, _ = comparison_rows(record)[0]
    assert label == "step (median)" and measured == pytest.approx(float(np.median(times)))


def test_warmup_zero_is_allowed_and_validated():
    scenario = load_scenario(QUICKSTART, overrides=["run.warmup=0"])
    assert scenario.run.warmup == 0
    with pytest.raises(Exception, match="warmup"):
        load_scenario(QUICKSTART, overrides=["run.warmup=-1"])
