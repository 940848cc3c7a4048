"""Shared by the GPT-family tests: random token data and meshes written as text."""

import numpy as np
import pytest

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


def assert_central_difference(model, tokens, targets, params, grads, name, idx,
                              abs_tol: float = 1e-8, eps: float = 1e-6) -> None:
    """The reference's gradient of parameter ``name`` at ``idx`` equals the central
    difference of its loss (``params`` perturbed in place and restored); an index into
    ``wte`` is moved to a row the batch uses."""
    p = params[name]
    if name == "wte":
        idx = (int(tokens[0, 0]),) + tuple(idx[1:])
    old = p[idx]
    p[idx] = old + eps
    up = model.reference_forward(tokens, targets, params)[0]
    p[idx] = old - eps
    down = model.reference_forward(tokens, targets, params)[0]
    p[idx] = old
    assert (up - down) / (2 * eps) == pytest.approx(grads[name][idx], rel=1e-5,
                                                    abs=abs_tol), (name, idx)
