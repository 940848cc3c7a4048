"""The MatMul and FeedForward policies written with JAX ``shard_map``: a second,
independent implementation to hold against the oracle.

Each function takes global numpy inputs, runs the policy as a ``shard_map`` over a JAX
mesh of the first ``prod(shape)`` devices (row-major, so device r is the emulator's rank
r) and returns each device's local output, by rank — what a golden's per-rank outputs
hold. On a machine without accelerators, start Python with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (it must be set before jax is
imported; the test does it in a subprocess). float64 needs ``jax_enable_x64``, which
:func:`jax_setup` turns on.

MatMul, C = A @ B (x, y, z the mesh axes in order; "all" every axis):

====================  ====================  ====================  =========================
policy                A                     B                     program
====================  ====================  ====================  =========================
Unsharded             [R, R]                [R, R]                a @ b
MatchedInner          [R, S(all)]           [S(all), R]           psum_all(a @ b)
UnmatchedInner        [R, S(y)]             [S(x), R]             gather A's k over y, take
                                                                  the x-th block, psum_x
Outer                 [S(x), R]             [R, S(y)]             a @ b -> C [S(x), S(y)]
Full                  [S(x), S(y)]          [S(y), S(z)]          psum_y(a @ b) -> [S(x), S(z)]
====================  ====================  ====================  =========================

FeedForward, y = act(x W1 + b1) W2 + b2 (layouts as in
:class:`tensor_parallel.FeedForwardShardingPolicy`): Unsharded (rows over dp), Megatron
(psum over tp of the row-parallel product), SequenceParallel (all_gather of x over tp
along the sequence, psum_scatter of y along it), GSPMD (all_gather of x over tp on
d_model and of W1, W2 over dp; psum_scatter of y over tp on d_model).
"""

from __future__ import annotations

import numpy as np

__all__ = ["jax_setup", "matmul_outputs", "ffn_outputs", "MATMUL_POLICIES", "FFN_POLICIES"]

MATMUL_POLICIES = ("Unsharded", "MatchedInnerSharding", "UnmatchedInnerSharding",
                   "OuterSharding", "FullSharding")
FFN_POLICIES = ("Unsharded", "Megatron", "SequenceParallel", "GSPMD")


def jax_setup(n_devices: int):
    """Import jax with float64 on; check that ``n_devices`` devices exist."""
    import jax
    jax.config.update("jax_enable_x64", True)
    if len(jax.devices()) < n_devices:
        raise RuntimeError(f"jax has {len(jax.devices())} devices, {n_devices} are needed: set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devices} "
                           "before jax is imported")
    return jax


def _mesh(shape, axes):
    jax = jax_setup(int(np.prod(shape)))
    from jax.sharding import Mesh
    devices = jax.devices()[:int(np.prod(shape))]
    return Mesh(np.array(devices).reshape(shape), tuple(axes)), devices


def _shard_map(f, mesh, in_specs, out_specs):
    import jax
    try:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    except TypeError:           # older jax: check_rep
        from jax.experimental.shard_map import shard_map
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_rep=False)


def _run(f, mesh, devices, in_specs, out_spec, *arrays) -> list[np.ndarray]:
    """Run ``f`` under shard_map; each device's local output, by rank."""
    import jax
    from jax.sharding import NamedSharding
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, in_specs)]
    out = jax.jit(_shard_map(f, mesh, tuple(in_specs), out_spec))(*placed)
    by_device = {s.device: np.asarray(s.data) for s in out.addressable_shards}
    return [by_device[d] for d in devices]


def matmul_outputs(policy: str, shape, axes, A, B) -> list[np.ndarray]:
    """Each rank's local C of ``policy`` on a mesh ``shape`` with ``axes`` (module table)."""
    import jax
    from jax.sharding import PartitionSpec as P
    mesh, devices = _mesh(shape, axes)
    x, y, z = (tuple(axes) + (None, None, None))[:3]
    every = tuple(axes)
    lax = jax.lax
    if policy == "Unsharded":
        specs, out, f = (P(), P()), P(), lambda a, b: a @ b
    elif policy == "MatchedInnerSharding":
        specs, out = (P(None, every), P(every, None)), P()
        f = lambda a, b: lax.psum(a @ b, every)           # noqa: E731
    elif policy == "UnmatchedInnerSharding":
        specs, out = (P(None, y), P(x, None)), P()

        def f(a, b):
            full = lax.all_gather(a, y, axis=1, tiled=True)          # (m, k)
            k_x = b.shape[0]
            block = lax.dynamic_slice_in_dim(full, lax.axis_index(x) * k_x, k_x, axis=1)
            return lax.psum(block @ b, x)
    elif policy == "OuterSharding":
        specs, out, f = (P(x, None), P(None, y)), P(x, y), lambda a, b: a @ b
    elif policy == "FullSharding":
        specs, out = (P(x, y), P(y, z)), P(x, z)
        f = lambda a, b: lax.psum(a @ b, y)               # noqa: E731
    else:
        raise ValueError(f"policy must be one of {MATMUL_POLICIES}, got {policy!r}")
    return _run(f, mesh, devices, specs, out, A, B)


def _act(name: str):
    import jax.numpy as jnp
    if name == "relu":
        return lambda h: jnp.maximum(h, 0)
    if name == "gelu":       # the tanh approximation, as tensor_parallel.ffn
        c, k = np.sqrt(2 / np.pi), 0.044715
        return lambda h: 0.5 * h * (1 + jnp.tanh(c * (h + k * h ** 3)))
    raise ValueError(f"activation must be relu or gelu, got {name!r}")


def ffn_outputs(policy: str, shape, x, w1, b1, w2, b2, activation: str = "gelu",
                dp: str = "dp", tp: str = "tp") -> list[np.ndarray]:
    """Each rank's local y of FeedForward ``policy`` on a (dp, tp) mesh of ``shape``."""
    import jax
    from jax.sharding import PartitionSpec as P
    mesh, devices = _mesh(shape, (dp, tp))
    act, lax = _act(activation), jax.lax
    if policy == "Unsharded":
        specs = (P(dp), P(), P(), P(), P())
        out = P(dp)

        def f(x, w1, b1, w2, b2):
            return act(x @ w1 + b1) @ w2 + b2
    elif policy == "Megatron":
        specs = (P(dp), P(None, tp), P(tp), P(tp, None), P())
        out = P(dp)

        def f(x, w1, b1, w2, b2):
            return lax.psum(act(x @ w1 + b1) @ w2, tp) + b2
    elif policy == "SequenceParallel":
        specs = (P(dp, tp), P(None, tp), P(tp), P(tp, None), P())
        out = P(dp, tp)

        def f(x, w1, b1, w2, b2):
            full = lax.all_gather(x, tp, axis=1, tiled=True)           # (r, s, d)
            partial = act(full @ w1 + b1) @ w2
            return lax.psum_scatter(partial, tp, scatter_dimension=1, tiled=True) + b2
    elif policy == "GSPMD":
        specs = (P(dp, None, tp), P(dp, tp), P(tp), P(tp, dp), P(tp))
        out = P(dp, None, tp)

        def f(x, w1, b1, w2, b2):
            full = lax.all_gather(x, tp, axis=2, tiled=True)           # (r, s, d)
            w1_full = lax.all_gather(w1, dp, axis=0, tiled=True)       # (d, f/n)
            w2_full = lax.all_gather(w2, dp, axis=1, tiled=True)       # (f/n, d)
            partial = act(full @ w1_full + b1) @ w2_full
            return lax.psum_scatter(partial, tp, scatter_dimension=2, tiled=True) + b2
    else:
        raise ValueError(f"policy must be one of {FFN_POLICIES}, got {policy!r}")
    return _run(f, mesh, devices, specs, out, x, w1, b1, w2, b2)
