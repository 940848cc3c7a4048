"""RMSNorm over the last dimension on one device, declared as the device's norm kernels
(0 FLOPs: elementwise work, as every norm of the block): the Llama block's pre-norms and
final norm (width h, :mod:`.llama`) and QK-norm's per-head norms (width d, :mod:`.gqa`).

    RMSNorm(x) = xhat·g,  xhat = x·r,  r = 1/sqrt(mean(x²) + eps)        over the last dim
    RMSNorm'  : dx = r·(d - xhat·mean(d·xhat)),  d = dy·g;   dg = rowsum(dy·xhat)
"""

from __future__ import annotations

import numpy as np

from vcluster.runtime.tracing.kernel import Kernel

__all__ = ["rms_norm", "rms_norm_gain_grad", "rms_norm_grad"]


def rms_norm(ops, x, g, eps: float, name: str):
    """(xhat·g, (xhat, r)), xhat = x·r, r = 1/sqrt(mean(x²) + eps) over x's last dim."""
    h = x.shape[-1]

    def fn():
        r = 1.0 / np.sqrt((x * x).sum(axis=-1, keepdims=True) / h + eps)
        xhat = x * r
        return xhat * g, (xhat, r)

    return ops.work(name, 0, (x, x, x), None, fn, Kernel.norm(x.size // h, h))


def rms_norm_grad(ops, dy, state, g, name: str, residual=None):
    """dx = r·(d - xhat·mean(d·xhat)), d = dy·g; plus ``residual``."""
    xhat, r = state
    h = dy.shape[-1]

    def fn():
        d = dy * g
        dx = r * (d - xhat * (d * xhat).sum(axis=-1, keepdims=True) / h)
        return dx if residual is None else dx + residual

    return ops.work(name, 0, (dy, xhat, dy), None, fn, Kernel.norm(dy.size // h, h, True))


def rms_norm_gain_grad(ops, dy, xhat, gg, name: str) -> None:
    """gg += rowsum(dy·xhat) over every row of the last dim (in place)."""
    gg += ops.ew(name, lambda: (dy * xhat).reshape(-1, dy.shape[-1]).sum(axis=0), dy, xhat)
