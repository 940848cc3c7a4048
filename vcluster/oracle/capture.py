"""Turning a run into a :class:`Golden`: name the arrays, hash them, describe the run.

Names. A rank's inputs are its argument tuple, flattened: ``arg<i>`` for an array
argument, ``arg<i>.<key>`` / ``arg<i>.<j>`` inside dicts, lists and tuples (other objects,
such as the operation itself, are described in ``layouts`` instead). A rank's results
are what the program returned, flattened the same way without the prefix (a dict of
arrays keeps its names; a bare array is ``out``; lists of numbers become arrays;
None and non-numeric leaves are left out). A result named ``d<Name>`` (``dA``, ``dx``,
``dW1``) is a gradient; every other result is an output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from .compare import default_tolerance
from .golden import FORMAT, Golden

__all__ = ["flatten_arrays", "flatten_results", "split_results", "engine_description",
           "golden_from_run", "capture"]

_GRADIENT = re.compile(r"^d[A-Za-z]")


def _numeric_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in x)


def flatten_arrays(obj, prefix: str = "") -> dict[str, np.ndarray]:
    """Array leaves of nested dicts, lists and tuples by dotted name (module docstring)."""
    out: dict[str, np.ndarray] = {}
    join = (lambda k: f"{prefix}.{k}") if prefix else str
    if isinstance(obj, np.ndarray):
        out[prefix or "out"] = obj
    elif _numeric_list(obj):
        out[prefix or "out"] = np.asarray(obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flatten_arrays(v, join(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_arrays(v, join(i)))
    return out


def flatten_results(result) -> dict[str, np.ndarray]:
    """One rank's program result as ``{name: array}``."""
    if isinstance(result, Mapping) and all(isinstance(v, np.ndarray) for v in result.values()):
        return {str(k): v for k, v in result.items()}
    return flatten_arrays(result)


def split_results(flat: dict) -> tuple[dict, dict]:
    """(outputs, gradients) of a flattened result (gradients: names ``d<Name>``)."""
    grads = {k: v for k, v in flat.items() if _GRADIENT.match(k.rsplit(".", 1)[-1])}
    return {k: v for k, v in flat.items() if k not in grads}, grads


def engine_description(cluster) -> dict:
    """``engine`` and, for torch, ``torch_version`` / ``torch_backend`` as torch reports."""
    info = dict(getattr(cluster, "info", None) or {})
    if "torch_version" in info:
        return {"engine": "torch", "torch_version": info["torch_version"],
                "torch_backend": info["torch_backend"]}
    return {"engine": "emulator"}


def golden_from_run(mesh, args_by_rank, results, *, name: str, seed=None, layouts=None,
                    scenario=None, engine=None, tolerances=None) -> Golden:
    """A Golden from per-rank arguments and results (see the module docstring).

    ``tolerances``: name -> {"rtol", "atol"} overriding :func:`default_tolerance`,
    which is taken over every rank's array of that name.
    """
    arrays, by_name = [], {}
    for r in range(mesh.size):
        flat = flatten_results(results[r])
        outputs, grads = split_results(flat)
        inputs = {}
        for i, arg in enumerate(args_by_rank[r]):
            inputs.update(flatten_arrays(arg, f"arg{i}"))
        arrays.append({"inputs": inputs,
                       "outputs": outputs, "gradients": grads})
        for k, v in flat.items():
            by_name.setdefault(k, []).append(np.asarray(v))
    tol = {}
    for k, vs in by_name.items():
        t = [default_tolerance(v) for v in vs]
        tol[k] = {"rtol": max(x["rtol"] for x in t), "atol": max(x["atol"] for x in t)}
        tol[k].update((tolerances or {}).get(k, {}))
    manifest = {
        "format": FORMAT,
        "scenario": dict(scenario or {}, name=name),
        "seed": seed,
        "mesh": {"shape": list(mesh.dims), "axes": list(mesh.axes)},
        "layouts": {str(k): str(v) for k, v in (layouts or {}).items()},
        "dtypes": {k: str(vs[0].dtype) for k, vs in by_name.items()},
        "tolerances": tol,
        **(engine or {"engine": "emulator"}),
    }
    return Golden(manifest, tuple(arrays))


def capture(cluster, program, args_by_rank, *, name: str, seed=None, layouts=None,
            scenario=None, tolerances=None) -> Golden:
    """Run ``program`` on ``cluster`` (any engine) and return the Golden of that run."""
    results = cluster.run(program, list(args_by_rank))
    return golden_from_run(cluster.mesh, args_by_rank, results, name=name, seed=seed,
                           layouts=layouts, scenario=scenario, tolerances=tolerances,
                           engine=engine_description(cluster))
