"""The ``localhost`` hardware: its spec, the shared core pool of the replay, its cost model
against the traffic model's bytes, and a real (short) calibration (``vcluster bench
predict``: tests/cli/test_bench_predict.py). No timing assertions: this machine is noisy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vcluster.runtime.tracing.ops import (DeviceTrace, TraceCollective, TraceCompute, TraceRecv,
                                          TraceSend)
from vcluster.runtime.traffic import collective_traffic
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace
from vcluster.localhost.cost_model import (LocalhostCostModel, LocalhostSpec, load_localhost_spec,
                                       save_localhost_spec)
from vcluster.timing.core_pool import CorePoolSpec

ROOT = str(Path(__file__).resolve().parents[2])

from tests.localhost_specs import MIB, spec

pytestmark = pytest.mark.timeout(120)

UNIT = SimpleCostModel.compute_only(1.0)        # a compute op of f flops takes f seconds


def traces(*rows) -> list[DeviceTrace]:
    return [DeviceTrace(r, tuple(ops)) for r, ops in enumerate(rows)]


# --- the spec -----------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_spec_round_trips_through_a_file(tmp_path, suffix):
    s = spec()
    save_localhost_spec(s, tmp_path / f"spec{suffix}")
    assert load_localhost_spec(tmp_path / f"spec{suffix}") == s
    assert LocalhostSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_saving_a_spec_replaces_the_file_atomically(tmp_path, monkeypatch):
    """Saving over a spec leaves the new one and no temporary file; a save that fails
    while writing leaves the old one whole."""
    path = tmp_path / "spec.json"
    save_localhost_spec(spec(), path)
    save_localhost_spec(spec(cores=4), path)
    assert load_localhost_spec(path).cores == 4
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]

    def broken(*args):
        raise OSError("disk full")
    monkeypatch.setattr("os.fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        save_localhost_spec(spec(cores=8), path)
    assert load_localhost_spec(path).cores == 4
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="gemm_float32_flops_per_s"):
        spec(gemm_float32_flops_per_s=0.0)
    with pytest.raises(ValueError, match="group_sizes"):
        spec(barrier_s=(1e-5, 2e-5))
    with pytest.raises(ValueError, match="throughput point"):
        spec(pool_throughput=((2, 2.5),))               # more than 2 cores' worth
    with pytest.raises(ValueError, match="missing fields"):
        LocalhostSpec.from_dict({"cores": 2})
    with pytest.raises(ValueError, match="dtype"):
        LocalhostCostModel(spec(), 8, "int8")


# --- the core pool --------------------------------------------------------------------------
@pytest.mark.parametrize("devices, cores", [(8, 2), (4, 2), (2, 2), (1, 2), (3, 1), (6, 4),
                                            (5, 3)])
def test_compute_bound_devices_share_the_cores(devices, cores):
    """N devices each computing w seconds of work on C ideal cores: max(1, N/C) w."""
    w = 0.25
    rows = [[TraceCompute("gemm", w, 0)] for _ in range(devices)]
    alone = simulate_trace(traces(rows[0]), UNIT, core_pool=cores).step_time_s
    together = simulate_trace(traces(*rows), UNIT, core_pool=cores)
    assert alone == pytest.approx(w, rel=1e-12)
    assert together.step_time_s == pytest.approx(max(1.0, devices / cores) * w, rel=1e-12)
    assert all(st.end_s == pytest.approx(together.step_time_s, rel=1e-12)
               for st in together.stats)                # processor sharing: all end together
    assert simulate_trace(traces(*rows), UNIT).step_time_s == w   # no pool: a core each


def test_pool_shares_by_processor_sharing_and_measured_throughput():
    # one core: 1 s and 3 s of work start together; each runs at 1/2 until the first ends
    res = simulate_trace(traces([TraceCompute("a", 1.0, 0)], [TraceCompute("b", 3.0, 0)]),
                         UNIT, core_pool=1)
    assert [st.end_s for st in res.stats] == pytest.approx([2.0, 4.0], rel=1e-12)
    # 8 jobs on 2 cores whose 8-busy throughput is 1.6 single cores: 8 w / 1.6
    pool = CorePoolSpec(2, ((2, 2.0), (8, 1.6)))
    assert pool.throughput_at(1) == 1.0 and pool.throughput_at(5) == pytest.approx(1.8)
    rows = [[TraceCompute("c", 0.5, 0)] for _ in range(8)]
    res = simulate_trace(traces(*rows), UNIT, core_pool=pool)
    assert res.step_time_s == pytest.approx(8 * 0.5 / 1.6, rel=1e-12)


def test_pool_validation():
    with pytest.raises(ValueError, match="symmetric"):
        simulate_trace(traces([TraceCompute("c", 1.0, 0)]), UNIT, symmetric=True, core_pool=2)
    with pytest.raises(TypeError, match="core_pool"):
        simulate_trace(traces([TraceCompute("c", 1.0, 0)]), UNIT, core_pool=2.5)
    with pytest.raises(ValueError, match="cores"):
        CorePoolSpec(0)


def test_collective_and_sends_use_the_pool():
    model = LocalhostCostModel(spec(), 8, "float32")
    pool = CorePoolSpec(8)                               # a core each: the model's own times
    ar = TraceCollective("all_reduce", tuple(range(8)), 4 * MIB, 4, "shm")
    res = simulate_trace(traces(*[[ar]] * 8), model, core_pool=pool)
    assert res.step_time_s == pytest.approx(model.collective_time_s(ar), rel=1e-12)
    # on 2 cores the 8 members' equal shares take 8 / T(8) times as long
    res = simulate_trace(traces(*[[ar]] * 8), model, core_pool=model.core_pool)
    assert res.step_time_s == pytest.approx(8 / 1.8 * model.collective_cpu_s(ar, 0), rel=1e-12)
    # a send: the sender's copy, then the receiver's, one after the other
    send, recv = TraceSend(1, 2 * MIB, 7), TraceRecv(0, 2 * MIB, 7)
    res = simulate_trace(traces([send], [recv]), model, core_pool=2)
    assert res.step_time_s == pytest.approx(model.p2p_time_s(0, 1, 2 * MIB), rel=1e-12)
    assert res.stats[0].end_s == pytest.approx(model.p2p_cpu_s(0, 1, 2 * MIB)[0], rel=1e-12)


def test_asynchronous_collective_shares_the_cores_with_compute():
    """Each of 2 ranks on 2 cores: 1 s of compute, an async all_reduce (share c) issued
    with a second 1 s of compute, then a wait. From t = 1 four jobs share the 2 cores
    (rate 1/2) until the shares end at 1 + 2c; the computes then finish alone: 2 + c."""
    from vcluster.runtime.tracing.ops import TraceWait
    model = LocalhostCostModel(spec(), 2, "float32")
    ar = TraceCollective("all_reduce", (0, 1), 4 * MIB, 4, "shm", 0, handle=0)
    c = model.collective_cpu_s(ar, 0)
    assert 0 < c < 1
    row = [TraceCompute("f", 0, 0, seconds=1.0), ar, TraceCompute("g", 0, 0, seconds=1.0),
           TraceWait(0)]
    res = simulate_trace(traces(row, row), model, core_pool=2)
    assert res.step_time_s == pytest.approx(2 + c, rel=1e-12)


# --- the cost model ---------------------------------------------------------------------------
def _read_bytes(collective: str, n: int, nbytes: int) -> int:
    """What member 0 reads: the traffic model's bytes from its peers plus its own piece,
    the same piece it reads from each peer."""
    t = collective_traffic(collective, "shm", tuple(range(n)), 0, nbytes, 4)
    return t.bytes_received * n // (n - 1)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("collective, rate", [
    ("all_gather", "channel_copy_bytes_per_s"), ("all_to_all", "channel_copy_bytes_per_s"),
    ("reduce_scatter", "channel_reduce_bytes_per_s"),
    ("all_reduce", "channel_all_reduce_bytes_per_s")])
def test_collective_work_follows_the_traffic_models_bytes(n, collective, rate):
    s = spec()
    model = LocalhostCostModel(s, 8, "float32")

    def work(nbytes):
        return model.collective_cpu_s(TraceCollective(collective, tuple(range(n)), nbytes, 4,
                                                      "shm"), 0)
    x = n * 64 * 1024
    moved = _read_bytes(collective, n, 2 * x) - _read_bytes(collective, n, x)
    if collective == "all_reduce":          # it also writes its reduced chunk to every output
        t1, t2 = (collective_traffic("all_reduce", "shm", tuple(range(n)), 0, b, 4)
                  for b in (x, 2 * x))
        moved += (t2.bytes_sent - t1.bytes_sent) * n // (n - 1)
    assert work(2 * x) - work(x) == pytest.approx(moved / getattr(s, rate), rel=1e-9)
    assert work(x) > moved / getattr(s, rate)            # plus the synchronisation share


def test_small_collectives_cost_their_latency_share():
    s = spec()
    model = LocalhostCostModel(s, 8)
    group = tuple(range(4))
    inline = TraceCollective("all_reduce", group, 8, 8, "shm")
    barrier = TraceCollective("barrier", group, 0, 1, "shm")
    t4 = s.core_pool.throughput_at(4)
    assert model.collective_cpu_s(inline, 2) == pytest.approx(160e-6 * t4 / 4)
    assert model.collective_cpu_s(barrier, 0) == pytest.approx(70e-6 * t4 / 4)
    # between table sizes: log-log interpolation of the wall time
    b6 = model.collective_cpu_s(TraceCollective("barrier", tuple(range(6)), 0, 1, "shm"), 0)
    wall6 = 70e-6 * (6 / 4) ** math.log2(200 / 70)
    assert b6 == pytest.approx(wall6 * s.core_pool.throughput_at(6) / 6)
    # ring messages: each message a p2p latency share, each byte a channel copy
    ring = TraceCollective("all_gather", group, MIB, 4, "ring")
    t = collective_traffic("all_gather", "ring", group, 0, MIB, 4)
    side = s.p2p_latency_s / 2
    copy = (t.bytes_sent + t.bytes_received) * (1.8 / 1.5) / s.p2p_copy_bytes_per_s
    assert model.collective_cpu_s(ring, 0) == pytest.approx(
        (t.messages_sent + t.messages_received) * side + copy)
    with pytest.raises(ValueError, match="cluster of 8"):
        model.collective_cpu_s(TraceCollective("barrier", tuple(range(16)), 0, 1, "shm"), 0)


def test_compute_prices_products_and_elementwise_work():
    s = spec()
    model = LocalhostCostModel(s, 8, "float32")
    m = k = n = 512
    gemm = TraceCompute("matmul", 2 * m * k * n, (m * k + k * n + m * n) * 4)
    assert model.compute_time_s(gemm) == pytest.approx(
        3e-6 + gemm.flops / 125e9 + gemm.bytes * (1.8 / 1.5) / 11e9)   # streaming: f_copy
    gelu = TraceCompute("gelu", 9 * m * n, 2 * m * n * 4)   # numpy elementwise: low intensity
    assert model.compute_time_s(gelu) == pytest.approx(3e-6 + gelu.flops * (1.8 / 1.8) / 0.8e9)
    assert LocalhostCostModel(s, 8, "float64").compute_time_s(gelu) > model.compute_time_s(gelu)
    assert model.compute_time_s(TraceCompute("timed", 1e12, 1, seconds=0.125)) == 0.125


BUSY = dict(barrier_cpu_s=(40e-6, 60e-6, 90e-6), small_all_reduce_cpu_s=(90e-6, 150e-6, 190e-6),
            large_all_reduce_cpu_s=(200e-6, 300e-6, 450e-6), p2p_message_cpu_s=55e-6)


def test_busy_cpu_per_call_is_the_members_share():
    """With the busy-CPU tables, a small call's share is the table (log-log between
    sizes), a message side is p2p_message_cpu_s, a large call's fixed part scales with
    the 4 KiB all_reduce's CPU; without them (older specs) the wall-time shares stay."""
    s, old = spec(**BUSY), spec()
    model, before = LocalhostCostModel(s, 8), LocalhostCostModel(old, 8)
    group = tuple(range(4))
    barrier = TraceCollective("barrier", group, 0, 1, "shm")
    inline = TraceCollective("all_reduce", group, 8, 8, "shm")
    assert model.collective_cpu_s(barrier, 1) == pytest.approx(60e-6)
    assert model.collective_cpu_s(inline, 3) == pytest.approx(150e-6)
    b6 = model.collective_cpu_s(TraceCollective("barrier", tuple(range(6)), 0, 1, "shm"), 0)
    assert b6 == pytest.approx(60e-6 * (6 / 4) ** math.log2(90 / 60))
    assert model.p2p_cpu_s(0, 1, 8) == (55e-6, 55e-6)
    assert model.p2p_time_s(0, 1, 8) == pytest.approx(110e-6)
    x = 4 * MIB                                          # large: only the fixed part changes
    big = TraceCollective("all_gather", group, x, 4, "shm")
    wall_share = 400e-6 * old.core_pool.throughput_at(4) / 4      # L(4) T(4) / 4
    assert model.large_share_s(4) == pytest.approx(300e-6)
    assert model.collective_cpu_s(big, 0) - before.collective_cpu_s(big, 0) == pytest.approx(
        (300e-6 - wall_share) * model._fixed_ratio("all_gather"))
    assert before.collective_cpu_s(barrier, 1) == pytest.approx(
        70e-6 * old.core_pool.throughput_at(4) / 4)
    assert before.p2p_cpu_s(0, 1, 8) == (30e-6, 30e-6)


def test_host_overheads_enter_the_replay_as_documented():
    """Hand-computed small traces on the core pool (T(1) = 1, T(2) = 1.9):
    one empty op alone takes compute_overhead_s; two devices each doing one and then a
    barrier take (overhead + barrier CPU) / (1.9 / 2); an 8-byte message takes its two
    sides one after the other (the receiver's once the data is there)."""
    s = spec(**BUSY, compute_overhead_s=20e-6)
    model = LocalhostCostModel(s, 8)
    empty = TraceCompute("empty", 0, 0)
    assert model.compute_time_s(empty) == 20e-6
    one = simulate_trace(traces([empty]), model, core_pool=model.core_pool)
    assert one.step_time_s == pytest.approx(20e-6)
    assert one.pool_work_s == pytest.approx(20e-6)                # the work the pool served
    pair = (0, 1)
    row = [empty, TraceCollective("barrier", pair, 0, 1, "shm")]
    two = simulate_trace(traces(row, row), model, core_pool=model.core_pool)
    assert two.step_time_s == pytest.approx((20e-6 + 40e-6) / (1.9 / 2))
    assert two.pool_work_s == pytest.approx(2 * (20e-6 + 40e-6))
    assert simulate_trace(traces(row, row), model).pool_work_s is None     # no pool
    msg = simulate_trace(traces([TraceSend(1, 8, 0)], [TraceRecv(0, 8, 0)]), model,
                         core_pool=model.core_pool)
    assert msg.step_time_s == pytest.approx(2 * 55e-6)
    assert msg.pool_work_s == pytest.approx(2 * 55e-6)


def test_spec_without_busy_cpu_fields_still_loads():
    """Specs saved before the busy-CPU figures existed load, with them None."""
    d = spec(**BUSY).to_dict()
    for k in BUSY:
        del d[k]
    assert LocalhostSpec.from_dict(d) == spec()
    with pytest.raises(ValueError, match="group_sizes"):
        spec(**dict(BUSY, barrier_cpu_s=(1e-5, 2e-5)))
    with pytest.raises(ValueError, match="p2p_message_cpu_s"):
        spec(**dict(BUSY, p2p_message_cpu_s=0.0))


# --- calibration ------------------------------------------------------------------------
def test_calibration_measures_positive_finite_figures():
    from vcluster.localhost.calibrate import calibrate_localhost
    s = calibrate_localhost(devices=2, message_bytes=(16 << 10, 64 << 10, 256 << 10))
    from vcluster.localhost.calls import CALLS
    assert {(d, call, g) for d, call, g, _ in s.call_cpu_s} == {(2, c, 2) for c in CALLS}
    assert all(0 < sec < 0.1 for *_, sec in s.call_cpu_s)
    for name, value in s.to_dict().items():
        if name in ("call_cpu_s", "start_split"):
            continue
        for v in (value if isinstance(value, list) else [value]):
            for x in (v if isinstance(v, list) else [v]):
                assert 0 < x < math.inf, (name, value)
    assert s.group_sizes == (2,) and s.calibration_devices == 2
    from vcluster.runtime.cores import usable_cores
    assert s.cores == usable_cores()
    for name in ("barrier_cpu_s", "small_all_reduce_cpu_s", "large_all_reduce_cpu_s"):
        assert len(getattr(s, name)) == 1 and 0 < getattr(s, name)[0] < 0.1, name
    assert 0 < s.p2p_message_cpu_s < 0.1 and 0 < s.compute_overhead_s < 0.01
    assert 1e8 < s.p2p_busy_copy_bytes_per_s < 1e12
    from vcluster.localhost.messages import SIDE_BYTES
    assert tuple(b for b, _ in s.message_side_cpu_s) == SIDE_BYTES
    assert all(0 < t <= min(k, s.cores) for k, t in s.pool_throughput)
    from vcluster.localhost.start import current_core
    assert (s.start_split is None) == (current_core() is None)
    assert all(d == 2 and sum(split) == 2 for d, split, _ in s.start_split or ())
    with pytest.raises(ValueError, match="devices"):
        calibrate_localhost(devices=1)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks here")
def test_calibration_pinned_to_one_cpu_prices_one_core():
    """Under ``taskset -c 0`` (or a CI runner's mask) the devices share one CPU: the spec
    says 1 core, not the machine's count, and every start finds its devices on it."""
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os, sys; sys.path.insert(0, {ROOT!r}); os.sched_setaffinity(0, {{{cpu}}})\n"
            "from vcluster.localhost.calibrate import calibrate_localhost\n"
            "s = calibrate_localhost(devices=2, message_bytes=(16 << 10, 64 << 10, 256 << 10))\n"
            "print(s.cores, max(t for _, t in s.pool_throughput), "
            "sorted({len(split) for _, split, _ in s.start_split or ()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, check=True).stdout.split(maxsplit=2)
    assert out[0] == "1" and float(out[1]) <= 1.0
    assert out[2].strip() in ("[1]", "[]")


@pytest.mark.parametrize("name, text", [("spec.json", "not json {"),
                                        ("spec.yaml", "a: [unclosed"), ("spec.json", "[1, 2]")])
def test_loading_a_file_that_is_not_a_spec_names_it(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}: (not a LocalhostSpec file|expected a "
                                         "mapping)"):
        load_localhost_spec(path)
