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
    """max / median <= 1.2 over the 3 measured steps (the issue's figure), judged on the
    best of five runs: this shared 2-core machine's noise alone moves one run's step by
    10-20%, while the start-up made step 0 5-10x the others in every run."""
    spreads = []
    for _ in range(5):
        record = run_scenario(load_scenario(QUICKSTART), progress=False)
        times = _measured(record)
        assert len(times) == 3
        spreads.append(float(times.max() / np.median(times)))
        if spreads[-1] <= 1.2:
            break
    assert min(spreads) <= 1.2, spreads
    # the headline and the chart show the same statistic: the median
    assert record.summary["measured_step_time_s"] == pytest.approx(float(np.median(times)))
    label, measured, _ = comparison_rows(record)[0]
    assert label == "step (median)" and measured == pytest.approx(float(np.median(times)))


def test_warmup_zero_is_allowed_and_validated():
    scenario = load_scenario(QUICKSTART, overrides=["run.warmup=0"])
    assert scenario.run.warmup == 0
    with pytest.raises(Exception, match="warmup"):
        load_scenario(QUICKSTART, overrides=["run.warmup=-1"])
