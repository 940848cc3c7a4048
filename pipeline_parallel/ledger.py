"""``MemoryLedger``: what one rank's training program holds, by kind, as it runs.

The kinds are :data:`~vcluster.runtime.recorder.MEMORY_KINDS` (params, grads, optimizer,
activations). The program says what it holds at every change (``set``/``add``); each
change that raises a kind's peak goes to ``dev.record_memory``, so the engine keeps the
peaks (``cluster.stats()``'s ``peak_params_bytes`` ..., a trace's ``peak_bytes``), and
the ledger keeps them too for the run's results (the ``memory`` table of ``fit``). The
engines keep nothing but each kind's peak, so a change below it would tell them nothing:
the training executor sets the activations after every action (~9 times per device and
step in the width-128 MLP of issue 32), and each call into the device was ~3 us.

What counts is what the algorithm needs, not what the emulator happens to keep
allocated: under ZeRO-2/3 a module's full gradient buffer counts from its accumulation
to its reduce-scatter, a ZeRO-3 module's parameters from their all-gather to their
release (the emulator keeps those buffers for reuse, as a caching allocator would, and
fills released parameters with NaN so that a use after release cannot go unnoticed).
Buffers a collective only stages (the flat copy a reduce-scatter sends) are transport,
not state, and do not count. Activations are the stages' saved tensors plus the loss
gradient dL/dy (the logits' gradient) the last stage holds from a micro-batch's forward
to its backward; :func:`vcluster.planner.memory.emulator_activation_bytes` counts the
same tensors in closed form.
"""

from __future__ import annotations

from vcluster.runtime.recorder import MEMORY_KINDS

__all__ = ["MemoryLedger"]


class MemoryLedger:
    """Bytes held now and at the peak, per kind, of one rank (reported to ``dev``)."""

    def __init__(self, dev):
        self._dev = dev
        self.now = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak = dict.fromkeys(MEMORY_KINDS, 0)

    def __repr__(self) -> str:
        return f"MemoryLedger(now={self.now}, peak={self.peak})"

    def set(self, kind: str, nbytes: int) -> None:
        if kind not in self.now:
            raise ValueError(f"MemoryLedger: unknown kind {kind!r}; the kinds are {MEMORY_KINDS}")
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"MemoryLedger: {kind} would hold {nbytes} bytes (< 0)")
        self.now[kind] = nbytes
        if nbytes > self.peak[kind]:      # the engines' peaks start at 0 too
            self.peak[kind] = nbytes
            self._dev.record_memory(**{kind: nbytes})

    def add(self, kind: str, nbytes: int) -> None:
        self.set(kind, self.now[kind] + int(nbytes))

    def peaks(self) -> dict:
        """``peak_{kind}_bytes`` per kind (the stats columns' names)."""
        return {f"peak_{k}_bytes": v for k, v in self.peak.items()}
