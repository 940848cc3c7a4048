"""``vcluster bench collectives --mpi``: the same cases on real MPI ranks beside the
emulator's, the closed-form check inside the ranks, and the error when MPI is missing."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

from vcluster.cli.bench_collectives import OPS

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _vcluster(*args, env=None):
    return subprocess.run([sys.executable, "-m", "vcluster", *args], capture_output=True,
                          text=True, timeout=240, cwd=ROOT,
                          env=dict(env or os.environ, PYTHONPATH=ROOT))


def _launcher_files() -> set:
    """What MPI launchers leave in the temporary directory: MPICH's hydra makes a
    ``hydra_hwloc_xmlfile_*`` per run (in /tmp, whatever TMPDIR says) and removes it as it
    ends, unless it is killed or a rank calls MPI_Abort."""
    return {f for f in os.listdir("/tmp") if f.startswith("hydra_hwloc_xmlfile_")} \
        if os.path.isdir("/tmp") else set()


def _shm_segments() -> set:
    """MPICH's shared-memory segments (``/dev/shm/mpich_shm_*``): unlinked in
    ``MPI_Finalize``, so ranks stopped before it leave theirs unless the launcher's
    stopper removes them."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("mpich_shm_")} \
        if os.path.isdir("/dev/shm") else set()


def _mpi_or_skip() -> str:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'vcluster[mpi]')")
    from vcluster.cli.bench_mpi import find_mpiexec
    try:
        return find_mpiexec()
    except ValueError as exc:
        pytest.skip(f"mpi4py is installed but no MPI launcher: {exc}")


@pytest.mark.parametrize("devices", [2, 4])
def test_mpi_rows_beside_the_emulator(tmp_path, devices):
    """Every op at two tiny sizes on both engines: the same (op, path, bytes) rows, MPI's
    named by its library; every MPI result was checked against its closed form inside
    the ranks (a wrong op would have failed the run), and the side-by-side table has a
    line per row. No temporary file of the run is left behind."""
    _mpi_or_skip()
    before = set(os.listdir(tempfile.gettempdir()))
    out = tmp_path / "b.json"
    proc = _vcluster("bench", "collectives", "--mpi", "--devices", str(devices),
                     "--sizes", "8B,64KiB", "--reps", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    rows = {}
    for r in records:
        rows.setdefault(r["engine"], set()).add((r["op"], r["path"], r["bytes"]))
        assert r["devices"] == devices and r["median_s"] > 0
    assert set(rows) == {"emulator", "mpi"}
    assert rows["emulator"] == rows["mpi"] and len(rows["mpi"]) == len(OPS) * 2 * 2
    names = {r["algorithm"] for r in records if r["engine"] == "mpi"}
    assert len(names) == 1 and names.pop() in proc.stdout
    table = proc.stdout.split("emulator beside mpi")[1]
    assert sum(line.startswith(OPS) for line in table.splitlines()) == len(OPS) * 2 * 2
    assert not [f for f in set(os.listdir(tempfile.gettempdir())) - before if f.startswith("vcluster-mpi")]


def test_rounds_alternate_the_engines(tmp_path):
    """--rounds 3: the emulator and MPI take turns round by round (the printed order says
    so), every record carries its round, and the closing table gives per case the median
    over the rounds with its range, and the per-round ratio computed from the records."""
    _mpi_or_skip()
    out = tmp_path / "r.json"
    proc = _vcluster("bench", "collectives", "--mpi", "--devices", "2", "--sizes", "8B",
                     "--ops", "all_reduce", "--paths", "resident,copy", "--reps", "3",
                     "--rounds", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    turns = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert turns == [f"round {r}/3: {engine}" for r in (1, 2, 3) for engine in ("emulator", "mpi")]
    records = json.loads(out.read_text())
    by = {}
    for r in records:
        by.setdefault((r["engine"], r["path"]), {})[r["round"]] = r["median_s"]
    assert {k: sorted(v) for k, v in by.items()} == {
        (e, p): [1, 2, 3] for e in ("emulator", "mpi") for p in ("resident", "copy")}
    table = proc.stdout.split("over 3 alternating rounds")[1].splitlines()[2:4]
    assert proc.stdout.splitlines()[-1] == f"wrote {out}"
    for line, path in zip(table, ("resident", "copy")):
        ratios = sorted(by[("mpi", path)][r] / by[("emulator", path)][r] for r in (1, 2, 3))
        assert line.split()[:4] == ["all_reduce", path, "8B", "3"]
        assert line.rstrip().endswith(f"{ratios[1]:.2f}x [{ratios[0]:.2f}x-{ratios[2]:.2f}x]")


def test_rounds_refuse_the_torch_engine():
    proc = _vcluster("bench", "collectives", "--engine", "torch", "--rounds", "2",
                     "--devices", "2", "--sizes", "8B", "--ops", "all_reduce")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--rounds = 2 with --engine torch" in proc.stderr


def test_missing_mpi_fails_before_running(tmp_path):
    """--mpiexec naming no executable: exit 2 before any device starts, naming the
    argument, the value and how to install MPI (or, where mpi4py itself is missing,
    naming mpi4py)."""
    missing = str(tmp_path / "no" / "mpiexec")
    proc = _vcluster("bench", "collectives", "--mpi", "--mpiexec", missing, "--devices", "2",
                     "--sizes", "8B", "--ops", "all_reduce")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    if importlib.util.find_spec("mpi4py") is None:
        assert "--mpi needs mpi4py, which is not installed" in proc.stderr
    else:
        assert f"--mpiexec = {missing!r}: no such executable" in proc.stderr
    assert "pip install 'vcluster[mpi]'" in proc.stderr
    assert "all_reduce" not in proc.stdout          # nothing was measured


@pytest.mark.alone      # counts the launcher's files in /tmp and /dev/shm, which any MPI run makes
def test_a_run_past_its_timeout_is_killed_and_named(tmp_path):
    """Ranks that cannot finish within ``timeout_s``: TimeoutError naming the ranks and
    the launcher, soon after the limit, with the run's temporary files removed and none
    of the launcher's left (it is stopped with SIGTERM before any SIGKILL)."""
    import time

    from vcluster.cli.bench_mpi import run_mpi_bench
    launcher = _mpi_or_skip()
    before, hydra = set(os.listdir(tempfile.gettempdir())), _launcher_files()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"waited 0.5 s for 2 MPI ranks started by {launcher}"):
        run_mpi_bench(2, [64 << 20], reps=50, timeout_s=0.5)
    assert time.monotonic() - start < 15
    assert not [f for f in set(os.listdir(tempfile.gettempdir())) - before
                if f.startswith("vcluster-mpi")]
    assert not _launcher_files() - hydra


def test_unknown_ops_are_named():
    from vcluster.cli.bench_mpi import run_mpi_bench
    with pytest.raises(ValueError, match=r"ops = \['all_reduce', 'allreduce'\]: \['allreduce'\] "
                                         "unknown; allowed: all_reduce, all_gather"):
        run_mpi_bench(2, [8], ops=["all_reduce", "allreduce"])


@pytest.mark.alone      # counts the launcher's files in /tmp and /dev/shm, which any MPI run makes
def test_a_failing_rank_fails_the_run_with_its_error():
    """A rank that raises (MPI has no SUM on booleans) flags it, and the parent stops the
    launcher, which ends every rank: RuntimeError carrying the ranks' traceback, no hang,
    and no launcher file left (MPI_Abort, mpi4py's way, left MPICH's behind), nor the
    ranks' shared-memory segments (they left one a run before 2026-11-28)."""
    import time

    from vcluster.cli.bench_mpi import run_mpi_bench
    _mpi_or_skip()
    hydra, shm, start = _launcher_files(), _shm_segments(), time.monotonic()
    with pytest.raises(RuntimeError, match=r"2 MPI ranks .* exited with status [1-9](?s:.*)Allreduce"):
        run_mpi_bench(2, [8], ops=["all_reduce"], dtype="bool", timeout_s=60)
    assert time.monotonic() - start < 8          # not the rank's 10 s wait for the parent
    assert not _launcher_files() - hydra
    assert not _shm_segments() - shm             # the stopped ranks' MPICH segments too
