"""Mini-batches drawn in shuffled epochs, with a state that a checkpoint can restore.

Epoch e is a permutation of the N samples drawn from a numpy ``PCG64`` generator
(seeded by ``seed``); step batches are ``batch_size`` consecutive indices of that
permutation, running on into the next epoch's permutation when one is used up.

The state is (the generator's state *before* it drew the current epoch's permutation,
the epoch, the position inside it): restoring it redraws the same permutation and
continues with the same batches, so a resumed run sees exactly the data the original
would have. ``data_position`` = samples consumed = ``epoch * N + position``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SamplerState", "BatchSampler"]


@dataclass(frozen=True)
class SamplerState:
    """Where a :class:`BatchSampler` stands; ``rng_state`` is JSON-ready."""

    rng_state: dict
    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict:
        return {"rng_state": self.rng_state, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplerState":
        try:
            return cls(d["rng_state"], int(d["epoch"]), int(d["position"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"sampler state: expected rng_state, epoch, position; got "
                             f"{d!r:.200} ({exc})") from None


def _jsonable(state):
    if isinstance(state, dict):
        return {k: _jsonable(v) for k, v in state.items()}
    if isinstance(state, np.integer):
        return int(state)
    return state


class BatchSampler:
    """Batches of ``batch_size`` of ``n`` samples, shuffled per epoch (see the module)."""

    def __init__(self, n: int, batch_size: int, seed: int = 0, state: SamplerState | None = None):
        if not 1 <= batch_size <= n:
            raise ValueError(f"batch_size: must be in 1..{n} (the samples given), got "
                             f"{batch_size}")
        self.n, self.batch_size, self.seed = int(n), int(batch_size), seed
        self._rng = np.random.Generator(np.random.PCG64(seed))
        if state is not None:
            self._rng.bit_generator.state = state.rng_state
            self.epoch = state.epoch
        else:
            self.epoch = 0
        self._epoch_start = _jsonable(self._rng.bit_generator.state)
        self._perm = self._rng.permutation(self.n)
        self.position = 0 if state is None else state.position
        if not 0 <= self.position <= self.n:
            raise ValueError(f"sampler state: position {self.position} is not in 0..{self.n}")

    def __repr__(self) -> str:
        return (f"BatchSampler(n={self.n}, batch_size={self.batch_size}, seed={self.seed}, "
                f"epoch={self.epoch}, position={self.position})")

    @property
    def state(self) -> SamplerState:
        return SamplerState(self._epoch_start, self.epoch, self.position)

    @property
    def data_position(self) -> int:
        """Samples consumed so far."""
        return self.epoch * self.n + self.position

    def next_indices(self) -> np.ndarray:
        """The sample indices of the next batch."""
        out = []
        need = self.batch_size
        while need:
            if self.position == self.n:
                self.epoch += 1
                self._epoch_start = _jsonable(self._rng.bit_generator.state)
                self._perm = self._rng.permutation(self.n)
                self.position = 0
            take = min(need, self.n - self.position)
            out.append(self._perm[self.position:self.position + take])
            self.position += take
            need -= take
        return np.concatenate(out)

    def batches(self, X, Y, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``steps`` batches stacked: (steps, batch_size, ...) each."""
        idx = [self.next_indices() for _ in range(steps)]
        if not idx:
            return (np.empty((0, self.batch_size) + X.shape[1:], X.dtype),
                    np.empty((0, self.batch_size) + Y.shape[1:], Y.dtype))
        return np.stack([X[i] for i in idx]), np.stack([Y[i] for i in idx])
