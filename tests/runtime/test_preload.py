"""``VirtualCluster(preload=...)`` and ``$VCLUSTER_PRELOAD``: modules the launcher imports
once before it forks the devices, so every device starts with them loaded; bad names fail
before anything starts, an import that fails in the launcher fails the start with its
error and leaves nothing behind."""

import os
import sys
import time

import pytest

from mesh import Mesh
from vcluster import VirtualCluster
from vcluster.runtime.errors import VClusterError
from vcluster.runtime.options import PRELOAD_VARIABLE
from vcluster.runtime.segments import list_segments

from .processes import wait_dead

# imported by nothing in this suite's device programs, nor by this module
PROBE = "xml.dom.minidom"


def _loaded(dev, name):
    return name in sys.modules, os.getppid()


@pytest.fixture
def no_env_preload(monkeypatch):
    monkeypatch.delenv(PRELOAD_VARIABLE, raising=False)


def test_devices_start_with_the_preloaded_modules(no_env_preload):
    mesh = Mesh((2,), ("x",))
    with VirtualCluster(mesh) as plain:
        assert plain.options.preload == ()
        assert [hit for hit, _ in plain.run(_loaded, [(PROBE,)] * 2)] == [False, False]
    with VirtualCluster(mesh, preload=[PROBE, PROBE]) as cluster:
        assert cluster.options.preload == (PROBE,)          # once, in the given order
        assert f"preload={PROBE}" in repr(cluster)
        out = cluster.run(_loaded, [(PROBE,)] * 2)
    assert [hit for hit, _ in out] == [True, True]
    assert out[0][1] == out[1][1] != os.getpid()            # both forked by the launcher


def test_the_environment_variable_is_the_default(monkeypatch):
    monkeypatch.setenv(PRELOAD_VARIABLE, f" {PROBE} ,, json ")
    with VirtualCluster(Mesh((2,), ("x",))) as cluster:
        assert cluster.options.preload == (PROBE, "json")
        assert [hit for hit, _ in cluster.run(_loaded, [(PROBE,)] * 2)] == [True, True]
        with VirtualCluster(Mesh((1,), ("x",)), preload=()) as explicit:   # overrides it
            assert explicit.options.preload == ()


@pytest.mark.parametrize("preload, error, text", [
    (["no_such_module_xyz"], ValueError,
     "VirtualCluster: preload: no module named 'no_such_module_xyz' on this process's "
     "sys.path"),
    (["json", "json.no_such_submodule"], ValueError, "no module named 'json.no_such_submodule'"),
    ("json", TypeError, "preload must be a sequence of module names, got 'json'"),
    ([3], TypeError, "preload must be a sequence of module names, got [3]"),
])
def test_bad_names_fail_before_anything_starts(no_env_preload, preload, error, text):
    before = len(list_segments())
    with pytest.raises(error) as info:
        VirtualCluster(Mesh((2,), ("x",)), preload=preload)
    assert text in str(info.value)
    assert len(list_segments()) <= before


def test_a_bad_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv(PRELOAD_VARIABLE, "json,no_such_module_xyz")
    with pytest.raises(ValueError, match=r"preload \(from \$VCLUSTER_PRELOAD="
                                         r"'json,no_such_module_xyz'\): no module named "
                                         r"'no_such_module_xyz'"):
        VirtualCluster(Mesh((2,), ("x",)))


def test_an_import_failing_in_the_launcher_fails_the_start_and_leaves_nothing(
        no_env_preload, tmp_path, monkeypatch):
    (tmp_path / "vcluster_boom_probe.py").write_text(
        "raise RuntimeError('this module refuses to load')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(VClusterError) as info:
        VirtualCluster(Mesh((4,), ("x",)), preload=["json", "vcluster_boom_probe"])
    assert time.monotonic() - t0 < 30.0
    assert str(info.value) == ("the device launcher did not start: preload: importing "
                               "'vcluster_boom_probe' failed: RuntimeError: this module "
                               "refuses to load")
    assert not [s for s in list_segments() if s.split("-")[1] == str(os.getpid())]
    assert not wait_dead(sorted(_children() - before), 5.0)    # the launcher is gone


def _children() -> set:
    """This process's child processes (Linux; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return set()
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()}


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _gc_state(dev, name):
    import gc
    module = sys.modules[name]
    return gc.isenabled(), gc.get_freeze_count(), gc.is_tracked(module.__dict__)


def test_what_the_launcher_imported_is_frozen_out_of_the_collector(no_env_preload):
    """``gc.freeze`` before the forks: a device's full collections skip the launcher's
    objects (the preloaded modules' among them) and the collector stays on."""
    import gc
    with VirtualCluster(Mesh((2,), ("x",)), preload=[PROBE]) as cluster:
        for enabled, frozen, tracked in cluster.run(_gc_state, [(PROBE,)] * 2):
            assert enabled
            assert frozen > 10_000                  # numpy and the runtime at least
            assert tracked                          # frozen objects stay tracked ...
        # ... but in the permanent generation: a collection in a device leaves them
        counts = cluster.run(lambda dev: (gc.collect(), gc.get_freeze_count())[1])
        assert all(c > 10_000 for c in counts)
