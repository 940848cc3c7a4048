"""The math of a dense MLP: activations, losses and their gradients (numpy, no state).

A layer computes z = x W + b and, except the last one, a = act(z). Losses are means over
the *global* batch of B samples, so per-sample gradients scaled by 1/B add up, over
micro-batches and data-parallel replicas, to the full-batch gradient:

* ``mse``: L = 1/(B d) sum_ij (y_ij - t_ij)^2, dL/dy = 2 (y - t) / (B d)
* ``cross_entropy`` (softmax): L = -1/B sum_i sum_c t_ic log softmax(y_i)_c with t one-hot
  (integer labels are turned into one-hot), dL/dy = (softmax(y) - t) / B
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ACTIVATIONS", "LOSSES", "activation", "activation_grad", "loss_and_grad"]

ACTIVATIONS = ("relu", "gelu", "tanh")
LOSSES = ("mse", "cross_entropy")
_GELU_C = math.sqrt(2.0 / math.pi)


def activation(name: str, z):
    if name == "relu":
        return np.maximum(z, 0)
    if name == "tanh":
        return np.tanh(z)
    if name == "gelu":   # tanh approximation
        return 0.5 * z * (1.0 + np.tanh(_GELU_C * (z + 0.044715 * z ** 3)))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def activation_grad(name: str, z, da):
    """dL/dz from dL/da, where a = act(z)."""
    if name == "relu":
        return da * (z > 0)
    if name == "tanh":
        return da * (1.0 - np.tanh(z) ** 2)
    if name == "gelu":
        u = _GELU_C * (z + 0.044715 * z ** 3)
        t = np.tanh(u)
        du = _GELU_C * (1.0 + 3 * 0.044715 * z ** 2)
        return da * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t ** 2) * du)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def one_hot(labels, classes: int, dtype) -> np.ndarray:
    """(len(labels), classes) rows of zeros with a 1 at each label (an integer array; a
    shape-only array when traced: the result then is one too)."""
    out = np.zeros_like(labels, dtype=dtype, shape=(len(labels), classes))
    # the row indices on the labels' device (like=: numpy's dispatch, NEP 35), so that a
    # device's labels never meet a host index array
    rows = np.arange(len(labels), like=labels)
    out[rows, labels.astype(np.int64, copy=False)] = 1
    return out


def loss_and_grad(name: str, y, t, global_batch: int):
    """(summed loss contribution, dL/dy) of a (micro-)batch, scaled by the global batch."""
    if name == "mse":
        diff = y - t
        scale = global_batch * y.shape[1]
        return float(np.sum(diff * diff)) / scale, 2.0 * diff / scale
    if name == "cross_entropy":
        if t.ndim == 1:
            t = one_hot(t, y.shape[1], y.dtype)
        shifted = y - np.max(y, axis=1, keepdims=True)
        log_z = np.log(np.sum(np.exp(shifted), axis=1, keepdims=True))
        log_p = shifted - log_z
        loss = -float(np.sum(t * log_p)) / global_batch
        return loss, (np.exp(log_p) - t) / global_batch
    raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
