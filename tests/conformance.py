"""Engine-independent conformance suite for the collective and point-to-point API.

Every check here takes a ``cluster`` -- anything with ``cluster.run(fn, args_per_rank)``
that calls ``fn(dev, *args_per_rank[r])`` on every rank r of ``mesh`` and returns the
list of results -- and compares what the devices computed with a reference computed on
the host with plain numpy (``np.concatenate`` / ``np.split`` / a reduction folded in
group order), never with the engine under test. The device programs use only the
``DeviceContext`` API (``dev.all_reduce`` ... ``dev.empty``, ``dev.xp``), so the
emulator and later engines (e.g. one over torch.distributed) can share this file; the
only engine-specific choices -- which algorithms exist, which of them must be bit-exact --
are parameters that the test module passes in.

Structure, in the spirit of mpi4py's test-suite (one test body run over many
communicators):

* a :class:`Case` describes one collective call: collective, group (``axis``),
  algorithm, dtype, per-rank input shape, keyword arguments (op, dim, root, ...), how
  the result is delivered (``out=`` mode) and whether a reduction must be bit-exact;
* :func:`enumerate_cases` (alias ``CASES``) builds the cross product that a test wants,
  pairing secondary parameters (roots, dims) cyclically instead of multiplying them out,
  and optionally rotating axes, shapes and ops;
* :func:`check_cases` runs a whole batch in ONE ``cluster.run`` (sync, async with a
  per-rank wait order, or mixed), then checks every rank's result against
  :func:`reference` and raises one AssertionError that lists every failing case;
* ``check_<collective>(cluster, mesh, axis, algorithm, dtype, shape, **kwargs)`` check a
  single call; ``check_p2p``, ``check_barrier``, ``check_errors``, ... cover the rest.

Comparison rules: data-movement collectives (gather, scatter, broadcast, all_to_all,
...) and integer reductions must match exactly; float reductions match with
``assert_allclose(rtol=1e-6 | 1e-12, atol=rtol * n * scale)`` where ``scale`` is the
larger of max|reference| and max|inputs| (the rounding error of a sum of n terms is
bounded by n eps sum|x_i|); a Case with ``exact=True`` must equal the reduction folded in
group order, ``((x0 op x1) op x2) ...``, bit for bit (real dtypes). Every member of an
all_reduce group must hold bit-identical results whatever the algorithm. Results must have the
reference's shape and dtype, and ``out=`` calls must return the ``out`` object itself.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

__all__ = [
    "COLLECTIVES", "REDUCTIONS", "ROOTED", "OPS", "DTYPES", "SHAPES", "OUT_MODES",
    "Case", "enumerate_cases", "CASES", "axis_choices", "group_size", "make_inputs",
    "reference", "check_cases", "run_cases_program",
    "check_all_reduce", "check_all_gather", "check_reduce_scatter", "check_all_to_all",
    "check_broadcast", "check_scatter", "check_gather", "check_reduce", "check_barrier",
    "check_reproducible", "check_hierarchical_all_reduce", "check_p2p",
    "check_p2p_same_tag_fifo", "check_irecv_post_order",
    "check_p2p_pending_across_collectives", "check_errors", "check_run_raises",
    "error_cases", "LAYOUTS", "INPLACE_COLLECTIVES", "make_case",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "scatter", "gather", "reduce", "barrier")
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "scatter", "gather", "reduce")
OPS = ("sum", "prod", "max", "min", "avg")
DTYPES = ("float32", "float64", "int64")
OUT_MODES = ("none", "numpy", "empty", "strided", "inplace")
LAYOUTS = ("plain", "empty", "strided")
INPLACE_COLLECTIVES = ("all_reduce", "broadcast", "reduce")   # result shape == input shape

#: Named per-rank input shapes. Collectives that split a dimension round it up to a
#: multiple of the group size (see :func:`fit_shape`).
SHAPES = {
    "scalar": (),            # 0-d: all_reduce, reduce, broadcast only
    "one": (1,),             # fewer elements than members
    "odd": (5,),
    "2d": (3, 7),
    "3d": (2, 3, 5),
    "empty": (0, 3),         # zero-size
    "medium": (33, 17),      # past any small-message inline path, below 64 KiB in f64
    "large": (40000,),       # 320 KB in float64: arena / rendezvous paths
}

_RTOL = {np.dtype("float16"): 1e-2, np.dtype("float32"): 1e-6, np.dtype("float64"): 1e-12,
         np.dtype("complex64"): 1e-6, np.dtype("complex128"): 1e-12}
_FILL = 77                  # what out= buffers hold before the call


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One collective call, issued by every rank of the mesh over its group."""

    collective: str
    axis: object = None                 # None, a name, or a tuple of names
    algorithm: str = "auto"
    dtype: str = "float64"
    shape: tuple = (5,)                 # per-rank input shape (already fitted)
    kwargs: tuple = ()                  # sorted (name, value) pairs: op, dim, root, ...
    out: str = "none"                   # none | numpy | empty | strided | inplace
    exact: bool = False                 # reductions: bit-exact group-order result
    values: str = "normal"              # normal | wide (mixed magnitudes)
    layout: str = "plain"               # input as passed | copied to dev.empty | strided view

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {self.collective!r}")
        if self.out not in OUT_MODES:
            raise ValueError(f"unknown out mode {self.out!r}")
        if self.out == "inplace" and self.collective not in INPLACE_COLLECTIVES:
            raise ValueError(f"{self.collective} has no in-place form")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}")

    @property
    def kw(self) -> dict:
        return dict(self.kwargs)

    def label(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        extra = "" if self.out == "none" else f", out={self.out}"
        extra += "" if self.layout == "plain" else f", input={self.layout}"
        return (f"{self.collective}(axis={self.axis!r}, {self.dtype}{list(self.shape)}"
                f"{', ' + args if args else ''}, algorithm={self.algorithm}{extra})")

    def spec(self) -> tuple:
        """What the device program needs, as plain builtins (no import of this module)."""
        return (self.collective, self.axis, self.algorithm, self.dtype, self.kw, self.out,
                self.layout)


def make_case(collective, axis=None, algorithm="auto", dtype="float64", shape=(5,),
              out="none", exact=False, values="normal", layout="plain", **kwargs) -> Case:
    return Case(collective, axis, algorithm, str(np.dtype(dtype)), tuple(shape),
                tuple(sorted(kwargs.items())), out, exact, values, layout)


def axis_choices(mesh) -> list:
    """None plus every ordered subset of the mesh's axes (a name when it has one axis)."""
    out: list = [None]
    for k in range(len(mesh.axes) + 1):
        for combo in itertools.permutations(mesh.axes, k):
            out.append(combo[0] if k == 1 else combo)
    return out


def group_size(mesh, axis) -> int:
    return len(mesh.group(axis, 0))


def roots_for(n: int) -> list[int]:
    """Every root of a small group; first, middle and last of a larger one."""
    return list(range(n)) if n <= 4 else sorted({0, n // 2, n - 1})


def dims_for(ndim: int) -> list[int]:
    return {0: [], 1: [0], 2: [0, 1], 3: [0, -2, -1]}.get(ndim, [0, -1])


def dim_pairs_for(ndim: int) -> list[tuple[int, int]]:
    """(split_dim, concat_dim) pairs of all_to_all."""
    return {0: [], 1: [(0, 0)], 2: [(0, 0), (0, 1), (1, 0), (1, 1)],
            3: [(0, 2), (1, 0), (-1, 1), (2, 2)]}.get(ndim, [(0, 0)])


def fit_shape(shape: tuple, dim: int, n: int) -> tuple:
    """``shape`` with ``shape[dim]`` rounded up to a multiple of n (0 stays 0)."""
    shape = list(shape)
    d = dim % len(shape)
    shape[d] = -(-shape[d] // n) * n
    return tuple(shape)


def _zip_cycle(a: list, b: list) -> list[tuple]:
    """Pairs (a[i % len a], b[i % len b]) until both lists are used up: every value of
    each appears at least once, without the cross product."""
    if not a or not b:
        return []
    return [(a[i % len(a)], b[i % len(b)]) for i in range(max(len(a), len(b)))]


def _variants(collective: str, shape: tuple, n: int, ops) -> list:
    """(input shape, kwargs) of one collective for one base shape and group size:
    every op, every root (:func:`roots_for`) and every dim (:func:`dims_for`) once."""
    ndim, roots, dims = len(shape), roots_for(n), dims_for(len(shape))
    if collective == "all_reduce":
        return [(shape, {"op": op}) for op in ops]
    if collective == "reduce":
        return [(shape, {"op": op, "root": r}) for op, r in _zip_cycle(list(ops), roots)]
    if collective == "broadcast":
        return [(shape, {"root": r}) for r in roots]
    if collective == "all_gather":
        return [(shape, {"dim": d}) for d in dims]
    if collective == "gather":
        return [(shape, {"dim": d, "root": r}) for d, r in _zip_cycle(dims, roots)]
    if collective == "scatter":
        return [(fit_shape(shape, d, n), {"dim": d, "root": r})
                for d, r in _zip_cycle(dims, roots)]
    if collective == "reduce_scatter":
        return [(fit_shape(shape, d, n), {"dim": d, "op": op})
                for d, op in _zip_cycle(dims, list(ops))]
    if collective == "all_to_all":
        return [(fit_shape(shape, s, n), {"split_dim": s, "concat_dim": c})
                for s, c in dim_pairs_for(ndim)]
    return []


def enumerate_cases(mesh, collective: str, axes=(None,), algorithms=("auto",),
                    dtypes=DTYPES, shapes=tuple(SHAPES), ops=OPS, out="none",
                    exact_algorithms=(), rotate_axes=False, rotate_shapes=False,
                    rotate_ops=False, values="normal", layout="plain") -> list[Case]:
    """Cases of one collective: algorithms x dtypes x shapes x ops (with every root and
    dim per shape, see :func:`_variants`).

    ``axes``: the groups to use; every case runs over each of them, or over one of them
    in turn with ``rotate_axes``. ``shapes``: names from :data:`SHAPES` (or tuples);
    ``rotate_shapes`` uses one per (axis, algorithm, dtype) in turn instead of all, and
    ``rotate_ops`` one op per shape in turn.
    ``avg`` is skipped for integer dtypes (it must raise, see :func:`error_cases`).
    ``exact_algorithms``: algorithms whose reductions must be bit-exact in group order.
    ``out``, ``values``, ``layout``: see :class:`Case`.
    """
    op_counter = itertools.count()
    shape_list = [SHAPES.get(s, s) if isinstance(s, str) else tuple(s) for s in shapes]
    cases: list[Case] = []
    axis_cycle = itertools.cycle(axes)
    shape_cycle = itertools.cycle(shape_list)
    axis_loop = [None] if rotate_axes else list(axes)
    for axis_slot in axis_loop:
        for algorithm in algorithms:
            if collective == "barrier":
                axis = next(axis_cycle) if rotate_axes else axis_slot
                cases.append(make_case("barrier", axis, algorithm, "float64", ()))
                continue
            for dtype in dtypes:
                kinds = [next(shape_cycle)] if rotate_shapes else shape_list
                for shape in kinds:
                    axis = next(axis_cycle) if rotate_axes else axis_slot
                    n = group_size(mesh, axis)
                    exact_type = not np.issubdtype(np.dtype(dtype), np.inexact)
                    use_ops = [o for o in ops if not (exact_type and o == "avg")]
                    if rotate_ops:
                        use_ops = [use_ops[next(op_counter) % len(use_ops)]]
                    for in_shape, kw in _variants(collective, shape, n, use_ops):
                        cases.append(make_case(
                            collective, axis, algorithm, dtype, in_shape, out=out,
                            exact=algorithm in exact_algorithms, values=values,
                            layout=layout, **kw))
    return cases


CASES = enumerate_cases


# ------------------------------------------------------------------- inputs, reference
def _values(rng, dtype: np.dtype, shape: tuple, op: str | None, kind: str) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        if op == "prod":
            v = rng.integers(-3, 4, shape)            # |prod| <= 3**8 for 8 members
        elif op in ("max", "min"):
            v = rng.integers(-5, 6, shape)            # many ties
        else:
            v = rng.integers(-1000, 1001, shape)
        return np.asarray(v, dtype)
    if np.issubdtype(dtype, np.complexfloating):
        scale = 0.7 if op == "prod" else 1.0
        v = scale * (rng.standard_normal(shape) + 1j * rng.standard_normal(shape))
    elif op == "prod":
        v = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
    elif kind == "wide":                               # rounding depends on the order
        v = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)
    else:
        v = rng.standard_normal(shape)
    return np.asarray(v, dtype)


def make_inputs(case: Case, mesh, seed: int = 0) -> list:
    """Per-rank inputs of ``case``: arrays, or None on non-roots of broadcast/scatter."""
    if case.collective == "barrier":
        return [None] * mesh.size
    kw, dtype = case.kw, np.dtype(case.dtype)
    xs = []
    for r in range(mesh.size):
        rng = np.random.default_rng([seed, r])
        pos = mesh.group_position(case.axis, r)
        if case.collective in ("broadcast", "scatter") and pos != kw.get("root", 0):
            xs.append(None)
        else:
            xs.append(_values(rng, dtype, case.shape, kw.get("op"), case.values))
    return xs


def _fold(arrays: list, op: str) -> np.ndarray:
    """((a0 op a1) op a2) ... in list order, in the arrays' dtype; avg divides by n."""
    uf = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}[op]
    acc = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        acc = np.asarray(uf(acc, a))
    if op == "avg":
        acc = np.asarray(acc / len(arrays))
    return acc.astype(arrays[0].dtype, copy=False)


def reference(case: Case, mesh, xs: list) -> list:
    """What every rank must get back, computed on the host from the inputs ``xs``."""
    kw = case.kw
    res: list = [None] * mesh.size
    if case.collective == "barrier":
        return res
    root = kw.get("root", 0)
    for group in mesh.groups(case.axis):
        n = len(group)
        ins = [xs[m] for m in group]
        c = case.collective
        if c in REDUCTIONS:
            total = _fold(ins, kw.get("op", "sum"))
        for p, r in enumerate(group):
            if c == "all_reduce":
                res[r] = total
            elif c == "reduce":
                res[r] = total if p == root else None
            elif c == "reduce_scatter":
                res[r] = np.split(total, n, axis=kw.get("dim", 0))[p]
            elif c == "all_gather":
                res[r] = np.concatenate(ins, axis=kw.get("dim", 0))
            elif c == "gather":
                res[r] = np.concatenate(ins, axis=kw.get("dim", 0)) if p == root else None
            elif c == "broadcast":
                res[r] = ins[root].copy()
            elif c == "scatter":
                res[r] = np.split(ins[root], n, axis=kw.get("dim", 0))[p]
            elif c == "all_to_all":
                res[r] = np.concatenate(
                    [np.split(x, n, axis=kw.get("split_dim", 0))[p] for x in ins],
                    axis=kw.get("concat_dim", 0))
    return res


# ------------------------------------------------------------------ device programs
def _strided(xp, shape, dtype):
    """A non-contiguous view of ``shape`` (every other element of rows padded by one),
    which numpy cannot flatten without a copy when it has two or more dimensions."""
    if len(shape) == 0:
        return xp.empty(2, dtype)[1:].reshape(())
    buf = xp.empty(tuple(shape[:-1]) + (2 * shape[-1] + 1,), dtype)
    buf[...] = _FILL
    return buf[..., 1::2]


def _issue(dev, spec, x, out_shape, async_op: bool):
    """Issue one collective from its spec; returns (result or handle, out buffer)."""
    collective, axis, algorithm, dtype, kw, out_mode, layout = spec
    kw = dict(kw)
    if algorithm != "auto":
        kw["algorithm"] = algorithm
    if async_op:
        kw["async_op"] = True
    fn = getattr(dev, collective)
    if collective == "barrier":
        return fn(axis, **kw), None
    out = None
    if x is not None and layout == "empty":         # resident: zero-copy paths
        buf = dev.empty(x.shape, x.dtype)
        buf[...] = x
        x = buf
    elif x is not None and layout == "strided":
        view = _strided(dev.xp, x.shape, x.dtype)
        view[...] = x
        x = view
    if out_mode == "inplace":
        if x is None:                       # a non-root of an in-place broadcast
            x = dev.empty(out_shape, dtype)
            x[...] = _FILL
        else:
            buf = dev.empty(x.shape, x.dtype)
            buf[...] = x
            x = buf
        out = x if out_shape is not None else None
    elif out_mode == "strided" and out_shape is not None:
        out = _strided(dev.xp, out_shape, dtype)
        out[...] = _FILL
    elif out_mode != "none" and out_shape is not None:
        out = dev.empty(out_shape, dtype) if out_mode == "empty" else \
            dev.xp.empty(out_shape, dtype)
        out[...] = _FILL
    if out is not None:
        kw["out"] = out
    return fn(x, axis, **kw), out


def run_cases_program(dev, specs, inputs, out_shapes, wait_order, p2p=None):
    """Device program: issue every case; return [(result, returned_out_object), ...].

    ``wait_order`` None: blocking calls. Else a permutation: every case with
    ``wait_order`` containing it is issued with ``async_op=True`` (all in flight), the
    others blocking in issue order; handles are waited in ``wait_order``.
    ``p2p`` = (sends, receives): exchanged after issuing, before waiting, so that
    point-to-point traffic overlaps the queued collectives; then appended to the result.
    """
    results = [None] * len(specs)
    handles = {}
    asynchronous = set(wait_order or ())
    for i, (spec, x, shape) in enumerate(zip(specs, inputs, out_shapes)):
        value, out = _issue(dev, spec, x, shape, i in asynchronous)
        if i in asynchronous:
            handles[i] = (value, out)
        else:
            results[i] = (value, out is None or value is out)
    received = None
    if p2p is not None:
        sends, recvs = p2p
        for to, tag, x in sends:
            dev.send(x, to, tag)
        received = [dev.recv(src, tag) for src, tag in recvs]
    for i in wait_order or ():
        handle, out = handles[i]
        value = handle.wait()
        results[i] = (value, out is None or value is out)
    return results if p2p is None else results + [received]


# ------------------------------------------------------------------------- checking
def _compare(got, want, exact: bool, n: int, scale: float) -> str | None:
    """None when ``got`` matches ``want``, else a one-line reason."""
    if want is None:
        return None if got is None else f"expected None, got {type(got).__name__}"
    if got is None:
        return f"got None, expected an array of shape {want.shape}"
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != expected {want.dtype}"
    if exact:
        if got.tobytes() != want.tobytes():
            diff = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
            return (f"not bit-identical to the reference ({diff.size} of {want.size} "
                    f"elements differ, first at flat index {diff[:1].tolist()}: "
                    f"{got.reshape(-1)[diff[:1]]} != {want.reshape(-1)[diff[:1]]})")
        return None
    rtol = _RTOL[want.dtype]
    try:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * n * scale)
    except AssertionError as exc:
        return " ".join(str(exc).split())[:400]
    return None


def _check_batch(cases, mesh, xs_all, refs, results) -> list[str]:
    failures = []
    for i, case in enumerate(cases):
        xs, ref = xs_all[i], refs[i]
        dtype = np.dtype(case.dtype)
        float_reduction = (case.collective in REDUCTIONS
                           and np.issubdtype(dtype, np.inexact))
        # complex products round differently in numpy's SIMD and scalar kernels (FMA),
        # so bit-exactness is only defined for real dtypes
        exact = (case.exact and not np.issubdtype(dtype, np.complexfloating)) \
            or not float_reduction
        groups = mesh.groups(case.axis) if case.collective != "barrier" else []
        for group in groups:
            n = len(group)
            scale = 0.0
            for a in [xs[m] for m in group] + [ref[m] for m in group]:
                if a is not None and a.size:
                    scale = max(scale, float(np.max(np.abs(a))))
            for r in group:
                got, is_out = results[r][i]
                why = _compare(got, ref[r], exact, n, scale)
                if why is None and not is_out:
                    why = "returned a different object than the out= buffer"
                if why:
                    failures.append(f"case #{i} {case.label()} rank {r}: {why}")
            if case.collective == "all_reduce":
                first = np.asarray(results[group[0]][i][0])
                if any(np.asarray(results[r][i][0]).tobytes() != first.tobytes()
                       for r in group[1:]):
                    failures.append(f"case #{i} {case.label()} group {group}: members "
                                    "hold different results")
        if case.collective == "barrier":
            bad = [r for r in range(mesh.size) if results[r][i][0] is not None]
            if bad:
                failures.append(f"case #{i} {case.label()}: ranks {bad} returned "
                                "something else than None")
    return failures


def _raise_failures(failures: list[str], total: int) -> None:
    if failures:
        shown = "\n  ".join(failures[:25])
        more = f"\n  ... and {len(failures) - 25} more" if len(failures) > 25 else ""
        raise AssertionError(f"{len(failures)} mismatches in {total} cases:\n  {shown}{more}")


def check_cases(cluster, mesh, cases: list[Case], mode: str = "sync", seed: int = 0,
                overlap_p2p: bool = False) -> list:
    """Run ``cases`` in one ``cluster.run`` and check every rank's result.

    ``mode``: ``sync`` (blocking calls), ``async`` (every call ``async_op=True``, all in
    flight, each rank waiting in its own random order) or ``mixed`` (every other call
    asynchronous, the blocking ones queued behind them). ``overlap_p2p``: while the
    asynchronous calls are in flight every rank exchanges messages with every other
    rank (checked too). Returns the raw per-rank results.
    """
    if mode not in ("sync", "async", "mixed"):
        raise ValueError(f"mode must be sync, async or mixed, got {mode!r}")
    xs_all = [make_inputs(c, mesh, seed * 100003 + i) for i, c in enumerate(cases)]
    refs = [reference(c, mesh, xs) for c, xs in zip(cases, xs_all)]
    specs = [c.spec() for c in cases]
    args = []
    for r in range(mesh.size):
        inputs = [xs[r] for xs in xs_all]
        shapes = [None if ref[r] is None else ref[r].shape for ref in refs]
        if mode == "sync":
            order = None
        else:
            chosen = range(len(cases)) if mode == "async" else range(0, len(cases), 2)
            order = [int(i) for i in np.random.default_rng([seed, r, 7]).permutation(
                np.array(list(chosen), dtype=np.int64))]
        p2p = None
        if overlap_p2p:
            peers = [p for p in range(mesh.size) if p != r]
            p2p = ([(to, t, _payload(r, to, t, P2P_KINDS)) for to in peers for t in (2, 1)],
                   [(src, t) for src in reversed(peers) for t in (1, 2)])
        args.append((specs, inputs, shapes, order, p2p))
    results = cluster.run(run_cases_program, args)
    failures = _check_batch(cases, mesh, xs_all, refs, results)
    for r in range(mesh.size):
        for (src, t), got in zip(args[r][4][1] if overlap_p2p else (), results[r][-1]):
            if why := _compare(got, _payload(src, r, t, P2P_KINDS), True, 1, 0.0):
                failures.append(f"rank {r}: message from {src} tag {t} during the "
                                f"collectives: {why}")
    _raise_failures(failures, len(cases))
    return results


def _single(collective):
    def check(cluster, mesh, axis=None, algorithm="auto", dtype="float64", shape=(5,),
              out="none", exact=False, async_op=False, **kwargs):
        case = make_case(collective, axis, algorithm, dtype, shape, out=out, exact=exact,
                         **kwargs)
        return check_cases(cluster, mesh, [case], "async" if async_op else "sync")
    check.__name__ = f"check_{collective}"
    check.__doc__ = (f"Check one ``{collective}`` call over ``axis`` against numpy "
                     "(kwargs: op, dim, root, split_dim, concat_dim as the call takes).")
    return check


check_all_reduce = _single("all_reduce")
check_all_gather = _single("all_gather")
check_reduce_scatter = _single("reduce_scatter")
check_all_to_all = _single("all_to_all")
check_broadcast = _single("broadcast")
check_scatter = _single("scatter")
check_gather = _single("gather")
check_reduce = _single("reduce")


def check_reproducible(cluster, mesh, cases: list[Case], seed: int = 0) -> None:
    """The same batch run twice gives bit-for-bit identical results on every rank."""
    first = check_cases(cluster, mesh, cases, seed=seed)
    second = check_cases(cluster, mesh, cases, seed=seed)
    failures = []
    for i, case in enumerate(cases):
        for r in range(mesh.size):
            a, b = first[r][i][0], second[r][i][0]
            if (a is None) != (b is None) or (
                    a is not None and np.asarray(a).tobytes() != np.asarray(b).tobytes()):
                failures.append(f"case #{i} {case.label()} rank {r}: differs between runs")
    _raise_failures(failures, len(cases))


# ----------------------------------------------------------------------------- barrier
def _barrier_program(dev, axes, delays, algorithm, async_op):
    times = []
    for axis, delay in zip(axes, delays):
        time.sleep(delay)
        before = time.monotonic()
        kw = {} if algorithm == "auto" else {"algorithm": algorithm}
        if async_op:
            res = dev.barrier(axis, async_op=True, **kw).wait()
        else:
            res = dev.barrier(axis, **kw)
        times.append((before, time.monotonic(), res))
    return times


def check_barrier(cluster, mesh, axes, algorithm="auto", async_op=False,
                  delay_s: float = 0.02) -> None:
    """No member leaves a barrier before the last one (delayed on purpose) arrives.

    Uses ``time.monotonic()``, which is one clock for all processes of one machine.
    """
    axes = list(axes)
    delays = [[delay_s if mesh.group_position(a, r) == group_size(mesh, a) - 1 else 0.0
               for a in axes] for r in range(mesh.size)]
    res = cluster.run(_barrier_program,
                      [(axes, delays[r], algorithm, async_op) for r in range(mesh.size)])
    failures = []
    for i, axis in enumerate(axes):
        for group in mesh.groups(axis):
            last_arrival = max(res[r][i][0] for r in group)
            first_exit = min(res[r][i][1] for r in group)
            if len(group) > 1 and first_exit < last_arrival:
                failures.append(f"barrier(axis={axis!r}) group {group}: a member left "
                                f"{last_arrival - first_exit:.4f} s before the last arrived")
            if any(res[r][i][2] is not None for r in group):
                failures.append(f"barrier(axis={axis!r}) returned something else than None")
    _raise_failures(failures, len(axes))


# ------------------------------------------------------------- chained collectives
def _chained_program(dev, x, axes, algorithm):
    kw = {} if algorithm == "auto" else {"algorithm": algorithm}
    for axis in axes:
        x = dev.all_reduce(x, axis, **kw)
    return x


def check_hierarchical_all_reduce(cluster, mesh, axes, algorithm="auto",
                                  dtype="float64", shape=(6, 5), seed=0) -> None:
    """all_reduce over each of ``axes`` in turn (disjoint groups) == one over their union
    (e.g. over "tp" then over "dp" == over everything)."""
    xs = [_values(np.random.default_rng([seed, r]), np.dtype(dtype), shape, "sum", "normal")
          for r in range(mesh.size)]
    res = cluster.run(_chained_program, [(xs[r], list(axes), algorithm)
                                         for r in range(mesh.size)])
    union = tuple(a for a in mesh.axes if any(a in mesh.axis_tuple(b) for b in axes))
    case = make_case("all_reduce", union, dtype=dtype, shape=shape, op="sum")
    ref = reference(case, mesh, xs)
    exact = np.issubdtype(np.dtype(dtype), np.integer)
    scale = float(np.max(np.abs(ref[0]))) if ref[0].size else 0.0
    failures = [f"rank {r}: {why}" for r in range(mesh.size)
                if (why := _compare(res[r], ref[r], exact, mesh.size, scale))]
    _raise_failures(failures, 1)


# ---------------------------------------------------------------------- point to point
def _payload(src: int, dst: int, tag: int, kinds) -> np.ndarray:
    """A distinct array for message (src, dst, tag), cycling through shapes and dtypes."""
    shape, dtype = kinds[(src * 7 + dst * 3 + tag) % len(kinds)]
    rng = np.random.default_rng([src, dst, tag, 11])
    return _values(rng, np.dtype(dtype), shape, "sum", "normal")


P2P_KINDS = (((5,), "float64"), ((), "int64"), ((0, 3), "float32"), ((3, 7), "float32"),
             ((40000,), "float64"), ((2, 3, 5), "int64"), ((33, 17), "float64"))


def _p2p_program(dev, sends, recvs, send_mode, recv_mode, recv_order, use_empty):
    """Post every send first, then every receive; wait receives in ``recv_order``."""
    send_handles = []
    for to, tag, x in sends:
        if use_empty and x.size:
            buf = dev.empty(x.shape, x.dtype)      # a resident buffer: zero-copy sends
            buf[...] = x
            x = buf
        if send_mode == "send":
            dev.send(x, to, tag)
        else:
            send_handles.append((dev.isend(x, to, tag), x))
    got = [None] * len(recvs)
    if recv_mode == "irecv":
        handles = [dev.irecv(src, tag) for src, tag, _ in recvs]
        for i in recv_order:
            got[i] = handles[i].wait()
    else:
        for i in recv_order:
            src, tag, shape_dtype = recvs[i]
            if recv_mode == "recv_out":
                out = dev.xp.empty(*shape_dtype)
                res = dev.recv(src, tag, out=out)
                got[i] = res if res is out else None
            else:
                got[i] = dev.recv(src, tag)
    for handle, _ in reversed(send_handles):
        handle.wait()
    return got


def check_p2p(cluster, mesh, send_mode="send", recv_mode="recv", tags=(0, 3, 1),
              peers="all", use_empty=False, kinds=P2P_KINDS, seed=0) -> None:
    """Every rank sends a distinct message per tag to several peers before receiving
    anything; receivers take them peer by peer in reverse order and tags out of order.

    ``send_mode``: send | isend; ``recv_mode``: recv | irecv | recv_out (``out=``);
    ``peers``: "all" (every other rank) or "ring" (the next and previous rank).
    """
    n = mesh.size
    if n < 2:
        return

    def targets(r):
        if peers == "ring":
            return sorted({(r + 1) % n, (r - 1) % n} - {r})
        return [p for p in range(n) if p != r]

    sources = {r: [s for s in range(n) if r in targets(s)] for r in range(n)}
    args = []
    for r in range(n):
        sends = [(to, t, _payload(r, to, t, kinds)) for to in targets(r) for t in tags]
        recvs = []
        for src in reversed(sources[r]):
            for t in sorted(tags, key=lambda t: (-t if t % 2 else t)):   # out of order
                p = _payload(src, r, t, kinds)
                recvs.append((src, t, (p.shape, p.dtype.str)))
        order = [int(i) for i in np.random.default_rng([seed, r]).permutation(len(recvs))]
        args.append((sends, recvs, send_mode, recv_mode, order, use_empty))
    res = cluster.run(_p2p_program, args)
    failures = []
    for r in range(n):
        for (src, t, _), got in zip(args[r][1], res[r]):
            want = _payload(src, r, t, kinds)
            why = _compare(got, want, True, 1, 0.0)
            if why:
                failures.append(f"rank {r} message from {src} tag {t} ({send_mode}/"
                                f"{recv_mode}): {why}")
    _raise_failures(failures, sum(len(a[1]) for a in args))


def _pairs(n: int) -> list[tuple[int, str]]:
    """(peer, role) per rank: ranks 2k send to 2k+1; an odd one out stays idle."""
    return [(r ^ 1, "send" if r % 2 == 0 else "recv") if (r ^ 1) < n else (r, "idle")
            for r in range(n)]


def _fifo_program(dev, peer, role, count, tag, shape):
    if role == "send":
        for k in range(count):
            dev.send(dev.xp.full(shape, k, dtype="int64"), peer, tag)
    if role != "recv":
        return None
    return [dev.recv(peer, tag) for _ in range(count)]


def check_p2p_same_tag_fifo(cluster, mesh, count=5, shape=(3,)) -> None:
    """Messages of one pair with the same tag arrive in the order they were sent."""
    pairs = _pairs(mesh.size)
    res = cluster.run(_fifo_program, [(p, role, count, 9, shape) for p, role in pairs])
    for r, (_, role) in enumerate(pairs):
        if role == "recv":
            got = [int(np.asarray(a).reshape(-1)[0]) for a in res[r]]
            assert got == list(range(count)), f"rank {r} received in order {got}"


def _post_order_program(dev, peer, role):
    if role == "send":
        dev.send(dev.xp.full(3, 1.0), peer, 5)
        dev.send(dev.xp.full(3, 2.0), peer, 5)
    if role != "recv":
        return None
    first, second = dev.irecv(peer, 5), dev.irecv(peer, 5)
    b = second.wait()                 # waited first, but posted second
    a = first.wait()
    return float(a[0]), float(b[0])


def check_irecv_post_order(cluster, mesh) -> None:
    """Two irecvs of the same (src, tag) match messages in the order they were posted
    (MPI's non-overtaking rule), whatever order they are waited in."""
    pairs = _pairs(mesh.size)
    res = cluster.run(_post_order_program, pairs)
    for r, (_, role) in enumerate(pairs):
        if role == "recv":
            assert res[r] == (1.0, 2.0), (
                f"rank {r}: the first posted irecv got message {res[r][0]:g} and the "
                f"second got {res[r][1]:g} (expected 1 then 2)")


def _pending_program(dev, payload, to, frm, calls, tag):
    """Send one message, run ``calls`` collectives, only then receive."""
    dev.send(payload, to, tag)
    results = []
    for collective, algorithm in calls:
        kw = {} if algorithm == "auto" else {"algorithm": algorithm}
        x = dev.xp.full(4 * dev.mesh.size, float(dev.rank))
        results.append(getattr(dev, collective)(x, **kw))
    return dev.recv(frm, tag), results


def check_p2p_pending_across_collectives(cluster, mesh, calls, tag=123) -> None:
    """A message sent but not yet received must not block the pair's later traffic:
    every rank sends to the next rank, runs ``calls`` = [(collective, algorithm), ...]
    over all ranks (whose messages use the same pairs), and only then receives."""
    n = mesh.size
    payloads = [np.arange(5.0) + 100 * r for r in range(n)]
    res = cluster.run(_pending_program, [(payloads[r], (r + 1) % n, (r - 1) % n, list(calls),
                                          tag) for r in range(n)])
    xs = [np.full(4 * n, float(r)) for r in range(n)]
    failures = []
    for r in range(n):
        got, results = res[r]
        if _compare(got, payloads[(r - 1) % n], True, 1, 0.0):
            failures.append(f"rank {r}: received {got} from rank {(r - 1) % n}")
        for (collective, algorithm), value in zip(calls, results):
            ref = reference(make_case(collective, None, shape=(4 * n,)), mesh, xs)[r]
            if why := _compare(value, ref, True, n, 0.0):
                failures.append(f"rank {r}: {collective} ({algorithm}) {why}")
    _raise_failures(failures, len(calls))


# ------------------------------------------------------------------------------ errors
def _mentions(text: str, value) -> bool:
    """``text`` contains ``value`` as a whole number (or one of a tuple of values)."""
    values = value if isinstance(value, tuple) else (value,)
    return any(re.search(rf"(?<![\w.]){re.escape(str(v))}(?![\w.])", text) for v in values)


def error_cases(mesh, axis, algorithms: dict) -> list:
    """(name, call, expected exception name, values the message must contain) of calls
    that every member of the group rejects before communicating.

    ``algorithms``: collective -> algorithms to try. ``call`` is
    (collective, input shape, dtype, kwargs). A value may be a tuple of alternatives
    (a negative dim may be reported as given or normalised).
    """
    n = group_size(mesh, axis)
    out = []

    def add(name, collective, shape, dtype, exc, must=(), **kw):
        for alg in algorithms.get(collective, ("auto",)):
            out.append((name, (collective, shape, dtype, {**kw, "algorithm": alg}), exc, must))

    add("avg on int64", "all_reduce", (4,), "int64", "TypeError", op="avg")
    add("avg on int64", "reduce", (4,), "int64", "TypeError", op="avg")
    add("avg on int64", "reduce_scatter", (4 * n,), "int64", "TypeError", op="avg")
    for c in ROOTED:
        for root in (n, n + 3, -1):
            add(f"root={root}", c, (2 * n,), "float64", "ValueError", root=root)
    if n > 1:
        size = 7 if 7 % n else 9          # not a multiple of the group size
        add("indivisible dim", "reduce_scatter", (2, size), "float32", "ValueError",
            (1, size, n), dim=1)
        add("indivisible dim", "reduce_scatter", (size,), "int64", "ValueError",
            (0, size, n), dim=0)
        add("indivisible split_dim", "all_to_all", (size, 2 * n), "float64", "ValueError",
            (0, size, n), split_dim=0, concat_dim=1)
        add("indivisible split_dim", "all_to_all", (3, 2, size), "float64", "ValueError",
            ((-1, 2), size, n), split_dim=-1, concat_dim=0)
    for c in ("all_gather", "gather"):
        add("dim out of range", c, (3, 4), "float64", "ValueError", dim=2)
    return out


def _errors_program(dev, calls, axis):
    got = []
    for collective, shape, dtype, kw in calls:
        kw = dict(kw)
        if kw.get("algorithm") == "auto":
            del kw["algorithm"]
        x = dev.xp.ones(shape, dtype)
        try:
            getattr(dev, collective)(x, axis, **kw)
            got.append(None)
        except Exception as exc:                    # noqa: BLE001 - that is the point
            got.append((type(exc).__name__, str(exc)))
    # the group must still work after the rejected calls
    return got, dev.all_reduce(dev.xp.full(3, float(dev.rank)), axis)


def check_errors(cluster, mesh, axis, algorithms: dict) -> None:
    """Every call of :func:`error_cases` raises the expected exception on every member,
    naming the dimension, its size and the group size for indivisible dims, and the
    group keeps working afterwards."""
    table = error_cases(mesh, axis, algorithms)
    calls = [t[1] for t in table]
    res = cluster.run(_errors_program, [(calls, axis)] * mesh.size)
    failures = []
    for r in range(mesh.size):
        got, after = res[r]
        for (name, call, exc_name, numbers), outcome in zip(table, got):
            what = f"rank {r} {call[0]}{list(call[1])} {call[2]} {call[3]} ({name})"
            if outcome is None:
                failures.append(f"{what}: did not raise (expected {exc_name})")
                continue
            if outcome[0] != exc_name:
                failures.append(f"{what}: raised {outcome[0]} (expected {exc_name}): "
                                f"{outcome[1]}")
                continue
            missing = [v for v in numbers if not _mentions(outcome[1], v)]
            if missing:
                failures.append(f"{what}: message lacks {missing}: {outcome[1]!r}")
        group = mesh.group(axis, r)
        want = np.full(3, float(sum(group)))
        if _compare(after, want, True, 1, 0.0):
            failures.append(f"rank {r}: all_reduce after the errors gave {after}")
    _raise_failures(failures, len(table))


def check_run_raises(cluster, mesh, program, args_per_rank, exc_name: str,
                     contains=()) -> str:
    """``cluster.run`` fails, naming ``exc_name`` and every value of ``contains`` in the
    error text (for errors raised on some members only, e.g. by a scatter's root);
    returns that text."""
    try:
        cluster.run(program, args_per_rank)
    except Exception as exc:                        # noqa: BLE001 - engine-specific type
        text = str(exc)
    else:
        raise AssertionError(f"{getattr(program, '__name__', program)} did not fail")
    assert exc_name in text, f"expected {exc_name} in the error, got: {text[-800:]}"
    for v in contains:
        assert _mentions(text, v), f"expected {v!r} in the error, got: {text[-800:]}"
    return text
