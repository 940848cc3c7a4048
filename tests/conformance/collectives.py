"""Running and checking batches of collective cases, barriers, chained collectives."""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

from .base import *  # noqa: F401,F403  (shared names)
from .base import _FILL, _RTOL  # noqa: F401
from .cases import *  # noqa: F401,F403
from .cases import _fold, _payload, _values  # noqa: F401

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
