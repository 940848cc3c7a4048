"""One device's CPU for one 8 B all_reduce with every peer already arrived, in one process.

The member's Python alone, without the scheduling of n processes on few cores: a
:class:`~vcluster.runtime.emulated_device.EmulatedDevice` of rank 0 over a private
control segment, whose n - 1 peers "arrive" by having their descriptor row (the same
header words and payload) and progress word written before each call. Those writes are
timed apart, over as many iterations, and subtracted. ``time.thread_time_ns`` around
``--calls`` calls, median [range] of 7 repetitions after 2000 warm-up calls.

    PYTHONPATH=<tree> python benchmarks/small_call_cpu.py --devices 8 --calls 5000
    PYTHONPATH=<tree> python benchmarks/small_call_cpu.py --profile   # cProfile, by tottime

(issue 30: 23 us per call in the tree before the inline plans, 6 us with them.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mesh import Mesh
from vcluster.runtime.algorithm import AlgorithmSettings
from vcluster.runtime.arena import Arena
from vcluster.runtime.arrays import array_module
from vcluster.runtime.emulated_device import EmulatedDevice
from vcluster.runtime.fabric import Fabric
from vcluster.runtime.futex import make_waker
from vcluster.runtime.layout import ControlLayout, D, encode_dtype
from vcluster.runtime.recorder import Recorder

_SLOT = 1                       # the group of the mesh's only axis
_SUM = 1                        # ReduceOp.SUM.code


def _device(n: int) -> EmulatedDevice:
    """Rank 0 of an n-device 1-D mesh over private (unshared) memory."""
    layout = ControlLayout(n, 2)
    words = np.zeros(layout.total_words, np.int64)
    arenas = [Arena(r, np.zeros(1 << 20, np.uint8)) for r in range(n)]
    fabric = Fabric(0, layout, words, arenas, Arena(-1, np.zeros(1 << 16, np.uint8)),
                    make_waker("auto"), 10.0)
    return EmulatedDevice(0, Mesh((n,), ("x",)), fabric, None, Recorder(0),
                          array_module("numpy"), AlgorithmSettings())


def _peer_row() -> np.ndarray:
    """What every peer publishes for an 8 B float32 sum (SEQ written per call)."""
    row = np.zeros(D.WORDS, np.int64)
    row[D.OP], row[D.DTYPE], row[D.NDIM], row[D.SHAPE] = 1, encode_dtype(np.float32), 1, 2
    row[D.IN_OWNER:D.ARG + 1] = [-1, 0, 8, -1, 0, _SUM]
    row[D.INLINE:D.INLINE + 1].view(np.float32)[:] = 1.0
    return row


def _arrive(dev: EmulatedDevice, row: np.ndarray) -> None:
    """Every peer publishes the device's next call and is done with it."""
    s = dev._seq[_SLOT] + 1
    row[D.SEQ] = s
    dev._f.desc[1:, _SLOT, s % 2] = row
    dev._f.progress[1:, _SLOT] = 4 * s + 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--path", choices=["copy", "resident"], default="copy")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    dev, row = _device(args.devices), _peer_row()
    x = np.ones(2, np.float32)
    out = None
    if args.path == "resident":
        x = out = dev.empty(2, np.float32)
        x[...] = 1.0

    def calls(k: int) -> None:
        for _ in range(k):
            _arrive(dev, row)
            dev.all_reduce(x, out=out)

    def arrivals(k: int) -> None:
        for _ in range(k):
            _arrive(dev, row)

    calls(2000)
    if args.profile:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.runcall(calls, args.calls)
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        return
    per_call_us = []
    for _ in range(7):
        t0 = time.thread_time_ns()
        calls(args.calls)
        t1 = time.thread_time_ns()
        arrivals(args.calls)
        t2 = time.thread_time_ns()
        per_call_us.append(((t1 - t0) - (t2 - t1)) / args.calls / 1e3)
        dev._recorder.reset()
    print(f"{args.path}, {args.devices} devices: {np.median(per_call_us):.2f} us per call "
          f"[{min(per_call_us):.2f}-{max(per_call_us):.2f}]")


if __name__ == "__main__":
    main()
