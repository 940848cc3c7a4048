"""The one place that makes an emulation engine from its name.

An engine runs ``program(dev, *args)`` on every rank (``engine.run(program,
args_by_rank) -> outputs by rank``), records events (``engine.trace()``,
``engine.reset_stats()``), and closes (``engine.close()``). Today: ``emulator``
(:class:`~vcluster.VirtualCluster`).
"""

from __future__ import annotations

from .errors import ScenarioError

__all__ = ["ENGINES", "RECORDS_TRAFFIC", "make_engine"]

ENGINES = ("emulator", "torch")
#: engines whose communication events carry per-peer messages and bytes (torch.distributed
#: does not report what its backend moved: with it, measured traffic is unknown, not 0)
RECORDS_TRAFFIC = ("emulator",)


def make_engine(name: str, mesh, *, array_module: str = "numpy", timeout_s: float = 60.0):
    """A started engine of ``name`` over ``mesh`` (close it, or use it in ``with``)."""
    if name == "emulator":
        # lazy: keeps vcluster --help fast
        from vcluster import VirtualCluster
        return VirtualCluster(mesh, array_module=array_module, timeout_s=timeout_s)
    if name == "torch":
        if array_module != "numpy":
            raise ScenarioError("cluster.array_module", array_module, "numpy",
                                "the torch engine stages numpy arrays for its backend")
        # lazy: keeps vcluster --help fast
        from vcluster.torchdist import TorchCluster
        return TorchCluster(mesh, timeout_s=timeout_s)
    raise ScenarioError("--engine", name, ", ".join(ENGINES), "unknown engine")
