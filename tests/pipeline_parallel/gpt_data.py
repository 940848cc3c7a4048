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


def assert_gradients_central(model, tokens, targets, whole, seed: int = 0,
                              abs_tol: float = 1e-9) -> dict:
    """The reference's gradients against central differences: every entry of the
    parameters whose last name part is in ``whole``, two random entries of every other
    (:func:`assert_central_difference`). Returns the gradients."""
    params = model.init_params()
    grads = model._reference(params, tokens, targets, backward=True)[2]
    rng = np.random.default_rng(seed)
    for name, p in params.items():
        picks = [np.unravel_index(j, p.shape) for j in range(p.size)] \
            if name.rsplit(".", 1)[-1] in whole \
            else [tuple(int(rng.integers(0, n)) for n in p.shape) for _ in range(2)]
        for idx in picks:
            assert_central_difference(model, tokens, targets, params, grads, name, idx,
                                      abs_tol=abs_tol)
    return grads


def assert_fit_equals_reference(cluster, model, par, tokens, targets, *, steps: int,
                                lr: float, rtol: float, atol: float, **ref_kw):
    """``model``'s forward (loss, logits) and a ``steps``-step fit on ``cluster`` under
    ``par`` equal its single-process references (``ref_kw``: what the references take,
    e.g. ``parallel=par`` for MoE routing) — every parameter and gradient by name.
    Returns (run, ref)."""
    ref_loss, ref_logits = model.reference_forward(tokens, targets, **ref_kw)
    loss, logits = model.forward(cluster, tokens, targets, par)
    assert loss == pytest.approx(ref_loss, rel=rtol)
    np.testing.assert_allclose(logits, ref_logits, rtol=rtol, atol=atol)
    ref = model.fit_reference(tokens, targets, steps=steps, lr=lr, **ref_kw)
    run = model.fit(cluster, tokens, targets, steps=steps, parallel=par, lr=lr)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=rtol)
    assert run.params.keys() == ref.params.keys() == run.grads.keys()
    assert_same_params_and_grads(run, ref, rtol, atol)
    return run, ref


def count_params(dev, job):
    """A traced program: declare (as one op's FLOPs) the parameters this rank's stages
    hold — the GPT program's own stages (``job.stage_factory``), for comparing with the
    memory model's count."""
    pp = dev.mesh.group("pp", dev.rank)
    pos = pp.index(dev.rank)
    held = sum(int(a.size) for s in range(pos, job.n_stages, len(pp))
               for arrays in job.stage_factory(dev, job, s).params for a in arrays)
    with dev.compute("params", flops=held):
        pass
