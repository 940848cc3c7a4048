"""GEMM prices from measured kernels: a profile fitted to a table of timed GEMMs.

A :class:`GemmProfile` prices an m×k×n GEMM (A is m×k) as

    t(m, k, n) = call_s + 2·m'·k·n' / flops_per_s,    m' = ⌈m/128⌉·128, n' = ⌈n/128⌉·128

a fixed cost per call and the FLOPs of the output padded to whole 128×128 tiles at one
sustained rate. Both constants are fitted to a measured table by least squares on the
*relative* error (linear in ``call_s`` and ``1/flops_per_s``: minimise Σ (t̂_i / t_i − 1)²),
so small and large GEMMs weigh alike. The price is monotone in m, k and n by
construction.

The H100 preset is fitted to ``data/h100_kernels.csv`` (one H100 SXM, PyTorch 2.11 +
CUDA 13, cuBLAS bf16, each call timed alone: its header line is the source). Its 160 GEMM
rows give ``call_s`` ≈ 18 µs and ``flops_per_s`` ≈ 724 TFLOP/s (73% of the bf16 peak);
each row predicted by a profile fitted without it (:func:`leave_one_out`): median error
6.0%, 97.5% of rows within 20%, worst 23% (``vcluster validate-model`` prints it). The
form itself was chosen on the same table, among three by their leave-one-out errors
(local log-linear interpolation: 5.2% median but prices that fall as a dimension grows;
wave quantisation over 132 SMs: 6.5–9.7%), so these figures are not those of a table the
choice never saw.

What the constants mean, and what they do not: ``call_s`` is the cost of one call timed
alone — launch, the kernel's first wave and epilogue, and the timing's own overhead (the
table's smallest elementwise kernel, 12.6 MB of traffic that HBM moves in ~4 µs, takes
16.5 µs). In a training step the host queues kernels ahead of the device, so part of it
overlaps: the replay moves the profile into a stream (its fixed cost becomes the 5.30 µs
of a GEMM in a stream) and floors each kernel at the launch interval
(:mod:`.kernel_profiles`), on hardware that opts in to the table.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from types import MappingProxyType

from modeling.choices import MLPKind

__all__ = ["GemmProfile", "KernelTiming", "KERNEL_KINDS", "TABLE_OPS", "gemm_rows",
           "LAYER_STEP_KINDS", "LAYER_STEP_DTYPES", "LayerShape",
           "leave_one_out", "fit_call_and_rate", "TABLE_PRESETS",
           "h100_gemm_profile", "h100_gemm_leave_one_out", "TILE", "H100_KERNEL_TABLE"]

TILE = 128                                 # cuBLAS's output tile edge on Hopper and Ampere
H100_KERNEL_TABLE = "h100_kernels.csv"     # in vcluster/timing/data
#: the hardware preset whose GPU measured each shipped table (its header line: one
#: "NVIDIA H100 80GB HBM3 (SXM)", the H100-SXM5-80GB of ``h100-dgx``): a table priced on
#: another device is moved to it by datasheet ratios (:meth:`.kernel_profiles.KernelProfile.moved`)
TABLE_PRESETS = MappingProxyType({H100_KERNEL_TABLE: "h100-dgx"})


def _padded_flops(m: int, k: int, n: int) -> float:
    return 2.0 * math.ceil(m / TILE) * TILE * k * math.ceil(n / TILE) * TILE


def _check_dims(m, k, n) -> None:
    for name, v in (("m", m), ("k", k), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"GemmProfile: {name} must be an int >= 1, got {v!r}")


#: the kernels of a measured table beside GEMMs (``data/h100_kernels.csv``'s ``op`` column,
#: and ``vcluster hardware calibrate --gpu``'s rows), with how many ``x``-separated numbers
#: their ``dims`` hold: attention BxHxSxD (causal), layernorm/add TOKENSxH, gelu TOKENSxW,
#: cross-entropy TOKENSxVOCAB (forward + backward), AdamW's step over P parameters
TABLE_OPS = MappingProxyType({
    "attn_fwd": 4, "attn_fwd_bwd": 4, "layernorm_fwd": 2, "layernorm_fwd_bwd": 2,
    "gelu_fwd": 2, "add": 2, "cross_entropy_fwd_bwd": 2, "adamw_fused_step": 1})
#: one transformer layer's serving step, timed whole (``vcluster bench gpu-decode``), with how
#: many ``x``-separated numbers their ``dims`` hold: ``decode_layer`` BxC (B sequences of one
#: new token, each attending to C cached tokens), ``prefill_layer`` T (one causal prompt of
#: T tokens); the layer is the row's ``layer`` (:class:`LayerShape`)
LAYER_STEP_KINDS = MappingProxyType({"decode_layer": 2, "prefill_layer": 1})
#: the dtypes a layer step is measured in (bf16 on a GPU; fp32 on a CPU, whose bf16 is slow)
LAYER_STEP_DTYPES = ("bf16", "fp16", "fp32")
KERNEL_KINDS = ("gemm", "gemm_sustained", "elementwise", "launch", *TABLE_OPS,
                *LAYER_STEP_KINDS)
#: LayerShape's fields as a row's ``layer`` text names them, in order
_LAYER_KEYS = ("hidden", "heads", "kv_heads", "head_dim", "mlp", "ffn", "tp")


@dataclass(frozen=True)
class LayerShape:
    """The transformer layer a ``decode_layer`` / ``prefill_layer`` row timed: the model's
    width ``hidden`` h, its attention's ``heads``, ``kv_heads`` and ``head_dim``, its MLP's
    kind ``mlp`` (gelu, swiglu, geglu) and width ``ffn``, and the tensor-parallel degree
    ``tp`` whose one-GPU shard ran (heads/tp query heads, max(1, kv_heads/tp) KV heads,
    ffn/tp of the MLP; no communication). In a file it is one line (``str``)::

        hidden=4096 heads=32 kv_heads=8 head_dim=128 mlp=swiglu ffn=14336 tp=1
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: str
    ffn: int
    tp: int = 1

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LayerShape: {name} must be an int >= 1, got {v!r}")
        if self.mlp not in MLPKind.values():
            raise ValueError(f"LayerShape: mlp must be one of {', '.join(MLPKind.values())}, "
                             f"got {self.mlp!r}")

    def __str__(self) -> str:
        return " ".join(f"{k}={getattr(self, k)}" for k in _LAYER_KEYS)

    @classmethod
    def parse(cls, text: str) -> "LayerShape":
        """The shape ``str`` wrote (every key once, in any order); else ValueError naming
        the text and the form."""
        form = " ".join(f"{k}=..." for k in _LAYER_KEYS)
        pairs = [p.split("=", 1) for p in text.split()] if isinstance(text, str) else None
        if not pairs or any(len(p) != 2 for p in pairs) or \
                sorted(k for k, _ in pairs) != sorted(_LAYER_KEYS):
            raise ValueError(f"layer must be '{form}', got {text!r}")
        values = dict(pairs)
        try:
            return cls(**{k: v if k == "mlp" else int(v) for k, v in values.items()})
        except ValueError as exc:
            raise ValueError(f"layer {text!r}: {exc}") from None


@dataclass(frozen=True)
class KernelTiming:
    """One measured kernel, seconds per call in a stream of back-to-back calls:
    ``gemm`` (an m×k×n GEMM in ``dtype``), ``gemm_sustained`` (the same GEMM run back to
    back for seconds, at the device's power limit), ``elementwise`` (a copy moving ``bytes``,
    read plus written), ``launch`` (a one-element kernel: the launch interval), or one of
    :data:`TABLE_OPS` with its shape in ``dims`` (as the measured table writes it,
    e.g. ``"4x16x2048x128"``), or a whole layer's serving step of :data:`LAYER_STEP_KINDS`
    (``dims`` ``"BxC"`` or ``"T"``) of the :class:`LayerShape` written in ``layer``."""

    kind: str
    seconds: float
    m: int = 0
    k: int = 0
    n: int = 0
    bytes: int = 0
    dtype: str = ""
    dims: str = ""
    layer: str = ""

    def __post_init__(self):
        if self.kind not in KERNEL_KINDS:
            raise ValueError(f"kind must be one of {KERNEL_KINDS}, got {self.kind!r}")
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds must be a number > 0, got {self.seconds!r}")
        for name in ("m", "k", "n", "bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.kind in ("gemm", "gemm_sustained"):
            _check_dims(self.m, self.k, self.n)
        if self.kind == "elementwise" and self.bytes < 1:
            raise ValueError(f"an elementwise kernel moves bytes >= 1, got {self.bytes!r}")
        if not isinstance(self.dims, str):
            raise ValueError(f"dims must be a string like '4x16x2048x128', got {self.dims!r}")
        numbers = TABLE_OPS.get(self.kind) or LAYER_STEP_KINDS.get(self.kind)
        if numbers:
            parts = self.dims.split("x")
            if len(parts) != numbers or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"a {self.kind} kernel's dims are {numbers} "
                                 f"integers >= 1 joined by 'x', got {self.dims!r}")
        elif self.dims:
            raise ValueError(f"dims is for the kinds {', '.join(TABLE_OPS)}, "
                             f"{', '.join(LAYER_STEP_KINDS)}; a {self.kind} kernel has none, "
                             f"got {self.dims!r}")
        if self.kind in LAYER_STEP_KINDS:
            LayerShape.parse(self.layer)
            if self.dtype not in LAYER_STEP_DTYPES:
                raise ValueError(f"a {self.kind} row's dtype must be one of "
                                 f"{', '.join(LAYER_STEP_DTYPES)}, got {self.dtype!r}")
        elif self.layer:
            raise ValueError(f"layer is for the kinds {', '.join(LAYER_STEP_KINDS)}; a "
                             f"{self.kind} kernel has none, got {self.layer!r}")

    @classmethod
    def coerce(cls, row, where: str) -> "KernelTiming":
        """``row`` as a KernelTiming (a mapping from a YAML file, or one already)."""
        if isinstance(row, cls):
            return row
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a mapping of kind, seconds, ..., got {row!r}")
        unknown = set(row) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        try:
            return cls(**row)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class GemmProfile:
    """``t = call_s + padded FLOPs / flops_per_s`` (module docstring), fitted to ``rows``
    rows of ``source``."""

    call_s: float
    flops_per_s: float
    source: str = ""
    rows: int = 0

    def time_s(self, m: int, k: int, n: int, batch: int = 1) -> float:
        """Seconds of one m×k×n GEMM, or of one batched kernel of ``batch`` of them
        (one fixed cost, each member's output padded to whole tiles)."""
        _check_dims(m, k, n)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"GemmProfile: batch must be an int >= 1, got {batch!r}")
        return self.call_s + batch * _padded_flops(m, k, n) / self.flops_per_s

    @classmethod
    def fit(cls, rows, source: str = "", zero_call: bool = False) -> "GemmProfile":
        """Fit to ``rows`` of ``(m, k, n, seconds)`` (at least two of different sizes);
        ``zero_call``: see :func:`fit_call_and_rate`."""
        rows = [tuple(r) for r in rows]
        a, b = fit_call_and_rate([(_padded_flops(m, k, n), t) for m, k, n, t in rows],
                                 "GemmProfile.fit", "GEMMs", "FLOP", zero_call)
        return cls(call_s=a, flops_per_s=1.0 / b, source=source, rows=len(rows))


def fit_call_and_rate(points, who: str, what: str = "kernels", unit: str = "unit",
                      zero_call: bool = False):
    """``(a, b)`` of ``t = a + b·x`` over ``points`` of ``(x, t)`` (at least two of different
    sizes), least squares on the relative error: minimise Σ (a/t + b·x/t − 1)², the 2×2
    normal equations. Raises unless a >= 0 and b > 0 (a fixed cost and a rate) — except
    that with ``zero_call`` a negative ``a`` (rows timed in a stream, where the fixed cost
    is within the rows' noise) becomes the best pure rate, a = 0, b = Σ(x/t) / Σ(x/t)²."""
    points = [tuple(p) for p in points]
    if len(points) < 2:
        raise ValueError(f"{who}: needs at least 2 rows, got {len(points)}")
    u = [1.0 / t for _, t in points]
    v = [x / t for x, t in points]
    suu, suv, svv = sum(x * x for x in u), sum(x * y for x, y in zip(u, v)), \
        sum(y * y for y in v)
    su, sv = sum(u), sum(v)
    det = suu * svv - suv * suv
    if det <= 1e-12 * suu * svv:
        raise ValueError(f"{who}: the rows do not tell a fixed cost from a rate "
                         f"(give {what} of different sizes)")
    a, b = (su * svv - sv * suv) / det, (sv * suu - su * suv) / det
    if a < 0 and zero_call:
        a, b = 0.0, sv / svv
    if a < 0 or b <= 0:
        raise ValueError(f"{who}: the rows give an unphysical fit (call {a:.3g} s, "
                         f"{b:.3g} s per {unit})")
    return a, b


def gemm_rows(table: str = H100_KERNEL_TABLE) -> tuple[list[tuple[int, int, int, float]], str]:
    """``([(m, k, n, seconds)], source line)`` of the ``gemm`` rows of a shipped table."""
    from .presets import read_data_csv
    comments, rows = read_data_csv(table)
    out = []
    for r in rows:
        if r["op"] == "gemm":
            m, k, n = (int(x) for x in r["dims"].split("x"))
            out.append((m, k, n, float(r["seconds"])))
    return out, f"{table} ({' '.join(comments)})"


def leave_one_out(rows) -> list[float]:
    """Per row, predicted / measured - 1 of a profile fitted to the other rows."""
    rows = list(rows)
    out = []
    for i, (m, k, n, t) in enumerate(rows):
        profile = GemmProfile.fit(rows[:i] + rows[i + 1:])
        out.append(profile.time_s(m, k, n) / t - 1.0)
    return out


def h100_gemm_profile() -> GemmProfile:
    """The profile of every GEMM row of ``data/h100_kernels.csv``."""
    rows, source = gemm_rows(H100_KERNEL_TABLE)
    return GemmProfile.fit(rows, source)


def h100_gemm_leave_one_out() -> dict:
    """The H100 profile's leave-one-out errors, summarised (JSON-ready)."""
    rows, source = gemm_rows(H100_KERNEL_TABLE)
    errors = [abs(e) for e in leave_one_out(rows)]
    profile = GemmProfile.fit(rows, source)
    return {"table": H100_KERNEL_TABLE, "rows": len(rows),
            "median_abs_rel_error": statistics.median(errors),
            "within_20_percent": sum(e <= 0.2 for e in errors) / len(errors),
            "max_abs_rel_error": max(errors),
            "call_s": profile.call_s, "flops_per_s": profile.flops_per_s}
