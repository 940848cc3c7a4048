"""Heterogeneous clusters: one job on nodes of several GPU kinds.

A :class:`ClusterSpec` is a name and its *parts*, each a :class:`ClusterPart`: a
:class:`~vcluster.timing.hardware.HardwareSpec` (one GPU kind, its node and its NICs) and
how many of its nodes the cluster holds. Global ranks are laid out part by part, node by
node: part 0's nodes first (ranks ``0 .. nodes_0 · gpus_per_node - 1``), then part 1's,
and so on. A file describes one as::

    name: mixed-a100-h100
    parts:
      - {hardware: a100-80gb-dgx, nodes: 2}     # a preset name,
      - {hardware: {base: h100-dgx, name: h100-4nic, network: {nics_per_node: 4}},
         nodes: 2}                              # a hardware mapping, or a YAML file

:func:`load_cluster` reads that (a mapping, a YAML path or a ClusterSpec) and passes
anything without ``parts`` — a preset name, a hardware file or mapping, a HardwareSpec —
to :func:`~vcluster.timing.presets.load_hardware` (or the loader given), unchanged.

The parts must share ``gpus_per_node`` and ``domain_gpus`` (the scale-up domain), and
each part holds whole scale-up domains: one rule then places every rank on its node
(``rank // gpus_per_node``) and domain, whichever part it is in, and no NVLink domain
straddles two kinds.

How :class:`~vcluster.timing.cluster_cost.ClusterCostModel` prices a cluster: compute on
the rank's own device; a collective or a transfer whose ranks all lie in one part on
that part's hardware; one spanning parts on the hardware of each part it spans, and the
slowest taken. Why the slowest: the parts' nodes hang off one network (one fat tree),
each node with its own kind's GPU links and NICs, and NCCL's ring (and tree, and a
pipelined transfer) streams every chunk through every member in turn, so its rate is set
by its slowest link — each part's HardwareSpec prices the whole group as if every member
had that part's links, and the slowest of those prices is the group's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .hardware import HardwareSpec
from .presets import load_hardware

__all__ = ["ClusterPart", "ClusterSpec", "load_cluster", "cluster_from_dict",
           "axis_major_placement", "CLUSTER_KEYS", "PART_KEYS"]

#: the keys of a cluster mapping, and of each of its parts
CLUSTER_KEYS = ("name", "parts", "source")
PART_KEYS = ("hardware", "nodes")


@dataclass(frozen=True, repr=False)
class ClusterPart:
    """``nodes`` nodes of one GPU kind (``hardware``)."""

    hardware: HardwareSpec
    nodes: int

    def __post_init__(self):
        if not isinstance(self.hardware, HardwareSpec):
            raise TypeError(f"hardware: expected a HardwareSpec, got {self.hardware!r}")
        n = self.nodes
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"nodes: must be an integer >= 1, got {n!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.hardware.gpus_per_node

    def __repr__(self) -> str:
        return f"ClusterPart(hardware=<HardwareSpec {self.hardware.name!r}>, nodes={self.nodes})"


@dataclass(frozen=True, repr=False)
class ClusterSpec:
    """A cluster of several GPU kinds (module docstring): ``parts`` in rank order."""

    name: str
    parts: tuple
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"source: expected a string, got {self.source!r}")
        parts = self.parts
        if isinstance(parts, (str, bytes, Mapping)) or not hasattr(parts, "__iter__"):
            raise ValueError(f"parts: expected a list of parts, got {parts!r}")
        parts = tuple(parts)
        if not parts:
            raise ValueError("parts: a cluster needs at least one part (allowed: a non-empty "
                             "list of {hardware, nodes})")
        for i, part in enumerate(parts):
            if not isinstance(part, ClusterPart):
                raise ValueError(f"parts[{i}]: expected a ClusterPart, got {part!r}")
        object.__setattr__(self, "parts", parts)
        first = parts[0].hardware
        for i, part in enumerate(parts):
            hw = part.hardware
            for what in ("gpus_per_node", "domain_gpus"):
                if getattr(hw, what) != getattr(first, what):
                    raise ValueError(
                        f"parts[{i}].hardware: {hw.name} has {what} {getattr(hw, what)}, "
                        f"parts[0]'s {first.name} has {getattr(first, what)}; allowed: parts "
                        f"that share gpus_per_node and domain_gpus (one rule places every "
                        f"rank on its node and scale-up domain)")
            per_domain = hw.node.nodes_per_domain
            if part.nodes % per_domain:
                raise ValueError(f"parts[{i}].nodes: {part.nodes} nodes of {hw.name} do not "
                                 f"make whole scale-up domains of {per_domain} nodes "
                                 f"({hw.domain_gpus} GPUs); allowed: a multiple of "
                                 f"{per_domain}")
        starts, at = [], 0
        for part in parts:
            starts.append(at)
            at += part.gpus
        object.__setattr__(self, "_starts", tuple(starts))

    # --- the layout ------------------------------------------------------------------
    @property
    def gpus(self) -> int:
        """Every GPU of every part."""
        return sum(p.gpus for p in self.parts)

    @property
    def nodes(self) -> int:
        return sum(p.nodes for p in self.parts)

    @property
    def gpus_per_node(self) -> int:
        return self.parts[0].hardware.gpus_per_node

    @property
    def domain_gpus(self) -> int:
        return self.parts[0].hardware.domain_gpus

    @property
    def kinds(self) -> tuple:
        """The distinct HardwareSpecs, in the order of their first part."""
        out = []
        for p in self.parts:
            if p.hardware not in out:
                out.append(p.hardware)
        return tuple(out)

    def part_ranks(self, k: int) -> range:
        """The global ranks of part ``k``."""
        start = self._starts[k]
        return range(start, start + self.parts[k].gpus)

    def part_of(self, rank: int) -> int:
        """The index of the part that holds global rank ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.gpus:
            raise ValueError(f"rank {rank!r} is not in cluster {self.name!r}; allowed: an "
                             f"integer in 0..{self.gpus - 1}")
        k = len(self._starts) - 1
        while self._starts[k] > rank:
            k -= 1
        return k

    def hardware_of(self, rank: int) -> HardwareSpec:
        """The hardware (GPU kind, node, NICs) of global rank ``rank``."""
        return self.parts[self.part_of(rank)].hardware

    def node_of(self, rank: int) -> int:
        self.part_of(rank)                      # in range
        return rank // self.gpus_per_node

    def domain_of(self, rank: int) -> int:
        return self.node_of(rank) // self.parts[0].hardware.node.nodes_per_domain

    def describe(self) -> list[str]:
        """One line per part: its nodes, GPU kind and ranks."""
        return [f"part {k}: {p.nodes} x {p.hardware.name} ({p.hardware.device.name}), "
                f"ranks {self.part_ranks(k).start}-{self.part_ranks(k).stop - 1}"
                for k, p in enumerate(self.parts)]

    def __repr__(self) -> str:
        parts = " + ".join(f"{p.nodes} x {p.hardware.name} (ranks {self.part_ranks(k).start}"
                           f"-{self.part_ranks(k).stop - 1})" for k, p in enumerate(self.parts))
        return f"<ClusterSpec {self.name!r}: {parts}>"


def axis_major_placement(mesh, axis: str) -> tuple:
    """The device (global rank of a cluster) of each mesh rank when ``axis`` is placed
    outermost and the other axes keep their order: the ranks of ``axis`` coordinate 0
    first. For a pipeline (``axis="pp"``) that is Megatron-LM's default rank order
    (``tp-cp-ep-dp-pp``: pp outermost), which puts each pipeline stage's ranks next to
    each other, so that parts holding whole stages hold each on one GPU kind."""
    if axis not in mesh.axes:
        return tuple(range(mesh.size))
    order = sorted(range(mesh.size), key=lambda r: (mesh.index(r)[axis], r))
    out = [0] * mesh.size
    for device, r in enumerate(order):
        out[r] = device
    return tuple(out)


# --- from files and mappings ------------------------------------------------------------
def _is_cluster_data(data) -> bool:
    return isinstance(data, Mapping) and "parts" in data


def _check_keys(data, where: str, allowed: tuple, required: tuple) -> None:
    """Raise ValueError naming ``where`` unless ``data`` is a mapping of ``allowed`` keys
    holding every ``required`` one."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping with keys {', '.join(allowed)}, "
                         f"got {data!r}")
    for key in data:
        if key not in allowed:
            raise ValueError(f"{where}.{key}: unknown key {key!r}; allowed: "
                             f"{', '.join(allowed)}")
    for key in required:
        if key not in data:
            raise ValueError(f"{where}.{key}: missing; required keys: {', '.join(required)}")


def cluster_from_dict(data: Mapping, path: str = "cluster", hardware_loader=None,
                      base_dir: Path | None = None) -> ClusterSpec:
    """Build and validate a ClusterSpec from ``{name, parts: [{hardware, nodes}, ...]}``;
    a part's ``hardware`` is what ``hardware_loader`` (default :func:`load_hardware`)
    accepts — a preset name, a hardware mapping, a YAML file (relative to ``base_dir``).
    Errors name the key path (``cluster.parts[1].nodes``), the value and what is allowed."""
    loader = hardware_loader or load_hardware
    _check_keys(data, path, CLUSTER_KEYS, ("name", "parts"))
    name = data["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{path}.name: expected a non-empty string, got {name!r}")
    source = data.get("source", "")
    if not isinstance(source, str):
        raise ValueError(f"{path}.source: expected a string, got {source!r}")
    raw = data["parts"]
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"{path}.parts: expected a non-empty list of {{hardware, nodes}}, "
                         f"got {raw!r}")
    parts = []
    for i, item in enumerate(raw):
        where = f"{path}.parts[{i}]"
        _check_keys(item, where, PART_KEYS, PART_KEYS)
        nodes = item["nodes"]
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"{where}.nodes: must be an integer >= 1, got {nodes!r}")
        hw = item["hardware"]
        if isinstance(hw, str) and base_dir is not None and hw.lower().endswith(
                (".yaml", ".yml")) and not Path(hw).is_absolute():
            hw = str(Path(base_dir) / hw)
        if isinstance(hw, Mapping) and "parts" in hw:
            raise ValueError(f"{where}.hardware: a part is one GPU kind, not a cluster "
                             f"(no 'parts' inside a part)")
        try:
            spec = loader(hw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}.hardware: {exc}") from None
        if not isinstance(spec, HardwareSpec):
            raise ValueError(f"{where}.hardware: expected one GPU kind (a preset, a hardware "
                             f"mapping or file), got {type(spec).__name__}")
        parts.append(ClusterPart(spec, nodes))
    try:
        return ClusterSpec(name, tuple(parts), source)
    except (TypeError, ValueError) as exc:     # messages start with the field's path
        raise ValueError(f"{path}.{exc}") from None


def load_cluster(spec, hardware_loader=None):
    """A ClusterSpec from a mapping with ``parts``, a YAML file holding one, or a
    ClusterSpec; anything else — a preset name, a hardware file or mapping, a
    HardwareSpec — goes to ``hardware_loader`` (default :func:`load_hardware`) and comes
    back as its HardwareSpec, unchanged. The loader also reads each part's ``hardware``
    (the CLI passes the front door's own loader, which also knows this machine's
    calibrated model and says where it belongs)."""
    loader = hardware_loader or load_hardware
    if isinstance(spec, (ClusterSpec, HardwareSpec)):
        return spec
    if isinstance(spec, Mapping):
        return cluster_from_dict(spec, hardware_loader=loader) if _is_cluster_data(spec) \
            else loader(spec)
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if path.suffix.lower() in (".yaml", ".yml") and path.is_file():
            import yaml  # lazy: only user files need it
            try:
                data = yaml.safe_load(path.read_text("utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError):
                data = None                  # the hardware loader says what is wrong
            if _is_cluster_data(data):
                return cluster_from_dict(data, path=f"{path}: cluster", hardware_loader=loader,
                                         base_dir=path.parent)
        return loader(spec)
    raise TypeError(f"hardware must be a preset name, a YAML path, a dict, a HardwareSpec or "
                    f"a ClusterSpec, got {spec!r}")
