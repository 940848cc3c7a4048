"""Simulated degraded links: a cost model wrapper that scales a link's bandwidth.

``DegradedLinks(costs, faults)`` answers like ``costs`` except on degraded links. With a
link left a fraction ``f`` of its bandwidth, only the bandwidth term of a transfer grows
(the latency term ``t(0)``, the cost of the same op with no bytes, is kept):

    t'(n) = t(0) + (t(n) - t(0)) / f

for a point-to-point transfer between the link's two ranks, and for a collective whose
group holds both (a ring or tree moves bytes over every member's links, and the slowest
link sets the pace, so the smallest ``f`` among the group's degraded links applies).
Straggling devices are the replay's ``stragglers=`` (:func:`vcluster.timing.engine.
simulate_trace`); :func:`straggler_map` builds it from :class:`~vcluster.runtime.faults.SlowFault`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vcluster.runtime.faults.specs import LinkFault, SlowFault, parse_faults

__all__ = ["DegradedLinks", "straggler_map"]


@dataclass(frozen=True)
class DegradedLinks:
    """``costs`` (a :class:`vcluster.timing.cost_model.CostModel`) with slower links."""

    costs: object
    factors: tuple            # ((rank_a, rank_b), bandwidth_factor), a < b

    @classmethod
    def from_faults(cls, costs, faults) -> "DegradedLinks":
        links: dict = {}
        for f in parse_faults(faults):
            if isinstance(f, LinkFault):
                links[f.ranks] = min(links.get(f.ranks, 1.0), f.bandwidth_factor)
        return cls(costs, tuple(sorted(links.items())))

    def _factor(self, members) -> float:
        members = set(members)
        found = [f for (a, b), f in self.factors if a in members and b in members]
        return min(found, default=1.0)

    def compute_time_s(self, op) -> float:
        return self.costs.compute_time_s(op)

    def collective_time_s(self, op, concurrent: int = 1) -> float:
        t = self.costs.collective_time_s(op, concurrent)
        f = self._factor(op.group)
        if f == 1.0:
            return t
        t0 = self.costs.collective_time_s(dataclasses.replace(op, nbytes=0), concurrent)
        return t0 + (t - t0) / f

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        t = self.costs.p2p_time_s(src, dst, nbytes)
        f = self._factor((src, dst)) if src != dst else 1.0
        if f == 1.0:
            return t
        t0 = self.costs.p2p_time_s(src, dst, 0)
        return t0 + (t - t0) / f


def straggler_map(faults) -> dict[int, float]:
    """``{rank: slowdown}`` of the slow-device faults, for ``simulate_trace(stragglers=)``."""
    return {f.rank: f.slowdown for f in parse_faults(faults) if isinstance(f, SlowFault)}
