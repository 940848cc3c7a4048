"""The correctness oracle: golden per-rank inputs, outputs and gradients, and the check.

>>> golden = capture(VirtualCluster(mesh), program, args_by_rank, name="ffn")  # doctest: +SKIP
>>> save_golden(golden, "goldens/ffn")                                         # doctest: +SKIP
>>> compare(torch_results_by_rank, "goldens/ffn").raise_if_mismatch()          # doctest: +SKIP

``vcluster oracle export FILE --out DIR [--engine emulator|torch]`` writes a golden from a
scenario file and ``vcluster oracle check DIR --actual DIR2`` compares two (docs/oracle.md);
the pytest plugin (:mod:`vcluster.oracle.pytest_plugin`) gives tests an ``oracle`` fixture.
"""

from .capture import (capture, engine_description, flatten_arrays, flatten_results,
                      golden_from_run, split_results)
from .compare import (Comparison, Mismatch, OracleMismatch, compare, default_tolerance,
                      ulps_between)
from .golden import FORMAT, KINDS, Golden, load_golden, save_golden
from .hashing import array_sha256, canonical_bytes

__all__ = ["capture", "engine_description", "flatten_arrays", "flatten_results",
           "golden_from_run", "split_results", "Comparison", "Mismatch", "OracleMismatch",
           "compare", "default_tolerance", "ulps_between", "FORMAT", "KINDS", "Golden",
           "load_golden", "save_golden", "array_sha256", "canonical_bytes"]
