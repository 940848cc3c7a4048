"""Routers: which replica a request goes to when it arrives (a global scheduler, as
Vidur's and splitwise-sim's).

* ``round_robin``: the k-th request routed (0-based) goes to replica k mod R.
* ``least_loaded``: the replica with the fewest *unfinished* requests (routed there and
  not yet finished — queued, running or in a KV transfer to it), ties to the lowest index
  (join-the-shortest-queue, splitwise-sim's JSQ).

A router is made fresh for each simulation (it holds the round-robin counter), so two
simulations never share one.
"""

from __future__ import annotations

from modeling.choices import Router
from modeling.errors import ConfigError

__all__ = ["RoundRobinRouter", "LeastLoadedRouter", "make_router"]


class RoundRobinRouter:
    """Replica k mod R for the k-th request."""

    def __init__(self, replicas: int):
        self.replicas, self._next = replicas, 0

    def choose(self, loads) -> int:
        i = self._next
        self._next = (i + 1) % self.replicas
        return i

    def __repr__(self) -> str:
        return f"RoundRobinRouter(replicas={self.replicas}, next={self._next})"


class LeastLoadedRouter:
    """argminᵢ loads[i], the lowest index on ties."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def choose(self, loads) -> int:
        best = 0
        for i in range(1, len(loads)):
            if loads[i] < loads[best]:
                best = i
        return best

    def __repr__(self) -> str:
        return f"LeastLoadedRouter(replicas={self.replicas})"


def make_router(router: Router | str, replicas: int):
    """A fresh router of kind ``router`` (:class:`~modeling.choices.Router`) over
    ``replicas`` replicas."""
    try:
        kind = Router(router)
    except ValueError:
        raise ConfigError("router", router, ", ".join(Router.values()),
                          "no such router") from None
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas", replicas, "an integer >= 1", "not a replica count")
    return RoundRobinRouter(replicas) if kind is Router.ROUND_ROBIN else \
        LeastLoadedRouter(replicas)
