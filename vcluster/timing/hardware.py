"""Hardware model of a GPU cluster: device, links, node, network — frozen values with units.

Units are in the names: ``*_gbps`` is GB/s = 1e9 bytes/s (nccl-tests' convention, not
gigabits), ``*_us`` microseconds, ``*_s`` seconds, ``*_bytes`` bytes, ``peak_tflops``
1e12 FLOP/s. Every preset number and its source live in :mod:`vcluster.timing.presets`.

Compute model of one device (``DeviceSpec``), for a kernel of F FLOPs touching B bytes
of HBM in dtype d::

    t_compute = F / (peak(d) * e_max(d) * c(d))    e_max(d) = gemm_max_efficiency, or
                                                   gemm_max_efficiency_by_dtype[d];
                                                   c(d) = sustained_compute_ratio, or
                                                   sustained_compute_ratio_by_dtype[d]
    t_memory  = B / (hbm_bandwidth * hbm_efficiency)
    t         = t_k + max(t_compute, t_memory)     t_k = kernel_overhead_us

so the achieved GEMM efficiency, F / (peak * t) when compute-bound, is the saturating
curve ``e(F) = e_max * F / (F + F_half)`` with ``F_half = peak * e_max * t_k``: it tends
to e_max for large GEMMs and is half of it when the ideal time equals the per-kernel
overhead. A GEMM (m, k) x (k, n) has F = 2mkn and B = (mk + kn + mn) * bytes(d).

c(d) is 1 on a datasheet part. A part of the same die held to a lower power limit (Meta's
500 W H100s) sustains lower clocks: c(d) < 1 scales its achieved GEMM rate and the fused
attention curves borrowed from the datasheet part (their BF16 kernels at
``sustained_compute_ratio``), while ``peak_tflops`` stays the datasheet's, the figure MFU
is reported against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType

from .kernel_profile import TABLE_PRESETS, GemmProfile, KernelTiming
from .kernel_profiles import LAUNCH_INTERVAL_S, KernelProfile

__all__ = ["DeviceSpec", "LinkSpec", "NodeSpec", "NetworkSpec", "HardwareSpec",
           "IntraNodeFabric", "NetworkTopology", "DTYPE_BYTES", "canonical_dtype"]

_S_PER_US = 1e-6          # seconds per microsecond
_BYTES_PER_GB = 1e9       # GB/s is 1e9 bytes/s
_FLOPS_PER_TFLOPS = 1e12  # TFLOP/s is 1e12 FLOP/s

# Bytes per element of each compute dtype (tf32 is stored as fp32).
DTYPE_BYTES: Mapping[str, float] = MappingProxyType(
    {"fp4": 0.5, "fp8": 1, "bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4})
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
     "float": "fp32", "float8": "fp8"})


def canonical_dtype(dtype) -> str:
    """``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``, ``"fp8"``, ``"fp4"`` from a name or
    numpy dtype."""
    name = str(getattr(dtype, "name", dtype)).lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not known; use one of {', '.join(DTYPE_BYTES)} "
                         f"(or {', '.join(_DTYPE_ALIASES)})")
    return name


class IntraNodeFabric(str, Enum):
    """How the GPUs of a scale-up domain reach each other.

    ``nvswitch``, ``pcie``: a non-blocking switch with one port of ``NodeSpec.gpu_link``
    bandwidth per GPU: any pair, or a GPU talking to all the others, gets the whole port.
    ``full_mesh``: no switch; each GPU has one direct link to every other GPU of its
    domain (AMD Infinity Fabric, xGMI), ``gpu_link`` the sum of its D - 1 links
    (D = ``domain_gpus``). A GPU talking to ``k`` peers of its domain at once drives
    ``k`` links: ``gpu_link * k / (D - 1)`` (``NodeSpec.fabric_gbps``); a pair gets one
    link's bandwidth, not the port's."""

    NVSWITCH = "nvswitch"
    PCIE = "pcie"
    FULL_MESH = "full_mesh"


class NetworkTopology(str, Enum):
    """Inter-node topology. ``fat_tree``: two levels (leaf, spine); nodes under one leaf
    switch are 1 switch hop apart, others 3; bandwidth is NIC-limited unless the tree is
    oversubscribed."""

    FAT_TREE = "fat_tree"


def _number(owner, name, *, positive=True, at_most=None, integer=False):
    value = getattr(owner, name)
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)  # 8.0e10 from YAML is a whole number of bytes
        object.__setattr__(owner, name, value)
        ok_type = True
    if isinstance(value, bool) or not ok_type:
        raise TypeError(f"{name}: expected {kind}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0) or (
            at_most is not None and value > at_most):
        bound = f"in (0, {at_most}]" if at_most is not None else (
            "> 0" if positive else ">= 0")
        raise ValueError(f"{name}: must be {bound}, got {value!r}")


def _text(owner, name, *, empty_ok=True):
    value = getattr(owner, name)
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        raise TypeError(f"{name}: expected a non-empty string, got {value!r}")


def _enum(owner, name, enum):
    value = getattr(owner, name)
    try:
        object.__setattr__(owner, name, enum(value))
    except ValueError:
        raise ValueError(f"{name}: must be one of {', '.join(e.value for e in enum)}, "
                         f"got {value!r}") from None


def _nested(owner, name, cls):
    if not isinstance(getattr(owner, name), cls):
        raise TypeError(f"{name}: expected a {cls.__name__}, got {getattr(owner, name)!r}")


class _FrozenMap(Mapping):
    """A read-only, hashable dict with a dict's repr (for ``peak_tflops``)."""

    def __init__(self, items):
        self._d = dict(items)

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)

    def __hash__(self):
        return hash(tuple(sorted(self._d.items())))

    def __repr__(self):
        return repr(self._d)


def _fractions_by_dtype(by_dtype, name: str, of_what: str, peaks) -> "_FrozenMap":
    """``by_dtype`` (dtype -> a fraction in (0, 1] of ``of_what``) checked and keyed by
    canonical dtype; each dtype must have a peak (``peaks``)."""
    if not isinstance(by_dtype, Mapping):
        raise ValueError(f"{name}: expected a mapping dtype -> fraction of {of_what}, "
                         f"got {by_dtype!r}")
    out = {}
    for dtype, e in by_dtype.items():
        try:
            key = canonical_dtype(dtype)
        except ValueError as exc:
            raise ValueError(f"{name}.{dtype}: {exc}") from None
        if key not in peaks:
            raise ValueError(f"{name}.{dtype}: no peak_tflops for {key!r} (peaks: "
                             f"{', '.join(peaks)})")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"{name}.{dtype}: must be a number in (0, 1], got {e!r}")
        out[key] = float(e)
    return _FrozenMap(out)


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU: peak FLOP/s per dtype, HBM, and the achieved-efficiency constants."""

    name: str
    peak_tflops: Mapping[str, float]  # dense (no sparsity) tensor-core peak per dtype
    hbm_bytes: int                    # HBM capacity, decimal bytes as on the datasheet
    hbm_bandwidth_gbps: float         # datasheet HBM bandwidth
    gemm_max_efficiency: float        # e_max: best achieved GEMM FLOP/s / peak
    kernel_overhead_us: float         # t_k: fixed cost of one kernel (launch, ramp, tail)
    hbm_efficiency: float             # achieved / datasheet HBM bandwidth
    source: str = ""
    # measured kernels this device's constants were fitted to (``vcluster hardware
    # calibrate --gpu``; kernel_profile.KernelTiming rows); empty for datasheet presets
    kernels: tuple = ()
    # a shipped table of measured kernels timed alone (vcluster/timing/data, e.g.
    # "h100_kernels.csv"): traced kernels are priced by the profiles fitted to it
    # (kernel_profiles.KernelProfile.from_table); empty: none
    kernel_table: str = ""
    # e_max of the dtypes measured apart from gemm_max_efficiency's (e.g. {"fp8": 0.709}:
    # the best achieved FP8 GEMM over the FP8 peak); a dtype not here takes
    # gemm_max_efficiency
    gemm_max_efficiency_by_dtype: Mapping[str, float] = _FrozenMap({})
    # how much faster than on the A100 (the ``a100-80gb-dgx`` preset's device) attention
    # kernels built for Ampere run here: FlashAttention 1, the Triton and xformers kernels
    # of 2022-23 (``ParallelConfig.attention="flash-v1"``; HardwareCostModel.flash_v1).
    # None: not known, and such runs are refused on this device
    flash_v1_speedup: float | None = None
    # block-scaled GEMM formats the tensor cores read natively (gemm_formats.
    # BLOCK_SCALED_FORMATS: "mxfp8", "mxfp6", "mxfp4", "nvfp4"); () : none
    block_scaled_formats: tuple = ()
    # the GPU whose published fused-attention curves price this device's attention kernels
    # (a ``gpu`` of attention_kernels.ATTENTION_TABLE, e.g. "h100-sxm"); "": none (analytic)
    attention_gpu: str = ""
    # the kernel of those curves that ``ParallelConfig.attention="flash"`` runs here (one
    # of attention_kernels.NAMED_KERNELS: "flash2", "flash3", "cudnn"); "" without curves
    attention_kernel: str = ""
    # the cuDNN release whose published rows price cuDNN attention here (one of
    # attention_kernels.cudnn_releases(attention_gpu), e.g. "9.13.1": the release a run's
    # container ships); "": every published release's, their median
    attention_cudnn: str = ""
    # the share of the datasheet part's compute speed this part sustains: a part of the
    # same die held to a lower power limit runs its SMs at lower clocks, so every
    # compute-bound rate — the GEMMs' achieved FLOP/s and the attention curves measured on
    # the datasheet part — is this times the datasheet part's. 1: the datasheet part.
    # ``peak_tflops`` stays the datasheet's (MFU is reported against it, as the sources do)
    sustained_compute_ratio: float = 1.0
    # the ratio of the GEMM dtypes measured apart (e.g. {"fp8": 0.80}: an FP8 GEMM draws
    # less power per FLOP, so a power limit slows it less); a dtype not here takes
    # sustained_compute_ratio
    sustained_compute_ratio_by_dtype: Mapping[str, float] = _FrozenMap({})

    def __post_init__(self):
        _text(self, "name", empty_ok=False)
        if not isinstance(self.peak_tflops, Mapping) or not self.peak_tflops:
            raise TypeError(f"peak_tflops: expected a mapping dtype -> TFLOP/s, "
                            f"got {self.peak_tflops!r}")
        peaks = {}
        for dtype, tflops in self.peak_tflops.items():
            try:
                key = canonical_dtype(dtype)
            except ValueError as exc:
                raise ValueError(f"peak_tflops.{dtype}: {exc}") from None
            if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or not (
                    math.isfinite(tflops) and tflops > 0):
                raise ValueError(f"peak_tflops.{dtype}: must be a number > 0, got {tflops!r}")
            peaks[key] = float(tflops)
        object.__setattr__(self, "peak_tflops", _FrozenMap(peaks))
        _number(self, "hbm_bytes", integer=True)
        _number(self, "hbm_bandwidth_gbps")
        _number(self, "gemm_max_efficiency", at_most=1)
        object.__setattr__(self, "gemm_max_efficiency_by_dtype", _fractions_by_dtype(
            self.gemm_max_efficiency_by_dtype, "gemm_max_efficiency_by_dtype",
            "that dtype's peak", peaks))
        _number(self, "kernel_overhead_us", positive=False)
        _number(self, "hbm_efficiency", at_most=1)
        _number(self, "sustained_compute_ratio", at_most=1)
        object.__setattr__(self, "sustained_compute_ratio_by_dtype", _fractions_by_dtype(
            self.sustained_compute_ratio_by_dtype, "sustained_compute_ratio_by_dtype",
            "the datasheet part's speed", peaks))
        if self.flash_v1_speedup is not None:
            _number(self, "flash_v1_speedup")
        from .gemm_formats import BLOCK_SCALED_FORMATS   # why: a table of names, no cycle
        formats = self.block_scaled_formats
        if isinstance(formats, str) or not hasattr(formats, "__iter__") or any(
                f not in BLOCK_SCALED_FORMATS for f in formats):
            raise ValueError(f"block_scaled_formats: expected a list of "
                             f"{', '.join(BLOCK_SCALED_FORMATS)}, got {formats!r}")
        object.__setattr__(self, "block_scaled_formats", tuple(formats))
        self._check_attention()
        _text(self, "source")
        _text(self, "kernel_table")
        if self.kernel_table and self.kernel_table not in kernel_tables():
            raise ValueError(f"kernel_table: {self.kernel_table!r} is not a shipped table of "
                             f"measured kernels; known: {', '.join(kernel_tables())}")
        if isinstance(self.kernels, (str, bytes)) or not hasattr(self.kernels, "__iter__"):
            raise ValueError(f"kernels: expected a list of measured kernels, got {self.kernels!r}")
        object.__setattr__(self, "kernels", tuple(
            KernelTiming.coerce(row, f"kernels[{i}]") for i, row in enumerate(self.kernels)))

    def _check_attention(self) -> None:
        """``attention_gpu`` names published curves and ``attention_kernel`` one of its
        kernels (both or neither); ``attention_cudnn`` a cuDNN release published there."""
        _text(self, "attention_gpu")
        _text(self, "attention_kernel")
        if not self.attention_gpu and not self.attention_kernel:
            if self.attention_cudnn:
                raise ValueError(f"attention_cudnn: {self.attention_cudnn!r} needs "
                                 f"attention_gpu (the curves it selects among)")
            return
        from .attention_kernels import attention_gpus, kernels_of   # why: reads the table
        if self.attention_gpu not in attention_gpus():
            raise ValueError(f"attention_gpu: {self.attention_gpu!r} has no published "
                             f"attention curves; allowed: {', '.join(attention_gpus())}, or "
                             f"\"\" (attention priced analytically)")
        if self.attention_kernel not in kernels_of(self.attention_gpu):
            raise ValueError(f"attention_kernel: {self.attention_kernel!r} has no curves on "
                             f"{self.attention_gpu}; allowed: "
                             f"{', '.join(kernels_of(self.attention_gpu))}")
        _text(self, "attention_cudnn")
        if self.attention_cudnn:
            from .attention_kernels import cudnn_releases   # why: reads the table
            releases = cudnn_releases(self.attention_gpu)
            if self.attention_cudnn not in releases:
                raise ValueError(f"attention_cudnn: {self.attention_cudnn!r} has no published "
                                 f"cudnn rows on {self.attention_gpu}; allowed: "
                                 f"{', '.join(releases) or 'none'}, or \"\" (every release)")

    def gemm_profile(self) -> GemmProfile | None:
        """The GEMM profile of this device's measured ``gemm`` kernels (None without
        at least two; in-stream rows, so a negative fitted fixed cost becomes 0)."""
        rows = [(r.m, r.k, r.n, r.seconds) for r in self.kernels if r.kind == "gemm"]
        return GemmProfile.fit(rows, f"{self.name}: measured kernels", zero_call=True) \
            if len(rows) >= 2 else None

    def kernel_profile(self) -> KernelProfile | None:
        """The prices of traced kernels by kind (None: price them analytically):
        ``kernel_table``'s profiles when it names one, moved from the GPU that measured
        the table (:data:`~.kernel_profile.TABLE_PRESETS`) to this one by the ratios of
        their achieved FLOP/s and HBM bandwidth (:meth:`KernelProfile.moved
        <.kernel_profiles.KernelProfile.moved>`; unchanged on the measuring GPU's own
        constants) and floored at the measured ``launch`` interval when ``kernels`` holds
        one, else at :data:`~.kernel_profiles.LAUNCH_INTERVAL_S`; else the profiles of the
        measured ``kernels`` (:meth:`KernelProfile.from_timings <.kernel_profiles.KernelProfile.
        from_timings>`: GEMMs and every table kind measured, in-stream already, floored at
        their ``launch`` row's interval)."""
        launch = [r.seconds for r in self.kernels if r.kind == "launch"]
        if self.kernel_table:
            return KernelProfile.from_table(
                self.kernel_table, launch[0] if launch else LAUNCH_INTERVAL_S).moved(
                    *self.kernel_table_ratios(), self.name)
        return KernelProfile.from_timings(self.kernels, f"{self.name}: measured kernels")

    def peak_flops(self, dtype) -> float:
        """Datasheet peak FLOP/s of ``dtype``."""
        key = canonical_dtype(dtype)
        if key not in self.peak_tflops:
            raise ValueError(f"{self.name} has no peak for dtype {key!r}; "
                             f"known: {', '.join(self.peak_tflops)}")
        return self.peak_tflops[key] * _FLOPS_PER_TFLOPS

    def kernel_table_ratios(self) -> tuple[float, float]:
        """(compute, memory): this device's achieved bf16 FLOP/s and HBM bandwidth over
        those of the GPU that measured ``kernel_table`` (its preset's,
        :data:`~.kernel_profile.TABLE_PRESETS`); (1, 1) without a table."""
        if not self.kernel_table:
            return 1.0, 1.0
        from .presets import preset          # presets builds DeviceSpecs: no cycle at import
        measured_on = preset(TABLE_PRESETS[self.kernel_table]).device
        return (self.achieved_flops("bf16") / measured_on.achieved_flops("bf16"),
                self.achieved_hbm_bytes_per_s() / measured_on.achieved_hbm_bytes_per_s())

    def e_max(self, dtype) -> float:
        """The best achieved share of ``dtype``'s peak by a GEMM:
        ``gemm_max_efficiency_by_dtype[dtype]`` where measured, else
        ``gemm_max_efficiency``."""
        return self.gemm_max_efficiency_by_dtype.get(canonical_dtype(dtype),
                                                     self.gemm_max_efficiency)

    def sustained_ratio(self, dtype) -> float:
        """The share of the datasheet part's ``dtype`` speed this part sustains:
        ``sustained_compute_ratio_by_dtype[dtype]`` where measured, else
        ``sustained_compute_ratio`` (1 on a datasheet part)."""
        return self.sustained_compute_ratio_by_dtype.get(canonical_dtype(dtype),
                                                         self.sustained_compute_ratio)

    def achieved_flops(self, dtype) -> float:
        """The best achieved GEMM FLOP/s of ``dtype``: peak × e_max(dtype) ×
        sustained_ratio(dtype)."""
        return self.peak_flops(dtype) * self.e_max(dtype) * self.sustained_ratio(dtype)

    def achieved_hbm_bytes_per_s(self) -> float:
        """The achieved HBM bandwidth of streaming kernels: datasheet × e_hbm, bytes/s."""
        return self.hbm_bandwidth_gbps * _BYTES_PER_GB * self.hbm_efficiency

    def gemm_half_efficiency_flops(self, dtype) -> float:
        """F_half = peak * e_max * t_k: the GEMM size (FLOPs) that reaches e_max / 2."""
        return self.achieved_flops(dtype) * self.kernel_overhead_us * _S_PER_US

    def gemm_efficiency(self, m: int, k: int, n: int, dtype) -> float:
        """Achieved / peak FLOP/s of a compute-bound GEMM: e_max * F / (F + F_half)."""
        flops = 2.0 * _dims(m, k, n)
        if flops == 0:
            return 0.0
        return self.e_max(dtype) * flops / (flops + self.gemm_half_efficiency_flops(dtype))

    def compute_time_s(self, flops: float, nbytes: float, dtype,
                       flops_per_s: float | None = None) -> float:
        """One kernel: t_k + max(F / (peak * e_max), B / (hbm_bandwidth * hbm_efficiency));
        ``flops_per_s``, when given, in place of peak * e_max (a kernel that computes at a
        rate of its own, e.g. HardwareCostModel's flash-v1 attention)."""
        if flops < 0 or nbytes < 0:
            raise ValueError(f"flops and nbytes must be >= 0, got {flops!r} and {nbytes!r}")
        if flops == 0 and nbytes == 0:
            return 0.0
        compute_s = flops / (self.achieved_flops(dtype) if flops_per_s is None else flops_per_s)
        return self.kernel_overhead_us * _S_PER_US + max(compute_s, self._memory_s(nbytes))

    def matmul_time_s(self, m: int, k: int, n: int, dtype) -> float:
        """(m, k) x (k, n): 2mkn / (peak * gemm_efficiency), floored by the memory-bound
        time t_k + (mk + kn + mn) * bytes(dtype) / achieved HBM bandwidth."""
        if _dims(m, k, n) == 0:
            return 0.0  # an empty GEMM launches nothing
        nbytes = (m * k + k * n + m * n) * DTYPE_BYTES[canonical_dtype(dtype)]
        return self.compute_time_s(2.0 * m * k * n, nbytes, dtype)

    def elementwise_time_s(self, nbytes: float) -> float:
        """A memory-bound kernel reading and writing ``nbytes`` in total: t_k + B / bw."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        return 0.0 if nbytes == 0 else self.kernel_overhead_us * _S_PER_US + self._memory_s(nbytes)

    def _memory_s(self, nbytes: float) -> float:
        return nbytes / self.achieved_hbm_bytes_per_s()


def kernel_tables() -> tuple[str, ...]:
    """The shipped tables of measured kernels (``vcluster/timing/data/*_kernels.csv``)."""
    from importlib import resources
    data = resources.files("vcluster.timing").joinpath("data")
    return tuple(sorted(f.name for f in data.iterdir() if f.name.endswith("_kernels.csv")))


def _dims(m, k, n) -> int:
    for name, v in (("m", m), ("k", k), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"GEMM dimension {name} must be an integer >= 0, got {v!r}")
    return m * k * n


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: line rate, NCCL's per-step latency over it, and the
    fraction of the line rate that NCCL achieves (``effective_gbps``)."""

    bandwidth_gbps: float  # line rate per direction
    latency_us: float      # alpha: latency of one NCCL step (Simple protocol) over it
    efficiency: float = 1.0  # achieved / line rate
    source: str = ""

    def __post_init__(self):
        _number(self, "bandwidth_gbps")
        _number(self, "latency_us", positive=False)
        _number(self, "efficiency", at_most=1)
        _text(self, "source")

    @property
    def effective_gbps(self) -> float:
        """Achieved bandwidth per direction: bandwidth_gbps * efficiency."""
        return self.bandwidth_gbps * self.efficiency


@dataclass(frozen=True)
class NodeSpec:
    """A node (host) of ``gpus_per_node`` GPUs in a scale-up domain of ``domain_gpus``.

    ``gpu_link`` is one GPU's port on the scale-up fabric (all its NVLinks or Infinity
    Fabric links together, per direction). The scale-up domain — the GPUs one NVLink or
    Infinity Fabric reaches — is independent of the host: 8 GPUs in a DGX node, 72 in a
    GB200 NVL72 rack of 18 four-GPU trays (``gpus_per_node`` 4, ``domain_gpus`` 72).
    ``domain_gpus`` (default: ``gpus_per_node``) is a whole number of nodes; traffic
    between domains goes through the nodes' NICs (:class:`NetworkSpec`).
    """

    gpus_per_node: int
    gpu_link: LinkSpec
    fabric: IntraNodeFabric = IntraNodeFabric.NVSWITCH
    source: str = ""
    domain_gpus: int | None = None   # scale-up domain size (None: one node)
    # NVLink SHARP (NVLS): the switch reduces, so an all_reduce of n bytes moves n each way
    # per GPU; its achieved rate (nccl-tests algbw at large sizes) over gpu_link's
    # bandwidth_gbps. None: the fabric has no in-switch reduction (or it is not modelled)
    nvls_efficiency: float | None = None
    # the GPU's link to its host CPU's memory (NVLink-C2C on Grace, PCIe elsewhere), per
    # direction, and the host memory each GPU may use there; None: not modelled
    host_link: LinkSpec | None = None
    host_memory_bytes: int | None = None

    def __post_init__(self):
        _number(self, "gpus_per_node", integer=True)
        _nested(self, "gpu_link", LinkSpec)
        _enum(self, "fabric", IntraNodeFabric)
        _text(self, "source")
        if self.nvls_efficiency is not None:
            _number(self, "nvls_efficiency", at_most=1)
            if self.fabric is not IntraNodeFabric.NVSWITCH:
                raise ValueError(f"nvls_efficiency: NVLink SHARP needs an NVSwitch fabric, "
                                 f"got fabric {self.fabric.value!r}")
        if self.host_link is not None:
            _nested(self, "host_link", LinkSpec)
        if self.host_memory_bytes is not None:
            _number(self, "host_memory_bytes", integer=True)
        if self.domain_gpus is None:
            object.__setattr__(self, "domain_gpus", self.gpus_per_node)
        _number(self, "domain_gpus", integer=True)
        if self.domain_gpus % self.gpus_per_node:
            raise ValueError(f"domain_gpus: must be a whole number of nodes of "
                             f"{self.gpus_per_node} GPUs (gpus_per_node), got "
                             f"{self.domain_gpus!r}")
        if self.fabric is IntraNodeFabric.FULL_MESH and self.domain_gpus < 2:
            raise ValueError(f"fabric: full_mesh needs a domain of 2 or more GPUs, got "
                             f"domain_gpus {self.domain_gpus}")

    @property
    def nodes_per_domain(self) -> int:
        return self.domain_gpus // self.gpus_per_node

    def fabric_gbps(self, peers: int) -> float:
        """Achieved scale-up bandwidth per direction of one GPU sending to ``peers`` other
        GPUs of its domain at once: the whole port through a switch; ``peers`` of its
        ``domain_gpus - 1`` links on a full mesh."""
        port = self.gpu_link.effective_gbps
        if self.fabric is not IntraNodeFabric.FULL_MESH:
            return port
        if isinstance(peers, bool) or not isinstance(peers, int) or not (
                1 <= peers < self.domain_gpus):
            raise ValueError(f"peers must be an integer in 1..{self.domain_gpus - 1}, "
                             f"got {peers!r}")
        return port * peers / (self.domain_gpus - 1)


@dataclass(frozen=True)
class NetworkSpec:
    """Inter-node network: ``nics_per_node`` NICs of ``nic`` each, on a fat tree.

    GPU i of a node is nearest to NIC ``i * nics_per_node // gpus_per_node`` (rails).
    An inter-node step's latency is ``nic.latency_us + (hops - 1) * switch_latency_us``
    with 1 hop under one leaf switch and 3 across the spine; traffic that crosses the
    spine gets ``1 / oversubscription`` of the NIC bandwidth.
    """

    nics_per_node: int
    nic: LinkSpec
    topology: NetworkTopology = NetworkTopology.FAT_TREE
    nodes_per_leaf_switch: int = 1
    switch_latency_us: float = 0.0
    oversubscription: float = 1.0
    source: str = ""

    def __post_init__(self):
        _number(self, "nics_per_node", integer=True)
        _nested(self, "nic", LinkSpec)
        _enum(self, "topology", NetworkTopology)
        _number(self, "nodes_per_leaf_switch", integer=True)
        _number(self, "switch_latency_us", positive=False)
        _number(self, "oversubscription")
        if self.oversubscription < 1:
            raise ValueError(f"oversubscription: must be >= 1 (1 = non-blocking), "
                             f"got {self.oversubscription!r}")
        _text(self, "source")

    @property
    def node_bandwidth_gbps(self) -> float:
        """Achieved inter-node bandwidth of one node, per direction: NICs x effective."""
        return self.nics_per_node * self.nic.effective_gbps


@dataclass(frozen=True)
class HardwareSpec:
    """A cluster of identical nodes: rank r lives on node ``r // gpus_per_node`` and in
    scale-up domain ``r // domain_gpus``.

    ``sources`` maps a field's dotted path (``device.peak_tflops.bf16``,
    ``node.gpu_link.bandwidth_gbps``) to where its value comes from — a datasheet, a
    measurement, a paper; presets have one for every field (``vcluster hardware show``).
    It is documentation: not compared, not hashed, not part of :func:`hardware_to_dict
    <.presets.hardware_to_dict>`'s values.
    """

    name: str
    device: DeviceSpec
    node: NodeSpec
    network: NetworkSpec
    source: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        _text(self, "name", empty_ok=False)
        _nested(self, "device", DeviceSpec)
        _nested(self, "node", NodeSpec)
        _nested(self, "network", NetworkSpec)
        _text(self, "source")
        if not isinstance(self.sources, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()):
            raise TypeError(f"sources: expected a mapping field path -> source text, got "
                            f"{self.sources!r}")
        object.__setattr__(self, "sources", _FrozenMap(self.sources))   # picklable

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus_per_node

    @property
    def domain_gpus(self) -> int:
        """GPUs of one scale-up domain (one NVLink / Infinity Fabric)."""
        return self.node.domain_gpus

    def domain_of(self, rank: int) -> int:
        """The scale-up domain that holds global rank ``rank``."""
        return self.node_of(rank) // self.node.nodes_per_domain

    def node_of(self, rank: int) -> int:
        """The node that holds global rank ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        return rank // self.node.gpus_per_node

    def for_job(self, gpus: int) -> "HardwareSpec":
        """The hardware as a job of ``gpus`` GPUs sees it. A job that does not fill its
        scale-up domains whole is placed on the fewest domains, an equal segment in each
        (a scheduler's job segments, Slurm's ``--segment``): 256 GPUs on 72-GPU NVL72
        racks are 4 racks of 64, so its groups of 64 stay on NVLink. The segment must be a
        whole number of nodes; otherwise, and for a job of one domain or whole domains,
        the hardware is unchanged. The segment becomes ``domain_gpus`` (named
        ``<name>-<segment>per-domain``)."""
        domain = self.domain_gpus
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
        if gpus <= domain or gpus % domain == 0:
            return self
        used = -(-gpus // domain)
        segment, rest = divmod(gpus, used)
        if rest or segment % self.node.gpus_per_node:
            return self
        sources = dict(self.sources)
        sources["node.domain_gpus"] = (f"a job of {gpus} GPUs in {used} equal segments of "
                                       f"{segment} (HardwareSpec.for_job), of "
                                       f"{domain}-GPU domains")
        return replace(self, name=f"{self.name}-{segment}per-domain",
                       node=replace(self.node, domain_gpus=segment), sources=sources)

    def with_nics_per_node(self, nics: int) -> "HardwareSpec":
        """The same cluster with ``nics`` NICs per node (named ``<name>-<nics>nic``)."""
        if nics == self.network.nics_per_node:
            return self
        return replace(self, name=f"{self.name}-{nics}nic",
                       network=replace(self.network, nics_per_node=nics))

