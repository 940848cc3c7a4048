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
-> count), ``replayed`` (count), ``planning_time_s``, ``hardware``, ``gpus`` and
``global_batch``. ``tflops_per_gpu`` counts the FLOPs executed (hardware FLOPs,
recomputation included); ``mfu`` the model's. :func:`throughput` derives tokens/s per GPU
and model TFLOP/s per GPU from a row's step time (figures of the step time, not columns:
the columns are the knobs and what was measured of them).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from pipeline_parallel.gpt import GPTConfig, ParallelConfig, model_flops
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

from .autocast_kernels import autocast_kernels_priced
from .candidates import REJECT_REASONS, SearchSpace, enumerate_candidates
from .memory import MEMORY_HEADROOM, usable_memory_bytes
from .precision import precision_policy
from .layer_cost import trace_stage_pieces
from .screen import peak_memory_bytes, screen_estimate
from .simulation import fp8_gemm, simulate_gpt

__all__ = ["plan_gpt", "throughput", "COLUMNS", "MIN_REPLAYED", "REPLAY_TIMEOUT_S",
           "REJECT_REASONS"]

MIN_REPLAYED = 10          # the issue: at least the top K, and at least 10, are replayed
REPLAY_TIMEOUT_S = 900.0   # one replay of up to 6,144 GPUs takes < 30 s; far beyond that is a hang

COLUMNS = ("tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "microbatches", "schedule",
           "virtual_stages", "first_stage_layers", "last_stage_layers",
           "sequence_parallel", "recompute", "distributed_optimizer", "zero_stage", "step_time_s",
           "tflops_per_gpu", "mfu", "peak_memory_gb", "compute_comm_ratio", "replayed", "screen_step_time_s")


def _knobs(par: ParallelConfig) -> dict:
    return {"tp": par.tp, "pp": par.pp, "dp": par.dp, "cp": par.cp, "ep": par.ep,
            "etp": par.etp,
            "micro_batch": par.micro_batch,
            "microbatches": par.microbatches, "schedule": par.schedule,
            "virtual_stages": par.chunks, "first_stage_layers": par.first_stage_layers,
            "last_stage_layers": par.last_stage_layers,
            "sequence_parallel": par.sequence_parallel,
            "recompute": par.recompute, "distributed_optimizer": par.distributed_optimizer,
            "zero_stage": par.zero_stage}


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
    config, par, hardware, precision, fp8 = args
    r = simulate_gpt(config, par, hardware, precision=precision, fp8=fp8)
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


def _run_replays(config, pars, hardware, workers: int, bar, precision, fp8) -> list[dict]:
    """Replay ``pars`` on ``workers`` processes (in this one when 1 or a pool fails)."""
    task = bar.add_task("candidates replayed", total=len(pars)) if bar else None
    jobs = [(config, p, hardware, precision, fp8) for p in pars]

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


def _screen_all(config, candidates, hw, bar, precision, fp8, attention) -> list:
    costs = HardwareCostModel(hw, fp8_gemms=fp8_gemm if fp8 else None,
                              flash_v1=attention == "flash-v1")
    autocast = autocast_kernels_priced(precision, costs)     # as the replays will
    fused = autocast and precision.inductor_fusion
    pieces: dict = {}
    task = bar.add_task("candidates screened", total=len(candidates)) if bar else None
    out = []
    for par in candidates:
        key = (par.tp, par.micro_batch, par.sequence_parallel, par.recompute)
        cp_key = (par.cp, par.cp_algorithm) if par.cp > 1 else ()
        key = key + cp_key + (par.ep, par.etp, par.moe_dispatcher, par.attention,
                              par.use_async_grad_reduce)
        if key not in pieces:
            pieces[key] = trace_stage_pieces(config, *key[:4], costs, *cp_key, ep=par.ep,
                                             attention=par.attention, autocast_kernels=autocast,
                                             inductor_fusion=fused,
                                             async_grad_reduce=par.use_async_grad_reduce,
                                             etp=par.etp, moe_dispatcher=par.moe_dispatcher)
        out.append(screen_estimate(config, par, pieces[key], hw))
        if bar:
            bar.advance(task)
    return out


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
             config: GPTConfig | None = None):
    """Plan the parallel configuration of a GPT (see the module docstring).

    The model: ``config`` (a :class:`~pipeline_parallel.gpt.GPTConfig`, e.g.
    ``GPTConfig.of_model("qwen3-235b-a22b", seq=4096, timing_only=True)``: every field of
    it, fine-grained MoE and attention variants included), or the keywords ``hidden``,
    ``layers``, ``heads``, ``seq``, ``vocab`` and the architecture and MoE keywords below
    (not both).

    ``top``: rows the caller shows (at least that many are replayed); ``replay``: how many
    of the screen's best are replayed (default max(top, 10); 0 = screen only);
    ``max_tp`` default the GPUs per node; ``micro_batches`` an explicit list, else the
    divisors of B/dp up to ``max_micro_batch`` (8); ``schedules``, ``recompute``,
    ``sequence_parallel``: restrict the choices; ``workers``: replay processes (default
    the machine's cores); ``progress``: a progress bar (True; default None: when stderr is a
    tty; False: none) or a progress object used as given (rich's ``Progress`` calls:
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
    dp).
    ``zero_stages``: the ZeRO stages searched (default all of 0-3; not with
    ``distributed_optimizer``, which means ``(1,)`` / ``(0,)``); each candidate takes the
    lowest of them that fits (:mod:`~vcluster.planner.candidates`), the DataFrame's
    ``zero_stage`` (``distributed_optimizer`` is ``zero_stage >= 1``). ``precision``: the
    memory model's :class:`~vcluster.planner.precision.PrecisionPolicy` or a preset's name
    (default "megatron"; the DataFrame's ``attrs["precision"]``). ``fp8``: every candidate's
    transformer-layer linear GEMMs priced in FP8 (:func:`~.simulation.fp8_gemm`; hardware
    with an FP8 peak; ``attrs["fp8"]``). ``grad_reduce_dtype``: every candidate's
    :attr:`~pipeline_parallel.gpt.ParallelConfig.grad_reduce_dtype` ("model", the default:
    16-bit reductions, or "fp32"; ``attrs["grad_reduce_dtype"]``). ``attrs["attention"]``:
    ``attention``.
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
    if not isinstance(fp8, bool):
        raise ValueError(f"plan_gpt: fp8 must be True or False, got {fp8!r}")
    hw = load_hardware(hardware)
    space = SearchSpace(
        max_tp=max_tp or hw.gpus_per_node, micro_batches=micro_batches,
        **{k: v for k, v in (("max_micro_batch", max_micro_batch), ("schedules", schedules),
                             ("max_virtual_stages", max_virtual_stages),
                             ("recompute", recompute),
                             ("sequence_parallel", sequence_parallel)) if v is not None},
        attention=attention, tp_overlap=tp_overlap, grad_reduce_dtype=grad_reduce_dtype,
        distributed_optimizer=distributed_optimizer, max_cp=max_cp,
        cp_algorithm=cp_algorithm, max_ep=max_ep, zero_stages=zero_stages,
        precision=precision)
    limit = usable_memory_bytes(hw.device.hbm_bytes, memory_headroom)
    candidates, rejected = enumerate_candidates(config, gpus, global_batch, space, limit)
    n_replay = min(len(candidates), max(top, MIN_REPLAYED) if replay is None else replay)
    bar = _progress(progress)
    if bar:
        bar.start()
    try:
        estimates = _screen_all(config, candidates, hw, bar, precision, fp8, attention)
        order = sorted(range(len(candidates)), key=lambda i: estimates[i].step_time_s)
        replayed = _run_replays(config, [candidates[i] for i in order[:n_replay]], hw,
                                workers or os.cpu_count() or 1, bar, precision, fp8)
    finally:
        if bar:
            bar.stop()
    rows = []
    for k, i in enumerate(order):
        par, est = candidates[i], estimates[i]
        figures = replayed[k] if k < n_replay else {
            "step_time_s": est.step_time_s, "tflops_per_gpu": est.tflops_per_gpu,
            "mfu": est.mfu, "peak_memory_gb": peak_memory_bytes(config, par, precision) / 1e9,
            "compute_comm_ratio": est.compute_comm_ratio}
        rows.append(_knobs(par) | figures | {"replayed": k < n_replay,
                                             "screen_step_time_s": est.step_time_s})
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    if len(df):
        df = df.sort_values(["replayed", "step_time_s"], ascending=[False, True],
                            kind="stable").reset_index(drop=True)
    df.attrs.update(config=config, rejected=dict(sorted(rejected.items())), replayed=n_replay,
                    candidates=len(candidates), hardware=hw.name, gpus=gpus,
                    global_batch=global_batch,
                    memory_limit_gb=limit / 1e9, memory_headroom=memory_headroom,
                    precision=precision.name, fp8=fp8, grad_reduce_dtype=grad_reduce_dtype,
                    attention=attention, planning_time_s=time.perf_counter() - t0)
    return df
