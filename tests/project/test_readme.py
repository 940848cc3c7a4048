"""Every Python example in the README and in docs/timing.md runs as written."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(180)


RUNNABLE_DOCS = ("README.md", os.path.join("docs", "timing.md"))


def _python_blocks():
    blocks = []
    for name in RUNNABLE_DOCS:
        with open(os.path.join(ROOT, name)) as f:
            blocks += re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    return blocks


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
