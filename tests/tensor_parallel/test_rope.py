"""Rotary tables: real on an emulated device, shape-only in a trace, the same declared work."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

from tensor_parallel.gqa import Rope
from vcluster.runtime.tracing import is_meta


class _Declared:
    """A device that records what each compute block declares."""

    def __init__(self):
        self.blocks = []

    @contextlib.contextmanager
    def compute(self, name, flops, bytes, kernel):
        self.blocks.append((name, flops, bytes, kernel))
        yield


def test_a_traced_programs_tables_are_shape_only_with_the_same_declared_work():
    dev = _Declared()
    ops = SimpleNamespace(dev=dev, xp=np)
    rope = Rope(128, 500000.0)
    real = rope.tables(ops, 64, np.float32)
    meta = rope.tables(ops, 64, np.float32, meta=True)
    assert not any(is_meta(t) for t in real) and all(is_meta(t) for t in meta)
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in real]
    assert dev.blocks[0] == dev.blocks[1]                # declared once each, identically
    assert rope.tables(ops, 64, np.float32, meta=True) is meta and len(dev.blocks) == 2
    # the real tables: [cos | cos] and [-sin | sin] of position x theta^(-2i/d)
    angle = np.arange(64)[:, None] * 500000.0 ** (-2.0 * np.arange(64) / 128)
    np.testing.assert_allclose(real[0][:, 0, :64], np.cos(angle), rtol=1e-6)
    np.testing.assert_allclose(real[1][:, 0, 64:], np.sin(angle), rtol=1e-6, atol=1e-7)


def test_positions_that_do_not_match_the_rows_are_refused_in_a_trace_too():
    ops = SimpleNamespace(dev=_Declared(), xp=np)
    rope = Rope(8, 10000.0, positions=range(4))
    for meta in (False, True):
        with pytest.raises(ValueError, match="6 rows given, the positions name 4"):
            rope.tables(ops, 6, np.float32, meta=meta)
