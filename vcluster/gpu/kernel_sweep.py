"""The kernel sweep of ``vcluster hardware calibrate --gpu``: GEMMs, copies, the kernels of
a transformer layer and its optimizer, and the launch interval, timed with PyTorch on one
device.

Every kernel is timed in a stream of ``reps`` back-to-back calls and reported as seconds
per call: what a kernel costs inside a training step, where the host queues kernels ahead
of the device — not the cost of one call timed alone, which adds the launch and the
timer's own latency (the shipped ``h100_kernels.csv`` times calls alone). On a GPU the
stream is timed with CUDA events, and it is *queued ahead*: a ``torch.cuda._sleep`` kernel
holds the device while the host issues all ``reps`` calls (sized to twice the host's
measured issue time, plus 1 ms), so the events time the device running the calls back to
back even where the host issues one call slower than the device runs it (a small
autograd backward: the step's host is ahead of its device there, as the host of a
training step is; at most ``_MAX_QUEUED`` calls of a many-kernel op, within CUDA's launch
queue). On the CPU: ``perf_counter`` around the stream with a final synchronisation,
torch on one thread (:data:`_CPU_THREADS`).
With ``repeats`` N > 1 every kernel's stream is timed N times and the fastest kept: other
processes on the machine only ever add time to a stream, so the fastest of several is the
least disturbed (the rule of Python's ``timeit``); :mod:`vcluster.gpu.plausibility` says
when a sweep still looks stalled.

* GEMM: C = A @ B for m, k, n over a grid (bf16 on a GPU; fp32 on the CPU, whose bf16
  GEMMs are emulated and slow);
* sustained GEMM: one GEMM of the grid run back to back for 1.5 s (the device reaches its
  power limit and lowers its clock) and then timed for 1.5 s more: the burst row's
  seconds over this one's is the share of the burst rate a GEMM-only load sustains
  (recorded, not used as a price: :class:`~vcluster.timing.kernel_profiles.KernelProfile`);
* copy: ``dst.copy_(src)``, ``bytes`` = read + written;
* the table's kernels (:data:`~vcluster.timing.kernel_profile.TABLE_OPS`), at the shapes
  of ``h100_kernels.csv`` on a GPU (so each in-stream price sits beside the same shape
  timed alone) and at tiny shapes on the CPU: causal SDPA attention forward, and forward
  + backward (``torch.autograd.grad`` of q, k, v); layer norm forward, and forward +
  backward (of x, weight, bias); GELU; an add; cross-entropy forward + backward of
  16-bit logits upcast to fp32; one fused AdamW step over P fp32 parameters (``fused``
  on a GPU);
* launch: ``x.add_(1)`` on a one-element tensor, *not* queued ahead: the interval at
  which the host issues kernels when each does nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType

from vcluster.timing.kernel_profile import H100_KERNEL_TABLE, TABLE_OPS, KernelTiming
from vcluster.timing.presets import read_data_csv

__all__ = ["KernelSweep", "StreamTimer", "sweep_kernels", "cuda_missing", "torch_missing",
           "TORCH_INSTALL_HINT", "table_op", "table_shapes",
           "GPU_GEMM_DIMS", "TINY_GEMM_DIMS", "TINY_TABLE_DIMS"]

# m, k and n each take these values (every combination). Kept to seconds of GPU time:
# the largest GEMM (8192 x 16384 x 8192, 2.2 TFLOP) runs in ~3 ms on an H100.
GPU_GEMM_DIMS = {"m": (512, 2048, 8192), "k": (1024, 4096, 16384), "n": (1024, 4096, 8192)}
GPU_COPY_BYTES = (1 << 20, 16 << 20, 256 << 20, 1 << 30)
TINY_GEMM_DIMS = {"m": (16, 64, 256), "k": (32, 128), "n": (16, 64, 256)}
TINY_COPY_BYTES = (64 << 10, 1 << 20, 8 << 20)
# the table's kernels at sizes a CPU times in well under a second each (two shapes each,
# so every kind's profile can be fitted)
TINY_TABLE_DIMS = (("attn_fwd", "1x2x64x16"), ("attn_fwd", "4x4x256x32"),
                   ("attn_fwd_bwd", "1x2x64x16"), ("attn_fwd_bwd", "4x4x256x32"),
                   ("layernorm_fwd", "64x32"), ("layernorm_fwd", "1024x256"),
                   ("layernorm_fwd_bwd", "64x32"), ("layernorm_fwd_bwd", "1024x256"),
                   ("gelu_fwd", "64x128"), ("gelu_fwd", "1024x1024"),
                   ("add", "64x32"), ("add", "1024x256"),
                   ("cross_entropy_fwd_bwd", "64x100"), ("cross_entropy_fwd_bwd", "512x1000"),
                   ("adamw_fused_step", "1000"), ("adamw_fused_step", "300000"))
_TARGET_S = MappingProxyType({"cuda": 0.02, "cpu": 0.01})      # each stream of calls lasts about this long
# gemm_sustained: this GEMM (in the grid) run for this long, then timed for as long again
_SUSTAINED_GEMM, _TINY_SUSTAINED_GEMM = (8192, 4096, 8192), (256, 128, 256)
_SUSTAINED_S = MappingProxyType({"cuda": 1.5, "cpu": 0.05})
_MAX_REPS = 200                              # calls in one stream, at most
_MAX_QUEUED = 40                             # ... of a table op (autograd: many kernels each)
# torch's threads in a CPU sweep (restored after it): one, as each virtual device runs
# BLAS on one. With torch's default (one per core) on a loaded 2-core machine, every tiny
# call waited for the second thread's time slice: a 16x32x16 fp32 GEMM took 10-16 ms per
# call against 1.9 us on one thread (measured here, load average 7-9), and the sweep
# recorded 20-50 ms for every GEMM of the grid.
_CPU_THREADS = 1


# what to do without torch (pyproject.toml's extra `torch`; the CPU wheel avoids the ~3 GB
# of CUDA libraries an unpinned install pulls, as docs/torch.md says)
TORCH_INSTALL_HINT = ("torch is not installed: pip install -e '.[torch]' in the vcluster "
                      "checkout (on a CPU-only machine: pip install torch --index-url "
                      "https://download.pytorch.org/whl/cpu first)")


def torch_missing() -> str | None:
    """:data:`TORCH_INSTALL_HINT` when ``import torch`` fails here (None when it works)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return TORCH_INSTALL_HINT
    return None


def cuda_missing() -> str | None:
    """Why torch cannot use a CUDA device here (None when it can)."""
    if why := torch_missing():
        return f"{why}; a GPU measurement needs torch with CUDA"
    import torch
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
    repeats: int = 1             # each row: the fastest of this many timed streams

    def __repr__(self) -> str:
        fastest = f", fastest of {self.repeats}" if self.repeats > 1 else ""
        return (f"KernelSweep({self.device_name!r}, torch {self.torch_version}, "
                f"{self.dtype}, {len(self.kernels)} kernels{fastest})")

    def of_kind(self, kind: str) -> list:
        return [k for k in self.kernels if k.kind == kind]


class StreamTimer:
    """Seconds per call of ``fn`` in a stream of calls on ``device`` (module docstring)."""

    def __init__(self, torch, device: str, repeats: int = 1):
        self.torch, self.device, self.repeats = torch, device, repeats
        self._sleep_cycles_per_s = None

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def stream(self, fn, reps: int, ahead_s: float = 0.0) -> tuple[float, float]:
        """``(device seconds per call, host seconds per call)`` of ``reps`` calls, the
        device held for ``ahead_s`` first (GPU only) while the host queues them."""
        torch = self.torch
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if ahead_s > 0:
                torch.cuda._sleep(int(ahead_s * self._cycles_per_s()))
            start.record()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            host_s = (time.perf_counter() - t0) / reps
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps, host_s
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        seconds = (time.perf_counter() - t0) / reps
        return seconds, seconds

    def _cycles_per_s(self) -> float:
        """The rate of ``torch.cuda._sleep``'s cycles, timed once with CUDA events."""
        if self._sleep_cycles_per_s is None:
            torch, cycles = self.torch, 10_000_000
            torch.cuda._sleep(cycles // 10)                       # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._sleep_cycles_per_s = cycles / (start.elapsed_time(end) / 1e3)
        return self._sleep_cycles_per_s

    def per_call(self, fn, max_reps: int = _MAX_REPS, queued: bool = True) -> float:
        """Warm up, size the stream to about ``_TARGET_S`` (at most ``max_reps`` calls),
        and time it ``repeats`` times (the fastest); ``queued`` (GPU): with the device held
        while the host queues it."""
        fn()
        self.sync()
        device_s, host_s = self.stream(fn, 2)
        reps = int(min(max_reps, max(3, _TARGET_S[self.device] / max(device_s, 1e-7))))
        ahead_s = 2.0 * host_s * reps + 1e-3 if queued and self.device == "cuda" else 0.0
        return min(self.stream(fn, reps, ahead_s)[0] for _ in range(self.repeats))


def sweep_kernels(device: str = "cuda", tiny: bool = False, repeats: int = 1) -> KernelSweep:
    """Run the sweep on ``device`` ("cuda": the current GPU; "cpu"), at the GPU sizes or
    (``tiny``) at sizes a CPU times in a few seconds; each kernel the fastest of
    ``repeats`` timed streams (the sustained GEMM: one)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1 (timed streams per kernel), "
                         f"got {repeats!r}")
    if why := (cuda_missing() if device == "cuda" else torch_missing()):
        raise RuntimeError(why)
    import torch
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(_CPU_THREADS)
    try:
        return _sweep(torch, StreamTimer(torch, device, repeats), tiny)
    finally:
        torch.set_num_threads(threads)


def _sweep(torch, timer: StreamTimer, tiny: bool) -> KernelSweep:
    device, repeats = timer.device, timer.repeats
    dtype, name = (torch.bfloat16, "bf16") if device == "cuda" else (torch.float32, "fp32")
    dims, copies = (TINY_GEMM_DIMS, TINY_COPY_BYTES) if tiny else (GPU_GEMM_DIMS, GPU_COPY_BYTES)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for m in dims["m"]:
        for k in dims["k"]:
            for n in dims["n"]:
                seconds = _gemm_seconds(torch, timer, m, k, n, dtype, gen)
                rows.append(KernelTiming("gemm", seconds, m=m, k=k, n=n, dtype=name))
    m, k, n = _TINY_SUSTAINED_GEMM if tiny else _SUSTAINED_GEMM
    seconds = _gemm_seconds(torch, timer, m, k, n, dtype, gen, _SUSTAINED_S[device])
    rows.append(KernelTiming("gemm_sustained", seconds, m=m, k=k, n=n, dtype=name))
    for nbytes in copies:
        seconds = _copy_seconds(torch, timer, nbytes)
        rows.append(KernelTiming("elementwise", seconds, bytes=2 * nbytes, dtype="uint8"))
    for op, shape in (TINY_TABLE_DIMS if tiny else table_shapes()):
        fn = table_op(torch, op, shape, device, dtype, gen)
        rows.append(KernelTiming(op, timer.per_call(fn, _MAX_QUEUED), dtype=name, dims=shape))
        del fn
    one = torch.zeros(1, device=device)
    rows.append(KernelTiming("launch", timer.per_call(lambda: one.add_(1), queued=False),
                             dtype="fp32"))
    label = torch.cuda.get_device_name() if device == "cuda" else _cpu_name()
    return KernelSweep(label, torch.__version__, device, name, tuple(rows), repeats)


def _gemm_seconds(torch, timer: StreamTimer, m: int, k: int, n: int, dtype, gen,
                  sustained_s: float = 0.0) -> float:
    """Seconds per call of the m×k×n GEMM in a burst, or (``sustained_s`` > 0) run back to
    back for that long first and then timed for as long again."""
    a = torch.randn(m, k, device=timer.device, dtype=dtype, generator=gen)
    b = torch.randn(k, n, device=timer.device, dtype=dtype, generator=gen)
    out = torch.empty(m, n, device=timer.device, dtype=dtype)
    if not sustained_s:
        return timer.per_call(lambda: torch.matmul(a, b, out=out))
    burst_s = timer.per_call(lambda: torch.matmul(a, b, out=out))
    reps = max(3, int(sustained_s / burst_s))
    timer.stream(lambda: torch.matmul(a, b, out=out), reps)       # to the power limit
    return timer.stream(lambda: torch.matmul(a, b, out=out), reps)[0]


def _copy_seconds(torch, timer: StreamTimer, nbytes: int) -> float:
    src = torch.ones(nbytes, device=timer.device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return timer.per_call(lambda: dst.copy_(src))


def table_shapes() -> tuple:
    """``((op, dims), ...)``: every non-GEMM row of the shipped ``h100_kernels.csv``."""
    _, rows = read_data_csv(H100_KERNEL_TABLE)
    return tuple((r["op"], r["dims"]) for r in rows if r["op"] in TABLE_OPS)


def table_op(torch, op: str, dims: str, device: str, dtype, gen):
    """A no-argument callable running one ``op`` of
    :data:`~vcluster.timing.kernel_profile.TABLE_OPS` at ``dims`` (module docstring), its
    inputs allocated once on ``device`` in ``dtype``."""
    KernelTiming(op, 1.0, dims=dims)                      # checks op and dims
    F = torch.nn.functional
    shape = [int(x) for x in dims.split("x")]

    def randn(*size, grad=False, dt=dtype):
        return torch.randn(*size, device=device, dtype=dt, generator=gen).requires_grad_(grad)

    if op in ("attn_fwd", "attn_fwd_bwd"):
        b, h, s, d = shape
        backward = op == "attn_fwd_bwd"
        q, k, v = (randn(b, h, s, d, grad=backward) for _ in range(3))
        if not backward:
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        go = randn(b, h, s, d)
        return lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), go)
    if op in ("layernorm_fwd", "layernorm_fwd_bwd"):
        t, w = shape
        backward = op == "layernorm_fwd_bwd"
        x, weight, bias = randn(t, w, grad=backward), randn(w, grad=backward), \
            randn(w, grad=backward)
        if not backward:
            return lambda: F.layer_norm(x, (w,), weight, bias)
        go = randn(t, w)
        return lambda: torch.autograd.grad(F.layer_norm(x, (w,), weight, bias),
                                           (x, weight, bias), go)
    if op == "gelu_fwd":
        x = randn(*shape)
        return lambda: F.gelu(x)
    if op == "add":
        a, b = randn(*shape), randn(*shape)
        return lambda: a + b
    if op == "cross_entropy_fwd_bwd":
        t, vocab = shape
        logits = randn(t, vocab, grad=True)
        targets = torch.randint(0, vocab, (t,), device=device, generator=gen)
        return lambda: torch.autograd.grad(F.cross_entropy(logits.float(), targets), logits)
    # adamw_fused_step
    p = torch.nn.Parameter(randn(shape[0], dt=torch.float32))
    p.grad = randn(shape[0], dt=torch.float32)
    optimizer = torch.optim.AdamW([p], lr=1e-4, fused=device == "cuda")
    return optimizer.step


def _cpu_name() -> str:
    import platform
    return f"CPU ({platform.processor() or platform.machine()})"
