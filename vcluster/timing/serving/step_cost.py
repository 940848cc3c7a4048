"""The price of one engine step: :class:`ServingCostModel` turns a step's batch (each
scheduled sequence's new tokens n_i, the context c_i its last query sees, whether it
samples) into seconds on a :class:`~vcluster.timing.hardware.HardwareSpec`, per layer from
the hardware model, as vLLM v1 runs the step on one replica of tp × pp GPUs.

Notation: T = Σ n_i tokens, S sampled rows, D decode rows (n_i = 1), b = 2 bytes of a bf16
activation, b_w bytes per weight, t = tp. Every kernel k costs

    t_k = t_fix + max(F_k / R, B_k / BW)     R: achieved FLOP/s, BW: achieved HBM bytes/s

(:meth:`DeviceSpec.compute_time_s <vcluster.timing.hardware.DeviceSpec.compute_time_s>`'s
roofline), where t_fix is :data:`GRAPH_KERNEL_FIXED_US` inside a CUDA graph (fitted: see
its comment) and, launched eagerly, that plus a CUDA launch (:data:`CUDA_LAUNCH_US`) — at
least the device's ``kernel_overhead_us``.
Per layer, each distinct layer type priced once and multiplied by its count on the stage:

* GEMMs (``gemm_s``), m = T: QKV (h × (heads/t + 2·kv_local)·d), O (heads/t·d × h), a dense
  MLP's gate/up and down (m·h·f/t), an MoE's shared experts as a dense MLP; latent
  attention's down-projections (replicated), its up-projections over heads/t, and, for
  prefill rows, the up-projection of their earlier context (m = Σ (c_i − n_i)). F = 2mkn,
  B = (mk + mn)·b + kn·b_w: the weights are read every step — what makes decode
  memory-bound. With a measured kernel profile (``DeviceSpec.kernel_profile()``), F/R
  becomes the profile's tile-padded FLOPs at its fitted rate.
* attention (``attention_s``): prefill rows and decode rows as two kernels. FLOPs =
  2·heads/t·(d_qk + d_v) per (query, key) pair (:func:`~.floors.attention_pairs`: causal
  within the chunk plus the whole earlier context, a window capping it), at
  :data:`FLASH_ATTENTION_UTILIZATION` of the peak of the KV cache's dtype (BF16 under FP8
  weights: vLLM's FlashAttention reads the cache in its own dtype; FP8 over an FP8
  cache); bytes = each sequence's keys read once,
  min(c_i, w)·KV bytes per token (per layer, per GPU), plus Q and O. Latent attention
  decodes in the absorbed form (2·heads/t·(2·r_kv + d_rope) FLOPs per key) over its
  cached latent.
* MoE (``moe_s``): the router GEMM (h × E, replicated) and one fused-MoE roofline over
  the GPU's routed (token, expert) pairs — ep = 1: all T·k of them on slices of width
  f_e/t; ep = tp: T·k/ep of them (uniform routing) on whole experts — F = 2·pairs·m·h·f',
  B = the expected distinct experts reached, E·(1 − (1 − k/E)^T)
  (:func:`~.floors.expected_experts`), the GPU's share of them (P_e/t bytes each, E/ep
  whole ones: the same) read once, plus the routed activations pairs·(2h + 2·m·f')·b; six
  kernels (top-k, align, two grouped GEMMs, activation, sum). Expert parallelism is
  ep ∈ {1, tp} (:class:`serving.ServingPlan`): with ep = tp every GPU holds all T tokens
  after attention's all-reduce and computes its local experts, and the MLP's all-reduce
  combines them — vLLM's path without all-to-all kernels — so the dispatch costs nothing
  beyond that all-reduce.
* elementwise (``elementwise_s``): two fused add+RMSNorms (4·T·h·b each), rotary
  embedding on q and k, the KV-cache write (2·T·KV bytes per token), a dense MLP's
  activation (T·(m·f/t)·b), the embedding lookup (first stage) and the final norm (last).
* communication (``comm_s``): tp > 1 — two all-reduces of T·h·b per layer, as the engine
  runs them (``tp_allreduce``): ``vllm-custom`` (the default) — vLLM's custom all-reduce
  where vLLM uses it (:mod:`.tp_allreduce`: measured on H100, one node, up to 8 MiB), NCCL
  elsewhere; ``nccl`` — :func:`~vcluster.timing.collective_cost.collective_time_s` over
  the stage's tp ranks, NCCL's algorithm choice; pp > 1 — per stage boundary vLLM's
  ``send_tensor_dict`` of the hidden states and the residual, 2·T·h·b: each tp rank sends
  its 1/t slice to its peer and the next stage all-gathers them (``pp_send_s``).
* LM head (``lm_head_s``, last stage): the S sampled rows only, S × h × V/t, the
  all-gather of their logits (S·V·b gathered) and the sampler over them
  (:data:`SAMPLER_BYTES_PER_LOGIT` per logit).
* per-step overhead (``overhead_s``): ``step_overhead_s`` + ``per_sequence_overhead_s`` ×
  sequences: the scheduler, input preparation, sampling bookkeeping and output
  processing that keep the GPU waiting (module constants' sources).

Measured layer steps (``layers_s``): on a device whose ``kernels`` carry ``decode_layer``
and ``prefill_layer`` rows (``vcluster bench gpu-decode``) of a layer of the same shape —
:class:`~vcluster.timing.kernel_profile.LayerShape`: hidden, heads, kv_heads, head_dim, MLP
kind and width, tp — measured in the model's ``dtype``, with weights and KV cache of that
dtype's bytes, each such layer's compute (its GEMMs, attention, norms, activation and
KV-cache write) is the fitted step of :mod:`.measured_steps` (DistServe's decode form
a + b·B + c·ΣC and prefill form a + b·T + c·T²; a mixed step the sum less one shared fixed
part) instead of the kernels above; its tp all-reduces, the LM head, the embedding and
final norm, pipeline sends and the per-step overhead stay as above, and ``total_s`` stays
at least the floor. The measured layer has no rotary embedding (one elementwise kernel of
2·(q + kv)·b bytes per token in vLLM, under 1% of a layer's step) and runs PyTorch's eager
kernels back to back, not vLLM's fused ones. A layer of any other shape (MoE, latent or
sliding-window attention included), rows that cannot be fitted, or another dtype: the
analytic price, unchanged.

CUDA graphs (vLLM v1 ≥ 0.11's FULL_AND_PIECEWISE, ``cudagraph_max_tokens``: its largest
capture size, 512): a decode-only step of at most that many tokens replays one full graph
(every kernel at the graph's fixed cost); a mixed or prefill step that small runs piecewise
graphs (attention kernels eager); a larger step runs eagerly. Batches are not padded up to
the next capture size as vLLM pads them (the padded rows of a memory-bound decode step cost
little).

Stages. Each pipeline stage's compute and tp communication is ``stage_s`` (the last
holds the LM head); ``total_s`` = Σ stage_s + Σ pp_send_s + overhead_s, the step's
latency through the pipeline. How stages of different steps overlap (vLLM v1 keeps pp
batches in flight) is the simulator's to decide from ``stage_s``.

Never below the floor: ``floor_s`` is :class:`~.floors.FloorModel`'s floor of the same
work (bytes over datasheet bandwidth, FLOPs over datasheet peak), and ``total_s`` is at
least it. The parts above count every byte and FLOP the floor does, at no more than
datasheet rates, so their sum is never below it (a test sweeps it); ``total_s`` takes the
max anyway.

Speed: the layout's shapes are fixed at construction; a call does a few numpy reductions
over the rows and one vectorised roofline over every GEMM of the model (Llama-3.1-70B at
tp 8 with 256 decode rows: 55–65 µs per call on the 2-core development machine, from rows
or from an EngineStep). Everything but attention, measured layers and the floor depends
only on (tokens, sampled rows, prefill rows' earlier context), which a serving run
repeats step after step: :meth:`ServingCostModel.price` keeps those parts per
key (``_memo``), so a repeated key costs the attention loop and the floor alone.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from modeling.spec import LatentAttention, ModelSpec, MoE
from serving.memory import check_layout, kv_heads_per_rank, vllm_stage_layers

from ..collective_cost import Collective, collective_cost, nccl_algorithms
from ..hardware import DTYPE_BYTES, HardwareSpec, canonical_dtype
from ..kernel_profile import TILE
from .floors import FloorModel, StepShape, expected_experts, shape_of
from .measured_steps import layer_shape, measured_layer_steps
from .tp_allreduce import tp_allreduce_s

__all__ = ["ServingCostModel", "StepTime", "STEP_OVERHEAD_S", "CUDA_LAUNCH_US",
           "GRAPH_KERNEL_FIXED_US", "TP_ALLREDUCE",
           "FLASH_ATTENTION_UTILIZATION", "SAMPLER_BYTES_PER_LOGIT", "CUDAGRAPH_MAX_TOKENS",
           "step_rows"]

# Per-step time the GPU waits on the engine's CPU work (schedule, prepare inputs, sample,
# process outputs). vLLM's v0.6.0 performance blog (2024-09-05) profiled Llama 3 8B on one
# H100 before that release: the API server took 33% of the time, scheduling and input
# preparation 29%, the GPU 38%; v0.6's multi-step scheduling and asynchronous output
# processing, then v1's separate engine-core process, took most of it off the step's
# critical path. Peers bracket what is left: BLIS's roofline charges 50 us per step
# (inference-sim hardware_config.json), InferSim 5 ms per decode step (its research note,
# docs/research/roofline-v2-improvement). We take 1 ms, to be calibrated on "fit" rows.
STEP_OVERHEAD_S = 1.0e-3
#: how tensor-parallel all-reduces are priced: vLLM's custom kernel where vLLM uses it, or NCCL
TP_ALLREDUCE = ("vllm-custom", "nccl")
# The fixed cost of one kernel inside a CUDA-graph-replayed decode step: a small, latency-
# bound kernel's minimum duration and the gap to the next. FITTED on the one `fit` row of
# the batch-latency table (serving_measured.csv, vllm-ci-9515-latency: Llama-3-70B TP4 on
# H200, batch 8, 32 in / 128 out, 2,077.5 ms): 5 us gives -4.7%, 6 us +0.3% (2 us, the
# device's 5 us less a ~3 us CUDA launch, gave -19.5%). The held-out rows of the same table then
# land at -0.5% (Llama-3.1-8B TP1) and -5.8% (Mixtral-8x7B TP2). Which constant to fit was
# chosen looking at all three rows (each missed by ~40 us per dense layer, ~80 per MoE
# layer: per kernel, not per step); its value on the fit row alone (docs/serving.md).
GRAPH_KERNEL_FIXED_US = 6.0
# What a kernel launched eagerly adds to it: a CUDA launch, ~3-5 us (vcluster.timing.presets'
# KERNEL_OVERHEAD_US comment), the lower end; a CUDA graph replays the launches on the device.
CUDA_LAUNCH_US = 3.0
# FlashAttention-3's forward reaches 75% of the H100's BF16 peak ("up to 740 TFLOPs/s (75%
# utilization)", Shah et al. 2024, arXiv 2407.08608); FlashAttention-2's 50-73% of the
# A100's (Dao 2023, arXiv 2307.08691). Attention computes at peak x min(e_max, this).
FLASH_ATTENTION_UTILIZATION = 0.75
# The sampler's traffic per logit of a sampled row: the bf16 logit read (2), its fp32 copy
# written (4) and read again by the argmax or the softmax (4) — greedy or plain sampling.
SAMPLER_BYTES_PER_LOGIT = 10
# vLLM's CompilationConfig default largest CUDA-graph capture size (max_capture_size 512).
CUDAGRAPH_MAX_TOKENS = 512

_US = 1e-6
_ACT = 2            # bytes per activation element (bf16)
# where a GEMM's m comes from: the step's tokens, its sampled rows, or the earlier
# context of its prefill rows (latent attention's context up-projection)
_M_TOKENS, _M_SAMPLES, _M_CONTEXT = 0, 1, 2
_GEMM, _MOE, _HEAD = 0, 1, 2    # which part of the breakdown a GEMM belongs to
# price()'s memo of context-free parts: cleared when it holds this many keys (a key is a
# step's (tokens, samples, prefill context); a 1,000-request run has ~10^3-10^4)
_MEMO_ENTRIES = 65536


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds: ``total_s`` (never below ``floor_s``) and its parts —
    ``gemm_s``, ``attention_s``, ``moe_s``, ``elementwise_s``, ``comm_s`` (tp collectives and
    pipeline sends), ``lm_head_s``, ``overhead_s``, ``layers_s`` (the layers priced from
    measured layer steps; 0 without them) — summed over the stages; ``stage_s``
    each stage's compute and tp communication, ``pp_send_s`` each stage boundary's
    transfer; ``tokens`` T, ``samples`` S, ``cuda_graph`` "full", "piecewise" or "none"."""

    total_s: float
    floor_s: float
    gemm_s: float = 0.0
    attention_s: float = 0.0
    moe_s: float = 0.0
    elementwise_s: float = 0.0
    comm_s: float = 0.0
    lm_head_s: float = 0.0
    overhead_s: float = 0.0
    layers_s: float = 0.0
    stage_s: tuple = ()
    pp_send_s: tuple = ()
    tokens: int = 0
    samples: int = 0
    cuda_graph: str = "none"

    @property
    def parts_s(self) -> float:
        """The parts' sum (equal to total_s unless the floor binds)."""
        return (self.gemm_s + self.attention_s + self.moe_s + self.elementwise_s
                + self.comm_s + self.lm_head_s + self.overhead_s + self.layers_s)

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage with the step's overhead: the interval between steps when
        the pipeline's stages overlap (pp > 1)."""
        return max(self.stage_s, default=0.0) + self.overhead_s

    def __repr__(self) -> str:
        ms = 1e3
        stages = ", ".join(f"{s * ms:.3f}" for s in self.stage_s)
        return (f"StepTime(total={self.total_s * ms:.3f} ms, floor={self.floor_s * ms:.3f} ms,"
                f" tokens={self.tokens}, samples={self.samples}, gemm={self.gemm_s * ms:.3f},"
                f" attention={self.attention_s * ms:.3f}, moe={self.moe_s * ms:.3f}, "
                f"elementwise={self.elementwise_s * ms:.3f}, comm={self.comm_s * ms:.3f}, "
                f"lm_head={self.lm_head_s * ms:.3f}, overhead={self.overhead_s * ms:.3f}, "
                + (f"measured layers={self.layers_s * ms:.3f}, " if self.layers_s else "")
                + f"stages=[{stages}] ms, cuda_graph={self.cuda_graph!r})")


def step_rows(step) -> tuple[list, list, int]:
    """(decode rows' contexts, other rows' (num_new_tokens, context), samples) of ``step``:
    a :class:`serving.EngineStep` (its scheduled requests' ``num_new_tokens``,
    ``num_computed_tokens`` + ``num_new_tokens`` and ``samples``), or a sequence of
    (num_new_tokens, context) pairs — each sampling — or (num_new_tokens, context,
    samples) triples. A decode row is one with a single new token."""
    scheduled = getattr(step, "scheduled", None)
    if scheduled is not None:
        decode, prefill, samples = [], [], 0
        for r in scheduled:
            n = r.num_new_tokens
            if n == 1:
                decode.append(r.num_computed_tokens + 1)
            else:
                prefill.append((n, r.num_computed_tokens + n))
            samples += r.samples
        return decode, prefill, samples
    try:
        rows = list(step)
        width = {len(r) for r in rows}
    except TypeError:
        raise TypeError(f"step must be an EngineStep or a sequence of (num_new_tokens, "
                        f"context[, samples]) rows, got {step!r}") from None
    if width <= {2}:
        samples = len(rows)
    elif width == {3}:
        samples = sum(1 for r in rows if r[2])
        rows = [(n, c) for n, c, _ in rows]
    else:
        raise ValueError(f"step rows must all be (num_new_tokens, context) or all "
                         f"(num_new_tokens, context, samples), got lengths {sorted(width)}")
    decode = [c for n, c in rows if n == 1]
    prefill = [] if len(decode) == len(rows) else [(n, c) for n, c in rows if n != 1]
    return decode, prefill, samples


def _affine(collective: Collective, group: tuple, hardware: HardwareSpec) -> np.ndarray:
    """(α, β) rows of each algorithm NCCL chooses from for ``collective`` over ``group``:
    each algorithm's cost is affine in the bytes (collective_cost's table), so two sizes
    fit it and ``min(α + β·n)`` is ``collective_time_s(collective, n, group)`` (tested)."""
    if len(group) < 2:
        return np.zeros((0, 2))
    n1, n2 = float(2**20), float(2**21)
    rows = []
    for alg in nccl_algorithms(collective, group, hardware):
        t1 = collective_cost(collective, n1, group, hardware, alg).time_s
        t2 = collective_cost(collective, n2, group, hardware, alg).time_s
        rows.append((2 * t1 - t2, (t2 - t1) / (n2 - n1)))
    return np.array(rows)


def _time(fit: np.ndarray, nbytes: float) -> float:
    if not len(fit) or nbytes <= 0:
        return 0.0
    return float((fit[:, 0] + fit[:, 1] * nbytes).min())


@dataclass(frozen=True)
class ServingCostModel:
    """Step prices of ``spec`` served on ``hardware`` with ``tp`` × ``pp`` GPUs (``ep``: 1,
    or tp for expert parallelism), computing in ``dtype`` with weights of
    ``weight_bytes_per_param`` and a KV cache of ``kv_bytes_per_element`` (module docstring
    for the model and each constant's source). ``graph_kernel_overhead_s`` None:
    :data:`GRAPH_KERNEL_FIXED_US`; ``eager_kernel_overhead_s`` None: that plus
    :data:`CUDA_LAUNCH_US`, at least the device's ``kernel_overhead_us``;
    ``cudagraph_max_tokens`` 0: no CUDA graphs (``enforce_eager``)."""

    spec: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "bf16"
    weight_bytes_per_param: float = 2
    kv_bytes_per_element: int = 2
    expert_weight_bytes_per_param: float | None = None
    step_overhead_s: float = STEP_OVERHEAD_S
    tp_allreduce: str = "vllm-custom"
    per_sequence_overhead_s: float = 0.0
    cudagraph_max_tokens: int = CUDAGRAPH_MAX_TOKENS
    eager_kernel_overhead_s: float | None = None
    graph_kernel_overhead_s: float | None = None
    floors: FloorModel = field(init=False, repr=False, compare=False)
    _c: dict = field(init=False, repr=False, compare=False)
    _memo: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        check_layout(self.spec, self.tp, self.pp, self.ep)
        if not isinstance(self.hardware, HardwareSpec):
            raise TypeError(f"hardware must be a HardwareSpec, got {self.hardware!r}")
        if self.tp_allreduce not in TP_ALLREDUCE:
            raise ValueError(f"tp_allreduce={self.tp_allreduce!r}: allowed "
                             f"{', '.join(TP_ALLREDUCE)}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("step_overhead_s", "per_sequence_overhead_s"):
            _seconds(name, getattr(self, name))
        device = self.hardware.device
        if self.graph_kernel_overhead_s is None:
            object.__setattr__(self, "graph_kernel_overhead_s", GRAPH_KERNEL_FIXED_US * _US)
        if self.eager_kernel_overhead_s is None:
            object.__setattr__(self, "eager_kernel_overhead_s", max(
                device.kernel_overhead_us * _US,
                self.graph_kernel_overhead_s + CUDA_LAUNCH_US * _US))
        for name in ("eager_kernel_overhead_s", "graph_kernel_overhead_s"):
            _seconds(name, getattr(self, name))
        m = self.cudagraph_max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"cudagraph_max_tokens={m!r}: allowed an integer >= 0 "
                             f"(0: no CUDA graphs)")
        object.__setattr__(self, "floors", FloorModel(
            self.spec, self.hardware, self.tp, self.pp, self.ep, self.dtype,
            self.weight_bytes_per_param, self.kv_bytes_per_element,
            self.expert_weight_bytes_per_param))
        object.__setattr__(self, "expert_weight_bytes_per_param",
                           self.floors.expert_weight_bytes_per_param)
        object.__setattr__(self, "_c", self._constants())
        object.__setattr__(self, "_memo", {})

    @property
    def measured_layers(self) -> tuple:
        """The :class:`~.measured_steps.MeasuredLayerSteps` pricing this model's layers
        (module docstring), once each; () when every layer is priced analytically."""
        return tuple(dict.fromkeys(fit for _, fit, _ in self._c["measured"]))

    # --- construction: every shape the layout fixes -----------------------------------
    def _constants(self) -> dict:
        spec, tp, pp, device = self.spec, self.tp, self.pp, self.hardware.device
        h, b_kv = spec.hidden, self.kv_bytes_per_element
        act_in = DTYPE_BYTES[self.dtype] if self.dtype == "fp8" else _ACT
        profile = device.kernel_profile()
        gemm_rate = device.achieved_flops(self.dtype)
        # attention computes in the KV cache's dtype: FP8 only over an FP8 cache
        # (FlashAttention 3's FP8 path); FP8 weights alone leave it BF16
        attn_dtype = "fp8" if b_kv == 1 and "fp8" in device.peak_tflops else "bf16"
        attn_rate = device.peak_flops(attn_dtype) * min(device.e_max(attn_dtype),
                                                         FLASH_ATTENTION_UTILIZATION) \
            * device.sustained_compute_ratio
        if profile is not None and profile.gemm is not None:
            gemm_rate = profile.gemm.flops_per_s
        if profile is not None and "attention" in profile.kinds:
            attn_rate = 1.0 / profile.kinds["attention"].unit_s
        measured = self._measured_fits()
        steps = []          # (stage, MeasuredLayerSteps, count): layers priced as measured
        gemms = []          # (stage, part, m source, k, n, count)
        moe = []            # (stage, experts, top_k, matrices, width per GPU, count)
        attention = []      # (stage, window, prefill coef, decode coef, KV B/token, count)
        elementwise = []    # (stage, bytes per token, kernels per step, count)
        layers_per_stage = []
        for s, layers in enumerate(vllm_stage_layers(spec.num_layers, pp)):
            layers_per_stage.append(len(layers))
            for layer, count in Counter(spec.layers[i] for i in layers).items():
                att, mlp = layer.attention, layer.mlp
                fit = measured.get(layer_shape(layer, h, tp))
                if fit is not None:
                    steps.append((s, fit, count))
                    continue
                if isinstance(att, LatentAttention):
                    heads = att.heads // tp
                    if att.q_lora_rank:
                        gemms += [(s, _GEMM, _M_TOKENS, h, att.q_lora_rank, count),
                                  (s, _GEMM, _M_TOKENS, att.q_lora_rank,
                                   heads * att.qk_head_dim, count)]
                    else:
                        gemms.append((s, _GEMM, _M_TOKENS, h, heads * att.qk_head_dim, count))
                    up = heads * (att.qk_nope_head_dim + att.v_head_dim)
                    gemms += [(s, _GEMM, _M_TOKENS, h, att.kv_lora_rank + att.qk_rope_head_dim,
                               count),
                              (s, _GEMM, _M_TOKENS, att.kv_lora_rank, up, count),
                              (s, _GEMM, _M_CONTEXT, att.kv_lora_rank, up, count),
                              (s, _GEMM, _M_TOKENS, heads * att.v_head_dim, h, count)]
                    kv_tok = (att.kv_lora_rank + att.qk_rope_head_dim) * b_kv
                    rope = 2 * (heads + 1) * att.qk_rope_head_dim * _ACT
                    attention.append((s, None, heads * (att.qk_head_dim + att.v_head_dim),
                                      heads * (2 * att.kv_lora_rank + att.qk_rope_head_dim),
                                      kv_tok, count))
                else:
                    q, kv = att.q_width // tp, kv_heads_per_rank(att, tp) * att.head_dim
                    gemms += [(s, _GEMM, _M_TOKENS, h, q + 2 * kv, count),
                              (s, _GEMM, _M_TOKENS, q, h, count)]
                    kv_tok = 2 * kv * b_kv
                    rope = 2 * (q + kv) * _ACT
                    coef = att.heads / tp * 2 * att.head_dim
                    attention.append((s, att.window, coef, coef, kv_tok, count))
                per_token = 2 * 4 * h * _ACT + rope + 2 * kv_tok      # norms, rope, KV write
                kernels = 4
                if isinstance(mlp, MoE):
                    gemms.append((s, _MOE, _M_TOKENS, h, mlp.experts, count))
                    mats = mlp.expert.kind.matrices
                    # ep = 1: every routed pair on each GPU, an expert's width over tp;
                    # ep = tp: 1/ep of the pairs on each GPU, whole experts
                    share, width = (1, mlp.expert.width / tp) if self.ep == 1 \
                        else (self.ep, mlp.expert.width)
                    moe.append((s, mlp.experts, mlp.top_k, mats, width, share, count))
                    if mlp.shared_experts:
                        width = mlp.shared_experts * mlp.shared_width / tp
                        gemms += [(s, _GEMM, _M_TOKENS, h, (mats - 1) * width, count),
                                  (s, _GEMM, _M_TOKENS, width, h, count)]
                        per_token += mats * width * _ACT
                        kernels += 1
                else:
                    mats, width = mlp.kind.matrices, mlp.width / tp
                    gemms += [(s, _GEMM, _M_TOKENS, h, (mats - 1) * width, count),
                              (s, _GEMM, _M_TOKENS, width, h, count)]
                    per_token += mats * width * _ACT
                    kernels += 1
                elementwise.append((s, per_token, kernels, count))
        last = pp - 1
        gemms.append((last, _HEAD, _M_SAMPLES, h, spec.vocab // tp, 1))
        elementwise += [(0, 2 * h * _ACT, 1, 1), (last, 2 * h * _ACT, 1, 1)]  # embed, norm
        g = np.array(gemms, dtype=float)
        groups = [tuple(range(s * tp, (s + 1) * tp)) for s in range(pp)]
        return {
            "gemm_stage": g[:, 0].astype(int), "gemm_part": g[:, 1].astype(int),
            "gemm_m": g[:, 2].astype(int), "gemm_k": g[:, 3], "gemm_n": g[:, 4],
            "gemm_count": g[:, 5], "gemm_slot": (g[:, 0] * 3 + g[:, 1]).astype(int),
            "moe": tuple(moe), "attention": tuple(attention), "measured": tuple(steps),
            "elementwise": tuple(elementwise), "layers": tuple(layers_per_stage),
            "act_in": act_in, "gemm_rate": gemm_rate, "attn_rate": attn_rate,
            "padded": profile is not None and profile.gemm is not None,
            "bw": device.achieved_hbm_bytes_per_s(), "moe_rate": device.achieved_flops(
                self.dtype),
            "all_reduce": tuple(_affine(Collective.ALL_REDUCE, grp, self.hardware)
                                for grp in groups),
            # vLLM's custom all-reduce: within one node (tp dividing the node's GPUs)
            "custom_ar": device.name if self.tp_allreduce == "vllm-custom"
            and self.hardware.gpus_per_node % tp == 0 else None,
            "all_gather": tuple(_affine(Collective.ALL_GATHER, grp, self.hardware)
                                for grp in groups),
            "send": tuple(_affine(Collective.SEND, (s * tp, (s + 1) * tp), self.hardware)
                          for s in range(pp - 1)),
        }

    def _measured_fits(self) -> dict:
        """{LayerShape: MeasuredLayerSteps} of the device's measured layer steps usable
        here: in ``dtype``, with weights and KV cache of that dtype's bytes, fitted."""
        b = DTYPE_BYTES[self.dtype]
        if self.weight_bytes_per_param != b or self.kv_bytes_per_element != b:
            return {}
        fits, _ = measured_layer_steps(self.hardware.device.kernels)
        return {shape: fit for (shape, dtype), fit in fits.items() if dtype == self.dtype}

    # --- one step ------------------------------------------------------------------------
    def step_time(self, step) -> StepTime:
        """The price of ``step`` (a :class:`serving.EngineStep`, or rows of (num_new_tokens,
        context[, samples]); module docstring)."""
        decode, prefill, samples = step_rows(step)
        if not decode and not prefill:
            return StepTime(0.0, 0.0, stage_s=(0.0,) * self.pp,
                            pp_send_s=(0.0,) * (self.pp - 1))
        return self.price(shape_of(decode, prefill, samples, self.floors.windows))

    def price(self, shape: StepShape) -> StepTime:
        """The price of a step already reduced to its :class:`~.floors.StepShape`."""
        k, pp = self._c, self.pp
        t, s_rows, decode = shape.tokens, shape.samples, shape.decode_seqs
        graph = "none"
        if t <= self.cudagraph_max_tokens:
            graph = "full" if decode == shape.sequences else "piecewise"
        key = (t, s_rows, shape.prefill_context)
        fixed = self._memo.get(key)
        if fixed is None:
            if len(self._memo) >= _MEMO_ENTRIES:
                self._memo.clear()
            fixed = self._memo[key] = self._context_free(*key)
        gemm, moe, head, elementwise, comm, sends, fixed_stage = fixed
        fix_attn = self.graph_kernel_overhead_s if graph == "full" \
            else self.eager_kernel_overhead_s
        bw = k["bw"]
        # attention: prefill rows and decode rows, each one kernel (per stage; plain floats:
        # numpy's per-call cost exceeds a few stages' arithmetic, and a run prices
        # thousands of steps)
        attention = [0.0] * pp
        t_pre = t - decode
        for s, window, pre, dec, kv_tok, count in k["attention"]:
            (p_pre, p_dec), (r_pre, r_dec) = shape.pairs[window], shape.read[window]
            cost = 0.0
            if t_pre:
                cost += fix_attn + max(2.0 * pre * p_pre / k["attn_rate"],
                                       (r_pre * kv_tok + t_pre * pre * _ACT) / bw)
            if decode:
                cost += fix_attn + max(2.0 * dec * p_dec / k["attn_rate"],
                                       (r_dec * kv_tok + decode * pre * _ACT) / bw)
            attention[s] += count * cost
        # layers priced from measured layer steps (module docstring)
        layers = [0.0] * pp
        if k["measured"]:
            square = 2 * shape.pairs[None][0] - t_pre     # Σ(2P_i − n_i): T² of one prompt
            context = shape.read[None][1]
            for s, fit, count in k["measured"]:
                layers[s] += count * fit.step_s(decode, context, t_pre, square)
        stage = tuple(f + a + m for f, a, m in zip(fixed_stage, attention, layers))
        overhead = self.step_overhead_s + self.per_sequence_overhead_s * shape.sequences
        floor = self.floors.floor_s(shape)
        parts_total = sum(stage) + sum(sends) + overhead
        # positional, in StepTime's field order (a keyword call costs more, once a step)
        return StepTime(max(parts_total, floor), floor, gemm, sum(attention), moe,
                        elementwise, comm, head, overhead, sum(layers), stage, sends, t,
                        s_rows, graph)

    def _context_free(self, t: int, s_rows: int, prefill_context: int) -> tuple:
        """The parts of a step's price that depend only on its token count, sampled rows
        and prefill rows' earlier context — not on the contexts attention reads nor on
        whether the step is decode-only (a full CUDA graph or piecewise ones: the same
        fixed cost outside attention): (gemm_s, moe_s, lm_head_s, elementwise_s, comm_s,
        pp_send_s, their sum per stage). A serving run repeats these keys step after step
        (:meth:`price` keeps them in ``_memo``)."""
        k, pp = self._c, self.pp
        fix = self.eager_kernel_overhead_s if t > self.cudagraph_max_tokens \
            else self.graph_kernel_overhead_s
        bw, b_w = k["bw"], self.weight_bytes_per_param
        # GEMMs: one vectorised roofline over every GEMM of every stage
        m = np.array((t, s_rows, prefill_context), dtype=float)[k["gemm_m"]]
        kk, nn = k["gemm_k"], k["gemm_n"]
        if k["padded"]:
            flops = 2.0 * np.ceil(m / TILE) * TILE * kk * np.ceil(nn / TILE) * TILE
        else:
            flops = 2.0 * m * kk * nn
        nbytes = m * kk * k["act_in"] + kk * nn * b_w + m * nn * _ACT
        times = np.where(m > 0, fix + np.maximum(flops / k["gemm_rate"], nbytes / bw), 0.0)
        parts = np.bincount(k["gemm_slot"], weights=times * k["gemm_count"],
                            minlength=3 * pp).reshape(pp, 3)
        gemm, moe, head = parts[:, _GEMM].copy(), parts[:, _MOE].copy(), parts[:, _HEAD].copy()
        # MoE: one fused roofline per layer type (module docstring)
        for s, experts, top_k, mats, width, share, count in k["moe"]:
            per_expert = mats * self.spec.hidden * width       # one expert's share here
            pairs = t * top_k / share                          # routed pairs computed here
            f = 2.0 * pairs * per_expert
            b = (expected_experts(experts, top_k, t) / share * per_expert
                 * self.expert_weight_bytes_per_param
                 + pairs * (2 * self.spec.hidden + 2 * mats * width) * _ACT)
            moe[s] += count * (6 * fix + max(f / k["moe_rate"], b / bw))
        elementwise = np.zeros(pp)
        for s, per_token, kernels, count in k["elementwise"]:
            elementwise[s] += count * (kernels * fix + t * per_token / bw)
        # tensor-parallel all-reduces, the logits' gather and the sampler
        comm = np.zeros(pp)
        hidden_bytes = t * self.spec.hidden * _ACT
        for s in range(pp):
            nccl = _time(k["all_reduce"][s], hidden_bytes)
            reduce_s = nccl if k["custom_ar"] is None or self.tp == 1 else tp_allreduce_s(
                k["custom_ar"], self.tp, hidden_bytes, nccl)
            comm[s] = 2 * k["layers"][s] * reduce_s
        if s_rows:
            logits = s_rows * self.spec.vocab
            head[-1] += _time(k["all_gather"][-1], logits * _ACT) \
                + fix + logits * SAMPLER_BYTES_PER_LOGIT / bw
        sends = tuple(_time(k["send"][s], 2 * hidden_bytes / self.tp)
                      + _time(k["all_gather"][s + 1], 2 * hidden_bytes) for s in range(pp - 1))
        stage = gemm + moe + elementwise + comm + head
        return (float(gemm.sum()), float(moe.sum()), float(head.sum()),
                float(elementwise.sum()), float(comm.sum()) + sum(sends), sends,
                tuple(float(x) for x in stage))


def _seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r}: allowed a number of seconds >= 0")
