"""alpha-beta cost of NCCL-style collectives over a group of global ranks on a HardwareSpec.

Notation: p ranks, n bytes (nccl-tests: the buffer for all_reduce, broadcast, reduce,
send/recv; the gathered output for all_gather; the input for reduce_scatter; the send
buffer for all_to_all). A "node" below is a scale-up domain: rank r sits in domain
r // domain_gpus (``HardwareSpec.domain_of``: one 8-GPU DGX, or a 72-GPU NVL72 rack of
4-GPU trays), whose NICs are its hosts' NICs together; the group spans N domains with
m_j members in domain j. Every call adds NCCL's base latency ``NCCL_BASE_LATENCY_US``.

* intra-domain step: alpha_nv = gpu_link.latency_us, beta_nv(k) = 1 / fabric(k), fabric(k)
  the bandwidth of a member sending to k others of its domain at once
  (:meth:`~.hardware.NodeSpec.fabric_gbps`): the whole port ``gpu_link.effective_gbps``
  through NVSwitch; k of the D - 1 links of a full mesh (Infinity Fabric), so a ring of
  m members uses beta_nv(m - 1), a pairwise round beta_nv(1).
* inter-domain step: alpha_net = nic.latency_us + (hops - 1) * switch_latency_us (hops = 1
  if all the group's nodes share a leaf switch, else 3). The NICs of domain j give this
  collective B_j(c) = min(nics * nic_eff / flows, rails(c)) / s, c the members of domain j
  that send, nics those of its hosts together, rails(c) = nic_eff * min(nics, ceil(c * nics
  / domain_gpus)) (GPU i uses its rail's NIC), flows = ``concurrent_flows`` (collectives of
  the same shape sharing the NICs), s = oversubscription if the group crosses the spine,
  else 1.

=======================  =================================================================
ring (NCCL orders the    one phase = p-1 steps: (p-N) alpha_nv + (N-1) alpha_net (tuning.cc);
ring node by node)       V bytes per link at beta = max(beta_nv [some m_j >= 2],
                         1 / min_j B_j(m_j) [N >= 2]). all_reduce: 2 phases,
                         V = 2(p-1)/p n; all_gather, reduce_scatter: 1 phase,
                         V = (p-1)/p n; broadcast, reduce (pipelined chain): 1 phase, V = n
tree                     all_reduce, NCCL double binary tree (intra-node chains):
                         2((m_max-1) alpha_nv + ceil(lg N) alpha_net) + 2n beta;
                         broadcast, reduce, binomial: ceil(lg p) rounds of alpha + n beta
recursive (p = 2^k)      reduce_scatter: vector halving, distance doubling (d = 1 .. p/2,
                         n/(2d) bytes); all_gather: the reverse; all_reduce: Rabenseifner
                         (both): lg p rounds each, (p-1)/p n bytes each
pairwise (all_to_all)    (m_min-1) alpha_nv + (p-m_min) alpha_net + max(max_j (m_j-1)/p n
                         beta_nv, max_j m_j (p-m_j)/p n / B_j(m_j))
hierarchical             all_reduce with m members on every node: ring reduce_scatter in
                         each node, ring all_reduce of n/m across nodes (m rings share the
                         NICs), ring all_gather in each node; one base latency per phase
nvls (all_reduce)        NVLink SHARP, one domain of >= 5 GPUs with ``nvls_efficiency``:
                         2 alpha_nv + n / (gpu_link.bandwidth_gbps * nvls_efficiency)
nvls_tree (all_reduce)   NCCL's NVLSTree: NVLS in each of N >= 2 domains (>= 5 members each),
                         a tree between them: 2 alpha_nv + 2 ceil(lg N) alpha_net
                         + n max(1 / nvls rate, 1 / min_j B_j(m_j)) (a domain's NICs carry
                         n each way, shared by its members)
p2p (send, recv)         alpha + n beta of the link between the two ranks
=======================  =================================================================

A round of a stepwise algorithm (recursive, binomial) costs alpha_net if any pair in it
crosses nodes (else alpha_nv) plus b * max(beta_nv, max_j c_j / B_j(c_j)), c_j the senders
of node j whose partner is on another node. Within one node these reduce to the closed
forms of Thakur, Rabenseifner & Gropp (FORMULAS.md) with gamma = 0: NCCL fuses the
reduction into the copy, so its cost is inside the achieved link bandwidth.
``algorithm="auto"`` picks the fastest of the algorithms NCCL has (``NCCL_ALGORITHMS``):
ring or tree for all_reduce, as NCCL's tuner does by size.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from .hardware import HardwareSpec

__all__ = ["Collective", "Algorithm", "CollectiveCost", "ALGORITHMS", "NCCL_ALGORITHMS",
           "NCCL_BASE_LATENCY_US", "NVLS_MIN_GPUS", "nccl_algorithms", "collective_cost", "collective_time_s", "bus_factor",
           "algbw_gbps", "busbw_gbps", "wire_bytes"]

# NVIDIA/nccl src/graph/tuning.cc baseLat, Ring/Simple: fixed cost of one NCCL call, us.
NCCL_BASE_LATENCY_US = 8.4
_FAT_TREE_HOPS_SAME_LEAF = 1   # two-level fat tree: node -> leaf -> node
_FAT_TREE_HOPS_VIA_SPINE = 3   # node -> leaf -> spine -> leaf -> node
_US = 1e-6  # seconds per microsecond
_GB = 1e9   # bytes per GB (GB/s as nccl-tests)


class Collective(str, Enum):
    """The collectives priced (torch.distributed names; ``send``/``recv`` one transfer)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SCATTER = "scatter"
    GATHER = "gather"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"


class Algorithm(str, Enum):
    """How a collective moves its bytes (see the module table)."""

    RING = "ring"
    TREE = "tree"
    RECURSIVE = "recursive"
    PAIRWISE = "pairwise"
    HIERARCHICAL = "hierarchical"
    NVLS = "nvls"
    NVLS_TREE = "nvls_tree"
    P2P = "p2p"
    LOCAL = "local"  # a group of one rank, or zero bytes: nothing moves


_C, _A = Collective, Algorithm
ALGORITHMS: Mapping[Collective, tuple[Algorithm, ...]] = MappingProxyType({
    # every algorithm this model prices, per collective
    _C.ALL_REDUCE: (_A.RING, _A.TREE, _A.NVLS, _A.NVLS_TREE, _A.RECURSIVE, _A.HIERARCHICAL),
    _C.ALL_GATHER: (_A.RING, _A.RECURSIVE),
    _C.REDUCE_SCATTER: (_A.RING, _A.RECURSIVE),
    _C.ALL_TO_ALL: (_A.PAIRWISE,),
    _C.BROADCAST: (_A.RING, _A.TREE),
    _C.REDUCE: (_A.RING, _A.TREE),
    _C.SCATTER: (_A.PAIRWISE,),
    _C.GATHER: (_A.PAIRWISE,),
    _C.BARRIER: (_A.RING, _A.TREE),  # a zero-byte all_reduce: its latency terms
    _C.SEND: (_A.P2P,),
    _C.RECV: (_A.P2P,),
})
NCCL_ALGORITHMS: Mapping[Collective, tuple[Algorithm, ...]] = MappingProxyType({
    c: (algs[:4] if c is _C.ALL_REDUCE else algs[:2] if c is _C.BARRIER else algs[:1])
    for c, algs in ALGORITHMS.items()})  # what algorithm="auto" chooses from (NVLS where
#                                          the hardware has it: _nvls_unavailable)
# NVLink SHARP needs multicast objects, which NVIDIA's fabric manager gives partitions of
# more than 4 GPUs only ("Fabric Manager for NVIDIA NVSwitch Systems", GPU partitions:
# partitions of 4 GPUs or fewer have no multicast; stas00/ml-engineering network/README.md)
NVLS_MIN_GPUS = 5


@dataclass(frozen=True)
class CollectiveCost:
    """Predicted time of one collective: ``time_s = latency_s + bandwidth_s``."""

    collective: Collective
    algorithm: Algorithm
    nbytes: float
    group_size: int
    nodes: int
    latency_s: float    # base + sum of alpha terms
    bandwidth_s: float  # sum of bytes * beta terms

    @property
    def time_s(self) -> float:
        return self.latency_s + self.bandwidth_s

    @property
    def busbw_gbps(self) -> float:
        return busbw_gbps(self.collective, self.nbytes, self.time_s, self.group_size)


class _Ctx:
    """The group's placement and the link parameters it sees (internal). "Node" in the
    formulas is a scale-up domain (``HardwareSpec.domain_of``): the GPUs one NVLink or
    Infinity Fabric joins, whose NICs are its nodes' NICs together."""

    def __init__(self, group, hw: HardwareSpec, flows: int):
        self.hw, self.flows = hw, flows
        self.ranks = sorted(group)  # NCCL orders rings node by node
        self.root = self.ranks.index(group[0])  # position of the rooted collectives' root
        self.p = len(self.ranks)
        self.node = [hw.domain_of(r) for r in self.ranks]
        self.counts = Counter(self.node)
        self.n_nodes = len(self.counts)
        net, per_domain = hw.network, hw.node.nodes_per_domain
        leaves = {j * per_domain // net.nodes_per_leaf_switch for j in self.counts}
        spine = len(leaves) > 1
        hops = _FAT_TREE_HOPS_VIA_SPINE if spine else _FAT_TREE_HOPS_SAME_LEAF
        self.alpha_nv = hw.node.gpu_link.latency_us * _US
        self.alpha_net = (net.nic.latency_us + (hops - 1) * net.switch_latency_us) * _US
        self._oversub = net.oversubscription if spine else 1.0
        self._nics = net.nics_per_node * per_domain     # the NICs of one domain

    def nv_bps(self, peers: int) -> float:
        """Scale-up bandwidth of one member sending to ``peers`` others of its domain at
        once, bytes/s (:meth:`NodeSpec.fabric_gbps`: the port on a switch, that many
        links on a full mesh)."""
        return self.hw.node.fabric_gbps(peers) * _GB

    def net_bps(self, senders: int) -> float:
        """B(c): inter-domain bandwidth of one domain to ``senders`` of its members, bytes/s."""
        net, gpd = self.hw.network, self.hw.domain_gpus
        rails = min(self._nics, math.ceil(senders * self._nics / gpd))
        shared = self._nics * net.nic.effective_gbps / self.flows
        return min(shared, rails * net.nic.effective_gbps) * _GB / self._oversub

    def ring_beta(self) -> float:
        """Seconds per byte of the ring's slowest link (on a full mesh, the rings of a
        domain's m members use their m - 1 links each)."""
        beta = max((1 / self.nv_bps(m - 1) for m in self.counts.values() if m >= 2),
                   default=0.0)
        if self.n_nodes >= 2:
            beta = max(beta, max(1 / self.net_bps(m) for m in self.counts.values()))
        return beta

    def ring_phase_latency(self) -> float:
        return (self.p - self.n_nodes) * self.alpha_nv + (self.n_nodes - 1) * self.alpha_net

    def rounds(self, rounds) -> tuple[float, float]:
        """(latency, bandwidth time) of rounds given as (pairs of positions, bytes): each
        member exchanges with one partner, over one link of a full mesh."""
        lat = bw = 0.0
        for pairs, nbytes in rounds:
            intra, crossing = False, Counter()
            for src, dst in pairs:
                if self.node[src] == self.node[dst]:
                    intra = True
                else:
                    crossing[self.node[src]] += 1
            lat += self.alpha_net if crossing else self.alpha_nv
            t = nbytes / self.nv_bps(1) if intra else 0.0
            for c in crossing.values():
                t = max(t, nbytes * c / self.net_bps(c))
            bw += t
        return lat, bw


def _ring(c: Collective, n: float, x: _Ctx):
    p = x.p
    phases, volume = {_C.ALL_REDUCE: (2, 2 * (p - 1) / p * n),
                      _C.ALL_GATHER: (1, (p - 1) / p * n),
                      _C.REDUCE_SCATTER: (1, (p - 1) / p * n),
                      _C.BROADCAST: (1, n), _C.REDUCE: (1, n)}[c]
    return 1, phases * x.ring_phase_latency(), volume * x.ring_beta()


def _tree(c: Collective, n: float, x: _Ctx):
    if c is _C.ALL_REDUCE:  # double binary tree across nodes, chains inside them
        m_max = max(x.counts.values())
        lat = 2 * ((m_max - 1) * x.alpha_nv
                   + math.ceil(math.log2(x.n_nodes)) * x.alpha_net)
        return 1, lat, 2 * n * x.ring_beta()
    levels = math.ceil(math.log2(x.p))  # binomial tree rooted at the group's first rank
    root, rounds = x.root, []
    for level in reversed(range(levels)):
        d = 1 << level
        pairs = [((i + root) % x.p, (i + d + root) % x.p)
                 for i in range(0, x.p, 2 * d) if i + d < x.p]
        rounds.append((pairs, n))
    return (1, *x.rounds(rounds))


def _recursive(c: Collective, n: float, x: _Ctx):
    p = x.p
    if p & (p - 1):
        raise ValueError(f"the recursive algorithms need a power-of-two group, got {p} ranks")
    # Round at distance d exchanges n/(2d) with rank i ^ d: the large messages travel the
    # short distances, which a node-by-node placement keeps inside a node (MPICH's
    # Rabenseifner: vector halving with distance doubling, then the reverse).
    distances = [1 << k for k in range(p.bit_length() - 1)]  # 1, 2, ..., p/2
    halving = [([(i, i ^ d) for i in range(p)], n / (2 * d)) for d in distances]
    doubling = halving[::-1]
    plan = {_C.ALL_GATHER: doubling, _C.REDUCE_SCATTER: halving,
            _C.ALL_REDUCE: halving + doubling}[c]
    return (1, *x.rounds(plan))


def _pairwise(c: Collective, n: float, x: _Ctx):
    p, counts = x.p, x.counts.values()
    if c in (_C.SCATTER, _C.GATHER):  # the root exchanges n/p with every other member
        m = x.counts[x.node[x.root]]
        lat = (m - 1) * x.alpha_nv + (p - m) * x.alpha_net
        return 1, lat, max((m - 1) / p * n / x.nv_bps(m - 1) if m > 1 else 0.0,
                           (p - m) / p * n / x.net_bps(1))
    m_min = min(counts)
    lat = (m_min - 1) * x.alpha_nv + (p - m_min) * x.alpha_net
    bw = max(max((m - 1) / p * n / x.nv_bps(m - 1) if m > 1 else 0.0 for m in counts),
             max(m * (p - m) / p * n / x.net_bps(m) for m in counts))
    return 1, lat, bw


def _nvls_unavailable(x: _Ctx, across: bool = False) -> str | None:
    """Why NVLink SHARP cannot run this group (None: it can): inside one domain (nvls), or
    inside each of several (nvls_tree, ``across``)."""
    node = x.hw.node
    if node.nvls_efficiency is None:
        return f"{x.hw.name} has no NVLink SHARP (node.nvls_efficiency is null)"
    if not across and x.n_nodes > 1:
        return "the group spans scale-up domains (NVLS reduces inside one NVSwitch fabric)"
    if across and x.n_nodes == 1:
        return "the group lies in one scale-up domain (nvls_tree joins several)"
    fewest = min(x.counts.values())
    if fewest < NVLS_MIN_GPUS:
        return (f"a domain holds {fewest} of the group's GPUs; NVLS multicast needs "
                f"{NVLS_MIN_GPUS} or more")
    return None


def _nvls_tree(c: Collective, n: float, x: _Ctx):
    """NCCL's NVLSTree all_reduce: NVLS inside each domain, a tree between domains over the
    NICs, pipelined. Each domain's members reduce their n bytes in the switch, then each
    sends its 1/m share of the domain's sum over its own NIC up the tree and gets the
    result back: a domain puts n bytes each way on its NICs together, so
    t = 2 alpha_nv + 2 ceil(lg N) alpha_net + n * max(1 / nvls rate, 1 / B_j(m_j))."""
    why = _nvls_unavailable(x, across=True)
    if why is not None:
        raise ValueError(f"nvls_tree: {why}")
    node = x.hw.node
    rate = node.gpu_link.bandwidth_gbps * node.nvls_efficiency * _GB
    beta = max(1 / rate, max(1 / x.net_bps(m) for m in x.counts.values()))
    lat = 2 * x.alpha_nv + 2 * math.ceil(math.log2(x.n_nodes)) * x.alpha_net
    return 1, lat, n * beta


def _nvls(c: Collective, n: float, x: _Ctx):
    """all_reduce reduced in the switch: each member sends its n bytes once and receives
    the n-byte result once (multimem load-reduce, then multicast store), at
    ``nvls_efficiency`` of its port: one step to the switch and one back."""
    why = _nvls_unavailable(x)
    if why is not None:
        raise ValueError(f"nvls: {why}")
    node = x.hw.node
    rate = node.gpu_link.bandwidth_gbps * node.nvls_efficiency * _GB
    return 1, 2 * x.alpha_nv, n / rate


def _hierarchical(c: Collective, n: float, x: _Ctx):
    sizes = set(x.counts.values())
    if len(sizes) != 1:
        raise ValueError("the hierarchical algorithm needs the same number of members on "
                         f"every node, got {dict(sorted(x.counts.items()))} (node: members)")
    m, big_n = sizes.pop(), x.n_nodes
    calls = lat = bw = 0.0
    if m > 1:  # reduce_scatter then all_gather inside every node
        calls += 2
        lat += 2 * (m - 1) * x.alpha_nv
        bw += 2 * (m - 1) / m * n / x.nv_bps(m - 1)
    if big_n > 1:  # m rings of n/m bytes, one member per node each, sharing the NICs
        calls += 1
        lat += 2 * (big_n - 1) * x.alpha_net
        bw += 2 * (big_n - 1) / big_n * n / x.net_bps(m)
    return calls, lat, bw


def _p2p(c: Collective, n: float, x: _Ctx):
    if x.p != 2:
        raise ValueError(f"{c.value} needs a group of two ranks (source, destination), "
                         f"got {x.p}")
    if x.n_nodes == 1:
        return 1, x.alpha_nv, n / x.nv_bps(1)
    return 1, x.alpha_net, n / x.net_bps(1)


_COST = MappingProxyType({_A.RING: _ring, _A.TREE: _tree, _A.RECURSIVE: _recursive,
                          _A.PAIRWISE: _pairwise, _A.HIERARCHICAL: _hierarchical,
                          _A.NVLS: _nvls, _A.NVLS_TREE: _nvls_tree, _A.P2P: _p2p})


def _parse(enum, value, what):
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of "
                         f"{', '.join(e.value for e in enum)}") from None


def _check_group(group) -> tuple:
    if isinstance(group, (str, bytes)) or not hasattr(group, "__iter__"):
        raise TypeError(f"group must be a tuple of global ranks, got {group!r}")
    group = tuple(group)
    bad = [r for r in group if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if not group or bad:
        raise ValueError(f"group must be a non-empty tuple of ranks >= 0, got {group!r}")
    if len(set(group)) != len(group):
        raise ValueError(f"group has repeated ranks: {group!r}")
    return group


def collective_cost(collective, nbytes: float, group, hardware: HardwareSpec,
                    algorithm="auto", concurrent_flows: int = 1) -> CollectiveCost:
    """Predicted cost of ``collective`` of ``nbytes`` over ``group`` (global ranks).

    ``algorithm``: "auto" (fastest of ``NCCL_ALGORITHMS``) or one of ``ALGORITHMS``.
    ``concurrent_flows``: how many collectives of this shape share each node's NICs at
    the same time, this one included (e.g. 8 data-parallel rings, one per local rank).
    The rooted collectives (broadcast, reduce, scatter, gather) are rooted at
    ``group[0]``; ``barrier`` ignores ``nbytes``.
    """
    coll = _parse(Collective, collective, "collective")
    group = _check_group(group)
    _check_args(hardware, nbytes, concurrent_flows)
    x = _Ctx(group, hardware, concurrent_flows)
    if algorithm == "auto":
        choices = _auto(coll, x)
    else:
        alg = _parse(Algorithm, algorithm, "algorithm")
        if alg not in ALGORITHMS[coll]:
            raise ValueError(f"{coll.value} has no algorithm {alg.value!r}; choose one of "
                             f"auto, {', '.join(a.value for a in ALGORITHMS[coll])}")
        choices = (alg,)
    if coll in (_C.SEND, _C.RECV):
        _p2p(coll, 0.0, x)  # validates the group size even when nothing moves
    priced = coll
    if coll is _C.BARRIER:  # the latency of an all_reduce of nothing
        priced, nbytes = _C.ALL_REDUCE, 0
    if x.p == 1 or (nbytes == 0 and coll is not _C.BARRIER):
        return CollectiveCost(coll, _A.LOCAL, nbytes, x.p, x.n_nodes, 0.0, 0.0)
    best = None
    for alg in choices:
        calls, lat, bw = _COST[alg](priced, float(nbytes), x)
        cost = CollectiveCost(coll, alg, nbytes, x.p, x.n_nodes,
                              calls * NCCL_BASE_LATENCY_US * _US + lat, bw)
        if best is None or cost.time_s < best.time_s:
            best = cost
    return best


def nccl_algorithms(collective, group, hardware: HardwareSpec) -> tuple[Algorithm, ...]:
    """The algorithms ``algorithm="auto"`` chooses from for ``collective`` over ``group``
    on ``hardware``: :data:`NCCL_ALGORITHMS`, NVLink SHARP only where it can run."""
    return _auto(_parse(Collective, collective, "collective"),
                 _Ctx(_check_group(group), hardware, 1))


def _auto(coll: Collective, x: _Ctx) -> tuple[Algorithm, ...]:
    """:data:`NCCL_ALGORITHMS` of ``coll``, NVLink SHARP only where the group's fabric has
    it (NCCL picks NVLS only there)."""
    return tuple(a for a in NCCL_ALGORITHMS[coll]
                 if a not in (_A.NVLS, _A.NVLS_TREE) or (
                     coll is _C.ALL_REDUCE
                     and _nvls_unavailable(x, across=a is _A.NVLS_TREE) is None))


def _check_args(hardware, nbytes, concurrent_flows) -> None:
    if not isinstance(hardware, HardwareSpec):
        raise TypeError(f"hardware must be a HardwareSpec (see load_hardware), got {hardware!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not (
            math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be a number of bytes >= 0, got {nbytes!r}")
    if isinstance(concurrent_flows, bool) or not isinstance(concurrent_flows, int) or (
            concurrent_flows < 1):
        raise ValueError(f"concurrent_flows must be an integer >= 1, got {concurrent_flows!r}")


def collective_time_s(collective, nbytes: float, group, hardware: HardwareSpec,
                      algorithm="auto", concurrent_flows: int = 1) -> float:
    """Seconds of one collective: ``collective_cost(...).time_s``."""
    return collective_cost(collective, nbytes, group, hardware, algorithm,
                           concurrent_flows).time_s


def bus_factor(collective, n: int) -> float:
    """nccl-tests busbw / algbw: 2(n-1)/n all_reduce; (n-1)/n all_gather, reduce_scatter,
    all_to_all (and scatter, gather, which nccl-tests lacks); 1 broadcast, reduce, send,
    recv, barrier."""
    coll = _parse(Collective, collective, "collective")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a number of ranks >= 1, got {n!r}")
    if coll is _C.ALL_REDUCE:
        return 2 * (n - 1) / n
    if coll in (_C.ALL_GATHER, _C.REDUCE_SCATTER, _C.ALL_TO_ALL, _C.SCATTER, _C.GATHER):
        return (n - 1) / n
    return 1.0


def algbw_gbps(nbytes: float, time_s: float) -> float:
    """nccl-tests algorithm bandwidth: nbytes / time_s, in GB/s (1e9 bytes/s)."""
    if not time_s > 0:
        raise ValueError(f"time_s must be > 0, got {time_s!r}")
    return nbytes / time_s / _GB


def busbw_gbps(collective, nbytes: float, time_s: float, n: int) -> float:
    """nccl-tests bus bandwidth: algbw_gbps * bus_factor(collective, n)."""
    return algbw_gbps(nbytes, time_s) * bus_factor(collective, n)


def wire_bytes(collective, nbytes: float, n: int) -> float:
    """Bytes one call puts on the links, summed over its ``n`` ranks (each byte counted
    once: sent by one rank, received by another). ``nbytes`` as nccl-tests (module doc).

    Every algorithm of this model moves the least the collective needs, so the total does
    not depend on the algorithm (only who carries it does):

    * all_reduce ``2(n-1) nbytes`` — ring: each rank sends ``2(n-1)/n nbytes``; tree: the
      reduce and the broadcast each cross ``n-1`` edges with ``nbytes``; recursive and
      hierarchical: a reduce-scatter and an all-gather of ``(n-1) nbytes`` each;
    * all_gather (gathered output), reduce_scatter (input), all_to_all (send buffer),
      broadcast, reduce ``(n-1) nbytes``;
    * scatter (the root's buffer), gather (gathered output) ``(n-1)/n nbytes``: every
      rank's piece but the root's own;
    * send / recv ``nbytes``; barrier ``0``.
    """
    coll = _parse(Collective, collective, "collective")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a number of ranks >= 1, got {n!r}")
    if coll in (_C.SEND, _C.RECV):
        return float(nbytes)
    if n == 1 or coll is _C.BARRIER:
        return 0.0
    if coll is _C.ALL_REDUCE:
        return 2.0 * (n - 1) * nbytes
    if coll in (_C.SCATTER, _C.GATHER):
        return (n - 1) / n * nbytes
    return float((n - 1) * nbytes)
