"""``kind: inference``: a model served — emulated on the virtual devices, simulated on a
hardware model, or both (docs/scenario.md ("kind: inference")).

The keys become three things, each made once here and each checked by the layer that owns
its rules (errors reported under the key the user wrote):

* the **model**, a :class:`modeling.ModelSpec`: ``workload.model`` (a preset or a
  config.json) with the shape keys written beside it replacing its own (``layers`` cuts it
  to a proxy, :meth:`~modeling.ModelSpec.with_layers`; ``hidden``, ``heads``, ``kv_heads``,
  ``head_dim``, ``ffn_hidden``, ``vocab``, ``experts``, ``moe_top_k``, ``moe_ffn_hidden``
  replace the layers' own — a head dimension tied to hidden/heads follows them), or,
  without ``model``, a Llama (RMSNorm, RoPE, SwiGLU) of the shape keys;
* the **requests**, :class:`serving.Request`: ``requests`` of ``input_len`` prompt and
  ``output_len`` output tokens (integers, ± ``range_ratio``, or one per request), each
  prompt after a ``prefix_len``-token prefix shared by all (default 0), sent at
  ``rate`` req/s with gamma ``burstiness`` and at most ``concurrency`` outstanding — as
  ``vllm bench serve`` draws them (:class:`~vcluster.timing.serving.workload.Workload`,
  seed ``workload.seed``) — or read from a ``trace`` CSV; the emulation serves the same
  lengths, request i joining the engine before step ``arrival_steps[i]`` (default 0);
* the **deployment**, a :class:`serving.ServingPlan`: ``parallel`` (tp, pp, ep, replicas,
  prefill_replicas, router) and the ``engine`` section (name, max_num_batched_tokens,
  max_num_seqs, block_size, gpu_memory_utilization, max_model_len, enable_chunked_prefill,
  enable_prefix_caching, hybrid_kv_cache_manager, weight_dtype, kv_cache_dtype;
  ``num_blocks``: the emulated cache).

``run.mode``:

* **emulate** — one replica on the mesh (pp, tp) (:func:`replica_mesh`): the serving
  program :func:`pipeline_parallel.decoder.serve_program` runs the model's numpy prefill
  and decode over a paged KV cache under the engine's continuous batching; with
  ``run.check`` every request's greedy tokens and logits are compared with
  :func:`~pipeline_parallel.decoder.greedy_reference` (the whole sequence re-run for each
  token, no cache, one process), every rank's tokens with rank 0's, and the engine steps
  the devices formed with a host replay of the scheduler;
* **simulate** — :func:`~vcluster.timing.serving.deployment.simulate_serve` of the model
  on ``hardware`` (a GPU model: preset, file or spec), every replica and request;
* **both** — the emulation, its trace replayed on ``hardware`` (predicted beside measured;
  the traffic compared, as every kind), and the serving simulation of the same model and
  requests when the hardware is a GPU model (``localhost`` prices this machine's CPU,
  which serves no requests).

The parameters are ``GPT(config, seed=workload.seed)``'s; the prompts are drawn from
``numpy.random.default_rng([seed, 2])``, uniform token ids in [0, vocab); with
``prefix_len`` every prompt's first tokens are then the shared prefix's, drawn from
``default_rng([seed, 3, prefix id])`` (the workload's one prefix: id 0).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from pipeline_parallel.decoder import (greedy_reference, serve_config, serve_mesh,
                                       serve_meta_args, serve_program, shard_params)
from pipeline_parallel.gpt import GPT, llama_ffn_hidden

from modeling import MLP, Attention, ConfigError, Layer, LatentAttention, ModelSpec, MoE
from modeling.presets import load_model
from serving import ServingPlan, blocks_for
from serving.plan import MXFP4_BYTES_PER_PARAM

from ..errors import ScenarioError
from ..hardware import LOCALHOST
from ..serving_records import ServingRun, emulated_records, simulated_records, step_rows
from .base import Workload

__all__ = ["validate", "build", "replica_mesh", "model_spec", "serving_plan",
           "emulated_requests", "simulation_source", "ServingWorkload", "SHAPE_KEYS"]

#: workload keys that describe (or, beside workload.model, override) the model's shape
SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab",
              "experts", "moe_top_k", "moe_ffn_hidden")
_MOE_KEYS = ("experts", "moe_top_k", "moe_ffn_hidden")
#: keys a trace replaces (its rows give the requests, their lengths and arrival times)
_TRACE_REPLACES = ("requests", "input_len", "output_len", "range_ratio", "rate", "burstiness",
                   "prefix_len")
#: requests without workload.requests or a per-request list: the 8 of issue 53's
#: emulated acceptance test (a handful a laptop serves in seconds)
DEFAULT_REQUESTS = 8
_FP8 = ("fp8",)       # engine.weight_dtype / kv_cache_dtype values of one byte per element

#: a ConfigError field of the model layer, the serving layer or the decoder -> the key
_KEY_PATHS = {
    "hidden": "workload.hidden", "vocab": "workload.vocab", "layers": "workload.layers",
    "heads": "workload.heads", "kv_heads": "workload.kv_heads",
    "head_dim": "workload.head_dim", "width": "workload.ffn_hidden",
    "experts": "workload.experts", "top_k": "workload.moe_top_k",
    "model": "workload.model", "num_requests": "workload.requests",
    **{k: f"workload.{k}" for k in ("input_len", "output_len", "rate", "burstiness",
                                    "concurrency", "range_ratio", "seed", "prefix_len")},
    **{k: f"parallel.{k}" for k in ("tp", "pp", "ep", "replicas", "prefill_replicas",
                                    "router")},
    "engine": "engine.name",
    **{k: f"engine.{k}" for k in ("max_num_batched_tokens", "max_num_seqs", "block_size",
                                  "gpu_memory_utilization", "max_model_len",
                                  "enable_chunked_prefill", "enable_prefix_caching",
                                  "num_blocks")},
    "hybrid_kv_cache": "engine.hybrid_kv_cache_manager",
    "weight_bytes": "engine.weight_dtype", "kv_bytes": "engine.kv_cache_dtype",
    "expert_weight_bytes": "engine.weight_dtype",
}


@contextlib.contextmanager
def _by_key(path: str | None = None, num_blocks: int | None = None):
    """A :class:`~modeling.ConfigError` inside, raised as a ScenarioError at the key the
    user wrote (``path``, else :data:`_KEY_PATHS` of its field; a request the emulated
    cache of ``num_blocks`` cannot hold at ``engine.num_blocks``; a model feature the
    program cannot run at ``workload.model``)."""
    try:
        yield
    except ConfigError as exc:
        field, value = exc.field, exc.value
        if path is None and field.startswith("requests["):
            where, value = "engine.num_blocks", num_blocks
            reason = f"{field} ({exc.value}): {exc.reason}"
        elif path is None and field in _KEY_PATHS:
            where, reason = _KEY_PATHS[field], exc.reason
        else:
            where = path or "workload.model"
            reason = f"{exc.owner + ': ' if exc.owner else ''}{field}: {exc.reason}"
        raise ScenarioError(where, value, exc.allowed, reason) from None


def _written(scenario) -> dict:
    """The workload keys the file wrote (the schema's defaults not filled in)."""
    return dict(scenario.document.get("workload") or {})


def _emulates(scenario) -> bool:
    return scenario.run.mode != "simulate"


def _simulates(scenario) -> bool:
    """Whether the serving simulator runs: simulate, or both on a GPU model."""
    return scenario.run.mode == "simulate" or (scenario.run.mode == "both"
                                               and scenario.hardware.name != LOCALHOST)


# --- the mesh ---------------------------------------------------------------------------
def replica_mesh(scenario):
    """The mesh of one replica, axes (pp, tp) (:func:`~pipeline_parallel.decoder.
    serve_mesh`); ``cluster.mesh``, when written, must be that mesh."""
    par = scenario.parallel
    mesh = serve_mesh(par["tp"], par["pp"])
    given = scenario.cluster.mesh
    if given and given != tuple(mesh.shape.items()):
        raise ScenarioError("cluster.mesh", dict(given), f"{dict(mesh.shape)} (one replica: "
                            f"parallel.pp x parallel.tp, tp fastest), or omit cluster.mesh",
                            "does not match parallel.tp and parallel.pp")
    return mesh


# --- the model --------------------------------------------------------------------------
def model_spec(scenario) -> ModelSpec:
    """The served model (module docstring)."""
    o, written = scenario.workload.options, _written(scenario)
    if not o.get("model"):
        with _by_key():
            return _llama(o)
    model = str(o["model"])
    path = Path(model).expanduser()
    if model.endswith(".json") and not path.is_absolute():
        path = Path(scenario.base_dir) / path
    with _by_key("workload.model"):
        spec = load_model(str(path) if model.endswith(".json") else model)
    with _by_key():
        return _proxy(spec, {k: written[k] for k in SHAPE_KEYS if k in written})


def _llama(o) -> ModelSpec:
    """A Llama of the shape keys (their defaults filled in)."""
    hidden, heads = o["hidden"], o["heads"]
    head_dim = o.get("head_dim") or _tied_head_dim(hidden, heads)
    ffn = o.get("ffn_hidden") or llama_ffn_hidden(hidden)
    mlp = MLP("swiglu", ffn)
    if o["experts"]:
        mlp = MoE(o["experts"], o["moe_top_k"], MLP("swiglu", o.get("moe_ffn_hidden") or ffn))
    layer = Layer(Attention(heads, o.get("kv_heads") or heads, head_dim), mlp)
    kind = f" MoE {o['experts']}x top-{o['moe_top_k']}" if o["experts"] else ""
    return ModelSpec(f"llama h={hidden} l={o['layers']} a={heads}{kind} V={o['vocab']}",
                     hidden=hidden, vocab=o["vocab"], layers=(layer,) * o["layers"])


def _tied_head_dim(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ConfigError("heads", heads, f"a divisor of hidden={hidden} (or give head_dim)",
                          "each head is hidden/heads wide")
    return hidden // heads


def _proxy(spec: ModelSpec, shape: dict) -> ModelSpec:
    """``spec`` with the written ``shape`` keys replacing its own (module docstring)."""
    if not shape:
        return spec
    if "layers" in shape:
        spec = spec.with_layers(shape["layers"])
    hidden = shape.get("hidden", spec.hidden)
    moe_keys = [k for k in _MOE_KEYS if k in shape]
    if moe_keys and not spec.is_moe:
        raise ScenarioError(f"workload.{moe_keys[0]}", shape[moe_keys[0]], "no value with a "
                            "dense model (or omit workload.model to describe a mixture of "
                            "experts)", f"{spec.name} has no experts")
    layers = tuple(Layer(_attention(x.attention, spec.hidden, hidden, shape),
                         _mlp(x.mlp, shape)) for x in spec.layers)
    changed = ", ".join(f"{k}={v}" for k, v in shape.items())
    return replace(spec, name=f"{spec.name} ({changed})", hidden=hidden,
                   vocab=shape.get("vocab", spec.vocab), layers=layers)


def _attention(att, old_hidden: int, hidden: int, shape: dict):
    if isinstance(att, LatentAttention):
        bad = [k for k in ("kv_heads", "head_dim") if k in shape]
        if bad:
            raise ConfigError(bad[0], shape[bad[0]], "no value with latent attention (its "
                              "KV is a shared latent)", "the model's attention is latent")
        return replace(att, heads=shape.get("heads", att.heads))
    heads = shape.get("heads", att.heads)
    head_dim = shape.get("head_dim", att.head_dim)
    tied = att.heads * att.head_dim == old_hidden
    if "head_dim" not in shape and tied and {"hidden", "heads"} & set(shape):
        head_dim = _tied_head_dim(hidden, heads)
    return replace(att, heads=heads, kv_heads=shape.get("kv_heads", att.kv_heads),
                   head_dim=head_dim)


def _mlp(mlp, shape: dict):
    if isinstance(mlp, MoE):
        expert = mlp.expert
        if "moe_ffn_hidden" in shape:
            expert = replace(expert, width=shape["moe_ffn_hidden"])
        return replace(mlp, experts=shape.get("experts", mlp.experts),
                       top_k=shape.get("moe_top_k", mlp.top_k), expert=expert)
    return replace(mlp, width=shape["ffn_hidden"]) if "ffn_hidden" in shape else mlp


# --- the requests -----------------------------------------------------------------------
def _rate(value) -> float:
    return math.inf if value == "inf" else float(value)


def _count(scenario) -> int:
    """How many requests: workload.requests, else a per-request list's length, else 8."""
    o, written = scenario.workload.options, _written(scenario)
    if "requests" in written:
        return int(written["requests"])
    lists = [o[k] for k in ("input_len", "output_len", "arrival_steps")
             if isinstance(o.get(k), list)]
    return len(lists[0]) if lists else DEFAULT_REQUESTS


def _lengths(scenario, n: int) -> tuple[tuple, tuple] | None:
    """Per-request (prompt, output) lengths when one is a list (the other broadcast), or
    None when both are integers (then the Workload draws them)."""
    o = scenario.workload.options
    if not any(isinstance(o[k], list) for k in ("input_len", "output_len")):
        return None
    out = []
    for key in ("input_len", "output_len"):
        value = o[key]
        if isinstance(value, list) and len(value) != n:
            raise ScenarioError(f"workload.{key}", value, f"a list of {n} lengths, one per "
                                "request (workload.requests), or one integer",
                                f"{len(value)} lengths for {n} requests")
        out.append(tuple(value) if isinstance(value, list) else (value,) * n)
    if o["range_ratio"]:
        raise ScenarioError("workload.range_ratio", o["range_ratio"], "0 with per-request "
                            "lengths", "the lengths are given, not drawn")
    return out[0], out[1]


def _drawn(scenario, n: int):
    """The Workload vllm bench would run (lengths drawn when both are integers; with
    per-request lengths, unit lengths whose draws leave the arrival times unchanged)."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing.serving.workload import Workload
    o = scenario.workload.options
    scalar = not any(isinstance(o[k], list) for k in ("input_len", "output_len"))
    with _by_key():
        return Workload(n, o["input_len"] if scalar else 1, o["output_len"] if scalar else 1,
                        rate=_rate(o["rate"]), burstiness=_rate(o["burstiness"]),
                        concurrency=o.get("concurrency"),
                        range_ratio=o["range_ratio"] if scalar else 0.0,
                        seed=scenario.workload.seed, prefix_len=o["prefix_len"])


def _trace_requests(scenario) -> tuple:
    # lazy: keeps vcluster --help fast
    from vcluster.timing.serving.workload import read_trace
    written = _written(scenario)
    clash = [k for k in _TRACE_REPLACES if k in written]
    if clash:
        raise ScenarioError(f"workload.{clash[0]}", written[clash[0]], "no value with "
                            "workload.trace", "the trace gives every request's lengths "
                            "and arrival time")
    path = Path(scenario.workload.options["trace"]).expanduser()
    path = path if path.is_absolute() else Path(scenario.base_dir) / path
    with _by_key("workload.trace"):
        return read_trace(path)


def _requests(scenario) -> tuple:
    """Every request with its lengths and arrival time (arrival steps not yet set)."""
    if scenario.workload.options.get("trace"):
        return _trace_requests(scenario)
    n = _count(scenario)
    lengths = _lengths(scenario, n)
    drawn = _drawn(scenario, n).requests()
    if lengths is None:
        return drawn
    return tuple(replace(r, prompt_len=r.prefix_len + p, output_len=q)
                 for r, p, q in zip(drawn, *lengths))


def emulated_requests(scenario) -> tuple:
    """The requests the emulator serves: every request's lengths, joining the engine
    before step ``arrival_steps[i]`` (default 0)."""
    requests = _requests(scenario)
    steps = scenario.workload.options.get("arrival_steps")
    if steps is None:
        return requests
    if len(steps) != len(requests):
        raise ScenarioError("workload.arrival_steps", list(steps), f"a list of "
                            f"{len(requests)} steps, one per request", f"{len(steps)} steps "
                            f"for {len(requests)} requests")
    return tuple(replace(r, arrival_step=int(a)) for r, a in zip(requests, steps))


def simulation_source(scenario):
    """What the serving simulator serves: the Workload, the trace (a TraceWorkload), or
    the requests of per-request lengths (no concurrency limit)."""
    # lazy: keeps vcluster --help fast
    from vcluster.timing.serving.workload import TraceWorkload
    o = scenario.workload.options
    if o.get("trace"):
        _trace_requests(scenario)                 # its rows' errors, named by key
        base = Path(o["trace"]).expanduser()
        path = base if base.is_absolute() else Path(scenario.base_dir) / base
        with _by_key():
            return TraceWorkload(str(path), concurrency=o.get("concurrency"))
    n = _count(scenario)
    lengths = _lengths(scenario, n)
    if lengths is None:
        return _drawn(scenario, n)
    if o.get("concurrency") is not None:
        raise ScenarioError("workload.concurrency", o["concurrency"], "no value with "
                            "per-request lengths (a rate, or integer lengths)",
                            "the simulator's client limits a drawn workload or a trace")
    return _requests(scenario)


# --- the deployment ---------------------------------------------------------------------
def serving_plan(scenario, spec: ModelSpec) -> ServingPlan:
    """The deployment of ``parallel`` and ``engine``, checked against ``spec``."""
    par, e = scenario.parallel, scenario.engine
    with _by_key():
        plan = ServingPlan(tp=par["tp"], pp=par["pp"], ep=par["ep"], replicas=par["replicas"],
                           prefill_replicas=par["prefill_replicas"], engine=e["name"],
                           router=par["router"],
                           max_num_batched_tokens=e.get("max_num_batched_tokens"),
                           max_num_seqs=e["max_num_seqs"], block_size=e["block_size"],
                           gpu_memory_utilization=e["gpu_memory_utilization"],
                           max_model_len=e.get("max_model_len"),
                           enable_chunked_prefill=e["enable_chunked_prefill"],
                           enable_prefix_caching=e["enable_prefix_caching"],
                           hybrid_kv_cache=e["hybrid_kv_cache_manager"],
                           weight_bytes=1 if e["weight_dtype"] in _FP8 else 2,
                           expert_weight_bytes=MXFP4_BYTES_PER_PARAM
                           if e["weight_dtype"] == "mxfp4" else None,
                           kv_bytes=1 if e["kv_cache_dtype"] in _FP8 else 2)
        return plan.check(spec)


def _num_blocks(scenario, requests) -> int:
    """engine.num_blocks, else room for every request at its longest at once (and the
    null block)."""
    given = scenario.engine.get("num_blocks")
    if given is not None:
        return int(given)
    size = scenario.engine["block_size"]
    return 1 + sum(blocks_for(r.max_tokens, size) for r in requests)


def _emulation_settings(scenario, requests) -> dict:
    """The decoder's scheduler keywords (``serve_meta_args``)."""
    e = scenario.engine
    return {"num_blocks": _num_blocks(scenario, requests), "block_size": e["block_size"],
            "max_num_batched_tokens": e.get("max_num_batched_tokens"),
            "max_num_seqs": e["max_num_seqs"], "engine": str(e["name"]),
            "enable_prefix_caching": (e["enable_prefix_caching"]
                                      if str(e["name"]) == "vllm-v1" else None),
            "hybrid_kv_cache": e["hybrid_kv_cache_manager"]}


# --- the parser's rules -----------------------------------------------------------------
def validate(scenario, mesh) -> None:
    """The cross-field rules (once per point; :func:`build` trusts them): the model's,
    the requests', the plan's (every one the layer's own) and the modes'."""
    spec = model_spec(scenario)
    par = scenario.parallel
    serving_plan(scenario, spec)
    if scenario.run.mode == "simulate" and scenario.hardware.name == LOCALHOST:
        raise ScenarioError("hardware", LOCALHOST, "a GPU model: a preset (vcluster hardware "
                            "list), a file or a spec", "the serving simulator prices GPU "
                            "kernels; localhost prices this machine's CPU")
    if _simulates(scenario):
        simulation_source(scenario)
    if not _emulates(scenario):
        return
    for key, one in (("replicas", 1), ("prefill_replicas", 0)):
        if par[key] != one:
            raise ScenarioError(f"parallel.{key}", par[key], f"{one} with run.mode "
                                f"{scenario.run.mode} (or run.mode simulate)",
                                "the emulator serves one replica")
    requests = emulated_requests(scenario)
    settings = _emulation_settings(scenario, requests)
    with _by_key(num_blocks=settings["num_blocks"]):
        config = serve_config(spec)
        serve_meta_args(mesh, replace(config, dtype=scenario.workload.dtype), requests,
                        tp=par["tp"], pp=par["pp"], ep=par["ep"],
                        dtype=scenario.workload.dtype, **settings)


# --- the workload -----------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class ServingWorkload(Workload):
    """A :class:`Workload` whose program serves requests, and ``serving``: the runner's
    hooks for the serving records (:class:`~vcluster.scenario.serving_records.ServingRun`)."""

    serving: ServingRun | None = None


def _hardware_spec(scenario, mesh):
    """The HardwareSpec of the scenario's GPU model (one kind: a cluster file of several
    is refused, naming the key)."""
    from ..hardware import LOCALHOST, cost_setup, single_kind   # lazy: the timing model
    if scenario.hardware.name != LOCALHOST:
        single_kind(scenario)
    return cost_setup(scenario, mesh, "float16").costs.hardware


def build(scenario, mesh) -> ServingWorkload:
    """The point's workload: the serving program and its per-rank arguments (with
    emulation), its shape-only twin for the tracer, the reference, and the serving
    records' hooks."""
    w, par = scenario.workload, scenario.parallel
    spec = model_spec(scenario)
    tp, pp, ep = par["tp"], par["pp"], par["ep"]
    simulated = None
    if _simulates(scenario):
        plan, source = serving_plan(scenario, spec), simulation_source(scenario)

        def simulated():
            return simulated_records(spec, _hardware_spec(scenario, mesh), plan, source,
                                     w.seed)
    description = (f"serve {spec.name}: {len(_requests(scenario))} requests, "
                   f"{scenario.engine['name']}, tp={tp} pp={pp}"
                   + (f" ep={ep}" if ep > 1 else "")
                   + (f", {par['replicas']} replicas" if par["replicas"] > 1 else "")
                   + (f" + {par['prefill_replicas']} prefill" if par["prefill_replicas"]
                      else ""))
    if not _emulates(scenario):
        return ServingWorkload(
            "inference", mesh, serve_program, (), (), w.dtype, _not_emulated,
            _not_emulated, description=description,
            serving=ServingRun(_not_emulated, simulated))
    requests = emulated_requests(scenario)
    settings = _emulation_settings(scenario, requests)
    config = replace(serve_config(spec), dtype=w.dtype)
    metas = serve_meta_args(mesh, config, requests, tp=tp, pp=pp, ep=ep, dtype=w.dtype,
                            **settings)
    params = GPT(config, seed=w.seed).init_params()
    rng = np.random.default_rng([w.seed, 2])
    prompts = [[int(t) for t in rng.integers(0, config.vocab, r.prompt_len)]
               for r in requests]
    heads: dict = {}      # every prompt of a prefix starts with that prefix's tokens
    for r in requests:
        if r.prefix_id is not None:
            heads[r.prefix_id] = max(heads.get(r.prefix_id, 0), r.prefix_len)
    for pid, length in heads.items():
        head = [int(t) for t in np.random.default_rng([w.seed, 3, pid]).integers(
            0, config.vocab, length)]
        for r, prompt in zip(requests, prompts):
            if r.prefix_id == pid:
                prompt[:r.prefix_len] = head[:r.prefix_len]
    prompts = tuple(tuple(prompt) for prompt in prompts)
    job = replace(metas[0][0], config=config, prompts=prompts)
    args = tuple((job, piece) for piece in shard_params(config, params, tp, pp, ep))
    scheduler = {k: v for k, v in job.settings if k != "num_blocks"}   # the devices' own

    def assemble(results):
        first = results[0]
        logits = next(r["logits"] for r in results if r["logits"] is not None)
        out = {"tokens agree across ranks (ranks that differ)":
               np.array([sum(r["outputs"] != first["outputs"] for r in results)], float)}
        for r in requests:
            out[f"request {r.request_id}: tokens"] = np.asarray(
                first["outputs"][r.request_id], np.float64)
            out[f"request {r.request_id}: logits"] = logits[r.request_id]
        out["engine steps (host replay of the scheduler)"] = step_rows(first["steps"])
        return out

    def reference():
        from ..serving_records import replay_schedule
        out = {"tokens agree across ranks (ranks that differ)": np.zeros(1)}
        for r, prompt in zip(requests, prompts):
            tokens, logits = greedy_reference(config, params, prompt, r.output_len)
            out[f"request {r.request_id}: tokens"] = np.asarray(tokens, np.float64)
            out[f"request {r.request_id}: logits"] = logits
        steps = replay_schedule(requests, settings["engine"], settings["num_blocks"],
                                scheduler)[0]
        out["engine steps (host replay of the scheduler)"] = step_rows(steps)
        return out

    def emulated(outputs_by_rank):
        return emulated_records(outputs_by_rank, requests, settings["engine"],
                                settings["num_blocks"], scheduler)

    return ServingWorkload("inference", mesh, serve_program, args,
                           tuple(tuple(m) for m in metas), w.dtype, assemble, reference,
                           description=description, serving=ServingRun(emulated, simulated))


def _not_emulated(*_):
    raise RuntimeError("inference: run.mode simulate emulates nothing (no outputs to "
                       "assemble, no reference to compute)")
