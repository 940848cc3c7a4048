"""Simulate one GPT training iteration on a hardware model, from the training program.

1. Trace the GPT training program (:func:`pipeline_parallel.executor.train_program` with
   the GPT stages) on shape-only 16-bit arrays, one representative rank per pipeline
   position (data- and tensor-parallel peers are identical), for a short step of a few
   micro-batches;
2. stitch the full step's traces from those actions (:mod:`pipeline_parallel.stitch`),
   following the full schedule of m = B / (dp·b) micro-batches;
3. replay them on the hardware (:func:`vcluster.timing.engine.simulate_trace` with
   :class:`~vcluster.timing.hardware_costs.HardwareCostModel`), symmetric mode.

Outputs: step time; per device compute, communication, exposed communication and bubble
time (means over the pipeline ranks); T_compute / T_comm; TFLOP/s per GPU counting the
FLOPs actually executed (recomputation included, from the trace); MFU with the model
FLOPs 72·B·s·l·h²·(1 + s/6h + V/12lh) over the peak of the compute dtype; peak memory
per device (:mod:`pipeline_parallel.gpt_memory`) and whether it fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vcluster.runtime.tracing import TraceCompute, trace_program
from .executor import train_program
from .gpt import GPT, GPTConfig, ParallelConfig, megatron_model_flops
from .gpt_memory import gpt_memory
from .stitch import coalesce, cut_templates, stitch

__all__ = ["GPTSimulation", "simulate_gpt", "RATIO_FLAG"]

RATIO_FLAG = 10.0      # below this compute/communication ratio, communication dominates


@dataclass(frozen=True)
class GPTSimulation:
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    compute_comm_ratio: float
    low_ratio: bool
    peak_memory_gb: float
    fits: bool
    memory: tuple
    gpus: int
    microbatches: int
    hardware: str

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["memory"] = [dataclasses.asdict(m) | {"total_bytes": m.total_bytes}
                         for m in self.memory]
        return out


def _short_microbatches(parallel: ParallelConfig) -> int:
    m = parallel.microbatches
    if parallel.schedule == "interleaved_1f1b":
        return parallel.pp if m >= parallel.pp else m
    return min(m, 2)


def simulate_gpt(config: GPTConfig, parallel: ParallelConfig, hardware,
                 dtype: str = "bf16") -> GPTSimulation:
    """See the module docstring. ``hardware``: a HardwareSpec, a preset name or a file."""
    from pipelining import make_schedule
    from vcluster.timing import load_hardware
    from vcluster.timing.engine import simulate_trace
    from vcluster.timing.hardware_costs import HardwareCostModel

    hw = load_hardware(hardware)
    mesh = parallel.mesh()
    traced_config = dataclasses.replace(config, dtype="float16")    # 16-bit bytes
    gpt = GPT(traced_config)
    m, m_short = parallel.microbatches, _short_microbatches(parallel)
    short = dataclasses.replace(parallel, global_batch=parallel.dp * parallel.micro_batch * m_short)
    ranks = list(mesh.group("pp", 0))
    args = gpt.meta_args(mesh, short)
    job = args[0][0]
    traces = {t.rank: t for t in trace_program(mesh, train_program, args, ranks=ranks)}
    schedule = make_schedule(parallel.schedule, parallel.pp, m,
                             virtual_stages=parallel.chunks if parallel.schedule
                             == "interleaved_1f1b" else None)
    S = job.n_stages
    costs = HardwareCostModel(hw, dtype)
    full = []
    for pos, rank in enumerate(ranks):
        t = coalesce(cut_templates(traces[rank], job.actions[pos], S, m_short), costs)
        full.append(stitch(t, rank, tuple(schedule.actions[pos]), tuple(ranks), S, m,
                           markers=False))
    result = simulate_trace(full, costs, mesh=mesh, symmetric=True, timeline=False)
    step = result.step_time_s
    flops = [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in full]
    n = mesh.size
    model_flops = megatron_model_flops(parallel.global_batch, config.seq, config.layers,
                                       config.hidden, config.vocab)
    memory = tuple(gpt_memory(config, parallel, schedule))
    peak = max(mm.total_bytes for mm in memory)

    def mean(d):
        return sum(d.values()) / len(d)

    ratio = result.compute_comm_ratio
    return GPTSimulation(
        step_time_s=step, tflops_per_gpu=sum(flops) / len(flops) / step / 1e12,
        mfu=model_flops / (n * hw.device.peak_flops(dtype) * step),
        compute_s=mean(result.compute_s), comm_s=mean(result.comm_s),
        exposed_comm_s=mean(result.exposed_comm_s), bubble_s=mean(result.bubble_s),
        compute_comm_ratio=ratio, low_ratio=ratio < RATIO_FLAG,
        peak_memory_gb=peak / 1e9, fits=peak <= hw.device.hbm_bytes, memory=memory,
        gpus=n, microbatches=m, hardware=hw.name)
