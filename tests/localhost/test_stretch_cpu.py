"""benchmarks/stretch_cpu.py: the thread CPU of each stretch of work between blocking calls,
measured on real devices, beside the localhost model's price of the same stretch. The
measurement is checked against spins of a known CPU; a pipelined program's stretches
are matched one for one with its trace's, with the cold extra where the model charges
it (after the start, not after a receive)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from tests.localhost.test_localhost_gap import _cold_spec

from mesh import Mesh
from vcluster import VirtualCluster

pytestmark = pytest.mark.timeout(180)

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "stretch_cpu.py"
_SPEC = importlib.util.spec_from_file_location("stretch_cpu", _PATH)
stretch_cpu = sys.modules.setdefault("stretch_cpu", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(stretch_cpu)
cloudpickle.register_pickle_by_value(stretch_cpu)      # the devices cannot import it


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _program(dev, x):
    """Rank 0: 30 ms, all_reduce, 10 ms, a send, 5 ms, end; rank 1: all_reduce, recv."""
    if dev.rank == 0:
        _spin(0.030)
        dev.all_reduce(x)
        _spin(0.010)
        dev.send(x, 1, 7)
        _spin(0.005)
    else:
        dev.all_reduce(x)
        dev.recv(0, 7)


def test_measured_stretches_are_the_thread_cpu_between_blocking_calls():
    import numpy as np
    with VirtualCluster(Mesh((2,), ("x",))) as cluster:
        got = stretch_cpu.measured_stretches(cluster, _program,
                                             [(np.ones(4),), (np.ones(4),)], runs=3)
    first, second = got
    assert len(first) == 2 and len(second) == 3        # blocking calls + 1 each
    assert 0.030 <= first[0] < 0.036                   # the send is inside the stretch
    assert 0.015 <= first[1] < 0.021
    assert all(0 <= s < 0.005 for s in second)         # rank 1 only waits


def test_a_pipeline_is_priced_stretch_for_stretch(tmp_path):
    """A 2-stage 1F1B pipeline with more micro-batches than stages: one stretch per
    receive and one from the start on each rank, in the trace and in the runs alike."""
    from vcluster.cli.bench_predict_scenarios import scenario_workloads
    from vcluster.runtime.tracing.ops import TraceRecv
    from vcluster.localhost.cost_model import localhost_model, localhost_traces
    path = tmp_path / "pipe.yaml"
    path.write_text("name: pipe\nworkload:\n  kind: mlp\n  sizes: [16, 32, 32, 32, 8]\n"
                    "  batch: 16\nparallel:\n  pp: 2\n  schedule: 1f1b\n  microbatches: 4\n"
                    "run:\n  mode: emulate\n")
    (wl,) = scenario_workloads([path])
    US = 1e-6
    cold = {4: (30 * US, 40 * US, 60 * US), 8: (40 * US, 50 * US, 70 * US)}   # 2: as 4
    model = localhost_model(_cold_spec(cold), 2, wl.dtype)
    traces = localhost_traces(model, wl.mesh, wl.program, wl.meta_args)
    priced = stretch_cpu.priced_stretches(model, traces)
    with VirtualCluster(wl.mesh) as cluster:
        measured = stretch_cpu.measured_stretches(cluster, wl.program, wl.args, runs=3)
    sums = stretch_cpu.compare(priced, measured)
    receives = sum(isinstance(op, TraceRecv) for t in traces for op in t.ops)
    assert set(sums) == {"start", "recv"} and receives > 0
    assert sums["start"][0] == 2 and sums["recv"][0] == receives
    assert sums["start"][2] > 0 and sums["recv"][2] == 0     # no cold extra after a recv
    assert all(warm > 0 and got > 0 for _, warm, _, got in sums.values())
    with pytest.raises(RuntimeError, match="stretches traced"):
        stretch_cpu.compare(priced, [m[:-1] for m in measured])
