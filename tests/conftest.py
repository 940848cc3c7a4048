"""Shared fixtures."""

import pytest


@pytest.fixture(scope="module")
def cluster_of():
    """``cluster_of(mesh)``: one VirtualCluster per mesh, started on first use and kept
    for the test module (a run costs milliseconds, a start ~0.2-0.4 s)."""
    from vcluster import VirtualCluster

    clusters = {}

    def get(mesh):
        if mesh not in clusters:
            clusters[mesh] = VirtualCluster(mesh, timeout_s=30.0, run_timeout_s=300.0)
        return clusters[mesh]

    yield get
    for cluster in clusters.values():
        cluster.close()
