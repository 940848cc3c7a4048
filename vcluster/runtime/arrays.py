"""The array modules a virtual device may compute with, and the crossings between them.

``VirtualCluster(mesh, array_module=...)`` picks what ``dev.xp`` is on every device:

==========  =====================================================================
``numpy``   host arrays (the default): a device's memory is host memory.
``cupy``    CuPy arrays on the machine's GPU (every device of the cluster shares it).
``strict``  :mod:`vcluster.runtime.strict`: numpy math on arrays that follow CuPy's
            rules (a host array meeting a device array raises ``TypeError``), so a
            CPU-only CI catches the host/device mixes that would fail on a GPU.
==========  =====================================================================

On the device modules a program's arguments arrive as device arrays (every numpy array
inside them, however deeply nested, is moved to the device once, on arrival), and its
results go back to the caller as numpy arrays. Between the two, a program's arrays cross
to the host only where it says so (``dev.xp.asnumpy``) or where a collective stages them
(counted in ``cluster.stats()``'s ``h2d_bytes`` / ``d2h_bytes``).
"""

from __future__ import annotations

import numpy as np

from .strict import StrictArray, StrictNamespace, unwrap

__all__ = ["ArrayModule", "ARRAY_MODULES", "array_module"]

ARRAY_MODULES = ("numpy", "cupy", "strict")


class ArrayModule:
    """One array module: ``xp`` and the host <-> device crossings (numpy: none)."""

    name = "numpy"
    device = False               # whether arrays live apart from the host's

    def __init__(self):
        self.xp = np

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def is_device(self, x) -> bool:
        """Whether ``x`` is an array of this module's device memory."""
        return False

    def to_device(self, x: np.ndarray):
        """A device copy of the host array ``x``."""
        return x

    def to_host(self, x) -> np.ndarray:
        """A host array with the data of ``x`` (a device array: a copy)."""
        return x

    def adopt(self, x: np.ndarray):
        """The device array of ``x``, a host array this device just received into its
        own memory (it may keep that memory instead of copying)."""
        return self.to_device(x)


class StrictModule(ArrayModule):
    """``strict``: numpy memory behind CuPy's rules (:mod:`vcluster.runtime.strict`)."""

    name = "strict"
    device = True

    def __init__(self):
        self.xp = StrictNamespace()

    def is_device(self, x) -> bool:
        return type(x) is StrictArray

    def to_device(self, x: np.ndarray):
        return StrictArray(np.array(x, copy=True))

    def to_host(self, x) -> np.ndarray:
        return unwrap(x).copy() if type(x) is StrictArray else x

    def adopt(self, x: np.ndarray):
        return StrictArray(x)          # the arena block is this device's memory


class CupyModule(ArrayModule):
    """``cupy``: CuPy arrays on the current CUDA device."""

    name = "cupy"
    device = True

    def __init__(self):
        import cupy                     # only on clusters that asked for it
        cupy.cuda.runtime.getDeviceCount()
        self.xp = cupy

    def is_device(self, x) -> bool:
        return isinstance(x, self.xp.ndarray)

    def to_device(self, x: np.ndarray):
        return self.xp.asarray(x)

    def to_host(self, x) -> np.ndarray:
        return self.xp.asnumpy(x) if isinstance(x, self.xp.ndarray) else x


def array_module(name: str) -> ArrayModule:
    """The :class:`ArrayModule` called ``name`` (one of :data:`ARRAY_MODULES`)."""
    if name == "numpy":
        return ArrayModule()
    if name == "strict":
        return StrictModule()
    if name == "cupy":
        return CupyModule()
    raise ValueError(f"array_module must be one of {ARRAY_MODULES}, got {name!r}")
