"""Memory accounting made cheap (issue 32): ``MemoryLedger`` tells the device of a kind
only when its peak rises — the engines keep nothing but peaks — while the ledger's own
figures and the peaks the engine ends with are those of every change told (against a
recorder told every change); a stage's ``activation_bytes``, counted as micro-batches come
and go, equals the sum over the arrays it holds after every pass."""

import contextlib

import numpy as np
import pytest

from pipeline_parallel.layers import LayerSpec, StageLayers
from pipeline_parallel.ledger import MemoryLedger
from vcluster.runtime.recorder import MemoryPeaks


class _Dev:
    """The part of a device context the ledger uses, keeping what it was told."""

    def __init__(self):
        self.told, self.memory = [], MemoryPeaks()

    def record_memory(self, **held):
        self.told.append(held)
        self.memory.record(held)


def test_the_device_hears_only_rising_peaks():
    dev, every = _Dev(), MemoryPeaks()
    ledger = MemoryLedger(dev)
    changes = [("activations", 10), ("activations", 5), ("params", 7), ("activations", 20),
               ("activations", 20), ("activations", 0), ("params", 7), ("activations", 21)]
    for kind, nbytes in changes:
        ledger.set(kind, nbytes)
        every.record({kind: nbytes})
    assert dev.told == [{"activations": 10}, {"params": 7}, {"activations": 20},
                        {"activations": 21}]
    assert dev.memory.peaks == every.peaks
    assert ledger.peaks() == {f"peak_{k}_bytes": v for k, v in every.peaks.items()}
    assert ledger.now["activations"] == 21 and ledger.now["params"] == 7


def test_a_zero_is_no_news_and_bad_values_are_still_refused():
    dev = _Dev()
    ledger = MemoryLedger(dev)
    ledger.set("grads", 0)
    ledger.add("grads", 0)
    assert dev.told == [] and ledger.peaks()["peak_grads_bytes"] == 0
    with pytest.raises(ValueError, match="grads would hold -1 bytes"):
        ledger.set("grads", -1)
    with pytest.raises(ValueError, match="unknown kind 'weights'"):
        ledger.set("weights", 1)


class _MathDev:
    """Enough of a device for a stage's math in this process (no recording)."""

    xp = np

    def compute(self, *args, **kwargs):
        return contextlib.nullcontext()

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype)


def _held(layers) -> int:
    """What a stage holds for its backward, summed from its dicts."""
    saved = sum(x.nbytes + z.nbytes for xs in layers._saved.values() for x, z in xs)
    return saved + sum(d.nbytes for ds in layers._dz.values() for d in ds if d is not None)


@pytest.mark.parametrize("need_input_grad", [True, False])
def test_stage_activation_bytes_follow_every_pass(need_input_grad):
    """The count kept as micro-batches come and go equals the sum over the held arrays
    after every F, I and W of a 1F1B-like order (3 layers, 4 micro-batches)."""
    rng = np.random.default_rng(0)
    specs = [LayerSpec(i, 8, 8, "dense", "relu" if i < 2 else None) for i in range(3)]
    layers = StageLayers(specs, [(rng.standard_normal((8, 8)), rng.standard_normal(8))
                                 for _ in specs])
    dev, seen = _MathDev(), []
    xs = [rng.standard_normal((4, 8)) for _ in range(4)]
    order = [("F", 0), ("F", 1), ("I", 0), ("F", 2), ("W", 0), ("I", 1), ("F", 3), ("W", 1),
             ("I", 2), ("I", 3), ("W", 3), ("W", 2)]
    for kind, j in order:
        if kind == "F":
            layers.forward(dev, j, xs[j])
        elif kind == "I":
            layers.backward_input(dev, j, np.ones((4, 8)), need_input_grad=need_input_grad)
        else:
            layers.backward_weight(dev, j)
        assert layers.activation_bytes == _held(layers), (kind, j)
        seen.append(layers.activation_bytes)
    assert max(seen) > 0 and seen[-1] == 0
