"""Thread pools sized to the machine (issue 32): each device's BLAS/OpenMP pool is
``max(1, cores // devices)`` wide by default, read inside the devices with threadpoolctl
(what the libraries themselves report), so 8 devices on a 2-core machine start no pool
threads beyond their own; ``threads_per_device=`` overrides it and the repr says it."""

import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.cores import usable_cores

pytestmark = pytest.mark.timeout(120)


def _pools(dev):
    from threadpoolctl import threadpool_info
    import scipy.linalg.blas  # noqa: F401  (scipy's own OpenBLAS, which W's GEMMs use)
    return sorted((p["user_api"], p["internal_api"], p["num_threads"])
                  for p in threadpool_info())


@pytest.mark.parametrize("n", [2, 8])
def test_default_pools_share_the_cores(n):
    cores = usable_cores()
    with VirtualCluster(Mesh((n,), ("x",)), timeout_s=30.0) as cluster:
        want = max(1, cores // n)
        assert cluster.options.threads_per_device == want
        assert f"threads_per_device={want}" in repr(cluster)
        pools = cluster.run(_pools)
    blas = [[t for api, _, t in device if api == "blas"] for device in pools]
    assert all(b for b in blas), f"no BLAS pool found in the devices: {pools}"
    for device in pools:                       # every pool (BLAS and OpenMP) alike
        assert all(t == want for _, _, t in device), device
    # in total: at most one pool thread per core, or the devices' own thread each
    assert sum(max(b) for b in blas) <= max(cores, n)


def test_threads_per_device_overrides_the_default():
    """Two threads each on 4 devices (the default is 1 below 8 cores). OpenBLAS never
    starts more threads than it sees CPUs, so this needs a machine of 2 cores or more."""
    if usable_cores() < 2:
        pytest.skip("needs 2 usable cores: OpenBLAS caps its pool at the CPUs it sees")
    with VirtualCluster(Mesh((4,), ("x",)), timeout_s=30.0, threads_per_device=2) as cluster:
        assert "threads_per_device=2" in repr(cluster)
        pools = cluster.run(_pools)
    assert all(t == 2 for device in pools for _, _, t in device), pools
