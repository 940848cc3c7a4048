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
    dp      = Σ_k t_all_reduce(bucket_k over dp, t concurrent flows) for the 16-bit
              (``grad_reduce_dtype="fp32"``: 32-bit) gradients of the rank's modules (the head, its layers, the embedding, in
              the order the backward finishes them), gathered into buckets as the
              executor's DDP does: modules join the open bucket until it holds at least
              1 MiB (``BUCKET_BYTES``), then it is launched — with modules larger than
              that, one all-reduce per module; launched during the last backward, so
    exposed = max(dp - B_last, 0) + t_all_reduce(last bucket),  B_last = B_r (1F1B: the
              rank's last backward; its other work has ended)
    opt     = the rank's optimizer step after the flush: one memory-bound kernel over its
              parameters (with ZeRO, its 1/(dp·cp) share) at the precision policy's
              bytes a parameter (``PrecisionPolicy.optimizer_step_bytes``), priced as
              the replay prices it
    step    = busy + bubble + p2p + exposed + opt

ZeRO (``zero_stage``; :mod:`pipeline_parallel.zero`'s collectives, one per module and
member of a dp group of n, each priced at nccl-tests sizes: the module's full bytes, its
gradient's in the reduction dtype)::

    ZeRO-1  rs = Σ t_reduce_scatter(module), ag = Σ t_all_gather(module)
            exposed = max(rs - B_last, 0) + t_rs(last module) + ag   (the gathers
            follow the step's update: nothing left to hide them)
    ZeRO-2  the reduce-scatters run every micro-batch, hidden behind the compute that
            follows them: exposed = max(m·rs - (m - 1)(F + B) - B_last, 0)
            + t_rs(last module) + ag
    ZeRO-3  every micro-batch gathers each module for its forward and again for its
            backward (prefetched: the next module's while this one computes), and
            reduce-scatters its gradient; nothing is gathered after the step:
            exposed = t_ag(first module) + max(m·(2·ag + rs) - m·(F + B), 0)
            + t_rs(last module)

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
traffic on shared links, stragglers of uneven stages within a rank's schedule. It is an
estimate for ranking; the planner's final order comes from the replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modeling import NormKind, Positions
from pipeline_parallel.gpt import model_flops
from pipelining import bubble_time_closed_form
from vcluster.runtime.tracing import Kernel, TraceCompute
from vcluster.timing.collective_cost import collective_time_s
from vcluster.timing.hardware_model import HardwareCostModel

from .layer_cost import StagePieces
from .memory import rank_memory, rank_params
from .precision import precision_policy

__all__ = ["ScreenEstimate", "screen_estimate", "peak_in_flight_closed_form",
           "peak_memory_bytes", "BUCKET_BYTES", "TRACE_BYTES"]

BUCKET_BYTES = 1 << 20    # the executor's default gradient bucket (train_job bucket_bytes)
TRACE_BYTES = 2           # 16-bit activations and gradients in the traced program


def grad_reduce_bytes(parallel) -> int:
    """Bytes per gradient element a data-parallel reduction moves: the traced 16-bit
    gradients', or 4 under ``ParallelConfig.grad_reduce_dtype="fp32"``."""
    return 4 if getattr(parallel, "grad_reduce_dtype", "model") == "fp32" else TRACE_BYTES


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
    per_rank_layers = parallel.rank_layers(config.layers, r)
    out = {}
    for a in ("F", "I", "W"):
        c = per_rank_layers * pieces[("layer", a)]
        if r == 0:
            c = c + pieces[("emb", a)]
        if (p * v - 1) % p == r:
            c = c + pieces[("head", a)]
        out[a] = c
    return out


def screen_estimate(config, parallel, pieces: StagePieces, hardware,
                    precision="megatron") -> ScreenEstimate:
    """The step estimate of the module docstring for ``parallel`` on ``hardware`` (a
    HardwareSpec), with ``pieces`` traced for its tp, micro-batch, SP and recompute;
    ``precision``: the policy whose optimizer step is priced (a PrecisionPolicy or a
    preset's name)."""

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

    params = _rank_modules(config, parallel, crit)        # the critical rank's modules
    exposed, dp_s = 0.0, 0.0
    if dp * cp > 1:
        # rank 0's dp (x cp) group on the mesh (dp, pp, [cp,] tp)
        group = tuple(d * p * cp * t + c * t for d in range(dp) for c in range(cp))
        flows = max(1, min(t, hardware.domain_gpus))   # dp rings sharing a domain's NICs
        modules = [n * TRACE_BYTES for n in params]             # 16-bit parameters
        reduced = [n * grad_reduce_bytes(parallel) for n in params]   # their gradients

        def price(collective, sizes):
            return [collective_time_s(collective, n, group, hardware, concurrent_flows=flows)
                    for n in sizes]

        if parallel.zero_stage == 0:
            buckets = price("all_reduce", _buckets(reduced, BUCKET_BYTES))
            dp_s = sum(buckets)
            exposed = max(dp_s - B.seconds, 0.0) + buckets[-1]
        else:
            rs, ag = price("reduce_scatter", reduced), price("all_gather", modules)
            if parallel.zero_stage == 1:
                dp_s = sum(rs) + sum(ag)
                exposed = max(sum(rs) - B.seconds, 0.0) + rs[-1] + sum(ag)
            elif parallel.zero_stage == 2:
                dp_s = m * sum(rs) + sum(ag)
                exposed = max(m * sum(rs) - (m - 1) * (F.seconds + B.seconds) - B.seconds,
                              0.0) + rs[-1] + sum(ag)
            else:
                dp_s = m * (2 * sum(ag) + sum(rs))
                exposed = ag[-1] + max(dp_s - m * (F.seconds + B.seconds), 0.0) + rs[-1]

    shards = dp * cp if parallel.zero_stage else 1
    n_opt = int(sum(params) / shards)
    opt = HardwareCostModel(hardware).compute_time_s(TraceCompute(
        "optimizer", 0, int(n_opt * precision_policy(precision).optimizer_step_bytes),
        kernel=Kernel.optimizer(n_opt, "adam")))
    step = busy + bubble + p2p + exposed + opt
    compute = m * (F.compute_s + B.compute_s) + opt
    comm = m * (F.comm_s + B.comm_s + F.cp_s + B.cp_s) + p2p + dp_s
    mean_layers_flops = m * (config.layers / p) * sum(pieces[("layer", a)].flops
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


def _rank_modules(config, parallel, r: int) -> list[float]:
    """Parameters of each module of pipeline rank r in the order its backward finishes
    them: the head (on the rank of the last stage), the layers, the embedding (rank 0)
    — :func:`~vcluster.planner.memory.rank_params` split by module."""
    h, V, t = config.hidden, config.vocab, parallel.tp
    block = config.block
    learned = block.positions is Positions.LEARNED      # a position table on the first rank
    emb = V * h / t + (config.seq * h if learned else 0) if r == 0 else 0.0
    last = (parallel.pp * parallel.chunks - 1) % parallel.pp == r
    norm = 2 * h if block.norm is NormKind.LAYERNORM else h                # the final norm
    head = V * h / t + norm if last else 0.0
    layers = parallel.rank_layers(config.layers, r)
    layer = (rank_params(config, parallel, r) - emb - head) / layers
    return [n for n in [head] + [layer] * layers + [emb] if n > 0]


def _buckets(sizes, bucket_bytes: int) -> list[float]:
    """The executor's DDP buckets (:class:`pipeline_parallel.executor.GradBuckets`):
    ``sizes`` join the open bucket in order; it is launched once it holds at least
    ``bucket_bytes``; what is left at the end is the last bucket."""
    out, open_bytes = [], 0.0
    for n in sizes:
        open_bytes += n
        if open_bytes >= bucket_bytes:
            out.append(open_bytes)
            open_bytes = 0.0
    return out + ([open_bytes] if open_bytes else [])
