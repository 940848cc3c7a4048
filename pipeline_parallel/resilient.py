"""Training that survives a lost device: checkpoints every K steps, faults, recovery.

``MLP.fit(cluster, X, Y, steps, microbatches, checkpoint_every=K, checkpoint_dir=DIR,
faults=[...], recovery="restart")`` runs here. The run is cut into segments that end on
multiples of K (one ``cluster.run`` of :func:`~pipeline_parallel.executor.train_program`
each, which starts from the state the host hands in: parameters, optimizer slots and
step count, global step number). After each segment the host assembles the full
training state and writes a checkpoint (:mod:`pipeline_parallel.checkpoint`).

Faults (:mod:`vcluster.runtime.faults`): a :class:`~vcluster.runtime.faults.CrashFault`
kills its device process at the start of its step, once; slow devices and links are injected
into the cluster for the duration of the fit.

Recovery when a device is lost (:class:`~vcluster.runtime.errors.DeviceLostError`):

* ``"restart"``: ``cluster.restart()`` replaces the processes, the newest checkpoint is
  read back from disk (verified) — or the initial state when none was written yet — and
  training continues. The steps since that checkpoint are recomputed with the same
  inputs in the same order, so the final parameters equal a fault-free run bit for bit.
* ``"fail"``: raise :class:`TrainingInterrupted`, naming the checkpoint to resume from
  (``MLP.fit(..., resume_from=DIR)`` or ``vcluster run FILE --resume DIR``).

Data: by default the full batch every step (data position after N steps: N x batch
samples; no random numbers drawn, the RNG state is None). With ``batch_size`` each step
trains on a mini-batch of :class:`~pipeline_parallel.sampler.BatchSampler` (shuffled
epochs); the host draws a segment's batches before it runs, and the sampler's state
(generator state at the epoch's start, epoch, position) is in every checkpoint, so a
resumed or recovered run trains on exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from vcluster.runtime.errors import DeviceLostError, VClusterError
from vcluster.runtime.faults import CrashFault, parse_faults

from .checkpoint import TrainingState, latest_checkpoint, load_checkpoint, save_checkpoint
from .executor import TrainJob, train_program
from .optim import Optimizer

__all__ = ["Recovery", "TrainingInterrupted", "RECOVERY_POLICIES", "fit_resilient"]

RECOVERY_POLICIES = ("restart", "fail")
_EXTRA_RESTARTS = 3       # unplanned device losses tolerated beyond the injected crashes


class TrainingInterrupted(VClusterError):
    """A device was lost under ``recovery="fail"``; ``checkpoint`` is where to resume."""

    def __init__(self, message: str, checkpoint: str | None, step: int):
        self.checkpoint, self.step = checkpoint, step
        super().__init__(message)


@dataclass(frozen=True)
class Recovery:
    """One recovery: ``rank`` was lost during the segment starting at ``segment_start``
    (at ``lost_at_step`` when it was an injected crash); training resumed from
    ``resumed_from_step`` (read from ``checkpoint``, None: the initial state)."""

    rank: int
    lost_at_step: int | None
    segment_start: int
    resumed_from_step: int
    checkpoint: str | None
    restart_s: float

    def to_dict(self) -> dict:
        return {"rank": self.rank, "lost_at_step": self.lost_at_step,
                "segment_start": self.segment_start,
                "resumed_from_step": self.resumed_from_step, "checkpoint": self.checkpoint,
                "restart_s": self.restart_s}


def fingerprint(mlp, job: TrainJob, samples: int, batch_size, data_seed) -> dict:
    """What identifies a run: a checkpoint restores only into the same one."""
    o = job.optimizer
    return {"model": repr(mlp), "dtype": mlp.dtype.str, "optimizer": o.name, "lr": o.lr,
            "momentum": o.momentum, "betas": list(o.betas), "eps": o.eps,
            "samples": int(samples), "batch_size": batch_size,
            "data_seed": None if batch_size is None else data_seed}


def _initial_state(mlp, job: TrainJob, fp: dict, sampler=None) -> TrainingState:
    params = tuple(mlp.init_params())
    flat = [a for pair in params for a in pair]
    opt = Optimizer(job.optimizer, flat)
    slots = tuple(tuple((s[2 * l], s[2 * l + 1]) for l in range(len(params)))
                  for s in opt.state)
    return TrainingState(step=0, params=params, optimizer_t=0, optimizer_slots=slots,
                         losses=np.zeros(0), fingerprint=fp,
                         rng_state=None if sampler is None else sampler.state.to_dict())


def _check_policy(checkpoint_every, checkpoint_dir, recovery) -> int | None:
    if recovery not in RECOVERY_POLICIES:
        raise ValueError(f"recovery: {recovery!r} is not a policy; allowed: "
                         f"{', '.join(RECOVERY_POLICIES)}")
    if checkpoint_every is None:
        return None
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, np.integer)) \
            or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every: must be a positive int number of steps, got "
                         f"{checkpoint_every!r}")
    if checkpoint_dir is None:
        raise ValueError("checkpoint_dir: needed with checkpoint_every (where checkpoints go)")
    return int(checkpoint_every)


def fit_resilient(mlp, cluster, plan, job: TrainJob, X, Y, *, checkpoint_every=None,
                  checkpoint_dir=None, faults=(), recovery: str = "fail", resume_from=None,
                  batch_size=None, data_seed: int = 0, on_segment=None):
    """Train ``job`` (its params/steps describe the whole run) as the module describes.

    Returns the :class:`~pipeline_parallel.mlp.FitResult` of the whole run, with
    ``recoveries`` and ``checkpoints`` filled in. ``on_segment(first_step, end_step,
    recovery)``, when given, is called after each segment that completes (steps
    ``first_step .. end_step - 1``), before its checkpoint is written; ``recovery`` is the
    :class:`Recovery` the segment resumed after, or None. A caller reads the cluster's
    events there: a restart replaces the processes and every event they recorded.
    """
    every = _check_policy(checkpoint_every, checkpoint_dir, recovery)
    faults = parse_faults(faults, "faults", cluster.mesh.size)
    crashes = {(f.rank, f.at_step) for f in faults if isinstance(f, CrashFault)}
    degraded = tuple(f for f in faults if not isinstance(f, CrashFault))
    fp = fingerprint(mlp, job, len(X), batch_size, data_seed)
    data = None if batch_size is None else (len(X), batch_size, data_seed)
    state = (load_checkpoint(resume_from, fp) if resume_from is not None
             else _initial_state(mlp, job, fp, _sampler(data, None)))
    if state.step > job.steps:
        raise ValueError(f"resume_from: the checkpoint is at step {state.step}, beyond "
                         f"steps={job.steps}")
    previous = cluster.faults
    if degraded:
        cluster.inject_faults(degraded)
    recoveries, written, fit = [], [], None
    last = None if resume_from is None else _checkpoint_path(resume_from)
    resumed_after = None          # the recovery the next segment resumes after
    try:
        while state.step < job.steps or fit is None:
            end = job.steps if every is None else min(job.steps, (state.step // every + 1) * every)
            first = state.step
            try:
                fit, state = _segment(mlp, cluster, plan, job, X, Y, state, end, crashes, data)
            except DeviceLostError as exc:
                fired = _fired(crashes, exc.rank, state.step, end)
                crashes.discard(fired)
                resume = _recover(exc, fired, state, recovery, last, checkpoint_dir,
                                  len(recoveries), len(faults), cluster, fp, mlp, job, data)
                recoveries.append(resume[1])
                state, resumed_after = resume[0], resume[1]
                continue
            if on_segment is not None:
                on_segment(first, end, resumed_after)
            resumed_after = None
            if every is not None and (state.step % every == 0 or state.step == job.steps):
                last = save_checkpoint(checkpoint_dir, state)
                written.append(last)
    finally:
        if degraded:                      # withdrawn (on a broken cluster: from its restart)
            cluster.inject_faults(previous)
    from .mlp import FitResult
    return FitResult(np.asarray(state.losses), [tuple(p) for p in state.params], fit.memory,
                     recoveries=tuple(recoveries), checkpoints=tuple(written))


def _sampler(data, state: TrainingState | None):
    """The batch sampler of ``data`` = (samples, batch_size, seed) at ``state`` (None:
    full-batch training)."""
    if data is None:
        return None
    from .sampler import BatchSampler, SamplerState
    saved = None if state is None or state.rng_state is None else \
        SamplerState.from_dict(state.rng_state)
    return BatchSampler(*data, state=saved)


def _segment(mlp, cluster, plan, job: TrainJob, X, Y, state: TrainingState, end: int, crashes,
             data):
    """Run steps ``state.step .. end-1`` from ``state``; return (FitResult, new state)."""
    import dataclasses
    seg = dataclasses.replace(
        job, params=tuple(state.params), steps=end - state.step, first_step=state.step,
        optimizer_state=(state.optimizer_t, state.optimizer_slots), return_optimizer=True,
        crash_at=tuple(sorted(crashes)))
    sampler = _sampler(data, state)
    if sampler is not None:                   # this segment's mini-batches, in order
        X, Y = sampler.batches(X, Y, end - state.step)
        seg = dataclasses.replace(seg, per_step_data=True)
    results = cluster.run(train_program, plan.device_args(seg, X, Y))
    fit = plan.collect(mlp, results)
    holder = next(r for r in results if r["optimizer"] is not None)
    slots = tuple(tuple(plan.assemble(lambda r, k=k: results[r]["optimizer"]["slots"][k]))
                  for k in range(len(holder["optimizer"]["slots"])))
    losses = np.concatenate([state.losses, np.asarray(fit.losses if fit.losses is not None
                                                      else [], dtype=np.float64)])
    new = TrainingState(
        step=end, params=tuple(fit.params), optimizer_t=holder["optimizer"]["t"],
        optimizer_slots=slots, losses=losses, fingerprint=state.fingerprint,
        data_position=end * job.global_batch if sampler is None else sampler.data_position,
        rng_state=None if sampler is None else sampler.state.to_dict())
    return fit, new


def _fired(crashes: set, rank: int, start: int, end: int):
    """The injected crash that killed ``rank`` in steps [start, end), if any."""
    mine = sorted(s for r, s in crashes if r == rank and start <= s < end)
    return (rank, mine[0]) if mine else None


def _checkpoint_path(path: str) -> str:
    """A ``step-N`` checkpoint directory as given, or the newest one under a directory."""
    return latest_checkpoint(path) or path


def _recover(exc, fired, state, recovery, ckpt, checkpoint_dir, n_recovered, n_faults,
             cluster, fp, mlp, job, data):
    """Apply the recovery policy after a lost device: (state to resume, Recovery)."""
    where = f"step {fired[1]}" if fired else f"steps {state.step}.."
    if recovery == "fail":
        hint = (f"resume from checkpoint {ckpt} (MLP.fit(..., resume_from={ckpt!r}) or "
                f"vcluster run FILE --resume {checkpoint_dir or ckpt})" if ckpt else
                "no checkpoint was written yet; rerun from the start (or set checkpoint_every)")
        raise TrainingInterrupted(f"rank {exc.rank} was lost at {where} ({exc.how}); "
                                  f"recovery='fail': {hint}", ckpt, state.step) from exc
    if n_recovered >= n_faults + _EXTRA_RESTARTS:
        raise TrainingInterrupted(f"rank {exc.rank} was lost at {where}; gave up after "
                                  f"{n_recovered} recoveries; resume from {ckpt}",
                                  ckpt, state.step) from exc
    t0 = time.perf_counter()
    cluster.restart()
    restart_s = time.perf_counter() - t0
    resumed = load_checkpoint(ckpt, fp) if ckpt else _initial_state(mlp, job, fp,
                                                                    _sampler(data, None))
    return resumed, Recovery(exc.rank, fired[1] if fired else None, state.step,
                             resumed.step, ckpt, restart_s)
