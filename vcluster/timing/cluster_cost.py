"""``ClusterCostModel``: the replay's :class:`~vcluster.timing.cost_model.CostModel` for a
heterogeneous cluster (:class:`~vcluster.timing.cluster.ClusterSpec`).

One :class:`~vcluster.timing.hardware_model.HardwareCostModel` per GPU kind, all with the
same dtype and options; a rank's compute ops are priced by its own kind's model
(:meth:`ClusterCostModel.rank_costs`, which the replay asks for each traced rank); a
collective or point-to-point transfer within one part by that part's model, one spanning
parts by each spanning part's model and the slowest taken (:mod:`.cluster` says why).

``placement`` (optional): the cluster rank (device) of each mesh rank; default the
identity (mesh rank r on device r). :func:`~vcluster.timing.cluster.axis_major_placement`
gives the one that puts a pipeline stage's ranks next to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cluster import ClusterSpec
from .hardware_model import TRAINING_KERNEL_EFFICIENCY, HardwareCostModel

__all__ = ["ClusterCostModel"]


@dataclass(frozen=True)
class ClusterCostModel:
    cluster: ClusterSpec
    dtype: str = "bf16"
    efficiency: float = TRAINING_KERNEL_EFFICIENCY
    fp8_gemms: object = None
    flash_v1: bool = False
    gemm_format: str = "fp8"          # the format of the fp8_gemms ops (gemm_formats)
    placement: tuple | None = None
    attention_kernel: str = ""        # HardwareCostModel's: a named fused attention kernel
    # one HardwareCostModel per part (parts of equal hardware share one)
    models: tuple = field(default=(), init=False, repr=False, compare=False)
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.cluster, ClusterSpec):
            raise TypeError(f"ClusterCostModel: cluster must be a ClusterSpec, got "
                            f"{self.cluster!r}")
        by_kind: dict = {}
        models = []
        for k, part in enumerate(self.cluster.parts):
            hw = part.hardware
            model = by_kind.get(hw)
            if model is None:
                try:
                    model = by_kind[hw] = HardwareCostModel(
                        hw, self.dtype, self.efficiency, fp8_gemms=self.fp8_gemms,
                        flash_v1=self.flash_v1, gemm_format=self.gemm_format,
                        attention_kernel=self.attention_kernel)
                except ValueError as exc:
                    raise ValueError(f"cluster {self.cluster.name!r} part {k} "
                                     f"({hw.name}): {exc}") from None
            models.append(model)
        object.__setattr__(self, "models", tuple(models))
        if self.placement is not None:
            placement = tuple(self.placement)
            n = self.cluster.gpus
            if len(set(placement)) != len(placement) or any(
                    isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < n
                    for d in placement):
                raise ValueError(f"ClusterCostModel: placement must give each mesh rank a "
                                 f"distinct device in 0..{n - 1} of cluster "
                                 f"{self.cluster.name!r}, got {placement!r:.200}")
            object.__setattr__(self, "placement", placement)

    # --- where a rank runs -----------------------------------------------------------
    def device(self, rank: int) -> int:
        """The cluster rank (device) of mesh rank ``rank``."""
        if self.placement is None:
            if not 0 <= rank < self.cluster.gpus:
                raise ValueError(f"rank {rank} is outside cluster {self.cluster.name!r} "
                                 f"({self.cluster.gpus} GPUs: ranks 0..{self.cluster.gpus - 1})")
            return rank
        if not 0 <= rank < len(self.placement):
            raise ValueError(f"rank {rank} has no device in the placement (ranks "
                             f"0..{len(self.placement) - 1}) on cluster {self.cluster.name!r}")
        return self.placement[rank]

    def part_of(self, rank: int) -> int:
        """The part (GPU kind) mesh rank ``rank`` runs on."""
        return self.cluster.part_of(self.device(rank))

    def rank_costs(self, rank: int) -> HardwareCostModel:
        """The model that prices mesh rank ``rank``'s compute: its own GPU kind's."""
        return self.models[self.part_of(rank)]

    @property
    def kernel_profile(self):
        """The first part's kernel profile when the parts agree on having one or not
        (None: priced analytically), which decides whether plain PyTorch's autocast
        kernels are priced by default; ValueError when some parts price kernels from
        measurements and others analytically (each part still prices its own kernels:
        say ``autocast_kernels`` explicitly)."""
        profiled = {m.kernel_profile is not None for m in self.models}
        if len(profiled) > 1:
            raise ValueError(f"cluster {self.cluster.name!r}: some parts price kernels from "
                             f"measurements and others analytically, so whether plain "
                             f"PyTorch's autocast kernels are priced has no default; give "
                             f"autocast_kernels=True or False")
        return self.models[0].kernel_profile

    # --- the CostModel protocol ------------------------------------------------------
    def compute_time_s(self, op) -> float:
        """A compute op's price where every part prices it alike (one GPU kind, or an op
        priced already: ``op.seconds``); a cluster of several kinds prices compute per
        rank (:meth:`rank_costs`)."""
        if getattr(op, "seconds", None) is not None:
            return op.seconds
        if len({id(m) for m in self.models}) == 1:
            return self.models[0].compute_time_s(op)
        raise ValueError(f"cluster {self.cluster.name!r} has {len(self.cluster.kinds)} GPU "
                         f"kinds: a compute op is priced on its rank's own device "
                         f"(rank_costs(rank).compute_time_s(op))")

    def _placed(self, op):
        """(op with its group on devices, the parts' models it spans)."""
        hit = self._groups.get(op.group)
        if hit is None:
            devices = tuple(self.device(r) for r in op.group)
            parts = sorted({self.cluster.part_of(d) for d in devices})
            models = []
            for k in parts:
                if all(m is not self.models[k] for m in models):
                    models.append(self.models[k])
            hit = self._groups[op.group] = (devices, tuple(models))
        devices, models = hit
        return (op if devices == op.group else replace(op, group=devices)), models

    def collective_time_s(self, op, concurrent: int = 1) -> float:
        placed, models = self._placed(op)
        return max(m.collective_time_s(placed, concurrent) for m in models)

    def collective_algorithm(self, op) -> str:
        """The algorithm of the model whose price sets ``op``'s time."""
        placed, models = self._placed(op)
        slowest = max(models, key=lambda m: m.collective_time_s(placed, 1))
        return slowest.collective_algorithm(placed)

    def wire_bytes(self, op) -> float:
        return self.models[0].wire_bytes(op)

    def p2p_ports(self, src: int, dst: int) -> tuple:
        """The NICs a transfer between nodes occupies (each device's own; none within a
        node), as :meth:`HardwareCostModel.p2p_ports`."""
        a, b = self.device(src), self.device(dst)
        gpn = self.cluster.gpus_per_node
        if a // gpn == b // gpn:
            return ()
        return (("nic_out", a), ("nic_in", b))

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        if src == dst:
            return 0.0
        a, b = self.device(src), self.device(dst)
        ka, kb = self.cluster.part_of(a), self.cluster.part_of(b)
        t = self.models[ka].p2p_time_s(a, b, nbytes)
        return t if self.models[kb] is self.models[ka] else max(
            t, self.models[kb].p2p_time_s(a, b, nbytes))
