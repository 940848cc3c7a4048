"""Errors: bad arguments raise the documented errors and the group still works."""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

from .base import *  # noqa: F401,F403  (shared names)
from .base import _FILL, _RTOL  # noqa: F401
from .cases import *  # noqa: F401,F403
from .collectives import *  # noqa: F401,F403
from .collectives import _compare, _raise_failures  # noqa: F401

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
