"""The workload registry: ``kind`` -> the module that validates and builds it.

Each module has ``validate(scenario, mesh)`` (cross-field rules; raises ScenarioError)
and ``build(scenario, mesh) -> Workload``. The front door reaches the algorithms only
through here (DESIGN.md: a small registry rather than imports everywhere).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

from ..errors import ScenarioError
from .base import Workload, compare

__all__ = ["Workload", "compare", "REGISTRY", "workload_module"]

#: kind -> module name (imported on first use: numpy-heavy algorithm layers load lazily)
REGISTRY = MappingProxyType({"collective": "collective", "matmul": "matmul", "ffn": "ffn",
                             "mlp": "mlp", "transformer": "transformer",
                             "inference": "inference"})


def workload_module(kind: str):
    """The module of ``kind`` (``validate``, ``build``)."""
    if kind not in REGISTRY:
        raise ScenarioError("workload.kind", kind, ", ".join(REGISTRY), "unknown workload")
    return importlib.import_module(f"{__name__}.{REGISTRY[kind]}")
