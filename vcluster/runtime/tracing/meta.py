"""``MetaArray``: a numpy-like array with a shape and a dtype but no data.

Per-device programs run unchanged on meta arrays: numpy dispatches its ufuncs and most
array functions to them (``__array_ufunc__``, ``__array_function__``), and the result is
another meta array of the right shape and dtype — computed by the same rules numpy
uses (broadcasting, ``np.result_type``, and, for indexing and views, numpy itself on a
zero-strided stand-in that occupies one element of memory). Values are not computed:
``float(meta)`` is 0.0 and comparisons give meta arrays of booleans, so a program whose
control flow depends on data cannot be traced (it gets a clear error where it matters).

Every array operation (a ufunc or operator, a numpy function, indexing, reshape...) is
``counted`` for the host-work accounting of :mod:`vcluster.runtime.tracing.host`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from types import MappingProxyType

import numpy as np

from .host import counted

__all__ = ["MetaArray", "meta_like", "is_meta"]


@lru_cache(maxsize=4096)   # pure: a read-only stand-in per (shape, dtype); views use it
def _standin(shape: tuple, dtype) -> np.ndarray:
    """A read-only array of ``shape`` backed by a single element (one per shape and
    dtype: nothing writes to it)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape,
                                           strides=(0,) * len(shape), writeable=False)


@lru_cache(maxsize=4096)   # pure: operand shapes -> their broadcast shape
def _broadcast_cached(shapes: tuple) -> tuple:
    return tuple(np.broadcast_shapes(*shapes))


def _broadcast(shapes: list) -> tuple:
    """numpy's broadcast shape of ``shapes`` (tuples); equal shapes, the common case, at
    once."""
    first = shapes[0]
    for s in shapes:
        if s != first:
            return _broadcast_cached(tuple(shapes))
    return first


def _meta(shape: tuple, dtype: np.dtype) -> "MetaArray":
    """A MetaArray of a shape that is already a tuple of ints and a dtype that is already
    an ``np.dtype`` (what numpy's own results are): no conversion."""
    m = object.__new__(MetaArray)
    m.shape, m.dtype = shape, dtype
    return m


def _dtype_of(x):
    if isinstance(x, MetaArray):
        return x.dtype
    if isinstance(x, np.ndarray):
        return x.dtype
    return np.asarray(x).dtype if not isinstance(x, (int, float, complex, bool)) else None


def _shape_of(x):
    return x.shape if isinstance(x, (MetaArray, np.ndarray)) else np.shape(x)


_SCALARS = (int, float, complex, bool)


@lru_cache(maxsize=4096)   # pure: (ufunc, operand kinds) -> dtype; tracing calls it per op
def _probe_dtype(ufunc, kinds) -> np.dtype:
    """The dtype ``ufunc`` gives for operands of these dtypes / Python scalar types."""
    with np.errstate(all="ignore"):
        return ufunc(*[k(1) if isinstance(k, type) else np.ones(1, k) for k in kinds]).dtype


def _kind(x):
    """What decides ``x``'s part in a result dtype: its dtype, or its Python scalar type."""
    t = type(x)
    if t is MetaArray or t is np.ndarray:
        return x.dtype
    return t if isinstance(x, _SCALARS) else (_dtype_of(x) or np.asarray(x).dtype)


def _result_dtype(inputs, ufunc=None):
    kinds = tuple(map(_kind, inputs))
    if ufunc is not None and ufunc.nout == 1 and ufunc.types:
        return _probe_dtype(ufunc, kinds)
    arrays = [k for k in kinds if not isinstance(k, type)]
    scalars = [x for x in inputs if isinstance(x, _SCALARS)]
    return np.result_type(*arrays, *scalars)


def _index(key):
    """``key`` with its meta arrays (traced integer index arrays) replaced by stand-ins of
    their shape and dtype: numpy then works out the indexed shape."""
    keys = key if isinstance(key, tuple) else (key,)
    if not any(isinstance(k, MetaArray) for k in keys):
        return key
    out = []
    for k in keys:
        if isinstance(k, MetaArray):
            if k.dtype.kind not in "iu":
                raise TypeError(f"tracing: indexing by a meta array of {k.dtype} (a boolean "
                                "mask's result depends on values); index by integer arrays")
            k = _standin(tuple(k.shape), k.dtype)
        out.append(k)
    return tuple(out) if isinstance(key, tuple) else out[0]


class MetaArray:
    """Shape and dtype only; see the module docstring."""

    __array_priority__ = 1000

    def __init__(self, shape, dtype=np.float64):
        self.shape = tuple(map(int, shape))
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)

    def __repr__(self) -> str:
        return f"MetaArray(shape={self.shape}, dtype={self.dtype})"

    # --- attributes -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    @counted
    def T(self) -> "MetaArray":
        return MetaArray(self.shape[::-1], self.dtype)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d meta array")
        return self.shape[0]

    def __float__(self) -> float:
        return 0.0

    def __int__(self) -> int:
        return 0

    def __bool__(self):
        raise TypeError("tracing: a program branched on array values, which a trace does "
                        "not compute; make control flow depend on shapes only")

    def __array__(self, dtype=None, copy=None):
        raise TypeError("tracing: a meta array cannot become a real numpy array (np.array/"
                        "np.asarray); use x.copy() or numpy functions on it instead")

    # --- views and copies -------------------------------------------------------------
    def _view(self, fn) -> "MetaArray":
        out = fn(_standin(self.shape, self.dtype))
        return _meta(out.shape, out.dtype)

    @counted
    def __getitem__(self, key) -> "MetaArray":
        key = _index(key)
        return self._view(lambda a: a[key])

    @counted
    def __setitem__(self, key, value) -> None:
        key = _index(key)
        self._view(lambda a: a[key])      # validates the index, writes nothing

    @counted
    def reshape(self, *shape, order="C") -> "MetaArray":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if not all(type(n) is int for n in shape):
            shape = tuple(int(n) for n in shape)
        if shape.count(-1) == 1:
            known = 1
            for n in shape:
                if n != -1:
                    known *= n
            if known and self.size % known == 0:
                shape = tuple(self.size // known if n == -1 else n for n in shape)
        total = 1
        for n in shape:
            total *= n
        if -1 in shape or total != self.size:
            raise ValueError(f"cannot reshape a meta array of size {self.size} into "
                             f"shape {shape}")
        return _meta(shape, self.dtype)

    @counted
    def transpose(self, *axes) -> "MetaArray":
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        if not axes:
            return MetaArray(self.shape[::-1], self.dtype)
        if sorted(a % self.ndim for a in axes) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} do not match a meta array of {self.ndim} dims")
        return MetaArray(tuple(self.shape[a] for a in axes), self.dtype)

    @counted
    def view(self, dtype) -> "MetaArray":
        dtype = np.dtype(dtype)
        if dtype.itemsize == self.itemsize or not self.shape:
            return MetaArray(self.shape, dtype)
        last = self.shape[-1] * self.itemsize
        if last % dtype.itemsize:
            raise ValueError(f"view: cannot view {self.dtype} of shape {self.shape} as {dtype}")
        return MetaArray(self.shape[:-1] + (last // dtype.itemsize,), dtype)

    @counted
    def ravel(self) -> "MetaArray":
        return MetaArray((self.size,), self.dtype)

    @counted
    def copy(self, order="C") -> "MetaArray":
        return MetaArray(self.shape, self.dtype)

    @counted
    def astype(self, dtype, copy=True) -> "MetaArray":
        return MetaArray(self.shape, dtype)

    def _reduce(self, axis=None, keepdims=False, dtype=None) -> "MetaArray":
        nd = self.ndim
        axes = range(nd) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
        axes = {a % nd if nd else 0 for a in axes}
        shape = tuple(1 if i in axes else n for i, n in enumerate(self.shape)) if keepdims \
            else tuple(n for i, n in enumerate(self.shape) if i not in axes)
        return MetaArray(shape, dtype or self.dtype)

    @counted
    def sum(self, axis=None, dtype=None, keepdims=False, **_):
        return self._reduce(axis, keepdims, dtype)

    @counted
    def mean(self, axis=None, dtype=None, keepdims=False, **_):
        return self._reduce(axis, keepdims, dtype or np.result_type(self.dtype, np.float64))

    @counted
    def max(self, axis=None, keepdims=False, **_):
        return self._reduce(axis, keepdims)

    @counted
    def min(self, axis=None, keepdims=False, **_):
        return self._reduce(axis, keepdims)

    # --- arithmetic through numpy's ufunc protocol -----------------------------------
    def _binary(name):
        @counted
        def op(self, other):
            return getattr(np, name)(self, other)

        @counted
        def rop(self, other):
            return getattr(np, name)(other, self)
        return op, rop

    __add__, __radd__ = _binary("add")
    __sub__, __rsub__ = _binary("subtract")
    __mul__, __rmul__ = _binary("multiply")
    __truediv__, __rtruediv__ = _binary("true_divide")
    __pow__, __rpow__ = _binary("power")
    __matmul__, __rmatmul__ = _binary("matmul")
    __gt__, _ = _binary("greater")
    __lt__, _ = _binary("less")
    __ge__, _ = _binary("greater_equal")
    __le__, _ = _binary("less_equal")
    del _binary

    @counted
    def __neg__(self):
        return np.negative(self)

    @counted
    def __iadd__(self, other):
        return np.add(self, other, out=self)

    @counted
    def __isub__(self, other):
        return np.subtract(self, other, out=self)

    @counted
    def __imul__(self, other):
        return np.multiply(self, other, out=self)

    @counted
    def __itruediv__(self, other):
        return np.true_divide(self, other, out=self)

    @counted
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if method == "reduce":
            (x,) = inputs
            return x._reduce(kwargs.get("axis", 0), kwargs.get("keepdims", False))
        if method != "__call__":
            raise TypeError(f"tracing does not support numpy.{ufunc.__name__}.{method}")
        if ufunc is np.matmul:
            shape = _matmul_shape(_shape_of(inputs[0]), _shape_of(inputs[1]))
        else:
            shape = _broadcast([_shape_of(x) for x in inputs])
        dtype = _result_dtype(inputs, ufunc)
        if out is not None:
            target = out[0] if isinstance(out, tuple) else out
            return target
        return _meta(shape, dtype)

    @counted
    def __array_function__(self, func, types, args, kwargs):
        impl = _FUNCTIONS.get(func)
        if impl is None:
            raise TypeError(f"tracing does not support numpy.{func.__name__} on meta arrays")
        return impl(*args, **kwargs)


def _matmul_shape(a, b) -> tuple:
    if len(a) < 1 or len(b) < 1:
        raise ValueError("matmul: 0-d operand")
    if a[-1] != (b[-2] if len(b) > 1 else b[0]):
        raise ValueError(f"matmul: shapes {a} and {b} do not align")
    if len(b) == 1:
        return tuple(a[:-1])
    if len(a) == 1:
        return tuple(b[:-2]) + (b[-1],)
    batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    return tuple(batch) + (a[-2], b[-1])


def meta_like(x) -> MetaArray:
    """A meta array with the shape and dtype of ``x`` (numpy array or meta array)."""
    return MetaArray(np.shape(x), x.dtype)


def is_meta(x) -> bool:
    return isinstance(x, MetaArray)


def _like(x, dtype=None, shape=None, **_):
    return MetaArray(x.shape if shape is None else shape, dtype or x.dtype)


def _split(x, indices_or_sections, axis=0):
    pieces = np.split(_standin(x.shape, x.dtype), indices_or_sections, axis=axis)
    return [MetaArray(p.shape, x.dtype) for p in pieces]


def _concatenate(arrays, axis=0, out=None, dtype=None, **_):
    arrays = list(arrays)
    if axis is None:
        shape = (sum(a.size for a in arrays),)
    else:
        first = arrays[0].shape
        ax = axis % len(first)
        for a in arrays[1:]:
            if len(a.shape) != len(first) or any(x != y for i, (x, y) in
                                                  enumerate(zip(a.shape, first)) if i != ax):
                raise ValueError(f"concatenate: shapes {first} and {a.shape} do not match "
                                 f"outside axis {axis}")
        shape = first[:ax] + (sum(a.shape[ax] for a in arrays),) + first[ax + 1:]
    res = MetaArray(shape, dtype or np.result_type(*[a.dtype for a in arrays]))
    return out if out is not None else res


def _copyto(dst, src, casting="same_kind", where=True):
    np.broadcast_shapes(_shape_of(src), dst.shape)
    return None


def _arange(start, stop=None, step=1, dtype=None, **_) -> "MetaArray":
    """``np.arange(..., like=meta)``: a shape-only range (dtype as numpy would pick)."""
    bounds = (start, stop, step) if stop is not None else (0, start, step)
    if all(isinstance(b, (int, np.integer)) for b in bounds):
        return MetaArray((len(range(*bounds)),), np.dtype(dtype or np.int_))
    real = np.arange(*bounds, dtype=dtype)          # floats: numpy's own count and dtype
    return MetaArray(real.shape, real.dtype)


_FUNCTIONS = MappingProxyType({
    np.arange: _arange,
    np.split: _split,
    np.array_split: lambda x, n, axis=0: [MetaArray(p.shape, x.dtype) for p in
                                          np.array_split(_standin(x.shape, x.dtype), n, axis)],
    np.concatenate: _concatenate,
    np.copyto: _copyto,
    np.zeros_like: _like, np.empty_like: _like, np.ones_like: _like,
    np.ascontiguousarray: lambda x, dtype=None, **_: MetaArray(x.shape, dtype or x.dtype),
    np.moveaxis: lambda x, s, d: x._view(lambda a: np.moveaxis(a, s, d)),
    np.transpose: lambda x, axes=None: x._view(lambda a: np.transpose(a, axes)),
    np.reshape: lambda x, shape, **_: x.reshape(shape),
    np.sum: lambda x, axis=None, dtype=None, keepdims=False, **_: x.sum(axis, dtype, keepdims),
    np.mean: lambda x, axis=None, dtype=None, keepdims=False, **_: x.mean(axis, dtype, keepdims),
    np.max: lambda x, axis=None, keepdims=False, **_: x.max(axis, keepdims),
    np.amax: lambda x, axis=None, keepdims=False, **_: x.max(axis, keepdims),
    np.min: lambda x, axis=None, keepdims=False, **_: x.min(axis, keepdims),
    np.shape: lambda x: x.shape,
    np.ndim: lambda x: x.ndim,
    np.size: lambda x, axis=None: x.size if axis is None else x.shape[axis],
    np.result_type: lambda *a: np.result_type(*[getattr(x, "dtype", x) for x in a]),
})
