"""The torch.distributed engine: the same per-device programs as torch.distributed ranks.

``TorchCluster(mesh)`` starts ``mesh.size`` local ranks (NCCL when every rank can have its
own GPU, else gloo on CPU) and runs programs with ``cluster.run(fn, args_per_rank)`` like
``VirtualCluster``; each rank's ``dev`` is a :class:`TorchDeviceContext`. ``python -m
vcluster.cli.torchrun`` runs a program under torchrun (multi-node). torch is imported
only inside the ranks, when a context is built, and on the host to count its GPUs when a
``TorchCluster``'s backend is ``auto`` or ``nccl``, so ``import vcluster.torchdist`` works
without torch.
"""

from .cluster import TorchCluster
from .context import TorchDeviceContext, TorchWork
from .groups import group_plan
from .rank import backend_choice, backend_info, choose_backend, init_rank, visible_gpus

__all__ = ["TorchCluster", "TorchDeviceContext", "TorchWork", "group_plan", "backend_info",
           "choose_backend", "backend_choice", "visible_gpus", "init_rank"]
