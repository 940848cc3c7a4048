"""Emulated slow devices and slow links: real delays inside the device processes.

A device holds one :class:`DeviceDelays` (built by :func:`delays_for` from the cluster's
faults). Its program context calls

* :meth:`DeviceDelays.compute_extra_s` after each ``dev.compute`` block: a device
  ``slowdown`` times slower sleeps ``(slowdown - 1) * t`` after a block that took ``t``;
* :meth:`DeviceDelays.transfer_extra_s` after each send / receive / collective: a transfer
  over a link left with a fraction ``f`` of its bandwidth sleeps ``(1/f - 1) * t``. A
  collective is delayed on the ranks of a degraded link whose peer is in its group (a
  ring or tree moves bytes over every such link, and the slowest link sets its pace);
* :meth:`DeviceDelays.jitter_s` before and after each send, receive and collective and
  after each compute block, under a :class:`~.specs.JitterFault`: with probability p a
  pause drawn uniformly from [0, max_delay_s), from the device's own stream
  (:meth:`DeviceDelays.jitter_stream`, seeded by the fault's seed and the rank).

:func:`crash_this_device` is the emulated crash: SIGKILL to the calling process, which the
host sees as a lost device (:class:`~vcluster.runtime.errors.DeviceLostError`).
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, field

from .specs import JitterFault, LinkFault, SlowFault

__all__ = ["DeviceDelays", "NO_DELAYS", "delays_for", "crash_this_device"]


@dataclass(frozen=True)
class DeviceDelays:
    """How much slower one device computes and talks to each peer."""

    rank: int = -1
    slowdown: float = 1.0                                   # compute time multiplier
    link_factors: dict = field(default_factory=dict)        # peer -> bandwidth fraction
    jitter: JitterFault | None = None                       # random pauses (stress mode)

    @property
    def active(self) -> bool:
        return self.slowdown != 1.0 or bool(self.link_factors) or self.jitter is not None

    def jitter_stream(self) -> random.Random | None:
        """A new random stream for :meth:`jitter_s`, seeded by (the jitter's seed, this
        rank): devices draw different pauses, and the same seed gives each the same
        draws (the interleaving they produce still depends on the OS scheduler). None
        without jitter."""
        if self.jitter is None:
            return None
        return random.Random(f"jitter:{self.jitter.seed}:{self.rank}")

    def jitter_s(self, stream: random.Random) -> float:
        """The next pause (seconds) from ``stream``: with the jitter's probability a
        uniform draw from [0, max_delay_s), else 0."""
        j = self.jitter
        if j is None or stream.random() >= j.probability:
            return 0.0
        return stream.random() * j.max_delay_s

    def compute_extra_s(self, elapsed_s: float) -> float:
        """Extra sleep after a compute block that took ``elapsed_s``."""
        return (self.slowdown - 1.0) * elapsed_s

    def transfer_extra_s(self, peers, elapsed_s: float) -> float:
        """Extra sleep after a transfer with ``peers`` (one rank, or a group's members)."""
        peers = (peers,) if isinstance(peers, int) else peers
        factors = [self.link_factors[p] for p in peers if p in self.link_factors]
        return (1.0 / min(factors) - 1.0) * elapsed_s if factors else 0.0


NO_DELAYS = DeviceDelays()


def delays_for(rank: int, faults) -> DeviceDelays:
    """The delays of ``rank`` under ``faults`` (crash faults are ignored here; a jitter
    applies to every rank)."""
    slowdown, links, jitter = 1.0, {}, None
    for f in faults:
        if isinstance(f, SlowFault) and f.rank == rank:
            slowdown = f.slowdown
        elif isinstance(f, LinkFault) and rank in f.ranks:
            peer = f.ranks[1] if f.ranks[0] == rank else f.ranks[0]
            links[peer] = min(links.get(peer, 1.0), f.bandwidth_factor)
        elif isinstance(f, JitterFault):
            jitter = f
    return DeviceDelays(rank, slowdown, links, jitter)


def crash_this_device() -> None:
    """Kill the calling device process at once (SIGKILL: no cleanup, like a lost GPU)."""
    os.kill(os.getpid(), signal.SIGKILL)
