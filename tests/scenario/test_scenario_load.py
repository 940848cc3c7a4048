"""Scenario files: every bad file exits 2 naming the key path, the value and what is
allowed, and writes nothing; --set, the JSON Schema, defaults and sweeps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from vcluster.cli.main import main
from vcluster.scenario import (ScenarioError, build_workload, load_scenario, parse_override,
                               resolve_mesh, scenario_from_dict, scenario_schema, sweep_points)

ROOT = Path(__file__).resolve().parents[2]
BAD = sorted((ROOT / "tests" / "scenarios_bad").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "scenarios").glob("*.yaml"))
pytestmark = pytest.mark.timeout(120)


def _expected(path: Path) -> tuple[str, str]:
    head = dict(line[2:].split(": ", 1) for line in path.read_text().splitlines()
                if line.startswith("# ") and ": " in line)
    return head["path"], head["value"]


def test_there_are_at_least_15_bad_files():
    assert len(BAD) >= 15


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_file_exits_2_naming_key_value_allowed_and_writes_nothing(path, tmp_path,
                                                                      monkeypatch, capsys):
    key, value = _expected(path)
    monkeypatch.chdir(tmp_path)
    code = main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{key} = " in err, err
    assert value in err, err
    assert "allowed: " in err and err.split("allowed: ", 1)[1].strip(), err
    assert list(tmp_path.iterdir()) == []                     # nothing written
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.path == key and info.value.allowed


def test_bad_file_through_the_real_entry_point(tmp_path):
    for args in (["run", str(BAD[0]), "--out", "out"], ["validate", str(BAD[0])]):
        proc = subprocess.run([sys.executable, "-m", "vcluster", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert _expected(BAD[0])[0] in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [
    ("parallel.tp", "--set"), ("=4", "--set"), ("parallel.tp=[", "--set parallel.tp"),
    ("workload.hidden=big", "workload.hidden"), ("parallel.tp=3", "workload.heads"),
    ("workload.nonsense=1", "workload.nonsense"), ("run.steps=0", "run.steps"),
])
def test_bad_set_exits_2(override, key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["run", str(ROOT / "scenarios" / "transformer.yaml"), "--set", override,
                 "--out", "out", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"{key} = " in err and "allowed: " in err, err
    assert list(tmp_path.iterdir()) == []


def test_set_parses_yaml_values():
    assert parse_override("parallel.tp=4") == ("parallel.tp", 4)
    assert parse_override("run.check=true") == ("run.check", True)
    assert parse_override("workload.sizes=[8, 16, 8]") == ("workload.sizes", [8, 16, 8])
    assert parse_override("hardware={name: h100-dgx, dtype: bf16}") == (
        "hardware", {"name": "h100-dgx", "dtype": "bf16"})
    s = load_scenario(ROOT / "scenarios" / "mlp_dp_pp_tp.yaml",
                      ["parallel.dp=1", "workload.batch=8", "run.steps=2"])
    assert dict(resolve_mesh(s).shape) == {"dp": 1, "pp": 2, "tp": 2}
    assert s.workload.options["batch"] == 8 and s.run.steps == 2
    hw = load_scenario(ROOT / "scenarios" / "quickstart.yaml", ["hardware.dtype=bf16"])
    assert (hw.hardware.name, hw.hardware.dtype) == ("a100-80gb-dgx", "bf16")


def test_schema_is_a_valid_json_schema_and_accepts_every_example(capsys):
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == scenario_schema()
    jsonschema.Draft202012Validator.check_schema(printed)
    validator = jsonschema.Draft202012Validator(printed)
    for path in EXAMPLES:
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path
    bad = yaml.safe_load((ROOT / "tests" / "scenarios_bad" / "unknown_key.yaml").read_text())
    assert list(validator.iter_errors(bad))           # the schema alone rejects it


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_validates(path, capsys):
    assert main(["validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out


def test_defaults_come_from_the_schema():
    s = scenario_from_dict({"cluster": {"mesh": {"tp": 2}},
                            "workload": {"kind": "matmul"},
                            "parallel": {"policy": "MatchedInnerSharding"}}, "d")
    props = scenario_schema()["properties"]
    assert s.run.mode == props["run"]["properties"]["mode"]["default"] == "emulate"
    assert s.run.steps == 1 and s.run.check is False
    assert s.workload.dtype == "float64" and s.workload.seed == 0
    assert (s.workload.options["m"], s.workload.options["backward"]) == (64, False)
    assert s.hardware.name == "a100-80gb-dgx" and s.hardware.dtype == "fp32"
    assert s.name == "d" and "matmul" in repr(s)


def test_sweep_points_are_the_product_in_order():
    s = load_scenario(ROOT / "scenarios" / "collective_sweep.yaml")
    points = sweep_points(s)
    values = [v for v, _ in points]
    assert values == [{"workload.size": a, "parallel.algorithm": b}
                      for a in ("16KiB", "256KiB", "1MiB") for b in ("shm", "ring")]
    assert [p.parallel["algorithm"] for _, p in points] == ["shm", "ring"] * 3
    assert all(not p.sweep for _, p in points)


ZIPPED = {"name": "z", "cluster": {"mesh": {"x": 4}},
          "workload": {"kind": "collective", "op": "all_reduce", "size": "16KiB",
                       "dtype": "float32"},
          "parallel": {"axis": "x"}, "run": {"mode": "simulate"}}


def test_sweep_zip_pairs_its_lists_and_multiplies_the_other_keys():
    s = scenario_from_dict({**ZIPPED, "sweep": {
        "zip": {"workload.size": ["16KiB", "1MiB", "4MiB"],
                "parallel.algorithm": ["shm", "ring", "ring"]},
        "run.steps": [1, 2]}})
    values = [v for v, _ in sweep_points(s)]
    assert values == [{"workload.size": a, "parallel.algorithm": b, "run.steps": n}
                      for a, b in (("16KiB", "shm"), ("1MiB", "ring"), ("4MiB", "ring"))
                      for n in (1, 2)]
    assert [p.run.steps for _, p in sweep_points(s)] == [1, 2] * 3
    assert [path for path, _ in s.sweep] == ["workload.size", "parallel.algorithm",
                                             "run.steps"]
    alone = scenario_from_dict({**ZIPPED, "sweep": {"zip": {"run.steps": [3, 1]}}})
    assert [p.run.steps for _, p in sweep_points(alone)] == [3, 1]


@pytest.mark.parametrize("sweep, path, match", [
    ({"zip": {"workload.size": ["16KiB", "1MiB"], "run.steps": [1]}}, "sweep.zip",
     "lists differ in length"),
    ({"zip": {"workload.size": []}}, "sweep.zip.workload.size", "at least 1 items"),
    ({"zip": {"size": ["16KiB"]}}, "sweep.zip.size", "a key path under cluster"),
    ({"zip": ["workload.size"]}, "sweep.zip", "a mapping"),
])
def test_sweep_zip_errors_name_the_key(sweep, path, match):
    with pytest.raises(ScenarioError, match=match) as info:
        scenario_from_dict({**ZIPPED, "sweep": sweep})
    assert info.value.path == path, info.value


def test_mesh_from_parallel_degrees_and_from_cluster():
    s = load_scenario(ROOT / "scenarios" / "transformer.yaml")
    assert (resolve_mesh(s).axes, resolve_mesh(s).size) == (("dp", "pp", "tp"), 8)
    m = load_scenario(ROOT / "scenarios" / "ffn_megatron.yaml")
    assert dict(resolve_mesh(m).shape) == {"dp": 2, "tp": 4}


def test_build_workload_gives_per_rank_inputs_and_a_reference():
    s = load_scenario(ROOT / "scenarios" / "matmul_layouts.yaml")
    w = build_workload(s)
    assert w.mesh.size == len(w.args_by_rank) == len(w.meta_args_by_rank) == 8
    _, a, b, dc = w.args_by_rank[0]
    assert a.shape == (256 // 2, 512 // 4) and b.shape == (512, 256) and dc is None
    ref = w.reference()
    assert set(ref) == {"C"} and ref["C"].shape == (256, 256)


def test_every_schema_key_is_documented():
    from vcluster.scenario.schema import KINDS, _PARALLEL, _WORKLOAD
    doc = (ROOT / "docs" / "scenario.md").read_text()
    props = scenario_schema()["properties"]
    paths = list(props)
    for section in ("cluster", "run", "report", "workload"):
        paths += [f"{section}.{k}" for k in props[section]["properties"]]
    paths += [f"hardware.{k}" for k in props["hardware"]["anyOf"][1]["properties"]]
    for kind in KINDS:
        paths += [f"workload.{k}" for k in _WORKLOAD[kind]]
        paths += [f"parallel.{k}" for k in _PARALLEL[kind]]
    missing = [p for p in paths if f"`{p}`" not in doc]
    assert not missing, missing


def test_readme_main_job_is_the_quickstart_scenario():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e . && vcluster run scenarios/quickstart.yaml" in readme
    assert (ROOT / "scenarios" / "quickstart.yaml").is_file()


def test_every_summary_key_is_documented():
    from vcluster.scenario.runner import SUMMARY_KEYS
    doc = (ROOT / "docs" / "scenario.md").read_text()
    missing = [k for keys in SUMMARY_KEYS.values() for k in keys if f"`{k}`" not in doc]
    assert not missing, missing
