"""``DeviceContext``: what a per-device program sees, whatever engine runs it.

A per-device program is ``fn(dev, *args)``. The emulator passes an
:class:`~vcluster.runtime.emulated_device.EmulatedDevice`; later engines (a tracer with
shape-only arrays, a torch.distributed rank) implement the same Protocol, and one
conformance suite (``tests/conformance/``) runs against each.

Groups. ``axis`` names the mesh axes of the group: one name, a tuple of names (major to
minor) or None (all ranks). The members are the ranks that share every coordinate
outside those axes, ordered by their coordinates along them; ``root`` is a *position*
in that order, ``to``/``src`` of send/recv are global ranks.

Every collective takes ``out=`` (write the result there; for all_reduce it may be the
input, in place) and ``async_op=True`` (return a :class:`Work` whose ``wait()`` returns
the result). ``algorithm=`` picks ring, tree, pairwise, shm or auto
(:func:`~vcluster.runtime.algorithm.choose_algorithm`).

=====================================  ================================================
call                                   result on each member
=====================================  ================================================
all_reduce(x, axis, op="sum")          elementwise reduction (sum, prod, max, min, avg)
all_gather(x, axis, dim=0)             members' arrays concatenated along dim
reduce_scatter(x, axis, dim=0, op)     this member's slice along dim of the reduction
all_to_all(x, axis, split_dim=0,       piece j of member i goes to member j; pieces
           concat_dim=0)               concatenated along concat_dim in group order
broadcast(x, axis, root=0)             the root's array (others may pass None)
scatter(x, axis, root=0, dim=0)        the root's array split along dim, piece i to i
gather(x, axis, root=0, dim=0)         concatenation at the root, None elsewhere
reduce(x, axis, root=0, op="sum")      the reduction at the root, None elsewhere
send(x, to, tag=0) / recv(src, tag=0)  point to point between global ranks
isend / irecv                          non-blocking; Work.wait() (irecv's returns it)
barrier(axis=None)                     returns when every member has arrived
=====================================  ================================================

Memory. ``record_memory(params=..., grads=..., optimizer=..., activations=...)`` says
how many bytes of each kind the program holds now (the program knows which arrays are
which); each engine keeps the peak of every kind since its last reset
(``cluster.stats()``'s ``peak_params_bytes`` ..., a trace's ``peak_bytes``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["DeviceContext", "Work"]


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous operation."""

    def wait(self, timeout_s: float | None = None) -> Any: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class DeviceContext(Protocol):
    """The per-device context of an SPMD program (see the module docstring)."""

    rank: int
    mesh: Any           # mesh.Mesh
    index: Any          # mesh.MeshIndex of this rank
    xp: Any             # numpy, cupy, or the strict module (vcluster.runtime.arrays)

    def empty(self, shape, dtype=...) -> Any: ...

    def compute(self, name: str, flops: float = 0, bytes: int = 0,
                gemm: tuple | None = None, kernel=None) -> AbstractContextManager: ...

    def all_reduce(self, x, axis=None, op="sum", *, out=None, async_op=False,
                   algorithm="auto"): ...

    def all_gather(self, x, axis=None, dim=0, *, out=None, async_op=False,
                   algorithm="auto"): ...

    def reduce_scatter(self, x, axis=None, dim=0, op="sum", *, out=None, async_op=False,
                       algorithm="auto"): ...

    def all_to_all(self, x, axis=None, split_dim=0, concat_dim=0, *, out=None,
                   async_op=False, algorithm="auto"): ...

    def broadcast(self, x, axis=None, root=0, *, out=None, async_op=False,
                  algorithm="auto"): ...

    def scatter(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
                algorithm="auto"): ...

    def gather(self, x, axis=None, root=0, dim=0, *, out=None, async_op=False,
               algorithm="auto"): ...

    def reduce(self, x, axis=None, root=0, op="sum", *, out=None, async_op=False,
               algorithm="auto"): ...

    def record_memory(self, **held_bytes: int) -> None: ...

    def send(self, x, to: int, tag: int = 0) -> None: ...

    def recv(self, src: int, tag: int = 0, *, out=None) -> Any: ...

    def isend(self, x, to: int, tag: int = 0) -> Work: ...

    def irecv(self, src: int, tag: int = 0, *, out=None) -> Work: ...

    def barrier(self, axis=None, *, async_op=False, algorithm="auto") -> Any: ...
