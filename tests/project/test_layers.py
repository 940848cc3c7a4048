"""The layers of DESIGN.md hold: import-linter's contracts (``.importlinter``) pass on this
tree and fail on a copy with one upward import planted; function-local imports that cross
packages are counted and kept few.

The count (:func:`function_local_crossings`) is an AST scan of the seven packages: an
``import`` or ``from ... import`` inside a function body whose target is another project
package (the top-level packages, and each sub-package of ``vcluster`` counted as a package of
its own) than the file's. Not counted: optional dependencies (torch, jax, cupy: not project
packages) and the front door's (vcluster.cli, vcluster.scenario) lazy imports of lower
layers, which carry a ``# lazy`` comment on the line above their block (they keep
``vcluster --help`` fast).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vcluster", "mesh", "sharding", "pipelining", "tensor_parallel",
            "pipeline_parallel", "reports")
FRONT_DOOR = ("vcluster.cli", "vcluster.scenario")
MAX_FUNCTION_LOCAL_CROSSINGS = 15                    # the bound


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or \
        shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter, a test dependency) is not installed"
    env = dict(os.environ, PYTHONPATH=str(cwd))       # this tree's packages come first
    return subprocess.run([exe, "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "vcluster" and len(parts) > 1 else parts[0]


def _module(path: Path, root: Path) -> tuple[str, bool]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _targets(node, module: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not node.level:
        return [node.module]
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return [".".join(base + ([node.module] if node.module else []))]


def function_local_crossings(root: Path = ROOT) -> list[str]:
    """``"path:line -> target"`` for every counted function-local import (module docstring)."""
    out = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module, is_pkg = _module(path, root)
            lines = path.read_text().splitlines()
            tree = ast.parse("\n".join(lines))
            import_lines = {i for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                            for i in range(n.lineno, n.end_lineno + 1)}
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if not isinstance(node, (ast.Import, ast.ImportFrom)):
                        continue
                    for target in _targets(node, module, is_pkg):
                        if target.split(".")[0] not in PACKAGES or \
                                _package(target) == _package(module):
                            continue
                        if _package(module) in FRONT_DOOR and _lazy(lines, node.lineno,
                                                                     import_lines):
                            continue
                        out.append(f"{path.relative_to(root)}:{node.lineno} -> {target}")
    return out


def _lazy(lines: list[str], lineno: int, import_lines: set) -> bool:
    """Whether the import at ``lineno`` (1-based) or the line above its block says lazy."""
    if "# lazy" in lines[lineno - 1]:
        return True
    above = lineno - 1
    while above in import_lines:
        above -= 1
    return above >= 1 and lines[above - 1].strip().startswith("# lazy")


def test_the_layer_contracts_hold():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Imports point downward only" in proc.stdout and "BROKEN" not in proc.stdout


@pytest.mark.parametrize("victim, planted, broken", [
    # a function-local upward import: the lowest layer reaching the front door
    ("mesh/mesh.py", "\n\ndef _planted():\n    from vcluster.cli import main  # noqa\n",
     "mesh is not allowed to import vcluster.cli"),
    # an engine reaching an algorithm, at module level
    ("vcluster/timing/engine.py", "\nimport tensor_parallel  # noqa\n",
     "vcluster.timing is not allowed to import tensor_parallel"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, victim, planted, broken):
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    assert _lint_imports(tmp_path).returncode == 0          # the copy itself is clean
    with open(tmp_path / victim, "a") as f:
        f.write(planted)
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "BROKEN" in proc.stdout and broken in proc.stdout, proc.stdout


def test_few_function_local_imports_cross_packages():
    found = function_local_crossings()
    assert len(found) <= MAX_FUNCTION_LOCAL_CROSSINGS, "\n".join(found)


def test_the_count_sees_an_uncommented_front_door_import(tmp_path):
    """The scan is not blind: a front-door import without its comment is counted, and an
    engine's function-local import is counted whatever its comment says."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    before = len(function_local_crossings(tmp_path))
    with open(tmp_path / "vcluster/cli/main.py", "a") as f:
        f.write("\n\ndef _planted():\n    from mesh import Mesh  # noqa\n")
    with open(tmp_path / "vcluster/timing/engine.py", "a") as f:
        f.write("\n\ndef _planted():\n    # lazy: says so, but engines may not\n"
                "    from mesh import Mesh  # noqa\n")
    assert len(function_local_crossings(tmp_path)) == before + 2


def test_the_timing_model_knows_localhost_only_through_the_cost_model_interface():
    """No file of vcluster/timing/ mentions localhost, and nothing outside
    vcluster/localhost/ asks whether it holds a localhost object: callers use
    ``model_traces``, ``core_pool_of`` and ``for_many_programs``."""
    timing = [str(p.relative_to(ROOT)) for p in (ROOT / "vcluster" / "timing").rglob("*")
              if p.is_file() and p.suffix in (".py", ".csv")
              and "localhost" in p.read_text().lower()]
    assert timing == []
    pattern = re.compile(r"isinstance\(.*Localhost")
    asking = [f"{p.relative_to(ROOT)}:{i}" for top in PACKAGES + ("benchmarks",)
              for p in (ROOT / top).rglob("*.py") if "vcluster/localhost" not in p.as_posix()
              for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert asking == []


@pytest.mark.parametrize("old", ["vcluster.timing.localhost", "vcluster.timing.localhost_spec",
                                 "vcluster.timing.host_cores", "vcluster.timing.localhost_pool",
                                 "vcluster.faults", "pipeline_parallel.gpt_plan",
                                 "tensor_parallel.auto_layout", "vcluster.torchdist.run",
                                 "vcluster.cli.units"])
def test_moved_modules_are_moved_not_shimmed(old):
    """docs/changelog.md lists the old paths; none of them still imports."""
    assert importlib.util.find_spec(old) is None
    assert f"`{old}`" in (ROOT / "docs" / "changelog.md").read_text()
