"""Arenas that grow (issue 32): a device's arena is a range of address space whose pages
are committed (``posix_fallocate``) as allocations reach them, so one device may hold
more than the old fixed 512 MiB while idle devices commit nothing; running out of
memory is an ``ArenaFullError`` that names the bytes needed and free; nothing outlives
the cluster.
"""

import os

import numpy as np
import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.errors import DeviceProgramError
from vcluster.runtime.arena import COMMIT_STEP_BYTES, Arena
from vcluster.runtime.segments import create_segment, list_segments, shm_available_bytes

pytestmark = pytest.mark.timeout(300)

_MiB = 1 << 20


@pytest.mark.alone   # counts the free shared memory of the whole machine
def test_arena_commits_pages_as_allocations_reach_them():
    seg = create_segment("test-growth", 1 << 30)         # a sparse 1 GiB range
    try:
        arena = Arena(0, np.frombuffer(seg.buf, np.uint8), seg.fd)
        free0 = shm_available_bytes()
        assert arena.committed_bytes == 0 and free0 is not None
        a = arena.empty((5 * _MiB,), np.uint8)             # within the first step
        assert arena.committed_bytes == COMMIT_STEP_BYTES
        b = arena.empty((40 * _MiB,), np.uint8)            # crosses it: one more step
        assert arena.committed_bytes == 2 * COMMIT_STEP_BYTES
        # the file system counts exactly the committed pages (other users may move it)
        assert free0 - shm_available_bytes() == pytest.approx(2 * COMMIT_STEP_BYTES,
                                                              abs=16 * _MiB)
        a[...], b[...] = 1, 2
        assert int(a.sum()) == 5 * _MiB and int(b.sum()) == 80 * _MiB
        del a, b                                           # freed blocks keep their pages
        assert arena.used_bytes == 0 and arena.committed_bytes == 2 * COMMIT_STEP_BYTES
        c = arena.empty((60 * _MiB,), np.uint8)            # reuses them: no new commit
        assert c is not None and arena.committed_bytes == 2 * COMMIT_STEP_BYTES
        assert "committed_bytes=67108864" in repr(arena)
        del c
    finally:
        seg.unlink()
        seg.close_fd()


@pytest.mark.alone   # counts the free shared memory of the whole machine
def test_a_device_grows_past_the_old_fixed_arena_and_idle_devices_commit_nothing():
    """768 MiB resident on rank 0 (the old default arena held 512 MiB): rank 0's segment
    holds those pages as the file system counts them (st_blocks), idle ranks' hold at
    most one commit step, and all of it returns when the cluster closes."""
    nbytes = 768 * _MiB
    with VirtualCluster(Mesh((4,), ("x",)), timeout_s=60.0) as cluster:
        assert cluster.options.arena_bytes > nbytes

        def prog(dev, nbytes):
            import os
            if nbytes:
                keep = dev.empty(nbytes // 8, np.float64)
                keep[...] = 0.5
                total = float(keep.sum())
            else:
                total = 0.0
            fd = dev._f.arenas[dev.rank]._commit_fd        # the device's own segment
            return total, os.fstat(fd).st_blocks * 512

        out = cluster.run(prog, [(nbytes,), (0,), (0,), (0,)])
        st = cluster.stats()
        free_open = shm_available_bytes()
    free_closed = shm_available_bytes()
    assert [t for t, _ in out] == [nbytes // 8 * 0.5, 0.0, 0.0, 0.0]
    assert st["arena_peak_bytes"].tolist() == [nbytes, 0, 0, 0]
    committed = st["arena_committed_bytes"].tolist()
    assert [b for _, b in out] == committed                # what the file system holds
    assert committed[0] == nbytes and max(committed[1:]) <= COMMIT_STEP_BYTES
    # no name of this process's left behind (the other workers' clusters have their own)
    assert not [s for s in list_segments() if s.split("-")[1] == str(os.getpid())]
    assert free_closed - free_open >= nbytes - 64 * _MiB   # and the pages came back


def test_a_capped_arena_says_what_it_holds_and_what_was_asked():
    with VirtualCluster(Mesh((2,), ("x",)), arena_bytes=8 * _MiB, timeout_s=30.0) as cluster:
        def prog(dev):
            keep = dev.empty(6 * _MiB, np.uint8)
            return dev.empty(4 * _MiB, np.uint8).nbytes + keep.nbytes

        with pytest.raises(DeviceProgramError) as info:
            cluster.run(prog)
        text = str(info.value)
        assert "ArenaFullError: rank 0: no room" in text
        assert "no room for an array of shape (4194304,) and dtype uint8" in text
        assert "8388608-byte range has no free extent of 4194304 bytes" in text
        assert "6291456 bytes in use" in text
        assert "arena_bytes" in text                     # how to raise the cap
