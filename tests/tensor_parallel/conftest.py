"""Fixtures of the tensor-parallel tests."""

import pytest

from mesh import Mesh
from vcluster import VirtualCluster


@pytest.fixture(scope="module")
def clusters():
    """``clusters(ep)``: one VirtualCluster on a 1-D ``("ep",)`` mesh of ``ep`` devices,
    started on first use and kept for the module (a module may define its own)."""
    made = {}

    def get(ep):
        if ep not in made:
            made[ep] = VirtualCluster(Mesh((ep,), ("ep",)), timeout_s=30)
        return made[ep]

    yield get
    for c in made.values():
        c.close()
