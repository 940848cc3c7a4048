"""Every Python example in the README runs as written."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(180)


def _python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(index, tmp_path):
    code = _python_blocks()[index]
    script = tmp_path / f"readme_{index}.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=150, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr


def test_readme_commands_are_the_ci_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    test_command = "bash scripts/install-test-deps.sh && pytest"
    assert test_command in readme and test_command in ci
