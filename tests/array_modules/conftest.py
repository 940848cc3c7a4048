"""Fixtures of the array-module suite: the same workloads on every device module.

``strict`` runs everywhere (CI included); ``cupy`` runs where CuPy sees a CUDA device and
is skipped elsewhere with the reason. The clusters are kept for a test module."""

import pytest

MODULES = ("strict", "cupy")


def cupy_missing() -> str | None:
    """Why CuPy cannot run here (None when it can)."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:      # CUDA driver or runtime missing
        return f"CuPy finds no CUDA device ({type(exc).__name__}: {exc})"
    return None if count else "CuPy finds no CUDA device (0 devices)"


@pytest.fixture(scope="module", params=MODULES)
def array_module(request):
    if request.param == "cupy" and (why := cupy_missing()):
        pytest.skip(why)
    return request.param


# Clusters kept open at once: on one GPU every device process holds a CUDA context and
# the device memory it shares, so a module's clusters are not all kept (8 devices x
# (context + 256 MiB) each).
KEEP_OPEN = 2
DEVICE_ARENA_BYTES = 256 << 20


@pytest.fixture(scope="module")
def device_cluster_of(array_module):
    """``device_cluster_of(mesh, transport="auto")``: a cluster of ``array_module``
    (the last ``KEEP_OPEN`` stay open)."""
    from vcluster import VirtualCluster

    clusters = {}

    def get(mesh, transport="auto"):
        key = (mesh, transport)
        if key not in clusters:
            while len(clusters) >= KEEP_OPEN:
                clusters.pop(next(iter(clusters))).close()
            clusters[key] = VirtualCluster(mesh, array_module=array_module, transport=transport,
                                           timeout_s=60.0, run_timeout_s=900.0,
                                           device_arena_bytes=DEVICE_ARENA_BYTES)
        else:
            clusters[key] = clusters.pop(key)        # most recently used last
        return clusters[key]

    yield get
    for cluster in clusters.values():
        cluster.close()
