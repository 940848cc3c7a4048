"""The JSON Schema of a scenario file (``vcluster schema`` prints it) and validation by it.

One schema serves editors (completion, hover text from ``description``) and the loader:
:func:`check_document` validates one run's document with :mod:`jsonschema` (the parser,
:mod:`vcluster.scenario.load`, is its only caller: once per sweep point) and turns the
first error into a :class:`~vcluster.scenario.errors.ScenarioError` naming the key path,
the value and the allowed values. Keys that depend on ``workload.kind`` (the workload's
sizes, the ``parallel`` section) are ``if``/``then`` branches, so an unknown key is
reported against the keys of *its* kind. Cross-field rules (mesh sizes, divisibility)
are checked after the schema, in :mod:`vcluster.scenario.semantics`.

Sections are closed (``additionalProperties: false``); a new section is one more entry of
``_SECTIONS`` and of :class:`~vcluster.scenario.model.Scenario`.
"""

from __future__ import annotations

import copy
from types import MappingProxyType

from modeling import AttentionKernel, CPAlgorithm, GradReduceDtype, TPOverlap, ZeroStage
from modeling.choices import RECOMPUTE_MODULES_MEGATRON, Engine as ServingEngine, Router

from .choices import Algorithm, ArrayModule, DataParallelMode, Mode, Recompute, ScheduleName
from .errors import ScenarioError, format_path
from .resilience import CHECKPOINT_SCHEMA as _CHECKPOINT_SCHEMA, FAULTS_SCHEMA as _FAULTS_SCHEMA

__all__ = ["scenario_schema", "check_document", "check_section", "KINDS", "MODES", "DTYPES",
           "COLLECTIVE_OPS", "MATMUL_POLICIES", "FFN_POLICIES", "SCHEDULES", "REPORT_FORMATS",
           "ALGORITHMS", "PARALLEL_AXES", "TRANSFORMER_AXES", "DATA_PARALLEL_MODES",
           "DATA_PARALLEL_KEYS", "ZERO_STAGES", "SERVING_KIND"]

SERVING_KIND = "inference"        # a model served: vcluster/scenario/workloads/inference.py
KINDS = ("collective", "matmul", "ffn", "mlp", "transformer", SERVING_KIND)
MODES = Mode.values()
DTYPES = ("float16", "float32", "float64")     # float16: run.mode simulate only
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                  "reduce", "scatter", "gather")
ALGORITHMS = Algorithm.values()
MATMUL_POLICIES = ("Unsharded", "MatchedInnerSharding", "UnmatchedInnerSharding",
                   "OuterSharding", "FullSharding", "auto")
FFN_POLICIES = ("Unsharded", "Megatron", "SequenceParallel", "GSPMD", "auto")
SCHEDULES = ScheduleName.values()
RECOMPUTE = Recompute.values()
MLP_ACTIVATIONS = ("relu", "gelu", "tanh")
FFN_ACTIVATIONS = ("relu", "gelu")
LOSSES = ("mse", "cross_entropy")
OPTIMIZERS = ("sgd", "adam")
REPORT_FORMATS = ("md", "html", "json", "csv", "png", "trace")
HARDWARE_DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
PARALLEL_AXES = ("dp", "pp", "tp")
TRANSFORMER_AXES = ("dp", "pp", "cp", "ep", "tp")   # ParallelConfig.mesh()'s order
CP_ALGORITHMS = CPAlgorithm.values()          # modeling.choices: the one list
ARCHS = ("gpt", "llama")          # pipeline_parallel.gpt.ARCHS (the front door imports no model)
DATA_PARALLEL_MODES = DataParallelMode.values()
#: data_parallel.zero_stage: modeling's ZeRO stages but 0 (DDP is data_parallel.mode ddp)
ZERO_STAGES = tuple(z for z in ZeroStage.values() if z != ZeroStage.DDP)
#: the data_parallel keys each mode takes besides ``mode`` (any other is an error)
DATA_PARALLEL_KEYS = MappingProxyType({"ddp": (), "zero": ("zero_stage",),
                                       "ps": ("servers", "staleness")})

_IDENT = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: sections a sweep varies (engine: the inference kind's serving engine)
_SWEPT = "(cluster|hardware|workload|parallel|run|data_parallel|engine)"


def _int(description: str, minimum: int = 1, default=None) -> dict:
    out = {"type": "integer", "minimum": minimum, "description": description}
    if default is not None:
        out["default"] = default
    return out


def _enum(values, description: str, default=None) -> dict:
    out = {"enum": list(values), "description": description}
    if default is not None:
        out["default"] = default
    return out


def _bool(description: str, default: bool = False) -> dict:
    return {"type": "boolean", "description": description, "default": default}


def _lengths(description: str, default: int) -> dict:
    """Token counts: one integer for every request, or a list of one per request."""
    return {"description": description, "default": default,
            "anyOf": [{"type": "integer", "minimum": 1},
                      {"type": "array", "items": {"type": "integer", "minimum": 1},
                       "minItems": 1}]}


def _rate(description: str, default) -> dict:
    """A positive number, or ``inf`` (YAML ``.inf`` or the text ``inf``)."""
    return {"description": description, "default": default,
            "anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": "inf"}]}


_AXES = {"description": "a mesh axis name, a list of names (major to minor), or null",
         "anyOf": [{"type": "null"}, {"type": "string", "pattern": _IDENT},
                   {"type": "array", "items": {"type": "string", "pattern": _IDENT},
                    "minItems": 1, "uniqueItems": True}]}
_LAYOUT = {"type": "array", "minItems": 2, "maxItems": 2, "items": _AXES,
           "description": "per dimension: null (replicated), an axis, or a list of axes"}

_DEGREES = {name: _int(f"{name} degree: the size of mesh axis '{name}' (when cluster.mesh "
                       f"is omitted, the mesh is built from dp, pp, tp)") for name in PARALLEL_AXES}
_TRAINING = {
    "optimizer": _enum(OPTIMIZERS, "optimizer of every step", "sgd"),
    "lr": {"type": "number", "exclusiveMinimum": 0, "default": 0.01,
           "description": "learning rate"},
}

#: workload keys of each kind (besides kind, dtype, seed)
_WORKLOAD = MappingProxyType({
    "collective": {
        "op": _enum(COLLECTIVE_OPS, "the collective every device calls", "all_reduce"),
        "size": {"description": "bytes of each device's input: an integer or a size with a "
                                "unit (8B, 64KiB, 1MiB)", "default": "1MiB",
                 "anyOf": [{"type": "integer", "minimum": 0},
                           {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*[A-Za-z]*\s*$"}]},
        "calls": _int("back-to-back calls per step", 1, 1),
    },
    "matmul": {
        "m": _int("rows of A and C", 1, 64), "k": _int("columns of A, rows of B", 1, 64),
        "n": _int("columns of B and C", 1, 64),
        "backward": _bool("also compute dA = dC B^T and dB = A^T dC"),
    },
    "ffn": {
        "batch": _int("batch size B of x (B, S, d_model)", 1, 4),
        "seq": _int("sequence length S", 1, 8), "d_model": _int("model width d", 1, 16),
        "d_ff": _int("hidden width of the FFN", 1, 64),
        "activation": _enum(FFN_ACTIVATIONS, "activation", "gelu"),
        "backward": _bool("also run the backward pass (dx and every parameter gradient)"),
    },
    "mlp": {
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 2,
                  "default": [16, 32, 32, 32, 8],
                  "description": "layer widths: inputs, hidden..., outputs"},
        "batch": _int("samples per step (the whole batch, split over dp and micro-batches)",
                      1, 48),
        "activation": _enum(MLP_ACTIVATIONS, "activation of the hidden layers", "relu"),
        "loss": _enum(LOSSES, "loss", "mse"),
        **_TRAINING,
    },
    "transformer": {
        "model": {"type": "string", "description": "a preset (vcluster model list) or a "
                  "Hugging Face config.json: the model's shapes and blocks; the shape keys "
                  "written beside it override it (layers: a proxy of fewer layers)"},
        "hidden": _int("hidden size h", 1, 16), "layers": _int("transformer layers", 1, 4),
        "heads": _int("attention heads (divide hidden)", 1, 4),
        "seq": _int("sequence length", 1, 8), "vocab": _int("vocabulary size", 1, 32),
        "batch": _int("global batch (sequences per step)", 1, 8),
        "arch": _enum(ARCHS, "gpt (LayerNorm, learned positions, gelu MLP 4h) or llama "
                      "(RMSNorm, RoPE, grouped-query attention, SwiGLU)", "gpt"),
        "kv_heads": _int("llama: key/value heads (divide heads; default heads)"),
        "ffn_hidden": _int("llama: SwiGLU width (default Llama's rule, 256-multiple of 8h/3)"),
        "head_dim": _int("llama: each attention head's dimension, even, independent of hidden "
                         "(Qwen3: 128; default hidden/heads)"),
        "qk_norm": _bool("llama: an RMSNorm of width head_dim on every query and key head "
                         "before RoPE (Qwen3, OLMo 2)"),
        "window": _int("llama: sliding-window attention, each query attending to its last "
                       "window positions (Mistral 4096, GPT-OSS 128; omit: none)"),
        "window_layers": {"type": "array", "items": {"type": "integer", "minimum": 0},
                          "minItems": 1,
                          "description": "llama: the layers with the window (GPT-OSS: "
                                         "[0, 2, 4, ...]; omit: every layer)"},
        "attention_sinks": _bool("llama: attention sinks, one learned logit per query head "
                                 "in every softmax's denominator (GPT-OSS)"),
        "qkv_bias": _bool("llama: biases on the attention's q, k and v projections "
                          "(Qwen2/Qwen2.5, GPT-OSS)"),
        "out_bias": _bool("llama: a bias on the attention's output projection, added after "
                          "the tensor-parallel reduction (GPT-OSS)"),
        "tie_embeddings": _bool("the output head is the word embedding's transpose (GPT-2, "
                                "MPT, Gemma)"),
        "fp8": _bool("simulation: the transformer layers' linear GEMMs priced at the "
                     "hardware's FP8 peak, as Transformer Engine runs them (simulate gpt "
                     "--fp8; a preset or file with an FP8 peak; the emulated math is "
                     "unchanged); the same as gemm_format: fp8"),
        "gemm_format": _enum(["fp8", "fp8-row", "fp8-block", "mxfp8", "nvfp4", "mxfp4"],
                             "simulation: the transformer layers' linear GEMMs in this "
                             "format (simulate train --gemm-format): fp8 one scale per "
                             "tensor, fp8-row a scale per row (PyTorch's row-scaled "
                             "GEMM, 0.76 of fp8's rate), fp8-block 128-blocks, mxfp8 (Blackwell, MI355X), "
                             "nvfp4 (Blackwell), mxfp4 (Blackwell, MI355X), each at its "
                             "dtype's peak and measured share; refused on hardware without "
                             "it; the emulated math is unchanged"),
        "experts": _int("mixture of experts: experts per layer (0: a dense MLP)", 0, 0),
        "moe_top_k": _int("experts each token is routed to, 1 to experts (DeepSeek-V3, "
                          "Qwen3: 8)", 1, 2),
        "moe_ffn_hidden": _int("each expert's SwiGLU width (default ffn_hidden)"),
        "moe_router": _enum(["softmax", "sigmoid"], "the router's scores (DeepSeek-V3: "
                            "sigmoid, gates normalised over the top k)", "softmax"),
        "moe_groups": {"type": "array", "items": {"type": "integer", "minimum": 1},
                       "minItems": 2, "maxItems": 2,
                       "description": "group-limited routing [n_group, topk_group]: each "
                                      "token chooses among its topk_group best groups of "
                                      "experts (DeepSeek-V3: [8, 4])"},
        "moe_bias_update_rate": {"type": "number", "minimum": 0, "default": 0.0,
                                 "description": "DeepSeek-V3's auxiliary-loss-free balancing: "
                                                "the per-expert choice bias's step (0: none)"},
        "moe_router_bias": _bool("a bias per expert on the router's logits, l = x W_r + b_r "
                                 "(GPT-OSS)"),
        "moe_expert_bias": _bool("biases on every routed expert's gate, up and down "
                                 "projections (GPT-OSS); b_down is added before the routing "
                                 "weight"),
        "moe_dense_layers": {"type": "array", "items": {"type": "integer", "minimum": 0},
                             "description": "layers whose MLP stays dense among the MoE "
                                            "ones (DeepSeek-V3: [0, 1, 2])"},
        "moe_aux_coef": {"type": "number", "minimum": 0, "default": 0.01,
                         "description": "alpha of the Switch load-balancing loss (0: none, "
                                        "as DeepSeek-V3's auxiliary-loss-free routing)"},
        "moe_shared_ffn_hidden": _int("the always-on shared experts' total SwiGLU width "
                                      "(0: none)", 0, 0),
        "moe_routed_scaling": {"type": "number", "exclusiveMinimum": 0, "default": 1.0,
                               "description": "the routed experts' gate factor "
                                              "(DeepSeek-V3: 2.5)"},
        "capacity_factor": {"type": "number", "exclusiveMinimum": 0,
                            "description": "expert capacity = ceil(factor x tokens x k / E); "
                                           "tokens beyond it are dropped (omit: dropless)"},
        **_TRAINING,
    },
    SERVING_KIND: {     # docs/scenario.md ("kind: inference"); checked in workloads/inference.py
        "model": {"type": "string", "description": "a preset (vcluster model list) or a "
                  "Hugging Face config.json: the served model; the shape keys written beside "
                  "it override it (a proxy for emulation: layers, hidden, ...). Omitted: a "
                  "Llama of the shape keys"},
        "hidden": _int("hidden size h", 1, 16), "layers": _int("transformer layers", 1, 2),
        "heads": _int("attention heads", 1, 4),
        "kv_heads": _int("key/value heads (divide heads; default heads)"),
        "head_dim": _int("each head's dimension (default hidden/heads)"),
        "ffn_hidden": _int("SwiGLU width (default Llama's rule, 256-multiple of 8h/3)"),
        "vocab": _int("vocabulary size", 1, 32),
        "experts": _int("mixture of experts: experts per layer (0: a dense MLP)", 0, 0),
        "moe_top_k": _int("experts each token is routed to", 1, 2),
        "moe_ffn_hidden": _int("each expert's SwiGLU width (default ffn_hidden)"),
        "requests": _int("requests to serve (vllm bench --num-prompts; default: the "
                         "length of a per-request list, else 8)"),
        "input_len": _lengths("prompt tokens of each request, or one per request", 32),
        "output_len": _lengths("output tokens of each request (generation ignores "
                               "end-of-sequence), or one per request", 8),
        "range_ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1, "default": 0.0,
                        "description": "lengths drawn uniformly within +-ratio of input_len "
                                       "and output_len (vllm bench --random-range-ratio)"},
        "prefix_len": _int("tokens every prompt starts with, shared by all (a system prompt; "
                           "prompts are prefix_len + input_len long; vllm bench "
                           "--random-prefix-len)", 0, 0),
        "arrival_steps": {"type": "array", "items": {"type": "integer", "minimum": 0},
                          "minItems": 1, "description": "emulation: the engine step each "
                          "request arrives at, one per request (default: all at step 0)"},
        "rate": _rate("simulation: requests per second (Poisson, gamma with burstiness; "
                      "inf: all at once)", "inf"),
        "burstiness": _rate("simulation: gamma shape of the inter-arrival times (1: "
                            "Poisson; inf: evenly spaced)", 1.0),
        "concurrency": _int("simulation: most requests outstanding, a new one sent when one "
                            "finishes (vllm bench --max-concurrency; omit: no limit)"),
        "trace": {"type": "string", "description": "run.mode simulate: requests from a CSV "
                  "file with columns arrival_s,input_len,output_len (relative to the "
                  "scenario file), instead of requests, lengths and rate"},
    },
})

#: parallel keys of each kind
_PARALLEL = MappingProxyType({
    "collective": {
        "axis": dict(_AXES, default=None,
                     description="the mesh axes of each group (null: all devices)"),
        "algorithm": _enum(ALGORITHMS, "collective algorithm (auto: the emulator's choice)",
                           "auto"),
    },
    "matmul": {
        "policy": _enum(MATMUL_POLICIES, "a named policy laid over the mesh axes in order "
                        "(docs/scenario.md gives each one's layouts)"),
        "layouts": {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
                    "description": "explicit layouts of A (m, k), B (k, n), C (m, n)",
                    "properties": {"a": _LAYOUT, "b": _LAYOUT, "c": _LAYOUT}},
    },
    "ffn": {
        "policy": _enum(FFN_POLICIES, "FeedForward sharding policy", "Megatron"),
        "tp": dict(_AXES, default="tp", description="tensor-parallel mesh axes"),
        "dp": dict(_AXES, default=None, description="data-parallel mesh axes (null: none)"),
    },
    "mlp": {
        "schedule": _enum(SCHEDULES, "pipeline schedule", "1f1b"),
        "microbatches": _int("micro-batches per step", 1, 4),
        "virtual_stages": _int("stages per pipeline rank (interleaved_1f1b only; default 2)"),
        **_DEGREES,
    },
    "transformer": {
        "schedule": _enum(SCHEDULES, "pipeline schedule", "1f1b"),
        "micro_batch": _int("sequences per micro-batch", 1, 1),
        "virtual_stages": _int("stages per pipeline rank (interleaved_1f1b only; default 2)"),
        "sequence_parallel": _bool("Megatron sequence parallelism"),
        "recompute": _enum(RECOMPUTE, "activation recomputation", "none"),
        "recompute_modules": {"type": "array", "uniqueItems": True, "default": ["core_attn"],
                              "items": {"enum": list(RECOMPUTE_MODULES_MEGATRON)},
                              "description": "with recompute selective: the modules re-run "
                              "in the backward (Megatron-Core's --recompute-modules; "
                              "modelled: core_attn, layernorm, mlp, mla_up_proj, moe_act)"},
        "attention": _enum(AttentionKernel.values(), "the attention kernel a real "
                           "run uses (flash: no s² scores kept; flash-v1: the same, a "
                           "kernel built for Ampere as in 2022-23, priced apart)", "flash"),
        "tp_overlap": _enum(TPOverlap.values(), "tensor parallelism's backward: each "
                            "column-parallel linear's input-gradient reduction overlapping "
                            "its weight gradient, as Megatron's (backward), or every TP "
                            "collective blocking (none)", "backward"),
        "grad_reduce_dtype": _enum(GradReduceDtype.values(), "the dtype of the data-parallel "
                                   "gradient reductions: the gradients' own (model) or "
                                   "float32, twice the bytes of 16-bit gradients (fp32: "
                                   "Megatron under bf16, FSDP's reduce_dtype=float32)",
                                   "model"),
        "distributed_optimizer": _bool("optimizer state sharded over dp (Megatron's "
                                       "distributed optimizer, ZeRO-1: emulated and in "
                                       "the memory model)"),
        **_DEGREES,
        "cp": _int("context-parallel degree: the sequence split over mesh axis 'cp' "
                   "(ring attention; the mesh is built dp, pp, cp, tp)"),
        "cp_algorithm": _enum(CP_ALGORITHMS, "context-parallel attention: K/V passed "
                              "around the cp ring, or all-gathered", "ring"),
        "ep": _int("expert-parallel degree: the experts split over mesh axis 'ep', carved "
                   "out of the data-parallel ranks (divides dp and experts)"),
        "first_stage_layers": _int("layers of the first pipeline stage (the others share "
                                   "the rest evenly; 0: the embedding alone; default an "
                                   "even split)", minimum=0),
        "last_stage_layers": _int("layers of the last pipeline stage (the others share the "
                                  "rest evenly; 0: the head alone; default an even split)",
                                  minimum=0),
        "moe_dispatcher": _enum(["alltoall", "allgather", "flex"], "how an MoE layer's "
                                "tokens reach their experts: all_to_all over the expert "
                                "group, all-gather the group's tokens and reduce-scatter the "
                                "experts' outputs, or flex (DeepEP / HybridEP: each token "
                                "once per destination rank)", "alltoall"),
        "moe_ep_node_ranks": _int("flex only: the expert group's ranks per node (scale-up "
                                  "domain), DeepEP's internode path: each token crosses "
                                  "the network once per destination node and is forwarded "
                                  "over NVLink there; ep a multiple of it (default: the "
                                  "group in one node)"),
        "moe_comm_overlap": _bool("Megatron-Core's MoE expert-parallel overlap (combined "
                                  "1F1B): the steady state's forward and backward of two "
                                  "micro-batches run together, each one's token "
                                  "all-to-alls overlapping the other's compute"),
        "etp": _int("expert tensor parallelism: tp (the default: each expert split over "
                    "tp) or 1 (experts whole; the ep group made of whole tp groups, ep = "
                    "tp x a divisor of dp; needs sequence_parallel)"),
    },
    SERVING_KIND: {
        "tp": _int("tensor-parallel degree of each replica (mesh axis tp)", 1, 1),
        "pp": _int("pipeline stages of each replica (mesh axis pp)", 1, 1),
        "ep": _int("MoE: 1 (every expert split over tp) or tp (experts whole, spread over "
                   "the tp ranks: vLLM's --enable-expert-parallel)", 1, 1),
        "replicas": _int("simulation: engine replicas behind the router (the decode pool "
                         "when prefill_replicas > 0); emulation serves one", 1, 1),
        "prefill_replicas": _int("simulation: prefill-only replicas, a disaggregated "
                                 "deployment (the KV moved over the network)", 0, 0),
        "router": _enum(Router.values(), "simulation: how requests are spread over the "
                        "replicas", "round_robin"),
    },
})

_HARDWARE_OBJECT = {
    "type": "object", "additionalProperties": False,
    "description": "exactly one of name, file, spec; plus dtype and calibration",
    "properties": {
        "name": {"type": "string", "description": "a preset (vcluster hardware list) or "
                                                  "'localhost' (this machine, calibrated)"},
        "file": {"type": "string", "description": "a hardware YAML file (relative to the "
                                                  "scenario file)"},
        "spec": {"type": "object", "description": "an inline hardware description (the "
                                                  "fields of a hardware YAML file)"},
        "dtype": _enum(HARDWARE_DTYPES, "the datasheet peak that prices every FLOP", "fp32"),
        "calibration": {"type": "string", "description": "localhost only: a saved "
                        "calibration (vcluster hardware calibrate --out FILE) instead of "
                        "calibrating (~20 s, once per run and cluster size)"},
    },
}

_SECTIONS = {
    "name": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]+$",
             "description": "scenario name (default: the file name without .yaml)"},
    "description": {"type": "string", "description": "free text, shown in the report"},
    "cluster": {
        "type": "object", "additionalProperties": False, "description": "the virtual cluster",
        "properties": {
            "mesh": {"type": "object", "minProperties": 1, "description": "mesh axes in "
                     "order, name: size (e.g. {dp: 2, tp: 4})",
                     "propertyNames": {"pattern": _IDENT},
                     "additionalProperties": {"type": "integer", "minimum": 1}},
            "devices": _int("number of devices; must equal the product of the mesh sizes"),
            "array_module": _enum(ArrayModule.values(), "the devices' array module", "numpy"),
        },
    },
    "hardware": {"description": "hardware for simulation: a preset name, 'localhost', a "
                                "YAML file, or an object", "default": "a100-80gb-dgx",
                 "anyOf": [{"type": "string"}, _HARDWARE_OBJECT]},
    "workload": {
        "type": "object", "required": ["kind"], "description": "what runs on the devices",
        "properties": {"kind": _enum(KINDS, "the workload"),
                       "dtype": _enum(DTYPES, "element type (float16: simulate only, "
                                              "for 16-bit traffic at cluster scale)", "float64"),
                       "seed": _int("seed of the inputs and parameters", 0, 0)},
    },
    "parallel": {"type": "object", "description": "how the workload is split (keys depend "
                                                  "on workload.kind)"},
    "run": {
        "type": "object", "additionalProperties": False, "description": "what to do",
        "properties": {
            "mode": _enum(MODES, "emulate (real processes), simulate (timing model on "
                                 "the hardware), or both", "emulate"),
            "steps": _int("steps (repetitions of the op, or training steps)", 1, 1),
            "warmup": _int("untimed runs of the program before the measured one (emulate): "
                           "the first run pays for start-up (first touches of memory, "
                           "devices that start apart)", 0, 1),
            "check": _bool("compare the result with the unsharded numpy reference (emulate)"),
            "tolerance": {"type": "number", "minimum": 0, "description": "largest allowed "
                          "max |result - reference| / max |reference| (default 1e-4 for "
                          "float32, 1e-9 for float64)"},
        },
    },
    "data_parallel": {
        "type": "object", "additionalProperties": False,
        "description": "how the replicas of a training workload (mlp, transformer) combine "
                       "their gradients: all-reduce (ddp), ZeRO (zero) or a parameter "
                       "server (ps)",
        "properties": {
            "mode": _enum(DATA_PARALLEL_MODES, "ddp: gradients all-reduced over dp (the "
                          "default); zero: ZeRO-1/2/3 over dp (zero_stage); ps: a "
                          "parameter server (servers + parallel.dp workers on one mesh "
                          "axis 'ps')", "ddp"),
            "zero_stage": _enum(ZERO_STAGES, "mode zero only: 1 shards the optimizer "
                                "state over dp, 2 also the gradients, 3 also the "
                                "parameters (2 and 3: pp 1)", 1),
            "servers": _int("mode ps only: ranks holding the parameters (the first ranks "
                            "of the mesh; each tensor lives on one server)", 1, 1),
            "staleness": _int("mode ps only: 0 synchronous (equal to the reference); s >= "
                              "1 asynchronous, workers at most s steps apart (emulate "
                              "only, without check)", 0, 0),
        },
    },
    "engine": {
        "type": "object", "additionalProperties": False,
        "description": "workload.kind inference: the serving engine whose scheduler runs, "
                       "and its settings (vLLM's names and defaults)",
        "properties": {
            "name": _enum(ServingEngine.values(), "vllm-v1: continuous batching with chunked "
                          "prefill and recompute preemption; static: static batching",
                          "vllm-v1"),
            "max_num_batched_tokens": _int("token budget of one step (default: vllm-v1 "
                                           "8192, static none)"),
            "max_num_seqs": _int("most sequences running at once", 1, 256),
            "block_size": _int("tokens per KV-cache block", 1, 16),
            "num_blocks": _int("emulation: KV blocks on each device, block 0 the null block "
                               "(default: room for every request at its longest at once)",
                               2),
            "gpu_memory_utilization": {"type": "number", "exclusiveMinimum": 0,
                                       "maximum": 1, "default": 0.9,
                                       "description": "simulation: share of each GPU's "
                                                      "memory the engine may use"},
            "max_model_len": _int("simulation: longest sequence the engine accepts "
                                  "(default: the workload's longest)", 2),
            "enable_chunked_prefill": _bool("simulation, vllm-v1: split a prompt over steps "
                                            "(false: admit it only when it fits one step)",
                                            True),
            "hybrid_kv_cache_manager": _bool("vllm-v1: a model mixing sliding-window and "
                                             "full layers keeps one block table per KV-cache "
                                             "group, the sliding ones dropping blocks that "
                                             "left the window (vLLM's default; false: "
                                             "--disable-hybrid-kv-cache-manager)", True),
            "enable_prefix_caching": _bool("vllm-v1: keep full KV blocks after they are "
                                           "freed, so a preempted request takes back what "
                                           "nobody overwrote (vLLM v1's default)", True),
            "weight_dtype": _enum(("bf16", "fp8", "mxfp4"), "simulation: bytes per weight "
                                  "(mxfp4: an MoE's routed experts in MXFP4, the rest bf16)",
                                  "bf16"),
            "kv_cache_dtype": _enum(("auto", "fp8"), "simulation: KV-cache bytes per "
                                    "element (auto: the weights' 16-bit)", "auto"),
        },
    },
    "faults": _FAULTS_SCHEMA,
    "checkpoint": _CHECKPOINT_SCHEMA,
    "sweep": {"type": "object", "minProperties": 1, "description": "key path: list of "
              "values; one run per point of the product of the lists; under zip, lists "
              "of one length that advance together",
              "propertyNames": {"pattern": rf"^(zip|{_SWEPT}(\.[A-Za-z_][A-Za-z0-9_]*)*)$"},
              "properties": {"zip": {
                  "type": "object", "minProperties": 1, "description": "key path: list "
                  "of values, every list as long: point i takes the i-th of each",
                  "propertyNames": {"pattern": rf"^{_SWEPT}(\.[A-Za-z_][A-Za-z0-9_]*)*$"},
                  "additionalProperties": {"type": "array", "minItems": 1}}},
              "additionalProperties": {"type": "array", "minItems": 1}},
    "report": {
        "type": "object", "additionalProperties": False, "description": "the report",
        "properties": {
            "out": {"type": "string", "description": "output directory (default "
                                                     "runs/<name>; --out overrides)"},
            "formats": {"type": "array", "items": {"enum": list(REPORT_FORMATS)},
                        "uniqueItems": True, "description": "files to write besides "
                        "results.json (default: all)"},
        },
    },
}


def _kind_branch(kind: str) -> dict:
    when = {"properties": {"workload": {"properties": {"kind": {"const": kind}},
                                        "required": ["kind"]}},
            "required": ["workload"]}
    workload = {"properties": {"kind": {}, "dtype": {}, "seed": {}, **_WORKLOAD[kind]},
                "additionalProperties": False}
    parallel = {"properties": _PARALLEL[kind], "additionalProperties": False}
    return {"if": when, "then": {"properties": {"workload": workload, "parallel": parallel}}}


def scenario_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a scenario file, a fresh dict."""
    return copy.deepcopy({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://vcluster.dev/schema/scenario.json",
        "title": "vcluster scenario",
        "description": "A cluster, a workload, how it is split and what to run: "
                       "vcluster run FILE. Every key: docs/scenario.md.",
        "type": "object",
        "required": ["workload"],
        "additionalProperties": False,
        "properties": _SECTIONS,
        "allOf": [_kind_branch(kind) for kind in KINDS],
    })


# --- validation ---------------------------------------------------------------------------
_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string",
               "boolean": "true or false", "object": "a mapping", "array": "a list",
               "null": "null"}


def _allowed(error) -> tuple[str, str]:
    """(allowed, reason) for a jsonschema error."""
    v, s = error.validator, error.schema
    if v == "additionalProperties" and isinstance(s.get("properties"), dict):
        return ", ".join(sorted(s["properties"])), "unknown key"
    if v in ("enum", "const"):
        values = error.validator_value if v == "enum" else [error.validator_value]
        return ", ".join(map(str, values)), "not one of the allowed values"
    if v == "type":
        types = error.validator_value
        types = types if isinstance(types, list) else [types]
        return " or ".join(_TYPE_WORDS.get(t, t) for t in types), "wrong type"
    if v == "anyOf":
        return s.get("description", "see docs/scenario.md"), "wrong type or value"
    if v == "required":
        return f"a mapping with the keys {', '.join(error.validator_value)}", "missing key"
    if v in ("minimum", "exclusiveMinimum"):
        op = ">=" if v == "minimum" else ">"
        return f"a number {op} {error.validator_value}", "too small"
    if v in ("maximum", "exclusiveMaximum"):
        op = "<=" if v == "maximum" else "<"
        return f"a number {op} {error.validator_value}", "too large"
    if v in ("maxItems", "minItems"):
        return f"a list of {'at most' if v == 'maxItems' else 'at least'} " \
               f"{error.validator_value} items", "wrong length"
    if v == "minProperties":
        return f"at least {error.validator_value} entries", "empty"
    if v == "pattern":
        return f"text matching {error.validator_value}", "bad format"
    if v == "uniqueItems":
        return "a list without repeats", "repeated item"
    return s.get("description", "see docs/scenario.md"), error.message


def _path_of(error) -> tuple[str, object]:
    """The key path of the offending value, and the value (the unknown key for
    additionalProperties, the missing key for required)."""
    parts, value = list(error.absolute_path), error.instance
    if error.validator == "additionalProperties":
        known = error.schema.get("properties", {})
        extra = [k for k in error.instance if k not in known]
        if extra:
            return format_path(parts + [extra[0]]), extra[0]
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        return format_path(parts + missing[:1]), None
    if error.validator == "propertyNames":
        return format_path(parts + [error.instance]), error.instance
    return format_path(parts), value


def _deepest(errors):
    """The most specific error: the deepest path; the schema's own branch errors
    (if/then) come out as their causes."""
    flat = []
    for e in errors:
        if e.validator == "propertyNames" or not e.context:
            flat.append(e)
        elif e.validator == "anyOf":      # the branch of the value's type, if one matched
            deeper = [c for c in e.context if c.validator != "type"
                      or len(c.absolute_path) > len(e.absolute_path)]
            flat.extend(_deepest(deeper) if deeper else [e])
        else:
            flat.extend(_deepest(e.context))
    return flat


def _raise_first(schema: dict, instance) -> None:
    """Raise :class:`ScenarioError` for the most specific violation of ``schema``."""
    import jsonschema  # lazy: keeps vcluster --help fast
    errors = _deepest(jsonschema.Draft202012Validator(schema).iter_errors(instance))
    if not errors:
        return
    error = max(errors, key=lambda e: (len(e.absolute_path), -len(str(e.validator))))
    if "propertyNames" in error.absolute_schema_path:   # a bad key name
        path, value = format_path(list(error.absolute_path) + [error.instance]), error.instance
        allowed = ("identifiers (letters, digits, _)" if "mesh" in path
                   else "a key path under cluster, hardware, workload, parallel, run, "
                        "data_parallel or engine")
        raise ScenarioError(path, value, allowed, "bad key")
    allowed, reason = _allowed(error)
    path, value = _path_of(error)
    raise ScenarioError(path, value, allowed, reason)


def check_document(document) -> None:
    """Raise :class:`ScenarioError` for the first violation of the schema by ``document``
    (one run's document: the parser calls it once per sweep point, and nothing after the
    parser calls it)."""
    _raise_first(scenario_schema(), document)


def check_section(name: str, value) -> None:
    """Raise :class:`ScenarioError` for the first violation of section ``name``'s schema
    by ``value`` alone (the parser checks ``sweep`` so, before expanding its points)."""
    _raise_first({"type": "object", "properties": {name: copy.deepcopy(_SECTIONS[name])}},
                 {name: value})
