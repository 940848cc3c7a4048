"""``HardwareCostModel``: the engine's :class:`~vcluster.timing.cost_model.CostModel` for a
:class:`~vcluster.timing.hardware.HardwareSpec`.

* compute: ``DeviceSpec.compute_time_s(flops, bytes, dtype)`` — one kernel: its launch
  overhead plus the larger of the compute-bound time at the achieved GEMM efficiency and
  the memory-bound time at the achieved HBM bandwidth — divided by
  ``TRAINING_KERNEL_EFFICIENCY``. On hardware with measured kernels
  (:meth:`~.hardware.DeviceSpec.kernel_profile`: a file from ``vcluster hardware
  calibrate --gpu``, or a shipped ``kernel_table``), a traced op that names its kernel
  (``TraceCompute.kernel``: kind and shape) is priced instead by its kind's profile — a
  GEMM by ``call_s + batch · tile-padded FLOPs / rate`` (:mod:`.kernel_profile`), flash
  attention, norms, GELU, elementwise work, the cross-entropy and Adam's step by theirs
  (:mod:`.kernel_profiles`) — with no efficiency divisor (in-stream prices), and every
  kernel, profiled or not, at no less than the host's launch interval: price =
  max(in-stream price, launch interval). Kernels with no profile (dropout, activation
  gradients, SGD, unfused attention's softmax) keep the analytic price and its divisor;
* low-precision GEMMs: with ``fp8_gemms`` (a predicate on compute ops: which GEMMs run
  in low precision, as Transformer Engine runs a transformer layer's linear layers; the
  caller knows its program's ops) those ops are priced by the same analytic model in
  ``gemm_format`` (:mod:`.gemm_formats`: ``fp8``, the default, ``fp8-row``,
  ``fp8-block``, ``mxfp8`` at the device's FP8 peak; ``nvfp4``, ``mxfp4`` at its FP4
  peak; each at that dtype's best achieved share times the format's ``rate_share``:
  ``fp8-row``'s 0.76, 1 for the others), every other op as before. It needs the analytic model:
  measured kernel prices are of BF16 kernels, so hardware with measured kernels refuses
  it, as does a device without the format (:func:`.gemm_formats.check_gemm_format`);
* FlashAttention-1-class attention: with ``flash_v1`` (a run whose attention kernels were
  built for Ampere: FlashAttention 1, the Triton and xformers kernels of 2022-23;
  ``ParallelConfig.attention="flash-v1"``) every fused attention kernel computes at the
  ``a100-80gb-dgx`` preset's achieved rate times the device's ``flash_v1_speedup`` (H100:
  1.60, from FlashAttention-2's Figs. 4 and 7), not at this device's peak — such kernels
  gained 1.6x on the H100 where its dense peak grew 3.17x — with this device's launch
  overhead and HBM term (:meth:`HardwareCostModel.flash_v1_time_s`). On an A100 it
  changes nothing (times the device's ``sustained_compute_ratio``, 1 but on a power-limited
  part). Like FP8 it needs the analytic model;
* fused attention from published curves (:mod:`.attention_kernels`): a kernel named by
  ``attention_kernel`` (``flash2``, ``flash3``, ``cudnn``: ``ParallelConfig.attention``)
  is priced t_k + F / r(seq, head dim, mask, direction) — F the kernel's FLOPs in the curves'
  convention, from its shape (:func:`~vcluster.runtime.tracing.kernel.kernel_flops`) — from that kernel's curves on the
  device's ``attention_gpu`` (refused by name where there are none); ``attention="flash"``
  (``attention_kernel`` "") takes the measured profile where the hardware has one, else the
  device's default kernel (``DeviceSpec.attention_kernel``) on its curves, else the
  analytic price. No efficiency divisor: the curves are the kernels' own rates — on a
  power-limited part of the curves' die, times its ``sustained_compute_ratio``
  (:class:`~.hardware.DeviceSpec`);
* collectives: :func:`~vcluster.timing.collective_cost.collective_cost` with NCCL's
  algorithm choice (``auto``) whatever the emulator used (its ``shm`` algorithm exists
  only on one machine). The trace records each member's local input bytes; nccl-tests
  sizes (what the cost model takes) are the gathered output for all_gather and gather,
  so those are multiplied by the group size;
* point to point: a ``send`` between the two ranks; between nodes it occupies the
  sender's and the receiver's NIC (:meth:`HardwareCostModel.p2p_ports`), so transfers
  converging on one rank (a parameter server) queue there.

What a report shows of a collective comes from the same model: :meth:`~HardwareCostModel.
collective_algorithm` names the algorithm it priced (ring, tree, ...: never the
emulator's), :meth:`~HardwareCostModel.wire_bytes` the bytes each member carries
(:func:`~vcluster.timing.collective_cost.wire_bytes` over the group, an equal share each).

``concurrent`` from the engine becomes ``concurrent_flows``: concurrent collectives share
a node's NICs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vcluster.runtime.tracing.kernel import KernelKind

from .attention_kernels import NAMED_KERNELS, attention_prices
from .collective_cost import collective_cost, collective_time_s
from .gemm_formats import check_gemm_format, gemm_format
from .collective_cost import wire_bytes as _wire_bytes
from .hardware import HardwareSpec

__all__ = ["HardwareCostModel", "TRAINING_KERNEL_EFFICIENCY"]

_GATHERING = ("all_gather", "gather")

# Kernels inside a training step run slower than the same kernels in a microbenchmark
# (the device's GEMM and HBM efficiencies): launch gaps between hundreds of small
# kernels, fusion breaks, and work the traced program does not itemise (dropout and
# masking of the attention probabilities, the optimizer's update, framework overhead).
# One constant for every device and workload, calibrated against the Megatron-LM tables
# that `vcluster validate-model` reports (not per row): with it, 0.64 of the A100's bf16
# peak for large GEMMs (0.859 x 0.75), in line with the 52% end-to-end Megatron reports.
TRAINING_KERNEL_EFFICIENCY = 0.75


@dataclass(frozen=True)
class HardwareCostModel:
    hardware: HardwareSpec
    dtype: str = "bf16"          # the compute dtype whose peak applies
    efficiency: float = TRAINING_KERNEL_EFFICIENCY
    # CollectiveCosts by (collective, nbytes, group, concurrent): a step repeats the same
    # calls thousands of times, and the cost is a pure function of these
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # the device's kernel prices by kind (None without measured kernels), fitted once
    kernel_profile: object = field(default=None, init=False, repr=False, compare=False)
    # op -> True for the GEMMs that run in low precision (None: none do), in gemm_format;
    # see the module docstring
    fp8_gemms: object = None
    gemm_format: str = "fp8"
    # price fused attention kernels as FlashAttention-1-class ones (module docstring)
    flash_v1: bool = False
    # the FLOP/s those kernels compute at here (set from flash_v1; None without it)
    _flash_v1_flops_per_s: object = field(default=None, init=False, repr=False, compare=False)
    # the dtype whose peak gemm_format's GEMMs compute at, and their share of its rate
    _gemm_dtype: str = field(default="fp8", init=False, repr=False, compare=False)
    _gemm_rate_share: float = field(default=1.0, init=False, repr=False, compare=False)
    # a fused attention kernel with published curves (attention_kernels.NAMED_KERNELS), or
    # "": the device's default (module docstring)
    attention_kernel: str = ""
    # the curves fused attention is priced by (None: the profile or the analytic model)
    _attention: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "kernel_profile", self.hardware.device.kernel_profile())
        fmt = gemm_format(self.gemm_format)
        if self.fp8_gemms is not None:
            check_gemm_format(fmt, self.hardware)
            self._refuse_measured_kernels(f"{fmt.name} GEMMs are", "BF16 kernels")
        object.__setattr__(self, "_gemm_dtype", fmt.dtype)
        object.__setattr__(self, "_gemm_rate_share", fmt.rate_share)
        object.__setattr__(self, "_attention", self._attention_prices())
        if not isinstance(self.flash_v1, bool):
            raise ValueError(f"flash_v1 must be True or False, got {self.flash_v1!r}")
        if self.flash_v1:
            device = self.hardware.device
            if device.flash_v1_speedup is None:
                raise ValueError(f"attention flash-v1 needs the device's flash_v1_speedup "
                                 f"(how much faster than on an A100 such kernels run): "
                                 f"{self.hardware.name} ({device.name}) has none")
            self._refuse_measured_kernels("attention flash-v1 is", "kernels")
            from .presets import FLASH_V1_REFERENCE_PRESET, preset
            reference = preset(FLASH_V1_REFERENCE_PRESET).device
            object.__setattr__(self, "_flash_v1_flops_per_s",
                               reference.achieved_flops(self.dtype) * device.flash_v1_speedup
                               * device.sustained_compute_ratio)

    def _attention_prices(self):
        """The curves fused attention is priced by (module docstring), or None."""
        device, name = self.hardware.device, self.attention_kernel
        if name:
            if name not in NAMED_KERNELS:
                raise ValueError(f"attention_kernel={name!r}: not a kernel with published "
                                 f"curves; allowed: {', '.join(NAMED_KERNELS)}, or \"\" (the "
                                 f"device's default)")
            if self.flash_v1:
                raise ValueError(f"attention_kernel={name!r} and flash_v1: one attention "
                                 f"kernel at a time")
            if not device.attention_gpu:
                raise ValueError(f"attention {name!r} is priced from published curves: "
                                 f"{self.hardware.name} ({device.name}) has none "
                                 f"(attention_gpu); run attention 'flash' (analytic here)")
            return attention_prices(device.attention_gpu, name,
                                    device.attention_cudnn if name == "cudnn" else "")
        has_profile = self.kernel_profile is not None and \
            "attention" in self.kernel_profile.kinds
        if self.flash_v1 or has_profile or not device.attention_kernel:
            return None
        return attention_prices(device.attention_gpu, device.attention_kernel,
                                device.attention_cudnn if device.attention_kernel == "cudnn"
                                else "")

    def _refuse_measured_kernels(self, what: str, measured: str) -> None:
        """Raise unless this hardware prices kernels analytically (no measured kernels)."""
        if self.kernel_profile is not None:
            raise ValueError(f"{what} priced by the analytic model: {self.hardware.name} "
                             f"prices kernels from measured {measured} "
                             f"({self.kernel_profile.source})")

    @property
    def gemm_profile(self):
        """The GEMM profile that prices traced GEMMs (None: priced analytically)."""
        return None if self.kernel_profile is None else self.kernel_profile.gemm

    def analytic_time_s(self, op) -> float:
        """t_k + max(F / rate, B / bandwidth) over the training-kernel efficiency, at the
        model's dtype's rate."""
        return self.hardware.device.compute_time_s(op.flops, op.bytes,
                                                   self.dtype) / self.efficiency

    def low_precision_time_s(self, op) -> float:
        """A GEMM of ``gemm_format``: the analytic price at its dtype's achieved rate times
        the format's ``rate_share`` (:mod:`.gemm_formats`),
        (t_k + max(F / (rate · share), B / bandwidth)) / efficiency."""
        device, dtype = self.hardware.device, self._gemm_dtype
        return device.compute_time_s(
            op.flops, op.bytes, dtype,
            flops_per_s=device.achieved_flops(dtype) * self._gemm_rate_share) / self.efficiency

    def flash_v1_time_s(self, op) -> float:
        """A FlashAttention-1-class kernel's price: the analytic price with its compute at
        the A100's achieved rate times the device's ``flash_v1_speedup`` (module
        docstring); the launch overhead and the HBM term are the device's own:
        (t_k + max(F / (speedup · A100 peak · A100 e_max), B / achieved HBM)) / efficiency."""
        return self.hardware.device.compute_time_s(
            op.flops, op.bytes, self.dtype, flops_per_s=self._flash_v1_flops_per_s
        ) / self.efficiency

    def compute_time_s(self, op) -> float:
        if getattr(op, "seconds", None) is not None:
            return op.seconds
        if self.fp8_gemms is not None and self.fp8_gemms(op):
            return self.low_precision_time_s(op)
        kernel, profile = getattr(op, "kernel", None), self.kernel_profile
        if kernel is not None and kernel.kind is KernelKind.ATTENTION and kernel.flash:
            if self.flash_v1:
                return self.flash_v1_time_s(op)
            if self._attention is not None:
                device = self.hardware.device
                return self._attention.time_s(kernel, device.kernel_overhead_us * 1e-6,
                                              device.sustained_compute_ratio)
        if kernel is None or profile is None:
            return self.analytic_time_s(op)
        t = profile.stream_time_s(kernel)
        if t is None:
            t = self.analytic_time_s(op)
        return max(t, profile.launch_s) if t > 0 else 0.0

    def _cost(self, op, concurrent: int):
        key = (op.collective, op.nbytes, op.group, concurrent)
        cost = self._memo.get(key)
        if cost is None:
            cost = self._memo[key] = collective_cost(
                op.collective, _nccl_bytes(op), op.group, self.hardware,
                concurrent_flows=max(1, int(concurrent)))
        return cost

    def collective_time_s(self, op, concurrent: int) -> float:
        return 0.0 if len(op.group) <= 1 else self._cost(op, concurrent).time_s

    def collective_algorithm(self, op) -> str:
        """The algorithm this model prices ``op`` with alone (NCCL's choice, "local" for a
        group of one or no bytes)."""
        return self._cost(op, 1).algorithm.value

    def wire_bytes(self, op) -> float:
        """One member's share of the bytes ``op`` puts on the links (sent, and as many
        received): the call's total over its group divided by the group size."""
        n = len(op.group)
        return _wire_bytes(op.collective, _nccl_bytes(op), n) / n

    def p2p_ports(self, src: int, dst: int) -> tuple:
        """The NICs a transfer between scale-up domains occupies (the sender's, the
        receiver's: each GPU drives one NIC rail): concurrent transfers through one of them
        queue. Within a domain, none (the switch's GPU links are per pair)."""
        hw = self.hardware
        if hw.domain_of(src) == hw.domain_of(dst):
            return ()
        return (("nic_out", src), ("nic_in", dst))

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        if src == dst:
            return 0.0
        return collective_time_s("send", nbytes, (src, dst), self.hardware)


def _nccl_bytes(op) -> int:
    """The nccl-tests size of a traced collective (a member's input; gathered output for
    all_gather and gather)."""
    return op.nbytes * len(op.group) if op.collective in _GATHERING else op.nbytes
