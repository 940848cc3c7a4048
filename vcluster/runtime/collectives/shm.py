"""The shared-memory direct algorithm ("shm") of every collective.

All members publish where their buffers are (phase 1) and wait for each other; then each
reads what it needs straight from its peers' arenas — or, for the reductions, reduces its
own 1/n chunk of every member's input and writes the result into every member's output —
and finally waits until all are done (phase 2) so nobody reuses a buffer still being
read. When every member's input fits inline in its descriptor (<= 512 B) the data is
copied out of the control segment and phase 2 is skipped (``GroupCall.inline``: phase 2
is written without a wake-up). An inline reduction is one ``ufunc.accumulate`` over the
(members, elements) block of the snapshot (:func:`~.common.reduce_rows`).

Per device, with n members and |x| the input bytes (reductions: chunks of |x|/n):

==============  ======================================  ======================================
collective      sent (written into peers' buffers)      received (read from peers' buffers)
==============  ======================================  ======================================
all_reduce      (n-1)/n |x|  (large);  0 (inline)       (n-1)/n |x|  (large); (n-1)|x| (inline)
reduce          root: 0; others |x|/n (large)           (n-1)/n |x| (large); root (n-1)|x| inline
all_gather      0                                       (n-1) |x|
reduce_scatter  0                                       (n-1)/n |x|
all_to_all      0                                       (n-1)/n |x|
broadcast       0                                       |x| on non-roots
scatter         0                                       |x|/n on non-roots
gather          0                                       (n-1) |x| on the root
==============  ======================================  ======================================

Reductions combine members strictly in group order, so results are bit-for-bit
reproducible and independent of arrival order.
"""

from __future__ import annotations

import numpy as np

from ..layout import INLINE_BYTES
from .common import GroupCall, ReduceOp, reduce_into, reduce_rows, scaled_shape, split_bounds

__all__ = ["all_reduce", "reduce_inline", "reduce", "all_gather", "reduce_scatter",
           "all_to_all", "broadcast", "scatter", "gather", "barrier"]


def _agree(call: GroupCall, dtype, shape, arg) -> None:
    call.check_agree_all(dtype, shape, arg)


def _done(call: GroupCall) -> None:
    if call.all_inline():
        call.inline = True
    else:
        call.arrive(2)
        call.wait_all(2)


def _result(call: GroupCall, out, shape, dtype, resident: bool) -> np.ndarray:
    return out if out is not None else call.alloc(shape, dtype, resident)


def reduce_inline(call: GroupCall, out, x, op: ReduceOp, n: int):
    """The group-order fold of every member's inline input (phase 1 reached), in ``out``
    when given."""
    rows = call.inline_inputs(x.dtype, x.size)          # (n, size), group order
    call.inline = True
    if type(rows) is np.ndarray:                        # host memory: one numpy call
        res = reduce_rows(out, rows, op, n)
        if res is not None:
            return res if out is not None else res.reshape(x.shape)
    res = _result(call, out, x.shape, x.dtype, False)
    _reduce_to(res, list(rows), op, n)
    return res


def _reduce_to(res: np.ndarray, sources: list[np.ndarray], op: ReduceOp, n: int) -> None:
    """reduce_into a flat view of ``res``; through a contiguous copy when ``res`` (a
    caller's out=) is not contiguous, as ``reshape(-1)`` would silently copy it then."""
    if res.flags.c_contiguous:
        reduce_into([res.reshape(-1)], sources, op, n)
        return
    tmp = np.empty_like(res, order="C")
    reduce_into([tmp.reshape(-1)], sources, op, n)
    np.copyto(res, tmp)


def all_reduce(call: GroupCall, x: np.ndarray, out, op: ReduceOp) -> np.ndarray:
    g, n = call.group, call.group.size
    if x.nbytes <= INLINE_BYTES:
        call.publish(x, arg=op.code)
        call.wait_all(1)
        _agree(call, x.dtype, x.shape, op.code)
        call.count_received_from_all(x.nbytes)
        return reduce_inline(call, out, x, op, n)
    arena = call.arenas[call.f.rank]
    res = out if out is not None and arena.offset_of(out) is not None else \
        call.alloc(x.shape, x.dtype, True)
    call.publish(x, arg=op.code, out=res)
    call.wait_all(1)
    _agree(call, x.dtype, x.shape, op.code)
    lo, hi = split_bounds(x.size, n)[g.position]
    sources = [call.peer_input(m).reshape(-1)[lo:hi] for m in g.members]
    dests = [call.peer_output(m, x.shape, x.dtype).reshape(-1)[lo:hi] for m in g.members]
    reduce_into(dests, sources, op, n)
    for m in g.members:
        call.count_received(m, (hi - lo) * x.itemsize)
        call.count_sent(m, (hi - lo) * x.itemsize)
    call.arrive(2)
    call.wait_all(2)
    if out is not None and out is not res:
        np.copyto(out, res)
        return out
    return res


def reduce(call: GroupCall, x: np.ndarray, out, op: ReduceOp, root: int):
    g, n = call.group, call.group.size
    root_rank, is_root = g.members[root], g.position == root
    if x.nbytes <= INLINE_BYTES:
        call.publish(x, arg=op.code * 4096 + root)
        call.wait_all(1)
        _agree(call, x.dtype, x.shape, op.code * 4096 + root)
        if not is_root:
            call.inline = True
            return None
        for m in g.members:
            call.count_received(m, x.nbytes)
        return reduce_inline(call, out, x, op, n)
    arena = call.arenas[call.f.rank]
    res = None
    if is_root:
        res = out if out is not None and arena.offset_of(out) is not None else \
            call.alloc(x.shape, x.dtype, True)
    call.publish(x, arg=op.code * 4096 + root, out=res)
    call.wait_all(1)
    _agree(call, x.dtype, x.shape, op.code * 4096 + root)
    lo, hi = split_bounds(x.size, n)[g.position]
    sources = [call.peer_input(m).reshape(-1)[lo:hi] for m in g.members]
    dest = call.peer_output(root_rank, x.shape, x.dtype).reshape(-1)[lo:hi]
    reduce_into([dest], sources, op, n)
    for m in g.members:
        call.count_received(m, (hi - lo) * x.itemsize)
    call.count_sent(root_rank, (hi - lo) * x.itemsize)
    call.arrive(2)
    call.wait_all(2)
    if not is_root:
        return None
    if out is not None and out is not res:
        np.copyto(out, res)
        return out
    return res


def all_gather(call: GroupCall, x: np.ndarray, out, dim: int) -> np.ndarray:
    n = call.group.size
    shape = scaled_shape(x.shape, dim, n, False, "all_gather")
    call.publish(x, arg=dim)
    call.wait_all(1)
    _agree(call, x.dtype, x.shape, dim)
    res = _concatenate_members(call, x, out, shape, dim)
    _done(call)
    return res


def _concatenate_members(call: GroupCall, x: np.ndarray, out, shape, dim: int) -> np.ndarray:
    """Every member's input, read in place, concatenated along ``dim`` in group order."""
    g = call.group
    res = _result(call, out, shape, x.dtype, x.nbytes * g.size > INLINE_BYTES)
    for piece, m in zip(np.split(res, g.size, axis=dim), g.members):
        np.copyto(piece, x if m == call.f.rank else call.peer_input(m))
        call.count_received(m, x.nbytes)
    return res


def reduce_scatter(call: GroupCall, x: np.ndarray, out, dim: int, op: ReduceOp) -> np.ndarray:
    g, n = call.group, call.group.size
    shape = scaled_shape(x.shape, dim, n, True, "reduce_scatter")
    call.publish(x, arg=dim * 16 + op.code)
    call.wait_all(1)
    _agree(call, x.dtype, x.shape, dim * 16 + op.code)
    pieces = [np.split(call.peer_input(m), n, axis=dim)[g.position] for m in g.members]
    res = _result(call, out, shape, x.dtype, x.nbytes > INLINE_BYTES)
    if dim % x.ndim == 0:
        _reduce_to(res, [p.reshape(-1) for p in pieces], op, n)
    else:
        reduce_into([res], pieces, op, n)
    for m in g.members:
        call.count_received(m, pieces[0].nbytes)
    _done(call)
    return res


def all_to_all(call: GroupCall, x: np.ndarray, out, split_dim: int, concat_dim: int):
    g, n = call.group, call.group.size
    shape = scaled_shape(scaled_shape(x.shape, split_dim, n, True, "all_to_all"),
                         concat_dim, n, False, "all_to_all")
    arg = (split_dim % x.ndim) * 64 + concat_dim % x.ndim
    call.publish(x, arg=arg)
    call.wait_all(1)
    _agree(call, x.dtype, x.shape, arg)
    res = _result(call, out, shape, x.dtype, x.nbytes > INLINE_BYTES)
    split, concat = split_dim % x.ndim, concat_dim % x.ndim
    k = x.shape[split] // n
    mine = (slice(None),) * split + (slice(g.position * k, (g.position + 1) * k),)
    if call.all_inline():
        # every input in the descriptors: my piece of each, (members, *piece), in one
        # indexing, then member m's piece to place m along concat_dim in one copy
        pieces = call.inline_inputs(x.dtype, x.size).reshape((n,) + x.shape)[(slice(None),)
                                                                               + mine]
        order = list(range(1, x.ndim + 1))
        order.insert(concat, 0)
        np.copyto(res, pieces.transpose(order).reshape(shape))
    else:
        for piece, m in zip(np.split(res, n, axis=concat_dim), g.members):
            np.copyto(piece, call.peer_input(m)[mine])    # a slice, not n pieces per member
    call.count_received_from_all(x.nbytes // n)
    _done(call)
    return res


def _rooted_meta(call: GroupCall, root: int, arg: int):
    """Check every member agrees on (root, arg); return the root's dtype and shape."""
    for m in call.group.members:
        _, _, _, a = call.peer_meta(m)
        call.check_agree("root and arguments", arg, {m: a})
    dtype, shape, _, _ = call.peer_meta(call.group.members[root])
    return dtype, shape


def broadcast(call: GroupCall, x, out, root: int) -> np.ndarray:
    g = call.group
    is_root = g.position == root
    call.publish(x if is_root else None, arg=root)
    call.wait_all(1)
    dtype, shape = _rooted_meta(call, root, root)
    src = x if is_root else call.peer_input(g.members[root])
    res = _result(call, out, shape, dtype, src.nbytes > INLINE_BYTES)
    if res is not src:
        np.copyto(res, src)
    call.count_received(g.members[root], src.nbytes)
    _done(call)
    return res


def scatter(call: GroupCall, x, out, root: int, dim: int) -> np.ndarray:
    g, n = call.group, call.group.size
    is_root = g.position == root
    call.publish(x if is_root else None, arg=root * 64 + dim)
    call.wait_all(1)
    dtype, shape = _rooted_meta(call, root, root * 64 + dim)
    piece_shape = scaled_shape(shape, dim, n, True, "scatter")
    src = np.split(x if is_root else call.peer_input(g.members[root]), n, axis=dim)[g.position]
    res = _result(call, out, piece_shape, dtype, src.nbytes > INLINE_BYTES)
    np.copyto(res, src)
    call.count_received(g.members[root], src.nbytes)
    _done(call)
    return res


def gather(call: GroupCall, x: np.ndarray, out, root: int, dim: int):
    g, n = call.group, call.group.size
    call.publish(x, arg=root * 64 + dim)
    call.wait_all(1)
    _agree(call, x.dtype, x.shape, root * 64 + dim)
    res = None
    if g.position == root:
        shape = scaled_shape(x.shape, dim, n, False, "gather")
        res = _concatenate_members(call, x, out, shape, dim)
    _done(call)
    return res


def barrier(call: GroupCall) -> None:
    call.publish(None)
    call.wait_all(1)        # raises CollectiveMismatch if a member called something else
    call.inline = True
