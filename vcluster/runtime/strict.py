"""A strict array module: numpy's math on arrays that refuse host arrays, as CuPy's do.

CI has no GPU, yet the bug a GPU exposes first is a program that hands a host
(``numpy.ndarray``) array to device math. ``VirtualCluster(mesh, array_module="strict")``
gives every device this module as ``dev.xp``: its arrays (:class:`StrictArray`) hold
numpy memory, compute with numpy, and follow CuPy's rules for mixing —

* an operation (operator, ufunc, ``np.*`` function, method, index, assignment) that
  meets a ``numpy.ndarray`` operand raises ``TypeError``, as CuPy does; Python and numpy
  scalars are allowed;
* implicit conversion to numpy (``np.asarray(x)``, ``np.array(x)``) raises ``TypeError``;
  crossing to the host is explicit: ``xp.asnumpy(x)`` or ``x.get()``, and back
  ``xp.asarray(host)``;
* reductions return 0-d arrays, not numpy scalars (``float(x)`` and ``x.item()`` read
  them on the host, as on CuPy).

``numpy`` functions called on strict arrays work through numpy's dispatch protocols
(``__array_ufunc__`` / ``__array_function__``), as they do on CuPy arrays, so device
code may be written with ``dev.xp`` or with ``np`` applied to device arrays alike.

``StrictNamespace`` is what ``dev.xp`` is: numpy's names, with functions wrapped so that
their results are strict arrays (``xp.zeros`` makes device memory).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

__all__ = ["StrictArray", "StrictNamespace", "HostDeviceMixError", "unwrap"]

# Methods of numpy.ndarray that would hand device memory to the host without a transfer.
_HOST_METHODS = frozenset({"tobytes", "tofile", "ctypes", "data", "dump", "dumps",
                           "__array_interface__", "__array_struct__", "base"})


class HostDeviceMixError(TypeError):
    """A host (numpy) array met a device array, or a device array was converted to
    numpy implicitly (CuPy raises a ``TypeError`` in both cases)."""


def _unwrap(x, where: str):
    """The numpy array inside a strict array; scalars pass; a host array is refused."""
    if type(x) is StrictArray:
        return x._a
    if isinstance(x, np.ndarray):
        raise HostDeviceMixError(
            f"{where}: a host numpy.ndarray of shape {x.shape} met device arrays; move it "
            "with dev.xp.asarray(x) (as CuPy requires), or keep the data on the device")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, where) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, where) for k, v in x.items()}
    return x


def _wrap(x):
    """numpy results as strict arrays; numpy scalars as 0-d arrays (CuPy's reductions
    return 0-d arrays); containers element-wise; anything else as it is."""
    if type(x) is np.ndarray:
        return StrictArray(x)
    if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_, np.void)):
        return StrictArray(np.asarray(x))
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(v) for v in x)
    return x


class StrictArray(NDArrayOperatorsMixin):
    """An array on a virtual device (numpy memory, CuPy's rules; see the module doc)."""

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, array: np.ndarray):
        if type(array) is not np.ndarray:
            raise TypeError(f"StrictArray wraps a numpy.ndarray, got {type(array).__name__}")
        self._a = array

    # --- numpy's protocols ------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise HostDeviceMixError(
            "implicit conversion of a device array to a numpy.ndarray is not allowed (as "
            "on CuPy); use dev.xp.asnumpy(x) or x.get() to copy it to the host")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"numpy.{ufunc.__name__}"
        out = kwargs.pop("out", None)
        kwargs = {k: _unwrap(v, where) for k, v in kwargs.items()}
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o, where) for o in out)
        result = getattr(ufunc, method)(*(_unwrap(x, where) for x in inputs), **kwargs)
        if out is not None and method != "at":
            # with out=, the result is the out array itself: hand back the strict one
            return out[0] if len(out) == 1 else tuple(out)
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        where = f"numpy.{func.__name__}"
        return _wrap(func(*_unwrap(args, where), **_unwrap(kwargs, where)))

    # --- attributes -------------------------------------------------------------------
    @property
    def shape(self):
        return self._a.shape

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    @property
    def dtype(self):
        return self._a.dtype

    @property
    def ndim(self):
        return self._a.ndim

    @property
    def size(self):
        return self._a.size

    @property
    def nbytes(self):
        return self._a.nbytes

    @property
    def itemsize(self):
        return self._a.itemsize

    @property
    def strides(self):
        return self._a.strides

    @property
    def flags(self):
        return self._a.flags

    @property
    def T(self):
        return StrictArray(self._a.T)

    @property
    def real(self):
        return StrictArray(self._a.real)

    @property
    def imag(self):
        return StrictArray(self._a.imag)

    def __getattr__(self, name):
        if name.startswith("__") or name in _HOST_METHODS:
            raise AttributeError(f"a device array has no {name!r} (host memory is reached "
                                 "through dev.xp.asnumpy(x))")
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)

        def method(*args, **kwargs):
            where = f"ndarray.{name}"
            return _wrap(attr(*_unwrap(args, where), **_unwrap(kwargs, where)))

        method.__name__ = name
        return method

    # --- host reads (explicit, as on CuPy) ----------------------------------------------
    def get(self) -> np.ndarray:
        """A host copy (CuPy's ``ndarray.get``)."""
        return self._a.copy()

    def item(self, *args):
        return self._a.item(*args)

    def tolist(self):
        return self._a.tolist()

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __complex__(self):
        return complex(self._a)

    def __bool__(self):
        return bool(self._a)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(row) for row in self._a)

    # --- indexing ---------------------------------------------------------------------
    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key, "indexing")])

    def __setitem__(self, key, value):
        self._a[_unwrap(key, "indexing")] = _unwrap(value, "assignment")

    def __repr__(self) -> str:
        return f"StrictArray({np.array2string(self._a, threshold=8)}, dtype={self._a.dtype})"

    def __reduce__(self):
        raise HostDeviceMixError("a device array cannot be pickled; copy it to the host "
                                 "first (dev.xp.asnumpy(x))")


class _WrappedModule:
    """A numpy (sub)module whose functions take and return strict arrays."""

    def __init__(self, module, label: str):
        self._module, self._label = module, label

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._label})"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._module, name)
        if isinstance(attr, type) or not callable(attr):
            if name in ("random", "linalg", "fft"):
                return _WrappedModule(attr, f"{self._label}.{name}")
            return attr                      # dtypes, constants, np.newaxis
        where = f"{self._label}.{name}"

        def function(*args, **kwargs):
            return _wrap(attr(*_unwrap(args, where), **_unwrap(kwargs, where)))

        function.__name__ = name
        return function


class StrictNamespace(_WrappedModule):
    """``dev.xp`` of a strict device: numpy's names; functions return strict arrays.

    ``asarray`` moves host data to the device (a copy; device arrays pass through),
    ``asnumpy`` moves device data to the host (a copy). Everything else is numpy's own
    function applied to the unwrapped operands, refusing host arrays.
    """

    ndarray = StrictArray

    def __init__(self):
        super().__init__(np, "xp")

    def __repr__(self) -> str:
        return "StrictNamespace(numpy math, CuPy's host/device rules)"

    @staticmethod
    def asarray(x, dtype=None, order=None):
        if type(x) is StrictArray:
            return x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype)
        return StrictArray(np.array(x, dtype=dtype, order=order or "K", copy=True))

    array = asarray

    @staticmethod
    def ascontiguousarray(x, dtype=None):
        return _wrap(np.ascontiguousarray(_unwrap(x, "xp.ascontiguousarray"), dtype=dtype))

    @staticmethod
    def asnumpy(x) -> np.ndarray:
        if type(x) is StrictArray:
            return x._a.copy()
        return np.asarray(x)

    @staticmethod
    def get_array_module(*args):
        return StrictNamespace() if any(type(a) is StrictArray for a in args) else np


def unwrap(x: StrictArray) -> np.ndarray:
    """The numpy memory of a strict array (the runtime's own access: no copy, no count)."""
    return x._a
