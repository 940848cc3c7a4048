"""DDP buckets (issue 32): full buckets start asynchronously as they fill; what is left at
``finish`` goes as one blocking all-reduce after the buckets in flight were waited for
(it would be waited for at once), and every gradient gets its bucket's sum — against
sums taken here, on a recording stand-in for a device of a 2-rank group."""

import numpy as np
import pytest

from pipeline_parallel.executor import GradBuckets


class _Work:
    def __init__(self, value, log):
        self._value, self._log = value, log

    def wait(self):
        self._log.append(("wait", self._value.size))
        return self._value


class _Dev:
    """all_reduce over 2 ranks holding the same gradients: the sum is 2 x."""

    def __init__(self):
        self.log = []

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype)

    def all_reduce(self, x, axis=None, op="sum", *, out=None, async_op=False,
                   algorithm="auto"):
        self.log.append(("async" if async_op else "blocking", x.size))
        total = 2 * x
        return _Work(total, self.log) if async_op else total


@pytest.mark.parametrize("bucket_bytes, want", [
    # 3 layers of (W 4x4, b 4) float64 = 160 B each, added last layer first
    (1 << 20, [("blocking", 60)]),                       # everything in the last bucket
    (160, [("async", 20), ("async", 20), ("async", 20), ("wait", 20), ("wait", 20),
           ("wait", 20)]),                               # full buckets only: none left
    (300, [("async", 40), ("wait", 40), ("blocking", 20)]),
])
def test_the_bucket_left_at_finish_is_a_blocking_all_reduce(bucket_bytes, want):
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal((4, 4)), rng.standard_normal(4)] for _ in range(3)]
    expected = [[2 * g for g in pair] for pair in grads]
    dev = _Dev()
    buckets = GradBuckets(dev, "dp", bucket_bytes)
    for pair in reversed(grads):
        buckets.add(pair)
    buckets.finish()
    assert dev.log == want
    for pair, exp in zip(grads, expected):
        for g, e in zip(pair, exp):
            np.testing.assert_array_equal(g, e)
    buckets.finish()                                     # nothing left: no call
    assert dev.log == want
