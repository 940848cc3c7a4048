"""One torch.distributed rank: join the process group, create every axis group, and
build its :class:`TorchDeviceContext`. Used by the local launcher and under torchrun."""

from __future__ import annotations

import datetime

from .groups import group_plan

__all__ = ["choose_backend", "init_rank", "backend_info"]


def choose_backend(backend: str = "auto") -> str:
    """``auto``: NCCL when CUDA is available, else gloo."""
    import torch
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False "
                         "(use 'gloo' or 'auto')")
    return backend


def init_rank(mesh, rank: int, backend: str, init_method: str, timeout_s: float,
              local_rank: int | None = None):
    """Join the world of ``mesh.size`` ranks and return this rank's device context.

    Every rank calls ``new_group`` for every group of :func:`group_plan`, in its order
    (torch requires that of members and non-members alike).
    """
    import torch
    import torch.distributed as dist
    from .context import TorchDeviceContext

    backend = choose_backend(backend)
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank % torch.cuda.device_count() if local_rank is None else local_rank}"
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=mesh.size, timeout=timeout)
    groups = {tuple(range(mesh.size)): dist.group.WORLD}
    for members in group_plan(mesh):
        pg = dist.new_group(list(members), timeout=timeout, backend=backend)
        if rank in members:
            groups[members] = pg
    return TorchDeviceContext(rank, mesh, groups, device)


def backend_info() -> dict:
    """What torch reports about this run: ``torch_version``, ``torch_backend``."""
    import torch
    import torch.distributed as dist
    return {"torch_version": str(torch.__version__),
            "torch_backend": str(dist.get_backend()) if dist.is_initialized() else None}
