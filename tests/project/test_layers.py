"""The layers of DESIGN.md hold: import-linter's contracts (``.importlinter``) pass on this
tree and fail on a copy with one upward import planted; and an import inside a function
that crosses packages is there for an optional dependency or carries a comment saying why.

That rule is checked by an AST scan of the project's packages
(:func:`function_local_crossings`, which skips a package folder not present): it lists every
``import`` or ``from ... import`` inside a function body whose target is another project
package (the top-level packages, and each sub-package of ``vcluster`` counted as a package of
its own) than the file's, unless a comment with a reason excuses it, and the list must be
empty. Optional dependencies (torch, jax, cupy) are not project packages, so their imports
are never listed. The excusing comment sits on the import's own line or on the line above
its import block, and says why after a colon:

* ``# why: <reason>``, in any package: an import cycle, say, or a heavy module that only
  one path needs;
* ``# lazy: <reason>``, in the front door (vcluster.cli, vcluster.scenario) only: a lower
  layer loaded when its command runs, which keeps ``vcluster --help`` fast.

A bare ``# why:`` or ``# lazy`` (no reason) excuses nothing, and neither does ``# lazy``
outside the front door: an engine's function-local crossing needs a ``# why``.
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
            "pipeline_parallel", "reports", "modeling")
FRONT_DOOR = ("vcluster.cli", "vcluster.scenario")
MAX_FUNCTION_LOCAL_CROSSINGS = 0                     # every crossing says why
# a comment that excuses a function-local crossing: the tag, a colon, a reason
_WHY = re.compile(r"#\s*why:\s*\S")
_LAZY = re.compile(r"#\s*lazy:\s*\S")


def _present(root: Path) -> list[str]:
    """The package folders of :data:`PACKAGES` that exist under ``root``."""
    return [name for name in PACKAGES if (root / name).is_dir()]


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
    """``"path:line -> target"`` for every function-local import that crosses packages
    without a comment saying why (module docstring)."""
    out = []
    for top in _present(root):
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
                        tags = (_WHY, _LAZY) if _package(module) in FRONT_DOOR else (_WHY,)
                        if _says_why(lines, node.lineno, import_lines, tags):
                            continue
                        out.append(f"{path.relative_to(root)}:{node.lineno} -> {target}")
    return out


def _says_why(lines: list[str], lineno: int, import_lines: set, tags) -> bool:
    """Whether the import at ``lineno`` (1-based), or the comment line above its import
    block, carries one of ``tags`` (compiled patterns of a tag with its reason)."""
    if any(tag.search(lines[lineno - 1]) for tag in tags):
        return True
    above = lineno - 1
    while above in import_lines:
        above -= 1
    if above < 1:
        return False
    comment = lines[above - 1].strip()
    return comment.startswith("#") and any(tag.match(comment) for tag in tags)


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
    for name in _present(ROOT):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    assert _lint_imports(tmp_path).returncode == 0          # the copy itself is clean
    with open(tmp_path / victim, "a") as f:
        f.write(planted)
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "BROKEN" in proc.stdout and broken in proc.stdout, proc.stdout


def test_every_function_local_import_across_packages_says_why():
    """No function-local import crosses packages without a ``# why: <reason>`` (or, in the
    front door, a ``# lazy: <reason>``) comment (module docstring)."""
    found = function_local_crossings()
    assert len(found) <= MAX_FUNCTION_LOCAL_CROSSINGS, "\n".join(found)


def test_the_count_sees_an_uncommented_front_door_import(tmp_path):
    """The scan is not blind: a front-door import without its comment, or with a bare
    ``# lazy``, is counted; an engine's is counted under ``# lazy:`` (engines may not be
    lazy) and under a ``# why:`` with no reason, and excused by a ``# why:`` with one."""
    for name in _present(ROOT):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    before = set(function_local_crossings(tmp_path))
    plants = {                               # file: [(comment above the import, counted)]
        "vcluster/cli/main.py": [(None, True), ("# lazy", True),
                                 ("# lazy: keeps vcluster --help fast", False)],
        "vcluster/timing/engine.py": [("# lazy: says so, but engines may not", True),
                                      ("# why:", True), ("# why:   ", True),
                                      ("# why: an import cycle through mesh", False)],
    }
    expected = set()
    for victim, cases in plants.items():
        path = tmp_path / victim
        for k, (comment, counted) in enumerate(cases):
            text = f"\n\ndef _planted_{k}():\n" + (f"    {comment}\n" if comment else "") + \
                "    import numpy  # noqa\n    from mesh import Mesh  # noqa\n"
            with open(path, "a") as f:
                f.write(text)
            if counted:
                expected.add(f"{victim}:{len(path.read_text().splitlines())} -> mesh")
    assert set(function_local_crossings(tmp_path)) - before == expected


def test_the_timing_model_knows_localhost_only_through_the_cost_model_interface():
    """No file of vcluster/timing/ mentions localhost, and nothing outside
    vcluster/localhost/ asks whether it holds a localhost object: callers use
    ``model_traces``, ``core_pool_of`` and ``for_many_programs``."""
    timing = [str(p.relative_to(ROOT)) for p in (ROOT / "vcluster" / "timing").rglob("*")
              if p.is_file() and p.suffix in (".py", ".csv")
              and "localhost" in p.read_text().lower()]
    assert timing == []
    pattern = re.compile(r"isinstance\(.*Localhost")
    asking = [f"{p.relative_to(ROOT)}:{i}" for top in _present(ROOT) + ["benchmarks"]
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
