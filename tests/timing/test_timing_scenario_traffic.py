"""For every bundled scenario that emulates, every sweep point: the traffic the emulator
moves equals what the trace of the same program predicts — per device, per group, call
for call (collective, algorithm, bytes and messages to and from each peer), and so also
in total messages and bytes per device per collective. (scenarios/faults.yaml is run
without its faults: a crash and restart repeat steps, not the program's traffic.)"""

from collections import Counter
from pathlib import Path

import pytest

from vcluster import CommEvent, VirtualCluster
from vcluster.runtime.tracing import comm_signature, trace_comm_signature, trace_program
from vcluster.scenario import build_workload, load_scenario, sweep_points

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
EMULATED = [p for p in sorted((ROOT / "scenarios").glob("*.yaml"))
            if load_scenario(p).run.mode != "simulate"]


def _totals(signature: dict) -> Counter:
    """(collective, 'sent' | 'received', 'bytes' | 'messages') -> total, of one device."""
    out = Counter()
    for entries in signature.values():
        for collective, _, sent, received in entries:
            for way, pairs in (("sent", sent), ("received", received)):
                for _, nbytes, messages in pairs:
                    out[(collective, way, "bytes")] += nbytes
                    out[(collective, way, "messages")] += messages
    return out


def test_every_emulated_scenario_is_covered():
    assert len(EMULATED) >= 10
    assert {p.stem for p in EMULATED} >= {"quickstart", "collective_sweep", "matmul_policies",
                                          "ffn_policies", "mlp_schedules", "transformer"}


@pytest.mark.parametrize("path", EMULATED, ids=[p.stem for p in EMULATED])
def test_emulator_traffic_equals_the_trace(path):
    scenario = load_scenario(path)
    clusters, moved = {}, 0
    try:
        for point in range(len(sweep_points(scenario))):
            w = build_workload(scenario, point)
            if w.mesh not in clusters:
                clusters[w.mesh] = VirtualCluster(w.mesh, timeout_s=120)
            cluster = clusters[w.mesh]
            cluster.reset_stats()
            cluster.run(w.program, list(w.args_by_rank))
            events = [e for e in cluster.trace() if isinstance(e, CommEvent)]
            moved += len(events)
            traces = trace_program(w.mesh, w.program, list(w.meta_args_by_rank))
            assert [t.rank for t in traces] == list(range(w.mesh.size))
            for t in traces:
                predicted, measured = trace_comm_signature(t), comm_signature(events, t.rank)
                assert _totals(predicted) == _totals(measured), (path.stem, point, t.rank)
                assert predicted == measured, (path.stem, point, t.rank)
        assert moved, f"{path.stem}: no communication at all (a vacuous comparison)"
    finally:
        for cluster in clusters.values():
            cluster.close()
