"""The KV-cache transfer of disaggregated serving: a prefilled prompt's cache moves from a
prefill replica to a decode replica, priced as point-to-point sends on the network model.

Placement: prefill replica i holds global ranks [i·g_p, (i+1)·g_p); the decode pool starts
at the first node boundary after the prefill pool (``⌈P·g_p / G⌉·G``, G GPUs per node —
the pools on separate nodes, as production P/D deployments place them) and decode replica
j holds [base + j·g_d, base + (j+1)·g_d).

Bytes: ``modeling.counts.kv_cache_bytes(spec, prompt_len)`` (= prompt_len × KV bytes per
token for full attention; a sliding-window layer keeps its window only). A replica's cache
is split over its GPUs (by KV heads under TP, by layers under PP), so the transfer is
f = min(g_p, g_d) parallel sends of bytes/f, GPU k of the prefill replica to GPU k of the
decode replica, each on its own rail NIC: time = one send,
``collective_time_s("send", bytes/f, (src_k, dst_k), hardware)`` = NCCL's base latency +
the link's latency + (bytes/f)/bandwidth — NVLink within a node, one NIC
(``hardware.network.nic``) across nodes. (NIXL, which vLLM's P/D uses, reads the blocks
over RDMA without NCCL; the base latency is then a few µs too many.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from modeling.counts import kv_cache_bytes
from modeling.errors import ConfigError
from modeling.spec import ModelSpec

from ..collective_cost import collective_time_s
from ..hardware import HardwareSpec

__all__ = ["KVTransferPricer", "NetworkKVTransfer"]


@runtime_checkable
class KVTransferPricer(Protocol):
    """Seconds to move the KV cache of a ``prompt_len``-token prompt from prefill replica
    ``src`` to decode replica ``dst``."""

    def time_s(self, prompt_len: int, src: int, dst: int) -> float:
        ...


def _count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "an integer >= 1", "not a count",
                          owner="NetworkKVTransfer")
    return value


@dataclass(frozen=True)
class NetworkKVTransfer:
    """KV transfer of ``spec`` over ``hardware`` (module docstring) between
    ``prefill_replicas`` replicas of ``prefill_gpus`` GPUs and decode replicas of
    ``decode_gpus`` GPUs; ``kv_bytes_per_element`` 2 (bf16) or 1 (fp8 KV cache)."""

    spec: ModelSpec
    hardware: HardwareSpec
    prefill_replicas: int = 1
    prefill_gpus: int = 1
    decode_gpus: int = 1
    kv_bytes_per_element: int = 2
    # time_s by (prompt_len, src, dst): a run asks once per request, mostly the same few
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.spec, ModelSpec):
            raise TypeError(f"NetworkKVTransfer: spec must be a ModelSpec, got {self.spec!r}")
        if not isinstance(self.hardware, HardwareSpec):
            raise TypeError("NetworkKVTransfer: hardware must be a HardwareSpec, got "
                            f"{self.hardware!r}")
        for name in ("prefill_replicas", "prefill_gpus", "decode_gpus", "kv_bytes_per_element"):
            _count(name, getattr(self, name))

    @property
    def flows(self) -> int:
        """Parallel sends per transfer: min(g_p, g_d)."""
        return min(self.prefill_gpus, self.decode_gpus)

    @property
    def decode_base_rank(self) -> int:
        """First global rank of the decode pool (a node boundary)."""
        gpn = self.hardware.gpus_per_node
        return -(-self.prefill_replicas * self.prefill_gpus // gpn) * gpn

    def ranks(self, src: int, dst: int) -> tuple[int, int]:
        """The first GPU of prefill replica ``src`` and of decode replica ``dst``."""
        if not 0 <= src < self.prefill_replicas:
            raise ConfigError("src", src, f"a prefill replica in [0, {self.prefill_replicas})",
                              "no such replica", owner="NetworkKVTransfer")
        return src * self.prefill_gpus, self.decode_base_rank + dst * self.decode_gpus

    def nbytes(self, prompt_len: int) -> int:
        """KV bytes of a ``prompt_len``-token prompt over the whole model."""
        return kv_cache_bytes(self.spec, prompt_len, self.kv_bytes_per_element)

    def time_s(self, prompt_len: int, src: int, dst: int) -> float:
        key = (prompt_len, src, dst)
        seconds = self._memo.get(key)
        if seconds is None:
            seconds = self._memo[key] = collective_time_s(
                "send", self.nbytes(prompt_len) / self.flows, self.ranks(src, dst),
                self.hardware)
        return seconds

    def __repr__(self) -> str:
        return (f"NetworkKVTransfer(spec={self.spec.name!r}, hardware={self.hardware.name!r}, "
                f"prefill_replicas={self.prefill_replicas}, prefill_gpus={self.prefill_gpus}, "
                f"decode_gpus={self.decode_gpus}, kv_bytes_per_element={self.kv_bytes_per_element})")
