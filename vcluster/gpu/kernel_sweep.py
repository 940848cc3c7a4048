"""The kernel sweep of ``vcluster hardware calibrate --gpu``: GEMMs, copies and the launch
interval, timed with PyTorch on one device.

Every kernel is timed in a stream of ``reps`` back-to-back calls (CUDA events around the
stream on a GPU, ``perf_counter`` with a final synchronisation on the CPU) and reported as
seconds per call: what a kernel costs inside a training step, where the host queues
kernels ahead of the device — not the cost of one call timed alone, which adds the
launch and the timer's own latency (the shipped ``h100_kernels.csv`` times calls alone).

* GEMM: C = A @ B for m, k, n over a grid (bf16 on a GPU; fp32 on the CPU, whose bf16
  GEMMs are emulated and slow);
* copy: ``dst.copy_(src)``, ``bytes`` = read + written;
* launch: ``x.add_(1)`` on a one-element tensor: the interval at which the host issues
  kernels when each does nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vcluster.timing.kernel_profile import KernelTiming

__all__ = ["KernelSweep", "sweep_kernels", "cuda_missing", "GPU_GEMM_DIMS", "TINY_GEMM_DIMS"]

# m, k and n each take these values (every combination). Kept to seconds of GPU time:
# the largest GEMM (8192 x 16384 x 8192, 2.2 TFLOP) runs in ~3 ms on an H100.
GPU_GEMM_DIMS = {"m": (512, 2048, 8192), "k": (1024, 4096, 16384), "n": (1024, 4096, 8192)}
GPU_COPY_BYTES = (1 << 20, 16 << 20, 256 << 20, 1 << 30)
TINY_GEMM_DIMS = {"m": (16, 64, 256), "k": (32, 128), "n": (16, 64, 256)}
TINY_COPY_BYTES = (64 << 10, 1 << 20, 8 << 20)
_TARGET_S = {"cuda": 0.02, "cpu": 0.01}      # each stream of calls lasts about this long


def cuda_missing() -> str | None:
    """Why torch cannot use a CUDA device here (None when it can)."""
    try:
        import torch
    except ImportError:
        return ("torch is not installed (pip install -e '.[torch]'); a GPU measurement "
                "needs torch with CUDA")
    if not torch.cuda.is_available():
        return (f"no CUDA device: torch {torch.__version__} reports "
                "torch.cuda.is_available() == False")
    return None


@dataclass(frozen=True)
class KernelSweep:
    """What a sweep measured on one device."""

    device_name: str
    torch_version: str
    device: str                  # "cuda" or "cpu"
    dtype: str                   # the GEMMs' dtype: "bf16" (cuda) or "fp32" (cpu)
    kernels: tuple               # KernelTiming rows

    def __repr__(self) -> str:
        return (f"KernelSweep({self.device_name!r}, torch {self.torch_version}, "
                f"{self.dtype}, {len(self.kernels)} kernels)")

    def of_kind(self, kind: str) -> list:
        return [k for k in self.kernels if k.kind == kind]


class _Timer:
    """Seconds per call of ``fn`` in a stream of calls on ``device``."""

    def __init__(self, torch, device: str):
        self.torch, self.device = torch, device

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def stream(self, fn, reps: int) -> float:
        torch = self.torch
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def per_call(self, fn) -> float:
        """Warm up, size the stream to about ``_TARGET_S``, and time it."""
        fn()
        self.sync()
        first = self.stream(fn, 2)
        reps = int(min(200, max(3, _TARGET_S[self.device] / max(first, 1e-7))))
        return self.stream(fn, reps)


def sweep_kernels(device: str = "cuda", tiny: bool = False) -> KernelSweep:
    """Run the sweep on ``device`` ("cuda": the current GPU; "cpu"), at the GPU sizes or
    (``tiny``) at sizes a CPU times in a few seconds."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and (why := cuda_missing()):
        raise RuntimeError(why)
    import torch
    timer = _Timer(torch, device)
    dtype, name = (torch.bfloat16, "bf16") if device == "cuda" else (torch.float32, "fp32")
    dims, copies = (TINY_GEMM_DIMS, TINY_COPY_BYTES) if tiny else (GPU_GEMM_DIMS, GPU_COPY_BYTES)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for m in dims["m"]:
        for k in dims["k"]:
            for n in dims["n"]:
                seconds = _gemm_seconds(torch, timer, m, k, n, dtype, gen)
                rows.append(KernelTiming("gemm", seconds, m=m, k=k, n=n, dtype=name))
    for nbytes in copies:
        seconds = _copy_seconds(torch, timer, nbytes)
        rows.append(KernelTiming("elementwise", seconds, bytes=2 * nbytes, dtype="uint8"))
    one = torch.zeros(1, device=device)
    rows.append(KernelTiming("launch", timer.per_call(lambda: one.add_(1)), dtype="fp32"))
    label = torch.cuda.get_device_name() if device == "cuda" else _cpu_name()
    return KernelSweep(label, torch.__version__, device, name, tuple(rows))


def _gemm_seconds(torch, timer: _Timer, m: int, k: int, n: int, dtype, gen) -> float:
    a = torch.randn(m, k, device=timer.device, dtype=dtype, generator=gen)
    b = torch.randn(k, n, device=timer.device, dtype=dtype, generator=gen)
    out = torch.empty(m, n, device=timer.device, dtype=dtype)
    return timer.per_call(lambda: torch.matmul(a, b, out=out))


def _copy_seconds(torch, timer: _Timer, nbytes: int) -> float:
    src = torch.ones(nbytes, device=timer.device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return timer.per_call(lambda: dst.copy_(src))


def _cpu_name() -> str:
    import platform
    return f"CPU ({platform.processor() or platform.machine()})"
