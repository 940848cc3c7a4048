"""Shared by the GPT-family tests: random token data and meshes written as text."""

import numpy as np

from mesh import Mesh


def token_data(cfg, batch: int, seed: int = 0):
    """(tokens, targets): two (batch, cfg.seq) int arrays in [0, cfg.vocab)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab, (batch, cfg.seq)),
            rng.integers(0, cfg.vocab, (batch, cfg.seq)))


def mesh_of(spec: str) -> Mesh:
    """"dp2 pp2 tp2" -> Mesh((2, 2, 2), ("dp", "pp", "tp"))."""
    parts = [(p[:2], int(p[2:])) for p in spec.split()]
    return Mesh(tuple(n for _, n in parts), tuple(a for a, _ in parts))


def assert_same_params_and_grads(run, ref, rtol: float, atol: float) -> None:
    """Every final parameter and last-step gradient of ``run`` (a fit) equals
    ``ref``'s (the reference fit) by name, within ``rtol``/``atol``."""
    for name in ref.params:
        np.testing.assert_allclose(run.grads[name], ref.grads[name], rtol=rtol, atol=atol,
                                   err_msg=name)
        np.testing.assert_allclose(run.params[name], ref.params[name], rtol=rtol, atol=atol,
                                   err_msg=name)
