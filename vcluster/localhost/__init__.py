"""``localhost``: this machine, measured, so that the timing model predicts the emulator
itself.

A cost model like any other (:class:`~vcluster.timing.cost_model.CostModel`), built from
microbenchmarks of the machine the emulator runs on:

* :mod:`.spec` — :class:`LocalhostSpec`, the measured figures, saved and loaded as files;
* :mod:`.calibrate` — :func:`calibrate_localhost` measures them on real devices, with
  :mod:`.calls` (the CPU of a call inside programs), :mod:`.gaps` (how it grows with the
  work before it), :mod:`.messages` (message sides of ring/tree/pairwise algorithms),
  :mod:`.p2p` (ping-pongs), :mod:`.start` (devices that start together) and
  :mod:`vcluster.runtime.cores` (the cores this process may use);
* :mod:`.cost_model` — :class:`LocalhostCostModel` prices a trace from a spec, with
  :mod:`.bytes` (what the bytes of a call cost) and :mod:`.host_work` (the programs' own
  Python and numpy work, timed while tracing).

The devices share the host's cores, so the model asks the replay for a core pool
(:mod:`vcluster.timing.core_pool`) and traces programs its own way
(:meth:`LocalhostCostModel.trace_program`); callers use the generic
:func:`vcluster.timing.model_traces` and ``model.core_pool`` and never test for this class.

Layer: an engine beside the runtime and the timing model; it starts real devices to
measure (:mod:`vcluster.runtime`) and prices with the timing model (:mod:`vcluster.timing`).
"""

from .calibrate import DEFAULT_MESSAGE_BYTES, calibrate_localhost
from vcluster.runtime.cores import usable_cores
from .cost_model import BLAS_MIN_FLOPS_PER_ELEMENT, LocalhostCostModel, localhost_model
from .host_work import TracerRates, localhost_traces, measure_tracer_rates
from .spec import (LocalhostSpec, is_localhost_spec_data, load_localhost_spec,
                   save_localhost_spec)
from .hardware import cost_model_for, load_hardware

__all__ = ["LocalhostSpec", "LocalhostCostModel", "localhost_model", "localhost_traces",
           "load_localhost_spec", "save_localhost_spec", "is_localhost_spec_data",
           "calibrate_localhost", "DEFAULT_MESSAGE_BYTES", "usable_cores", "TracerRates",
           "measure_tracer_rates", "BLAS_MIN_FLOPS_PER_ELEMENT", "cost_model_for",
           "load_hardware"]
