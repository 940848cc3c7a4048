"""A device's traceback names the user's file (issue 31, item 5).

Functions defined in a script's ``__main__`` travel to the devices by value; cloudpickle
3.1.3 and later rename their code's file ``<dynamic-code>``, which left a user with
``File "<dynamic-code>", line 10, in prog``. ``vcluster.runtime.transfer.dumps`` puts the
name back.
"""

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle

from vcluster.runtime.transfer import dumps

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import numpy as np
    from mesh import Mesh
    from vcluster import VirtualCluster

    def helper(x):
        return 1 / int(x[0])

    def prog(dev):
        return helper(np.zeros(2))

    if __name__ == "__main__":
        with VirtualCluster(Mesh((2,), ("x",))) as cluster:
            cluster.run(prog, [()] * 2)
""")


def test_a_scripts_traceback_names_its_file(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT)] + sys.path)})
    assert proc.returncode == 1
    assert "ZeroDivisionError" in proc.stderr
    assert "<dynamic-code>" not in proc.stderr, proc.stderr
    assert f'File "{script}", line 10, in prog' in proc.stderr, proc.stderr
    assert f'File "{script}", line 7, in helper' in proc.stderr, proc.stderr


def test_functions_sent_by_value_keep_their_file_and_still_run():
    namespace: dict = {}
    code = compile("def twice(x):\n    return inner(x) * 2\n\ndef inner(x):\n    return x + 1\n",
                   "/somewhere/notebook_cell.py", "exec")
    exec(code, namespace)                     # a function no worker can import
    namespace["twice"].__module__ = "__main__"
    fn = pickle.loads(dumps(namespace["twice"]))
    assert fn(3) == 8
    assert fn.__code__.co_filename == "/somewhere/notebook_cell.py"
    assert fn.__globals__["inner"].__code__.co_filename == "/somewhere/notebook_cell.py"
    # the same bytes as cloudpickle but for the file names: nothing else changes
    plain = pickle.loads(cloudpickle.dumps(namespace["twice"]))
    assert plain.__code__.co_code == fn.__code__.co_code
