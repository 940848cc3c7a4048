"""Moving Python objects between the host and a device without pickling array data.

Objects are pickled with protocol 5: arrays of at least ``OUT_OF_BAND_BYTES`` become
out-of-band buffers that are placed in the sender's shared-memory arena (in place when
they already live there) and sent as (owner, offset, nbytes) locations. The receiver
copies each buffer once — a device into its own arena, so inputs arrive resident and
collectives use them without staging; the host into private memory, so results
outlive the cluster. Functions and closures defined in ``__main__`` or a notebook
travel by value (cloudpickle), so starting devices never re-runs the user's script;
:func:`dumps` keeps their source file names, so that a device's traceback points at the
user's file (cloudpickle 3.1.3 and later write ``<dynamic-code>`` instead).
"""

from __future__ import annotations

import io
import pickle
import types
from collections import ChainMap

import cloudpickle
import numpy as np

from .arena import Arena

__all__ = ["pack", "unpack", "dumps", "OUT_OF_BAND_BYTES"]

OUT_OF_BAND_BYTES = 64 * 1024


def pack(obj, arena: Arena, keep: list, placed: dict | None = None,
         to_host=None) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Pickle ``obj``; large buffers go to ``arena`` (their blocks are appended to keep).

    ``to_host(x)``: a device's results cross to the host as numpy arrays: it returns the
    host copy of a device array ``x``, or None for any other object.
    ``placed`` maps (address, nbytes) of buffers already copied to ``arena`` to their
    offset: pass one dict to the ``pack`` calls of one ``run`` so that an array shared by
    the arguments of many ranks (a model's parameters) is copied to the arena once. An
    address names a buffer only while the buffer lives, so the dict holds each buffer it
    names: the contiguous copy the pickler makes of a strided array is freed as soon as it
    is written, and the next copy of the same size often gets the same address — keyed
    by address alone, that array would silently travel as the earlier one's data.
    """
    locations: list[tuple[int, int, int]] = []

    def place(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True                       # in band
        src = np.frombuffer(raw, np.uint8)
        offset = arena.offset_of(src)
        key = (src.__array_interface__["data"][0], raw.nbytes)
        if offset is None and placed is not None and key in placed:
            offset = placed[key][0]
        if offset is None:
            block = arena.empty((raw.nbytes,), np.uint8)
            if block is None:
                return True                   # no room: in band, slower but correct
            np.copyto(block, src)
            src, offset = block, arena.offset_of(block)
            if placed is not None:
                placed[key] = (offset, buffer)      # the buffer, so its address stays its own
        keep.append(src)
        locations.append((arena.owner, offset, raw.nbytes))
        return False

    data = dumps(obj, buffer_callback=place, to_host=to_host)
    return data, locations


def _code_in_file(rebuild, args, filename: str):
    """The code object cloudpickle rebuilds, with its source file name put back."""
    return rebuild(*args).replace(co_filename=filename)


def _reduce_code(code):
    rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return _code_in_file, (rebuild, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except that code sent by value keeps ``co_filename``, a
    strided array travels as a contiguous copy (numpy pickles those through
    ``_frombuffer``, which :func:`unpack` can move to a device), and device arrays
    become host arrays through ``to_host``."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file, protocol, buffer_callback, to_host):
        super().__init__(file, protocol=protocol, buffer_callback=buffer_callback)
        self._to_host = to_host

    def reducer_override(self, obj):
        if type(obj) is np.ndarray:
            if obj.flags.c_contiguous or obj.flags.f_contiguous or obj.dtype.hasobject:
                return NotImplemented
            return obj.copy(order="C").__reduce_ex__(5)
        if self._to_host is not None:
            host = self._to_host(obj)
            if host is not None:
                return host.__reduce_ex__(5) if host.flags.c_contiguous else \
                    host.copy(order="C").__reduce_ex__(5)
        return super().reducer_override(obj)


def dumps(obj, protocol: int = 5, buffer_callback=None, to_host=None) -> bytes:
    """``cloudpickle.dumps`` whose functions sent by value keep their source file names
    (in tracebacks and ``fn.__code__.co_filename`` on the device); see :class:`_Pickler`
    for arrays."""
    with io.BytesIO() as out:
        _Pickler(out, protocol, buffer_callback, to_host).dump(obj)
        return out.getvalue()


_FROMBUFFER = {("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer")}


class _Unpickler(pickle.Unpickler):
    """Unpickles every (non-object) numpy array straight onto a device: numpy rebuilds
    each through ``_frombuffer`` (strided ones were made contiguous by the pickler)."""

    def __init__(self, file, buffers, to_device):
        super().__init__(file, buffers=buffers)
        self._to_device = to_device

    def find_class(self, module, name):
        found = super().find_class(module, name)
        if (module, name) not in _FROMBUFFER:
            return found
        to_device = self._to_device

        def frombuffer_on_device(*args):
            return to_device(found(*args))

        return frombuffer_on_device


def unpack(data: bytes, locations, arenas: dict[int, Arena], into: Arena | None,
           to_device=None):
    """Unpickle; copy each buffer into ``into`` (an arena) or private memory if None;
    ``to_device(host_array)``, if given, makes every array a device array.

    Returns (object, bytes copied).
    """
    buffers, copied = [], 0
    for owner, offset, nbytes in locations:
        src = arenas[owner].view(offset, (nbytes,), np.uint8)
        dst = into.empty((nbytes,), np.uint8) if into is not None else None
        if dst is None:
            dst = np.empty(nbytes, np.uint8)
        np.copyto(dst, src)
        buffers.append(dst)
        copied += nbytes
    if to_device is None:
        return pickle.loads(data, buffers=buffers), copied
    with io.BytesIO(data) as file:
        return _Unpickler(file, buffers, to_device).load(), copied
