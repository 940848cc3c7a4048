"""Layout types: how a tensor is laid out over a named mesh.

A :class:`TensorSharding` assigns to every tensor dimension ``d`` a tuple of
mesh axes ``A_d = (a_1, ..., a_m)`` (a :class:`DimSharding`, major to minor)
and names a tuple of mesh axes ``P`` over which the value is *partial*.

* Dimension ``d`` of size ``L_d`` is cut into ``k_d = prod_j |a_j|`` equal
  contiguous pieces of length ``L_d / k_d`` (``k_d`` must divide ``L_d``);
  rank ``r`` holds piece ``pos_{A_d}(r)``, the row-major position of its
  coordinates along ``A_d`` (see :mod:`mesh`).  ``A_d = ()`` means replicated.
* Partial over ``P``: the global value is ``sum_{q in group(P, r)} local_q``.
* Every mesh axis is used at most once: in one dimension, or in ``P``, or not
  at all (then the local arrays are replicas along that axis).

Like JAX ``PartitionSpec`` / PyTorch DTensor ``Shard`` / ``Replicate`` /
``Partial`` placements.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

if TYPE_CHECKING:  # pragma: no cover
    from mesh import Mesh

__all__ = ["DimSharding", "TensorSharding", "DimArg", "check_sharding", "check_shape"]


def _axes_from(value, what: str) -> tuple[str, ...]:
    """None -> (), "x" -> ("x",), ("x", "y") -> ("x", "y"); validated."""
    if value is None:
        return ()
    if isinstance(value, str):
        names: tuple = (value,)
    elif isinstance(value, (tuple, list)):
        names = tuple(value)
    else:
        raise TypeError(
            f"{what} must be None, an axis name or a tuple of axis names, got {value!r}"
        )
    for a in names:
        if not isinstance(a, str):
            raise TypeError(f"{what}: axis names must be str, got {a!r} in {value!r}")
        if not a.isidentifier():
            raise ValueError(
                f"{what}: axis names must be non-empty identifiers, got {a!r} in {value!r}"
            )
    for a in names:
        if names.count(a) > 1:
            raise ValueError(f"{what}: mesh axis {a!r} is used twice in {names!r}")
    return names


@dataclass(frozen=True)
class DimSharding:
    """The mesh axes (major to minor) splitting one tensor dimension; () = replicated.

    ``DimSharding(None)`` and ``DimSharding()`` are replicated,
    ``DimSharding("tp")`` splits over ``tp``, ``DimSharding(("dp", "tp"))``
    splits into ``|dp| * |tp|`` pieces with ``dp`` major.
    """

    axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", _axes_from(self.axes, "DimSharding axes"))

    @property
    def is_replicated(self) -> bool:
        """True when no mesh axis splits this dimension."""
        return not self.axes

    def shorthand(self):
        """The compact form ``TensorSharding`` accepts: None, a name, or a tuple."""
        if not self.axes:
            return None
        if len(self.axes) == 1:
            return self.axes[0]
        return self.axes

    def __str__(self) -> str:
        return "R" if not self.axes else f"S({','.join(self.axes)})"


#: What one dimension of ``TensorSharding(...)`` accepts.
DimArg = Union[DimSharding, str, Sequence[str], None]


@dataclass(frozen=True, init=False, repr=False)
class TensorSharding:
    """``TensorSharding(*dims, partial=())``: one DimSharding per tensor dimension.

    Each of ``dims`` is a :class:`DimSharding` or its shorthand (None, an axis
    name, a tuple of names); ``partial`` is an axis name or tuple of names over
    which the value is an unreduced sum.  No mesh axis may appear twice.
    """

    dims: tuple[DimSharding, ...]
    partial: tuple[str, ...]

    def __init__(self, *dims: DimArg, partial: Union[str, Sequence[str], None] = ()) -> None:
        parsed = tuple(d if isinstance(d, DimSharding) else DimSharding(d) for d in dims)
        part = _axes_from(partial, "TensorSharding partial")
        seen: dict[str, str] = {}
        for i, d in enumerate(parsed):
            for a in d.axes:
                if a in seen:
                    raise ValueError(
                        f"TensorSharding: mesh axis {a!r} is used twice "
                        f"({seen[a]} and dimension {i})"
                    )
                seen[a] = f"dimension {i}"
        for a in part:
            if a in seen:
                raise ValueError(
                    f"TensorSharding: mesh axis {a!r} is used twice "
                    f"({seen[a]} and partial)"
                )
        object.__setattr__(self, "dims", parsed)
        object.__setattr__(self, "partial", part)

    @classmethod
    def replicated(cls, ndim: int) -> "TensorSharding":
        """Fully replicated sharding of an ``ndim``-dimensional tensor."""
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
            raise ValueError(
                f"TensorSharding.replicated: ndim must be a non-negative int, got {ndim!r}"
            )
        return cls(*([None] * ndim))

    @property
    def ndim(self) -> int:
        """Number of tensor dimensions described."""
        return len(self.dims)

    @property
    def split_axes(self) -> tuple[str, ...]:
        """All mesh axes that split some dimension, in dimension order."""
        return tuple(a for d in self.dims for a in d.axes)

    @property
    def used_axes(self) -> tuple[str, ...]:
        """Split axes followed by partial axes."""
        return self.split_axes + self.partial

    def validate(self, mesh: "Mesh", shape: Optional[Sequence[int]] = None) -> None:
        """Same as ``check_sharding(self, mesh, shape)``."""
        check_sharding(self, mesh, shape)

    def __reduce__(self):
        return (_rebuild, (tuple(self.dims), self.partial))

    def __repr__(self) -> str:
        parts = [repr(d.shorthand()) for d in self.dims]
        if self.partial:
            parts.append(f"partial={self.partial!r}")
        return f"TensorSharding({', '.join(parts)})"

    def __str__(self) -> str:
        body = "[" + ", ".join(str(d) for d in self.dims) + "]"
        if self.partial:
            body += f" P({','.join(self.partial)})"
        return body

    def _repr_html_(self) -> str:
        """A table of the layout for notebooks (see :mod:`sharding.html`)."""
        from .html import sharding_html
        return sharding_html(self)


def _rebuild(dims: tuple, partial: tuple) -> TensorSharding:
    return TensorSharding(*dims, partial=partial)


def check_shape(shape: Iterable[int]) -> tuple[int, ...]:
    """Validate a global array shape (a sequence of non-negative ints) -> tuple."""
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    out = []
    for n in shape:
        if isinstance(n, bool):
            raise TypeError(f"shape must be a tuple of non-negative ints, got {shape!r}")
        try:
            n = operator.index(n)
        except TypeError:
            raise TypeError(
                f"shape must be a tuple of non-negative ints, got {shape!r}"
            ) from None
        if n < 0:
            raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
        out.append(n)
    return tuple(out)


def check_sharding(
    sharding: TensorSharding, mesh: "Mesh", shape: Optional[Sequence[int]] = None
) -> None:
    """Check ``sharding`` against ``mesh`` (and a global ``shape`` if given).

    Raises ValueError for an axis not in the mesh, an ndim mismatch, or a
    dimension ``d`` whose size is not divisible by ``k_d = prod |A_d|``.
    """
    if not isinstance(sharding, TensorSharding):
        raise TypeError(f"sharding must be a TensorSharding, got {sharding!r}")
    for a in sharding.used_axes:
        if a not in mesh.axes:
            raise ValueError(
                f"sharding {sharding} uses mesh axis {a!r}, which is not one of "
                f"the mesh's axes {mesh.axes!r}"
            )
    if shape is None:
        return
    dims = check_shape(shape)
    if len(dims) != sharding.ndim:
        raise ValueError(
            f"shape {dims!r} has {len(dims)} dimensions but sharding {sharding} "
            f"describes {sharding.ndim}"
        )
    for i, (n, d) in enumerate(zip(dims, sharding.dims)):
        k = mesh.axis_size(d.axes)
        if n % k:
            raise ValueError(
                f"dimension {i} of size {n} does not split evenly into {k} shards "
                f"over mesh axes {d.axes!r}"
            )
