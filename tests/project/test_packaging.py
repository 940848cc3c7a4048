"""What an installed vcluster carries: a wheel built from this tree, installed into a
fresh virtual environment, loads every shipped table and runs ``vcluster validate-model``
from a folder with neither the source tree nor the shared reference folder (issue 5: the
published tables ship as package data, with their source lines)."""

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("vcluster", "mesh", "sharding", "pipelining", "tensor_parallel",
            "pipeline_parallel", "reports")
TABLES = ("hardware.csv", "nccl_a100.csv", "megatron_2020_a100.csv",
          "megatron_sc21_table1.csv", "h100_kernels.csv", "h200_gpt_steps.csv",
          "h100_gpt_steps.csv", "h200_shapes_steps.csv", "korthikanti_2022_a100.csv",
          "llm_foundry_mpt.csv", "nemo_2407_h100_fp8.csv", "torchtitan_a100_fsdp.csv",
          "megatron_bridge_h100_fp8.csv", "megatron_bridge_h100_moe.csv", "nccl_2026.csv",
          "megatron_bridge_blackwell.csv", "amd_instinct_training.csv")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel of this tree, built without network (the installed setuptools) from a
    copy of it: a build writes ``build/`` beside its sources, and one left in the tree
    would carry files since deleted into the next wheel."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("vcluster-*.whl")
    return path


def test_wheel_holds_every_package_and_the_published_tables(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for package in PACKAGES:
        assert f"{package}/__init__.py" in names, package
    for table in TABLES:
        assert f"vcluster/timing/data/{table}" in names, table
    assert not any(n.startswith(("tests/", "scenarios/")) for n in names)
    from vcluster.timing.presets import PRESET_NAMES
    for name in PRESET_NAMES:                      # the presets are data files too
        assert f"vcluster/timing/data/presets/{name}.yaml" in names, name


def _see_this_environments_packages(python) -> None:
    """Let the new environment import what this test's interpreter has installed (numpy,
    simpy, pip, ...) through a ``.pth`` file of its site-packages directories — this
    interpreter's, a virtualenv's or the system's alike (``system_site_packages`` would
    give the base interpreter's, which a virtualenv does not use). A plain directory
    listed in a ``.pth`` has its own ``.pth`` files ignored, so an editable vcluster
    installed here stays out; vcluster comes from the wheel, which the environment's own
    site-packages put first."""
    site_dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages",
                                                                  "dist-packages")]
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, timeout=60, check=True)
    with open(os.path.join(purelib.stdout.strip(), "outer-site.pth"), "w") as f:
        f.write("".join(d + "\n" for d in site_dirs))


def test_installed_wheel_validates_the_model_without_the_source_tree(wheel, tmp_path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _see_this_environments_packages(python)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q",
                              str(wheel)],
                             capture_output=True, text=True, timeout=300, env=environ)
    assert install.returncode == 0, install.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import vcluster; print(vcluster.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=work, env=environ)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(env_dir)), where.stdout
    # every shipped table loads from the installed package, each with all its rows
    counts = subprocess.run(
        [str(python), "-c", "import json; from vcluster.timing import read_data_csv; "
         "from vcluster.cli.validate_model_cmd import TABLES; "
         "print(json.dumps({t: len(read_data_csv(t)[1]) for t in TABLES}))"],
        capture_output=True, text=True, timeout=60, cwd=work, env=environ)
    assert counts.returncode == 0, counts.stderr
    assert json.loads(counts.stdout) == {"nccl_a100.csv": 5, "megatron_2020_a100.csv": 8,
                                         "megatron_sc21_table1.csv": 10,
                                         "korthikanti_2022_a100.csv": 14,
                                         "h200_gpt_steps.csv": 5, "h100_gpt_steps.csv": 8,
                                         "h200_shapes_steps.csv": 7, "llm_foundry_mpt.csv": 191,
                                         "nemo_2407_h100_fp8.csv": 9,
                                         "torchtitan_a100_fsdp.csv": 3,
                                         "megatron_bridge_h100_fp8.csv": 2,
                                         "megatron_bridge_h100_moe.csv": 14,
                                         "nccl_2026.csv": 19,
                                         "megatron_bridge_blackwell.csv": 193,
                                         "amd_instinct_training.csv": 4,
                                         "torchtitan_long_context.csv": 45,
                                         "h200_llama_steps.csv": 23,
                                         "hf_llama_1b_steps.csv": 36}
    # and validate-model runs from it (two tables, collectives and simulated training
    # steps, the quickest of each: the whole run is the slow acceptance test's, from the
    # source tree)
    proc = subprocess.run([str(env_dir / "bin" / "vcluster"), "validate-model", "--table",
                           "nccl_a100.csv", "--table", "torchtitan_a100_fsdp.csv", "--json",
                           "v.json"], capture_output=True, text=True, timeout=300, cwd=work,
                          env=environ)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((work / "v.json").read_text())["rows"]
    assert [r["table"] for r in rows] == ["nccl_a100.csv"] * 5 + ["torchtitan_a100_fsdp.csv"] * 3
    assert {r["metric"] for r in rows} == {"busbw_gbps", "tokens_per_s_per_gpu"}
    listed = subprocess.run([str(env_dir / "bin" / "vcluster"), "hardware", "list"],
                            capture_output=True, text=True, timeout=60, cwd=work, env=environ)
    assert listed.returncode == 0, listed.stderr
    assert "a100-80gb-dgx" in listed.stdout and "h200-dgx" in listed.stdout
