"""Content hashes of arrays: equal data gives equal hashes, on any machine.

The canonical bytes of an array are ``"<dtype>|<shape>|"`` (the little-endian dtype
string, e.g. ``<f8``, and the shape as comma-separated integers) followed by its
elements in C order, little-endian. ``sha256`` of those bytes is the array's hash: it
ignores memory layout (strides, Fortran order) and the host's byte order, and it differs
when the dtype or the shape differs even if the raw bytes are equal.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["canonical_bytes", "array_sha256"]


def canonical_bytes(x) -> bytes:
    """The canonical byte string of ``x`` (see the module docstring)."""
    a = np.asarray(x)
    le = a.dtype.newbyteorder("<")        # "|" (byte-sized) dtypes stay as they are
    data = np.ascontiguousarray(a, dtype=le)
    head = f"{le.str}|{','.join(str(n) for n in a.shape)}|".encode()
    return head + data.tobytes(order="C")


def array_sha256(x) -> str:
    """Hex sha256 of :func:`canonical_bytes`."""
    return hashlib.sha256(canonical_bytes(x)).hexdigest()
