"""The copies the message algorithms make (vcluster/runtime/collectives/messages.py).

On real devices, each member of a ring, tree or pairwise call counts the bytes that
``np.copyto`` writes inside the algorithms' module (its local copies) and inside the
channel (a sender's staging copy), inputs in arena memory (``dev.empty``):

* no send is staged: the algorithms send from arena buffers, which the channel posts
  without a copy (only a program's send of a private array is staged);
* each member copies locally only what its result needs: its input into a working
  buffer (ring all-reduce and reduce-scatter, tree reduce and all-reduce), its own piece
  into the result (all-gather, all-to-all, scatter's and gather's roots), the reduced
  piece out (reduce-scatter), a broadcast root's input into its result. Tree all-reduce
  broadcasts its sum from the working buffer without copying it again.
"""

from __future__ import annotations

import numpy as np
import pytest

from mesh import Mesh

MESH = Mesh((4,), ("x",))
ELEMENTS = 4 * 1024                           # float32 input per member: 16 KiB
X = ELEMENTS * 4
# collective, algorithm, keywords, {position: local bytes} (default for the others)
CASES = [("all_reduce", "ring", {}, {None: X}),
         ("all_reduce", "tree", {}, {None: X}),
         ("all_gather", "ring", {}, {None: X}),
         ("reduce_scatter", "ring", {}, {None: X + X // 4}),
         ("broadcast", "tree", {"root": 1}, {1: X, None: 0}),
         ("reduce", "tree", {"root": 2}, {None: X}),
         ("all_to_all", "pairwise", {}, {None: X // 4}),
         ("scatter", "pairwise", {"root": 3}, {3: X // 4, None: 0}),
         ("gather", "pairwise", {"root": 0}, {0: X, None: 0})]


class _Counting:
    """Stands in for a module's ``np``: counts the bytes its ``copyto`` writes."""

    def __init__(self, numpy):
        self._np, self.bytes = numpy, 0

    def copyto(self, dst, src, *args, **kwargs):
        self.bytes += np.asarray(dst).nbytes
        return self._np.copyto(dst, src, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._np, name)


def _counted(dev, values, name, algorithm, kwargs):
    """(local bytes copied by the algorithm, bytes staged by the channel) of one call."""
    import vcluster.runtime.channel as channel
    import vcluster.runtime.collectives.messages as messages
    x = dev.empty(values.shape, values.dtype)
    x[...] = values
    local, staged = _Counting(np), _Counting(np)
    messages.np, channel.np = local, staged
    try:
        getattr(dev, name)(x, algorithm=algorithm, **kwargs)
    finally:
        messages.np, channel.np = np, np
    return local.bytes, staged.bytes


def _private_send(dev, values):
    import vcluster.runtime.channel as channel
    staged = _Counting(np)
    channel.np = staged
    try:
        if dev.rank == 0:
            dev.send(values, 1)
        elif dev.rank == 1:
            dev.recv(0)
    finally:
        channel.np = np
    return staged.bytes


@pytest.mark.parametrize("name,algorithm,kwargs,local", CASES)
def test_message_algorithms_stage_nothing_and_copy_only_their_results(cluster_of, name,
                                                                     algorithm, kwargs,
                                                                     local):
    values = np.arange(ELEMENTS, dtype=np.float32)
    counted = cluster_of(MESH).run(_counted, [(values, name, algorithm, kwargs)] * 4)
    for rank, (copied, staged) in enumerate(counted):
        assert staged == 0, f"rank {rank} staged {staged} bytes"
        assert copied == local.get(rank, local[None]), f"rank {rank}"


def test_the_counter_sees_a_private_payload_staged(cluster_of):
    """The other side of the check above: a program's send of a private array is staged."""
    values = np.ones(ELEMENTS, np.float32)
    staged = cluster_of(MESH).run(_private_send, [(values,)] * 4)
    assert staged[0] == values.nbytes and staged[2:] == [0, 0]
