"""vcluster.runtime.cores: the cores a process may use (affinity mask, cgroup quota),
read from real files laid out as cgroup v1 and v2 mount them, and a real affinity mask."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vcluster.runtime.cores import cgroup_cpu_limit, usable_cores

ROOT = str(Path(__file__).resolve().parents[2])


def _tree(tmp_path, files: dict, proc_cgroup: str):
    for name, text in files.items():
        path = tmp_path / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    (tmp_path / "cgroup").mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return str(tmp_path / "cgroup"), str(proc)


@pytest.mark.parametrize("files, proc, want", [
    # cgroup v2 in a container (its own namespace: the process at the mount's root)
    ({"cpu.max": "200000 100000"}, "0::/\n", 2.0),
    ({"cpu.max": "max 100000"}, "0::/\n", None),
    ({"cpu.max": "150000 100000"}, "0::/\n", 1.5),
    # cgroup v2 on a host: the tightest of the process's cgroup and its ancestors
    ({"cpu.max": "max 100000", "ci.slice/cpu.max": "300000 100000",
      "ci.slice/job-7/cpu.max": "max 100000"}, "0::/ci.slice/job-7\n", 3.0),
    ({"ci.slice/cpu.max": "400000 100000", "ci.slice/job-7/cpu.max": "50000 100000"},
     "0::/ci.slice/job-7\n", 0.5),
    # cgroup v1: the cpu controller's hierarchy, mounted as cpu,cpuacct
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
      "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000",
      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"},
     "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", 2.5),
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
     "2:cpuacct:/\n1:cpu:/\n0::/\n", None),
    # nothing readable: no limit
    ({}, "0::/\n", None),
    ({"cpu.max": "garbage"}, "0::/\n", None),
])
def test_cgroup_cpu_limit_reads_v1_and_v2(tmp_path, files, proc, want):
    root, proc_file = _tree(tmp_path, files, proc)
    got = cgroup_cpu_limit(root, proc_file)
    assert got == (None if want is None else pytest.approx(want))


def test_usable_cores_is_the_affinity_at_most_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    none, proc = _tree(tmp_path / "a", {}, "0::/\n")
    assert usable_cores(none, proc) == affinity
    half, proc = _tree(tmp_path / "b", {"cpu.max": "50000 100000"}, "0::/\n")
    assert usable_cores(half, proc) == 1                    # half a core: one CPU, partly
    one_and_half, proc = _tree(tmp_path / "c", {"cpu.max": "150000 100000"}, "0::/\n")
    assert usable_cores(one_and_half, proc) == min(affinity, 2)
    assert usable_cores(str(tmp_path / "missing"), str(tmp_path / "missing")) == affinity


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks here")
def test_a_process_pinned_to_one_cpu_has_one_core():
    """As under ``taskset -c 0``: the machine's CPU count is not what the process gets."""
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os, sys; sys.path.insert(0, {ROOT!r}); os.sched_setaffinity(0, {{{cpu}}}); "
            "from vcluster.runtime.cores import usable_cores; print(usable_cores())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "1"
