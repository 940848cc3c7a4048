"""What travels: supported dtypes, complex tensors as real pairs, shape headers, and
``TorchWork``, the handle of an asynchronous call on the torch engine."""

from __future__ import annotations

import datetime

import numpy as np

from vcluster.runtime.errors import CollectiveTimeout

__all__ = ["DTYPES", "MAX_NDIM", "TorchWork", "wait_work", "to_wire", "encode_header",
           "parse_header", "check_dtype"]

DTYPES = ("float16", "float32", "float64", "complex64", "complex128", "int8", "int16",
          "int32", "int64", "uint8", "bool")
MAX_NDIM = 16               # header: [dtype code, ndim, shape (padded to MAX_NDIM)]


def check_dtype(dtype, rank: int) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.name not in DTYPES:
        raise TypeError(f"rank {rank}: dtype {dtype} is not supported by the torch engine "
                        f"(supported: {', '.join(DTYPES)})")
    return dtype


def encode_header(x, rank: int) -> np.ndarray:
    """[dtype code, ndim, shape...] of ``x`` as int64 (zeros for None: a receive buffer)."""
    h = np.zeros(2 + MAX_NDIM, np.int64)
    if x is not None:
        if x.ndim > MAX_NDIM:
            raise ValueError(f"rank {rank}: arrays of more than {MAX_NDIM} dimensions are "
                             f"not supported, got {x.ndim}")
        h[0], h[1] = DTYPES.index(check_dtype(x.dtype, rank).name), x.ndim
        h[2:2 + x.ndim] = x.shape
    return h


def parse_header(h: np.ndarray) -> tuple[tuple, np.dtype]:
    return tuple(int(v) for v in h[2:2 + int(h[1])]), np.dtype(DTYPES[int(h[0])])


def to_wire(t):
    """What goes on the wire: complex tensors as real views (..., 2), as gloo wants."""
    if t.is_complex():
        import torch
        return torch.view_as_real(t)
    return t


class TorchWork:
    """Handle of an asynchronous call: waits the torch works, then ``finish()``."""

    def __init__(self, works, finish, describe):
        self._works, self._finish, self._describe = list(works), finish, describe
        self._done, self._value = False, None

    def __repr__(self) -> str:
        return f"TorchWork({self._describe()}, completed={self._done})"

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: float | None = None):
        if not self._done:
            for w in self._works:
                wait_work(w, timeout_s, self._describe)
            self._value = self._finish()
            self._done = True
        return self._value


def _wait(work, timeout_s, describe) -> None:
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CollectiveTimeout(f"{describe()} failed or timed out: {exc}") from exc


def wait_work(work, timeout_s, describe) -> None:
    """Wait a torch Work; a failure or timeout becomes a CollectiveTimeout naming
    ``describe()`` (the rank, the call and its group or peer)."""
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CollectiveTimeout(f"{describe()} failed or timed out: {exc}") from exc
