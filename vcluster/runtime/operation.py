"""``Operation``: a parallel operation as a per-device program plus host conveniences.

An operation knows how to run on ONE device (``forward_local(dev, *local_inputs)``,
and ``backward_local`` where it has a gradient) — these are the functions other
programs compose (a pipeline stage calls a MatMul's ``forward_local``). The host
conveniences (``run``, ``backward``) split global arrays into per-rank arguments, call
``cluster.run`` and put the results back together; how to split is the subclass's
business (e.g. :class:`tensor_parallel.ShardedOperation` uses tensor layouts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["Operation"]


class Operation(ABC):
    """Base of every parallel operation (MatMul, FeedForward, pipelined MLP, ...)."""

    name: str = "operation"

    @abstractmethod
    def forward_local(self, dev, *local_inputs):
        """The forward per-device program: local inputs in, local outputs out."""

    @abstractmethod
    def run(self, cluster, *global_inputs):
        """Host convenience: global inputs in, global output out."""
