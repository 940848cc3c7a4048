"""An immutable N-D mesh of ranks with named axes.

A mesh of shape ``(n_0, ..., n_{k-1})`` with axis names ``(a_0, ..., a_{k-1})``
holds ranks ``0 .. N-1`` where ``N = n_0 * ... * n_{k-1}``, laid out in
row-major (C) order: the rank at coordinates ``(c_0, ..., c_{k-1})`` is

    rank = sum_i c_i * s_i,    s_i = n_{i+1} * ... * n_{k-1}   (s_{k-1} = 1).

Groups.  For a tuple of axes ``A = (b_0, ..., b_{m-1})`` (listed major to
minor, in any order) the *group* of rank ``r`` over ``A`` is the set of ranks
sharing every coordinate outside ``A`` with ``r``, ordered by the row-major
position of their coordinates along ``A``:

    pos_A(r) = sum_j c_{b_j}(r) * t_j,    t_j = n_{b_{j+1}} * ... * n_{b_{m-1}}.

So ``group(A, r)[pos_A(r)] == r``, every group has ``prod_j n_{b_j}`` ranks,
and the groups over ``A`` partition the mesh.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Union

from .index import MeshIndex

__all__ = ["Mesh", "AxesArg"]

#: What ``axes`` arguments accept: one name, a sequence of names, or None (= all).
AxesArg = Union[str, Iterable[str], None]


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True, init=False, repr=False)
class Mesh:
    """``Mesh(shape, axes)``: ranks ``0..N-1`` in row-major order over named axes.

    ``shape`` is a tuple of positive ints, ``axes`` a tuple of distinct,
    non-empty identifier strings of the same length.  Equality and hashing
    use ``(dims, axes)``.  ``mesh.shape`` is a read-only ``{axis: size}``
    mapping; ``mesh.dims`` is the plain size tuple.
    """

    dims: tuple[int, ...]
    axes: tuple[str, ...]

    def __init__(self, shape: Iterable[int], axes: Iterable[str]) -> None:
        if not isinstance(shape, (tuple, list)):
            raise TypeError(
                f"Mesh: shape must be a tuple of positive ints, got {shape!r}"
            )
        if not isinstance(axes, (tuple, list)):
            raise TypeError(
                f"Mesh: axes must be a tuple of axis-name strings, got {axes!r}"
            )
        dims = []
        for n in shape:
            if isinstance(n, bool):
                raise TypeError(
                    f"Mesh: shape must be a tuple of positive ints, got {tuple(shape)!r}"
                )
            try:
                n = operator.index(n)
            except TypeError:
                raise TypeError(
                    f"Mesh: shape must be a tuple of positive ints, got {tuple(shape)!r}"
                ) from None
            if n < 1:
                raise ValueError(
                    f"Mesh: shape must be a tuple of positive ints, got {tuple(shape)!r}"
                )
            dims.append(n)
        names = tuple(axes)
        for a in names:
            if not isinstance(a, str):
                raise TypeError(
                    f"Mesh: axes must be strings, got {a!r} in axes={names!r}"
                )
            if not a.isidentifier():
                raise ValueError(
                    f"Mesh: axis names must be non-empty identifiers, got {a!r} "
                    f"in axes={names!r}"
                )
        if len(set(names)) != len(names):
            dup = next(a for a in names if names.count(a) > 1)
            raise ValueError(
                f"Mesh: axis names must be distinct, got {dup!r} repeated in "
                f"axes={names!r}"
            )
        if len(dims) != len(names):
            raise ValueError(
                f"Mesh: shape={tuple(dims)!r} and axes={names!r} must have the "
                f"same length ({len(dims)} != {len(names)})"
            )
        object.__setattr__(self, "dims", tuple(dims))
        object.__setattr__(self, "axes", names)

    # ----------------------------------------------------------- basic facts
    @property
    def shape(self) -> Mapping[str, int]:
        """Read-only mapping ``axis -> size`` in axis order."""
        return MappingProxyType(dict(zip(self.axes, self.dims)))

    @property
    def size(self) -> int:
        """Number of ranks ``N = prod(dims)``."""
        return _prod(self.dims)

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.dims)

    def __reduce__(self):
        return (Mesh, (self.dims, self.axes))

    def __repr__(self) -> str:
        return f"Mesh(shape={self.dims!r}, axes={self.axes!r})"

    def __str__(self) -> str:
        inner = ", ".join(f"{a}={n}" for a, n in zip(self.axes, self.dims))
        return f"Mesh({inner})"

    def _repr_html_(self) -> str:
        """Rank tables for notebooks (see :func:`mesh.html.mesh_html`)."""
        from .html import mesh_html
        return mesh_html(self)

    # ------------------------------------------------------- rank <-> index
    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool):
            raise TypeError(f"{self}: rank must be an int, got {rank!r}")
        try:
            r = operator.index(rank)
        except TypeError:
            raise TypeError(f"{self}: rank must be an int, got {rank!r}") from None
        if not 0 <= r < self.size:
            raise ValueError(
                f"{self}: rank {r} is out of range; valid ranks are 0..{self.size - 1}"
            )
        return r

    def index(self, rank: int) -> MeshIndex:
        """Coordinates of ``rank``: ``c_i = (rank // s_i) % n_i``."""
        r = self._check_rank(rank)
        coords = []
        for n in reversed(self.dims):
            coords.append(r % n)
            r //= n
        return MeshIndex(reversed(coords), self.axes)

    def rank(self, index: Union[MeshIndex, tuple, Mapping[str, int]]) -> int:
        """Rank at ``index`` (a MeshIndex, a tuple, or a dict ``axis -> coord``)."""
        if isinstance(index, Mapping):
            keys = tuple(index)
            if set(keys) != set(self.axes) or len(keys) != self.ndim:
                raise ValueError(
                    f"{self}: index dict must have exactly the keys {self.axes!r}, "
                    f"got {keys!r}"
                )
            coords = tuple(index[a] for a in self.axes)
        elif isinstance(index, MeshIndex):
            if index.axes != self.axes:
                raise ValueError(
                    f"{self}: index {index!r} has axes {index.axes!r}, expected "
                    f"{self.axes!r}"
                )
            coords = tuple(index)
        elif isinstance(index, (tuple, list)):
            coords = tuple(index)
        else:
            raise TypeError(
                f"{self}: index must be a MeshIndex, tuple or dict, got {index!r}"
            )
        if len(coords) != self.ndim:
            raise ValueError(
                f"{self}: index {coords!r} has {len(coords)} coordinates, "
                f"expected {self.ndim} for axes {self.axes!r}"
            )
        r = 0
        for a, n, c in zip(self.axes, self.dims, coords):
            if isinstance(c, bool):
                raise TypeError(f"{self}: coordinate {a}={c!r} must be an int")
            try:
                c = operator.index(c)
            except TypeError:
                raise TypeError(f"{self}: coordinate {a}={c!r} must be an int") from None
            if not 0 <= c < n:
                raise ValueError(
                    f"{self}: coordinate {a}={c} is out of range; valid values "
                    f"are 0..{n - 1}"
                )
            r = r * n + c
        return r

    # ---------------------------------------------------------- axes helpers
    def axis_tuple(self, axes: AxesArg) -> tuple[str, ...]:
        """Normalise an axes argument: name -> (name,), sequence -> tuple, None -> all."""
        if axes is None:
            return self.axes
        if isinstance(axes, str):
            names: tuple = (axes,)
        elif isinstance(axes, (tuple, list)):
            names = tuple(axes)
        else:
            raise TypeError(
                f"{self}: axes must be an axis name, a tuple of names or None, "
                f"got {axes!r}"
            )
        for a in names:
            if not isinstance(a, str):
                raise TypeError(
                    f"{self}: axis names must be str, got {a!r} in axes={names!r}"
                )
            if a not in self.axes:
                raise ValueError(
                    f"axis {a!r} is not one of the mesh's axes {self.axes!r}"
                )
        if len(set(names)) != len(names):
            dup = next(a for a in names if names.count(a) > 1)
            raise ValueError(
                f"axis {dup!r} is repeated in axes={names!r}; the mesh's axes "
                f"are {self.axes!r}"
            )
        return names

    def axis_size(self, axes: AxesArg) -> int:
        """``prod(n_b for b in axes)``; None -> ``size``; () -> 1."""
        return _prod(self.dims[self.axes.index(a)] for a in self.axis_tuple(axes))

    # ---------------------------------------------------------------- groups
    def group(self, axes: AxesArg, rank: int) -> tuple[int, ...]:
        """Ranks sharing all coordinates outside ``axes`` with ``rank``.

        Ordered by row-major position along ``axes`` (first axis major).
        """
        names = self.axis_tuple(axes)
        coords = list(self.index(rank))
        pos = [self.axes.index(a) for a in names]
        out = []
        for combo in itertools.product(*(range(self.dims[p]) for p in pos)):
            for p, c in zip(pos, combo):
                coords[p] = c
            out.append(self._ravel(coords))
        return tuple(out)

    def groups(self, axes: AxesArg) -> tuple[tuple[int, ...], ...]:
        """All groups over ``axes``, ordered row-major by the coordinates outside ``axes``."""
        names = self.axis_tuple(axes)
        others = [p for p, a in enumerate(self.axes) if a not in names]
        out = []
        for combo in itertools.product(*(range(self.dims[p]) for p in others)):
            coords = [0] * self.ndim
            for p, c in zip(others, combo):
                coords[p] = c
            out.append(self.group(names, self._ravel(coords)))
        return tuple(out)

    def group_position(self, axes: AxesArg, rank: int) -> int:
        """``pos_A(rank)``: the position of ``rank`` within ``group(axes, rank)``."""
        names = self.axis_tuple(axes)
        idx = self.index(rank)
        pos = 0
        for a in names:
            pos = pos * self.dims[self.axes.index(a)] + idx[a]
        return pos

    def _ravel(self, coords) -> int:
        r = 0
        for n, c in zip(self.dims, coords):
            r = r * n + c
        return r
