"""What faults cost in simulated time: slow devices and links in a replay
(:mod:`.links`, :func:`.impact.simulate_with_faults`), and the goodput of a run under a
failure rate with checkpoints and restarts (:mod:`.goodput`, :func:`.impact.goodput_table`).

The fault specs themselves are the runtime's (:mod:`vcluster.runtime.faults`), which also
injects them into emulated devices.
"""

from .goodput import (FailureModel, GoodputRun, daly_interval_s, expected_goodput,
                      expected_run_s, expected_segment_s, segment_cv, simulate_goodput,
                      young_interval_s)
from .impact import goodput_table, simulate_with_faults, straggler_table
from .links import DegradedLinks, straggler_map

__all__ = ["DegradedLinks", "straggler_map", "simulate_with_faults", "straggler_table",
           "goodput_table", "FailureModel", "GoodputRun", "daly_interval_s", "expected_goodput",
           "expected_run_s", "expected_segment_s", "segment_cv", "simulate_goodput",
           "young_interval_s"]
