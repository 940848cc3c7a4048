"""What the bytes of a communication call cost one member on ``localhost``.

Every rate here is pool work per byte with every device busy (single-core seconds, see
:mod:`vcluster.localhost.cost_model`), so a figure adds to the call's fixed CPU directly:

* a large shm collective: the member reads its peers' pieces and its own, and writes the
  reduced chunk where there is one (:func:`moved_bytes`)::

      copy collectives    read / B_copy        (all_gather, all_to_all, broadcast,
                                                scatter, gather)
      reduce_scatter      read / B_reduce
      all_reduce          (read + written) / B_all_reduce
      reduce              read / B_reduce + written / B_copy

* a message algorithm (ring, tree, pairwise): each message side costs the CPU of a side
  of its size as measured in a ring all_gather on every device
  (:mod:`~vcluster.localhost.messages`), on the sender's side as on the
  receiver's. Specs without that curve: the back-to-back CPU of an 8-byte message
  (``p2p_message_cpu_s``; older still: half the alone round trip), and each byte one
  copy at :func:`p2p_copy_s_per_byte` (which a send/recv's bytes beyond
  CALL_BYTES also pay). The algorithms send from arena buffers, which the
  channel posts without a staging copy (tests/runtime/test_message_copies.py), but a large send
  is a rendezvous: the sender waits while the receiver copies the payload out, and that
  wait costs it about the copy's CPU. Ping-pongs of 4 KiB and 4 MiB, every device in a
  pair (2 cores, 8 devices), cost 7.9–9.7 GB/s per side with arena payloads and
  7.7–8.8 GB/s with private (staged) ones: the same within the machine's noise.
"""

from __future__ import annotations

from .messages import MessageSides

__all__ = ["COPY_COLLECTIVES", "moved_bytes", "bytes_work", "message_work",
           "p2p_copy_s_per_byte"]

COPY_COLLECTIVES = ("all_gather", "all_to_all", "broadcast", "scatter", "gather")


def moved_bytes(name: str, n: int, position: int, op, traffic) -> tuple[int, int]:
    """(bytes read, bytes written) by member ``position`` of a large shm ``name`` over
    ``n``: the traffic model's reads from and writes to its peers, plus its own piece
    (which the model leaves out: all_gather and gather's root copy their own input,
    all_to_all and reduce_scatter their own 1/n, all_reduce and reduce combine their own
    chunk, broadcast's and scatter's roots copy their input or piece into the result)."""
    x, root = op.nbytes, position == op.root
    chunk = max((b for _, b, _ in traffic.received), default=0)
    own = {"all_gather": x, "gather": x if root else 0, "all_to_all": x // n,
           "reduce_scatter": x // n, "all_reduce": chunk, "reduce": chunk,
           "broadcast": x if root else 0, "scatter": x // n if root else 0}[name]
    written = 0
    if name == "all_reduce" or (name == "reduce" and root):
        written = traffic.bytes_sent + own                # the reduced chunk, to every output
    elif name == "reduce":
        written = traffic.bytes_sent                      # ... to the root's
    return traffic.bytes_received + own, written


def bytes_work(spec, name: str, n: int, position: int, op, traffic) -> float:
    """The channel work of the bytes member ``position`` of a large shm call moves."""
    read, written = moved_bytes(name, n, position, op, traffic)
    if name in COPY_COLLECTIVES:
        return read / spec.channel_copy_bytes_per_s
    if name == "all_reduce":
        return (read + written) / spec.channel_all_reduce_bytes_per_s
    return read / spec.channel_reduce_bytes_per_s + written / spec.channel_copy_bytes_per_s


def p2p_copy_s_per_byte(spec) -> float:
    """Pool work per byte one side of a message copies with every device busy:
    ``1 / p2p_busy_copy_bytes_per_s`` (measured so, in one figure), or in older specs
    the alone rate under the memcpy busy factor, ``T(N) / (s_memcpy B_p2p)`` (two
    figures whose noise multiplies)."""
    if spec.p2p_busy_copy_bytes_per_s is not None:
        return 1.0 / spec.p2p_busy_copy_bytes_per_s
    return spec.busy_factor(spec.memcpy_busy_speedup) / spec.p2p_copy_bytes_per_s


def message_work(spec, traffic, copied_bytes: int = 0) -> float:
    """A member's work in a message algorithm: its sent and its received message sides,
    each at the mean size of its kind, priced from the spec's ring-measured curve
    (:class:`~vcluster.localhost.messages.MessageSides`), plus ``copied_bytes``
    of local copies (the working copy of a reducing algorithm:
    :func:`~vcluster.localhost.messages.working_copy_bytes`) at the memcpy rate
    under its busy factor, as a group of one's copy. Older specs: the messages follow each
    other inside one call, so each side costs the back-to-back CPU of an 8-byte message,
    plus the copy of its bytes at the ping-pong slope (which priced ring reductions'
    working copies in, roughly)."""
    if spec.message_side_cpu_s is not None:
        sides = MessageSides(spec.message_side_cpu_s)
        local = copied_bytes * spec.busy_factor(spec.memcpy_busy_speedup) \
            / spec.memcpy_bytes_per_s
        return (sides.work(traffic.messages_sent, traffic.bytes_sent)
                + sides.work(traffic.messages_received, traffic.bytes_received) + local)
    side = spec.p2p_latency_s / 2 if spec.p2p_message_cpu_s is None else spec.p2p_message_cpu_s
    return ((traffic.messages_sent + traffic.messages_received) * side
            + (traffic.bytes_sent + traffic.bytes_received) * p2p_copy_s_per_byte(spec))
