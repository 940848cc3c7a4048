"""Hardware arguments that may name this machine: ``"localhost"`` (calibrated now) or a
:class:`~.spec.LocalhostSpec`, beside the presets and hardware descriptions of
:func:`vcluster.timing.load_hardware`.

:func:`cost_model_for` is what a ranking of layouts prices with; :func:`load_hardware` is
what ``vcluster simulate`` and ``vcluster plan`` read, which price datasheet hardware
only and say where ``localhost`` belongs instead of failing on its fields.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from vcluster.timing import PRESET_NAMES, canonical_dtype
from vcluster.timing import load_hardware as load_datasheet_hardware
from vcluster.timing.hardware import HardwareSpec
from vcluster.timing.hardware_model import HardwareCostModel

from .calibrate import calibrate_localhost
from .cost_model import localhost_model
from .spec import LocalhostSpec, is_localhost_spec_data

__all__ = ["LOCALHOST", "cost_model_for", "load_hardware"]

LOCALHOST = "localhost"

_LOCALHOST_USE = ("it prices emulated scenarios in vcluster run (hardware: {name: localhost, "
                  "calibration: FILE}); here, use a preset (" + ", ".join(PRESET_NAMES) +
                  ") or a hardware YAML file")


def cost_model_for(hardware, devices: int, dtype):
    """The cost model of ``hardware`` for ``devices`` devices computing in ``dtype``:
    ``"localhost"`` is calibrated now (~20 s), a :class:`LocalhostSpec` priced as it is,
    anything else read by :func:`vcluster.timing.load_hardware` and priced at the
    datasheet peak of ``dtype``. The replay's core pool, if any, is ``model.core_pool``."""
    if isinstance(hardware, str) and hardware == LOCALHOST:
        hardware = calibrate_localhost(devices)
    if isinstance(hardware, LocalhostSpec):
        return localhost_model(hardware, devices, np.dtype(dtype).name)
    return HardwareCostModel(load_datasheet_hardware(hardware), canonical_dtype(np.dtype(dtype)))


def load_hardware(spec) -> HardwareSpec:
    """:func:`vcluster.timing.load_hardware`, except that ``"localhost"`` or a saved
    localhost calibration gets an error that says where it belongs."""
    if isinstance(spec, str) and spec == LOCALHOST:
        raise ValueError(f"'localhost' is this machine, measured (vcluster hardware "
                         f"calibrate), not a hardware description: {_LOCALHOST_USE}")
    if isinstance(spec, (str, Path)) and Path(spec).is_file():
        try:
            data = yaml.safe_load(Path(spec).read_text("utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError):
            data = None                  # load_datasheet_hardware says what is wrong
        if is_localhost_spec_data(data):
            raise ValueError(f"{spec} is a localhost calibration (vcluster hardware "
                             f"calibrate), not a hardware description: {_LOCALHOST_USE}")
    return load_datasheet_hardware(spec)
