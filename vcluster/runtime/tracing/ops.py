"""A symbolic trace: what each device does, in order, with sizes but no data.

The tracer (:mod:`vcluster.runtime.tracing.tracer`) records one tuple of these ops per
traced rank by running the same per-device program on shape-only arrays; the timing
model (:mod:`vcluster.timing`) replays them on a hardware model. Ops are small frozen
dataclasses:

* ``TraceCompute(name, flops, bytes, seconds=None, host_s=0, array_calls=0, array_s=0,
  contains=0, kernel=None)`` — work on the device's compute stream; ops named ``"host"``
  (``trace_program(host_time=True)``) carry a program's own host work instead
  (:mod:`vcluster.runtime.tracing.host`). A ``dev.compute`` block is recorded when it
  ends, after the ops issued inside it: ``contains`` says how many of the ops just before
  it those are (host ops not counted, so that a trace with and without host time says the
  same), so that a report can draw the block (a pipeline action ``0F1``, say) over the
  span of the work it holds;
* ``TraceCollective(collective, group, nbytes, itemsize, algorithm, root, handle)`` — one
  call of a collective by this member (``nbytes``: its local input, or for broadcast and
  scatter the root's); blocking when ``handle`` is None, else issued asynchronously on the
  device's communication stream (FIFO) and waited for by ``TraceWait(handle)``;
* ``TraceSend(peer, nbytes, tag)`` / ``TraceRecv(peer, nbytes, tag)`` — point to point:
  a send does not block the sender (buffered), a receive waits for the matching send's
  data (same peer pair and tag, in order);
* ``TraceWait(handle)`` — wait for an asynchronous collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernel import Kernel, KernelKind

__all__ = ["TraceCompute", "TraceCollective", "TraceSend", "TraceRecv", "TraceWait", "TraceOp",
           "DeviceTrace", "RING_TAG_BASE", "is_ring_tag"]

#: point-to-point tags from here on mark the steps of a ring every member of a group runs
#: alike (a tensor-parallel collective matmul): under symmetric replay a receive with such a
#: tag from an untraced rank mirrors the receiver's own send (vcluster.timing.replay); other
#: tags keep the rule that a receive's peer must be traced
RING_TAG_BASE = 1 << 40


def is_ring_tag(tag: int) -> bool:
    """Whether ``tag`` marks a symmetric ring's step (:data:`RING_TAG_BASE`)."""
    return tag >= RING_TAG_BASE


@dataclass(frozen=True)
class TraceCompute:
    """``seconds``, when set, is a precomputed duration (e.g. of several coalesced kernels)
    that cost models use instead of pricing flops and bytes. ``host_s``,
    ``array_calls`` and ``array_s`` (host ops only): thread CPU seconds of the tracer in
    the program's own Python, the array operations it made, and the thread CPU seconds
    spent inside them (:mod:`vcluster.runtime.tracing.host`). ``contains``: the number of
    ops just before this one in the rank's trace, host ops not counted, that were issued
    inside this block (0 for a block with no device calls in it); the block's own cost is
    ``flops`` and ``bytes`` alone, its contents are priced as their own ops. ``kernel``:
    what the op is as one kernel, its kind and shape (:class:`~vcluster.runtime.tracing.
    kernel.Kernel`; a timing model with measured kernels prices it by them), None when
    the program did not say; ``gemm`` reads (batch, m, k, n) of a GEMM kernel
    (2·batch·m·k·n = ``flops``)."""

    name: str
    flops: float
    bytes: int
    seconds: float | None = None
    host_s: float = 0.0
    array_calls: int = 0
    array_s: float = 0.0
    contains: int = 0
    kernel: Kernel | None = None

    @classmethod
    def memory_bound(cls, name: str, nbytes: int, elements: int | None = None
                     ) -> "TraceCompute":
        """One elementwise kernel reading and writing ``nbytes`` in all, no FLOPs;
        ``elements`` (its kernel's size; default the 16-bit elements the bytes hold, at
        least 1)."""
        return cls(name, 0.0, nbytes, kernel=Kernel.elementwise(
            max(1, nbytes // 2) if elements is None else elements))

    @property
    def gemm(self) -> tuple | None:
        """(batch, m, k, n) when the op is one (batched) GEMM kernel, else None."""
        k = self.kernel
        return k.shape if k is not None and k.kind is KernelKind.GEMM else None


@dataclass(frozen=True)
class TraceCollective:
    collective: str
    group: tuple[int, ...]
    nbytes: int
    itemsize: int
    algorithm: str
    root: int = 0
    handle: int | None = None


@dataclass(frozen=True)
class TraceSend:
    peer: int
    nbytes: int
    tag: int


@dataclass(frozen=True)
class TraceRecv:
    peer: int
    nbytes: int
    tag: int


@dataclass(frozen=True)
class TraceWait:
    handle: int


TraceOp = TraceCompute | TraceCollective | TraceSend | TraceRecv | TraceWait


@dataclass(frozen=True)
class DeviceTrace:
    """The ops of one rank, in program order; ``peak_bytes``: (kind, bytes) of the most
    the program said it held of each kind (``dev.record_memory``)."""

    rank: int
    ops: tuple
    peak_bytes: tuple = ()

    def __len__(self) -> int:
        return len(self.ops)
