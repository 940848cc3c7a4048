"""Devices keep the memory they free (vcluster/runtime/launcher.py, keep_freed_memory):
a program's arrays after its first step land on pages already touched, not on fresh
pages the kernel must fault in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="mallopt and ru_minflt are Linux (glibc) figures")]

ARRAYS, ARRAY_BYTES = 16, 1 << 20          # one "step": 16 MiB of 1 MiB activations
PAGES = ARRAYS * ARRAY_BYTES // 4096


def step_faults(dev=None, steps: int = 3) -> int:
    """Minor page faults of the last of ``steps`` steps, each keeping ARRAYS fresh 1 MiB
    arrays alive (written in full, as results are) and then freeing them."""
    import resource
    faults = 0
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        kept = [np.ones(ARRAY_BYTES // 8) for _ in range(ARRAYS)]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del kept
    return faults


def _plain_process_faults(keep: bool) -> int:
    """step_faults in a fresh Python process, with or without keep_freed_memory()."""
    code = textwrap.dedent(f"""
        from vcluster.runtime.launcher import keep_freed_memory
        import test_device_memory as t
        assert {keep} is False or keep_freed_memory()
        print(t.step_faults())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=Path(__file__).parent)
    return int(out.stdout.split()[-1])


def test_a_plain_process_faults_its_steps_in_again():
    """The control: glibc's defaults unmap or trim what a step freed, so the third step
    touches fresh pages (most of its 4096)."""
    assert _plain_process_faults(keep=False) > PAGES // 2


def test_keep_freed_memory_reuses_the_pages_of_the_step_before():
    assert _plain_process_faults(keep=True) < PAGES // 10


def test_devices_keep_freed_memory():
    with VirtualCluster(Mesh((2,), ("a",))) as cluster:
        faults = cluster.run(step_faults)
    assert all(f < PAGES // 10 for f in faults), faults
