"""256 virtual devices on one machine (issue 30): the host holds more than 1024 file
descriptors then, where ``select`` stops (``ValueError: filedescriptor out of range in
select()`` before); the host and the launcher wait with ``poll``."""

import os
import socket

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.wire import readable, send_msg

pytestmark = pytest.mark.timeout(240)


def _sum_of_ranks(dev):
    return float(dev.all_reduce(np.array([float(dev.rank)]), "x")[0])


@pytest.mark.slow
def test_256_devices_start_and_all_reduce():
    n = 256
    with VirtualCluster(Mesh((n,), ("x",)), timeout_s=120) as cluster:
        assert set(cluster.run(_sum_of_ranks)) == {n * (n - 1) / 2}


def test_readable_takes_descriptors_beyond_select():
    a, b = socket.socketpair()
    fillers = [socket.socket() for _ in range(1100)]       # push the pair's copies past 1024
    try:
        high_a = socket.socket(fileno=os.dup(a.fileno()))
        high_b = socket.socket(fileno=os.dup(b.fileno()))
        assert high_a.fileno() > 1024
        assert not readable(high_a, 0.01)
        send_msg(high_b, ("hello",))
        assert readable(high_a, 1.0)
        high_a.close()
        high_b.close()
    finally:
        for s in fillers:
            s.close()
        a.close()
        b.close()
