"""Point-to-point calls of the torch engine (a mixin of :class:`TorchDeviceContext`).

A message is a header (dtype, shape) on tag 2t and the payload on tag 2t + 1, so a
receiver need not know the shape. ``send`` is buffered, as on the emulator: it starts an
``isend`` of a private copy and returns; the run's end waits for every pending send.
Receives of one (src, tag) are completed in the order they were posted (payloads arrive
in send order), whatever order they are waited in.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import numpy as np

from vcluster.runtime.arguments import check_peer

from .tensors import TorchWork, encode_header, parse_header, to_wire, wait_work

__all__ = ["PointToPoint"]

_MAX_TAG = 2 ** 30           # gloo slots are 32-bit; headers and payloads use 2t, 2t + 1


@dataclass(eq=False)
class _RecvRequest:
    """A posted receive; its header receive is in flight from the moment it is posted."""

    src: int
    tag: int
    out: object
    header: object           # (tensor, torch Work)
    done: bool = False
    result: object = None


class PointToPoint:
    """send / recv / isend / irecv; needs ``rank``, ``mesh``, ``_dist``, ``_tensor``,
    ``_empty_tensor``, ``_numpy``, ``_deliver``, ``_posted_recvs``, ``_pending_sends``."""

    def _peer(self, peer, what: str) -> int:
        return check_peer(peer, self.mesh.size, what)

    @staticmethod
    def _tag(tag) -> int:
        tag = operator.index(tag)
        if not 0 <= tag < _MAX_TAG:
            raise ValueError(f"tag must be an int in [0, 2**30) on the torch engine "
                             f"(gloo tags are 32-bit), got {tag}")
        return tag

    def isend(self, x, to: int, tag: int = 0) -> TorchWork:
        """Start sending a private copy of ``x`` (header on tag 2t, payload on 2t + 1)."""
        to, tag, x = self._peer(to, "isend"), self._tag(tag), np.asarray(x)
        header, payload = self._tensor(encode_header(x, self.rank)), self._tensor(x)
        works = [self._dist.isend(header, to, tag=2 * tag)]
        if x.size:
            works.append(self._dist.isend(to_wire(payload), to, tag=2 * tag + 1))

        keep = (header, payload)     # alive until the sends complete
        return TorchWork(works, lambda: keep and None,
                         lambda: f"rank {self.rank}: send to rank {to} (tag {tag})")

    def send(self, x, to: int, tag: int = 0) -> None:
        """Buffered send: returns at once; the run's end waits for delivery."""
        self._pending_sends.append(self.isend(x, to, tag))

    def irecv(self, src: int, tag: int = 0, *, out=None) -> TorchWork:
        """Post a receive now; receives of one (src, tag) match in post order."""
        request = self._post_recv(src, tag, out, "irecv")
        return TorchWork([], lambda: self._complete(request),
                         lambda: f"rank {self.rank}: recv from rank {src} (tag {tag})")

    def recv(self, src: int, tag: int = 0, *, out=None):
        return self._complete(self._post_recv(src, tag, out, "recv"))

    def _post_recv(self, src, tag, out, what: str) -> _RecvRequest:
        src, tag = self._peer(src, what), self._tag(tag)
        h = self._tensor(encode_header(None, self.rank))
        request = _RecvRequest(src, tag, out, (h, self._dist.irecv(h, src, tag=2 * tag)))
        self._posted_recvs.setdefault((src, tag), deque()).append(request)
        return request

    def _complete(self, request: _RecvRequest):
        """Finish the posted receives of (src, tag) oldest first, up to ``request``:
        payloads arrive in send order, so they are received in post order."""
        key = (request.src, request.tag)
        queue = self._posted_recvs.get(key, deque())
        while not request.done:
            head = queue.popleft()
            h, work = head.header
            what = lambda: f"rank {self.rank}: recv from rank {head.src} (tag {head.tag})"
            wait_work(work, None, what)
            shape, dtype = parse_header(self._numpy(h))
            t = self._empty_tensor(shape, dtype)
            if t.numel():
                wait_work(self._dist.irecv(to_wire(t), head.src, tag=2 * head.tag + 1), None, what)
            head.result, head.done = self._deliver(self._numpy(t), head.out), True
        if not queue:
            self._posted_recvs.pop(key, None)
        return request.result
