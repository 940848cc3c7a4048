"""Shared fixtures."""

import pytest


@pytest.fixture(scope="module")
def cluster_of():
    """``cluster_of(mesh, algorithm=None)``: one VirtualCluster per mesh (and collective
    algorithm, None: the default), started on first use and kept for the test module (a
    run costs milliseconds, a start ~0.2-0.4 s)."""
    from vcluster import VirtualCluster

    clusters = {}

    def get(mesh, algorithm=None):
        key = (mesh, algorithm)
        if key not in clusters:
            extra = {} if algorithm is None else {"algorithm": algorithm}
            clusters[key] = VirtualCluster(mesh, timeout_s=30.0, run_timeout_s=300.0, **extra)
        return clusters[key]

    yield get
    for cluster in clusters.values():
        cluster.close()
