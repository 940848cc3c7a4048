"""Host work in traces (``trace_program(host_time=True)``) and its price on ``localhost``:
the array calls each segment makes are counted exactly, device calls' own work is not the
program's, traces without host timing are unchanged, and the localhost model turns a host
op into the emulator's work by the documented formula."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from mesh import Mesh
from vcluster.runtime.tracing import MetaArray, TraceCollective, TraceCompute, trace_program
from vcluster.runtime.tracing.host import HOST_OP, HostClock
from vcluster.localhost.cost_model import LocalhostCostModel, localhost_model
from vcluster.localhost.host_work import (REFERENCE_CALLS, TracerRates, host_work_s,
                                            measure_tracer_rates, reference_calls)

from tests.localhost_specs import HOST_RATES, spec

pytestmark = pytest.mark.timeout(120)



def _hosts(trace):
    return [op for op in trace.ops if isinstance(op, TraceCompute) and op.name == HOST_OP]


def _program(dev, x, w):
    y = x + 1.0                                   # 2 array calls before the block
    z = y @ w
    with dev.compute("product", flops=1.0, bytes=8):
        q = z * 2.0                               # 1 inside the block
    dev.all_reduce(q, "x")                        # its own MetaArray work is not counted
    r = q.reshape(-1)                             # 3 after the collective: reshape,
    r = r[1:]                                     # a slice and
    dev.empty((4,))                               # an allocation
    return r


def test_segments_count_the_programs_array_calls_exactly():
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    for t in trace_program(mesh, _program, args, host_time=True):
        kinds = [(op.name, op.array_calls) if isinstance(op, TraceCompute) else op.collective
                 for op in t.ops]
        assert kinds == [(HOST_OP, 2), (HOST_OP, 1), ("product", 0), (HOST_OP, 0),
                         "all_reduce", (HOST_OP, 3)]
        assert all(op.host_s >= 0 and op.flops == 0 and op.bytes == 0 for op in _hosts(t))


def test_without_host_time_the_trace_is_unchanged():
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    plain = trace_program(mesh, _program, args)
    timed = trace_program(mesh, _program, args, host_time=True)
    for p, t in zip(plain, timed):
        assert not _hosts(p)
        assert p.ops == tuple(op for op in t.ops if op not in _hosts(t))


def test_nested_blocks_and_point_to_point_keep_program_order():
    def program(dev, x):
        with dev.compute("outer"):
            x = x * 3.0                          # outer block's own work
            with dev.compute("inner"):
                x = x + 1.0
                x = x - 1.0
        if dev.rank == 0:
            dev.send(x, 1)
        else:
            x = dev.recv(0)
            x = np.exp(x)
        return x
    t0, t1 = trace_program(Mesh((2,), ("x",)), program, [(MetaArray((3,)),)] * 2,
                           host_time=True)
    names = lambda t: [getattr(op, "name", type(op).__name__) for op in t.ops]  # noqa: E731
    assert names(t0) == [HOST_OP, HOST_OP, HOST_OP, "inner", HOST_OP, "outer", HOST_OP,
                         "TraceSend", HOST_OP]
    assert [op.array_calls for op in _hosts(t0)] == [0, 1, 2, 0, 0, 0]
    assert [op.array_calls for op in _hosts(t1)][-1] == 1          # np.exp after the recv


def test_host_seconds_follow_the_programs_python():
    """A stretch of pure Python lands in its segment (generous bounds: CPU time of the
    same loop measured directly in the same thread)."""
    def loop():
        total = 0
        for i in range(200_000):
            total += i
        return total

    def program(dev):
        loop()
        dev.barrier()
    t0 = time.thread_time()
    loop()
    direct = time.thread_time() - t0
    (t,) = trace_program(Mesh((1,), ("x",)), program, [()], host_time=True)
    first = _hosts(t)[0]
    assert 0.3 * direct <= first.host_s <= 3 * direct + 0.005


def test_counting_is_off_outside_a_clock():
    clock = HostClock()
    x = MetaArray((2, 2))
    _ = x + x                                     # no clock running: nothing counted
    clock.start()
    try:
        _ = (x + x).sum()
        assert clock.calls == 2
    finally:
        clock.stop()
    _ = x * x
    assert clock.calls == 2


# --- the price on localhost ---------------------------------------------------------------
RATES = TracerRates(segment_s=2e-6, meta_call_s=6e-6, python_unit_s=20e-6)


def test_host_op_price_is_the_documented_formula():
    s = spec(**HOST_RATES)
    op = TraceCompute(HOST_OP, 0.0, 0, host_s=100e-6, array_calls=5)
    python_s = 100e-6 - 2e-6 - 5 * 6e-6                     # less the tracer's own costs
    want = python_s * 25e-6 / 20e-6 + 5 * 1.5e-6            # at the devices' speed
    assert host_work_s(op, s, RATES) == pytest.approx(want)
    model = LocalhostCostModel(s, 2, "float64", tracer=RATES)
    assert model.compute_time_s(op) == pytest.approx(want)
    assert model.host_timed
    # a segment that is all meta calls costs just the numpy calls
    only_calls = TraceCompute(HOST_OP, 0.0, 0, host_s=1e-6, array_calls=3)
    assert model.compute_time_s(only_calls) == pytest.approx(3 * 1.5e-6)
    # a trace that timed its array calls: their own CPU and the timing's, not the rate
    rates = dataclasses.replace(RATES, array_overhead_s=1e-6)
    timed = TraceCompute(HOST_OP, 0.0, 0, host_s=100e-6, array_calls=5, array_s=20e-6)
    python_s = 100e-6 - 2e-6 - 20e-6 - 5 * 1e-6
    assert host_work_s(timed, s, rates) == pytest.approx(python_s * 25e-6 / 20e-6
                                                         + 5 * 1.5e-6)


def test_compute_ops_of_host_timed_traces_cost_the_block_overhead_plus_kernel():
    s = spec(**HOST_RATES)
    op = TraceCompute("relu", 0.0, 8 << 20)
    plain = LocalhostCostModel(s, 2, "float64")
    timed = LocalhostCostModel(s, 2, "float64", tracer=RATES)
    kernel = plain.compute_time_s(op) - s.compute_overhead_s
    assert timed.compute_time_s(op) == pytest.approx(s.block_overhead_s + kernel)


def test_host_ops_need_rates_on_both_sides():
    op = TraceCompute(HOST_OP, 0.0, 0, host_s=1e-5, array_calls=1)
    with pytest.raises(ValueError, match="localhost_model"):
        LocalhostCostModel(spec(**HOST_RATES), 2).compute_time_s(op)
    with pytest.raises(ValueError, match="numpy_call_s"):
        LocalhostCostModel(spec(), 2, tracer=RATES)
    with pytest.raises(TypeError, match="TracerRates"):
        LocalhostCostModel(spec(**HOST_RATES), 2, tracer=(1, 2, 3))
    assert not localhost_model(spec(), 2).host_timed       # an older spec: no host work
    with pytest.raises(ValueError, match="python_unit_s"):
        TracerRates(1e-6, 1e-6, 0.0)


def test_spec_with_and_without_host_rates_round_trips():
    s = spec(**HOST_RATES)
    assert type(s).from_dict(s.to_dict()) == s
    d = s.to_dict()
    for k in HOST_RATES:
        del d[k]
    assert type(s).from_dict(d) == spec()
    with pytest.raises(ValueError, match="numpy_call_s"):
        spec(**dict(HOST_RATES, numpy_call_s=-1.0))


def test_tracer_rates_measure_this_process():
    rates = measure_tracer_rates()
    for f in dataclasses.fields(rates):
        assert 0 <= getattr(rates, f.name) < 0.01, f.name
    assert rates.meta_call_s > 0 and rates.python_unit_s > 0
    # the reference mix is what its docstring says, on numpy and on meta arrays alike
    real = reference_calls(np.ones((8, 16)), np.ones((16, 16)), np.ones(16))
    clock = HostClock()
    clock.start()
    try:
        meta = reference_calls(MetaArray((8, 16)), MetaArray((16, 16)), MetaArray((16,)))
    finally:
        clock.stop()
    assert clock.calls == REFERENCE_CALLS and meta.shape == real.shape


def test_replay_of_a_host_timed_trace_charges_its_host_work():
    """Two identical ranks on two cores (T(2) = 1.9: each runs at 0.95): the host ops
    lengthen the step by their work over that rate."""
    from vcluster.runtime.tracing import DeviceTrace
    from vcluster.timing.engine import simulate_trace
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    timed = trace_program(mesh, _program, args, host_time=True)
    timed = [DeviceTrace(t.rank, tuple(dataclasses.replace(op, host_s=1e-4, array_s=0.0)
                                       if op in _hosts(t) else op for op in t.ops))
             for t in timed]                                  # the same host work on both
    stripped = [DeviceTrace(t.rank, tuple(op for op in t.ops if op not in _hosts(t)))
                for t in timed]
    model = LocalhostCostModel(spec(**HOST_RATES), 2, "float64", tracer=RATES)
    host = sum(model.compute_time_s(op) for op in _hosts(timed[0]))
    with_host = simulate_trace(timed, model, core_pool=model.core_pool).step_time_s
    without = simulate_trace(stripped, model, core_pool=model.core_pool).step_time_s
    assert with_host - without == pytest.approx(host / 0.95, rel=1e-6)


def _with_host_s(traces, values):
    """``traces`` with their host ops' host_s set to ``values`` in order."""
    from vcluster.runtime.tracing import DeviceTrace
    it = iter(values)
    return [DeviceTrace(t.rank, tuple(dataclasses.replace(op, host_s=next(it), array_s=0.0)
                                      if op in _hosts(t) else op for op in t.ops))
            for t in traces]


def test_median_host_work_takes_each_segments_median_over_traces():
    from vcluster.localhost.host_work import median_host_work
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    base = trace_program(mesh, _program, args, host_time=True)
    n = sum(len(_hosts(t)) for t in base)
    runs = [_with_host_s(base, [1e-6 * (k + 1)] * n) for k in range(3)]
    runs[1] = _with_host_s(base, [9e-3] * n)                 # one interrupted trace
    merged = median_host_work(runs)
    assert [h.host_s for t in merged for h in _hosts(t)] == pytest.approx([3e-6] * n)
    for m, b in zip(merged, base):                           # everything else is the first's
        assert m.rank == b.rank and len(m.ops) == len(b.ops)
        assert [op for op in m.ops if op not in _hosts(m)] == \
            [op for op in b.ops if op not in _hosts(b)]
    assert median_host_work(runs[:1]) == runs[0]
    with pytest.raises(ValueError, match="at least one run"):
        median_host_work([])


def test_median_host_work_keeps_the_median_run_when_traces_differ():
    from vcluster.runtime.tracing import DeviceTrace
    from vcluster.localhost.host_work import median_host_work
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    base = trace_program(mesh, _program, args, host_time=True)
    n = sum(len(_hosts(t)) for t in base)
    small, large = _with_host_s(base, [1e-6] * n), _with_host_s(base, [1e-3] * n)
    other = [DeviceTrace(t.rank, t.ops[:-1]) for t in _with_host_s(base, [2e-6] * n)]
    assert median_host_work([large, other, small]) == other      # total 2e-6 n: the median


def test_segments_time_their_array_calls():
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    for t in trace_program(mesh, _program, args, host_time=True):
        for h in _hosts(t):
            assert 0.0 <= h.array_s <= h.host_s
            if h.array_calls == 0:
                assert h.array_s == 0.0
        assert sum(h.array_s for h in _hosts(t)) > 0.0      # x + 1.0, y @ w, ... timed


def test_median_host_work_prices_each_run_with_its_own_rates():
    from vcluster.localhost.host_work import median_host_work
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    base = trace_program(mesh, _program, args, host_time=True)
    n = sum(len(_hosts(t)) for t in base)
    runs = [_with_host_s(base, [1e-3] * n) for _ in range(3)]
    prices = [lambda op, k=k: op.host_s * k for k in (1.0, 5.0, 2.0)]
    merged = median_host_work(runs, prices)
    assert [h.seconds for t in merged for h in _hosts(t)] == pytest.approx([2e-3] * n)
    model = LocalhostCostModel(spec(**HOST_RATES), 2, "float64", tracer=RATES)
    assert model.compute_time_s(_hosts(merged[0])[0]) == pytest.approx(2e-3)  # priced
    with pytest.raises(ValueError, match="2 prices for 3 runs"):
        median_host_work(runs, prices[:2])
    # runs that differ: the run of median priced total, priced
    from vcluster.runtime.tracing import DeviceTrace
    other = [DeviceTrace(t.rank, t.ops[:-1]) for t in runs[1]]
    kept = median_host_work([runs[0], other, runs[2]], prices)
    assert [h.seconds for t in kept for h in _hosts(t)] == pytest.approx([2e-3] * n)


def test_localhost_traces_merges_host_timed_traces():
    from vcluster.localhost.cost_model import localhost_traces
    model = localhost_model(spec(**HOST_RATES), 2)
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    traces = localhost_traces(model, mesh, _program, args, host_traces=3)
    assert len(traces) == 2 and all(_hosts(t) for t in traces)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"host_traces \(or len\(tracer_rates\)\) must "
                                             rf"be an int >= 1, got {bad!r}"):
            localhost_traces(model, mesh, _program, args, host_traces=bad)


def test_localhost_traces_prices_with_rates_measured_beforehand():
    """A ranking of many programs passes the tracer's rates it measured once: every host
    op is then priced with exactly those (one set per host-timed trace)."""
    from vcluster.localhost.cost_model import localhost_traces
    model = localhost_model(spec(**HOST_RATES), 2)
    mesh = Mesh((2,), ("x",))
    args = [(MetaArray((4, 8)), MetaArray((8, 8)))] * 2
    for rates in (RATES, dataclasses.replace(RATES, python_unit_s=80e-6)):
        traces = localhost_traces(model, mesh, _program, args, tracer_rates=[rates])
        hosts = [h for t in traces for h in _hosts(t)]
        assert hosts and [h.seconds for h in hosts] == pytest.approx(
            [host_work_s(h, model.spec, rates) for h in hosts])
    assert len(localhost_traces(model, mesh, _program, args, tracer_rates=[RATES] * 3)) == 2
    with pytest.raises(ValueError, match=r"len\(tracer_rates\)\) must be an int >= 1, got 0"):
        localhost_traces(model, mesh, _program, args, tracer_rates=[])
    with pytest.raises(ValueError, match="tracer_rates must hold TracerRates"):
        localhost_traces(model, mesh, _program, args, tracer_rates=[2e-6])
