"""Fused attention kernels priced from published measurements: the FLOP/s a kernel reaches
at a sequence length, head dimension and mask, per GPU.

``data/attention_benchmarks.csv`` holds the published throughput of FlashAttention 2 and 3,
cuDNN's fused SDPA and others (its header names each source: the FlashAttention-2 and -3
papers' figures, NVIDIA's cudnn-frontend benchmark results) as TFLOP/s by GPU, kernel,
direction (``fwd``, ``bwd``, ``fwd_bwd``), causal mask, head dimension and sequence length,
in FlashAttention's FLOP convention — forward 4·B·H·S²·D (halved when causal), backward
2.5× the forward — which :func:`~vcluster.runtime.tracing.kernel.kernel_flops` counts
from a kernel's shape (cuDNN's benchmarks count causal S(S+1)/2, equal up to 1/S).

A kernel of that shape is priced as

    t = t_k + F / r(direction, causal, d, s)

with ``t_k`` the device's kernel overhead, ``F`` the kernel's FLOPs in that convention
(:func:`~vcluster.runtime.tracing.kernel.kernel_flops`: from its shape and mask, not the
count the program declared — before 2026-12-01 the declared count, which priced the GPT
block's causal kernels at 2× forward and 1.6× backward, the grouped-query block's backward
at 0.8×) and ``r`` the curve's
rate, interpolated linearly in log2(s) between the published sequence lengths and held at
the ends (the sources sweep 512 to 16K, some to 128K; past 16K the published rates stay
within ±8% to 128K: cudnn-frontend's B200 and H200 runs, S5-S7). No efficiency divisor: the
rates are the kernels' own, measured alone (as :mod:`.kernel_profiles`' in-stream prices).

The sequence a kernel is read at: √(s_q·s_kv) for its query and key rows (a context-
parallel block is the smaller kernel it is); the head dimension: the published one nearest
in log2 (the lower on a tie) — at that dimension's rate where the kernel's d is the larger;
where it is the smaller, the rate of d' scaled to d by the softmax's exponentials (since
2026-12-01, :meth:`AttentionKernelPrices.curve`). Per (query, key) pair a fused kernel does
F·d tensor-core FLOPs (F = 4 forward, 10 backward in the convention below) and one
exponential whatever d (the backward recomputes P = exp(S − LSE)), so

    t(d) = (d/d')·(F·d'/r(d') − e) + e,    r(d) = F·d / t(d),

e = 1/E the GPU's time per exponential (:data:`EXP_PER_S`: 16 per clock per SM on every
generation, against 2,048 tensor-core FLOPs per clock per SM on Ampere, 4,096 on Hopper,
8,192 on Blackwell, twice the exponentials on Blackwell Ultra). What the published rate of
d' leaves after its exponentials scales with d; the exponentials do not. A smaller d is
slower per FLOP, and the more so where the exponentials weigh more: Blackwell doubled
Hopper's tensor cores, not its exponential units (FlashAttention-4, Zadouri et al. 2026;
together.ai/blog/flashattention-4). Checked where both are published (the H100's cuDNN,
FlashAttention-2 and -3, d = 64 from d = 128, :func:`head_dim_check`): within −5% to +21%
forward, +4% to +9% backward, but FlashAttention-3's causal forward at 512–1,024 tokens
(+29%, +32%) and Triton's kernel (−18%); reading d = 128's curve as is, as before, was +6%
to +56% off (Triton's −5%). GPT-OSS's and Llama 3.2's head dimension 64 on B200, GB200,
GB300 and H200, whose published full-attention curves are at 128 and 160 only, read those
unscaled before.

A sliding window w shorter than the sequence is read from the curves of that window where
the table publishes them (its ``window`` column: cudnn-frontend's GPT-OSS runs, w = 128 and
1024 at head dim 64), at the kernel's sequence and the window's nearest head dimension:
such a kernel computes each query tile against about w/tile + 1 key tiles however long the
sequence, and runs far below the full kernel — on a GB200 under cuDNN 9.22.0, 165 TFLOP/s
forward at w = 128 against 1,408 causal at 4K. A window with no published curve keeps the
causal curve read at min(√(s_q·s_kv), w) (an upper bound on its rate: the curves' shortest
sequences are 512 to 2,048). With a cuDNN release selected (below), a window that release
has no rows of is read from every release's rows of it (``AttentionCurve.derived`` says so).

Where a source leaves a (direction, mask) out, the curve is derived, in this order, and says
so (:attr:`AttentionCurve.derived`):

1. ``bwd`` from ``fwd`` and ``fwd_bwd`` (both published): 2.5·F / (3.5·F/r_fb − F/r_f);
   ``fwd`` likewise from ``bwd`` and ``fwd_bwd``;
2. ``fwd`` and ``bwd`` both missing: both at the ``fwd_bwd`` rate (a 3.5·F pair at that rate);
3. a causal ``bwd`` from the non-causal ``bwd`` times the forward's causal over non-causal
   rate at the same sequence (the mask's cost measured on the forward, assumed the same
   on the backward: FlashAttention-3 publishes no causal backward);
4. a mask with no curve at all takes the other mask's (cudnn-frontend's B200 runs are
   causal only: non-causal blocks, as context parallelism's, then price at the causal rate,
   the lower at short sequences).

Which GPU's curves a device reads and its default kernel are preset fields
(:attr:`~.hardware.DeviceSpec.attention_gpu`, :attr:`~.hardware.DeviceSpec.
attention_kernel`); a run names another with ``ParallelConfig.attention`` (``flash2``,
``flash3``, ``cudnn``). cuDNN's kernels change from release to release (on one GB200, its
causal forward at 8K tokens ran at 1,586 TFLOP/s under cuDNN 9.19.1 and 9.22.0, against
B200's 1,171 under 9.13.1): the table records each cuDNN row's release (``cudnn``), and a
device may read one release's rows (:attr:`~.hardware.DeviceSpec.attention_cudnn`; by
default every release's, their median at each point).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from vcluster.runtime.tracing.kernel import Kernel, kernel_flops

from .presets import read_data_csv

__all__ = ["ATTENTION_TABLE", "NAMED_KERNELS", "EXP_PER_S", "AttentionCurve",
           "AttentionKernelPrices", "attention_prices", "attention_gpus", "kernels_of",
           "named_kernel", "cudnn_releases", "scaled_head_dim_rate", "head_dim_check"]

#: the published measurements (module docstring)
ATTENTION_TABLE = "attention_benchmarks.csv"
#: the kernels a run may name (ParallelConfig.attention): their curves in ATTENTION_TABLE
NAMED_KERNELS = ("flash2", "flash3", "cudnn")
_FWD_BWD, _BWD = 3.5, 2.5         # FLOPs of fwd+bwd and bwd over the forward's
#: tensor-core FLOPs per (query, key) pair and head dimension, by direction (convention A)
_PAIR_FLOPS = MappingProxyType({"fwd": 4.0, "bwd": 10.0})
#: exponentials per second of each curve GPU: its dense 16-bit tensor-core peak over the
#: tensor-core FLOPs per exponential, both per clock per SM — 16 exponentials (the MUFU's
#: rate) against 2,048 FLOPs on Ampere (A100: 312 TFLOP/s over 108 SMs at 1.41 GHz),
#: 4,096 on Hopper (FlashAttention-3, arXiv 2407.08608 sec 3.1: H100 SXM5 "989 TFLOPS of
#: FP16 matmul but only 3.9 TFLOPS of special functions"), 8,192 on Blackwell
#: (FlashAttention-4, together.ai/blog/flashattention-4: B200 2.25 PFLOP/s, MUFU 16 per
#: clock per SM, unchanged from Hopper), doubled exponentials on Blackwell Ultra (NVIDIA,
#: developer.nvidia.com/blog/making-softmax-more-efficient-with-nvidia-blackwell-ultra:
#: "doubling SFU throughput over the standard NVIDIA Blackwell architecture"). Peaks: the
#: presets' BF16 (A100 312, H100/H200 989.4, B200 2,250, GB200 and GB300 2,500)
EXP_PER_S: Mapping[str, float] = MappingProxyType({
    "a100-80gb": 312e12 / 128, "h100-sxm": 989.4e12 / 256, "h200": 989.4e12 / 256,
    "b200": 2250e12 / 512, "gb200": 2500e12 / 512, "gb300": 2500e12 / 256})
_DIRECTIONS = ("fwd", "bwd", "fwd_bwd")


@dataclass(frozen=True)
class AttentionCurve:
    """TFLOP/s by sequence length: ``points`` ((seq, tflops), ...) ascending; ``derived``:
    how it was made where not published ("" when published; module docstring)."""

    points: tuple
    derived: str = ""

    def tflops(self, seq: float) -> float:
        """The rate at ``seq``: linear in log2(seq) between points, held at the ends."""
        pts = self.points
        if seq <= pts[0][0]:
            return pts[0][1]
        if seq >= pts[-1][0]:
            return pts[-1][1]
        x = math.log2(seq)
        for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
            if seq <= s1:
                u = (x - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + u * (r1 - r0)
        return pts[-1][1]                                   # unreachable


def _combine(a: AttentionCurve, b: AttentionCurve, fn, how: str) -> AttentionCurve | None:
    """``fn(ra, rb)`` at the sequence lengths both curves publish (None if none)."""
    rb = dict(b.points)
    pts = tuple((s, fn(r, rb[s])) for s, r in a.points if s in rb)
    pts = tuple((s, r) for s, r in pts if r > 0 and math.isfinite(r))
    return AttentionCurve(pts, how) if pts else None


@dataclass(frozen=True)
class AttentionKernelPrices:
    """One kernel on one GPU: its curves by (direction, causal, head_dim)."""

    gpu: str
    kernel: str
    curves: Mapping = field(repr=False)           # read-only after construction
    # sliding-window curves by (direction, window, head_dim) (module docstring)
    windowed: Mapping = field(default_factory=dict, repr=False)
    head_dims: tuple = field(init=False)           # the published head dimensions

    def __post_init__(self):
        object.__setattr__(self, "curves", MappingProxyType(dict(self.curves)))
        object.__setattr__(self, "windowed", MappingProxyType(dict(self.windowed)))
        object.__setattr__(self, "head_dims", tuple(sorted({d for _, _, d in self.curves})))

    def curve(self, direction: str, causal: bool, head_dim: int) -> AttentionCurve:
        """The curve of the published head dimension d' nearest ``head_dim``; where
        ``head_dim`` is the smaller and the GPU's exponential rate is known
        (:data:`EXP_PER_S`), scaled to it by the exponentials (module docstring)."""
        d = min(self.head_dims, key=lambda h: (abs(math.log2(h) - math.log2(head_dim)), h))
        near = self.curves[(direction, bool(causal), d)]
        if head_dim >= d or self.gpu not in EXP_PER_S or direction not in _PAIR_FLOPS:
            return near
        return _scaled_curve(near, d, head_dim, _PAIR_FLOPS[direction],
                             1.0 / EXP_PER_S[self.gpu])

    def windowed_curve(self, direction: str, window: int,
                       head_dim: int) -> AttentionCurve | None:
        """The published curve of sliding window ``window`` at the head dimension nearest
        ``head_dim`` among that window's, or None where the window has none."""
        dims = [d for x, w, d in self.windowed if x == direction and w == window]
        if not dims:
            return None
        d = min(dims, key=lambda h: (abs(math.log2(h) - math.log2(head_dim)), h))
        return self.windowed[(direction, window, d)]

    def rate_tflops(self, kernel: Kernel) -> float:
        """The TFLOP/s ``kernel`` (an attention kernel) runs at (module docstring)."""
        _, s_q, s_kv, d = kernel.shape
        seq = math.sqrt(max(s_q, 1) * max(s_kv, 1))
        direction = "bwd" if kernel.backward else "fwd"
        if kernel.window and kernel.window < seq:
            own = self.windowed_curve(direction, kernel.window, d)
            if own is not None:
                return own.tflops(seq)
            seq = kernel.window
        return self.curve(direction, kernel.causal or bool(kernel.window), d).tflops(seq)

    def time_s(self, kernel: Kernel, overhead_s: float, rate_scale: float = 1.0) -> float:
        """t_k + F / (r · rate_scale), F the kernel's FLOPs in the curves' convention
        (:func:`~vcluster.runtime.tracing.kernel.kernel_flops`, from its shape: module
        docstring; ``rate_scale``: the device's sustained compute ratio, 1 on the part the
        curves were measured on); 0 for an empty kernel."""
        flops = kernel_flops(kernel)
        if flops <= 0:
            return 0.0
        return overhead_s + flops / (self.rate_tflops(kernel) * 1e12 * rate_scale)


def scaled_head_dim_rate(rate_tflops: float, d_from: int, d_to: int, pair_flops: float,
                         exp_s: float) -> float:
    """TFLOP/s at head dimension ``d_to`` from ``rate_tflops`` at ``d_from``: per pair
    t(d') = F·d'/r(d'), of which ``exp_s`` (one exponential) does not scale with d and the
    rest does: t(d) = (d/d')·(t(d') − e) + e, r(d) = F·d/t(d) (module docstring). A rate
    already past the exponentials' bound (t(d') <= e: a kernel that emulates some of them)
    is kept."""
    t_from = pair_flops * d_from / (rate_tflops * 1e12)
    if t_from <= exp_s:
        return rate_tflops
    t_to = d_to / d_from * (t_from - exp_s) + exp_s
    return pair_flops * d_to / t_to / 1e12


@functools.lru_cache(maxsize=None)
def _scaled_curve(near: AttentionCurve, d_from: int, d_to: int, pair_flops: float,
                  exp_s: float) -> AttentionCurve:
    """``near`` (head dim ``d_from``) scaled to ``d_to`` point by point (built once per
    curve and head dimension: :meth:`AttentionKernelPrices.curve` is on the pricing path)."""
    return AttentionCurve(
        tuple((s, scaled_head_dim_rate(r, d_from, d_to, pair_flops, exp_s))
              for s, r in near.points),
        f"head dim {d_to} from {d_from}'s curve, scaled by the exponentials"
        + (f" ({near.derived})" if near.derived else ""))


def head_dim_check(gpu: str, kernel: str, d_from: int = 128, d_to: int = 64) -> dict:
    """{(direction, causal): [(seq, derived / published − 1), ...]} of ``kernel`` on
    ``gpu`` wherever both head dimensions' curves are published (not derived; each the
    median of its rows, as :func:`attention_prices` builds them): the exponential scaling
    of ``d_from``'s rates against ``d_to``'s own (module docstring)."""
    curves = attention_prices(gpu, kernel).curves
    exp_s = 1.0 / EXP_PER_S[gpu]
    out: dict = {}
    for (direction, causal, d), own in curves.items():
        src = curves.get((direction, causal, d_from))
        if d != d_to or src is None or own.derived or src.derived:
            continue
        rates = dict(src.points)
        out[(direction, causal)] = [
            (s, scaled_head_dim_rate(rates[s], d_from, d_to, _PAIR_FLOPS[direction], exp_s)
             / r - 1) for s, r in own.points if s in rates]
    return out


def named_kernel(attention) -> str:
    """The named kernel of a run's ``attention`` (ParallelConfig's; "flash2", "flash3",
    "cudnn"), or "" for every other (``flash``: the device's default)."""
    value = getattr(attention, "value", attention)
    return value if value in NAMED_KERNELS else ""


@functools.lru_cache(maxsize=None)
def _rows() -> tuple:
    return tuple(read_data_csv(ATTENTION_TABLE)[1])


def attention_gpus() -> tuple:
    """The GPUs the table has curves for (its ``gpu`` keys)."""
    return tuple(sorted({r["gpu"] for r in _rows()}))


def kernels_of(gpu: str) -> tuple:
    """The named kernels (:data:`NAMED_KERNELS`) with curves on ``gpu``."""
    return tuple(k for k in NAMED_KERNELS if any(r["gpu"] == gpu and r["kernel"] == k
                                                 for r in _rows()))


@functools.lru_cache(maxsize=None)
def cudnn_releases(gpu: str) -> tuple:
    """The cuDNN releases the table has ``cudnn`` rows of on ``gpu`` (ascending)."""
    return tuple(sorted({r["cudnn"] for r in _rows() if r["gpu"] == gpu and
                         r["kernel"] == "cudnn" and r["cudnn"]}, key=_release_key))


def _release_key(release: str) -> tuple:
    return tuple(int(x) for x in release.split("."))


@functools.lru_cache(maxsize=None)
def attention_prices(gpu: str, kernel: str, cudnn: str = "") -> AttentionKernelPrices:
    """``kernel``'s curves on ``gpu``, published and derived (module docstring); with
    ``cudnn`` (a ``cudnn`` kernel only), the rows of that cuDNN release alone. ValueError
    naming what the table has when it has none."""
    if cudnn and kernel != "cudnn":
        raise ValueError(f"attention cudnn={cudnn!r}: a cuDNN release selects the curves of "
                         f"the cudnn kernel, not of {kernel!r}")
    if cudnn and cudnn not in cudnn_releases(gpu):
        raise ValueError(f"attention cudnn={cudnn!r}: no cudnn rows of that release on "
                         f"{gpu} in {ATTENTION_TABLE}; releases there: "
                         f"{', '.join(cudnn_releases(gpu)) or 'none'}")
    if kernel not in NAMED_KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: not a kernel with published curves; "
                         f"allowed: {', '.join(NAMED_KERNELS)}")
    if gpu not in attention_gpus():
        raise ValueError(f"attention curves for GPU {gpu!r}: none published in "
                         f"{ATTENTION_TABLE}; GPUs with curves: {', '.join(attention_gpus())}")
    samples: dict = {}
    windowed: dict = {}        # (direction, window, head_dim) -> release -> seq -> rates
    for r in _rows():
        if r["gpu"] != gpu or r["kernel"] != kernel:
            continue
        rate, seq = float(r["tflops"]), int(r["seq"])
        if r["window"]:
            key = (r["direction"], int(r["window"]), int(r["head_dim"]))
            windowed.setdefault(key, {}).setdefault(r["cudnn"], {}).setdefault(
                seq, []).append(rate)
        elif not cudnn or r["cudnn"] == cudnn:
            key = (r["direction"], r["causal"] == "1", int(r["head_dim"]))
            samples.setdefault(key, {}).setdefault(seq, []).append(rate)
    if not samples:
        raise ValueError(f"attention kernel {kernel!r} on {gpu}: no published curve; kernels "
                         f"with curves on {gpu}: {', '.join(kernels_of(gpu)) or 'none'}")
    curves = {key: _median_curve(by_seq) for key, by_seq in samples.items()}
    return AttentionKernelPrices(gpu, kernel, _complete(curves),
                                 {key: _window_curve(by_release, cudnn)
                                  for key, by_release in windowed.items()})


def _median_curve(by_seq: dict, derived: str = "") -> AttentionCurve:
    """The curve through the median published rate at each sequence."""
    return AttentionCurve(tuple((s, statistics.median(v)) for s, v in sorted(by_seq.items())),
                          derived)


def _window_curve(by_release: dict, cudnn: str) -> AttentionCurve:
    """A window's curve from its rows by cuDNN release: the selected release's where it has
    them, else every release's (module docstring)."""
    if not cudnn or cudnn in by_release:
        chosen = [by_release[cudnn]] if cudnn else list(by_release.values())
        derived = ""
    else:
        chosen = list(by_release.values())
        derived = (f"no rows of cuDNN {cudnn} at this window: those of "
                   f"{', '.join(sorted(by_release, key=_release_key))}")
    merged: dict = {}
    for by_seq in chosen:
        for s, v in by_seq.items():
            merged.setdefault(s, []).extend(v)
    return _median_curve(merged, derived)


def _complete(curves: dict) -> dict:
    """Every (fwd|bwd, causal) curve at every published head dimension, derived where
    missing by the module docstring's rules 1-4."""
    out = dict(curves)
    for d in sorted({k[2] for k in curves}):
        for causal in (True, False):
            f, b, fb = (out.get((x, causal, d)) for x in _DIRECTIONS)
            if b is None and f is not None and fb is not None:          # rule 1
                b = _combine(fb, f, lambda r_fb, r_f: _BWD / (_FWD_BWD / r_fb - 1 / r_f),
                             "backward from fwd_bwd less fwd")
            if f is None and b is not None and fb is not None:
                f = _combine(fb, b, lambda r_fb, r_b: 1 / (_FWD_BWD / r_fb - _BWD / r_b),
                             "forward from fwd_bwd less bwd")
            if f is None and b is None and fb is not None:              # rule 2
                f = b = AttentionCurve(fb.points, "forward and backward at the fwd_bwd rate")
            for key, c in (((("fwd", causal, d)), f), (("bwd", causal, d), b)):
                if c is not None:
                    out[key] = c
        for causal in (True, False):                                    # rule 3
            if ("bwd", causal, d) not in out and all(
                    k in out for k in (("bwd", not causal, d), ("fwd", True, d),
                                       ("fwd", False, d))):
                f_ratio = _combine(out[("fwd", causal, d)], out[("fwd", not causal, d)],
                                   lambda a, b: a / b, "")
                if f_ratio is not None:
                    ratio = AttentionCurve(f_ratio.points)
                    nc = out[("bwd", not causal, d)]
                    out[("bwd", causal, d)] = AttentionCurve(
                        tuple((s, r * ratio.tflops(s)) for s, r in nc.points),
                        f"{'causal' if causal else 'non-causal'} backward: the other mask's "
                        f"backward times the forward's mask ratio")
        for direction in ("fwd", "bwd"):                                # rule 4
            for causal in (True, False):
                other = out.get((direction, not causal, d))
                if (direction, causal, d) not in out and other is not None:
                    out[(direction, causal, d)] = AttentionCurve(
                        other.points, f"{'causal' if causal else 'non-causal'}: none "
                        f"published, the other mask's curve")
    missing = [(x, c, d) for d in sorted({k[2] for k in out}) for x in ("fwd", "bwd")
               for c in (True, False) if (x, c, d) not in out]
    for key in missing:       # a head dim published for one direction only: the nearest
        near = [k for k in out if k[:2] == key[:2]]
        if near:
            src = min(near, key=lambda k: abs(math.log2(k[2]) - math.log2(key[2])))
            out[key] = AttentionCurve(out[src].points, f"head dim {src[2]}'s curve")
    return {k: v for k, v in out.items() if k[0] in ("fwd", "bwd")}
