"""Integer and number arguments, checked the same way in every layer.

It lives in the lowest layer so that every package may use it. An *int* is anything with
``__index__`` (Python and numpy integers) except a bool; a *number* is a real number
(``numbers.Real``: Python and numpy floats and ints) except a bool. A wrong type is a
``TypeError``, a value out of range a ``ValueError``, and both say::

    {what} must be an int >= 1, got 0
    {what} must be a number > 0, got nan

``what`` names the argument as the caller's user knows it (``"Schedule: microbatches"``).
"""

from __future__ import annotations

import math
import numbers
import operator

__all__ = ["as_int", "as_number"]


def _bounds(low, high, open_low: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {low}..{high}"
    if low is not None:
        return f" {'>' if open_low else '>='} {low}"
    return f" <= {high}" if high is not None else ""


def as_int(value, what: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` with ``low <= value <= high`` (either bound may be None)."""
    expected = f"{what} must be an int{_bounds(low, high)}, got {value!r}"
    if isinstance(value, bool):
        raise TypeError(expected)
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(expected) from None
    if (low is not None and n < low) or (high is not None and n > high):
        raise ValueError(expected)
    return n


def as_number(value, what: str, low: float | None = None, *, strict: bool = False,
              finite: bool = True) -> float:
    """``value`` as a ``float``, finite unless ``finite=False``, at least ``low`` (more than
    ``low`` with ``strict=True``)."""
    expected = f"{what} must be a{' finite' if finite else ''} number" \
               f"{_bounds(low, None, strict)}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(expected)
    x = float(value)
    if math.isnan(x) or (finite and math.isinf(x)) or \
            (low is not None and (x <= low if strict else x < low)):
        raise ValueError(expected)
    return x
