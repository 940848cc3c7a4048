"""The planner's screen: a closed-form estimate of a GPT training step, for ranking
thousands of candidate configurations in milliseconds before the best few are replayed.

Notation: p = pp ranks, v = chunks per rank, S = p·v stages of L_s = l / S layers,
m = B / (dp·b) micro-batches of b sequences, t = tp. Per micro-batch on one device,
``F``, ``I`` and ``W`` of one layer, of the embedding and of the head come from
:func:`~vcluster.planner.layer_cost.trace_stage_pieces` (the replay's own program
and cost model; TP collectives included, they are on the critical path).

Rank r holds stages r, r + p, ..., the first also the embedding, the one with stage
S - 1 the head::

    F_r = v·L_s·F_layer [+ F_emb on rank 0] [+ F_head on rank (S-1) mod p]   (same for I, W)
    B_r = I_r + W_r

The slowest rank sets the pace (F, I, W = those of the rank with the largest F_r + B_r)::

    busy    = m·(F + B)
    bubble  = the schedule's closed form (pipelining.bubble_time_closed_form):
              1F1B (p-1)(F + B); interleaved (p-1)(F + B)/v (m mod p = 0);
              ZB-H1 (p-1)·max(F, I, F + I - W) for m >= p, else as 1F1B
    p2p     = 2·(S - 1)·t_send(b·s·h·2 bytes [/t with sequence parallelism])
              (the fill and drain cross every stage boundary once each way)
    dp      = n_buckets·t_all_reduce(bucket over dp, t concurrent flows) for the 16-bit
              gradients of the rank's parameters in 1 MiB buckets (the executor's DDP
              buckets); launched during the last backward, so
    exposed = max(dp - B_last, 0) + t_all_reduce(last bucket),  B_last = B_r (1F1B: the
              rank's last backward; its other work has ended)
    step    = busy + bubble + p2p + exposed

Figures beside it: TFLOP/s per GPU = executed FLOPs per rank (mean over ranks) / step;
MFU = 72·B·s·l·h²(1 + s/6h + V/12lh) / (N · peak · step); compute / comm = the rank's
compute over its TP, p2p and DP communication; peak memory: :mod:`gpt_memory`'s formulas
with the schedules' peaks of micro-batches in flight in closed form (1F1B min(m, p - r),
ZB-H1 min(m, p), interleaved min((v-1)p + 2(p-1-r) + 1, v·m); tested equal).

Context parallelism (cp > 1): the pieces are a cp rank's (its s/cp rows, its attention
blocks; :mod:`~vcluster.planner.layer_cost`), the p2p messages are b·s/cp·h·2 bytes, the
gradients are all-reduced over dp·cp ranks, N = dp·p·cp·t; the ring's K/V transfers
count in comm but not in the step (assumed hidden behind the attention blocks, as the
program overlaps them; the replay says how far they are).

What it leaves out (the replay has them): the exact interleaving of TP, p2p and DP
traffic on shared links, stragglers of uneven stages within a rank's schedule, the
optimizer's tail. It is an estimate for ranking; the planner's final order comes from
the replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline_parallel.gpt import model_flops
from pipelining import bubble_time_closed_form
from vcluster.timing.collective_cost import collective_time_s

from .layer_cost import StagePieces
from .memory import rank_memory, rank_params

__all__ = ["ScreenEstimate", "screen_estimate", "peak_in_flight_closed_form",
           "peak_memory_bytes", "BUCKET_BYTES", "TRACE_BYTES"]

BUCKET_BYTES = 1 << 20    # the executor's default gradient bucket (train_job bucket_bytes)
TRACE_BYTES = 2           # 16-bit activations and gradients in the traced program


@dataclass(frozen=True)
class ScreenEstimate:
    step_time_s: float
    busy_s: float
    bubble_s: float
    p2p_s: float
    exposed_dp_s: float
    compute_s: float
    comm_s: float
    tflops_per_gpu: float
    mfu: float
    compute_comm_ratio: float


def peak_in_flight_closed_form(schedule: str, p: int, m: int, v: int, r: int) -> int:
    """Micro-batch activation sets alive at once on rank r (pipelining.peak_in_flight)."""
    if schedule == "1f1b":
        return min(m, p - r)
    if schedule == "zero_bubble":
        return min(m, p)
    if schedule == "interleaved_1f1b":
        return min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m)
    if schedule == "gpipe":
        return m
    raise ValueError(f"peak_in_flight_closed_form: unknown schedule {schedule!r}")


def peak_memory_bytes(config, parallel, precision="megatron") -> int:
    """max over pipeline ranks of gpt_memory's total, without building the schedule
    (``precision``: a PrecisionPolicy or a preset's name)."""
    p, v, m = parallel.pp, parallel.chunks, parallel.microbatches
    return max(rank_memory(config, parallel, r,
                           peak_in_flight_closed_form(parallel.schedule, p, m, v, r),
                           precision=precision).total_bytes
               for r in sorted({0, p - 1, (p * v - 1) % p}))


def _rank_costs(config, parallel, pieces: StagePieces, r: int) -> dict:
    p, v = parallel.pp, parallel.chunks
    per_rank_layers = config.layers // (p * v) * v
    out = {}
    for a in ("F", "I", "W"):
        c = per_rank_layers * pieces[("layer", a)]
        if r == 0:
            c = c + pieces[("emb", a)]
        if (p * v - 1) % p == r:
            c = c + pieces[("head", a)]
        out[a] = c
    return out


def screen_estimate(config, parallel, pieces: StagePieces, hardware) -> ScreenEstimate:
    """The step estimate of the module docstring for ``parallel`` on ``hardware`` (a
    HardwareSpec), with ``pieces`` traced for its tp, micro-batch, SP and recompute."""

    p, v, m, t, dp = parallel.pp, parallel.chunks, parallel.microbatches, parallel.tp, parallel.dp
    ranks = sorted({0, p - 1, (p * v - 1) % p})
    per_rank = {r: _rank_costs(config, parallel, pieces, r) for r in ranks}
    crit = max(ranks, key=lambda r: sum(c.seconds for c in per_rank[r].values()))
    F, I, W = (per_rank[crit][a] for a in ("F", "I", "W"))
    B = I + W
    busy = m * (F.seconds + B.seconds)
    name = parallel.schedule if p > 1 else "1f1b"
    if name == "zero_bubble" and (m < p or W.seconds >= B.seconds):
        name = "1f1b"
    bubble = 0.0 if p == 1 else bubble_time_closed_form(
        name, p, m, v if name == "interleaved_1f1b" else 1, F.seconds, B.seconds,
        min(W.seconds, 0.999 * B.seconds))

    cp = getattr(parallel, "cp", 1)
    act_bytes = parallel.micro_batch * config.seq // cp * config.hidden * TRACE_BYTES
    act_bytes //= t if pieces.sequence_parallel else 1
    p2p = 0.0 if p == 1 else 2 * (p * v - 1) * collective_time_s(
        "send", act_bytes, (0, t), hardware)

    exposed, dp_s = 0.0, 0.0
    if dp * cp > 1:
        # rank 0's dp (x cp) group on the mesh (dp, pp, [cp,] tp)
        group = tuple(d * p * cp * t + c * t for d in range(dp) for c in range(cp))
        grad_bytes = rank_params(config, parallel, crit) * TRACE_BYTES
        flows = max(1, min(t, hardware.gpus_per_node))
        full, rest = divmod(int(grad_bytes), BUCKET_BYTES)
        bucket_s = collective_time_s("all_reduce", BUCKET_BYTES, group, hardware,
                                     concurrent_flows=flows)
        last_s = collective_time_s("all_reduce", rest, group, hardware,
                                   concurrent_flows=flows) if rest else bucket_s
        dp_s = full * bucket_s + (last_s if rest else 0.0)
        exposed = max(dp_s - B.seconds, 0.0) + last_s

    step = busy + bubble + p2p + exposed
    compute = m * (F.compute_s + B.compute_s)
    comm = m * (F.comm_s + B.comm_s + F.cp_s + B.cp_s) + p2p + dp_s
    mean_layers_flops = m * (config.layers // p) * sum(pieces[("layer", a)].flops
                                                       for a in "FIW")
    ends_flops = m * sum(pieces[(e, a)].flops for e in ("emb", "head") for a in "FIW") / p
    tflops = (mean_layers_flops + ends_flops) / step / 1e12
    model = model_flops(config, parallel.global_batch)
    n = dp * p * t * cp
    return ScreenEstimate(
        step_time_s=step, busy_s=busy, bubble_s=bubble, p2p_s=p2p, exposed_dp_s=exposed,
        compute_s=compute, comm_s=comm, tflops_per_gpu=tflops,
        mfu=model / (n * hardware.device.peak_flops("bf16") * step),
        compute_comm_ratio=compute / comm if comm > 0 else math.inf)
