"""Message-passing algorithms: ring, binomial tree and pairwise exchange.

They move data only through :class:`~vcluster.runtime.channel.VirtualChannel` messages
(tagged with the call number and step), so their traffic is exactly that of the textbook
algorithms (Thakur, Rabenseifner & Gropp 2005). Per device, n members, |x| input bytes:

* ring all-gather: n-1 steps, sends (n-1)·|x| (|x| = the local piece);
* ring reduce-scatter: n-1 steps, sends (n-1)/n·|x|;
* ring all-reduce = ring reduce-scatter + ring all-gather: 2(n-1) steps,
  sends 2(n-1)/n·|x| (exact when n divides the element count);
* binomial-tree broadcast/reduce: ceil(lg n) rounds, every non-root receives
  (broadcast) or sends (reduce) |x| once; tree all-reduce = reduce to 0 + broadcast;
* pairwise all-to-all: n-1 exchanges of |x|/n; pairwise scatter/gather: the root sends
  (receives) one piece to (from) each member.

Ring reductions combine chunk c in ring order starting at member c; tree reductions in
the fixed binomial order. Both are independent of timing, so results are reproducible.
"""

from __future__ import annotations

import numpy as np

from .common import GroupCall, ReduceOp, scaled_shape, split_bounds

__all__ = ["ring_all_reduce", "ring_all_gather", "ring_reduce_scatter", "tree_broadcast",
           "tree_reduce", "tree_all_reduce", "pairwise_all_to_all", "pairwise_scatter",
           "pairwise_gather"]


def _neighbours(call: GroupCall) -> tuple[int, int]:
    g = call.group
    return g.members[(g.position + 1) % g.size], g.members[(g.position - 1) % g.size]


def _resident_copy(call: GroupCall, x: np.ndarray, out=None) -> np.ndarray:
    """A C-contiguous working copy of x in my arena (``out`` itself when it qualifies)."""
    arena = call.f.arenas[call.f.rank]
    if out is not None and out.shape == x.shape and arena.offset_of(out) is not None:
        buf = out
    else:
        buf = call.alloc(x.shape, x.dtype, True)
    if buf is not x:
        np.copyto(buf, x)
    return buf


def _ring_reduce_scatter_flat(call: GroupCall, pieces: list[np.ndarray], op: ReduceOp,
                              offset: int, step0: int) -> None:
    """After n-1 steps member p holds the reduction of piece (p + offset) mod n."""
    right, left = _neighbours(call)
    n, p = call.group.size, call.group.position
    for t in range(n - 1):
        send_c, recv_c = (p + offset - 1 - t) % n, (p + offset - 2 - t) % n
        handle = call.isend(right, step0 + t, pieces[send_c])
        msg = call.take(left, step0 + t)
        try:
            mine = pieces[recv_c]
            op.ufunc(msg.view().reshape(mine.shape), mine, out=mine)
        finally:
            msg.release()
        handle.wait()


def _ring_all_gather_flat(call: GroupCall, pieces: list[np.ndarray], offset: int,
                          step0: int) -> None:
    """Member p starts with piece (p + offset) mod n; after n-1 steps all have all."""
    right, left = _neighbours(call)
    n, p = call.group.size, call.group.position
    for t in range(n - 1):
        send_c, recv_c = (p + offset - t) % n, (p + offset - 1 - t) % n
        handle = call.isend(right, step0 + t, pieces[send_c])
        call.recv_into(left, step0 + t, pieces[recv_c])
        handle.wait()


def ring_all_reduce(call: GroupCall, x: np.ndarray, out, op: ReduceOp) -> np.ndarray:
    n = call.group.size
    buf = _resident_copy(call, x, out)
    flat = buf.reshape(-1)
    pieces = [flat[lo:hi] for lo, hi in split_bounds(flat.size, n)]
    _ring_reduce_scatter_flat(call, pieces, op, offset=1, step0=0)
    if op is ReduceOp.AVG:
        mine = pieces[(call.group.position + 1) % n]
        np.true_divide(mine, n, out=mine, casting="unsafe")
    _ring_all_gather_flat(call, pieces, offset=1, step0=n - 1)
    if out is not None and out is not buf:
        np.copyto(out, buf)
        return out
    return buf


def ring_all_gather(call: GroupCall, x: np.ndarray, out, dim: int) -> np.ndarray:
    n = call.group.size
    shape = scaled_shape(x.shape, dim, n, False, "all_gather")
    res = out if out is not None else call.alloc(shape, x.dtype, True)
    pieces = np.split(res, n, axis=dim)
    np.copyto(pieces[call.group.position], x)
    _ring_all_gather_flat(call, pieces, offset=0, step0=0)
    return res


def ring_reduce_scatter(call: GroupCall, x: np.ndarray, out, dim: int, op: ReduceOp):
    n = call.group.size
    shape = scaled_shape(x.shape, dim, n, True, "reduce_scatter")
    work = _resident_copy(call, np.moveaxis(x, dim, 0))   # pieces along axis 0: contiguous
    pieces = np.split(work, n, axis=0)
    _ring_reduce_scatter_flat(call, pieces, op, offset=0, step0=0)
    mine = pieces[call.group.position]
    if op is ReduceOp.AVG:
        np.true_divide(mine, n, out=mine, casting="unsafe")
    res = out if out is not None else call.alloc(shape, x.dtype, False)
    np.copyto(res, np.moveaxis(mine, 0, dim))
    return res


def tree_broadcast(call: GroupCall, x, out, root: int, step0: int = 0,
                   owned: bool = False) -> np.ndarray:
    """Binomial tree: in round k, members with relative rank < 2^k send to rel + 2^k.
    ``owned``: the root's ``x`` is a buffer of the algorithm's own (tree all-reduce's
    sum), returned as the root's result instead of copied."""
    g, n = call.group, call.group.size
    rel = (g.position - root) % n
    data = x if rel == 0 else None
    mask = 1
    while mask < n:
        if rel & mask:
            src = g.members[(rel - mask + root) % n]
            data = call.recv_into(src, step0, None)
            break
        mask <<= 1
    handles = []
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            handles.append(call.isend(g.members[(rel + mask + root) % n], step0, data))
        mask >>= 1
    for h in handles:
        h.wait()
    if out is not None:
        if out is not data:
            np.copyto(out, data)
        return out
    if data is x and not owned:                    # the root: its result, like the others'
        data = call.alloc(x.shape, x.dtype, True)  # received ones, lives in its arena
        np.copyto(data, x)
    return data


def tree_reduce(call: GroupCall, x: np.ndarray, out, op: ReduceOp, root: int,
                step0: int = 0, divide: bool = True):
    """Binomial tree: member rel combines rel + 2^k's partial result, then sends to rel - 2^k."""
    g, n = call.group, call.group.size
    rel = (g.position - root) % n
    acc = _resident_copy(call, x)
    mask = 1
    while mask < n:
        if rel & mask:
            call.isend(g.members[(rel - mask + root) % n], step0, acc).wait()
            return None
        if rel + mask < n:
            msg = call.take(g.members[(rel + mask + root) % n], step0)
            try:
                op.ufunc(acc, msg.view().reshape(acc.shape), out=acc)
            finally:
                msg.release()
        mask <<= 1
    if op is ReduceOp.AVG and divide:
        np.true_divide(acc, n, out=acc, casting="unsafe")
    if out is not None:
        np.copyto(out, acc)
        return out
    return acc


def tree_all_reduce(call: GroupCall, x: np.ndarray, out, op: ReduceOp) -> np.ndarray:
    total = tree_reduce(call, x, None, op, root=0, step0=0)
    return tree_broadcast(call, total, out, root=0, step0=1, owned=True)


def pairwise_all_to_all(call: GroupCall, x: np.ndarray, out, split_dim: int,
                        concat_dim: int) -> np.ndarray:
    g, n, p = call.group, call.group.size, call.group.position
    shape = scaled_shape(scaled_shape(x.shape, split_dim, n, True, "all_to_all"),
                         concat_dim, n, False, "all_to_all")
    res = out if out is not None else call.alloc(shape, x.dtype, True)
    src_pieces = np.split(x, n, axis=split_dim)
    dst_pieces = np.split(res, n, axis=concat_dim)
    np.copyto(dst_pieces[p], src_pieces[p])
    for k in range(1, n):
        to, frm = (p + k) % n, (p - k) % n
        handle = call.isend(g.members[to], k, src_pieces[to])
        call.recv_into(g.members[frm], k, dst_pieces[frm])
        handle.wait()
    return res


def pairwise_scatter(call: GroupCall, x, out, root: int, dim: int) -> np.ndarray:
    g, n = call.group, call.group.size
    if g.position != root:
        return call.recv_into(g.members[root], 0, out)
    pieces = np.split(x, n, axis=dim)
    handles = [call.isend(m, 0, pieces[i]) for i, m in enumerate(g.members) if i != root]
    res = out if out is not None else call.alloc(pieces[root].shape, x.dtype, False)
    np.copyto(res, pieces[root])
    for h in handles:
        h.wait()
    return res


def pairwise_gather(call: GroupCall, x: np.ndarray, out, root: int, dim: int):
    g, n = call.group, call.group.size
    if g.position != root:
        call.isend(g.members[root], 0, x).wait()
        return None
    shape = scaled_shape(x.shape, dim, n, False, "gather")
    res = out if out is not None else call.alloc(shape, x.dtype, True)
    for i, (piece, m) in enumerate(zip(np.split(res, n, axis=dim), g.members)):
        if i == root:
            np.copyto(piece, x)
        else:
            call.recv_into(m, 0, piece)
    return res
