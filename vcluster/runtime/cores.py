"""How many cores this process may keep busy: the width of the devices' thread pools, and the
``cores`` of the ``localhost`` hardware.

``os.cpu_count()`` counts the machine's CPUs, not the ones a process may use. Under
``taskset``, ``docker --cpuset-cpus`` or a CI runner's affinity mask the process runs on
fewer; under ``docker --cpus=2`` or a Kubernetes CPU limit its cgroup grants it a quota
of ``quota / period`` cores' time however many CPUs it may run on. The devices of a
:class:`~vcluster.VirtualCluster` inherit both, so the core pool the timing model
replays on has

    cores = min(len(affinity mask), ceil(min over the cgroup and its ancestors of
                                          quota / period))

(``ceil``: a quota of 1.5 cores keeps two CPUs partly busy; the pool's measured
throughput ``T(k)`` carries the fraction). A quota is a long-run figure: the kernel
grants it per period (100 ms by default) and throttles the cgroup once it is spent, so a
run of a few ms under a one-core quota on two CPUs takes either its two-CPU time or that
plus the rest of a period (measured: a quickstart step 14 ms in one run, 61 ms in the
next, against 36–48 ms predicted). Pin with an affinity mask for steady timings.

cgroup v2 states the quota in ``cpu.max`` (``"200000 100000"``, or ``"max 100000"`` for
none); v1 in ``cpu.cfs_quota_us`` (-1 for none) over ``cpu.cfs_period_us``, under the
hierarchy that mounts the ``cpu`` controller. Files that are absent or unreadable (not
Linux, no cgroup mounted) mean no limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cores", "usable_cpus", "device_cpu_sets", "cgroup_cpu_limit"]


def usable_cores(cgroup_root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup") -> int:
    """The cores this process may keep busy (>= 1): its affinity mask's CPUs (else
    ``os.cpu_count()``), at most its cgroup CPU quota rounded up."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):                    # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit - 1e-9))
    return max(1, cpus)


def usable_cpus(cgroup_root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup") -> tuple:
    """The CPU numbers devices may be pinned to: the affinity mask's, lowest first, as many
    as :func:`usable_cores` (under a cgroup quota of q cores, the first ceil(q): devices
    packed there never run more at once than the quota grants, so the kernel need not
    throttle them). Empty where affinity masks are not supported (not Linux)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ()
    return tuple(cpus[:usable_cores(cgroup_root, proc_cgroup)])


def device_cpu_sets(n_devices: int, cpus) -> tuple:
    """The CPUs each of ``n_devices`` devices (ranks 0 .. n-1) is pinned to: consecutive
    ranks share a CPU, ``cpus[floor(r C / n)]`` .. ``cpus[ceil((r + 1) C / n) - 1]`` for
    rank r of n on C CPUs: with n >= C about n / C ranks per CPU, with n < C blocks of
    about C / n CPUs (a rank whose share straddles two CPUs gets both).

    Why consecutive ranks: a mesh's last axis varies fastest, so they are the ranks that
    talk most (a pipeline's stages with ``("dp", "pp")``, a tensor-parallel group with
    ``tp`` last); on one CPU a receiver that waits yields to the sender that will wake it,
    and the sender's data is still in that CPU's caches. Measured on the 2-core machine
    (issue 32; benchmarks/README.md): the width-128 MLP step on dp 2 x pp 4, one pipeline
    replica per CPU, took 7.4-7.7 ms against 8.4-8.5 ms free to migrate on a quiet
    machine, 8.8-9.1 ms against 14-22 ms under other load, with ~5% less CPU.
    """
    cpus = tuple(cpus)
    c = len(cpus)
    if n_devices < 1 or c < 1:
        raise ValueError(f"device_cpu_sets: need >= 1 device and >= 1 CPU, got "
                         f"{n_devices} device(s) on CPUs {cpus}")
    return tuple(tuple(cpus[(r * c) // n_devices:-(-((r + 1) * c) // n_devices)])
                 for r in range(n_devices))


def cgroup_cpu_limit(cgroup_root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup"):
    """The tightest CPU quota (in cores) on this process's cgroup or its ancestors, or
    None when none is set or none can be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root, limits = Path(cgroup_root), []
    for line in lines:
        parts = line.split(":", 2)                    # hierarchy-ID:controllers:path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                         # cgroup v2 (unified)
            limits += [_v2_limit(d) for d in _up_from(root, path)]
        elif "cpu" in controllers.split(","):         # cgroup v1, the cpu hierarchy
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    limits += [_v1_limit(d) for d in _up_from(mount, path)]
                    break
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def _up_from(mount: Path, path: str) -> list:
    """The directories of ``path`` under ``mount`` and of each ancestor, up to ``mount``
    (in a container with its own cgroup namespace ``path`` is ``/``: the mount itself)."""
    parts = [p for p in path.strip().split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_limit(directory: Path):
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _quota(fields[0], fields[1])


def _v1_limit(directory: Path):
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _quota(quota, period)


def _quota(quota: str, period: str):
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path):
    try:
        return path.read_text().strip()
    except OSError:
        return None
