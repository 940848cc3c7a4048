"""Tracing: the same per-device programs on shape-only arrays, recorded as symbolic ops."""

from .compare import comm_signature, trace_comm_signature
from .kernel import Kernel, KernelKind
from .meta import MetaArray, is_meta, meta_like
from .ops import (RING_TAG_BASE, DeviceTrace, TraceCollective, TraceCompute, TraceOp, TraceRecv,
                  TraceSend, TraceWait, is_ring_tag)
from .tracer import TraceError, TracingDevice, trace_program

__all__ = ["Kernel", "KernelKind", "MetaArray", "meta_like", "is_meta", "DeviceTrace", "TraceCollective",
           "TraceCompute", "TraceOp", "TraceRecv", "TraceSend", "TraceWait", "TraceError",
           "RING_TAG_BASE", "is_ring_tag",
           "TracingDevice", "trace_program", "comm_signature", "trace_comm_signature"]
