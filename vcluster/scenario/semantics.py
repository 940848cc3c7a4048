"""Cross-field rules a schema cannot say: the mesh, and each workload's divisibility.

The mesh is ``cluster.mesh`` (axes in order), or, when that is omitted, the axes of
``parallel.dp / pp / tp`` that are given (in that order). When both are given, each
degree must equal its axis's size (an absent axis has size 1); ``cluster.devices``,
when given, must equal the mesh's size.

:func:`check_semantics` is part of the parser (:mod:`.load`): it runs once per sweep point
and returns the mesh, which the parsed point keeps (``Scenario.mesh``); nothing after the
parser runs these rules again.
"""

from __future__ import annotations

from mesh import Mesh

from .errors import ScenarioError
from .hardware import check_hardware
from .resilience import check_faults
from .schema import PARALLEL_AXES, TRANSFORMER_AXES

__all__ = ["resolve_mesh", "check_semantics", "DEGREE_KINDS"]

DEGREE_KINDS = ("mlp", "transformer")      # kinds whose parallel section has dp / pp / tp
#: the degree keys of those kinds, in the order a mesh built from them takes
_DEGREE_AXES = {"mlp": PARALLEL_AXES, "transformer": TRANSFORMER_AXES}


def resolve_mesh(scenario):
    """The :class:`mesh.Mesh` of ``scenario`` (see the module docstring): the parser's,
    when it resolved it already."""
    if getattr(scenario, "mesh", None) is not None:
        return scenario.mesh
    par = scenario.parallel
    degrees = {a: par[a] for a in _DEGREE_AXES[scenario.workload.kind]
               if par.get(a) is not None} if scenario.workload.kind in DEGREE_KINDS else {}
    if degrees.get("ep", 1) > 1:      # dp counts every data-parallel rank, ep among them
        dp, ep = degrees.get("dp", 1), degrees["ep"]
        if dp % ep:
            raise ScenarioError("parallel.ep", ep, f"a divisor of parallel.dp={dp}",
                                "the expert-parallel ranks are carved out of the "
                                "data-parallel ones (mesh axis dp holds dp/ep)")
        degrees["dp"] = dp // ep
    if scenario.cluster.mesh:
        axes = tuple(a for a, _ in scenario.cluster.mesh)
        mesh = Mesh(tuple(n for _, n in scenario.cluster.mesh), axes)
        for a, n in degrees.items():
            size = mesh.shape.get(a, 1)
            if n != size:
                raise ScenarioError(f"parallel.{a}", n, f"{size} (the size of axis {a} in "
                                    f"cluster.mesh {dict(mesh.shape)}), or omit parallel.{a}",
                                    "does not match cluster.mesh")
    elif degrees:
        mesh = Mesh(tuple(degrees.values()), tuple(degrees))
    else:
        raise ScenarioError("cluster.mesh", None, "a mapping of axis: size, e.g. {dp: 2, "
                            "tp: 4} (or parallel.dp / pp / tp for mlp and transformer)",
                            "missing")
    devices = scenario.cluster.devices
    if devices is not None and devices != mesh.size:
        raise ScenarioError("cluster.devices", devices,
                            f"{mesh.size} (the product of the mesh sizes {dict(mesh.shape)})",
                            "mesh size mismatch")
    return mesh


def check_semantics(scenario):
    """Raise :class:`ScenarioError` for the first broken cross-field rule; return the
    scenario's :class:`mesh.Mesh`."""
    from .workloads import workload_module  # lazy: keeps vcluster --help fast (numpy)
    mesh = resolve_mesh(scenario)
    if scenario.workload.dtype == "float16" and scenario.run.mode != "simulate":
        raise ScenarioError("workload.dtype", "float16", "float32, float64 (float16 only with "
                            "run.mode: simulate)", "the emulator computes in float32 or "
                            "float64")
    workload_module(scenario.workload.kind).validate(scenario, mesh)
    check_faults(scenario, mesh)
    if scenario.run.mode != "emulate":
        check_hardware(scenario)
    if scenario.cluster.array_module == "cupy":
        try:
            import cupy  # noqa: F401  (optional dependency)
        except ImportError:
            raise ScenarioError("cluster.array_module", "cupy", "numpy (CuPy is not "
                                "installed)", "cupy is not importable") from None
    return mesh
