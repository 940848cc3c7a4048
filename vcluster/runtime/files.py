"""Writing files atomically: a crash never leaves a half-written file behind."""

from __future__ import annotations

import os
import tempfile

__all__ = ["write_text_atomic", "write_bytes_atomic", "write_json"]


def write_text_atomic(path: str, text: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str, data: bytes) -> None:
    """``write_text_atomic`` for bytes (a PNG, say)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON, atomically."""
    import json
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
