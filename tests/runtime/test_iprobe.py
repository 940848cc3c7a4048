"""dev.iprobe: whether a message is waiting, without taking it or blocking."""

import numpy as np

from mesh import Mesh
from vcluster import VirtualCluster


def _probe(dev):
    if dev.rank == 0:
        before = dev.iprobe(1, tag=7)
        dev.send(np.zeros(1), 1, tag=5)                 # let rank 1 send tag 7 now
        while not dev.iprobe(1, tag=7):
            pass
        other_tag = dev.iprobe(1, tag=8)
        still = dev.iprobe(1, tag=7)                    # probing does not take it
        got = dev.recv(1, tag=7)
        return before, other_tag, still, got.tolist(), dev.iprobe(1, tag=7)
    dev.recv(0, tag=5)
    dev.send(np.arange(3.0) + np.arange(20000.0)[:3], 0, tag=7)
    return None


def test_iprobe_sees_a_message_without_taking_it():
    with VirtualCluster(Mesh((2,), ("x",))) as cluster:
        before, other_tag, still, got, after = cluster.run(_probe)[0]
    assert (before, other_tag, still, after) == (False, False, True, False)
    assert got == [0.0, 2.0, 4.0]
