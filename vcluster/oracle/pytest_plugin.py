"""pytest plugin (entry point ``vcluster_oracle``): the ``oracle`` fixture.

Installed with vcluster, it is active in every pytest run of the environment::

    def test_my_backend(oracle):
        golden = oracle.load("goldens/matmul_policies")       # relative to --oracle-dir
        results = run_my_backend(golden.inputs)               # [ {name: array}, ... ]
        oracle.assert_matches(results, golden)                # names rank, tensor, index

Golden paths are relative to ``--oracle-dir`` (or the ``oracle_dir`` ini option; default:
the rootdir). ``assert_matches`` raises :class:`~vcluster.oracle.OracleMismatch` (an
AssertionError) whose message lists every differing rank, tensor and element with its
absolute, relative and ulps error.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["Oracle", "oracle"]


def pytest_addoption(parser):
    group = parser.getgroup("vcluster-oracle")
    group.addoption("--oracle-dir", default=None,
                    help="directory that golden paths of the `oracle` fixture are relative to")
    parser.addini("oracle_dir", "directory that golden paths of the `oracle` fixture are "
                  "relative to (default: the rootdir)", default=None)


class Oracle:
    """What the ``oracle`` fixture gives a test: ``load`` goldens, ``assert_matches``."""

    def __init__(self, base_dir: str):
        self.base_dir = base_dir

    def __repr__(self) -> str:
        return f"Oracle(base_dir={self.base_dir!r})"

    def path(self, name) -> str:
        return os.path.join(self.base_dir, os.fspath(name))

    def load(self, name):
        """The :class:`~vcluster.oracle.Golden` at ``name`` (hashes verified)."""
        from vcluster.oracle import load_golden
        return load_golden(self.path(name))

    def assert_matches(self, actual_by_rank, golden, tensors=None):
        """Assert per-rank results match ``golden`` (a Golden or a path); return the
        :class:`~vcluster.oracle.Comparison`."""
        from vcluster.oracle import Golden, compare
        if not isinstance(golden, Golden):
            golden = self.load(golden)
        result = compare(actual_by_rank, golden, tensors)
        result.raise_if_mismatch()
        return result


@pytest.fixture
def oracle(request) -> Oracle:
    """Load goldens and assert per-rank results against them (see the module docstring)."""
    config = request.config
    base = config.getoption("--oracle-dir") or config.getini("oracle_dir") or str(config.rootpath)
    return Oracle(os.path.abspath(base))
