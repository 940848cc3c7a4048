"""``kind: mlp``: :class:`pipeline_parallel.MLP` trained for ``run.steps`` steps with a
pipeline schedule on a (dp x) pp (x tp) mesh — the executor's per-device
``train_program``, the same program ``MLP.fit`` runs.

Data from the seed: X ~ N(0, 1) of shape (batch, sizes[0]); Y ~ N(0, 1) (batch,
sizes[-1]) for mse, class labels in [0, sizes[-1]) for cross_entropy. The reference is
``MLP.fit_reference`` (full-batch training in one process): the per-step losses
(``loss``) and every final parameter (``W{l}``, ``b{l}``) must match.

``data_parallel`` picks how the dp replicas combine gradients: ``ddp`` all-reduces them;
``zero`` runs the same program with the job's ``zero_stage`` (ZeRO-1/2/3 over dp);
``ps`` runs :func:`pipeline_parallel.parameter_server.parameter_server_program` instead,
as :meth:`MLP.fit_parameter_server` does, on one mesh axis ``ps``: the first
``data_parallel.servers`` ranks hold the parameters, the ``parallel.dp`` workers after
them each take an equal slice of the batch (``parallel.schedule`` and ``microbatches``
do not apply). Its losses are summed over the workers and its parameters read from the
servers; synchronous, it equals the same reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from pipeline_parallel import MLP
from pipeline_parallel.executor import TrainJob, train_program
from pipeline_parallel.mlp import layer_specs
from pipeline_parallel.optim import OptimizerConfig
from pipeline_parallel.parameter_server import (ParameterServerJob, assign_tensors,
                                                mlp_worker_stage, parameter_server_program)
from pipeline_parallel.parameter_server import assemble as assemble_ps
from pipeline_parallel.plan import AXES, plan_training
from vcluster.runtime.tracing import MetaArray, meta_like

from ..choices import DataParallelMode
from ..errors import ScenarioError
from .base import Workload

__all__ = ["validate", "build"]


def _mlp(scenario):
    w, o = scenario.workload, scenario.workload.options
    return MLP(o["sizes"], activation=o["activation"], loss=o["loss"], seed=w.seed,
               dtype=w.dtype)


def validate(scenario, mesh) -> None:
    par, o = scenario.parallel, scenario.workload.options
    if scenario.data_parallel.mode == DataParallelMode.PS:
        return _validate_ps(scenario, mesh)
    unknown = [a for a in mesh.axes if a not in AXES]
    if unknown or "pp" not in mesh.axes:
        raise ScenarioError("cluster.mesh", dict(mesh.shape), "axes among dp, pp, tp, "
                            "with pp", "an MLP pipeline runs on a (dp x) pp (x tp) mesh")
    interleaved = par["schedule"] == "interleaved_1f1b"
    if par.get("virtual_stages") is not None and not interleaved and par["virtual_stages"] != 1:
        raise ScenarioError("parallel.virtual_stages", par["virtual_stages"],
                            "1, or a schedule interleaved_1f1b",
                            f"schedule {par['schedule']} has one stage per rank")
    v = par.get("virtual_stages") or (2 if interleaved else 1)
    stages, layers = mesh.shape["pp"] * v, len(o["sizes"]) - 1
    if layers % stages:
        raise ScenarioError("workload.sizes", list(o["sizes"]),
                            f"a number of layers (len(sizes) - 1) that is a multiple of "
                            f"{stages}", f"{layers} layers do not split into pp="
                            f"{mesh.shape['pp']} x {v} stages")
    dp, m = mesh.shape.get("dp", 1), par["microbatches"]
    if o["batch"] % (dp * m):
        raise ScenarioError("workload.batch", o["batch"], f"a multiple of {dp * m}",
                            f"the batch splits into dp={dp} x microbatches={m}")
    if "tp" in mesh.axes:
        tp = mesh.shape["tp"]
        for spec in (s for st in layer_specs(_mlp(scenario), stages, True) for s in st):
            width = spec.fan_in if spec.kind == "row" else spec.fan_out
            if spec.kind != "dense" and width % tp:
                raise ScenarioError(f"workload.sizes[{spec.index + (spec.kind != 'row')}]",
                                    width, f"a multiple of tp={tp}",
                                    f"layer {spec.index} is {spec.kind}-parallel over tp")


def _validate_ps(scenario, mesh) -> None:
    """The parameter server's rules (its mesh, pp and tp are the parser's
    :func:`~vcluster.scenario.semantics.resolve_mesh` and ``check_data_parallel``)."""
    o, servers = scenario.workload.options, scenario.data_parallel.servers
    workers, tensors = mesh.size - servers, 2 * (len(o["sizes"]) - 1)
    if servers > tensors:
        raise ScenarioError("data_parallel.servers", servers, f"at most {tensors} (the "
                            f"W and b of {tensors // 2} layers)",
                            "each parameter tensor lives on one server")
    if o["batch"] % workers:
        raise ScenarioError("workload.batch", o["batch"], f"a multiple of {workers}",
                            f"the batch splits into {workers} workers' slices")


def _data(scenario):
    w, o = scenario.workload, scenario.workload.options
    rng = np.random.default_rng([w.seed, 1])
    X = rng.standard_normal((o["batch"], o["sizes"][0]))
    if o["loss"] == "mse":
        Y = rng.standard_normal((o["batch"], o["sizes"][-1]))
    else:
        Y = rng.integers(0, o["sizes"][-1], o["batch"])
    return X, Y


def _named(fit) -> dict:
    """A fit's per-step losses (``loss``) and parameters (``W{l}``, ``b{l}``)."""
    out = {"loss": np.asarray(fit.losses)}
    for l, (wt, b) in enumerate(fit.params):
        out[f"W{l}"], out[f"b{l}"] = wt, b
    return out


def _meta_params(mlp) -> tuple:
    return tuple((MetaArray((i, j), mlp.dtype), MetaArray((j,), mlp.dtype))
                 for i, j in zip(mlp.sizes[:-1], mlp.sizes[1:]))


def build(scenario, mesh) -> Workload:
    par, o, steps = scenario.parallel, scenario.workload.options, scenario.run.steps
    mlp = _mlp(scenario)
    X, Y = _data(scenario)
    X, Y = mlp._check_data(X, Y)
    if scenario.data_parallel.mode == DataParallelMode.PS:
        return _build_ps(scenario, mesh, mlp, X, Y)
    plan = plan_training(mlp, mesh, len(X), par["microbatches"], par["schedule"],
                         par.get("virtual_stages"))
    simulate_only = scenario.run.mode == "simulate"      # shapes only, no parameters
    params = _meta_params(mlp) if simulate_only else tuple(mlp.init_params())
    zero_stage = scenario.data_parallel.zero_stage        # 0 unless data_parallel.mode zero
    job = TrainJob(params=params, specs=plan.stage_specs,
                   actions=plan.actions, loss=mlp.loss,
                   optimizer=OptimizerConfig(o["optimizer"], o["lr"]), steps=steps,
                   microbatches=par["microbatches"], global_batch=len(X), pp_axis="pp",
                   dp_axis=plan.dp_axis, tp_axis=plan.tp_axis, zero_stage=zero_stage)
    if simulate_only:
        args, metas = (), tuple(plan.device_args(job, meta_like(X), meta_like(Y)))
    else:
        args = tuple(plan.device_args(job, X, Y))
        meta_job = dataclasses.replace(job, params=tuple((meta_like(wt), meta_like(b))
                                                         for wt, b in job.params))
        metas = tuple((meta_job,) + tuple(None if a is None else meta_like(a) for a in rest)
                      for _, *rest in args)

    def assemble(results):
        return _named(plan.collect(mlp, list(results)))     # ZeRO shards unsharded there

    def reference():
        return _named(mlp.fit_reference(X, Y, steps, optimizer=o["optimizer"], lr=o["lr"]))

    def fit(engine, **resilience):
        """``MLP.fit`` of the same job, with checkpoints / faults / recovery."""
        return mlp.fit(engine, X, Y, steps, par["microbatches"], schedule=par["schedule"],
                       optimizer=o["optimizer"], lr=o["lr"],
                       virtual_stages=par.get("virtual_stages"), **resilience)

    zero = f", ZeRO-{zero_stage} over dp" if zero_stage else ""
    return Workload("mlp", mesh, train_program, args, metas, str(mlp.dtype), assemble,
                    reference, training=True, fit=fit, fit_outputs=_named,
                    description=f"{mlp!r}, {par['schedule']}, {par['microbatches']} "
                                f"micro-batches{zero}")


def _build_ps(scenario, mesh, mlp, X, Y) -> Workload:
    """The parameter server's workload: the job and per-rank arguments
    :meth:`MLP.fit_parameter_server` makes, the shape-only twin, and the reference."""
    o, steps, dp = scenario.workload.options, scenario.run.steps, scenario.data_parallel
    servers = dp.servers
    workers = mesh.size - servers
    simulate_only = scenario.run.mode == "simulate"      # shapes only, no parameters
    meta_tensors = tuple(a for pair in _meta_params(mlp) for a in pair)
    tensors = meta_tensors if simulate_only else tuple(
        a for pair in mlp.init_params() for a in pair)
    job = ParameterServerJob(
        tensors=tensors, worker_stage=mlp_worker_stage(mlp), loss=mlp.loss,
        optimizer=OptimizerConfig(o["optimizer"], o["lr"]), steps=steps,
        global_batch=len(X), servers=servers, workers=workers,
        owner=assign_tensors([a.nbytes for a in tensors], servers),
        staleness=dp.staleness)
    rows = len(X) // workers
    slices = [(X[w * rows:(w + 1) * rows], Y[w * rows:(w + 1) * rows])
              for w in range(workers)]
    meta_job = dataclasses.replace(job, tensors=meta_tensors)
    metas = tuple([(meta_job, None, None)] * servers
                  + [(meta_job, meta_like(x), meta_like(y)) for x, y in slices])
    args = () if simulate_only else tuple([(job, None, None)] * servers
                                          + [(job, x, y) for x, y in slices])

    def assemble(results):
        losses, flat = assemble_ps(job, results)
        out = {"loss": losses}
        for l in range(mlp.n_layers):
            out[f"W{l}"], out[f"b{l}"] = flat[2 * l], flat[2 * l + 1]
        return out

    def reference():
        return _named(mlp.fit_reference(X, Y, steps, optimizer=o["optimizer"], lr=o["lr"]))

    sync = "synchronous" if not dp.staleness else f"asynchronous, staleness {dp.staleness}"
    s = "" if servers == 1 else "s"
    return Workload("mlp", mesh, parameter_server_program, args, metas, str(mlp.dtype),
                    assemble, reference, training=True, fit_outputs=_named,
                    roles=("server",) * servers + ("worker",) * workers,
                    updates_per_step=workers if dp.staleness else 1,
                    description=f"{mlp!r}, parameter server: {servers} server{s} + "
                                f"{workers} workers, {sync}")
