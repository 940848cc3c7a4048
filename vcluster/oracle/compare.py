"""``compare(actual_by_rank, golden)``: which rank, tensor and element differ, by how much.

An element passes when ``|actual - expected| <= atol + rtol * |expected|`` (numpy's
``isclose``), with the tensor's tolerance from the golden manifest; integers, booleans
and data that no reduction touched use ``rtol = atol = 0`` (exact). NaN equals NaN.
For each failing (rank, tensor) the report gives the element with the largest
``|actual - expected| - rtol * |expected|`` overshoot: its index, both values, the
absolute error, the relative error ``|a - e| / |e|`` and the distance in ulps — the
number of representable floats of the dtype between the two values (0 when equal,
1 for neighbours), counted on the integer line that orders IEEE floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Mismatch", "Comparison", "OracleMismatch", "compare", "ulps_between",
           "default_tolerance"]

_RTOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-10, "complex64": 1e-5,
         "complex128": 1e-10}


def default_tolerance(x) -> dict:
    """``{"rtol", "atol"}`` for a golden array: exact for integers and booleans; for
    floats rtol by dtype (float16 1e-2, float32 1e-5, float64 1e-10) and
    ``atol = rtol * max|x|`` (sums round relative to their largest terms, not to each
    element)."""
    a = np.asarray(x)
    rtol = _RTOL.get(a.dtype.name, 0.0)
    scale = float(np.max(np.abs(a))) if rtol and a.size else 0.0
    return {"rtol": rtol, "atol": rtol * (scale if np.isfinite(scale) else 0.0)}


def ulps_between(a: float, b: float, dtype) -> int | None:
    """Representable ``dtype`` floats between a and b (None for non-real-float dtypes)."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        return None
    ints = np.dtype(f"i{dtype.itemsize}")

    def line(v) -> int:
        i = int(np.array(v, dtype).view(ints))
        return i if i >= 0 else -(i & ((1 << (8 * dtype.itemsize - 1)) - 1))
    if np.isnan(a) or np.isnan(b):
        return 0 if np.isnan(a) and np.isnan(b) else None
    return abs(line(a) - line(b))


@dataclass(frozen=True)
class Mismatch:
    """One (rank, tensor) that differs; ``index`` is its worst element (None: the
    tensor is missing or has another shape or dtype, see ``reason``)."""

    rank: int
    tensor: str
    index: tuple | None
    actual: object = None
    expected: object = None
    abs_error: float | None = None
    rel_error: float | None = None
    ulps: int | None = None
    bad_elements: int = 0
    size: int = 0
    rtol: float = 0.0
    atol: float = 0.0
    reason: str = ""

    def __str__(self) -> str:
        if self.index is None:
            return f"rank {self.rank}, tensor {self.tensor!r}: {self.reason}"
        ulps = "" if self.ulps is None else f", {self.ulps} ulps"
        return (f"rank {self.rank}, tensor {self.tensor!r}, index {self.index}: actual "
                f"{self.actual!r}, expected {self.expected!r} (abs error {self.abs_error:.3g}, "
                f"rel error {self.rel_error:.3g}{ulps}; {self.bad_elements} of {self.size} "
                f"elements outside rtol={self.rtol:g}, atol={self.atol:.3g})")


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: ``ok`` when nothing differs."""

    mismatches: tuple[Mismatch, ...]
    checked: int                      # (rank, tensor) pairs compared

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"all {self.checked} (rank, tensor) pairs match the golden"
        lines = [f"{len(self.mismatches)} of {self.checked} (rank, tensor) pairs differ "
                 "from the golden:"] + [f"  {m}" for m in self.mismatches[:50]]
        if len(self.mismatches) > 50:
            lines.append(f"  ... and {len(self.mismatches) - 50} more")
        return "\n".join(lines)

    def raise_if_mismatch(self) -> None:
        if not self.ok:
            raise OracleMismatch(self)


class OracleMismatch(AssertionError):
    """Results differ from a golden; ``.comparison`` has every :class:`Mismatch`."""

    def __init__(self, comparison: Comparison):
        self.comparison = comparison
        super().__init__(str(comparison))


def _scalar(v):
    return v.item() if hasattr(v, "item") else v


def compare_array(rank: int, name: str, actual, expected, tol: dict) -> Mismatch | None:
    """None when ``actual`` matches ``expected`` within ``tol``, else the Mismatch."""
    expected = np.asarray(expected)
    if actual is None:
        return Mismatch(rank, name, None, reason="missing from the actual results")
    actual = np.asarray(actual)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Mismatch(rank, name, None, reason=f"actual {actual.dtype}{list(actual.shape)} "
                        f"!= expected {expected.dtype}{list(expected.shape)}")
    rtol, atol = float(tol.get("rtol", 0.0)), float(tol.get("atol", 0.0))
    if expected.dtype.kind in "fc":
        ok = np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    else:
        ok = actual == expected
    if bool(np.all(ok)):
        return None
    with np.errstate(all="ignore"):
        diff = np.abs(actual.astype(np.complex128 if expected.dtype.kind == "c" else np.float64)
                      - expected)
        excess = np.where(ok, -np.inf, np.nan_to_num(diff - rtol * np.abs(expected), nan=np.inf))
    flat = int(np.argmax(excess))
    index = tuple(int(i) for i in np.unravel_index(flat, expected.shape))
    a, e = _scalar(actual.reshape(-1)[flat]), _scalar(expected.reshape(-1)[flat])
    abs_err = float(diff.reshape(-1)[flat])
    rel_err = abs_err / abs(e) if e != 0 else float("inf") if abs_err else 0.0
    return Mismatch(rank, name, index, a, e, abs_err, rel_err,
                    ulps_between(a, e, expected.dtype), int(np.size(ok) - np.count_nonzero(ok)),
                    int(expected.size), rtol, atol)


def compare(actual_by_rank, golden, tensors=None) -> Comparison:
    """Compare per-rank results with a golden (a :class:`~vcluster.oracle.Golden` or the
    path of its directory).

    ``actual_by_rank[r]`` maps tensor names to arrays (names as in the golden's outputs
    and gradients; extra names are ignored), or is what the program returned on rank r
    (flattened as :func:`~vcluster.oracle.capture.flatten_results` names it). ``tensors`` restricts the comparison to
    those names. Returns a :class:`Comparison` (falsy on mismatch; ``str`` lists every
    differing rank, tensor and element; ``raise_if_mismatch()`` raises
    :class:`OracleMismatch`).
    """
    from .capture import flatten_results
    from .golden import Golden, load_golden
    if not isinstance(golden, Golden):
        golden = load_golden(golden)
    if len(actual_by_rank) != golden.size:
        raise ValueError(f"compare: actual_by_rank has {len(actual_by_rank)} ranks, the golden "
                         f"has {golden.size} (mesh {golden.manifest['mesh']})")
    mismatches, checked = [], 0
    for r in range(golden.size):
        expected = golden.results(r)
        got = flatten_results(actual_by_rank[r]) if actual_by_rank[r] is not None else {}
        for name, want in expected.items():
            if tensors is not None and name not in tensors:
                continue
            checked += 1
            m = compare_array(r, name, got.get(name), want, golden.tolerance(name))
            if m is not None:
                mismatches.append(m)
    return Comparison(tuple(mismatches), checked)
