"""``vcluster run --out DIR`` that cannot be written fails with exit 2 before anything
runs (issue 31, item 9: it used to run the whole job, then fail with exit 1)."""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)


def _run(out):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vcluster", "run",
                           os.path.join(ROOT, "scenarios", "quickstart.yaml"), "--out", str(out),
                           "--quiet"], capture_output=True, text=True, timeout=110)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("where", ["proc", "file"])
def test_unwritable_out_is_a_usage_error_before_the_run(tmp_path, where):
    if where == "proc":
        out = "/proc/vcluster-no-such-dir/report"
        if not os.path.isdir("/proc"):
            pytest.skip("needs /proc (Linux)")
    else:
        (tmp_path / "a_file").write_text("x")
        out = tmp_path / "a_file" / "report"
    proc, elapsed_s = _run(out)
    assert proc.returncode == 2, proc.stderr
    assert f"report directory {str(out)!r} cannot be written" in proc.stderr
    assert "(--out or report.out)" in proc.stderr
    assert "devices" not in proc.stdout                 # nothing ran
    assert not list(tmp_path.glob(".vcluster-probe-*"))
