"""Integer arguments, checked the same way in every layer.

It lives in the lowest layer so that every package may use it. An *int* is anything with
``__index__`` (Python and numpy integers) except a bool. A wrong type is a ``TypeError``,
a value out of range a ``ValueError``, and both say::

    {what} must be an int >= 1, got 0

``what`` names the argument as the caller's user knows it (``"Schedule: microbatches"``).
"""

from __future__ import annotations

import operator

__all__ = ["as_int"]


def as_int(value, what: str, low: int | None = None) -> int:
    """``value`` as an ``int``, at least ``low`` unless ``low`` is None."""
    if type(value) is int:              # the common case: no conversion (a bool is not)
        n = value
    else:
        if isinstance(value, bool):
            raise TypeError(_expected(value, what, low))
        try:
            n = operator.index(value)
        except TypeError:
            raise TypeError(_expected(value, what, low)) from None
    if low is not None and n < low:
        raise ValueError(_expected(value, what, low))
    return n


def _expected(value, what: str, low: int | None) -> str:
    return f"{what} must be an int{'' if low is None else f' >= {low}'}, got {value!r}"
