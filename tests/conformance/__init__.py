"""Engine-independent conformance suite for the collective and point-to-point API.

Every check here takes a ``cluster`` -- anything with ``cluster.run(fn, args_per_rank)``
that calls ``fn(dev, *args_per_rank[r])`` on every rank r of ``mesh`` and returns the
list of results -- and compares what the devices computed with a reference computed on
the host with plain numpy (``np.concatenate`` / ``np.split`` / a reduction folded in
group order), never with the engine under test. The device programs use only the
``DeviceContext`` API (``dev.all_reduce`` ... ``dev.empty``, ``dev.xp``), so the
emulator and later engines (e.g. one over torch.distributed) can share this file; the
only engine-specific choices -- which algorithms exist, which of them must be bit-exact --
are parameters that the test module passes in.

Structure, in the spirit of mpi4py's test-suite (one test body run over many
communicators):

* a :class:`Case` describes one collective call: collective, group (``axis``),
  algorithm, dtype, per-rank input shape, keyword arguments (op, dim, root, ...), how
  the result is delivered (``out=`` mode) and whether a reduction must be bit-exact;
* :func:`enumerate_cases` (alias ``CASES``) builds the cross product that a test wants,
  pairing secondary parameters (roots, dims) cyclically instead of multiplying them out,
  and optionally rotating axes, shapes and ops;
* :func:`check_cases` runs a whole batch in ONE ``cluster.run`` (sync, async with a
  per-rank wait order, or mixed), then checks every rank's result against
  :func:`reference` and raises one AssertionError that lists every failing case;
* ``check_<collective>(cluster, mesh, axis, algorithm, dtype, shape, **kwargs)`` check a
  single call; ``check_p2p``, ``check_barrier``, ``check_errors``, ... cover the rest.

Comparison rules: data-movement collectives (gather, scatter, broadcast, all_to_all,
...) and integer reductions must match exactly; float reductions match with
``assert_allclose(rtol=1e-6 | 1e-12, atol=rtol * n * scale)`` where ``scale`` is the
larger of max|reference| and max|inputs| (the rounding error of a sum of n terms is
bounded by n eps sum|x_i|); a Case with ``exact=True`` must equal the reduction folded in
group order, ``((x0 op x1) op x2) ...``, bit for bit (real dtypes). Every member of an
all_reduce group must hold bit-identical results whatever the algorithm. Results must have the
reference's shape and dtype, and ``out=`` calls must return the ``out`` object itself.
"""

from .base import *  # noqa: F401,F403
from .cases import *  # noqa: F401,F403
from .collectives import *  # noqa: F401,F403
from .errors import *  # noqa: F401,F403
from .p2p import *  # noqa: F401,F403

__all__ = [
    "COLLECTIVES", "REDUCTIONS", "ROOTED", "OPS", "DTYPES", "SHAPES", "OUT_MODES",
    "Case", "enumerate_cases", "CASES", "axis_choices", "group_size", "make_inputs",
    "reference", "check_cases", "run_cases_program",
    "check_all_reduce", "check_all_gather", "check_reduce_scatter", "check_all_to_all",
    "check_broadcast", "check_scatter", "check_gather", "check_reduce", "check_barrier",
    "check_reproducible", "check_hierarchical_all_reduce", "check_p2p",
    "check_p2p_same_tag_fifo", "check_irecv_post_order",
    "check_p2p_pending_across_collectives", "check_errors", "check_run_raises",
    "error_cases", "LAYOUTS", "INPLACE_COLLECTIVES", "make_case",
]
