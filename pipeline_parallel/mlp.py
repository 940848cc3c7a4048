"""``MLP``: a stack of dense layers trained with pipeline (x data x tensor) parallelism.

>>> mlp = MLP([16, 64, 64, 64, 8], activation="relu", loss="mse", seed=0)
>>> run = mlp.fit(cluster, X, Y, steps=5, microbatches=6, schedule="1f1b",
...               optimizer="sgd", lr=0.05)                             # doctest: +SKIP
>>> ref = mlp.fit_reference(X, Y, steps=5, optimizer="sgd", lr=0.05)   # doctest: +SKIP

Both start from the parameters the seed gives (W_l ~ N(0, 2/fan_in), b_l ~ N(0, 0.01))
and never change the MLP object. ``fit`` needs a mesh axis ``pp`` (p ranks) and may
have ``dp`` (data-parallel replicas, each with its slice of the batch) and ``tp``
(tensor parallelism inside the stages); the layers split evenly into p·v stages (v
virtual stages per rank for ``interleaved_1f1b``), stage s on pipeline rank s mod p, and
the batch splits evenly into dp replicas x ``microbatches``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .executor import TrainJob, train_program
from .functional import ACTIVATIONS, LOSSES, activation, activation_grad, loss_and_grad
from .layers import LayerSpec, layer_kinds
from .optim import Optimizer, OptimizerConfig
from .parameter_server import ParameterServerFit
from mesh.arguments import as_int

__all__ = ["MLP", "FitResult", "ParameterServerFit"]


@dataclass(frozen=True)
class FitResult:
    """Per-step losses (full-batch means), final (W, b) per layer, per-device memory;
    with checkpoints or faults (:mod:`pipeline_parallel.resilient`), the recoveries made
    and the checkpoints written."""

    losses: np.ndarray
    params: list
    memory: object = None          # pandas DataFrame (fit only)
    recoveries: tuple = ()         # resilient.Recovery, in order
    checkpoints: tuple = ()        # paths of the checkpoints written, in order

    def __repr__(self) -> str:
        extra = (f", recoveries={len(self.recoveries)}" if self.recoveries else "") + \
            (f", checkpoints={len(self.checkpoints)}" if self.checkpoints else "")
        return (f"FitResult(losses={np.array2string(self.losses, precision=6)}, "
                f"layers={len(self.params)}{extra})")


class MLP:
    """Dense layers of widths ``sizes`` (sizes[0] inputs ... sizes[-1] outputs)."""

    def __init__(self, sizes, activation: str = "relu", loss: str = "mse", seed: int = 0,
                 dtype=np.float64):
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"MLP: sizes must list at least 2 positive widths, got {sizes}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if loss not in LOSSES:
            raise ValueError(f"MLP: loss must be one of {LOSSES}, got {loss!r}")
        self.sizes, self.activation, self.loss = tuple(sizes), activation, loss
        self.seed, self.dtype = seed, np.dtype(dtype)

    def __repr__(self) -> str:
        return (f"MLP(sizes={list(self.sizes)}, activation={self.activation!r}, "
                f"loss={self.loss!r}, seed={self.seed})")

    @property
    def n_layers(self) -> int:
        return len(self.sizes) - 1

    def init_params(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Fresh parameters from the seed (the same on every call)."""
        rng = np.random.default_rng(self.seed)
        out = []
        for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:]):
            w = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
            b = rng.standard_normal(fan_out) * 0.1
            out.append((w.astype(self.dtype), b.astype(self.dtype)))
        return out

    def _act(self, layer: int):
        return None if layer == self.n_layers - 1 else self.activation

    # --- single-process reference ---------------------------------------------------------
    def fit_reference(self, X, Y, steps: int, optimizer: str = "sgd", lr: float = 0.01,
                      momentum: float = 0.9, betas=(0.9, 0.999), eps: float = 1e-8, *,
                      batch_size: int | None = None, data_seed: int = 0) -> FitResult:
        """Training in this process with numpy: the ground truth for ``fit``. Full-batch,
        or with ``batch_size`` the mini-batches of :class:`~pipeline_parallel.sampler.
        BatchSampler` (``data_seed``), as ``fit`` draws them."""
        X_all, Y_all = self._check_data(X, Y)
        sampler = None
        if batch_size is not None:
            from .sampler import BatchSampler
            sampler = BatchSampler(len(X_all), as_int(batch_size, "batch_size", 1), data_seed)
        params = [[w.copy(), b.copy()] for w, b in self.init_params()]
        flat = [a for pair in params for a in pair]
        opt = Optimizer(OptimizerConfig(optimizer, lr, momentum, tuple(betas), eps), flat)
        losses = []
        for _ in range(as_int(steps, "steps", 1)):
            if sampler is None:
                X, Y = X_all, Y_all
            else:
                idx = sampler.next_indices()
                X, Y = X_all[idx], Y_all[idx]
            xs, zs, x = [], [], X
            for l, (w, b) in enumerate(params):
                z = x @ w + b
                xs.append(x)
                zs.append(z)
                x = activation(self._act(l), z) if self._act(l) else z
            loss, grad = loss_and_grad(self.loss, x, Y, len(X))
            grads = []
            for l in reversed(range(self.n_layers)):
                dz = activation_grad(self._act(l), zs[l], grad) if self._act(l) else grad
                grads = [xs[l].T @ dz, dz.sum(axis=0)] + grads
                grad = dz @ params[l][0].T
            opt.step(flat, grads)
            losses.append(loss)
        return FitResult(np.array(losses), [(w, b) for w, b in params])

    def _check_data(self, X, Y):
        X, Y = np.asarray(X, dtype=self.dtype), np.asarray(Y)
        if X.ndim != 2 or X.shape[1] != self.sizes[0]:
            raise ValueError(f"MLP: X must have shape (batch, {self.sizes[0]}), got {X.shape}")
        if self.loss == "mse" or Y.ndim == 2:
            Y = Y.astype(self.dtype)
            if Y.shape != (len(X), self.sizes[-1]):
                raise ValueError(f"MLP: Y must have shape ({len(X)}, {self.sizes[-1]}), "
                                 f"got {Y.shape}")
        elif Y.shape != (len(X),):
            raise ValueError(f"MLP: class labels Y must have shape ({len(X)},), got {Y.shape}")
        return X, Y

    # --- pipelined training on a cluster ---------------------------------------------------
    def fit(self, cluster, X, Y, steps: int, microbatches: int, schedule: str = "1f1b",
            optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.9,
            betas=(0.9, 0.999), eps: float = 1e-8, virtual_stages: int | None = None,
            bucket_bytes: int = 1 << 20, action_costs: dict | None = None, *,
            checkpoint_every: int | None = None, checkpoint_dir: str | None = None,
            faults=None, recovery: str = "fail", resume_from: str | None = None,
            batch_size: int | None = None, data_seed: int = 0,
            zero_stage: int = 0, on_segment=None) -> FitResult:
        """Train on ``cluster`` following ``schedule``; see the module docstring.

        ``zero_stage``: 0 all-reduces gradients over dp (DDP); 1, 2, 3 shard the
        optimizer state, + the gradients, + the parameters over dp (ZeRO-1/2/3, FSDP:
        :mod:`pipeline_parallel.zero`; 2 and 3 need pp = 1). The results' ``memory``
        (and ``cluster.stats()``) carry each rank's peak parameter, gradient, optimizer
        and activation bytes.

        ``checkpoint_every`` steps a checkpoint goes to ``checkpoint_dir``; ``faults``
        (:mod:`vcluster.runtime.faults` specs or their dicts) are injected; a lost device is
        handled by ``recovery`` ("restart" or "fail"); ``resume_from`` (a checkpoint or a
        directory of them) continues a run. See :mod:`pipeline_parallel.resilient`.
        ``batch_size``: train on mini-batches of that many samples, drawn in shuffled
        epochs (:class:`~pipeline_parallel.sampler.BatchSampler`, seed ``data_seed``)
        instead of the full batch; the sampler's state is part of every checkpoint.
        ``on_segment(first_step, end_step, recovery)``: called after each completed
        segment of such a run (:func:`~pipeline_parallel.resilient.fit_resilient`).
        """
        from .plan import plan_training
        from .zero import check_zero_stage
        zero_stage = check_zero_stage(zero_stage, "MLP.fit",
                                      cluster.mesh.shape.get("pp", 1))
        X, Y = self._check_data(X, Y)
        batch = len(X) if batch_size is None else as_int(batch_size, "batch_size", 1)
        plan = plan_training(self, cluster.mesh, batch, as_int(microbatches, "microbatches", 1),
                             schedule, virtual_stages)
        job = TrainJob(
            params=tuple(self.init_params()), specs=plan.stage_specs, actions=plan.actions,
            loss=self.loss, optimizer=OptimizerConfig(optimizer, lr, momentum, tuple(betas), eps),
            steps=as_int(steps, "steps", 1), microbatches=microbatches, global_batch=batch,
            pp_axis="pp", dp_axis=plan.dp_axis, tp_axis=plan.tp_axis,
            bucket_bytes=int(bucket_bytes), action_costs=dict(action_costs or {}),
            zero_stage=zero_stage)
        if (checkpoint_every is not None or faults is not None or resume_from is not None
                or recovery != "fail" or batch_size is not None or on_segment is not None):
            if zero_stage:
                raise ValueError(f"MLP.fit: zero_stage={zero_stage} cannot be combined with "
                                 f"checkpoints, faults, recovery, resume_from or batch_size "
                                 f"(their checkpoints hold unsharded optimizer state); "
                                 f"use zero_stage=0 with them")
            from .resilient import fit_resilient
            return fit_resilient(self, cluster, plan, job, X, Y,
                                 checkpoint_every=checkpoint_every,
                                 checkpoint_dir=checkpoint_dir, faults=faults,
                                 recovery=recovery, resume_from=resume_from,
                                 batch_size=batch_size, data_seed=data_seed,
                                 on_segment=on_segment)
        results = cluster.run(train_program, plan.device_args(job, X, Y))
        return plan.collect(self, results)

    def fit_parameter_server(self, cluster, X, Y, steps: int, servers: int = 1,
                             optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.9,
                             betas=(0.9, 0.999), eps: float = 1e-8, staleness: int = 0,
                             replay=None) -> ParameterServerFit:
        """Parameter-server training on ``cluster`` (one mesh axis): its first ``servers``
        ranks hold the parameters, the others are workers, each with an equal slice of
        the batch (:mod:`pipeline_parallel.parameter_server`). ``staleness=0``:
        synchronous, equal to :meth:`fit` with dp = workers (bit for bit with the ``shm``
        all-reduce) and to :meth:`fit_reference` within rounding. ``staleness=s >= 1``:
        asynchronous, each gradient applied as it arrives, workers at most s steps apart;
        ``replay=run.events`` of such a run repeats it exactly."""
        from .parameter_server import fit_parameter_server, make_job, mlp_worker_stage
        X, Y = self._check_data(X, Y)
        job = make_job("MLP.fit_parameter_server", cluster.mesh,
                       [a for pair in self.init_params() for a in pair],
                       mlp_worker_stage(self), loss=self.loss,
                       optimizer=OptimizerConfig(optimizer, lr, momentum, tuple(betas), eps),
                       steps=steps, batch=len(X), servers=servers, staleness=staleness,
                       replay=replay, timeout_s=cluster.options.timeout_s)
        return fit_parameter_server(cluster, job, X, Y,
                                    lambda t: list(zip(t[::2], t[1::2])))


def layer_specs(mlp: MLP, stages: int, tp: bool) -> tuple[tuple[LayerSpec, ...], ...]:
    """The layers of each of ``stages`` stages (consecutive, equal counts)."""
    per = mlp.n_layers // stages
    out = []
    for s in range(stages):
        kinds = layer_kinds(per, tp)
        out.append(tuple(LayerSpec(l, mlp.sizes[l], mlp.sizes[l + 1], kinds[l - s * per],
                                   mlp._act(l)) for l in range(s * per, (s + 1) * per)))
    return tuple(out)
