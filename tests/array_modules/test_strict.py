"""The strict array module follows CuPy's rules, and catches on CPU the host/device mix
that failed every MatMul policy on a real GPU (issue 27)."""

import numpy as np
import pytest

from mesh import Mesh
from tensor_parallel.matmul import local_matmul
from vcluster import VirtualCluster
from vcluster.runtime.errors import DeviceProgramError
from vcluster.runtime.strict import HostDeviceMixError, StrictArray, StrictNamespace

xp = StrictNamespace()


def test_device_math_works_through_xp_numpy_and_operators():
    a = xp.asarray(np.arange(12.0).reshape(3, 4))
    b = xp.ones((4, 2))
    for c in (a @ b, xp.matmul(a, b), np.matmul(a, b), np.einsum("ij,jk->ik", a, b)):
        assert type(c) is StrictArray
        np.testing.assert_array_equal(xp.asnumpy(c), np.arange(12.0).reshape(3, 4) @ np.ones((4, 2)))
    a += 1.0
    out = xp.empty((3, 2))
    assert np.matmul(a, b, out=out) is out
    assert type(a.sum()) is StrictArray and a.sum().shape == ()     # 0-d, as on CuPy
    assert float(a.sum()) == 78.0 and a.sum().item() == 78.0
    pieces = np.split(a, 2, axis=1)
    assert all(type(p) is StrictArray for p in pieces)
    a[0] = xp.zeros(4)
    a[1, :] = 7
    assert xp.asnumpy(a)[:2].tolist() == [[0, 0, 0, 0], [7, 7, 7, 7]]
    assert type(a.get()) is np.ndarray and type(xp.asnumpy(a)) is np.ndarray


@pytest.mark.parametrize("mix", [
    lambda a, h: a + h,
    lambda a, h: h * a,
    lambda a, h: xp.matmul(h, a),
    lambda a, h: np.matmul(a, h),
    lambda a, h: np.concatenate([a, h]),
    lambda a, h: a.__setitem__(0, h[0]),
    lambda a, h: a[np.array([0, 1])],
    lambda a, h: np.add(h, h, out=a),
    lambda a, h: np.asarray(a),
    lambda a, h: np.array(a),
], ids=["add", "radd", "xp.matmul", "np.matmul", "concatenate", "setitem", "index",
        "out", "asarray", "array"])
def test_host_arrays_never_meet_device_arrays(mix):
    a, h = xp.ones((3, 3)), np.ones((3, 3))
    with pytest.raises(HostDeviceMixError):
        mix(a, h)


def test_scalars_mix_freely():
    a = xp.ones(3)
    assert float((a * 2 + np.float64(1.5) - 1).sum()) == 7.5


def _planted_mix(dev, a, b):
    """The bug of issue 27: the program computes its input on the host (numpy) and hands
    it to device math."""
    host_a = np.asarray(a) if dev.xp is np else dev.xp.asnumpy(a)
    return local_matmul(dev, host_a, b)


def test_the_stand_in_catches_a_planted_host_device_mix():
    mesh = Mesh((2,), ("x",))
    args = [(np.ones((2, 3)), np.ones((3, 2)))] * 2
    with VirtualCluster(mesh) as cluster:                       # numpy: nothing to catch
        assert all(np.array_equal(r, np.full((2, 2), 3.0)) for r in cluster.run(_planted_mix, args))
    with VirtualCluster(mesh, array_module="strict") as cluster:
        with pytest.raises(DeviceProgramError, match="HostDeviceMixError.*host numpy.ndarray"):
            cluster.run(_planted_mix, args)


def _arrival(dev, x, nested):
    kinds = {type(x).__name__, type(nested["w"][0]).__name__, type(nested["w"][1]).__name__}
    return kinds, {"y": x * 2, "list": [x[:1]]}, nested["n"]


def test_arguments_arrive_on_the_device_and_results_return_to_the_host():
    """Every array of the arguments (strided ones, nested ones) arrives as a device array;
    every device array of the results comes back as numpy."""
    big = np.arange(40000.0)
    nested = {"w": (np.eye(3)[:, ::2], big.reshape(200, 200).T), "n": 5}
    with VirtualCluster(Mesh((2,), ("x",)), array_module="strict") as cluster:
        results = cluster.run(_arrival, [(big, nested)] * 2)
        assert cluster.options.transport == "ipc"
    for kinds, out, n in results:
        assert kinds == {"StrictArray"} and n == 5
        assert type(out["y"]) is np.ndarray and type(out["list"][0]) is np.ndarray
        np.testing.assert_array_equal(out["y"], 2 * big)


def test_options_are_checked():
    mesh = Mesh((2,), ("x",))
    with pytest.raises(ValueError, match="array_module must be one of .*'strict'.*got 'jax'"):
        VirtualCluster(mesh, array_module="jax")
    with pytest.raises(ValueError, match="transport must be one of .*got 'nvlink'"):
        VirtualCluster(mesh, array_module="strict", transport="nvlink")
    with pytest.raises(ValueError, match="transport='ipc' .* array_module='numpy'"):
        VirtualCluster(mesh, transport="ipc")
    with pytest.raises(ValueError, match="device_arena_bytes must be an int"):
        VirtualCluster(mesh, array_module="strict", device_arena_bytes=10)


def test_a_scenario_runs_on_the_strict_module(tmp_path):
    """``cluster.array_module: strict`` in a scenario (here set on the command line): the
    bundled MLP dp x pp x tp scenario passes its check under CuPy's rules."""
    import os

    from vcluster.cli.main import main
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert main(["run", os.path.join(root, "scenarios", "mlp_dp_pp_tp.yaml"), "--set",
                 "cluster.array_module=strict", "--quiet", "--out", str(tmp_path)]) == 0
