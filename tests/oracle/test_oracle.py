"""The oracle's core: content hashes, golden files, compare (rank, tensor, index, errors),
and the pytest plugin's fixture in a real pytest subprocess."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.oracle import (OracleMismatch, array_sha256, canonical_bytes, capture, compare,
                             golden_from_run, load_golden, save_golden, ulps_between)

MESH = Mesh((2, 2), ("dp", "tp"))


# ----------------------------------------------------------------------------- hashes
def test_equal_data_equal_hash_whatever_the_layout_or_byte_order():
    a = np.arange(12.0).reshape(3, 4)
    same = [a.copy(), np.asfortranarray(a), a.astype(">f8"), a.T.copy().T,
            np.frombuffer(a.tobytes(), "<f8").reshape(3, 4)]
    assert len({array_sha256(x) for x in same}) == 1
    different = [a.reshape(4, 3), a.astype(np.float32), a.astype(np.int64), a + 1e-16 * 0 + 1,
                 a.reshape(-1)]
    hashes = {array_sha256(x) for x in different}
    assert len(hashes) == len(different) and array_sha256(a) not in hashes


def test_canonical_bytes_are_dtype_shape_then_little_endian_c_order():
    a = np.array([[1, 2], [3, 4]], dtype=">i4").T
    want = b"<i4|2,2|" + np.array([1, 3, 2, 4], "<i4").tobytes()
    assert canonical_bytes(a) == want
    assert canonical_bytes(np.float64(1.5)) == b"<f8||" + np.float64(1.5).tobytes()


# ------------------------------------------------------------------------------- ulps
def test_ulps_count_representable_floats():
    one = np.float32(1.0)
    assert ulps_between(one, np.nextafter(one, np.float32(2)), np.float32) == 1
    assert ulps_between(1.0, np.nextafter(np.nextafter(1.0, 2.0), 2.0), np.float64) == 2
    assert ulps_between(0.0, -0.0, np.float64) == 0
    tiny = np.nextafter(0.0, 1.0)
    assert ulps_between(tiny, -tiny, np.float64) == 2          # across zero
    assert ulps_between(3, 4, np.int64) is None


# ------------------------------------------------------------- golden files, compare
def _golden(seed=0):
    rng = np.random.default_rng(seed)
    args = [(rng.standard_normal((3, 4)), np.arange(r, r + 3)) for r in range(MESH.size)]
    results = [{"y": a @ np.ones((4, 2)), "dW": a.T.copy(), "count": b * 2} for a, b in args]
    return golden_from_run(MESH, args, results, name="toy", seed=seed,
                           layouts={"y": "S(dp)R"}), results


def test_save_load_round_trip_and_manifest(tmp_path):
    golden, results = _golden()
    path = save_golden(golden, tmp_path / "g")
    manifest = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert manifest["format"] == "vcluster-oracle/1" and manifest["engine"] == "emulator"
    assert manifest["mesh"] == {"shape": [2, 2], "axes": ["dp", "tp"]}
    assert manifest["scenario"]["name"] == "toy" and manifest["seed"] == 0
    assert manifest["dtypes"] == {"y": "float64", "dW": "float64", "count": "int64"}
    assert manifest["layouts"] == {"y": "S(dp)R"}
    assert manifest["tolerances"]["count"] == {"rtol": 0.0, "atol": 0.0}
    assert manifest["arrays"][3]["gradients"]["dW"]["sha256"] == array_sha256(results[3]["dW"])
    assert sorted(os.listdir(tmp_path / "g" / "rank1")) == ["gradients.npz", "inputs.npz",
                                                             "outputs.npz"]
    loaded = load_golden(path)
    for r in range(MESH.size):
        assert loaded.results(r).keys() == results[r].keys()
        for k, v in results[r].items():
            np.testing.assert_array_equal(loaded.results(r)[k], v)
        np.testing.assert_array_equal(loaded.inputs(r)["arg1"], np.arange(r, r + 3))
    assert compare(results, loaded).ok
    save_golden(_golden(seed=1)[0], path)                    # replaced as a whole
    assert load_golden(path).manifest["seed"] == 1
    assert [p for p in os.listdir(tmp_path) if p.startswith(".oracle")] == []


def test_a_changed_file_is_detected(tmp_path):
    golden, _ = _golden()
    path = save_golden(golden, tmp_path / "g")
    data = dict(np.load(tmp_path / "g" / "rank2" / "outputs.npz"))
    data["y"][0, 0] += 1.0
    np.savez(tmp_path / "g" / "rank2" / "outputs.npz", **data)
    with pytest.raises(ValueError, match=r"rank 2 outputs 'y': sha256"):
        load_golden(path)


def test_compare_names_rank_tensor_index_and_errors():
    golden, results = _golden()
    actual = [{k: v.copy() for k, v in res.items()} for res in results]
    actual[1]["y"][2, 1] = np.nextafter(actual[1]["y"][2, 1], np.inf)   # 1 ulp: within tol
    assert compare(actual, golden).ok
    actual[3]["y"][1, 0] += 1e-3
    actual[2]["count"][1] += 1
    actual[0].pop("dW")
    result = compare(actual, golden)
    assert not result.ok and result.checked == 12
    by = {(m.rank, m.tensor): m for m in result.mismatches}
    assert set(by) == {(3, "y"), (2, "count"), (0, "dW")}
    m = by[(3, "y")]
    want = results[3]["y"][1, 0]
    assert m.index == (1, 0) and m.expected == want and m.actual == want + 1e-3
    assert m.abs_error == pytest.approx(1e-3) and m.rel_error == pytest.approx(1e-3 / abs(want))
    assert m.ulps == ulps_between(want + 1e-3, want, np.float64) and m.ulps > 10**9
    assert m.bad_elements == 1 and m.size == 6
    assert by[(2, "count")].index == (1,) and by[(2, "count")].ulps is None
    assert "missing" in by[(0, "dW")].reason
    text = str(result)
    assert "rank 3, tensor 'y', index (1, 0)" in text and "rank 2, tensor 'count', index (1,)" in text
    with pytest.raises(OracleMismatch, match=r"rank 3, tensor 'y', index \(1, 0\)"):
        result.raise_if_mismatch()
    actual[0]["dW"] = results[0]["dW"].astype(np.float32)
    assert "float32[4, 3] != expected float64[4, 3]" in str(compare(actual, golden))
    with pytest.raises(ValueError, match="has 4"):
        compare(actual[:2], golden)


def _program(dev, x):
    return {"s": dev.all_reduce(x, "tp"), "g": dev.all_gather(x, "dp")}


def test_capture_on_the_emulator_equals_numpy():
    xs = [np.random.default_rng(r).standard_normal(5) for r in range(MESH.size)]
    with VirtualCluster(MESH) as cluster:
        golden = capture(cluster, _program, [(x,) for x in xs], name="toy", seed=3)
    for r in range(MESH.size):
        tp, dp = MESH.group("tp", r), MESH.group("dp", r)
        np.testing.assert_allclose(golden.results(r)["s"], xs[tp[0]] + xs[tp[1]], rtol=1e-15)
        np.testing.assert_array_equal(golden.results(r)["g"], np.concatenate([xs[m] for m in dp]))
        np.testing.assert_array_equal(golden.inputs(r)["arg0"], xs[r])
    assert golden.manifest["engine"] == "emulator"


# ------------------------------------------------------------------------ the plugin
def test_pytest_plugin_fixture_in_a_real_pytest_run(tmp_path):
    golden, results = _golden()
    save_golden(golden, tmp_path / "goldens" / "toy")
    np.save(tmp_path / "y_rank3.npy", results[3]["y"])
    (tmp_path / "test_backend.py").write_text(textwrap.dedent("""
        import numpy as np
        import pytest

        def _actual(golden, perturb):
            res = [dict(golden.results(r)) for r in range(golden.size)]
            if perturb:
                res[3]["y"] = res[3]["y"].copy()
                res[3]["y"][2, 1] += 0.5
            return res

        def test_matches(oracle):
            golden = oracle.load("toy")
            assert oracle.assert_matches(_actual(golden, False), golden).ok
            assert oracle.assert_matches(_actual(golden, False), "toy").checked == 12

        def test_perturbed(oracle):
            golden = oracle.load("toy")
            oracle.assert_matches(_actual(golden, True), golden)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--oracle-dir", str(tmp_path / "goldens"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "OracleMismatch" in out and "rank 3, tensor 'y', index (2, 1)" in out, out


def test_check_dirs_requires_the_goldens_inputs(tmp_path):
    """An actual run that started from other inputs is a mismatch even when its outputs
    happen to agree (``oracle check`` compares input hashes too)."""
    from vcluster.scenario.oracle_export import check_dirs
    golden, results = _golden()
    save_golden(golden, tmp_path / "gold")
    assert check_dirs(tmp_path / "gold", tmp_path / "gold")[0][2].ok
    arrays = [{k: dict(v) for k, v in rank.items()} for rank in golden.arrays]
    arrays[1]["inputs"]["arg0"] = arrays[1]["inputs"]["arg0"] + 1.0
    save_golden(type(golden)(golden.manifest, tuple(arrays)), tmp_path / "other")
    (_, _, result), = check_dirs(tmp_path / "gold", tmp_path / "other")
    assert [(m.rank, m.tensor) for m in result.mismatches] == [(1, "inputs/arg0")]
    assert "input differs from the golden's" in str(result)
    with pytest.raises(FileNotFoundError, match="holds no golden"):
        check_dirs(tmp_path / "gold", tmp_path / "missing")
