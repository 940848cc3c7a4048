"""Exactly what each collective algorithm moves, per device, without running it.

``collective_traffic`` returns the (peer, bytes, messages) a member sends and receives
in one call — the same numbers the emulator records in its ``CommEvent`` (a test checks
it event for event). Planners (``explain``), the tracer and the timing model use it to
predict traffic. Accounting conventions are those of :mod:`vcluster.runtime.events`.

With n members and |x| the local input bytes, the totals per device are:

=====================  ============================  ===================================
algorithm              sent                          received
=====================  ============================  ===================================
ring all_reduce        2(n-1)/n |x|, 2(n-1) msgs     the same
ring all_gather        (n-1) |x|                     (n-1) |x|
ring reduce_scatter    (n-1)/n |x|                   (n-1)/n |x|
pairwise all_to_all    (n-1)/n |x|                   (n-1)/n |x|
tree broadcast         |x| per child                 |x| from the parent (non-roots)
tree reduce            |x| to the parent             |x| per child
shm                    see vcluster.runtime.collectives.shm
=====================  ============================  ===================================

(ring all_reduce is exact when n divides the element count; otherwise the chunks differ
by one element and the sum is taken over them.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives.common import split_bounds
from .events import PeerTotals
from .layout import INLINE_BYTES

__all__ = ["Traffic", "collective_traffic", "binomial_parent", "binomial_children"]


@dataclass(frozen=True)
class Traffic(PeerTotals):
    """(peer, bytes, messages) tuples sorted by peer, as in ``CommEvent.sent``."""

    sent: tuple[tuple[int, int, int], ...]
    received: tuple[tuple[int, int, int], ...]


class _Tally:
    def __init__(self, me: int):
        self.me = me
        self.sent: dict[int, list[int]] = {}
        self.received: dict[int, list[int]] = {}

    def send(self, peer: int, nbytes: int) -> None:
        self._add(self.sent, peer, nbytes)

    def recv(self, peer: int, nbytes: int) -> None:
        self._add(self.received, peer, nbytes)

    def _add(self, table, peer, nbytes):
        if peer != self.me:
            entry = table.setdefault(peer, [0, 0])
            entry[0] += int(nbytes)
            entry[1] += 1

    def result(self) -> Traffic:
        def pairs(d):
            return tuple((p, b, m) for p, (b, m) in sorted(d.items()))
        return Traffic(pairs(self.sent), pairs(self.received))


def binomial_parent(rel: int) -> int | None:
    """Parent of relative rank ``rel`` in a binomial tree rooted at 0 (None for 0)."""
    if rel == 0:
        return None
    return rel - (rel & -rel)


def binomial_children(rel: int, n: int) -> list[int]:
    """Children of ``rel``: rel + 2^k for 2^k below rel's lowest set bit, in send order."""
    limit = (rel & -rel) if rel else 1 << max(n - 1, 0).bit_length()
    children, mask = [], limit >> 1
    while mask > 0:
        if rel + mask < n:
            children.append(rel + mask)
        mask >>= 1
    return children


def _pieces_bytes(size: int, n: int, itemsize: int) -> list[int]:
    return [(hi - lo) * itemsize for lo, hi in split_bounds(size, n)]


def collective_traffic(collective: str, algorithm: str, members: tuple[int, ...],
                       position: int, nbytes: int, itemsize: int, root: int = 0) -> Traffic:
    """What member ``members[position]`` moves in one call.

    ``nbytes`` is the member's local input size (for broadcast and scatter: the root's);
    ``itemsize`` the dtype's; ``root`` a position in the group.
    """
    n, me = len(members), members[position]
    t = _Tally(me)
    if algorithm == "local" or n == 1 or collective == "barrier":
        return t.result()
    at = lambda k: members[k % n]  # noqa: E731
    size = nbytes // itemsize if itemsize else 0
    if algorithm == "shm":
        _shm(t, collective, members, position, nbytes, itemsize, size, root)
    elif algorithm == "ring":
        right, left = at(position + 1), at(position - 1)
        if collective == "all_reduce":
            chunks = _pieces_bytes(size, n, itemsize)
            for offset in (0, 1):   # reduce-scatter phase, then all-gather phase
                for s in range(n - 1):
                    t.send(right, chunks[(position + offset - s) % n])
                    t.recv(left, chunks[(position + offset - s - 1) % n])
        elif collective == "all_gather":
            for _ in range(n - 1):
                t.send(right, nbytes)
                t.recv(left, nbytes)
        elif collective == "reduce_scatter":
            for _ in range(n - 1):
                t.send(right, nbytes // n)
                t.recv(left, nbytes // n)
        else:
            raise ValueError(f"{collective} has no ring algorithm")
    elif algorithm == "tree":
        rel = (position - root) % n
        if collective in ("broadcast", "all_reduce"):
            r0 = 0 if collective == "all_reduce" else root
            _tree(t, members, (position - r0) % n, r0, nbytes, reduce=False)
            if collective == "all_reduce":
                _tree(t, members, position, 0, nbytes, reduce=True)
        elif collective == "reduce":
            _tree(t, members, rel, root, nbytes, reduce=True)
        else:
            raise ValueError(f"{collective} has no tree algorithm")
    elif algorithm == "pairwise":
        if collective == "all_to_all":
            for k in range(1, n):
                t.send(at(position + k), nbytes // n)
                t.recv(at(position - k), nbytes // n)
        elif collective == "scatter":
            if position == root:
                for i, m in enumerate(members):
                    if i != root:
                        t.send(m, nbytes // n)
            else:
                t.recv(members[root], nbytes // n)
        elif collective == "gather":
            if position == root:
                for i, m in enumerate(members):
                    if i != root:
                        t.recv(m, nbytes)
            else:
                t.send(members[root], nbytes)
        else:
            raise ValueError(f"{collective} has no pairwise algorithm")
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return t.result()


def _tree(t: _Tally, members, rel: int, root: int, nbytes: int, reduce: bool) -> None:
    n = len(members)
    rank_of = lambda r: members[(r + root) % n]  # noqa: E731
    parent = binomial_parent(rel)
    children = binomial_children(rel, n)
    if reduce:
        for c in reversed(children):
            t.recv(rank_of(c), nbytes)
        if parent is not None:
            t.send(rank_of(parent), nbytes)
    else:
        if parent is not None:
            t.recv(rank_of(parent), nbytes)
        for c in children:
            t.send(rank_of(c), nbytes)


def _shm(t: _Tally, collective, members, position, nbytes, itemsize, size, root) -> None:
    n = len(members)
    if collective == "all_reduce":
        if nbytes <= INLINE_BYTES:
            for m in members:
                t.recv(m, nbytes)
        else:
            lo, hi = split_bounds(size, n)[position]
            for m in members:
                t.recv(m, (hi - lo) * itemsize)
                t.send(m, (hi - lo) * itemsize)
    elif collective == "reduce":
        if nbytes <= INLINE_BYTES:
            if position == root:
                for m in members:
                    t.recv(m, nbytes)
        else:
            lo, hi = split_bounds(size, n)[position]
            for m in members:
                t.recv(m, (hi - lo) * itemsize)
            t.send(members[root], (hi - lo) * itemsize)
    elif collective == "all_gather":
        for m in members:
            t.recv(m, nbytes)
    elif collective in ("reduce_scatter", "all_to_all"):
        for m in members:
            t.recv(m, nbytes // n)
    elif collective == "broadcast":
        t.recv(members[root], nbytes)
    elif collective == "scatter":
        t.recv(members[root], nbytes // n)
    elif collective == "gather":
        if position == root:
            for m in members:
                t.recv(m, nbytes)
    else:
        raise ValueError(f"unknown collective {collective!r}")
