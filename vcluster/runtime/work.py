"""Asynchronous operations of one device: a FIFO communication thread and ``Work`` handles.

Like a NCCL stream, a device runs its collectives in the order the program issued them.
``async_op=True`` queues the collective on the device's communication thread and returns
a :class:`Work` at once; a blocking collective runs inline when nothing is queued, and
otherwise queues behind the others and waits, so the issue order is kept either way.
numpy releases the GIL while it copies and reduces, so queued communication overlaps
the program's computation for real.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable

__all__ = ["Work", "CommQueue"]

_POLL_S = 0.05


class Work:
    """Handle of an asynchronous operation; ``wait()`` returns its result.

    ``resolve`` computes the result on first ``wait`` (lazy receives); ``future`` is a
    queued operation; ``after`` is applied to the future's result by the waiter.
    """

    def __init__(self, check_abort: Callable[[], None], future: cf.Future | None = None,
                 resolve: Callable[[], Any] | None = None,
                 after: Callable[[Any], Any] | None = None):
        self._check_abort, self._future = check_abort, future
        self._resolve, self._after = resolve, after
        self._lock = threading.Lock()
        self._done, self._value = False, None

    def __repr__(self) -> str:
        return f"Work(completed={self.is_completed()})"

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self._future is not None and self._future.done() and self._after is None

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until done and return the result (re-raising the operation's error).

        The operation's own waits carry the cluster's timeout; ``timeout_s`` bounds this
        call in addition.
        """
        with self._lock:
            if self._done:
                return self._value
            value = None
            if self._future is not None:
                value = self._await_future(timeout_s)
            if self._resolve is not None:
                value = self._resolve()
            if self._after is not None:
                value = self._after(value)
            self._done, self._value = True, value
            self._future = self._resolve = self._after = None
            return value

    def _await_future(self, timeout_s: float | None) -> Any:
        import time
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                value = self._future.result(timeout=_POLL_S)
                return value.take() if isinstance(value, _Handoff) else value
            except cf.TimeoutError:
                self._check_abort()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"Work.wait: not completed within {timeout_s:g} s")


class _Handoff:
    """A queued operation's result, handed over once: :meth:`Work.wait` takes it out, so
    the future — which the pool's worker thread still references for a moment after
    completing it — holds the result no longer than the waiter needs."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    def take(self) -> Any:
        value, self._value = self._value, None
        return value


class _RunOnce:
    """Runs ``thunk`` once and lets go of it before the result is published.

    The pool's worker thread references the callable it ran until it fetches the next
    one, a moment after completing the future, and a collective's thunk holds its input
    (a DDP bucket, say) in its closure. Dropping the thunk first means the input returns
    to the arena as soon as the program drops it too, whenever the worker is next
    scheduled (a descheduled worker used to keep a bucket alive past the program's
    next allocations: a peak one bucket higher).
    """

    __slots__ = ("_thunk",)

    def __init__(self, thunk: Callable[[], Any]):
        self._thunk = thunk

    def __call__(self) -> _Handoff:
        thunk, self._thunk = self._thunk, None
        return _Handoff(thunk())


class CommQueue:
    """One device's communication thread (started on first use).

    Who owns a result: the :class:`Work` handle the program holds, never the queue. The
    queue keeps a future only while it is queued or running, or when it failed (so
    :meth:`drain` can raise the error of an operation nobody waited for); a future that
    completes successfully is dropped at once, and ``Work.wait`` takes the result out of
    it (:class:`_Handoff`). A result — often an arena buffer, such as a DDP bucket's
    all-reduce output — thus returns to the arena as soon as the program drops it, not
    at the end of the run.
    """

    def __init__(self, rank: int):
        self._rank = rank
        self._executor: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()     # the done-callbacks run on the comm thread
        self._pending: list[cf.Future] = []

    def idle(self) -> bool:
        if not self._pending:     # one list read under the GIL: a blocking call's common case
            return True
        with self._lock:
            return all(f.done() for f in self._pending)

    def submit(self, thunk: Callable[[], Any]) -> cf.Future:
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix=f"vcluster-comm-{self._rank}")
        future = self._executor.submit(_RunOnce(thunk))
        with self._lock:
            self._pending.append(future)
        future.add_done_callback(self._forget_if_ok)   # runs now if already done
        return future

    def _forget_if_ok(self, future: cf.Future) -> None:
        """Drop a future that succeeded (its result is the Work handle's alone)."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            try:
                self._pending.remove(future)
            except ValueError:            # drain() took it already
                pass

    def drain(self, check_abort: Callable[[], None]) -> None:
        """Wait for every queued operation; raise the first error among them."""
        with self._lock:
            pending, self._pending = self._pending, []
        first_error = None
        for future in pending:
            while True:
                try:
                    future.result(timeout=_POLL_S)
                    break
                except cf.TimeoutError:
                    try:
                        check_abort()
                    except BaseException as exc:  # aborted: still collect the others
                        first_error = first_error or exc
                        if future.done():
                            break
                except BaseException as exc:
                    first_error = first_error or exc
                    break
        if first_error is not None:
            raise first_error

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
