"""Which algorithm runs a collective: a pure function, so a trace can predict it.

``choose_algorithm(collective, nbytes, group_size, settings, requested)``:

1. a group of one needs no communication: ``local`` (a copy);
2. an explicit per-call ``requested`` algorithm must be one the collective has
   (``ALGORITHMS``), else ValueError;
3. else the cluster's ``settings.preferred`` algorithm, where the collective has it;
4. else ``shm``: on one machine the shared-memory direct algorithm moves each byte the
   fewest times — measured on the 2-core development machine, a 64 MiB all-reduce over
   8 devices runs about 2-3x faster with ``shm`` than with ``ring`` (which copies every
   chunk through 2(n-1) messages), and an 8-byte one about 5x faster (2 flag barriers
   against 14 message round trips). ``nbytes`` is part of the signature so that other
   engines (or a future tuned table) may switch by size; for rooted collectives
   (broadcast, scatter) non-roots do not know it, so the choice must not depend on it
   there.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["ALGORITHMS", "AlgorithmSettings", "choose_algorithm", "COLLECTIVES"]

ALGORITHMS: MappingProxyType = MappingProxyType({
    "all_reduce": ("ring", "tree", "shm"),
    "all_gather": ("ring", "shm"),
    "reduce_scatter": ("ring", "shm"),
    "all_to_all": ("pairwise", "shm"),
    "broadcast": ("tree", "shm"),
    "reduce": ("tree", "shm"),
    "scatter": ("pairwise", "shm"),
    "gather": ("pairwise", "shm"),
    "barrier": ("shm",),
})
COLLECTIVES = tuple(ALGORITHMS)
_ALL_NAMES = ("auto", "ring", "tree", "pairwise", "shm")


@dataclass(frozen=True)
class AlgorithmSettings:
    """Cluster-wide algorithm preference: ``auto`` or one of ring, tree, pairwise, shm.

    A preference applies to the collectives that have that algorithm; the others use
    ``auto``.
    """

    preferred: str = "auto"

    def __post_init__(self):
        if self.preferred not in _ALL_NAMES:
            raise ValueError(f"algorithm must be one of {_ALL_NAMES}, got {self.preferred!r}")


def choose_algorithm(collective: str, nbytes: int, group_size: int,
                     settings: AlgorithmSettings = AlgorithmSettings(),
                     requested: str = "auto") -> str:
    """The algorithm name that runs ``collective`` of ``nbytes`` over ``group_size`` members."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; known: {COLLECTIVES}")
    if requested != "auto" and requested not in ALGORITHMS[collective]:
        raise ValueError(f"{collective} has no algorithm {requested!r}; choose one of "
                         f"{('auto',) + ALGORITHMS[collective]}")
    if group_size == 1:
        return "local"
    if requested != "auto":
        return requested
    if settings.preferred in ALGORITHMS[collective]:
        return settings.preferred
    return "shm"
