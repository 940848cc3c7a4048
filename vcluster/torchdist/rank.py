"""One torch.distributed rank: join the process group, create every axis group, and
build its :class:`TorchDeviceContext`. Used by the local launcher and under torchrun."""

from __future__ import annotations

import datetime

from .groups import group_plan

__all__ = ["choose_backend", "backend_choice", "visible_gpus", "init_rank", "join_world",
           "mesh_context", "backend_info"]

_BACKENDS = ("auto", "gloo", "nccl")


def require_torch() -> None:
    """Raise an ImportError that says how to install torch, when it is missing."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        raise ImportError("the torch engine needs torch: pip install -e '.[torch]' (a CPU "
                          "build: pip install torch --index-url "
                          "https://download.pytorch.org/whl/cpu)")


def visible_gpus() -> int:
    """How many CUDA devices this process sees: ``torch.cuda.device_count()``, 0 when
    CUDA is not available."""
    require_torch()
    import torch
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _gpus(n: int) -> str:
    return "no GPU (CUDA is not available)" if n == 0 else _count(n, "GPU")


def _check_counts(world_size, gpu_count) -> None:
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise ValueError(f"world_size must be a positive int or None, got {world_size!r}")
    if gpu_count is not None and (type(gpu_count) is not int or gpu_count < 0):
        raise ValueError(f"gpu_count must be an int >= 0 or None, got {gpu_count!r}")


def backend_choice(backend: str = "auto", world_size: int | None = None,
                   gpu_count: int | None = None) -> tuple[str, str | None]:
    """The backend for ``world_size`` ranks sharing ``gpu_count`` GPUs, and a note.

    ``auto``: NCCL when every rank can have its own GPU (``gpu_count >= world_size``),
    else gloo (CPU tensors). ``nccl``: a ValueError naming the ranks, the GPUs and the
    fix when the GPUs are too few. ``gloo``: gloo. NCCL refuses two ranks on one GPU.

    ``world_size``: the ranks that share this machine's GPUs; None counts this process
    alone (as under torchrun, where each rank has a local GPU). ``gpu_count``: None asks
    :func:`visible_gpus` (imports torch); not asked for ``gloo``.

    The note is one line saying why ``auto`` chose gloo although GPUs are present (too
    few for the ranks); None otherwise (a machine without CUDA choosing gloo is
    unremarkable).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    _check_counts(world_size, gpu_count)
    if backend == "gloo":
        return "gloo", None
    gpus = visible_gpus() if gpu_count is None else gpu_count
    need = 1 if world_size is None else world_size
    if gpus >= need:
        return "nccl", None
    ranks = "this rank" if world_size is None else _count(world_size, "rank")
    if backend == "nccl":
        fix = "use backend='gloo' or 'auto'" + (f", or a mesh of at most {gpus} devices"
                                                if gpus else "")
        raise ValueError(f"backend='nccl' needs one GPU per rank: {ranks}, {_gpus(gpus)}; "
                         f"{fix}")
    if gpus == 0:
        return "gloo", None
    return "gloo", (f"backend 'auto' chose gloo (CPU tensors), not NCCL: {ranks}, "
                    f"{_gpus(gpus)}, and NCCL needs one GPU per rank (backend='gloo' "
                    f"chooses it quietly; a mesh of at most {gpus} devices gets NCCL)")


def choose_backend(backend: str = "auto", world_size: int | None = None,
                   gpu_count: int | None = None) -> str:
    """``auto``: NCCL when every rank can have its own GPU, else gloo; see
    :func:`backend_choice` (this is its backend, without the note)."""
    return backend_choice(backend, world_size, gpu_count)[0]


def init_rank(mesh, rank: int, backend: str, init_method: str, timeout_s: float,
              local_rank: int | None = None, local_world_size: int | None = None):
    """Join the world of ``mesh.size`` ranks and return this rank's device context:
    :func:`join_world`, then :func:`mesh_context`.

    ``backend`` as :func:`choose_backend`: without ``local_rank`` (the local launcher)
    all ``mesh.size`` ranks share this machine's GPUs, so NCCL needs that many; with
    ``local_rank`` (torchrun) the ``local_world_size`` ranks of this node share its GPUs
    (None: this rank alone), each rank on ``cuda:<local_rank>``.
    """
    device = join_world(mesh.size, rank, backend, init_method, timeout_s, local_rank,
                        local_world_size)
    return mesh_context(mesh, rank, device, timeout_s)


def join_world(world_size: int, rank: int, backend: str, init_method: str, timeout_s: float,
               local_rank: int | None = None, local_world_size: int | None = None) -> str:
    """``init_process_group`` for ``world_size`` ranks; return where this rank stages
    its tensors: "cpu" (gloo) or "cuda:<i>" (NCCL; i = ``local_rank``, else ``rank``).
    The arguments as :func:`init_rank`'s."""
    import torch
    import torch.distributed as dist

    backend = choose_backend(backend, world_size if local_rank is None else local_world_size)
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank if local_rank is None else local_rank}"    # one GPU per rank
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def mesh_context(mesh, rank: int, device: str, timeout_s: float, made: dict | None = None):
    """This rank's :class:`TorchDeviceContext` on ``mesh`` in the world joined by
    :func:`join_world` (``mesh.size`` must be its size: a ValueError names both).

    Every rank calls ``new_group`` for every group of :func:`group_plan` in its order
    (torch requires that of members and non-members alike), except those in ``made``
    (sorted member tuple -> process group, from an earlier mesh of the same world; new
    groups are added to it): several meshes of one world, as the points of a sweep, then
    share their common groups, as long as every rank builds them in the same order.
    """
    import torch.distributed as dist
    from .context import TorchDeviceContext

    world = dist.get_world_size()
    if mesh.size != world:
        raise ValueError(f"mesh {mesh} has {mesh.size} devices, the torch.distributed world "
                         f"has {world} ranks")
    made = {} if made is None else made
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    groups = {tuple(range(mesh.size)): dist.group.WORLD}
    for members in group_plan(mesh):
        if members not in made:
            made[members] = dist.new_group(list(members), timeout=timeout, backend=backend)
        if rank in members:
            groups[members] = made[members]
    return TorchDeviceContext(rank, mesh, groups, device)


def backend_info() -> dict:
    """What torch reports about this run: ``torch_version``, ``torch_backend``."""
    import torch
    import torch.distributed as dist
    return {"torch_version": str(torch.__version__),
            "torch_backend": str(dist.get_backend()) if dist.is_initialized() else None}
