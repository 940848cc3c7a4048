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


def pack(obj, arena: Arena, keep: list,
         placed: dict | None = None) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Pickle ``obj``; large buffers go to ``arena`` (their blocks are appended to keep).

    ``placed`` maps (address, nbytes) of buffers already copied to ``arena`` to their
    offset: pass one dict to the ``pack`` calls of one ``run`` so that an array shared by
    the arguments of many ranks (a model's parameters) is copied to the arena once.
    """
    locations: list[tuple[int, int, int]] = []

    def place(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True                       # in band
        src = np.frombuffer(raw, np.uint8)
        offset = arena.offset_of(src)
        key = (src.__array_interface__["data"][0], raw.nbytes)
        if offset is None and placed is not None:
            offset = placed.get(key)
        if offset is None:
            block = arena.empty((raw.nbytes,), np.uint8)
            if block is None:
                return True                   # no room: in band, slower but correct
            np.copyto(block, src)
            src, offset = block, arena.offset_of(block)
            if placed is not None:
                placed[key] = offset
        keep.append(src)
        locations.append((arena.owner, offset, raw.nbytes))
        return False

    data = dumps(obj, buffer_callback=place)
    return data, locations


def _code_in_file(rebuild, args, filename: str):
    """The code object cloudpickle rebuilds, with its source file name put back."""
    return rebuild(*args).replace(co_filename=filename)


def _reduce_code(code):
    rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return _code_in_file, (rebuild, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except that code sent by value keeps ``co_filename``."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj, protocol: int = 5, buffer_callback=None) -> bytes:
    """``cloudpickle.dumps`` whose functions sent by value keep their source file names
    (in tracebacks and ``fn.__code__.co_filename`` on the device)."""
    with io.BytesIO() as out:
        _Pickler(out, protocol=protocol, buffer_callback=buffer_callback).dump(obj)
        return out.getvalue()


def unpack(data: bytes, locations, arenas: dict[int, Arena], into: Arena | None):
    """Unpickle; copy each buffer into ``into`` (an arena) or private memory if None.

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
    return pickle.loads(data, buffers=buffers), copied
