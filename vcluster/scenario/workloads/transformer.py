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

import dataclasses

import numpy as np
from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import FUSED_ATTENTION, GPT, GPTConfig, ParallelConfig, model_flops
from pipeline_parallel.optim import OptimizerConfig
from pipeline_parallel.parameter_server import assemble as assemble_ps
from pipeline_parallel.parameter_server import device_args as ps_device_args
from pipeline_parallel.parameter_server import parameter_server_program
from vcluster.planner.memory import gpt_memory
from vcluster.planner.simulation import fp8_gemm, gpt_schedule, gpt_step_traces
from vcluster.runtime.tracing import MetaArray, meta_like

from modeling import ConfigError

from ..choices import DataParallelMode
from ..errors import ScenarioError
from ..hardware import check_fp8
from .base import Workload

__all__ = ["validate", "build"]


def validate(scenario, mesh) -> None:
    """The parser's cross-field rules (once per point; :func:`build` trusts them)."""
    o, par = scenario.workload.options, scenario.parallel
    if o["fp8"]:
        check_fp8(scenario)
    if scenario.data_parallel.mode == DataParallelMode.PS:
        return _validate_ps(scenario, mesh)
    unknown = [a for a in mesh.axes if a not in _AXES]
    if unknown:
        raise ScenarioError("cluster.mesh", dict(mesh.shape), f"axes among {', '.join(_AXES)}",
                            f"unknown axes {unknown} for a transformer")
    if o.get("model"):        # the model's shapes: every rule is the model layer's
        return _check_plan(scenario, mesh, check_model=True)
    if o["hidden"] % o["heads"]:
        raise ScenarioError("workload.heads", o["heads"], f"a divisor of hidden={o['hidden']}",
                            "hidden splits into heads")
    degrees = _degrees(mesh)
    _validate_arch(o, degrees["tp"])
    interleaved = par["schedule"] == "interleaved_1f1b"
    if par.get("virtual_stages") is not None and not interleaved:
        raise ScenarioError("parallel.virtual_stages", par["virtual_stages"],
                            "no value, or schedule interleaved_1f1b",
                            f"schedule {par['schedule']} has one stage per rank")
    if o["batch"] % (degrees["dp"] * par["micro_batch"]):
        raise ScenarioError("workload.batch", o["batch"],
                            f"a multiple of {degrees['dp'] * par['micro_batch']}",
                            f"the batch splits into dp={degrees['dp']} x "
                            f"micro_batch={par['micro_batch']}")
    chunks = par.get("virtual_stages") or (2 if interleaved else 1)
    stages = degrees["pp"] * chunks
    if o["layers"] % stages:
        raise ScenarioError("workload.layers", o["layers"], f"a multiple of {stages}",
                            f"layers split into pp={degrees['pp']} x {chunks} stages")
    for key in ("heads", "vocab"):
        if o[key] % degrees["tp"]:
            raise ScenarioError(f"workload.{key}", o[key], f"a multiple of tp={degrees['tp']}",
                                f"{key} is split over tp")
    cp, tp = degrees["cp"], degrees["tp"]
    if cp > 1 and o["seq"] % (2 * cp):
        raise ScenarioError("workload.seq", o["seq"], f"a multiple of 2 x cp = {2 * cp}",
                            "the sequence is cut into 2·cp chunks (two per cp rank)")
    if par["sequence_parallel"] and (o["seq"] // cp) % tp:
        raise ScenarioError("workload.seq", o["seq"], f"a multiple of cp x tp = {cp * tp}",
                            "sequence parallelism splits each cp rank's rows over tp")
    if cp > 1 and par.get("attention", "flash") not in FUSED_ATTENTION:
        raise ScenarioError("parallel.attention", par["attention"],
                            "flash or flash-v1 with cp > 1",
                            "context-parallel attention never keeps the s² scores")
    _validate_experts(o, degrees)
    _check_plan(scenario, mesh)


def _check_plan(scenario, mesh, check_model: bool = False) -> None:
    """The plan's rulebook (:class:`modeling.ParallelConfig`; with ``check_model`` also
    :meth:`~modeling.ParallelConfig.check` against the model), each rule once, its
    ConfigError reported under the scenario key the user wrote."""
    try:
        config, parallel = _configs(scenario, mesh)
        parallel.check_microbatches()
        if check_model:
            parallel.check(config, parallel.mesh())
    except ConfigError as exc:
        path = _KEY_PATHS.get(exc.field, f"parallel.{exc.field}")
        value = scenario.workload.options["batch"] if exc.field == "microbatches" \
            else exc.value
        if exc.owner not in ("", "ParallelConfig", "GPT", "model"):    # a config.json's key
            path = f"workload.model ({exc.owner}: {exc.field})"
        raise ScenarioError(path, value, exc.allowed, exc.reason) from None


#: a ConfigError field of the plan -> the scenario key a user wrote it under
_KEY_PATHS = {"microbatches": "workload.batch", "global_batch": "workload.batch",
              "zero_stage": "data_parallel.zero_stage", "model": "workload.model",
              "experts": "workload.experts", "micro_batch": "parallel.micro_batch"}


def _validate_ps(scenario, mesh) -> None:
    """The parameter server's rules (its mesh, pp, tp, cp and ep are the parser's
    :func:`~vcluster.scenario.semantics.resolve_mesh` and ``check_data_parallel``)."""
    o, servers = scenario.workload.options, scenario.data_parallel.servers
    if o["hidden"] % o["heads"]:
        raise ScenarioError("workload.heads", o["heads"], f"a divisor of hidden={o['hidden']}",
                            "hidden splits into heads")
    _validate_arch(o, 1)
    _validate_experts(o, dict.fromkeys(_AXES, 1))
    if o["experts"]:
        raise ScenarioError("workload.experts", o["experts"], "0 with data_parallel.mode ps",
                            "the parameter server trains dense models (each worker "
                            "holds the whole model)")
    tensors = len(GPT(_configs(scenario)[0]).param_shapes())
    if servers > tensors:
        raise ScenarioError("data_parallel.servers", servers, f"at most {tensors} (the "
                            f"model's parameter tensors)",
                            "each parameter tensor lives on one server")
    workers = mesh.size - servers
    if o["batch"] % workers:
        raise ScenarioError("workload.batch", o["batch"], f"a multiple of {workers}",
                            f"the batch splits into {workers} workers' slices")


def _validate_experts(o, degrees) -> None:
    """The experts split over ep; ep needs experts; no experts with cp (yet)."""
    experts, ep = o["experts"], degrees["ep"]
    if ep > 1 and not experts:
        raise ScenarioError("parallel.ep", ep, "1 for a dense model (workload.experts: 0)",
                            "expert parallelism splits the experts")
    if experts and experts % ep:
        raise ScenarioError("workload.experts", experts, f"a multiple of ep={ep}",
                            "each ep rank holds experts/ep experts")
    if experts and o["moe_top_k"] > experts:
        raise ScenarioError("workload.moe_top_k", o["moe_top_k"], f"at most experts={experts}",
                            "each token is routed to k distinct experts")
    if experts and degrees["cp"] > 1:
        raise ScenarioError("parallel.cp", degrees["cp"], "1 with experts",
                            "mixture of experts with context parallelism is not supported yet")
    for key in ("moe_ffn_hidden", "capacity_factor"):
        if not experts and o.get(key) is not None:
            raise ScenarioError(f"workload.{key}", o[key], "no value without experts",
                                "only a mixture-of-experts model takes it")


def _validate_arch(o, tp: int) -> None:
    """kv_heads and ffn_hidden belong to llama; their splits over tp (the rules of
    :func:`tensor_parallel.llama.check_kv_heads`, named by key)."""
    if o["arch"] != "llama":
        for key in ("kv_heads", "ffn_hidden"):
            if o.get(key) is not None:
                raise ScenarioError(f"workload.{key}", o[key], "no value with arch gpt",
                                    "only arch llama takes it (gpt: heads and 4 x hidden)")
        return
    heads, kv = o["heads"], o.get("kv_heads") or o["heads"]
    if heads % kv:
        raise ScenarioError("workload.kv_heads", kv, f"a divisor of heads={heads}",
                            "query heads share key/value heads in equal groups")
    if (o["hidden"] // heads) % 2:
        raise ScenarioError("workload.heads", heads, "a count that leaves hidden/heads even",
                            "RoPE rotates pairs of the head dimension")
    if kv >= tp and kv % tp or kv < tp and tp % kv:
        raise ScenarioError("workload.kv_heads", kv, f"a multiple or a divisor of tp={tp}",
                            "key/value heads split over tp, or each replicated over "
                            "tp/kv_heads ranks")
    if o.get("ffn_hidden") is not None and o["ffn_hidden"] % tp:
        raise ScenarioError("workload.ffn_hidden", o["ffn_hidden"], f"a multiple of tp={tp}",
                            "the SwiGLU width is split over tp")


_AXES = ("dp", "pp", "cp", "ep", "tp")


def _degrees(mesh) -> dict:
    """The ParallelConfig degrees of ``mesh``: its axis sizes, dp counting every
    data-parallel rank (mesh axis dp x ep)."""
    out = {a: mesh.shape.get(a, 1) for a in _AXES}
    out["dp"] *= out["ep"]
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
                       tie_embeddings=o["tie_embeddings"], experts=o["experts"],
                       moe_top_k=o["moe_top_k"], moe_ffn_hidden=o.get("moe_ffn_hidden"),
                       capacity_factor=o.get("capacity_factor"))
    return config, None if mesh is None else _parallel(scenario, mesh)


#: workload keys that, written beside workload.model, override the model's
_MODEL_OVERRIDES = ("hidden", "heads", "vocab", "arch", "kv_heads", "ffn_hidden",
                    "tie_embeddings", "experts", "moe_top_k", "moe_ffn_hidden",
                    "capacity_factor")


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
                         attention=par.get("attention", "flash"),
                         tp_overlap=par.get("tp_overlap", "backward"),
                         grad_reduce_dtype=par.get("grad_reduce_dtype", "model"),
                         distributed_optimizer=bool(par.get("distributed_optimizer")),
                         # data_parallel.mode zero's stage (0 with ddp; the alias
                         # distributed_optimizer raises 0 to 1)
                         zero_stage=scenario.data_parallel.zero_stage,
                         cp_algorithm=par.get("cp_algorithm", "ring"), **_degrees(mesh))


def _gqa(config) -> str:
    """The Llama-only and the mixture-of-experts shape terms of the description."""
    out = f" kv={config.kv_heads} ffn={config.ffn_hidden}" if config.block.grouped_query else ""
    if config.experts:
        out += f" experts={config.experts} top-{config.moe_top_k}"
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
        losses, params, _ = gpt.collect(mesh, results)
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
                                + (", FP8 linear layers" if o["fp8"] else "")
                                + (", flash-v1 attention" if parallel.attention == "flash-v1"
                                   else ""),
                    fp8_gemms=fp8_gemm if o["fp8"] else None,
                    flash_v1=parallel.attention == "flash-v1")


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
                                + (", FP8 linear layers" if o["fp8"] else ""),
                    fp8_gemms=fp8_gemm if o["fp8"] else None)
