"""Hardening: SIGTERM during a training run with checkpoints leaves no process, no
shared-memory segment and no half-written checkpoint, and the run resumes bit for bit;
a soak of 2,000 random collectives leaks no memory, file descriptor, segment or
shared-memory mapping."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.checkpoint import list_checkpoints, load_checkpoint, params_sha256
from vcluster import VirtualCluster
from vcluster.runtime.segments import list_segments

from .processes import wait_dead as _wait_dead

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES, BATCH, STEPS = [8, 32, 32, 32, 4], 32, 120   # ~60 ms a step: a run of ~7 s




def _data():
    rng = np.random.default_rng(11)
    return rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1]))


TRAIN = """
import sys, time
sys.path.insert(0, {root!r})
import numpy as np
from mesh import Mesh
from pipeline_parallel import MLP
from vcluster import VirtualCluster
rng = np.random.default_rng(11)
X, Y = rng.standard_normal(({batch}, {n_in})), rng.standard_normal(({batch}, {n_out}))
with VirtualCluster(Mesh((2, 2), ("pp", "tp"))) as c:
    print("PIDS", " ".join(map(str, c.pids)), flush=True)
    MLP({sizes}, seed=4).fit(c, X, Y, steps={steps}, microbatches=4, optimizer="adam",
                             lr=0.01, action_costs={{"F": 0.004}}, checkpoint_every=1,
                             checkpoint_dir={ckpt!r})
print("DONE", flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("checkpoints,delay_s", [(1, 0.0), (4, 0.03)])
def test_sigterm_during_training_leaves_nothing_half_done(tmp_path, checkpoints, delay_s):
    """SIGTERM once ``checkpoints`` checkpoints exist (plus ``delay_s``: another moment
    of the step), well before the run's end whatever the machine's speed."""
    ckpt = str(tmp_path / "ckpt")
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(root=ROOT, batch=BATCH, n_in=SIZES[0], n_out=SIZES[-1],
                                   sizes=SIZES, steps=STEPS, ckpt=ckpt))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    deadline = time.monotonic() + 60
    while len(list_checkpoints(ckpt)) < checkpoints and time.monotonic() < deadline:
        time.sleep(0.005)                             # training is under way
    time.sleep(delay_s)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and "DONE" not in out
    assert _wait_dead(pids) == [], "device processes outlived a SIGTERM'd host"
    assert not [s for s in list_segments() if s.split("-")[1] == str(proc.pid)]
    # every visible checkpoint is complete; at most a hidden temporary one is left
    found = list_checkpoints(ckpt)
    assert 0 < len(found) < STEPS, found
    for step, path in found:
        assert load_checkpoint(path).step == step
    assert all(n.startswith(".") for n in os.listdir(ckpt) if not n.startswith("step-"))
    # the run resumes from the newest one and ends where an uninterrupted run ends
    X, Y = _data()
    mlp = MLP(SIZES, seed=4)
    kw = dict(steps=STEPS, microbatches=4, optimizer="adam", lr=0.01)
    with VirtualCluster(Mesh((2, 2), ("pp", "tp"))) as c:
        resumed = mlp.fit(c, X, Y, **kw, resume_from=ckpt)
        clean = mlp.fit(c, X, Y, **kw)
    assert params_sha256(resumed.params) == params_sha256(clean.params)
    assert np.array_equal(resumed.losses, clean.losses)


# --- soak --------------------------------------------------------------------------------

_AXES = (None, "a", "b", ("a", "b"))
_DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16)
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_MAX_BYTES = 4 << 20


def _plan(n_calls: int, seed: int) -> list[tuple]:
    """(kind, axis, dtype, elements per rank): sizes log-uniform in 0 B .. 4 MiB."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_calls):
        dtype = np.dtype(_DTYPES[rng.integers(len(_DTYPES))])
        nbytes = 0 if rng.random() < 0.05 else int(np.exp(rng.uniform(0, np.log(_MAX_BYTES))))
        elements = (nbytes // dtype.itemsize) // 4 * 4          # divisible by group sizes
        out.append((_KINDS[rng.integers(len(_KINDS))], _AXES[rng.integers(len(_AXES))],
                    dtype.str, elements))
    return out


def _soak(dev, plan, first):
    """Run the calls; check each against the closed form (inputs are small integers, so
    sums are exact in every dtype); return the first mismatch, or None."""
    for i, (kind, axis, dtype, n) in enumerate(plan):
        members = dev.mesh.group(dev.mesh.axis_tuple(axis), dev.rank)
        p, pos = len(members), members.index(dev.rank)
        x = np.full(n, (first + i + dev.rank) % 7, dtype=dtype)
        if kind == "all_reduce":
            got = dev.all_reduce(x, axis)
            want = np.full(n, sum((first + i + r) % 7 for r in members), dtype=dtype)
        elif kind == "all_gather":
            got = dev.all_gather(x, axis)
            want = np.concatenate([np.full(n, (first + i + r) % 7, dtype=dtype) for r in members])
        elif kind == "reduce_scatter":
            got = dev.reduce_scatter(x, axis)
            want = np.full(n // p, sum((first + i + r) % 7 for r in members), dtype=dtype)
        elif kind == "all_to_all":
            got = dev.all_to_all(x, axis)
            want = np.concatenate([np.full(n // p, (first + i + r) % 7, dtype=dtype)
                                   for r in members])
        else:
            got = dev.broadcast(x, axis, root=0)
            want = np.full(n, (first + i + members[0]) % 7, dtype=dtype)
        if got.shape != want.shape or not np.array_equal(got, want):
            return (first + i, kind, axis, dtype, n, pos)
    return None


def _usage(pids) -> tuple[int, int, int, int]:
    """(RSS bytes, open file descriptors, memory mappings, of them /dev/shm mappings)
    summed over ``pids``."""
    rss = fds = maps = shm = 0
    for pid in pids:
        with open(f"/proc/{pid}/statm") as f:
            rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        fds += len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
        maps += len(lines)
        shm += sum("/dev/shm/" in line for line in lines)
    return rss, fds, maps, shm


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_of_2000_random_collectives_leaks_nothing():
    plan, chunk = _plan(2000, seed=2026), 100
    with VirtualCluster(Mesh((2, 2), ("a", "b")), timeout_s=60.0) as cluster:
        pids = [os.getpid(), *cluster.pids]
        samples = []
        for start in range(0, len(plan), chunk):
            part = plan[start:start + chunk]
            bad = [r for r in cluster.run(_soak, [(part, start)] * 4) if r is not None]
            assert not bad, bad
            cluster.reset_stats()                 # the trace is bounded by design
            samples.append(_usage(pids))
        rss, fds, maps, shm = zip(*samples)
        warm = 5                                  # after 500 calls every buffer size was seen
        assert max(fds[warm:]) <= fds[warm], fds
        assert len(set(shm)) == 1, shm            # shared-memory mappings: never one more
        assert max(maps[warm:]) <= maps[warm] + 32, maps   # malloc arenas come and go
        # no growth: the last RSS is within 64 MiB (1 MiB per process per 100 calls
        # would be 75 MiB) of the warmed-up level, summed over host and 4 devices
        assert rss[-1] - rss[warm] < 64 << 20, [r >> 20 for r in rss]
        assert _my_segments() == []        # names are dropped once every process mapped them
    assert _my_segments() == []


def _my_segments() -> list[str]:
    """This process's /dev/shm segments (other test runs may share the machine)."""
    return [s for s in list_segments() if s.split("-")[1] == str(os.getpid())]
