"""The communication queue holds an operation's inputs no longer than the operation runs.

A collective's thunk closes over its input (a DDP bucket in the arena). The pool's worker
thread keeps the callable it ran until it fetches the next one, a moment *after* it
completes the future; if the operating system deschedules it in that moment, the bucket
outlives the program's own reference, and the program's next allocations peak one
bucket higher (seen in CI: a GPT rank's arena peak 608 KiB above the same job's on
another run). The check is deterministic: a done-callback runs on the worker thread
inside ``set_result``, before the worker lets go of anything, so it sees what the queue
still holds when the waiter wakes.
"""

import threading
import weakref

import numpy as np

from vcluster.runtime.work import CommQueue, Work


def _never_aborted():
    return None


def _summing(x):
    """A thunk that closes over ``x``, as a collective's thunk closes over its input."""
    return lambda: float(x.sum())


def test_inputs_are_released_before_the_result_is_published():
    queue = CommQueue(rank=0)
    try:
        gate = threading.Event()
        queue.submit(lambda: gate.wait(10))      # the worker waits until the callback is set
        bucket = np.ones(1 << 16)
        alive = weakref.ref(bucket)
        future = queue.submit(_summing(bucket))
        del bucket
        seen = []
        future.add_done_callback(lambda f: seen.append(alive() is not None))
        gate.set()
        assert Work(_never_aborted, future=future).wait(timeout_s=10) == float(1 << 16)
        assert seen == [False], "the worker thread still held the operation's input"
        assert alive() is None
    finally:
        queue.shutdown()


def test_a_result_belongs_to_the_waiter_alone():
    queue = CommQueue(rank=0)
    try:
        future = queue.submit(lambda: np.zeros(1 << 16))
        out = Work(_never_aborted, future=future).wait(timeout_s=10)
        alive = weakref.ref(out)
        del out
        assert alive() is None, "the queue kept a completed operation's result"
        assert queue.idle()
    finally:
        queue.shutdown()
