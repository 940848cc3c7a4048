"""``parallel.policy: auto`` for ``matmul`` and ``ffn``: the layout is chosen by
:func:`vcluster.planner.auto_layout` — every valid layout of the op on the mesh, the
redistribution of its inputs from replicated included, ranked by the timing model's
replay on the scenario's ``hardware`` — and the fastest is the one that runs.

The choice depends on the hardware: the default ``a100-80gb-dgx`` ranks layouts for that
machine; ``hardware: localhost`` (with ``calibration:`` a saved spec, or calibrated on the
spot) ranks them for this machine, so the emulated run is the one predicted fastest here.
"""

from __future__ import annotations

from dataclasses import dataclass

from vcluster.planner.auto_layout import auto_layout

from ..hardware import cost_setup

__all__ = ["AUTO", "AutoChoice", "choose"]

AUTO = "auto"


@dataclass(frozen=True)
class AutoChoice:
    """The sharding ``auto`` picked, its predicted time and how many layouts it ranked."""

    sharding: object
    predicted_s: float
    candidates: int
    hardware: str

    def __str__(self) -> str:
        return (f"auto: fastest of {self.candidates} layouts on {self.hardware} "
                f"(predicted {self.predicted_s * 1e6:.1f} us)")


def choose(op: str, scenario, mesh, shapes: dict, **kwargs) -> AutoChoice:
    """Rank the layouts of ``op`` ("matmul" or "ffn") with ``shapes`` on ``mesh``, priced by
    the same cost model as the scenario's own prediction (:func:`..hardware.cost_setup`)."""
    setup = cost_setup(scenario, mesh, scenario.workload.dtype)
    best, ranking = auto_layout(op, mesh, shapes, setup.label, dtype=scenario.workload.dtype,
                                cost_model=setup.costs, **kwargs)
    return AutoChoice(best, float(ranking.iloc[0]["predicted_s"]), len(ranking),
                      scenario.hardware.label)
