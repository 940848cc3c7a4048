"""Point to point: sends, receives, FIFO and post order, pending messages."""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

from .base import *  # noqa: F401,F403  (shared names)
from .base import _FILL, _RTOL  # noqa: F401
from .cases import *  # noqa: F401,F403
from .collectives import *  # noqa: F401,F403
from .cases import _payload, _values  # noqa: F401
from .collectives import _compare, _raise_failures  # noqa: F401

# ---------------------------------------------------------------------- point to point
def _p2p_program(dev, sends, recvs, send_mode, recv_mode, recv_order, use_empty):
    """Post every send first, then every receive; wait receives in ``recv_order``."""
    send_handles = []
    for to, tag, x in sends:
        if use_empty and x.size:
            buf = dev.empty(x.shape, x.dtype)      # a resident buffer: zero-copy sends
            buf[...] = x
            x = buf
        if send_mode == "send":
            dev.send(x, to, tag)
        else:
            send_handles.append((dev.isend(x, to, tag), x))
    got = [None] * len(recvs)
    if recv_mode == "irecv":
        handles = [dev.irecv(src, tag) for src, tag, _ in recvs]
        for i in recv_order:
            got[i] = handles[i].wait()
    else:
        for i in recv_order:
            src, tag, shape_dtype = recvs[i]
            if recv_mode == "recv_out":
                out = dev.xp.empty(*shape_dtype)
                res = dev.recv(src, tag, out=out)
                got[i] = res if res is out else None
            else:
                got[i] = dev.recv(src, tag)
    for handle, _ in reversed(send_handles):
        handle.wait()
    return got


def check_p2p(cluster, mesh, send_mode="send", recv_mode="recv", tags=(0, 3, 1),
              peers="all", use_empty=False, kinds=P2P_KINDS, seed=0) -> None:
    """Every rank sends a distinct message per tag to several peers before receiving
    anything; receivers take them peer by peer in reverse order and tags out of order.

    ``send_mode``: send | isend; ``recv_mode``: recv | irecv | recv_out (``out=``);
    ``peers``: "all" (every other rank) or "ring" (the next and previous rank).
    """
    n = mesh.size
    if n < 2:
        return

    def targets(r):
        if peers == "ring":
            return sorted({(r + 1) % n, (r - 1) % n} - {r})
        return [p for p in range(n) if p != r]

    sources = {r: [s for s in range(n) if r in targets(s)] for r in range(n)}
    args = []
    for r in range(n):
        sends = [(to, t, _payload(r, to, t, kinds)) for to in targets(r) for t in tags]
        recvs = []
        for src in reversed(sources[r]):
            for t in sorted(tags, key=lambda t: (-t if t % 2 else t)):   # out of order
                p = _payload(src, r, t, kinds)
                recvs.append((src, t, (p.shape, p.dtype.str)))
        order = [int(i) for i in np.random.default_rng([seed, r]).permutation(len(recvs))]
        args.append((sends, recvs, send_mode, recv_mode, order, use_empty))
    res = cluster.run(_p2p_program, args)
    failures = []
    for r in range(n):
        for (src, t, _), got in zip(args[r][1], res[r]):
            want = _payload(src, r, t, kinds)
            why = _compare(got, want, True, 1, 0.0)
            if why:
                failures.append(f"rank {r} message from {src} tag {t} ({send_mode}/"
                                f"{recv_mode}): {why}")
    _raise_failures(failures, sum(len(a[1]) for a in args))


def _pairs(n: int) -> list[tuple[int, str]]:
    """(peer, role) per rank: ranks 2k send to 2k+1; an odd one out stays idle."""
    return [(r ^ 1, "send" if r % 2 == 0 else "recv") if (r ^ 1) < n else (r, "idle")
            for r in range(n)]


def _fifo_program(dev, peer, role, count, tag, shape):
    if role == "send":
        for k in range(count):
            dev.send(dev.xp.full(shape, k, dtype="int64"), peer, tag)
    if role != "recv":
        return None
    return [dev.recv(peer, tag) for _ in range(count)]


def check_p2p_same_tag_fifo(cluster, mesh, count=5, shape=(3,)) -> None:
    """Messages of one pair with the same tag arrive in the order they were sent."""
    pairs = _pairs(mesh.size)
    res = cluster.run(_fifo_program, [(p, role, count, 9, shape) for p, role in pairs])
    for r, (_, role) in enumerate(pairs):
        if role == "recv":
            got = [int(np.asarray(a).reshape(-1)[0]) for a in res[r]]
            assert got == list(range(count)), f"rank {r} received in order {got}"


def _post_order_program(dev, peer, role):
    if role == "send":
        dev.send(dev.xp.full(3, 1.0), peer, 5)
        dev.send(dev.xp.full(3, 2.0), peer, 5)
    if role != "recv":
        return None
    first, second = dev.irecv(peer, 5), dev.irecv(peer, 5)
    b = second.wait()                 # waited first, but posted second
    a = first.wait()
    return float(a[0]), float(b[0])


def check_irecv_post_order(cluster, mesh) -> None:
    """Two irecvs of the same (src, tag) match messages in the order they were posted
    (MPI's non-overtaking rule), whatever order they are waited in."""
    pairs = _pairs(mesh.size)
    res = cluster.run(_post_order_program, pairs)
    for r, (_, role) in enumerate(pairs):
        if role == "recv":
            assert res[r] == (1.0, 2.0), (
                f"rank {r}: the first posted irecv got message {res[r][0]:g} and the "
                f"second got {res[r][1]:g} (expected 1 then 2)")


def _pending_program(dev, payload, to, frm, calls, tag):
    """Send one message, run ``calls`` collectives, only then receive."""
    dev.send(payload, to, tag)
    results = []
    for collective, algorithm in calls:
        kw = {} if algorithm == "auto" else {"algorithm": algorithm}
        x = dev.xp.full(4 * dev.mesh.size, float(dev.rank))
        results.append(getattr(dev, collective)(x, **kw))
    return dev.recv(frm, tag), results


def check_p2p_pending_across_collectives(cluster, mesh, calls, tag=123) -> None:
    """A message sent but not yet received must not block the pair's later traffic:
    every rank sends to the next rank, runs ``calls`` = [(collective, algorithm), ...]
    over all ranks (whose messages use the same pairs), and only then receives."""
    n = mesh.size
    payloads = [np.arange(5.0) + 100 * r for r in range(n)]
    res = cluster.run(_pending_program, [(payloads[r], (r + 1) % n, (r - 1) % n, list(calls),
                                          tag) for r in range(n)])
    xs = [np.full(4 * n, float(r)) for r in range(n)]
    failures = []
    for r in range(n):
        got, results = res[r]
        if _compare(got, payloads[(r - 1) % n], True, 1, 0.0):
            failures.append(f"rank {r}: received {got} from rank {(r - 1) % n}")
        for (collective, algorithm), value in zip(calls, results):
            ref = reference(make_case(collective, None, shape=(4 * n,)), mesh, xs)[r]
            if why := _compare(value, ref, True, n, 0.0):
                failures.append(f"rank {r}: {collective} ({algorithm}) {why}")
    _raise_failures(failures, len(calls))
