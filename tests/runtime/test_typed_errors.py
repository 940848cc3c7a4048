"""A device's runtime error reaches the host as its own type (issue 31, item 5): the
README promises CollectiveTimeout and CollectiveMismatch, so ``except CollectiveTimeout``
in the host must catch a device's timeout — and the error is still a DeviceProgramError
carrying the rank and the device's traceback."""

import numpy as np
import pytest

import vcluster
from mesh import Mesh

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster():
    with vcluster.VirtualCluster(Mesh((2,), ("x",)), timeout_s=0.5,
                                 arena_bytes=8 << 20) as c:
        yield c


def test_except_collective_timeout_catches_a_devices_timeout(cluster):
    def prog(dev):
        if dev.rank == 0:
            return dev.recv(1, tag=7)            # rank 1 never sends

    try:
        cluster.run(prog)
    except vcluster.CollectiveTimeout as exc:
        assert isinstance(exc, vcluster.DeviceProgramError) and exc.rank == 0
        assert "timed out after 0.5 s" in str(exc) and "rank 1" in str(exc)
        assert "dev.recv(1, tag=7)" in exc.remote_traceback
    else:
        pytest.fail("no CollectiveTimeout")
    assert cluster.run(lambda dev: dev.rank) == [0, 1]      # and the cluster is usable


def test_except_collective_mismatch_catches_a_devices_mismatch(cluster):
    def prog(dev):
        x = np.ones(4)
        return dev.all_reduce(x) if dev.rank == 0 else dev.all_gather(x)

    with pytest.raises(vcluster.CollectiveMismatch) as info:
        cluster.run(prog)
    assert isinstance(info.value, vcluster.DeviceProgramError)
    assert not isinstance(info.value, vcluster.CollectiveTimeout)


def test_except_arena_full_catches_a_devices_full_arena(cluster):
    with pytest.raises(vcluster.ArenaFullError) as info:
        cluster.run(lambda dev: dev.empty(16 << 20, np.uint8))
    assert "no room for an array of shape (16777216,)" in str(info.value)


def test_other_errors_stay_device_program_errors(cluster):
    def prog(dev):
        raise ValueError(f"bad input on rank {dev.rank}")

    with pytest.raises(vcluster.DeviceProgramError) as info:
        cluster.run(prog)
    assert type(info.value) is vcluster.DeviceProgramError
    assert "ValueError: bad input on rank" in str(info.value)
