"""The ``hardware`` section: which machine a simulation prices the trace on.

* a preset (``vcluster hardware list``), a YAML file or an inline ``spec``: a
  :class:`~vcluster.timing.hardware.HardwareSpec` priced by
  :class:`~vcluster.timing.hardware_model.HardwareCostModel` at the datasheet peak of
  ``dtype`` (default fp32; the trace's bytes are the workload's own dtype);
* a cluster file of several GPU kinds (``parts``: docs/heterogeneous.md) as
  ``hardware.file``: every mesh rank r on the cluster's GPU r (the mesh's own order),
  priced on its own kind by :class:`~vcluster.timing.cluster_cost.ClusterCostModel`; the
  mesh must have as many devices as the cluster has GPUs;
* ``localhost``: this machine, so that the simulator predicts the emulator itself
  (:class:`~vcluster.localhost.cost_model.LocalhostCostModel`, devices sharing the cores):
  calibrated by microbenchmarks (about 20 s on a 2-core machine), or read from
  ``calibration`` (a file written by ``vcluster hardware calibrate --out FILE``). One
  ``vcluster run`` calibrates once per cluster size (:class:`LocalhostCalibrations`):
  its sweep points, and ``parallel.policy: auto``'s ranking, share that calibration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ScenarioError

__all__ = ["check_hardware", "check_fp8", "CostSetup", "cost_setup", "LocalhostCalibrations",
           "LOCALHOST", "single_kind"]

LOCALHOST = "localhost"


def _path(scenario, relative: str) -> Path:
    p = Path(relative).expanduser()
    return p if p.is_absolute() else Path(scenario.base_dir) / p


def _allowed_names() -> str:
    # lazy: keeps vcluster --help fast
    from vcluster.timing import PRESET_NAMES
    return ", ".join(PRESET_NAMES + (LOCALHOST,)) + ", a .yaml file, or an object"


def check_hardware(scenario) -> None:
    """Raise :class:`ScenarioError` when the hardware cannot be loaded."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing import PRESET_NAMES, hardware_from_dict
    hw = scenario.hardware
    given = [k for k in ("name", "file", "spec") if getattr(hw, k)]
    if len(given) != 1:
        raise ScenarioError("hardware", dict(name=hw.name, file=hw.file),
                            "exactly one of name, file, spec", f"{len(given)} given")
    if hw.name is not None:
        if hw.name in PRESET_NAMES or hw.name == LOCALHOST:
            pass
        elif hw.name.endswith((".yaml", ".yml")):
            _check_file(scenario, "hardware", hw.name)
        else:
            raise ScenarioError("hardware", hw.name, _allowed_names(), "unknown hardware")
    elif hw.file is not None:
        _check_file(scenario, "hardware.file", hw.file)
    else:
        try:
            hardware_from_dict(dict(hw.spec), path="hardware.spec")
        except (TypeError, ValueError, KeyError) as exc:
            raise ScenarioError("hardware.spec", dict(hw.spec), "the fields of a hardware "
                                "YAML file (vcluster hardware show NAME)", str(exc)) from None
    if hw.calibration is not None:
        if hw.name != LOCALHOST:
            raise ScenarioError("hardware.calibration", hw.calibration,
                                "only with name: localhost", "not localhost hardware")
        if not _path(scenario, hw.calibration).is_file():
            raise ScenarioError("hardware.calibration", hw.calibration,
                                "an existing file written by vcluster hardware "
                                "calibrate --out FILE", "no such file")
    if hw.name != LOCALHOST:
        try:
            for kind in _kinds(_load(scenario)):
                kind.device.peak_flops(hw.dtype)
        except (TypeError, ValueError) as exc:
            raise ScenarioError("hardware.dtype", hw.dtype, "a dtype with a datasheet peak "
                                "on this hardware", str(exc)) from None


def _check_file(scenario, path: str, value: str) -> None:
    # lazy: keeps vcluster --help fast
    from vcluster.timing import load_hardware
    from vcluster.timing.cluster import load_cluster
    p = _path(scenario, value)
    if not p.is_file():
        raise ScenarioError(path, value, _allowed_names(), f"no such file {p}")
    try:
        load_cluster(p, hardware_loader=load_hardware)
    except (TypeError, ValueError, KeyError) as exc:
        raise ScenarioError(path, value, "a valid hardware YAML file, or a cluster file "
                            "(docs/heterogeneous.md)", str(exc)) from None


def _load(scenario):
    """The scenario's HardwareSpec, or its ClusterSpec (a cluster file of several kinds)."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing import load_hardware
    from vcluster.timing.cluster import ClusterSpec, load_cluster
    spec = load_cluster(_hardware_arg(scenario), hardware_loader=load_hardware)
    return spec if isinstance(spec, ClusterSpec) and len(spec.kinds) > 1 else (
        spec.parts[0].hardware if isinstance(spec, ClusterSpec) else spec)


def _kinds(spec) -> list:
    """The HardwareSpecs of a HardwareSpec or a ClusterSpec's parts."""
    return [part.hardware for part in spec.parts] if hasattr(spec, "parts") else [spec]


def single_kind(scenario):
    """The scenario's HardwareSpec; :class:`ScenarioError` naming the hardware key when it
    is a cluster of several GPU kinds (what needs one device model, e.g. serving)."""
    spec = _load(scenario)
    if hasattr(spec, "parts"):
        hw = scenario.hardware
        raise ScenarioError("hardware.file" if hw.file else "hardware", hw.file or hw.name,
                            "one GPU kind: a preset or a hardware file",
                            f"cluster {spec.name!r} has {len(spec.kinds)} GPU kinds")
    return spec


def _hardware_arg(scenario):
    hw = scenario.hardware
    if hw.spec is not None:
        return dict(hw.spec)
    if hw.file is not None:
        return _path(scenario, hw.file)
    if hw.name.endswith((".yaml", ".yml")):
        return _path(scenario, hw.name)
    return hw.name


class LocalhostCalibrations:
    """This machine's calibrations of one ``vcluster run``, one per cluster size, made when
    first needed: every sweep point on ``localhost`` hardware without ``calibration``
    (and ``auto``'s ranking of layouts, then the prediction, of the same point) prices
    its trace with the spec of its size instead of calibrating again (~20 s each)."""

    def __init__(self):
        self._specs: dict = {}             # devices -> (spec, how it was measured)

    def __repr__(self) -> str:
        measured = "; ".join(source for _, source in self._specs.values())
        return f"LocalhostCalibrations({measured or 'none yet'})"

    def calibration(self, devices: int) -> tuple:
        """(the :class:`~vcluster.localhost.cost_model.LocalhostSpec` measured on ``devices``
        devices in this run, when and how long it was measured), calibrated now if it is
        the first asked for."""
        if devices not in self._specs:
            # lazy: keeps vcluster --help fast
            from vcluster.localhost.calibrate import calibrate_localhost
            started, t0 = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
            spec = calibrate_localhost(devices)
            self._specs[devices] = (spec, f"measured {started} on {devices} devices "
                                          f"({time.perf_counter() - t0:.1f} s)")
        return self._specs[devices]


@dataclass(frozen=True)
class CostSetup:
    """What :func:`~vcluster.timing.engine.simulate_trace` needs: the cost model, the core
    pool (localhost only) and the hardware's name for the report; ``calibration`` says
    which localhost calibration priced it (a saved file, or when it was measured)."""

    costs: object
    core_pool: object
    label: str
    localhost: bool
    calibration: str | None = None


def check_fp8(scenario, key: str = "workload.fp8", value=True, fmt: str = "fp8") -> None:
    """Raise :class:`ScenarioError` (naming ``key`` and ``value``) unless the scenario
    simulates on hardware that runs GEMMs in ``fmt`` (:mod:`vcluster.timing.gemm_formats`:
    FP8 needs an FP8 peak — H100 and later —, mxfp8/nvfp4/mxfp4 block-scaled tensor
    cores), not localhost, whose kernels are this machine's."""
    if scenario.run.mode == "emulate":
        raise ScenarioError(key, value, "run.mode simulate or both",
                            f"{fmt} prices the simulation; the emulated math is unchanged")
    check_hardware(scenario)
    if scenario.hardware.name == LOCALHOST:
        raise ScenarioError(key, value, f"a hardware preset or file that runs {fmt} GEMMs "
                            f"(`vcluster hardware list`)",
                            "localhost prices this machine's CPU kernels")
    # lazy: keeps vcluster --help fast
    from vcluster.timing.gemm_formats import check_gemm_format
    try:
        for spec in _kinds(_load(scenario)):
            check_gemm_format(fmt, spec)
    except ValueError as exc:
        raise ScenarioError(key, value, f"a hardware preset or file that runs {fmt} GEMMs "
                            f"(`vcluster hardware list`)", str(exc)) from None


def cost_setup(scenario, mesh, dtype: str, fp8_gemms=None, flash_v1: bool = False,
               gemm_format: str = "fp8", attention_kernel: str = "") -> CostSetup:
    """The cost model of the scenario's hardware for a ``dtype`` workload on ``mesh``;
    ``fp8_gemms``: the traced GEMMs priced in ``gemm_format`` (:func:`check_fp8` first);
    ``flash_v1``: fused attention priced as kernels built for Ampere
    (``parallel.attention: flash-v1``; a GPU model's, not localhost's);
    ``attention_kernel``: fused attention priced from that kernel's published curves
    (``parallel.attention: flash2``, ``flash3``, ``cudnn``; a GPU model's too)."""
    hw = scenario.hardware
    named = "flash-v1" if flash_v1 else attention_kernel
    if named and hw.name == LOCALHOST:
        raise ScenarioError("parallel.attention", named, "flash or unfused on localhost",
                            f"{named} prices a GPU's attention kernels; localhost prices "
                            "this machine's CPU kernels")
    if hw.name == LOCALHOST:
        # lazy: keeps vcluster --help fast
        from vcluster.localhost.cost_model import load_localhost_spec, localhost_model
        if hw.calibration is not None:
            path = _path(scenario, hw.calibration)
            spec, source = load_localhost_spec(path), f"saved {path}"
        else:
            measured = hw.measured if hw.measured is not None else LocalhostCalibrations()
            spec, source = measured.calibration(max(2, mesh.size))
        model = localhost_model(spec, mesh.size, dtype)
        return CostSetup(model, model.core_pool, LOCALHOST, True, source)
    # lazy: keeps vcluster --help fast
    from vcluster.timing.cluster_cost import ClusterCostModel
    from vcluster.timing.hardware_model import HardwareCostModel
    spec = _load(scenario)
    if hasattr(spec, "parts") and spec.gpus != mesh.size:
        raise ScenarioError("hardware.file", hw.file or hw.name,
                            f"a cluster of {mesh.size} GPUs (the mesh's devices: mesh rank r "
                            f"runs on the cluster's GPU r)",
                            f"cluster {spec.name!r} has {spec.gpus} GPUs")
    try:
        if hasattr(spec, "parts"):
            costs = ClusterCostModel(spec, hw.dtype, fp8_gemms=fp8_gemms, flash_v1=flash_v1,
                                     gemm_format=gemm_format,
                                     attention_kernel=attention_kernel)
        else:
            costs = HardwareCostModel(spec, hw.dtype, fp8_gemms=fp8_gemms, flash_v1=flash_v1,
                                      gemm_format=gemm_format,
                                      attention_kernel=attention_kernel)
    except ValueError as exc:
        if not named or named not in str(exc):
            raise
        raise ScenarioError("parallel.attention", named,
                            "flash or unfused on this hardware", str(exc)) from None
    return CostSetup(costs, None, spec.name, False)
