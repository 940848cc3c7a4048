"""``vcluster run`` with localhost hardware measures its emulated runs as the model
predicts them: after a warm-up run, from an instant all devices agree on, with the
start and end protocol's own events dropped (vcluster/scenario/timed_runs.py)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.events import CommEvent
from vcluster.scenario import load_scenario
from vcluster.localhost.start import timed_call
from vcluster.scenario.progress import ProgressBar
from vcluster.scenario.timed_runs import (TIMED_REPEATS, emulate_timed,
                                         measures_like_localhost, step_times, within_run)

pytestmark = pytest.mark.alone   # step times held to wall-clock thresholds

ROOT = Path(__file__).resolve().parents[2]
FIRST_RUN_SLEEP_S = 0.4


def _slow_first_run(dev, x, marker_dir):
    """Rank 0 sleeps the first time it runs (a marker file records that it has); every
    rank then all-reduces ``x`` and, rank 1 only, computes for ~20 ms."""
    marker = Path(marker_dir) / "ran"
    if dev.rank == 0 and not marker.exists():
        marker.write_text("ran")
        time.sleep(FIRST_RUN_SLEEP_S)
    if dev.rank == 1:
        with dev.compute("busy", flops=0, bytes=0):
            end = time.perf_counter() + 0.02
            while time.perf_counter() < end:
                pass
    return dev.all_reduce(x)


@pytest.mark.parametrize("steps", [1, 3])
def test_emulate_timed_warms_up_starts_together_and_keeps_only_the_programs_events(
        tmp_path, steps):
    mesh = Mesh((4,), ("x",))
    xs = [np.full(8, float(r + 1)) for r in range(4)]
    workload = SimpleNamespace(program=_slow_first_run, training=False,
                               args_by_rank=[(x, str(tmp_path)) for x in xs])
    point = SimpleNamespace(run=SimpleNamespace(steps=steps))
    with VirtualCluster(mesh) as cluster, ProgressBar(steps + 1, False) as bar:
        emu = emulate_timed(workload, point, cluster, bar)
    assert (tmp_path / "ran").exists()                     # the warm-up ran the program
    assert len(emu["step_times"]) == steps
    # rank 0's first-run sleep fell in the warm-up; rank 1's 20 ms of work is in every step
    assert all(0.02 <= t < FIRST_RUN_SLEEP_S / 2 for t in emu["step_times"])
    for out in emu["outputs"]:
        np.testing.assert_array_equal(out, np.full(8, 10.0))
    comm = [e for e in emu["events"] if isinstance(e, CommEvent)]
    assert {e.collective for e in comm} == {"all_reduce"}        # no barrier, no broadcast
    assert len(comm) == 4 * steps
    assert [e.rank for e in emu["first_events"] if isinstance(e, CommEvent)].count(0) == 1


def _slow_second_run(dev, x, marker_dir):
    """Rank 0 counts its runs in a file and sleeps in the second (the first timed one);
    every rank all-reduces ``x``."""
    runs = Path(marker_dir) / "runs"
    if dev.rank == 0:
        with runs.open("a") as f:
            f.write("x")
        if runs.read_text() == "xx":
            time.sleep(FIRST_RUN_SLEEP_S)
    return dev.all_reduce(x)


def test_a_measured_run_is_the_median_of_its_repeats(tmp_path):
    """One timed run disturbed (0.4 s) among TIMED_REPEATS does not reach the step time,
    and the step's events are one run's, not every repeat's."""
    mesh = Mesh((4,), ("x",))
    xs = [np.full(8, float(r + 1)) for r in range(4)]
    workload = SimpleNamespace(program=_slow_second_run, training=False,
                               args_by_rank=[(x, str(tmp_path)) for x in xs])
    point = SimpleNamespace(run=SimpleNamespace(steps=1))
    with VirtualCluster(mesh) as cluster, ProgressBar(2, False) as bar:
        emu = emulate_timed(workload, point, cluster, bar)
    assert TIMED_REPEATS >= 3
    assert (tmp_path / "runs").read_text() == "x" * (1 + TIMED_REPEATS)
    assert len(emu["step_times"]) == 1 and emu["step_times"][0] < FIRST_RUN_SLEEP_S / 2
    assert len([e for e in emu["events"] if isinstance(e, CommEvent)]) == 4
    for out in emu["outputs"]:
        np.testing.assert_array_equal(out, np.full(8, 10.0))


class _Event(SimpleNamespace):
    pass


def test_step_times_split_a_training_run_at_its_updates_from_the_common_start():
    events = [_Event(rank=r, name=n, start=s, end=e) for r, n, s, e in [
        (0, "matmul", 1.0, 1.5), (1, "matmul", 1.1, 1.6),
        (0, "optimizer", 2.0, 2.1), (1, "optimizer", 2.0, 2.3),
        (0, "optimizer", 3.0, 3.2), (1, "optimizer", 3.0, 3.1),
        (0, "loss", 3.3, 3.4)]]
    # from the first event to each step's last update
    assert step_times(events, True, 2) == pytest.approx([1.3, 0.9])
    # from a common start before it, the last step running to the run's end
    assert step_times(events, True, 2, start=0.5, end=3.5) == pytest.approx([1.8, 1.2])
    ops = events[:2]
    assert step_times(ops, False, 1) == pytest.approx([0.6])
    assert step_times(ops, False, 1, start=0.9, end=1.7) == pytest.approx([0.8])
    assert step_times([], True, 2) == []


@pytest.mark.parametrize("overrides, expected", [
    (["hardware=localhost", "run.mode=both"], True),
    (["hardware=localhost", "run.mode=emulate"], False),
    (["hardware=a100-80gb-dgx", "run.mode=both"], False),
])
def test_only_localhost_comparisons_measure_like_the_model(overrides, expected):
    s = load_scenario(ROOT / "scenarios" / "collective_all_reduce.yaml", overrides)
    assert measures_like_localhost(s, "emulator") is expected
    assert measures_like_localhost(s, "torch") is False


def test_a_rank_late_to_the_start_protocol_keeps_its_broadcast_out():
    """On a loaded machine a rank can reach the broadcast of the start instant after that
    instant: the broadcast then lies after ``start`` and before ``end`` but is still the
    protocol's (it once made ``traffic_matches`` false); the run begins at ``began``."""
    def event(rank, collective, start, end):
        return CommEvent(rank, collective, (0, 1), "shm", 8, (), (), 0, start, end)

    start, end = 10.0, 20.0
    spans = [(start, end, None, start), (start, end, None, 10.5)]     # rank 1 began late
    events = [event(0, "broadcast", 9.0, 9.1), event(1, "broadcast", 10.2, 10.4),
              event(0, "all_reduce", 10.6, 11.0), event(1, "all_reduce", 10.6, 11.0),
              event(1, "barrier", 19.0, 21.0)]
    kept = within_run(events, spans)
    assert [(e.rank, e.collective) for e in kept] == [(0, "all_reduce"), (1, "all_reduce")]


def test_timed_call_says_when_each_rank_began(cluster_of):
    spans = cluster_of(Mesh((2,), ("x",))).run(timed_call, [(_double, 1.0)] * 2)
    for start, end, result, began in spans:
        assert start <= began <= end and result == 2.0


def _double(dev, x):
    return 2 * x
