"""vLLM's custom all-reduce: the tensor-parallel all-reduce an inference engine runs.

Serving engines do not reduce their small per-layer activations with NCCL's ring: vLLM
(``vllm/distributed/device_communicators/custom_all_reduce.py``, since PR #2192) runs a
one-kernel all-reduce over peer-mapped buffers (one-shot: every GPU reads every peer's
buffer; two-shot for larger sizes: reduce-scatter then all-gather through the same
buffers), for world sizes 2, 4, 6 and 8 on a fully NVLink-connected node and messages up
to 8 MiB (``max_size=8192 * 1024``); NCCL takes over beyond. Its latency at decode sizes
(tens to hundreds of KB) is a third to a half of NCCL's.

The price is interpolated in a table measured on H100 SXM (:data:`HOPPER_MEASURED_US`):
vLLM's custom all-reduce timed by SGLang's unit test, without CUDA graphs
(sgl-project/sglang PR #2904, "unit test performance in H100 (without cuda graph)",
the "vllm" table: 512 B to 1 MiB at tp 2, 4 and 8). Between the measured sizes the time
is linear in the bytes; beyond 1 MiB, unmeasured, it is the lesser of the last interval's
rate extrapolated and NCCL's price (vLLM's two-shot kernel moves the bytes as a ring
would); tp 6 takes the mean of tp 4 and 8. The figures include one kernel launch each: under CUDA graphs a
little less, so this errs slow. Applied to Hopper devices (H100, H200: the same NVLink 4
switch fabric) only; elsewhere, and above 8 MiB, ``None`` (price it with NCCL's model).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

__all__ = ["HOPPER_MEASURED_US", "CUSTOM_ALLREDUCE_MAX_BYTES", "custom_allreduce_s",
           "tp_allreduce_s"]

#: vLLM's custom all-reduce limit: larger messages go to NCCL (``max_size=8192 * 1024``)
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024
#: the measured sizes, bytes
_SIZES = (512, 4096, 32768, 262144, 524288, 1048576)
#: tp -> microseconds at each of ``_SIZES`` (sglang PR #2904, H100, vLLM's kernel)
HOPPER_MEASURED_US = MappingProxyType({
    2: (9.5, 8.8, 8.7, 12.9, 17.7, 26.6),
    4: (9.1, 8.5, 9.2, 20.6, 26.9, 40.2),
    8: (10.1, 9.3, 11.8, 24.1, 30.4, 45.0),
})
_HOPPER = ("H100", "H200")


def _table(tp: int):
    if tp == 6:
        return tuple((a + b) / 2 for a, b in zip(HOPPER_MEASURED_US[4], HOPPER_MEASURED_US[8]))
    return HOPPER_MEASURED_US.get(tp)


def custom_allreduce_s(device_name: str, tp: int, nbytes: float,
                       same_node: bool = True) -> float | None:
    """Seconds of vLLM's custom all-reduce of ``nbytes`` over ``tp`` GPUs of one node of
    ``device_name`` (module docstring); None where vLLM would use NCCL instead (another
    device family, tp not in 2, 4, 6, 8, across nodes, or above 8 MiB)."""
    table = _table(tp)
    if table is None or not same_node or not device_name.startswith(_HOPPER) \
            or nbytes > CUSTOM_ALLREDUCE_MAX_BYTES:
        return None
    if nbytes <= 0:
        return 0.0
    sizes = np.asarray(_SIZES, dtype=float)
    us = np.asarray(table, dtype=float)
    if nbytes <= sizes[-1]:
        return float(np.interp(nbytes, sizes, us)) * 1e-6
    slope = (us[-1] - us[-2]) / (sizes[-1] - sizes[-2])
    return float(us[-1] + slope * (nbytes - sizes[-1])) * 1e-6


def tp_allreduce_s(device_name: str, tp: int, nbytes: float, nccl_s: float,
                   same_node: bool = True) -> float:
    """What vLLM's tensor-parallel all-reduce of ``nbytes`` costs: the custom kernel's
    measured price up to 1 MiB, the lesser of its extrapolation and ``nccl_s`` (NCCL's
    price of the same all-reduce) up to 8 MiB, ``nccl_s`` wherever vLLM uses NCCL."""
    custom = custom_allreduce_s(device_name, tp, nbytes, same_node)
    if custom is None:
        return nccl_s
    return custom if nbytes <= _SIZES[-1] else min(custom, nccl_s)
