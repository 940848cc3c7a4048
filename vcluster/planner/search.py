"""``plan_gpt``: the best TP x PP x DP x schedule x micro-batch x recomputation of a GPT on
N GPUs, by a closed-form screen of every candidate and a SimPy replay of the best.

>>> df = plan_gpt(hidden=12288, layers=96, heads=96, seq=2048, vocab=51200,
...               gpus=1024, global_batch=1536, hardware="a100-80gb-dgx")  # doctest: +SKIP
>>> df.head(10)                                                              # doctest: +SKIP

1. Enumerate (:mod:`vcluster.planner.candidates`) and drop what does not fit
   memory, counting the rejections per reason;
2. screen every candidate (:mod:`vcluster.planner.screen`, milliseconds each; the
   per-layer costs are traced once per (tp, micro-batch, SP, recompute));
3. replay the ``replay`` best of the screen (default max(top, 10)) with
   :func:`~vcluster.planner.simulation.simulate_gpt`, spread over the machine's
   cores (a process pool; one process when ``workers=1`` or a pool cannot start);
4. order: the replayed candidates by replayed step time, then the others by screened
   step time — everything above the last replayed row was replayed (``replayed``).

The result is a pandas DataFrame, one row per candidate that fits, with the columns of
``COLUMNS``; ``df.attrs`` holds ``config`` (the GPTConfig planned), ``rejected`` (reason
-> count), ``replayed`` (count), ``planning_time_s``, ``hardware``, ``gpus``,
``global_batch`` and ``cluster_parts`` (on a heterogeneous cluster, one mapping per part:
hardware, device, nodes, gpus; else None). ``tflops_per_gpu`` counts the FLOPs executed
(hardware FLOPs, recomputation included); ``mfu`` the model's. :func:`throughput` derives
tokens/s per GPU and model TFLOP/s per GPU from a row's step time (figures of the step
time, not columns: the columns are the knobs and what was measured of them).

On a heterogeneous cluster (``hardware`` a :class:`~vcluster.timing.cluster.ClusterSpec`
or its file; ``gpus`` must be its GPU count) the stages are placed pipeline-major, each
on one GPU kind (:func:`~vcluster.planner.candidates.stage_kinds`); a candidate whose
stage straddles two kinds is split by data-parallel replicas instead when each replica
lies on one kind (:func:`~vcluster.planner.candidates.replica_kinds`, the mesh's order;
every stage then held to the smallest GPU's memory, the estimate the slowest kind's own
screen estimate, :func:`replica_screen_estimate`, the replay
``simulate_gpt(..., cluster_split="replicas")``), and is rejected otherwise
(``stage_spans_gpu_kinds``); the ``cluster_split`` column says which (None off a
cluster). A candidate split by stages with
one stage per rank takes the layer split that balances its stages
(:func:`balanced_split`): one transformer layer's forward and backward (and the
embedding's on the first stage, the head's on the last) priced on each stage's kind by
the screen's traced pieces (:func:`~vcluster.planner.layer_cost.trace_stage_pieces`
under that kind's model), then the whole layers per stage that minimise the slowest
stage (:func:`~vcluster.planner.candidates.balance_layers`; the ``layers_per_stage``
column, None where the split is the candidate's own). Each stage's memory is held to
its own device (``out_of_memory`` when the balanced split and the even one both exceed
it). The screen's estimate (:func:`cluster_screen_estimate`) takes the slowest stage's
F, I and W on its kind, the bubble's closed form at the stages' mean, and the
pipeline's and data-parallel communication as the screen prices them on the slowest
stage's kind; the replay prices every stage on its own device
(:func:`~vcluster.planner.simulation.simulate_gpt`).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import dataclasses

from modeling import ConfigError
from pipeline_parallel.gpt import GPTConfig, ParallelConfig, model_flops
from pipelining import bubble_time_closed_form
from vcluster.runtime.cores import usable_cores
from vcluster.timing.cluster import ClusterSpec, load_cluster
from vcluster.timing.gemm_formats import GEMM_FORMATS
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.attention_kernels import named_kernel

from .autocast_kernels import autocast_kernels_priced
from .candidates import (REJECT_REASONS, SearchSpace, balance_layers, enumerate_candidates,
                         replica_kinds, stage_kinds, with_node_ranks)
from .memory import MEMORY_HEADROOM, rank_memory, usable_memory_bytes
from .precision import precision_policy
from .layer_cost import trace_stage_pieces
from .screen import peak_in_flight_closed_form, peak_memory_bytes, screen_estimate
from .simulation import CLUSTER_SPLITS, fp8_gemm, simulate_gpt

__all__ = ["plan_gpt", "throughput", "COLUMNS", "MIN_REPLAYED", "REPLAY_TIMEOUT_S",
           "REJECT_REASONS", "balanced_split", "cluster_screen_estimate",
           "replica_screen_estimate", "stage_memory_bytes"]

MIN_REPLAYED = 10          # the issue: at least the top K, and at least 10, are replayed
REPLAY_TIMEOUT_S = 900.0   # one replay of up to 6,144 GPUs takes < 30 s; far beyond that is a hang

COLUMNS = ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "microbatches", "schedule",
           "virtual_stages", "first_stage_layers", "last_stage_layers", "layers_per_stage",
           "sequence_parallel", "recompute", "distributed_optimizer", "zero_stage",
           "cluster_split", "moe_comm_overlap", "moe_ep_node_ranks", "step_time_s",
           "tflops_per_gpu", "mfu", "peak_memory_gb", "compute_comm_ratio", "replayed", "screen_step_time_s")


def _knobs(par: ParallelConfig) -> dict:
    return {"tp": par.tp, "pp": par.pp, "dp": par.dp, "cp": par.cp, "ep": par.ep,
            "etp": par.etp,
            "micro_batch": par.micro_batch,
            "microbatches": par.microbatches, "schedule": par.schedule,
            "virtual_stages": par.chunks, "first_stage_layers": par.first_stage_layers,
            "last_stage_layers": par.last_stage_layers,
            "layers_per_stage": par.layers_per_stage,
            "sequence_parallel": par.sequence_parallel,
            "recompute": par.recompute, "distributed_optimizer": par.distributed_optimizer,
            "zero_stage": par.zero_stage, "moe_comm_overlap": par.moe_comm_overlap,
            "moe_ep_node_ranks": par.moe_ep_node_ranks}


def _flex_node_ranks(par: ParallelConfig, kinds) -> ParallelConfig:
    """``par`` with ``moe_ep_node_ranks`` where its flex expert group spans several
    scale-up domains of the hardware (:func:`~.candidates.with_node_ranks`, on every GPU
    kind of ``kinds``: set only where they agree), else ``par`` (one-hop flex: a group that
    does not split into whole domains, a ConfigError there, keeps it)."""
    if par.moe_dispatcher != "flex" or par.ep == 1:
        return par
    try:
        placed = {with_node_ranks(par, h).moe_ep_node_ranks for h in kinds}
    except ConfigError as exc:
        if exc.field != "moe_ep_node_ranks":
            raise
        return par
    return dataclasses.replace(par, moe_ep_node_ranks=placed.pop()) if len(placed) == 1 \
        and None not in placed else par


def throughput(step_time_s: float, attrs: dict) -> dict:
    """The figures of a plan row's step time, given its DataFrame's ``attrs``:
    ``tokens_per_s_per_gpu`` = global batch · seq / (step · GPUs), the unit of published
    training tables, and ``model_tflops_per_gpu`` = model FLOPs / (step · GPUs) / 1e12
    (:func:`~pipeline_parallel.gpt.model_flops`: no recomputation, MFU's numerator)."""
    config, batch, gpus = attrs["config"], attrs["global_batch"], attrs["gpus"]
    return {"tokens_per_s_per_gpu": batch * config.seq / (step_time_s * gpus),
            "model_tflops_per_gpu": model_flops(config, batch) / (step_time_s * gpus) / 1e12}


def _replay(args):
    """Worker: one replay's figures (top-level so that a process pool can pickle it)."""
    config, par, hardware, precision, fp8, split = args
    r = simulate_gpt(config, par, hardware, precision=precision, fp8=bool(fp8),
                     gemm_format=_gemm_format(fp8), cluster_split=split)
    return {"step_time_s": r.step_time_s, "tflops_per_gpu": r.tflops_per_gpu, "mfu": r.mfu,
            "peak_memory_gb": r.peak_memory_gb, "compute_comm_ratio": r.compute_comm_ratio}


def _progress(enabled):
    """A rich progress bar on a terminal (silent when not a tty or disabled); ``enabled``
    True, False, None (a bar when stderr is a tty) or a progress object of rich's
    ``Progress`` calls (``add_task``, ``advance``, ``start``, ``stop``), used as given:
    :class:`~vcluster.planner.progress.ProgressLines` for a pipe."""
    if enabled is not None and not isinstance(enabled, bool):
        if not all(callable(getattr(enabled, m, None))
                   for m in ("add_task", "advance", "start", "stop")):
            raise TypeError(f"plan_gpt: progress must be True, False, None or an object with "
                            f"add_task, advance, start and stop, got {enabled!r}")
        return enabled
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    return Progress("[progress.description]{task.description}", BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                    transient=True)


def pool_context():
    """fork where the platform has it (works from notebooks and scripts without a
    ``__main__`` guard; the workers only run pure replays), else spawn."""
    import multiprocessing
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def process_pool(workers: int, jobs: int, who: str) -> ProcessPoolExecutor | None:
    """A pool of min(workers, jobs) processes (:func:`pool_context`), or None — one worker
    or one job, or a platform that cannot start one (``who`` says so on stderr, and the
    caller runs its jobs in this process)."""
    if workers <= 1 or jobs <= 1:
        return None
    try:
        return ProcessPoolExecutor(max_workers=min(workers, jobs), mp_context=pool_context())
    except (OSError, ImportError, NotImplementedError, ValueError) as exc:
        print(f"{who}: no process pool ({exc}); working in this process", file=sys.stderr)
        return None


def _run_replays(config, pars, hardware, workers: int, bar, precision, fp8,
                 splits=None) -> list[dict]:
    """Replay ``pars`` on ``workers`` processes (in this one when 1 or a pool fails);
    ``splits``: each one's ``cluster_split`` on a heterogeneous cluster (default None)."""
    task = bar.add_task("candidates replayed", total=len(pars)) if bar else None
    jobs = [(config, p, hardware, precision, fp8, None if splits is None else splits[i])
            for i, p in enumerate(pars)]

    def done():
        if bar:
            bar.advance(task)

    pool = process_pool(workers, len(jobs), "plan_gpt")
    if pool is not None:
        with pool:
            # longest first (ops to replay ~ m·l, twice the collectives under SP), so
            # that no long replay starts last while the other workers idle
            order = sorted(range(len(jobs)), key=lambda i: -pars[i].microbatches * (
                2 if pars[i].sequence_parallel else 1))
            submitted = {i: pool.submit(_replay, jobs[i]) for i in order}
            futures = [submitted[i] for i in range(len(jobs))]
            out = []
            for par, fut in zip(pars, futures):
                try:
                    out.append(fut.result(timeout=REPLAY_TIMEOUT_S))
                except FutureTimeout:
                    for f in futures:
                        f.cancel()
                    raise TimeoutError(
                        f"plan_gpt: waited {REPLAY_TIMEOUT_S:.0f} s for the replay worker of "
                        f"{_knobs(par)}; it did not finish") from None
                done()
            return out
    out = []
    for j in jobs:
        out.append(_replay(j))
        done()
    return out


class _Pieces:
    """The screen's traced pieces of each candidate's (tp, b, SP, recompute, ...) key,
    priced under ``costs`` (traced once per key)."""

    def __init__(self, config, costs, precision):
        self.config, self.costs, self.cache = config, costs, {}
        self.autocast = autocast_kernels_priced(precision, costs)     # as the replays will
        self.fused = self.autocast and precision.inductor_fusion

    def __call__(self, par):
        key = (par.tp, par.micro_batch, par.sequence_parallel, par.recompute)
        cp_key = (par.cp, par.cp_algorithm) if par.cp > 1 else ()
        key = key + cp_key + (par.ep, par.etp, par.moe_dispatcher, par.attention,
                              par.use_async_grad_reduce, par.use_tp_comm_overlap,
                              par.recompute_modules)
        if key not in self.cache:
            self.cache[key] = trace_stage_pieces(
                self.config, *key[:4], self.costs, *cp_key, ep=par.ep,
                attention=par.attention, autocast_kernels=self.autocast,
                inductor_fusion=self.fused, async_grad_reduce=par.use_async_grad_reduce,
                etp=par.etp, moe_dispatcher=par.moe_dispatcher,
                tp_comm_overlap=par.use_tp_comm_overlap,
                recompute_modules=par.recompute_modules)
        return self.cache[key]


def _gemm_format(fp8) -> str:
    """The GEMM format of plan_gpt's ``fp8`` (True: "fp8"; a format's name: itself)."""
    return fp8 if isinstance(fp8, str) else "fp8"


def _screen_costs(hw, fp8, attention) -> HardwareCostModel:
    """The model the screen prices a GPU kind's pieces with, as the replays will."""
    return HardwareCostModel(hw, fp8_gemms=fp8_gemm if fp8 else None,
                             gemm_format=_gemm_format(fp8), flash_v1=attention == "flash-v1",
                             attention_kernel=named_kernel(attention))


def _screen_all(config, candidates, hw, bar, precision, fp8, attention) -> list:
    pieces = _Pieces(config, _screen_costs(hw, fp8, attention), precision)
    task = bar.add_task("candidates screened", total=len(candidates)) if bar else None
    out = []
    for par in candidates:
        out.append(screen_estimate(config, par, pieces(par), hw, precision))
        if bar:
            bar.advance(task)
    return out


def _piece_s(pieces, piece: str) -> float:
    """One micro-batch's forward and backward (F + I + W) of ``piece``, seconds."""
    return sum(pieces[(piece, a)].seconds for a in ("F", "I", "W"))


def balanced_split(config, par: ParallelConfig, kinds, pieces) -> tuple | None:
    """The layers per stage that balance ``par``'s stages on GPU kinds ``kinds`` (one
    kind index per stage) given each kind's traced pieces (``pieces[kind]``): one layer's
    F + I + W on the stage's kind, the embedding's on the first stage and the head's on
    the last as fixed work (:func:`~vcluster.planner.candidates.balance_layers`). None
    where there is nothing to balance: one kind, one stage, or interleaved chunks (the
    plan's ``layers_per_stage`` takes one stage per rank)."""
    p = par.pp
    if p == 1 or par.chunks != 1 or len(set(kinds)) == 1:
        return None
    per_layer = [_piece_s(pieces[k], "layer") for k in kinds]
    fixed = [0.0] * p
    fixed[0] += _piece_s(pieces[kinds[0]], "emb")
    fixed[-1] += _piece_s(pieces[kinds[-1]], "head")
    return balance_layers(config.layers, per_layer, fixed)


def stage_memory_bytes(config, par: ParallelConfig, precision) -> list:
    """Each pipeline rank's peak memory (:func:`~vcluster.planner.memory.rank_memory` with
    the schedule's closed-form micro-batches in flight), bytes."""
    p, v, m = par.pp, par.chunks, par.microbatches
    return [rank_memory(config, par, r, peak_in_flight_closed_form(par.schedule, p, m, v, r),
                        precision=precision).total_bytes for r in range(p)]


def cluster_screen_estimate(config, par: ParallelConfig, kinds, pieces, hardware,
                            peak_flops: float, precision="megatron"):
    """The screen's estimate (:func:`~vcluster.planner.screen.screen_estimate`) of ``par``
    with its stages on GPU kinds ``kinds`` (``pieces[k]``, ``hardware[k]``: kind k's traced
    pieces and HardwareSpec): the slowest rank's F, I and W on its own kind set the busy
    time m·(F + B); the bubble is the schedule's closed form at the ranks' mean F, B and
    W; the pipeline's sends and the exposed data-parallel communication are the screen's
    on the slowest rank's kind; ``peak_flops`` is the mean peak of the GPUs (MFU). An
    estimate for ranking; the replay prices each stage on its own device."""
    p, v, m = par.pp, par.chunks, par.microbatches
    per_rank = []
    for r in range(p):
        k = kinds[r]
        c = {}
        for a in ("F", "I", "W"):
            x = par.rank_layers(config.layers, r) * pieces[k][("layer", a)]
            if r == 0:
                x = x + pieces[k][("emb", a)]
            if (p * v - 1) % p == r:
                x = x + pieces[k][("head", a)]
            c[a] = x.seconds
        per_rank.append(c)
    crit = max(range(p), key=lambda r: sum(per_rank[r].values()))
    est = screen_estimate(config, par, pieces[kinds[crit]], hardware[kinds[crit]], precision)
    F, I, W = (per_rank[crit][a] for a in ("F", "I", "W"))
    busy = m * (F + I + W)
    mean = {a: sum(c[a] for c in per_rank) / p for a in ("F", "I", "W")}
    name = par.schedule if p > 1 else "1f1b"
    B = mean["I"] + mean["W"]
    if name == "zero_bubble" and (m < p or mean["W"] >= B):
        name = "1f1b"
    bubble = 0.0 if p == 1 else bubble_time_closed_form(
        name, p, m, v if name == "interleaved_1f1b" else 1, mean["F"], B,
        min(mean["W"], 0.999 * B))
    step = busy + bubble + est.p2p_s + est.exposed_dp_s
    n = par.gpus
    return dataclasses.replace(
        est, step_time_s=step, busy_s=busy, bubble_s=bubble,
        tflops_per_gpu=est.tflops_per_gpu * est.step_time_s / step,
        mfu=model_flops(config, par.global_batch) / (n * peak_flops * step))


def replica_screen_estimate(config, par: ParallelConfig, kinds, pieces, hardware,
                            peak_flops: float, precision="megatron"):
    """The screen's estimate of ``par`` with its data-parallel replicas on GPU kinds
    ``kinds`` (one per replica; ``pieces[k]``, ``hardware[k]``: kind k's traced pieces
    and HardwareSpec): every replica runs the whole model, and the data-parallel
    collectives that join them wait for the slowest and run at the slowest part's price,
    so the step is the slowest kind's own screen estimate
    (:func:`~vcluster.planner.screen.screen_estimate`); ``peak_flops`` is the mean peak
    of the GPUs (MFU). An estimate for ranking; the replay prices each replica on its own
    device."""
    est = max((screen_estimate(config, par, pieces[k], hardware[k], precision)
               for k in set(kinds)),
              key=lambda e: e.step_time_s)
    return dataclasses.replace(est, mfu=model_flops(config, par.global_batch) / (
        par.gpus * peak_flops * est.step_time_s))


def _cluster_candidates(config, candidates, cluster, bar, precision, fp8, attention,
                        memory_headroom, rejected,
                        allowed=("stages", "replicas")) -> tuple[list, list, list]:
    """(candidates placed and balanced on ``cluster``, their screen estimates, each one's
    ``cluster_split``, one of ``allowed``); the others counted in ``rejected`` (module
    docstring)."""
    kinds_hw = cluster.kinds
    pieces = [_Pieces(config, _screen_costs(h, fp8, attention), precision) for h in kinds_hw]
    if len({p.autocast for p in pieces}) > 1:
        raise ValueError(f"plan_gpt: cluster {cluster.name!r}: some GPU kinds price kernels "
                         f"from measurements and others analytically, so whether plain "
                         f"PyTorch's autocast kernels are priced has no default (the "
                         f"planner takes it from the hardware)")
    limits = [usable_memory_bytes(h.device.hbm_bytes, memory_headroom) for h in kinds_hw]
    peak = sum(part.hardware.device.peak_flops("bf16") * part.gpus
               for part in cluster.parts) / cluster.gpus
    task = bar.add_task("candidates screened", total=len(candidates)) if bar else None
    out, estimates, splits = [], [], []
    for par in candidates:
        if bar:
            bar.advance(task)
        kinds = stage_kinds(cluster, par.pp) if "stages" in allowed else None
        if kinds is None:                  # each stage on every kind: split by replicas
            replicas = replica_kinds(cluster, par) if "replicas" in allowed else None
            if replicas is None:
                rejected["stage_spans_gpu_kinds"] += 1
                continue
            limit = min(limits[k] for k in set(replicas))
            if max(stage_memory_bytes(config, par, precision)) > limit:
                rejected["out_of_memory"] += 1
                continue
            out.append(par)
            estimates.append(replica_screen_estimate(
                config, par, replicas, {k: pieces[k](par) for k in set(replicas)},
                kinds_hw, peak, precision))
            splits.append("replicas")
            continue
        by_kind = {k: pieces[k](par) for k in set(kinds)}
        split = balanced_split(config, par, kinds, by_kind)
        tries = [par]
        if split is not None and split != par.stage_layers(config.layers):
            tries.insert(0, dataclasses.replace(par, first_stage_layers=None,
                                                last_stage_layers=None,
                                                layers_per_stage=split))
        for t in tries:
            if all(b <= limits[kinds[r]]
                   for r, b in enumerate(stage_memory_bytes(config, t, precision))):
                out.append(t)
                estimates.append(cluster_screen_estimate(config, t, kinds, by_kind,
                                                         kinds_hw, peak, precision))
                splits.append("stages")
                break
        else:
            rejected["out_of_memory"] += 1
    return out, estimates, splits


_MODEL_DEFAULTS = dict(hidden=None, layers=None, heads=None, seq=None, vocab=None,
                      arch="gpt", kv_heads=None, ffn_hidden=None, tie_embeddings=False,
                      experts=0, moe_top_k=2, moe_ffn_hidden=None, capacity_factor=None)


def _model(config, **fields) -> GPTConfig:
    """``config``, or the GPTConfig of ``fields``; ValueError naming what was given twice
    or is missing."""
    given = [k for k, v in fields.items() if v != _MODEL_DEFAULTS[k]]
    if config is not None:
        if not isinstance(config, GPTConfig):
            raise TypeError(f"plan_gpt: config must be a GPTConfig, got {config!r}")
        if given:
            raise ValueError(f"plan_gpt: config= is the whole model; do not also pass "
                             f"{', '.join(given)} (use dataclasses.replace(config, ...))")
        return config
    missing = [k for k in ("hidden", "layers", "heads", "seq", "vocab") if fields[k] is None]
    if missing:
        raise ValueError(f"plan_gpt: {', '.join(missing)} required (or config=GPTConfig)")
    return GPTConfig(**fields)


def plan_gpt(*, hidden: int | None = None, layers: int | None = None,
             heads: int | None = None, seq: int | None = None, vocab: int | None = None,
             gpus: int, global_batch: int, hardware="a100-80gb-dgx", top: int = 10,
             replay: int | None = None, max_tp: int | None = None,
             micro_batches=None, max_micro_batch: int | None = None,
             schedules=None, max_virtual_stages: int | None = None, recompute=None,
             sequence_parallel=None, workers: int | None = None,
             progress: bool | None = None, memory_headroom: float = MEMORY_HEADROOM,
             attention: str = "flash", tp_overlap: str = "backward",
             distributed_optimizer: bool | None = None,
             arch: str = "gpt", kv_heads: int | None = None, ffn_hidden: int | None = None,
             tie_embeddings: bool = False, max_cp: int = 1, cp_algorithm: str = "ring",
             experts: int = 0, moe_top_k: int = 2, moe_ffn_hidden: int | None = None,
             capacity_factor: float | None = None, max_ep: int = 1, zero_stages=None,
             precision="megatron", fp8: bool = False, grad_reduce_dtype: str = "model",
             config: GPTConfig | None = None, cluster_splits=None,
             moe_dispatcher: str = "alltoall", moe_comm_overlap: bool = False):
    """Plan the parallel configuration of a GPT (see the module docstring).

    The model: ``config`` (a :class:`~pipeline_parallel.gpt.GPTConfig`, e.g.
    ``GPTConfig.of_model("qwen3-235b-a22b", seq=4096, timing_only=True)``: every field of
    it, fine-grained MoE and attention variants included), or the keywords ``hidden``,
    ``layers``, ``heads``, ``seq``, ``vocab`` and the architecture and MoE keywords below
    (not both).

    ``top``: rows the caller shows (at least that many are replayed); ``replay``: how many
    of the screen's best are replayed (default max(top, 10); 0 = screen only);
    ``max_tp`` default the GPUs of one scale-up (NVLink) domain; ``micro_batches`` an explicit list, else the
    divisors of B/dp up to ``max_micro_batch`` (8); ``schedules``, ``recompute``,
    ``sequence_parallel``: restrict the choices; ``workers``: replay processes (default
    the cores this process may use: affinity mask, cgroup quota); ``progress``: a
    progress bar (True; default None: when stderr is a tty; False: none) or a progress
    object used as given (rich's ``Progress`` calls:
    :class:`~vcluster.planner.progress.ProgressLines` prints lines, for a pipe);
    ``memory_headroom``: the share of each device's memory a configuration must leave
    free (default 5%, :data:`~vcluster.planner.memory.MEMORY_HEADROOM`); ``attention``:
    the attention kernel (one of ParallelConfig's: flash, unfused or flash-v1); ``tp_overlap``:
    every candidate's :attr:`~pipeline_parallel.gpt.ParallelConfig.tp_overlap` ("backward",
    the default: Megatron's asynchronous input-gradient reductions, or "none");
    ``distributed_optimizer``: True / False for every candidate, None (default) where a
    candidate with dp > 1 needs it to fit. ``arch``, ``kv_heads``, ``ffn_hidden``,
    ``tie_embeddings``: as :class:`~pipeline_parallel.gpt.GPTConfig`'s ("llama":
    grouped-query attention, SwiGLU; tied: the head is E^T).
    ``max_cp``: the largest context-parallel degree searched (every cp up to it that
    divides the GPUs and splits s into 2·cp chunks; default 1: no context parallelism,
    the search of earlier versions), with ``cp_algorithm`` ("ring" or "all_gather").
    ``experts``, ``moe_top_k``, ``moe_ffn_hidden``, ``capacity_factor``: a mixture of
    experts (GPTConfig's fields); ``max_ep``: the largest expert-parallel degree tried
    (every ep <= max_ep dividing dp and the experts; default 1), each expert split over
    tp (etp = tp) or, tp > 1 with sequence parallelism, the group folded over whole tp
    groups (etp = 1); with cp > 1 the group takes whole cp groups (ep = cp × a divisor of
    dp). ``moe_dispatcher``: every candidate with ep > 1 dispatches its tokens so
    ("alltoall", the default; "allgather"; "flex": DeepEP / HybridEP, one row per token and
    destination rank — where its expert group spans several scale-up domains of the
    hardware, the candidate's ``moe_ep_node_ranks`` is set to the group's ranks per domain,
    :func:`~vcluster.planner.candidates.with_node_ranks`, and stays one-hop flex where the
    group does not split into whole domains). ``moe_comm_overlap``: Megatron-Core's MoE
    all-to-all overlap (the combined 1F1B) on every candidate with ep > 1 where
    ParallelConfig's rule allows it (the alltoall or flex dispatcher, no full
    recomputation, 1f1b on pp 1 or interleaved_1f1b with virtual stages >= 2), off on the
    others (it rejects no candidate); the DataFrame's ``moe_comm_overlap`` column says
    which rows run it, ``moe_ep_node_ranks`` the two-hop flex rows' ranks per domain
    (None: one hop). The screen prices the dispatcher (its traced pieces); the overlap
    and the two-hop flex path only the replay (``attrs["moe_dispatcher"]``,
    ``attrs["moe_comm_overlap"]``).
    ``zero_stages``: the ZeRO stages searched (default all of 0-3; not with
    ``distributed_optimizer``, which means ``(1,)`` / ``(0,)``); each candidate takes the
    lowest of them that fits (:mod:`~vcluster.planner.candidates`), the DataFrame's
    ``zero_stage`` (``distributed_optimizer`` is ``zero_stage >= 1``). ``precision``: the
    memory model's :class:`~vcluster.planner.precision.PrecisionPolicy` or a preset's name
    (default "megatron"; the DataFrame's ``attrs["precision"]``). ``fp8``: every candidate's
    transformer-layer linear GEMMs priced in FP8 (:func:`~.simulation.fp8_gemm`; hardware
    with an FP8 peak; ``attrs["fp8"]``), or in the format named (``"mxfp8"``,
    ``"nvfp4"``, ...: :mod:`vcluster.timing.gemm_formats`; refused by name on hardware
    without it). ``grad_reduce_dtype``: every candidate's
    :attr:`~pipeline_parallel.gpt.ParallelConfig.grad_reduce_dtype` ("model", the default:
    16-bit reductions, or "fp32"; ``attrs["grad_reduce_dtype"]``). ``attrs["attention"]``:
    ``attention``; ``attrs["tp_overlap"]``: ``tp_overlap`` (with ``te``, every candidate
    with tp > 1 runs sequence parallelism, which that overlap needs). ``cluster_splits``:
    on a heterogeneous cluster, the splits searched (``"stages"``, ``"replicas"``; default
    both: a candidate by stages where each stage lies on one kind, else by replicas).
    """
    import pandas as pd
    t0 = time.perf_counter()
    precision = precision_policy(precision)
    config = _model(config, hidden=hidden, layers=layers, heads=heads, seq=seq, vocab=vocab,
                    arch=arch, kv_heads=kv_heads, ffn_hidden=ffn_hidden,
                    tie_embeddings=tie_embeddings, experts=experts, moe_top_k=moe_top_k,
                    moe_ffn_hidden=moe_ffn_hidden, capacity_factor=capacity_factor)
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_gpt: {name} must be a positive int, got {value!r}")
    if replay is not None and (isinstance(replay, bool) or not isinstance(replay, int)
                               or replay < 0):
        raise ValueError(f"plan_gpt: replay must be an int >= 0, got {replay!r}")
    if not isinstance(fp8, bool) and fp8 not in GEMM_FORMATS:
        raise ValueError(f"plan_gpt: fp8 must be True, False or a GEMM format "
                         f"({', '.join(GEMM_FORMATS)}), got {fp8!r}")
    splits_allowed = tuple(CLUSTER_SPLITS if cluster_splits is None else cluster_splits)
    if not splits_allowed or any(v not in CLUSTER_SPLITS for v in splits_allowed):
        raise ValueError(f"plan_gpt: cluster_splits={cluster_splits!r}; allowed: a non-empty "
                         f"subset of {CLUSTER_SPLITS}, or None (both)")
    hw = load_cluster(hardware)
    cluster = hw if isinstance(hw, ClusterSpec) else None
    if cluster is not None and gpus != cluster.gpus:
        parts = " + ".join(f"{p.nodes} x {p.hardware.name}" for p in cluster.parts)
        raise ValueError(f"plan_gpt: gpus={gpus} but cluster {cluster.name!r} has "
                         f"{cluster.gpus} GPUs ({parts}); allowed: {cluster.gpus}")
    space = SearchSpace(
        max_tp=max_tp or hw.domain_gpus, micro_batches=micro_batches,
        **{k: v for k, v in (("max_micro_batch", max_micro_batch), ("schedules", schedules),
                             ("max_virtual_stages", max_virtual_stages),
                             ("recompute", recompute),
                             ("sequence_parallel", sequence_parallel)) if v is not None},
        attention=attention, tp_overlap=tp_overlap, grad_reduce_dtype=grad_reduce_dtype,
        distributed_optimizer=distributed_optimizer, max_cp=max_cp,
        cp_algorithm=cp_algorithm, max_ep=max_ep, zero_stages=zero_stages,
        precision=precision, moe_dispatcher=moe_dispatcher, moe_comm_overlap=moe_comm_overlap)
    if cluster is None and isinstance(gpus, int) and gpus >= 1:
        hw = hw.for_job(gpus)     # as simulate_gpt places the job: the screen prices it so
    # on a cluster: the largest device's limit here, each stage's own after the balance
    limit = max(usable_memory_bytes(h.device.hbm_bytes, memory_headroom)
                for h in (cluster.kinds if cluster is not None else (hw,)))
    candidates, rejected = enumerate_candidates(config, gpus, global_batch, space, limit)
    if moe_dispatcher == "flex":
        kinds = cluster.kinds if cluster is not None else (hw,)
        candidates = [_flex_node_ranks(p, kinds) for p in candidates]
    bar = _progress(progress)
    if bar:
        bar.start()
    try:
        splits = None
        if cluster is None:
            estimates = _screen_all(config, candidates, hw, bar, precision, fp8, attention)
        else:
            candidates, estimates, splits = _cluster_candidates(
                config, candidates, cluster, bar, precision, fp8, attention,
                memory_headroom, rejected, splits_allowed)
            limit = min(usable_memory_bytes(h.device.hbm_bytes, memory_headroom)
                        for h in cluster.kinds)
        n_replay = min(len(candidates), max(top, MIN_REPLAYED) if replay is None else replay)
        order = sorted(range(len(candidates)), key=lambda i: estimates[i].step_time_s)
        replayed = _run_replays(config, [candidates[i] for i in order[:n_replay]], hw,
                                workers or usable_cores(), bar, precision, fp8,
                                None if splits is None else [splits[i]
                                                             for i in order[:n_replay]])
    finally:
        if bar:
            bar.stop()
    rows = []
    for k, i in enumerate(order):
        par, est = candidates[i], estimates[i]
        memory = peak_memory_bytes(config, par, precision) if cluster is None else max(
            stage_memory_bytes(config, par, precision))
        figures = replayed[k] if k < n_replay else {
            "step_time_s": est.step_time_s, "tflops_per_gpu": est.tflops_per_gpu,
            "mfu": est.mfu, "peak_memory_gb": memory / 1e9,
            "compute_comm_ratio": est.compute_comm_ratio}
        rows.append(_knobs(par) | figures | {
            "replayed": k < n_replay, "screen_step_time_s": est.step_time_s,
            "cluster_split": None if splits is None else splits[i]})
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    # an int or None per row (not pandas' float NaN)
    df["moe_ep_node_ranks"] = pd.Series([r["moe_ep_node_ranks"] for r in rows], dtype=object)
    if len(df):
        df = df.sort_values(["replayed", "step_time_s"], ascending=[False, True],
                            kind="stable").reset_index(drop=True)
    df.attrs.update(config=config, rejected=dict(sorted(rejected.items())), replayed=n_replay,
                    candidates=len(candidates), hardware=hw.name, gpus=gpus,
                    cluster_parts=None if cluster is None else [
                        {"hardware": part.hardware.name, "device": part.hardware.device.name,
                         "nodes": part.nodes, "gpus": part.gpus} for part in cluster.parts],
                    global_batch=global_batch,
                    memory_limit_gb=limit / 1e9, memory_headroom=memory_headroom,
                    precision=precision.name, fp8=fp8, grad_reduce_dtype=grad_reduce_dtype,
                    attention=attention, tp_overlap=tp_overlap,
                    moe_dispatcher=moe_dispatcher, moe_comm_overlap=moe_comm_overlap,
                    planning_time_s=time.perf_counter() - t0)
    return df
