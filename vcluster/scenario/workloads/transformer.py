"""``kind: transformer``: a GPT or, with ``arch: llama``, a Llama
(:class:`pipeline_parallel.gpt.GPT`) trained for
``run.steps`` steps with Megatron tensor parallelism (``tp``), a pipeline schedule
(``pp``) and data parallelism (``dp``) — the executor's ``train_program`` with GPT stages.

``data_parallel.mode: zero`` runs ZeRO-``zero_stage`` (``ParallelConfig.zero_stage``; the
memory model follows it). ``ps`` runs :func:`pipeline_parallel.parameter_server.
parameter_server_program` instead, as :meth:`GPT.fit_parameter_server
<pipeline_parallel.gpt.GPT.fit_parameter_server>` does (:meth:`GPT.parameter_server_job`),
on one mesh axis ``ps``: the first ``data_parallel.servers`` ranks hold the parameter
tensors, the ``parallel.dp`` workers after them each train the whole model on an equal
slice of the sequences (dense models only; the schedule and micro-batches do not apply).
Its losses are summed over the workers and its parameters read from the servers;
synchronous, it equals the same reference.

Tokens and targets are drawn from the seed, uniform in [0, vocab). The reference is
``GPT.fit_reference`` (the whole model on the whole batch in one process): per-step
losses (``loss``) and every final parameter (by its name) must match. In ``simulate``
mode no real parameters are made (``args_by_rank`` is empty): only the shape-only
arguments the tracer needs, so cluster-scale models cost no memory.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, model_flops
from pipeline_parallel.optim import OptimizerConfig
from pipeline_parallel.parameter_server import assemble as assemble_ps
from pipeline_parallel.parameter_server import device_args as ps_device_args
from pipeline_parallel.parameter_server import parameter_server_program
from vcluster.planner.memory import gpt_memory
from vcluster.planner.simulation import fp8_gemm, gpt_schedule, gpt_step_traces
from vcluster.runtime.tracing import MetaArray, meta_like
from vcluster.timing.attention_kernels import named_kernel

from modeling import ConfigError

from ..choices import DataParallelMode
from ..errors import ScenarioError
from ..hardware import check_fp8
from .base import Workload

__all__ = ["validate", "build"]


def validate(scenario, mesh) -> None:
    """The parser's cross-field rules (once per point; :func:`build` trusts them): the
    model's and the plan's are the model layer's (:class:`~pipeline_parallel.gpt.GPTConfig`,
    :class:`modeling.ParallelConfig` and its ``check`` against the model), each written
    once there and reported here under the key the user wrote."""
    o = scenario.workload.options
    if o.get("gemm_format") is not None:
        if o["fp8"] and o["gemm_format"] != "fp8":
            raise ScenarioError("workload.fp8", True, f"false with workload.gemm_format "
                                f"{o['gemm_format']}", "fp8: true is gemm_format: fp8; give "
                                "one of them")
        check_fp8(scenario, "workload.gemm_format", o["gemm_format"], o["gemm_format"])
    elif o["fp8"]:
        check_fp8(scenario)
    if scenario.data_parallel.mode == DataParallelMode.PS:
        return _validate_ps(scenario, mesh)
    unknown = [a for a in mesh.axes if a not in _AXES]
    if unknown:
        raise ScenarioError("cluster.mesh", dict(mesh.shape), f"axes among {', '.join(_AXES)}",
                            f"unknown axes {unknown} for a transformer")
    with _by_key(scenario):
        config, parallel = _configs(scenario, mesh)
        parallel.check_microbatches()
        parallel.check(config, mesh)


@contextlib.contextmanager
def _by_key(scenario):
    """A :class:`~modeling.ConfigError` inside, raised as a ScenarioError at the scenario
    key the user wrote (:data:`_KEY_PATHS`; a config.json's own key under workload.model)."""
    try:
        yield
    except ConfigError as exc:
        path = _KEY_PATHS.get(exc.field, f"parallel.{exc.field}")
        value = scenario.workload.options["batch"] if exc.field == "microbatches" \
            else exc.value
        if exc.owner not in ("", "ParallelConfig", "GPT", "GPTConfig", "model"):
            path = f"workload.model ({exc.owner}: {exc.field})"
        raise ScenarioError(path, value, exc.allowed, exc.reason) from None


#: a ConfigError field of the plan -> the scenario key a user wrote it under
_KEY_PATHS = {"microbatches": "workload.batch", "global_batch": "workload.batch",
              "zero_stage": "data_parallel.zero_stage", "model": "workload.model",
              **{f: f"workload.{f}" for f in ("hidden", "layers", "heads", "seq", "vocab",
                                               "kv_heads", "ffn_hidden", "head_dim",
                                               "qk_norm", "window", "window_layers",
                                               "attention_sinks", "qkv_bias",
                                               "out_bias", "experts",
                                               "moe_top_k", "moe_ffn_hidden",
                                               "capacity_factor", "arch", "moe_router",
                                               "moe_shared_ffn_hidden",
                                               "moe_routed_scaling", "moe_aux_coef",
                                               "moe_dense_layers", "moe_groups",
                                               "moe_bias_update_rate", "moe_router_bias",
                                               "moe_expert_bias")}}


def _validate_ps(scenario, mesh) -> None:
    """The parameter server's rules (its mesh, pp, tp, cp and ep are the parser's
    :func:`~vcluster.scenario.semantics.resolve_mesh` and ``check_data_parallel``); the
    model's are GPTConfig's."""
    o, servers = scenario.workload.options, scenario.data_parallel.servers
    with _by_key(scenario):
        config = _configs(scenario)[0]
    if config.experts:
        raise ScenarioError("workload.experts", o["experts"], "0 with data_parallel.mode ps",
                            "the parameter server trains dense models (each worker "
                            "holds the whole model)")
    tensors = len(GPT(config).param_shapes())
    if servers > tensors:
        raise ScenarioError("data_parallel.servers", servers, f"at most {tensors} (the "
                            f"model's parameter tensors)",
                            "each parameter tensor lives on one server")
    workers = mesh.size - servers
    if o["batch"] % workers:
        raise ScenarioError("workload.batch", o["batch"], f"a multiple of {workers}",
                            f"the batch splits into {workers} workers' slices")


_AXES = ("dp", "pp", "cp", "ep", "tp")


def _degrees(mesh, etp=None) -> dict:
    """The ParallelConfig degrees of ``mesh``: its axis sizes, dp counting every
    data-parallel rank (mesh axis dp x ep); with ``etp`` 1 (the expert group folded over
    tp) ep counts the group, mesh axis ep x tp."""
    out = {a: mesh.shape.get(a, 1) for a in _AXES}
    out["dp"] *= out["ep"]
    if etp == 1 and out["tp"] > 1 and "ep" in mesh.axes:
        out["ep"] *= out["tp"]
    return out


def _configs(scenario, mesh=None):
    """The GPT's configs from the parsed point (their own checks are the library's);
    without ``mesh`` the ParallelConfig is None."""
    w, o = scenario.workload, scenario.workload.options
    if o.get("model"):
        return _model_config(scenario), None if mesh is None else _parallel(scenario, mesh)
    config = GPTConfig(hidden=o["hidden"], layers=o["layers"], heads=o["heads"], seq=o["seq"],
                       vocab=o["vocab"], dtype=w.dtype, arch=o["arch"],
                       kv_heads=o.get("kv_heads"), ffn_hidden=o.get("ffn_hidden"),
                       head_dim=o.get("head_dim"), qk_norm=o.get("qk_norm", False),
                       window=o.get("window"), attention_sinks=o.get("attention_sinks", False),
                       qkv_bias=o.get("qkv_bias", False), out_bias=o.get("out_bias", False),
                       window_layers=tuple(o["window_layers"]) if o.get("window_layers")
                       else None,
                       tie_embeddings=o["tie_embeddings"], experts=o["experts"],
                       moe_top_k=o["moe_top_k"], moe_ffn_hidden=o.get("moe_ffn_hidden"),
                       capacity_factor=o.get("capacity_factor"),
                       **{k: o[k] for k in ("moe_router", "moe_shared_ffn_hidden",
                                            "moe_routed_scaling", "moe_aux_coef",
                                            "moe_bias_update_rate", "moe_router_bias",
                                            "moe_expert_bias") if k in o},
                       moe_dense_layers=tuple(o.get("moe_dense_layers") or ()),
                       moe_groups=tuple(o["moe_groups"]) if o.get("moe_groups") else None)
    return config, None if mesh is None else _parallel(scenario, mesh)


#: workload keys that, written beside workload.model, override the model's
_MODEL_OVERRIDES = ("hidden", "heads", "vocab", "arch", "kv_heads", "ffn_hidden",
                    "head_dim", "qk_norm", "window", "window_layers", "attention_sinks",
                    "qkv_bias", "out_bias", "tie_embeddings", "experts", "moe_top_k",
                    "moe_ffn_hidden",
                    "capacity_factor", "moe_router", "moe_shared_ffn_hidden",
                    "moe_routed_scaling", "moe_aux_coef", "moe_dense_layers", "moe_groups",
                    "moe_bias_update_rate", "moe_router_bias", "moe_expert_bias")


def _model_config(scenario):
    """``workload.model`` (a preset or a config.json, :func:`modeling.load_model`) as the
    GPTConfig the program runs: the keys written beside it (``layers``, ``seq`` and the
    shape keys) override the model's, the others keep the model's values."""
    w = scenario.workload
    written = dict(scenario.document.get("workload") or {})
    return GPTConfig.of_model(w.options["model"], w.options["seq"], w.dtype,
                              timing_only=scenario.run.mode == "simulate",
                              layers=written.get("layers"),
                              **{k: written[k] for k in _MODEL_OVERRIDES if k in written})


def _parallel(scenario, mesh):
    o, par = scenario.workload.options, scenario.parallel
    return ParallelConfig(global_batch=o["batch"], micro_batch=par["micro_batch"],
                         schedule=par["schedule"], virtual_stages=par.get("virtual_stages"),
                         sequence_parallel=par["sequence_parallel"],
                         recompute=par["recompute"],
                         recompute_modules=tuple(par.get("recompute_modules", ("core_attn",))),
                         attention=par.get("attention", "flash"),
                         tp_overlap=par.get("tp_overlap", "backward"),
                         grad_reduce_dtype=par.get("grad_reduce_dtype", "model"),
                         distributed_optimizer=bool(par.get("distributed_optimizer")),
                         # data_parallel.mode zero's stage (0 with ddp; the alias
                         # distributed_optimizer raises 0 to 1)
                         zero_stage=scenario.data_parallel.zero_stage,
                         cp_algorithm=par.get("cp_algorithm", "ring"), etp=par.get("etp"),
                         moe_dispatcher=par.get("moe_dispatcher", "alltoall"),
                         moe_comm_overlap=bool(par.get("moe_comm_overlap", False)),
                         moe_ep_node_ranks=par.get("moe_ep_node_ranks"),
                         first_stage_layers=par.get("first_stage_layers"),
                         last_stage_layers=par.get("last_stage_layers"),
                         **_degrees(mesh, par.get("etp")))


def _gqa(config) -> str:
    """The Llama-only and the mixture-of-experts shape terms of the description."""
    out = f" kv={config.kv_heads} ffn={config.ffn_hidden}" if config.block.grouped_query else ""
    if config.block.grouped_query and config.head_dim * config.heads != config.hidden:
        out += f" d={config.head_dim}"
    out += " qk-norm" if config.qk_norm else ""
    if config.window is not None:
        out += f" window={config.window}" + ("" if config.window_layers is None else
                                             f" ({len(config.window_layers)}/{config.layers}"
                                             " layers)")
    out += " sinks" if config.attention_sinks else ""
    out += " qkv-bias" if config.qkv_bias else ""
    out += " out-bias" if config.out_bias else ""
    if config.experts:
        out += f" experts={config.experts} top-{config.moe_top_k}"
        out += " router-bias" if config.moe_router_bias else ""
        out += " expert-bias" if config.moe_expert_bias else ""
    return out


def build(scenario, mesh) -> Workload:
    """The point's workload: one training job (one schedule), its shape-only twin for the
    tracer, and (unless simulating) the real per-rank arguments."""
    w, o, steps = scenario.workload, scenario.workload.options, scenario.run.steps
    ps = scenario.data_parallel.mode == DataParallelMode.PS
    config, parallel = _configs(scenario, None if ps else mesh)
    gpt = GPT(config, seed=w.seed)
    rng = np.random.default_rng([w.seed, 1])
    tokens = rng.integers(0, config.vocab, (o["batch"], config.seq))
    targets = rng.integers(0, config.vocab, (o["batch"], config.seq))
    optimizer = OptimizerConfig(o["optimizer"], o["lr"])
    if ps:
        return _build_ps(scenario, mesh, gpt, tokens, targets, optimizer)
    simulate_only = scenario.run.mode == "simulate"    # cluster scale: no real parameters
    shapes = {n: MetaArray(s, config.dtype) for n, s in gpt.param_shapes().items()}
    job = gpt.train_job(mesh, parallel, steps, optimizer, shapes if simulate_only else None)
    meta_job = job if simulate_only else dataclasses.replace(
        job, params=tuple((n, meta_like(a)) for n, a in job.params))
    data = MetaArray((parallel.global_batch, config.seq), np.int64)
    # an MoE trace cannot route (no values): it routes a balanced load (GPT.meta_args),
    # whose exchanged bytes equal the run's with a capacity factor (padded exchanges)
    metas = tuple(gpt.meta_args(mesh, parallel, steps, optimizer) if config.experts
                  else gpt.device_args(mesh, meta_job, data, data))
    args = () if simulate_only else tuple(gpt.device_args(mesh, job, tokens, targets))

    def assemble(results):
        losses, params, _ = gpt.collect(mesh, results, parallel)
        if config.experts:                      # the aux loss is part of the loss (as fit)
            losses = losses + gpt.moe_report(mesh, parallel, results)[0]
        return {"loss": np.asarray(losses), **params}

    def reference():
        ref = gpt.fit_reference(tokens, targets, steps, optimizer=o["optimizer"], lr=o["lr"],
                                parallel=parallel if config.experts else None)
        return {"loss": np.asarray(ref.losses), **ref.params}

    def step_traces(costs):
        return gpt_step_traces(config, parallel, costs, optimizer=optimizer, markers=True)

    def peak_memory_bytes():
        memory = gpt_memory(config, parallel, gpt_schedule(parallel))
        return max(m.total_bytes for m in memory)

    return Workload("transformer", mesh, train_program, args, metas, config.dtype, assemble,
                    reference, training=True, peak_memory_bytes=peak_memory_bytes,
                    # the planner's traces are of one step in 16-bit: the same program
                    step_traces=step_traces if steps == 1 and config.dtype == "float16"
                    else None,
                    model_flops=model_flops(config, parallel.global_batch),
                    description=f"{config.block} h={config.hidden} l={config.layers} "
                                f"a={config.heads}{_gqa(config)} s={config.seq} "
                                f"V={config.vocab}, {parallel.schedule}, "
                                f"{parallel.microbatches} micro-batches"
                                + (f", ZeRO-{parallel.zero_stage} over dp"
                                   if parallel.zero_stage else "")
                                + (f", {_format(o).upper()} linear layers" if _format(o)
                                   else "")
                                + (", flash-v1 attention" if parallel.attention == "flash-v1"
                                   else ""),
                    fp8_gemms=fp8_gemm if _format(o) else None,
                    gemm_format=_format(o) or "fp8",
                    flash_v1=parallel.attention == "flash-v1",
                    attention_kernel=named_kernel(parallel.attention.value))


def _format(o) -> str | None:
    """The GEMM format the workload's options ask for (``gemm_format``, or ``fp8: true``
    as ``fp8``), None for BF16."""
    return o.get("gemm_format") or ("fp8" if o["fp8"] else None)


def _build_ps(scenario, mesh, gpt, tokens, targets, optimizer) -> Workload:
    """The parameter server's workload: the job and per-rank arguments
    :meth:`GPT.fit_parameter_server` makes, the shape-only twin, and the reference."""
    o, steps, dp, config = (scenario.workload.options, scenario.run.steps,
                            scenario.data_parallel, gpt.config)
    servers, workers = dp.servers, mesh.size - dp.servers
    simulate_only = scenario.run.mode == "simulate"      # shapes only, no parameters
    shapes = {n: MetaArray(s, config.dtype) for n, s in gpt.param_shapes().items()}
    job = gpt.parameter_server_job(mesh, servers, o["batch"], steps, optimizer,
                                   dp.staleness, params=shapes if simulate_only else None)
    meta_job = dataclasses.replace(job, tensors=tuple(shapes.values()))
    data = MetaArray((o["batch"], config.seq), np.int64)
    metas = tuple(ps_device_args(meta_job, data, data))
    args = () if simulate_only else tuple(ps_device_args(job, tokens, targets))

    def assemble(results):
        losses, flat = assemble_ps(job, results)
        return {"loss": losses, **dict(zip(gpt.param_shapes(), flat))}

    def reference():
        ref = gpt.fit_reference(tokens, targets, steps, optimizer=o["optimizer"], lr=o["lr"])
        return {"loss": np.asarray(ref.losses), **ref.params}

    sync = "synchronous" if not dp.staleness else f"asynchronous, staleness {dp.staleness}"
    s = "" if servers == 1 else "s"
    return Workload("transformer", mesh, parameter_server_program, args, metas, config.dtype,
                    assemble, reference, training=True,
                    model_flops=model_flops(config, o["batch"]),
                    roles=("server",) * servers + ("worker",) * workers,
                    updates_per_step=workers if dp.staleness else 1,
                    description=f"{config.block} h={config.hidden} l={config.layers} "
                                f"a={config.heads}{_gqa(config)} s={config.seq} "
                                f"V={config.vocab}, parameter server: {servers} server{s} + "
                                f"{workers} workers, {sync}"
                                + (f", {_format(o).upper()} linear layers" if _format(o)
                                   else ""),
                    fp8_gemms=fp8_gemm if _format(o) else None,
                    gemm_format=_format(o) or "fp8")
