"""Kernel prices by kind and shape: a :class:`KernelProfile` over a measured table.

A traced op that says what kernel it is (:class:`~vcluster.runtime.tracing.kernel.Kernel`)
is priced by its kind's profile. Every kind but GEMMs (:class:`~.kernel_profile.
GemmProfile`) has one form, a fixed cost per call plus a size at one sustained rate,

    t(size) = call_s + size · unit_s

fitted like the GEMM profile, least squares on the relative error
(:func:`~.kernel_profile.fit_call_and_rate`), each kind to its own rows of
``data/h100_kernels.csv`` (its header line is the source: one H100 SXM, PyTorch 2.11,
bf16, SDPA flash attention, each call timed alone). The sizes:

==========================  ======================================  ===========================
profile                     rows                                    size
==========================  ======================================  ===========================
``attention``               ``attn_fwd``                            causal FLOPs 2·(B·H)·S²·D
``attention_backward``      ``attn_fwd_bwd`` − ``attn_fwd``         2.5 × the forward's FLOPs
``norm``                    ``layernorm_fwd``                       tokens × width
``norm_backward``           ``layernorm_fwd_bwd`` − ``layernorm_fwd``  tokens × width
``activation``              ``gelu_fwd``                            tokens × width (4h)
``elementwise``             ``add``                                 elements read + written
``cross_entropy``           ``cross_entropy_fwd_bwd``               tokens × vocab
``optimizer``               ``adamw_fused_step``                    parameters
==========================  ======================================  ===========================

A backward's rows are the difference of the same shape's forward+backward and forward
timings (both measured, both alone: the difference is the backward as it runs after its
forward, launched by autograd). Each price rises with every dimension of its shape (a size
that grows with each, ``unit_s`` > 0), so prices are monotone along every swept dimension.

From a table timed alone to a training step. The table's fixed costs are those of one
call timed alone; in a step the host queues kernels ahead of the device and the stream
hides part of that. The replay takes a kernel's in-stream price as its table price less
``alone_overhead_s``, the part of a lone call's fixed cost that a stream hides, floored at
zero — measured for GEMMs only: the H100 GEMM profile's ``call_s`` (≈ 18 µs, fitted to the
table) less the in-stream fixed cost of a GEMM measured on an H200
(``STREAM_GEMM_CALL_S``, 5.30 µs) — and assumed the same for every kind of one lone
forward kernel per row (attention, norm, activation, elementwise, optimizer). The
profiles whose rows time a backward through autograd (``attention_backward``,
``norm_backward``, ``cross_entropy``) fit intercepts of 55–150 µs that are mostly the
autograd engine's host work around one lone backward, which a step's stream hides behind
the kernels queued before it: they keep their fitted rate and take ``STREAM_GEMM_CALL_S``
as their in-stream fixed cost (an assumption, not a measurement: no backward was timed in
a stream). Then no kernel starts before the host has launched it: price = max(in-stream
price, ``launch_s``) (``LAUNCH_INTERVAL_S``, 5.71 µs on the same H200). No constant here
was chosen on a row of ``vcluster validate-model``.

Outside the table. Sizes beyond the swept range follow the fitted line (fixed cost plus
size at the sustained rate). Kernels the table has no rows for are priced by the
device's analytic model (:meth:`~.hardware.DeviceSpec.compute_time_s`: t_k + max(F/rate,
B/bandwidth), over the training-kernel efficiency), floored at the launch interval too:
dropout, activation gradients, SwiGLU, SGD's step, unfused attention (its products are
GEMMs; its softmax passes elementwise work over the s² scores), and everything on a device
with no table.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from vcluster.runtime.tracing.kernel import Kernel, KernelKind, attention_flops, kernel_flops

from .kernel_profile import (H100_KERNEL_TABLE, TABLE_OPS, GemmProfile, fit_call_and_rate,
                             gemm_rows)

__all__ = ["LinearProfile", "KernelProfile", "table_rows", "profile_points", "kind_leave_one_out",
           "h100_kernel_profile", "h100_kernel_leave_one_out", "LAUNCH_INTERVAL_S",
           "STREAM_GEMM_CALL_S", "PROFILE_UNITS", "COMPUTE_BOUND"]

# benchmarks/results/h200-2026-11-26/calibrated.yaml (`vcluster hardware calibrate --gpu`
# on one H200): "27 bf16 GEMMs fitted to 741.4 TFLOP/s + 5.30 us per call (in-stream)"
STREAM_GEMM_CALL_S = 5.30e-6
# the same file's `kind: launch` row: back-to-back one-element kernels, 5.713 us apart
LAUNCH_INTERVAL_S = 5.71e-6

#: each profile's size unit (module docstring)
PROFILE_UNITS = MappingProxyType({
    "attention": "causal FLOP", "attention_backward": "causal FLOP", "norm": "element",
    "norm_backward": "element", "activation": "element", "elementwise": "element moved",
    "cross_entropy": "token x vocab", "optimizer": "parameter"})

#: the table op each profile is measured by (module docstring's table)
_PROFILE_OP = MappingProxyType({
    "attention": "attn_fwd", "attention_backward": "attn_fwd_bwd", "norm": "layernorm_fwd",
    "norm_backward": "layernorm_fwd_bwd", "activation": "gelu_fwd", "elementwise": "add",
    "cross_entropy": "cross_entropy_fwd_bwd", "optimizer": "adamw_fused_step"})
#: the profiles whose size is FLOPs (compute-bound: they move with the device's achieved
#: FLOP/s); every other kind's size is elements or bytes moved (memory-bound: they move
#: with its achieved HBM bandwidth) — :meth:`KernelProfile.moved`
COMPUTE_BOUND = ("attention", "attention_backward")
#: the profiles of one lone forward kernel per row (module docstring); the others time a
#: backward through autograd
_ALONE = ("attention", "norm", "activation", "elementwise", "optimizer")
_BACKWARD_OF = {"attention_backward": "attention", "norm_backward": "norm"}
_FWD_BWD_FLOPS = 3.5   # the table's attn_fwd_bwd FLOPs over attn_fwd's (its header line)


@dataclass(frozen=True)
class LinearProfile:
    """``t = call_s + size · unit_s`` (module docstring), fitted to ``rows`` rows."""

    call_s: float
    unit_s: float
    unit: str = ""
    rows: int = 0

    def time_s(self, size: float) -> float:
        return self.call_s + size * self.unit_s

    @classmethod
    def fit(cls, points, unit: str = "", zero_call: bool = False) -> "LinearProfile":
        """Fit to ``points`` of ``(size, seconds)``; ``zero_call``: see
        :func:`~.kernel_profile.fit_call_and_rate`."""
        points = list(points)
        a, b = fit_call_and_rate(points, f"LinearProfile.fit ({unit or 'size'})", "kernels",
                                 unit or "unit", zero_call)
        return cls(a, b, unit, len(points))


def _size(k: Kernel) -> tuple[str, float] | None:
    """(profile name, size) of ``k``, or None where no profile applies (module docstring)."""
    kind, shape = k.kind, k.shape
    if kind is KernelKind.ATTENTION:
        if not k.flash:
            return None
        return ("attention_backward" if k.backward else "attention", kernel_flops(k))
    if kind is KernelKind.NORM:
        return ("norm_backward" if k.backward else "norm", shape[0] * shape[1])
    if kind is KernelKind.ACTIVATION:
        return None if k.backward or k.variant not in ("", "gelu") \
            else ("activation", shape[0] * shape[1])
    if kind is KernelKind.ELEMENTWISE:
        return "elementwise", shape[0]
    if kind is KernelKind.CROSS_ENTROPY:
        return "cross_entropy", shape[0] * shape[1] / k.parts
    if kind is KernelKind.OPTIMIZER:
        return ("optimizer", shape[0]) if k.variant in ("adam", "adamw") else None
    return None


@dataclass(frozen=True)
class KernelProfile:
    """In-stream prices by kernel kind: ``gemm`` (a GemmProfile) and the ``kinds``'
    LinearProfiles (names of :data:`PROFILE_UNITS`), both with their in-stream fixed costs
    already (module docstring), and the host's ``launch_s`` floor.

    Prices are burst prices: a GEMM run back to back for seconds slows at the device's
    power limit (one H100 SXM: 679.9 against 792.9 TFLOP/s, SM clock 1365 against
    1980 MHz at 700 W; ``hardware calibrate --gpu`` records it as a ``gemm_sustained``
    row), but inside a real eager step, whose memory-bound kernels draw less power, the
    GEMMs took 0.97–1.06× their burst prices (micro-batch 1–8,
    benchmarks/results/h100-2026-11-26/): no sustained factor is applied."""

    gemm: GemmProfile | None = None
    kinds: Mapping = field(default_factory=dict)
    launch_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        unknown = set(self.kinds) - set(PROFILE_UNITS)
        if unknown:
            raise ValueError(f"KernelProfile: unknown profile(s) {sorted(unknown)}; known: "
                             f"{', '.join(PROFILE_UNITS)}")
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))
        if not (self.launch_s >= 0):
            raise ValueError(f"KernelProfile: launch_s must be >= 0, got {self.launch_s!r}")

    def stream_time_s(self, kernel: Kernel) -> float | None:
        """``kernel``'s in-stream price from its kind's profile; None where none applies
        (the caller's analytic model prices it)."""
        if kernel.kind is KernelKind.GEMM:
            batch, m, k, n = kernel.shape
            if self.gemm is None:
                return None
            return self.gemm.time_s(m, k, n, batch) if batch and m and k and n else 0.0
        found = _size(kernel)
        if found is None or found[0] not in self.kinds:
            return None
        name, size = found
        return self.kinds[name].time_s(size) if size else 0.0

    def time_s(self, kernel: Kernel) -> float | None:
        """max(in-stream price, launch interval), or None (see :meth:`stream_time_s`)."""
        t = self.stream_time_s(kernel)
        return None if t is None else max(t, self.launch_s)

    def moved(self, compute_ratio: float, memory_ratio: float, to: str = "") -> "KernelProfile":
        """These prices on another device, by datasheet ratios: ``compute_ratio`` = its
        achieved FLOP/s over the measuring device's (bf16 peak × GEMM efficiency, each
        device's), ``memory_ratio`` = its achieved HBM bandwidth over the measuring
        device's (datasheet bandwidth × HBM efficiency). The GEMM rate is multiplied by
        ``compute_ratio`` and the :data:`COMPUTE_BOUND` kinds' time per FLOP divided by it;
        every other kind's time per element moved is divided by ``memory_ratio``. Fixed
        costs and the launch floor stay: they are the host's and the launch's, the same
        software on either device (an assumption). ``to`` names the device in
        ``source``. Ratios of 1 give this profile back."""
        for name, r in (("compute_ratio", compute_ratio), ("memory_ratio", memory_ratio)):
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not (r > 0) \
                    or r == float("inf"):
                raise ValueError(f"KernelProfile.moved: {name} must be a number > 0, got {r!r}")
        if compute_ratio == 1 and memory_ratio == 1:
            return self
        gemm = None if self.gemm is None else \
            replace(self.gemm, flops_per_s=self.gemm.flops_per_s * compute_ratio)
        kinds = {name: replace(p, unit_s=p.unit_s / (compute_ratio if name in COMPUTE_BOUND
                                                     else memory_ratio))
                 for name, p in self.kinds.items()}
        return KernelProfile(gemm, kinds, self.launch_s,
                             f"{self.source}; moved to {to or 'another device'} by datasheet "
                             f"ratios: FLOP/s x{compute_ratio:.4g}, HBM bandwidth "
                             f"x{memory_ratio:.4g}")

    @classmethod
    def from_table(cls, table: str = H100_KERNEL_TABLE, launch_s: float = LAUNCH_INTERVAL_S,
                   stream_gemm_call_s: float = STREAM_GEMM_CALL_S) -> "KernelProfile":
        """Every profile of a shipped table of lone calls, moved into a stream: each lone
        fixed cost less the GEMM's (table call_s − ``stream_gemm_call_s``), at least 0."""
        rows, source = gemm_rows(table)
        gemm = GemmProfile.fit(rows, source)
        hidden_s = max(gemm.call_s - stream_gemm_call_s, 0.0)
        kinds = {}
        for name, points in table_rows(table).items():
            p = LinearProfile.fit(points, PROFILE_UNITS[name])
            kinds[name] = replace(p, call_s=max(p.call_s - hidden_s, 0.0)
                                  if name in _ALONE else stream_gemm_call_s)
        return cls(replace(gemm, call_s=max(gemm.call_s - hidden_s, 0.0)), kinds, launch_s,
                   f"{source}; lone-call overhead {hidden_s * 1e6:.2f} us removed")

    @classmethod
    def from_timings(cls, kernels, source: str = "") -> "KernelProfile | None":
        """The profile of kernels measured in a stream on one device
        (:class:`~.kernel_profile.KernelTiming` rows, ``vcluster hardware calibrate
        --gpu``): the GEMM profile of its ``gemm`` rows, a profile per kind of its
        :data:`~.kernel_profile.TABLE_OPS` rows (sizes as the table's, module docstring),
        both as measured — in a stream already, nothing removed — with a fixed cost of 0
        where the rows fit a negative one, and the ``launch`` row's interval as the floor
        (a ``gemm_sustained`` row is a record, not a price: class docstring). A kind whose
        rows cannot be fitted (a larger size ran faster, or a backward no slower than its
        forward: noise) gets no profile — the analytic model prices it — and ``source``
        says so. None when the rows hold neither two GEMMs nor two rows of a kind."""
        return _timings_profile(tuple(kernels), source)


def _timings_profile(kernels, source: str) -> "KernelProfile | None":
    """See :meth:`KernelProfile.from_timings`."""
    gemms = [(r.m, r.k, r.n, r.seconds) for r in kernels if r.kind == "gemm"]
    by_op: dict = {}
    for r in kernels:
        if r.kind in TABLE_OPS:
            by_op.setdefault(r.kind, {})[r.dims] = r.seconds
    kinds = {}
    points = profile_points(by_op)
    for name, rows in points.items():
        try:
            kinds[name] = LinearProfile.fit(rows, PROFILE_UNITS[name], zero_call=True)
        except ValueError:             # noisy rows: a larger size ran faster
            pass
    # kinds measured (their op has rows) that got no profile: too few usable rows (a
    # backward not above its forward) or rows that fall with size
    unfit = [name for name, op in _PROFILE_OP.items() if op in by_op and name not in kinds]
    if unfit:
        source += f" (no profile for {', '.join(unfit)}: its rows cannot be fitted)"
    gemm = GemmProfile.fit(gemms, source, zero_call=True) if len(gemms) >= 2 else None
    if gemm is None and not kinds:
        return None
    launch = [r.seconds for r in kernels if r.kind == "launch"]
    return KernelProfile(gemm, kinds, launch[0] if launch else 0.0, source)


def table_rows(table: str = H100_KERNEL_TABLE) -> dict:
    """``{profile: [(size, seconds)]}`` of a shipped table's non-GEMM rows (module
    docstring: the sizes; backward rows as differences)."""
    from .presets import read_data_csv
    _, rows = read_data_csv(table)
    by_op: dict = {}
    for r in rows:
        by_op.setdefault(r["op"], {})[r["dims"]] = float(r["seconds"])
    return profile_points(by_op)


def profile_points(by_op: Mapping) -> dict:
    """``{profile: [(size, seconds)]}`` of measured rows ``{op: {dims: seconds}}`` (ops of
    :data:`~.kernel_profile.TABLE_OPS`; module docstring: the sizes, and each backward as
    its shape's forward + backward less its forward); profiles with fewer than two rows
    are left out."""

    def dims(text):
        return [int(x) for x in text.split("x")]

    def attn(dim):
        b, h, s, d = dims(dim)
        return attention_flops(Kernel.attention(b * h, s, s, d))

    def tokens_x(dim):
        t, w = dims(dim)
        return t * w

    def op(name):
        return by_op.get(name, {})

    out = {"attention": [(attn(d), t) for d, t in op("attn_fwd").items()],
           "attention_backward": [((_FWD_BWD_FLOPS - 1.0) * attn(d), t - op("attn_fwd")[d])
                                  for d, t in op("attn_fwd_bwd").items()
                                  if d in op("attn_fwd") and t > op("attn_fwd")[d]],
           "norm": [(tokens_x(d), t) for d, t in op("layernorm_fwd").items()],
           "norm_backward": [(tokens_x(d), t - op("layernorm_fwd")[d])
                             for d, t in op("layernorm_fwd_bwd").items()
                             if d in op("layernorm_fwd") and t > op("layernorm_fwd")[d]],
           "activation": [(tokens_x(d), t) for d, t in op("gelu_fwd").items()],
           "elementwise": [(3 * tokens_x(d), t) for d, t in op("add").items()],
           "cross_entropy": [(tokens_x(d), t) for d, t in op("cross_entropy_fwd_bwd").items()],
           "optimizer": [(dims(d)[0], t) for d, t in op("adamw_fused_step").items()]}
    return {k: v for k, v in out.items() if len(v) >= 2}


def kind_leave_one_out(points) -> list[float]:
    """Per row, predicted / measured − 1 of a LinearProfile fitted to the other rows."""
    points = list(points)
    return [LinearProfile.fit(points[:i] + points[i + 1:]).time_s(x) / t - 1.0
            for i, (x, t) in enumerate(points)]


def h100_kernel_profile() -> KernelProfile:
    """The in-stream profile of ``data/h100_kernels.csv`` (:meth:`KernelProfile.from_table`)."""
    return KernelProfile.from_table(H100_KERNEL_TABLE)


def h100_kernel_leave_one_out() -> dict:
    """Per profile of the H100 table: rows, median and worst |leave-one-out error|, and the
    fitted (lone-call) constants (JSON-ready)."""
    out = {}
    for name, points in table_rows(H100_KERNEL_TABLE).items():
        errors = [abs(e) for e in kind_leave_one_out(points)]
        p = LinearProfile.fit(points, PROFILE_UNITS[name])
        out[name] = {"rows": len(points), "median_abs_rel_error": statistics.median(errors),
                     "max_abs_rel_error": max(errors), "call_s": p.call_s, "unit_s": p.unit_s,
                     "unit": p.unit}
    return out
