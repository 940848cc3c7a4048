"""Benchmark: what a stretch of work between two blocking calls costs inside a program,
against the ``localhost`` model's price of the same stretch.

A *stretch* is what one device does from its start, or from the return of a blocking
call (a synchronous collective over two or more members, or a receive), to its next
blocking call (or its end): array work, Python, and the non-blocking sends in between.
Each stretch is **measured** as the thread CPU (``time.thread_time``) between those
edges, on real devices, the median over ``--runs`` runs after a warm-up (the program is
handed a thin proxy of its device context that notes the edges), and **priced** from the
host-timed trace the model replays (:func:`~vcluster.localhost.cost_model.localhost_traces`):
the ops between the same calls at their warm price (compute, host work, the sender's
side of each send), and apart from it the model's cold extra (``cold stretch``). The
stretches are summed by what starts them: the start, a receive, a collective.

    python benchmarks/stretch_cpu.py quickstart/0 mlp_schedules/2 [--runs 15] [--spec FILE]

Points are named as ``vcluster bench predict --scenarios`` names them
(``<scenario>/<sweep point>``, bundled scenarios). Without ``--spec`` the machine is
calibrated first (~15 s).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from vcluster.runtime.algorithm import COLLECTIVES

BLOCKING = frozenset(COLLECTIVES) | {"recv"}      # the calls a device waits in
KINDS = ("start", "recv", "collective")


class EdgeNotingDevice:
    """A device context that forwards everything and notes, at each blocking call, the
    thread CPU since the previous one returned: ``edges`` = [(call, cpu_s), ...]."""

    def __init__(self, dev):
        self._dev, self.edges, self._since = dev, [], time.thread_time()

    def __getattr__(self, name):
        attr = getattr(self._dev, name)
        if name not in BLOCKING:
            return attr

        def call(*args, **kwargs):
            entered = time.thread_time()
            out = attr(*args, **kwargs)
            if kwargs.get("async_op"):
                return out                     # blocks in its handle's wait, not here
            self.edges.append((name, entered - self._since))
            self._since = time.thread_time()
            return out
        return call

    def end(self) -> list:
        self.edges.append(("end", time.thread_time() - self._since))
        return self.edges


def _noted(dev, program, *args) -> list:
    device = EdgeNotingDevice(dev)
    program(device, *args)
    return device.end()


def measured_stretches(cluster, program, args_by_rank, runs: int) -> list:
    """Per rank, per stretch: the median thread CPU over ``runs`` runs (one warm-up)."""
    args = [(program,) + tuple(a) for a in args_by_rank]
    cluster.run(_noted, args)
    got = [cluster.run(_noted, args) for _ in range(runs)]
    out = []
    for rank in range(len(args)):
        per_run = [g[rank] for g in got]
        if len({len(p) for p in per_run}) != 1:
            raise RuntimeError(f"rank {rank}: the runs made different numbers of blocking "
                               f"calls ({sorted({len(p) for p in per_run})})")
        out.append([float(np.median([p[i][1] for p in per_run]))
                    for i in range(len(per_run[0]))])
    return out


def priced_stretches(model, traces) -> list:
    """Per rank, per stretch: ``(kind that starts it, warm price, cold extra)``."""
    from vcluster.runtime.tracing.ops import TraceCollective, TraceCompute, TraceRecv, TraceSend
    from vcluster.localhost.start import COLD_CALL, COLD_STRETCH, FIRST_CALL, RUN_START
    extras = {COLD_CALL, FIRST_CALL, RUN_START}
    out = []
    for t in traces:
        rows, kind, warm, extra = [], "start", 0.0, 0.0
        for op in t.ops:
            if isinstance(op, TraceCompute):
                if op.name == COLD_STRETCH:
                    extra += model.compute_time_s(op)
                elif op.name not in extras:
                    warm += model.compute_time_s(op)
            elif isinstance(op, TraceSend):
                warm += model.p2p_cpu_s(t.rank, op.peer, op.nbytes)[0]
            elif isinstance(op, TraceRecv) or (isinstance(op, TraceCollective)
                                               and len(op.group) > 1 and op.handle is None):
                rows.append((kind, warm, extra))
                kind, warm, extra = ("recv" if isinstance(op, TraceRecv) else "collective",
                                     0.0, 0.0)
        rows.append((kind, warm, extra))
        out.append(rows)
    return out


def compare(priced: list, measured: list) -> dict:
    """``{kind: (stretches, warm_s, extra_s, measured_s)}`` summed over ranks."""
    sums = {}
    for rank, (rows, cpu) in enumerate(zip(priced, measured)):
        if len(rows) != len(cpu):
            raise RuntimeError(f"rank {rank}: {len(rows)} stretches traced, {len(cpu)} "
                               "measured")
        for (kind, warm, extra), seconds in zip(rows, cpu):
            n, w, e, m = sums.get(kind, (0, 0.0, 0.0, 0.0))
            sums[kind] = (n + 1, w + warm, e + extra, m + seconds)
    return sums


def main(argv=None) -> int:
    from vcluster import VirtualCluster
    from vcluster.cli.bench_predict_scenarios import scenario_workloads
    from vcluster.localhost.cost_model import load_localhost_spec, localhost_model, localhost_traces
    from vcluster.localhost.calibrate import calibrate_localhost
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="+", help="scenario points, e.g. quickstart/0")
    p.add_argument("--runs", type=int, default=15, help="timed runs per point (15)")
    p.add_argument("--spec", help="a saved localhost calibration instead of calibrating")
    args = p.parse_args(argv)
    workloads = {w.name: w for w in scenario_workloads()}
    unknown = [name for name in args.points if name not in workloads]
    if unknown:
        p.error(f"unknown point {unknown[0]!r}; the points are {', '.join(workloads)}")
    spec = load_localhost_spec(args.spec) if args.spec else calibrate_localhost()
    print(f"{'point':<22}{'after':>12}{'stretches':>11}{'warm':>10}{'model':>10}"
          f"{'measured':>10}{'meas/warm':>11}{'meas/model':>11}")
    for name in args.points:
        wl = workloads[name]
        model = localhost_model(spec, wl.mesh.size, wl.dtype)
        priced = priced_stretches(model, localhost_traces(model, wl.mesh, wl.program,
                                                          wl.meta_args))
        with VirtualCluster(wl.mesh) as cluster:
            measured = measured_stretches(cluster, wl.program, wl.args, args.runs)
        for kind, (n, warm, extra, got) in sorted(compare(priced, measured).items(),
                                                   key=lambda kv: KINDS.index(kv[0])):
            print(f"{name:<22}{kind:>12}{n:>11}{warm * 1e3:>8.2f}ms{(warm + extra) * 1e3:>8.2f}ms"
                  f"{got * 1e3:>8.2f}ms{got / warm:>11.2f}{got / (warm + extra):>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
