"""Optimizers that step once per training step, on any list of parameter arrays.

* SGD with momentum mu (PyTorch's form): v <- mu v + g;  p <- p - lr v
* Adam (Kingma & Ba 2015): m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
  p <- p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

The update is elementwise, so a sharded parameter is updated shard by shard with the
same result as the whole parameter: the same optimizer serves the single-process
reference and every device. For the same reason a large parameter is updated in blocks
of :data:`BLOCK_BYTES` (the same expressions on matching slices, so the same bits): a
block's operands and temporaries stay in cache, where whole arrays went through memory
once per operation — SGD with momentum on 2 x 8 MiB float64 took 4.0 ms whole and 2.4
ms in blocks on the development machine (2 MiB L2 per core).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["OptimizerConfig", "Optimizer", "OPTIMIZERS", "BLOCK_BYTES"]

OPTIMIZERS = ("sgd", "adam")
BLOCK_BYTES = 256 << 10      # of each operand per block: 4-6 operands and temporaries in L2


def _blocks(*arrays):
    """Matching 1-D slices of ``arrays`` of about :data:`BLOCK_BYTES` each, or the arrays
    whole (small ones, and any that is not a C-contiguous numpy array: meta and device
    arrays, strided views)."""
    first = arrays[0]
    if first.nbytes <= BLOCK_BYTES or not all(
            type(a) is np.ndarray and a.flags.c_contiguous for a in arrays):
        yield arrays
        return
    flat = [a.reshape(-1) for a in arrays]
    step = max(1, BLOCK_BYTES // first.itemsize)
    for lo in range(0, first.size, step):
        yield tuple(f[lo:lo + step] for f in flat)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


class Optimizer:
    """Optimizer state for a list of parameters (updated in place by ``step``)."""

    def __init__(self, config: OptimizerConfig, params: list[np.ndarray]):
        self.config = config
        self.t = 0
        slots = 1 if config.name == "sgd" else 2
        self.state = [[np.zeros_like(p) for p in params] for _ in range(slots)]

    @property
    def bytes_touched_per_param_byte(self) -> int:
        """Memory traffic of one step per byte of parameters: SGD reads p, g, v and
        writes p, v (5); Adam reads p, g, m, v and writes p, m, v (7)."""
        return 5 if self.config.name == "sgd" else 7

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for slot in self.state for s in slot)

    def step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> None:
        c = self.config
        self.t += 1
        if c.name == "sgd":
            for arrays in zip(params, grads, self.state[0]):
                for p, g, v in _blocks(*arrays):
                    v *= c.momentum
                    v += g
                    p -= c.lr * v
            return
        b1, b2 = c.betas
        for arrays in zip(params, grads, self.state[0], self.state[1]):
            for p, g, m, v in _blocks(*arrays):
                m *= b1
                m += (1 - b1) * g
                v *= b2
                v += (1 - b2) * g * g
                m_hat = m / (1 - b1 ** self.t)
                v_hat = v / (1 - b2 ** self.t)
                p -= c.lr * m_hat / (np.sqrt(v_hat) + c.eps)
