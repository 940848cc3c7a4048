"""Cross-field rules a schema cannot say: the mesh, and each workload's divisibility.

The mesh is ``cluster.mesh`` (axes in order), or, when that is omitted, the axes of
``parallel.dp / pp / tp`` that are given (in that order). When both are given, each
degree must equal its axis's size (an absent axis has size 1); ``cluster.devices``,
when given, must equal the mesh's size. A served model (``kind: inference``) runs one
replica on the mesh (pp, tp) (:func:`~.workloads.inference.replica_mesh`), and only it
takes the ``engine`` section.

``data_parallel`` (:func:`check_data_parallel`): each mode takes its own keys; ZeRO and
the parameter server train mlp / transformer without faults or checkpoints; ZeRO-2/3
need pp 1; the parameter server's mesh is one axis ``ps`` of
``servers`` + ``parallel.dp`` workers (built so when ``cluster.mesh`` is omitted), without
pp or tp (nor cp or ep: each worker holds the whole model); an asynchronous one
(staleness >= 1) only emulates, unchecked.

:func:`check_semantics` is part of the parser (:mod:`.load`): it runs once per sweep point
and returns the mesh, which the parsed point keeps (``Scenario.mesh``); nothing after the
parser runs these rules again.
"""

from __future__ import annotations

from mesh import Mesh
from modeling import ConfigError, check_zero_stage

from .choices import DataParallelMode
from .errors import ScenarioError
from .hardware import check_hardware
from .resilience import check_faults, wants_resilience
from .schema import DATA_PARALLEL_KEYS, PARALLEL_AXES, SERVING_KIND, TRANSFORMER_AXES

__all__ = ["resolve_mesh", "check_semantics", "check_data_parallel", "DEGREE_KINDS",
           "PS_AXIS"]

PS_AXIS = "ps"          # the parameter server's one mesh axis: servers, then workers

DEGREE_KINDS = ("mlp", "transformer")      # kinds whose parallel section has dp / pp / tp
#: the degree keys of those kinds, in the order a mesh built from them takes
_DEGREE_AXES = {"mlp": PARALLEL_AXES, "transformer": TRANSFORMER_AXES}


def resolve_mesh(scenario):
    """The :class:`mesh.Mesh` of ``scenario`` (see the module docstring): the parser's,
    when it resolved it already."""
    if getattr(scenario, "mesh", None) is not None:
        return scenario.mesh
    if scenario.workload.kind == SERVING_KIND:     # one serving replica: mesh (pp, tp)
        from .workloads.inference import replica_mesh  # lazy: the decoder's layer (numpy)
        return _check_devices(scenario, replica_mesh(scenario))
    if _is_ps(scenario):
        return _ps_mesh(scenario)
    par = scenario.parallel
    degrees = {a: par[a] for a in _DEGREE_AXES[scenario.workload.kind]
               if par.get(a) is not None} if scenario.workload.kind in DEGREE_KINDS else {}
    if degrees.get("ep", 1) > 1:      # dp counts every data-parallel rank, ep among them
        dp, ep, tp = degrees.get("dp", 1), degrees["ep"], degrees.get("tp", 1)
        if par.get("etp") == 1 and tp > 1:       # folded: the group is ep/tp whole tp groups
            if ep % tp or dp % (ep // tp):
                raise ScenarioError("parallel.ep", ep, f"parallel.tp={tp} x a divisor of "
                                    f"parallel.dp={dp} with parallel.etp 1",
                                    "the expert group is made of whole tp groups (mesh axis "
                                    "ep holds ep/tp)")
            ep //= tp
        if dp % ep:
            raise ScenarioError("parallel.ep", degrees["ep"], f"a divisor of parallel.dp={dp}",
                                "the expert-parallel ranks are carved out of the "
                                "data-parallel ones (mesh axis dp holds dp/ep)")
        degrees["dp"], degrees["ep"] = dp // ep, ep
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
    return _check_devices(scenario, mesh)


def _check_devices(scenario, mesh):
    devices = scenario.cluster.devices
    if devices is not None and devices != mesh.size:
        raise ScenarioError("cluster.devices", devices,
                            f"{mesh.size} (the product of the mesh sizes {dict(mesh.shape)})",
                            "mesh size mismatch")
    return mesh


def _is_ps(scenario) -> bool:
    dp = getattr(scenario, "data_parallel", None)
    return (dp is not None and dp.mode == DataParallelMode.PS
            and scenario.workload.kind in DEGREE_KINDS)


def _ps_mesh(scenario):
    """The parameter server's mesh: one axis ``ps`` of servers then workers
    (``parallel.dp`` of them, default 1; or what ``cluster.mesh`` leaves after the
    servers)."""
    servers, workers = scenario.data_parallel.servers, scenario.parallel.get("dp")
    if not scenario.cluster.mesh:
        return _check_devices(scenario, Mesh((servers + (workers or 1),), (PS_AXIS,)))
    shape = dict(scenario.cluster.mesh)
    if tuple(shape) != (PS_AXIS,):
        raise ScenarioError("cluster.mesh", shape, f"one axis {PS_AXIS!r} of data_parallel."
                            f"servers + parallel.dp devices (e.g. {{{PS_AXIS}: "
                            f"{servers + (workers or 1)}}}), or omit cluster.mesh",
                            "the parameter server runs on one axis: servers, then workers")
    size = shape[PS_AXIS]
    if workers is not None and size != servers + workers:
        raise ScenarioError("parallel.dp", workers, f"{size - servers} (cluster.mesh "
                            f"{shape} less data_parallel.servers={servers}), or omit "
                            "parallel.dp", "does not match cluster.mesh")
    if size <= servers:
        raise ScenarioError("data_parallel.servers", servers, f"at most {size - 1} on "
                            f"cluster.mesh {shape}", "leaves no worker")
    return _check_devices(scenario, Mesh((size,), (PS_AXIS,)))


def check_data_parallel(scenario) -> None:
    """The ``data_parallel`` rules that need no mesh (module docstring)."""
    dp, kind = scenario.data_parallel, scenario.workload.kind
    mode = dp.mode
    section = dict(scenario.document.get("data_parallel") or {})
    for key in section:
        if key != "mode" and key not in DATA_PARALLEL_KEYS[mode]:
            owner = next(m for m, keys in DATA_PARALLEL_KEYS.items() if key in keys)
            raise ScenarioError(f"data_parallel.{key}", section[key],
                                f"no value with data_parallel.mode {mode} ({key} belongs "
                                f"to mode {owner})", f"not a key of mode {mode}")
    if mode == DataParallelMode.DDP:
        return
    if kind not in DEGREE_KINDS:
        raise ScenarioError("data_parallel.mode", mode, "ddp", f"workload kind {kind} does "
                            "not train: it has no replicas to combine (zero and ps train "
                            f"{' and '.join(DEGREE_KINDS)})")
    if wants_resilience(scenario):
        raise ScenarioError("data_parallel.mode", mode, "ddp with faults or checkpoint "
                            "(or omit those sections)",
                            "checkpoints and restarts hold the unsharded DDP training state")
    par = scenario.parallel
    if mode == DataParallelMode.PS:
        for axis in ("pp", "tp", "cp", "ep"):
            if par.get(axis) not in (None, 1):
                raise ScenarioError(f"parallel.{axis}", par[axis], "1 or no value with "
                                    "data_parallel.mode ps", "the parameter server runs "
                                    "on one axis of servers and workers, each worker "
                                    "holding the whole model")
        if dp.staleness and (scenario.run.mode != "emulate" or scenario.run.check):
            key = "run.mode" if scenario.run.mode != "emulate" else "run.check"
            raise ScenarioError("data_parallel.staleness", dp.staleness, "0 (synchronous), "
                                "or >= 1 with run.mode emulate and run.check false",
                                f"asynchronous with {key} = "
                                f"{str(scenario.run.mode) if key == 'run.mode' else 'true'}: "
                                "its gradients apply in the machine's arrival order, so a "
                                "check against the synchronous reference would fail and a "
                                "trace cannot know the order")


def _check_zero(scenario, mesh) -> None:
    """The ZeRO stage against the plan's rulebook (:func:`modeling.check_zero_stage`: 2 and
    3 need pp 1), named by key."""
    try:
        check_zero_stage(scenario.data_parallel.zero_stage, mesh.shape.get("pp", 1))
    except ConfigError as exc:
        raise ScenarioError("data_parallel.zero_stage", exc.value, exc.allowed,
                            exc.reason) from None


def _check_engine_section(scenario) -> None:
    """The ``engine`` section configures a served model: only with workload.kind inference."""
    kind = scenario.workload.kind
    if kind != SERVING_KIND and "engine" in scenario.document:
        raise ScenarioError("engine", dict(scenario.document["engine"]),
                            f"no engine section with workload.kind {kind}",
                            f"the serving engine belongs to workload.kind {SERVING_KIND}")


def check_semantics(scenario):
    """Raise :class:`ScenarioError` for the first broken cross-field rule; return the
    scenario's :class:`mesh.Mesh`."""
    from .workloads import workload_module  # lazy: keeps vcluster --help fast (numpy)
    _check_engine_section(scenario)
    check_data_parallel(scenario)
    mesh = resolve_mesh(scenario)
    _check_zero(scenario, mesh)
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
