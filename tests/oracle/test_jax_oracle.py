"""JAX check: the MatMul and FeedForward policies written with ``shard_map``
(vcluster/oracle/jax_programs.py) on forced host CPU devices reproduce the oracle's
per-rank outputs.

The goldens come from the emulator (and are first checked against unsharded numpy);
JAX runs in a subprocess whose environment sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax starts.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# A skip mark, not importorskip: the emulator's devices import this module to find its
# programs, and must not pay for importing jax.
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                 reason="jax is not installed")]

from mesh import Mesh  # noqa: E402
from sharding import TensorSharding as TS, shard, unshard  # noqa: E402
from tensor_parallel import FeedForward, FeedForwardSharding, MatMul, MatMulSharding  # noqa: E402
from vcluster import VirtualCluster  # noqa: E402
from vcluster.oracle import OracleMismatch, capture, compare  # noqa: E402
from vcluster.oracle.jax_programs import FFN_POLICIES, MATMUL_POLICIES  # noqa: E402

pytestmark.append(pytest.mark.timeout(600))

MM_MESH = Mesh((2, 2, 2), ("x", "y", "z"))
FFN_MESH = Mesh((2, 4), ("dp", "tp"))
M, K, N = 8, 16, 8
X_SHAPE, D_FF = (4, 8, 8), 16


def _matmul_layouts(policy):
    every = ("x", "y", "z")
    return {"Unsharded": (TS(None, None), TS(None, None), TS(None, None)),
            "MatchedInnerSharding": (TS(None, every), TS(every, None), TS(None, None)),
            "UnmatchedInnerSharding": (TS(None, "y"), TS("x", None), TS(None, None)),
            "OuterSharding": (TS("x", None), TS(None, "y"), TS("x", "y")),
            "FullSharding": (TS("x", "y"), TS("y", "z"), TS("x", "z"))}[policy]


def _forward_program(dev, jobs):
    out = {}
    for name, op, local in jobs:
        out[name] = op.forward_local(dev, *local)
    return out


def _golden(cluster, mesh, ops):
    """Golden of the forward pass of every op (name -> (op, global inputs, layouts))."""
    per_rank = [[] for _ in range(mesh.size)]
    for name, (op, arrays, layouts) in ops.items():
        pieces = [shard(a, lay, mesh) for a, lay in zip(arrays, layouts)]
        for r in range(mesh.size):
            per_rank[r].append((name, op, tuple(p[r] for p in pieces)))
    return capture(cluster, _forward_program, [(jobs,) for jobs in per_rank], name="jax-check")


def _gelu(h):
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    rng = np.random.default_rng(11)
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    d = X_SHAPE[-1]
    x = rng.standard_normal(X_SHAPE)
    w1, b1 = rng.standard_normal((d, D_FF)) / np.sqrt(d), rng.standard_normal(D_FF)
    w2, b2 = rng.standard_normal((D_FF, d)) / np.sqrt(D_FF), rng.standard_normal(d)
    mm_ops = {}
    for p in MATMUL_POLICIES:
        s = MatMulSharding(*_matmul_layouts(p))
        assert s.policy_on(MM_MESH).value == p
        mm_ops[f"matmul.{p}.C"] = (MatMul(s), (A, B), (s.a, s.b), s.c, A @ B)
    ffn_ops = {}
    y_ref = _gelu(x.reshape(-1, d) @ w1 + b1) @ w2 + b2
    for p in FFN_POLICIES:
        op = FeedForward(FeedForwardSharding(p, tp="tp", dp="dp"), activation="gelu")
        lay = op.layouts
        ffn_ops[f"ffn.{p}.y"] = (op, (x, w1, b1, w2, b2),
                                 tuple(lay[n] for n in ("x", "w1", "b1", "w2", "b2")), lay["y"],
                                 y_ref.reshape(X_SHAPE))
    out = {}
    for key, mesh, ops in (("matmul", MM_MESH, mm_ops), ("ffn", FFN_MESH, ffn_ops)):
        with VirtualCluster(mesh) as cluster:
            golden = _golden(cluster, mesh, {k: v[:3] for k, v in ops.items()})
        for name, (_, _, _, layout, ref) in ops.items():      # the golden is trusted
            got = unshard([golden.results(r)[name] for r in range(mesh.size)], layout, mesh)
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
        out[key] = golden
    path = tmp_path_factory.mktemp("jax") / "inputs.npz"
    np.savez(path, A=A, B=B, x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    return out, path


JAX_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from vcluster.oracle.jax_programs import (FFN_POLICIES, MATMUL_POLICIES, ffn_outputs,
                                              matmul_outputs)
    inputs = dict(np.load(sys.argv[1]))
    out = {}
    for p in MATMUL_POLICIES:
        for r, c in enumerate(matmul_outputs(p, (2, 2, 2), ("x", "y", "z"), inputs["A"],
                                             inputs["B"])):
            out[f"{r}/matmul.{p}.C"] = c
    for p in FFN_POLICIES:
        ys = ffn_outputs(p, (2, 4), *(inputs[k] for k in ("x", "w1", "b1", "w2", "b2")))
        for r, y in enumerate(ys):
            out[f"{r}/ffn.{p}.y"] = y
    import jax
    out["jax_version"] = np.array(jax.__version__)
    out["devices"] = np.array(len(jax.devices()))
    np.savez(sys.argv[2], **out)
""")


@pytest.fixture(scope="module")
def jax_results(goldens, tmp_path_factory):
    _, inputs = goldens
    out = tmp_path_factory.mktemp("jax") / "outputs.npz"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT, str(inputs), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = dict(np.load(out))
    assert int(data["devices"]) >= 8
    by_rank = [{} for _ in range(8)]
    for key, value in data.items():
        if "/" in key:
            r, name = key.split("/", 1)
            by_rank[int(r)][name] = value
    return by_rank


@pytest.mark.parametrize("kind", ["matmul", "ffn"])
def test_jax_shard_map_reproduces_the_oracle(goldens, jax_results, kind):
    golden = goldens[0][kind]
    names = sorted(golden.results(0))
    assert len(names) == (5 if kind == "matmul" else 4)
    result = compare(jax_results, golden, tensors=names)
    assert result.ok, str(result)
    assert result.checked == 8 * len(names)


def test_a_wrong_jax_policy_is_caught(goldens, jax_results):
    """Outer's output read as if it were Full's: the oracle names the rank and tensor."""
    golden = goldens[0]["matmul"]
    swapped = [dict(r) for r in jax_results]
    for r in swapped:
        r["matmul.OuterSharding.C"] = np.ascontiguousarray(r["matmul.OuterSharding.C"][::-1])
    result = compare(swapped, golden, tensors=["matmul.OuterSharding.C"])
    with pytest.raises(OracleMismatch, match=r"rank 0, tensor 'matmul.OuterSharding.C', index"):
        result.raise_if_mismatch()
    json.dumps([str(m) for m in result.mismatches])      # messages are plain text
