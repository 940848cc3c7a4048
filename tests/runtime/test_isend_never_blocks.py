"""``isend`` never waits, as MPI's does not: ranks may each post more sends to a peer than
its mailbox has slots (16) before receiving any, and every message still arrives, in
order, with its data — inline payloads, private arrays (staged) and arena arrays (sent
in place, kept unchanged until ``wait``). An ``isend`` that waited for a free slot made
two ranks that both did this wait for each other until the timeout."""

from __future__ import annotations

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster

N_MESSAGES = 40                      # > 16 mailbox slots per pair
TAG = 5


def _payload(dev, rank: int, i: int):
    """Message i of ``rank``: inline (32 B), private (64 KiB, staged) or in the arena."""
    kind = i % 3
    if kind == 0:
        return np.full(4, rank * 1000.0 + i)
    if kind == 1:
        return np.full(8192, rank * 1000.0 + i)
    x = dev.empty((8192,), np.float64)
    x[...] = rank * 1000.0 + i
    return x


def _exchange(dev, to: int, frm: int):
    """Post every isend to ``to``, then receive as many from ``frm``, then wait."""
    mine = [_payload(dev, dev.rank, i) for i in range(N_MESSAGES)]
    sends = [dev.isend(x, to, tag=TAG) for x in mine]
    got = [dev.recv(frm, tag=TAG) for _ in range(N_MESSAGES)]
    for w in sends:
        w.wait()
    return [(float(g[0]), float(g[-1]), g.size) for g in got]


def _expected(frm: int):
    return [(frm * 1000.0 + i, frm * 1000.0 + i, (4, 8192, 8192)[i % 3])
            for i in range(N_MESSAGES)]


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_post_more_isends_than_slots_before_receiving(n):
    with VirtualCluster(Mesh((n,), ("x",)), timeout_s=10.0, run_timeout_s=120.0) as cluster:
        results = cluster.run(lambda dev: _exchange(dev, (dev.rank + 1) % n,
                                                    (dev.rank - 1) % n))
        for rank, got in enumerate(results):
            assert got == _expected((rank - 1) % n), rank
        # the cluster is clean for the next run: a second exchange gives the same
        assert cluster.run(lambda dev: _exchange(dev, (dev.rank + 1) % n,
                                                 (dev.rank - 1) % n)) == results


def test_queued_sends_that_are_never_waited_for_are_still_delivered():
    """A program that never waits on its isends (the end of the run posts what is left)."""
    def program(dev):
        if dev.rank == 0:
            for i in range(N_MESSAGES):
                dev.isend(np.full(4, float(i)), 1, tag=TAG)
            return None
        return [float(dev.recv(0, tag=TAG)[0]) for _ in range(N_MESSAGES)]

    with VirtualCluster(Mesh((2,), ("x",)), timeout_s=10.0, run_timeout_s=120.0) as cluster:
        assert cluster.run(program)[1] == [float(i) for i in range(N_MESSAGES)]
