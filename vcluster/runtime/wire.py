"""Length-prefixed pickled frames over a host<->device (or host<->launcher) socket.

Only small control messages travel here: large arrays go through shared memory
(:mod:`vcluster.runtime.transfer`) and only their locations are in the frame.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct

__all__ = ["send_msg", "recv_msg", "readable", "PeerClosed"]

_HEADER = struct.Struct("<Q")


class PeerClosed(ConnectionError):
    """The other end of the socket is gone (its process died or closed it)."""


def readable(sock, timeout_s: float) -> bool:
    """Whether ``sock`` (a socket or a file descriptor) has data or an end to read within
    ``timeout_s`` seconds. ``poll``, not ``select``: a host of 256 devices holds
    descriptors beyond ``select``'s 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(timeout_s, 0.0) * 1000.0))


def send_msg(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    try:
        sock.sendall(_HEADER.pack(len(data)) + data)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerClosed(str(exc)) from exc


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except ConnectionResetError as exc:
            raise PeerClosed(str(exc)) from exc
        if k == 0:
            raise PeerClosed("connection closed")
        got += k
    return buf


def recv_msg(sock: socket.socket):
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, length))
