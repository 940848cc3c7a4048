"""Goodput of a long GPT training run on simulated hardware under device failures.

    table = gpt_goodput(GPTConfig(...), ParallelConfig(...), "h100-dgx",
                        device_mtbf_h=50_000, checkpoint_every=[100, 500, 2000])

* step time ``t``: :func:`~vcluster.planner.simulation.simulate_gpt` on the hardware;
* checkpoint cost ``C``: every device writes its own shard of parameters and optimizer
  state in parallel (:mod:`vcluster.planner.memory`), so ``C`` = the largest
  per-device ``params_bytes + optimizer_bytes`` / ``write_bytes_per_s`` (the storage
  bandwidth available to one device);
* the job's MTBF ``M`` = ``device_mtbf_h`` x 3600 / number of GPUs (independent devices,
  any loss stops the job); restart ``R`` = ``restart_s``;

then :func:`vcluster.timing.faults.impact.goodput_table` (closed form and SimPy Monte Carlo,
docs/faults.md). Returns the table with the inputs as extra columns.
"""

from __future__ import annotations

from pipelining import make_schedule
from vcluster.timing.faults.impact import goodput_table

from .memory import gpt_memory
from .simulation import simulate_gpt

__all__ = ["gpt_goodput"]

_SECONDS_PER_HOUR = 3600.0


def gpt_goodput(config, parallel, hardware, device_mtbf_h, checkpoint_every,
                write_bytes_per_s: float = 2e9, restart_s: float = 300.0,
                dtype: str = "bf16", seed: int = 0):
    """See the module docstring. ``device_mtbf_h``: one number or a list (hours)."""
    if not write_bytes_per_s > 0:
        raise ValueError(f"gpt_goodput: write_bytes_per_s must be > 0, got {write_bytes_per_s!r}")
    sim = simulate_gpt(config, parallel, hardware, dtype)
    schedule = make_schedule(parallel.schedule, parallel.pp, parallel.microbatches,
                             virtual_stages=parallel.chunks if parallel.schedule
                             == "interleaved_1f1b" else None,
                             combined=parallel.moe_comm_overlap)
    state_bytes = max(m.params_bytes + m.optimizer_bytes
                      for m in gpt_memory(config, parallel, schedule))
    checkpoint_s = state_bytes / write_bytes_per_s
    mtbfs = device_mtbf_h if isinstance(device_mtbf_h, (list, tuple)) else [device_mtbf_h]
    table = goodput_table(sim.step_time_s, checkpoint_s, restart_s,
                          [h * _SECONDS_PER_HOUR / sim.gpus for h in mtbfs],
                          checkpoint_every, seed=seed)
    table.insert(0, "device_mtbf_h", [h for h in mtbfs for _ in checkpoint_every])
    table["step_time_s"], table["checkpoint_s"], table["restart_s"] = \
        sim.step_time_s, checkpoint_s, restart_s
    table["gpus"], table["hardware"] = sim.gpus, sim.hardware
    return table
