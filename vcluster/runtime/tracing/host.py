"""The host work of a traced program: its own Python between device calls.

A per-device program spends CPU outside its ``dev.compute`` blocks' kernels and its
communication calls: the Python that decides what to do next (a pipeline executor's
bookkeeping, a layer's loops) and small numpy calls (reshapes, slices, additions on
tiny arrays). On a GPU that work overlaps the device; on the emulator it *is* the
device's time, so the ``localhost`` timing model needs it. The tracer runs the same
Python, so it can measure it — with one difference: array operations run on
:class:`~vcluster.runtime.tracing.meta.MetaArray` (shape arithmetic in Python, ~5x a
numpy call on a tiny array). So a host segment is recorded as two figures:

* ``host_s``: thread CPU seconds of the program between two device calls (device calls'
  own work excluded), meta-array calls included;
* ``array_calls``: how many array operations (outermost meta-array calls: a ufunc, an
  operator, indexing, reshape, ``np.split``...) the segment made;
* ``array_s``: the thread CPU seconds spent inside those operations, timed around each
  one (so the model replaces exactly what the meta calls of *this* trace cost, not a
  rate measured at another moment: this machine's speed moves within seconds).

The ``localhost`` cost model turns them into the emulator's host work by replacing each
meta-array call's cost by a numpy call's (both measured by microbenchmarks, see
:mod:`vcluster.localhost.host_work`).

Counting is off unless a :class:`HostClock` is running in the current thread (a
:class:`contextvars.ContextVar` holds it, so traced threads never see each other's), so
tracing without host work pays one context-variable read per array operation.
"""

from __future__ import annotations

import functools
import time
from contextvars import ContextVar

__all__ = ["HostClock", "counted", "HOST_OP"]

HOST_OP = "host"     #: the name of the TraceCompute ops that carry host segments

_CLOCK: ContextVar["HostClock | None"] = ContextVar("vcluster_host_clock", default=None)


def counted(fn):
    """Count calls of ``fn`` (a meta-array operation) as array calls of the running clock,
    and the thread CPU spent inside them.

    Only the outermost call counts: an operator that dispatches to ``__array_ufunc__`` is
    one call, as is everything a device call does inside.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        clock = _CLOCK.get()
        if clock is None or clock.depth:
            return fn(*args, **kwargs)
        clock.depth = 1
        clock.calls += 1
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.array_s += time.thread_time() - t0
            clock.depth = 0
    return wrapper


class HostClock:
    """Measures one traced thread's host segments (see the module docstring).

    ``start()`` in the thread that runs the program; then ``lap()`` closes the segment
    that ends now and returns ``(host_s, array_calls)``; ``pause()`` before a device call
    does its own work, ``resume()`` after it (its work is not the program's).
    """

    __slots__ = ("calls", "depth", "array_s", "_t0", "_calls0", "_array0", "_token")

    def __init__(self) -> None:
        self.calls = 0
        self.depth = 0
        self.array_s = 0.0
        self._t0 = 0.0
        self._calls0 = 0
        self._array0 = 0.0
        self._token = None

    def __repr__(self) -> str:
        return f"HostClock(calls={self.calls})"

    def start(self) -> None:
        self._token = _CLOCK.set(self)
        self.resume()

    def stop(self) -> None:
        if self._token is not None:
            _CLOCK.reset(self._token)
            self._token = None

    def lap(self) -> tuple[float, int, float]:
        """``(host_s, array_calls, array_s)`` since the last ``resume``/``lap``; starts
        the next."""
        now = time.thread_time()
        out = (max(0.0, now - self._t0), self.calls - self._calls0,
               max(0.0, self.array_s - self._array0))
        self._t0, self._calls0, self._array0 = now, self.calls, self.array_s
        return out

    def pause(self) -> None:
        self.depth = 1

    def resume(self) -> None:
        self.depth = 0
        self._t0, self._calls0, self._array0 = time.thread_time(), self.calls, self.array_s

    def count_call(self) -> None:
        """One array operation done by a device call (``dev.empty``) for the program."""
        self.calls += 1
