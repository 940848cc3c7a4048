"""Inputs shared by the MoE dispatcher tests (test_moe_flex.py, test_moe_nodes.py)."""

import numpy as np


def moe_inputs(seed: int, h: int, n: int = 32):
    """(x, dy): two (n, h) standard-normal arrays from ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, h)), rng.standard_normal((n, h))


def skewed_router(params: dict, h: int, bias: float = 1.5) -> dict:
    """``params`` with a router that favours expert 0 (a real imbalance)."""
    p = dict(params, w_router=params["w_router"].copy())
    p["w_router"][:, 0] += bias / np.sqrt(h)
    return p
