"""Low-precision GEMM formats a training run's linear layers may use, and what each needs.

A format is priced by the analytic GEMM model (:meth:`~.hardware.DeviceSpec.compute_time_s`)
at the peak of the dtype its tensor cores compute in and that dtype's best achieved share
(``e_max``: ``gemm_max_efficiency_by_dtype``, a measured MAMF figure where the preset has
one — every preset field names its source). The formats:

===============  =====  ==================================================================
format           peak   needs
===============  =====  ==================================================================
``fp8``          fp8    FP8 tensor cores; one scale per tensor (Transformer Engine's
                        delayed or current scaling, ``FP8-DS`` / ``FP8-CS``)
``fp8-row``      fp8    FP8 tensor cores; a scale per row of A and per column of B
                        (torchao's ``rowwise`` recipe, PyTorch's ``_scaled_mm`` with row
                        scales: a CUTLASS kernel of PyTorch's own, not cuBLAS's), at
                        :data:`FP8_ROW_RATE_SHARE` of ``fp8``'s rate (below)
``fp8-block``    fp8    FP8 tensor cores; a scale per 1x128 / 128x128 block (DeepSeek-V3's
                        recipe; Transformer Engine's ``Float8BlockScaling``): on Hopper the
                        scales are applied outside the tensor cores, priced as ``fp8``
``mxfp8``        fp8    tensor cores that read OCP microscaling scales (one E8M0 scale per
                        32 elements): ``block_scaled_formats`` has ``mxfp8`` (Blackwell)
``mxfp4``        fp4    ``block_scaled_formats`` has ``mxfp4`` (Blackwell, CDNA 4)
``nvfp4``        fp4    ``block_scaled_formats`` has ``nvfp4`` (NVIDIA's E4M3 scale per 16
                        elements plus a tensor scale: Blackwell)
===============  =====  ==================================================================

Every format computes at its dtype's achieved rate times its ``rate_share`` (1 but for
``fp8-row``). PyTorch's row-scaled FP8 GEMM is "substantially slower" than its per-tensor
one, which calls cuBLAS (github.com/pytorch/pytorch issue 147971: with fast accumulation,
the forward's, most shapes at 90-100% of the per-tensor speed and a tail down to 50%;
without it, the backward's, so slow that torchao runs those GEMMs through cuBLAS with the
scales applied after: pytorch/ao pull 1325). No kernel-level figure is published as
numbers, so the share is an end-to-end one: :data:`FP8_ROW_RATE_SHARE` is the share at
which ``simulate_gpt`` reproduces torchao's own measurement of the two recipes in one
torchtitan run (torchao/float8/README.md at pytorch/ao 9519bebb, "Training benchmarks",
NVIDIA H100: Llama 3 8B on 8 H100s, FSDP2, batch 1, sequence 8192, ``torch.compile``,
per-op SAC — tensorwise 7,689.5 tokens/s, rowwise 6,768: 0.880), chosen on a grid of 0.01
(0.75: 0.873, **0.76: 0.878**, 0.77: 0.883). Chosen on those two rows alone, which no
validation table holds; the torchtitan table's row-wise rows are held out from it
(``vcluster.planner.validation_long_context``). Measured on H100s; the same share is
assumed elsewhere (on Blackwell PyTorch's row-wise kernel is a CUTLASS template too:
pytorch issue 153555).

An MX or NV format on hardware without it is refused by name (:func:`check_gemm_format`),
as is FP8 on a GPU without FP8 tensor cores (the A100). The master weights, gradients and
optimizer state keep their precision policy; what a format changes is the size of a
quantised tensor, ``stored_bytes`` per element with its scales (fp8 1; fp8-block 1 +
4/128, an fp32 scale per 128; mxfp8 1 + 1/32 and mxfp4 0.5 + 1/32, an E8M0 byte per 32
(the OCP Microscaling Formats v1.0 specification); nvfp4 0.5 + 1/16, an E4M3 byte per 16),
which is what Transformer Engine keeps of a GEMM's input for its weight gradient
(:attr:`vcluster.planner.precision.PrecisionPolicy.gemm_input_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["GemmFormat", "GEMM_FORMATS", "BLOCK_SCALED_FORMATS", "gemm_format",
           "check_gemm_format", "FP8_ROW_RATE_SHARE"]

# the block-scaled formats a device's tensor cores may read natively
BLOCK_SCALED_FORMATS = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class GemmFormat:
    """A GEMM format: its name, the dtype whose peak it computes at, and the native
    block-scaling support it needs (None: plain tensor cores of that dtype)."""

    name: str
    dtype: str
    needs: str | None = None
    stored_bytes: float = 1.0     # per element of a quantised tensor, scales included
    rate_share: float = 1.0       # its kernels' share of the dtype's achieved GEMM rate

    def __post_init__(self):
        if isinstance(self.rate_share, bool) or not isinstance(self.rate_share, (int, float)) \
                or not 0 < self.rate_share <= 1:
            raise ValueError(f"GemmFormat {self.name!r}: rate_share must be in (0, 1], got "
                             f"{self.rate_share!r}")


#: PyTorch's row-scaled FP8 GEMM's share of the per-tensor one's rate: torchao's measured
#: rowwise / tensorwise throughput (0.880, one torchtitan run on 8 H100s) reproduced by
#: ``simulate_gpt`` (module docstring: source, grid, and what it was not chosen on)
FP8_ROW_RATE_SHARE = 0.76


GEMM_FORMATS: Mapping[str, GemmFormat] = MappingProxyType({
    "fp8": GemmFormat("fp8", "fp8"),
    # one fp32 scale per row of K elements: ~1 byte an element at training's K
    "fp8-row": GemmFormat("fp8-row", "fp8", rate_share=FP8_ROW_RATE_SHARE),
    "fp8-block": GemmFormat("fp8-block", "fp8", stored_bytes=1 + 4 / 128),
    "mxfp8": GemmFormat("mxfp8", "fp8", "mxfp8", 1 + 1 / 32),
    "mxfp4": GemmFormat("mxfp4", "fp4", "mxfp4", 0.5 + 1 / 32),
    "nvfp4": GemmFormat("nvfp4", "fp4", "nvfp4", 0.5 + 1 / 16),
})


def gemm_format(name) -> GemmFormat:
    """The format ``name`` (a :data:`GEMM_FORMATS` key or a GemmFormat); ValueError
    naming the allowed ones otherwise."""
    if isinstance(name, GemmFormat):
        return name
    if name not in GEMM_FORMATS:
        raise ValueError(f"GEMM format {name!r} is not known; use one of "
                         f"{', '.join(GEMM_FORMATS)}")
    return GEMM_FORMATS[name]


def check_gemm_format(fmt, hardware) -> GemmFormat:
    """``fmt`` if ``hardware``'s device can run it, else ValueError naming the hardware,
    its device and what it has."""
    fmt = gemm_format(fmt)
    device = hardware.device
    if fmt.dtype not in device.peak_tflops:
        raise ValueError(f"{fmt.name} GEMMs need {fmt.dtype.upper()} tensor cores: "
                         f"{hardware.name} ({device.name}) has peaks for "
                         f"{', '.join(device.peak_tflops)} only")
    if fmt.needs is not None and fmt.needs not in device.block_scaled_formats:
        has = ", ".join(device.block_scaled_formats) or "none"
        raise ValueError(f"{fmt.name} GEMMs need tensor cores that read {fmt.needs} block "
                         f"scales: {hardware.name} ({device.name}) has none of that kind "
                         f"(block-scaled formats: {has})")
    return fmt
