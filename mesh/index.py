"""Coordinates of a rank in a named device mesh.

A :class:`MeshIndex` is a tuple of integer coordinates ``(c_0, ..., c_{n-1})``
that also remembers the axis name of every position, so ``idx[1]`` and
``idx["tp"]`` both work.  It *is* a :class:`tuple`: equality and hashing are
those of the plain coordinate tuple, so ``MeshIndex((1, 1), ("dp", "tp")) ==
(1, 1)``.  (Two indices with the same coordinates but different axis names are
therefore equal too; the axis names are labels, not part of the value.)
"""

from __future__ import annotations

import operator
from typing import Iterable

__all__ = ["MeshIndex"]


class MeshIndex(tuple):
    """Tuple of mesh coordinates labelled with axis names.

    ``MeshIndex(coords, axes)`` with ``len(coords) == len(axes)``; every
    coordinate is a non-negative int and the axis names are distinct strings.
    Immutable, hashable (as the plain tuple) and picklable.
    """

    def __new__(cls, coords: Iterable[int], axes: Iterable[str]) -> "MeshIndex":
        if isinstance(coords, (str, bytes)) or not hasattr(coords, "__iter__"):
            raise TypeError(
                f"MeshIndex: coords must be an iterable of ints, got {coords!r}"
            )
        if isinstance(axes, (str, bytes)) or not hasattr(axes, "__iter__"):
            raise TypeError(
                f"MeshIndex: axes must be an iterable of str, got {axes!r}"
            )
        coords_t = tuple(coords)
        axes_t = tuple(axes)
        values = []
        for c in coords_t:
            if isinstance(c, bool):
                raise TypeError(f"MeshIndex: coords must be ints, got {coords_t!r}")
            try:
                c = operator.index(c)
            except TypeError:
                raise TypeError(
                    f"MeshIndex: coords must be ints, got {coords_t!r}"
                ) from None
            if c < 0:
                raise ValueError(
                    f"MeshIndex: coords must be non-negative, got {coords_t!r}"
                )
            values.append(c)
        if not all(isinstance(a, str) for a in axes_t):
            raise TypeError(f"MeshIndex: axes must be str, got {axes_t!r}")
        if len(set(axes_t)) != len(axes_t):
            raise ValueError(f"MeshIndex: axes must be distinct, got {axes_t!r}")
        if len(values) != len(axes_t):
            raise ValueError(
                f"MeshIndex: coords {coords_t!r} and axes {axes_t!r} must have "
                f"the same length ({len(values)} != {len(axes_t)})"
            )
        self = super().__new__(cls, values)
        object.__setattr__(self, "_axes", axes_t)
        return self

    @property
    def axes(self) -> tuple[str, ...]:
        """The axis name of every coordinate, in order."""
        return self._axes  # type: ignore[attr-defined]

    def __getitem__(self, key):  # type: ignore[override]
        """``idx[i]`` by position, ``idx["name"]`` by axis name, slices keep names."""
        if isinstance(key, str):
            try:
                pos = self.axes.index(key)
            except ValueError:
                raise KeyError(
                    f"MeshIndex: axis {key!r} is not one of {self.axes!r}"
                ) from None
            return tuple.__getitem__(self, pos)
        if isinstance(key, slice):
            return MeshIndex(tuple.__getitem__(self, key), self.axes[key])
        return tuple.__getitem__(self, key)

    def as_dict(self) -> dict[str, int]:
        """A fresh ``{axis: coordinate}`` dict in axis order."""
        return dict(zip(self.axes, self))

    def __setattr__(self, name, value):
        raise AttributeError(f"MeshIndex is immutable; cannot set {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"MeshIndex is immutable; cannot delete {name!r}")

    def __reduce__(self):
        return (MeshIndex, (tuple(self), self.axes))

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}={c}" for a, c in zip(self.axes, self))
        return f"MeshIndex({inner})"
