"""``Workload``: one scenario's per-device program, its inputs per rank and its reference.

Every engine runs ``program(dev, *args_by_rank[r])`` on rank ``r`` and gets this rank's
outputs (a mapping name -> array, or the training program's result dict); the tracer runs
the same program on ``meta_args_by_rank`` (shape-only arrays). ``assemble`` turns the
per-rank outputs into named global arrays, ``reference()`` gives the same names computed
unsharded in one process with numpy, and :meth:`Workload.check` compares them:

    error = max |result - reference|,  scale = max |reference| (1 when 0),
    passed  <=>  error <= tolerance * scale.

With ``run.mode: simulate`` a builder makes no real data: ``args_by_rank`` is empty and
only the shape-only ``meta_args_by_rank`` exist (every kind; an MLP still draws its
small data batch), so cluster-scale shapes cost no memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

__all__ = ["Workload", "compare"]


@dataclass(frozen=True, repr=False)
class Workload:
    """See the module docstring. ``training``: the program runs every step itself (steps
    end at each rank's ``optimizer`` compute event); otherwise one run is one step.
    ``fit`` / ``fit_outputs`` (training with checkpoints and faults, see
    :mod:`vcluster.scenario.resilience`): train on an engine through the model's ``fit``, and
    name its result like ``assemble`` does. ``peak_memory_bytes()``: what one device
    holds at its peak on the hardware model (a GPT: parameters, gradients, optimizer state
    and activations, :mod:`vcluster.planner.memory`); ``model_flops``: the model's FLOPs
    per step, for MFU; ``step_traces(costs)``: one step's traces of the pipeline ranks of
    replica 0, made the planner's fast way (:func:`vcluster.planner.simulation.
    gpt_step_traces`), for a simulate-only run at cluster scale. ``roles``: each rank's
    role where ranks differ (a parameter server's ``server`` and ``worker`` ranks; the
    summary then gives each role's bytes per device). ``updates_per_step``: ``optimizer``
    events an updating rank records per step (an asynchronous parameter server applies
    each worker's gradient on its own: one per worker). ``fp8_gemms``: which traced GEMMs
    the simulation prices at the hardware's FP8 peak (a GPT's ``workload.fp8``:
    :func:`vcluster.planner.simulation.fp8_gemm`), or in ``gemm_format`` (a GPT's
    ``workload.gemm_format``: :mod:`vcluster.timing.gemm_formats`)."""

    kind: str
    mesh: object
    program: Callable
    args_by_rank: tuple
    meta_args_by_rank: tuple
    dtype: str
    assemble: Callable[[list], Mapping[str, np.ndarray]]
    reference: Callable[[], Mapping[str, np.ndarray]]
    training: bool = False
    description: str = ""
    fit: Callable | None = None            # (engine, **resilience) -> FitResult (mlp)
    fit_outputs: Callable | None = None    # FitResult -> the reference's names
    peak_memory_bytes: Callable[[], float] | None = None   # per device, on real hardware
    model_flops: float | None = None       # per step (MFU's numerator), where known
    step_traces: Callable | None = None    # costs -> one step's traces of replica 0's pipeline
    roles: tuple[str, ...] | None = None   # per rank, where ranks have different roles
    updates_per_step: int = 1              # optimizer events per step on an updating rank
    fp8_gemms: Callable | None = None      # traced op -> priced in FP8 (simulation); None: none
    gemm_format: str = "fp8"               # the format fp8_gemms ops are priced in
    flash_v1: bool = False                 # attention kernels priced as built for Ampere
    attention_kernel: str = ""             # a named fused kernel's curves ("": default)

    def __repr__(self) -> str:
        return (f"Workload({self.kind!r}, mesh={self.mesh}, dtype={self.dtype!r}, "
                f"training={self.training}){': ' + self.description if self.description else ''}")

    def check(self, outputs_by_rank: list, tolerance: float) -> tuple[dict, ...]:
        """One check per reference array (see the module docstring)."""
        return compare(self.assemble(outputs_by_rank), self.reference(), tolerance)


def compare(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray],
            tolerance: float) -> tuple[dict, ...]:
    """``{"name", "passed", "max_abs_error", "tolerance"}`` per name of ``want``
    (``tolerance`` here is the absolute bound ``tolerance * max |reference|``)."""
    out = []
    for name, ref in want.items():
        ref = np.asarray(ref, np.float64)
        value = got.get(name)
        if value is None or np.shape(value) != ref.shape:
            out.append({"name": name, "passed": False, "max_abs_error": float("inf"),
                        "tolerance": tolerance, "detail": f"shape {np.shape(value)} != "
                                                          f"reference {ref.shape}"})
            continue
        err = float(np.max(np.abs(np.asarray(value, np.float64) - ref))) if ref.size else 0.0
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        bound = tolerance * (scale if scale > 0 else 1.0)
        out.append({"name": name, "passed": bool(err <= bound), "max_abs_error": err,
                    "tolerance": bound})
    return tuple(out)
