"""Peak memory per device of GPT (and Llama) training: parameters, gradients, optimizer state,
activations and the logits, by the formulas of the Megatron-LM papers, in the bytes of a
:class:`~vcluster.planner.precision.PrecisionPolicy` (``precision=``; default Megatron's,
whose figures this docstring gives; ``torch_amp``: PyTorch AMP's 4 + 4 + 8 bytes per
parameter; ``fp64``/``fp32``: the emulated program's own, with its own activation count,
"The emulated program" below).

Parameters on pipeline rank r (tensor-parallel degree t): its layers' 12h² + 13h each
(QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two LayerNorms 4h), divided by t
except the LayerNorms and the row-parallel biases (6h, counted whole: (12h² + 7h)/t +
6h; the column-parallel QKV bias divides by t as in the program); the first
stage also holds the word (V·h / t, vocabulary-parallel) and position (s·h) embeddings,
the last the final LayerNorm and the output projection (V·h / t; with tied embeddings,
``GPTConfig.tie_embeddings``, a copy of the word embedding on a pipeline's last stage,
nothing more when one stage holds both ends).

Bytes per parameter: Megatron-LM's mixed precision with fp32 gradient accumulation
(Narayanan et al. SC'21; the ZeRO paper's count): ``WEIGHT_BYTES`` 2 (bf16/fp16 weights)
+ ``GRAD_BYTES`` 4 (fp32 main gradients, accumulated over micro-batches) +
``OPTIMIZER_BYTES`` 12 (fp32 master weights, Adam's m and v) = 18. With the distributed
optimizer (``ParallelConfig.distributed_optimizer``: Megatron's ``--use-distributed-
optimizer``, ZeRO stage 1) the 12 are sharded over the dp ranks: 6 + 12/dp per parameter,
as Megatron-LM's distributed-optimizer documentation counts it. ``ParallelConfig.
zero_stage`` 2 also shards the gradients (2 + 16/dp, plus the largest module's full
gradient, held from its accumulation to its reduce-scatter), 3 the weights too (18/dp,
plus at most two of the largest module's weights gathered at once: the one computing
and the prefetched next) — the ZeRO paper's stages, as :mod:`pipeline_parallel.zero`
runs them.

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", 16-bit), s sequence, b micro-batch,
h hidden, a heads, t tensor-parallel degree:

=============  ====================================  ==============================
recompute      without sequence parallelism          with sequence parallelism
=============  ====================================  ==============================
none           s·b·h·(10 + 24/t + 5·a·s/(h·t))       s·b·h·(34/t + 5·a·s/(h·t))
selective      s·b·h·(10 + 24/t)                     s·b·h·34/t
full           2·s·b·h (the layer's input)           2·s·b·h/t
=============  ====================================  ==============================

The 5·a·s/(h·t) term is what unfused attention keeps for its backward: the scores (2 bytes
per entry), the softmax (2) and the dropout mask (1) of b·a/t·s² entries.
``attention="flash"`` (the default; ``"flash-v1"`` keeps the same: FlashAttention, PyTorch's SDPA, Megatron-Core's
TE attention) keeps none of them — it recomputes the scores block by block in the
backward — only the softmax's log-sum-exp, fp32 per row: 4·b·a·s/t bytes per layer. So
without recomputation flash attention keeps s·b·h·(10 + 24/t) + 4·b·a·s/t, the same as
selective recomputation plus the statistics.

Selective recomputation by module (``ParallelConfig.recompute_modules``, Megatron-Core's
``--recompute-modules``; "selective" above is its default, ``core_attn``): each
recomputed module keeps only its input, so the layer drops (16-bit) with ``layernorm``
the two norms' outputs, the attention's and the MLP's inputs, 4·s·b·h/σ (σ = t under
sequence parallelism, else 1); with ``mlp`` the dense MLP's inner tensors (GPT: W1's
output and gelu's, 16·s·b·h/t; Llama: gate, up and their product 6·s·b·f/t); with
``mla_up_proj`` the up-projected q, k and v, 2·s·b·a·(2·d_qk + d_v)/t; with ``moe_act``
each routed row's product H, 2·R·f_e/etp (of the MoE term below); without ``core_attn``
unfused attention keeps its scores (flash keeps none either way). The emulated program's
own count and PyTorch's (:func:`emulator_activation_bytes`,
:func:`torch_amp_activation_bytes`) cover the default only.

The logits: the last stage holds the fp32 logits of its micro-batch for the loss and its
gradient, 4·b·s·V/t bytes (the policy's ``logits_bytes`` per entry; PyTorch's and Megatron's
cross-entropy upcast the logits to fp32), freed before the next micro-batch.

Plain PyTorch under autocast (the ``torch_amp`` policy, ``activation_count="torch_amp"``)
is counted by its own program's saved tensors instead: :func:`torch_amp_activation_bytes`
(the LayerNorms' fp32 inputs, the linears' bf16 input and weight casts, 12 bytes a logit
at the loss's backward) and, its ``.grad`` being set to None between steps, a peak that
is the larger of the first backward's start and what follows it
(:func:`in_flight_after_first_backward`), not the sum of gradients and activations.
The same program under ``torch.compile`` (the ``torch_compile`` policy) saves the same
tensors but for a few row statistics and keeps 4 bytes a logit at the loss's backward
(Inductor fuses the loss: the bf16 logits and their bf16 gradient, no fp32 copy).

Llama (``GPTConfig(arch="llama")``; d = ``head_dim`` (default h/a), h_q = a·d, c
kv_heads, f ffn_hidden, c_l = max(c/t, 1) KV heads per rank — replicated when c < t).
Parameters per layer: (2·h·h_q + 3·h·f)/t + 2·h·d·c_l + 2h (the RMSNorm gains whole; no
biases), + 2d with QK-norm (its two gains, whole on every rank), + a/t with attention
sinks (one logit per query head, split by heads), + h_q/t + 2·d·c_l with q, k, v biases
(``qkv_bias``: b_q split by heads, b_kv laid out as W_kv) and + h with an output bias
(``out_bias``: b_o whole on every rank); the first stage adds
the word embedding V·h/t (no positions), the last the final gain and the output
projection V·h/t + h. Activations per layer and micro-batch, 16-bit, by the same
counting with no dropout: the two norms' inputs and outputs 8·s·b·h (/t with SP), q and
the attention output 4·s·b·h_q/t, k and v 4·s·b·c_l·d, SwiGLU's gate, up and product
6·s·b·f/t, so

    s·b·(8h/σ + 4·h_q/t + 4·c_l·d + 6f/t)     σ = t with sequence parallelism, else 1

(QK-norm keeps its norms' inputs too, q and k before the norm: + 2·s·b·(h_q/t + c_l·d))

Sliding-window attention (``GPTConfig.window`` w on ``window_layers``): flash attention
keeps no scores anyway; unfused attention keeps each windowed layer's b·a·s·min(s, w)
scores instead of s² (the term below takes the mean over the layers), and the
context-parallel K/V buffers are the same (every block still travels).

Multi-head latent attention (``GPTConfig.kv_lora_rank``; r_q = q_lora_rank, r_kv,
d_n + d_r = d_qk, d_v; :mod:`tensor_parallel.mla`): the attention's parameters per rank
are the replicated down-projections and their norms, h·r_q + r_q + h·(r_kv + d_r) + r_kv
(without r_q: none of them), plus (r_q·a·d_qk + r_kv·a·(d_n + d_v) + a·d_v·h)/t (without
r_q h·a·d_qk/t more) split by heads — in place of (2·h·h_q)/t + 2·h·d·c_l. Its
activations in place of 4·h_q/t + 4·c_l·d: the latents' norms' inputs and outputs
4·s·b·(r_q + r_kv) (whole on every rank: the down-projections are replicated) and q, k,
v and the output 4·s·b·a·(d_qk + d_v)/t; the shared rotary key is part of k. The
context-parallel K/V blocks are a_l·d_qk and a_l·d_v wide (the up-projected k and v
travel, not the latent).

plus flash attention's 4·b·a·s/t statistics, or unfused attention's softmax 2·a·s²·b/t
(no dropout; 2·a·s·min(s, w)·b/t on a layer with a sliding window w) without
recomputation; full recomputation keeps 2·s·b·h/σ.

Mixture of experts (``GPTConfig(experts=E)``; k = moe_top_k, f_e = moe_ffn_hidden,
``ParallelConfig(ep)``; :mod:`tensor_parallel.moe_layer`): the MLP's parameters (Llama
3·h·f/t; GPT (8h² + 4h)/t + h) become the router h·E plus the rank's E/ep experts
3·h·f_e·E/(ep·etp) (each expert's hidden dimension split over etp = tp: expert tensor
parallelism; whole when the expert group is folded over tp, etp = 1), and the shared
expert's 3·h·F_s/etp (``moe_shared_ffn_hidden``; replicated over tp when folded); with
GPT-OSS's biases, + E for the router's (``moe_router_bias``, replicated as W_r) and +
(2·f_e/etp + h)·E/ep for the experts' (``moe_expert_bias``: b_gate, b_up split as their
columns, b_down whole over etp; they count and shard with the experts). Under ZeRO the
experts' share
(optimizer state from stage 1, gradients from 2, weights at 3) is sharded over the
expert-data-parallel ranks that hold them (dp·cp/ep, folded dp·cp·tp/ep), the rest over
dp·cp.
Activations: the dense MLP's term (Llama's SwiGLU 6·s·b·f/t; GPT's 19·s·b·h of
Korthikanti's count: 2 + 16/t + 1 without SP, 19/t with it) becomes the rank's routed
rows R (those its
experts receive, :meth:`~tensor_parallel.moe_load.ExpertLoad.received` of
``ExpertLoad.skewed(..., expert_skew)`` — ep rank 0 holds the busiest expert) times
2·(h + 3·f_e/etp) (each row's input, and its slice of gate, up and product, 16-bit) plus
its routing probability, 4 bytes, which the expert's activation applies and keeps for its
backward; plus the shared expert's gate, up and product on every token, 6·s·b·F_s/t (its
slice, or folded its tokens' share). Folded, a rank routes b·s/t tokens (R from those).
The token side keeps nothing of size: Megatron-Core permutes the probabilities with the
tokens and applies them in the expert's activation (Megatron-LM !2668, "Memory efficient
token permutation", 2025-04-09, commit 2659630; Megatron-Core 0.13 on, which every
Megatron-Bridge container ships), so neither the permutation (its backward needs only the
row map) nor the unweighted un-permutation keeps the k·s·b dispatched or combined rows.
(Before that commit the combine weighted the expert outputs itself and kept them, R·h
more; until 2026-11-30 this count kept 4·k·s·b·h on the token side.)

A rank holds as many micro-batches' activations as its schedule keeps in flight at
its peak (:func:`pipelining.peak_in_flight`: m for GPipe, min(m, p - r) for 1F1B on
rank r), each for one chunk's layers.

Context parallelism (``ParallelConfig.cp``): a rank holds s/cp rows of every micro-batch,
so every activation term above is taken at s/cp (with cp > 1 the attention is the
flash form — the context-parallel kernels keep O and the log-sum-exp, as Megatron's CP
needs flash attention — so every term is linear in s and the activations divide by
cp). Added once, for the layer whose attention runs: the K/V buffers of the
communication, X = 2·b·c_l·d·s/cp bytes for one local K (or V) block in 16 bits (c_l
the K/V heads per rank: a/t for GPT): the ring holds the received K, V block and the
next one in flight, and in the backward also the dK, dV accumulator it sends and the one
it receives, 8X at its peak; all_gather holds K, V and dK, dV of the whole sequence,
4·cp·X (:data:`CP_RING_BUFFERS`; counted in ``activations_bytes``). Parameters,
gradients and optimizer state are replicated over cp (the gradients are all-reduced
over dp × cp); the logits are s/cp rows.

The emulated program (a policy with ``activation_count="emulator"``:
:func:`emulator_activation_bytes`; dense GPT, no context parallelism). The numpy GPT
(:mod:`tensor_parallel.transformer`, :mod:`tensor_parallel.attention`) saves its own set
of tensors, not Megatron's, in its dtype (e bytes per element), and its ledger
(:mod:`pipeline_parallel.ledger`) samples what it holds after every action. Per layer and
micro-batch, in elements (σ = t with sequence parallelism, else 1; "gathered": the full
sequence the TP block works on):

* forward state F (from a layer's forward to its input gradient): LN1's x̂ s·b·h/σ and
  rstd s·b/σ, the gathered LN1 output (the QKV input) s·b·h, q, k, v 3·s·b·h/t, the
  softmax P b·a·s²/t (unfused: the program keeps it), the merged context s·b·h/t, LN2's x̂
  and rstd, the gathered LN2 output (the MLP input) s·b·h, the MLP's pre-activation h and
  gelu output a 8·s·b·h/t — s·b·h·(2/σ + 2 + 12/t) + b·a·s²/t + 2·s·b/σ. Selective
  recomputation drops P and the context (s·b·h·(2/σ + 2 + 11/t) + 2·s·b/σ), full keeps
  the layer's input s·b·h/σ;
* weight state W (from the input gradient to the weight gradient, which a B action runs
  after the whole stage's input gradient): x̂1, x̂2, the attention's and the MLP's input
  gradients (s·b·h/σ each), the two gathered inputs and the two gathered output
  gradients (s·b·h each), dqkv 3·s·b·h/t, the context s·b·h/t, dh and a 8·s·b·h/t —
  s·b·h·(4/σ + 4 + 12/t), whatever the recomputation; with t > 1 and the input-gradient
  reductions overlapped (``ParallelConfig.use_async_grad_reduce``) the weight gradients
  of QKV and of the MLP's first linear are computed during the input gradient, so the
  two gathered inputs, dqkv and dh are not kept: s·b·h·(4/σ + 2 + 5/t);
* the ends: the embedding's int64 local ids and bool mask, 9·s·b bytes
  (``INDEX_BYTES``), and in W its gathered input gradient s·b·h (+ s·b·h/t with SP); the
  head's final-LN x̂, rstd and gathered input s·b·h·(1/σ + 1) + s·b/σ in F, and in W its
  input, x̂ and input gradient s·b·h·(1 + 2/σ) plus the logits' gradient s·b·V/t — which
  the last stage also holds from the loss to the backward (the executor counts it).

A stage (its layers and ends) holding k micro-batches peaks after the input gradient of
the first backward, (k−1)·F + max(F, W); the logits' gradients, k·s·b·V/t·e, are
reported as ``logits_bytes`` (the ledger counts them among its activations). The count
is exact for a stage per rank with B actions (1F1B, GPipe); the interleaved and
zero-bubble schedules (I and W apart) hold other mixes. Parameters, gradients and
optimizer state follow the formulas above with e bytes each (Adam: 2e, SGD's momentum: e;
no master copy), ZeRO's padding aside (< dp elements per module).

Activation offload (``ParallelConfig.activation_offload`` f, :mod:`.offload`): the first
k = floor(f·L) layers of each chunk of L layers keep their activations in host memory,
so a rank holding n micro-batches keeps n·(L − k)·A in HBM and n·k·A in host memory
(``host_bytes``, outside ``total_bytes``), A a layer's bytes above (Korthikanti's count
only; the other counts refuse it). No copy buffer is added: Transformer Engine's schedule
holds at most L − k layers' sets on the GPU, the one in flight among them.

The peak (:attr:`MemoryBreakdown.total_bytes`) counts tensors, comparable to
``torch.cuda.max_memory_allocated``. A device also needs room the tensors do not show
(the CUDA context, NCCL's buffers, the caching allocator's fragmentation): a
configuration fits when its peak is at most the device memory less ``MEMORY_HEADROOM``,
the reserve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from modeling import DEFAULT_RECOMPUTE_MODULES, FULL_RECOMPUTE, GPT2_BLOCK, LLAMA_BLOCK
from pipeline_parallel.gpt import FUSED_ATTENTION
from pipelining import peak_in_flight
from tensor_parallel.moe_load import ExpertLoad

from .offload import rank_offloaded_layers
from .precision import MEGATRON, PrecisionPolicy, precision_policy

__all__ = ["MemoryBreakdown", "gpt_memory", "rank_memory", "rank_params", "WEIGHT_BYTES",
           "GRAD_BYTES", "OPTIMIZER_BYTES", "LOGITS_BYTES", "LSE_BYTES", "MEMORY_HEADROOM",
           "usable_memory_bytes", "activation_bytes_per_layer", "moe_routed_rows",
           "expert_params_per_layer", "llama_activation_bytes_per_layer", "cp_buffer_bytes",
           "recomputed_llama_bytes",
           "CP_RING_BUFFERS", "emulator_activation_bytes", "torch_amp_activation_bytes",
           "in_flight_after_first_backward", "INDEX_BYTES", "PrecisionPolicy",
           "layer_activation_bytes"]

# Megatron's policy (vcluster.planner.precision.MEGATRON, the default): bytes per parameter
WEIGHT_BYTES = MEGATRON.weight_bytes         # bf16 weights
GRAD_BYTES = MEGATRON.grad_bytes             # fp32 main gradients
OPTIMIZER_BYTES = MEGATRON.optimizer_bytes   # fp32 master weights, Adam's m and v
LOGITS_BYTES = MEGATRON.logits_bytes         # fp32 logits (the loss upcasts them)
# the emulated embedding's per-token index state: an int64 local id and a bool mask
INDEX_BYTES = 8 + 1
LSE_BYTES = 4        # flash attention's fp32 log-sum-exp per (row, head)
ROUTED_PROB_BYTES = 4   # a routed row's fp32 probability, kept by the expert's activation
# The share of a device's memory a plan leaves free: the formulas above count tensors,
# not the CUDA context (~0.5 GB), NCCL's buffers or the caching allocator's
# fragmentation. 5% is issue 31's default (chosen, not measured); --memory-headroom
# changes it.
MEMORY_HEADROOM = 0.05
# The ring's K/V blocks held at once at its peak (the backward): the received K and V,
# the next K and V in flight, the dK, dV accumulator sent and the one received.
CP_RING_BUFFERS = 8


def usable_memory_bytes(hbm_bytes: float, headroom: float = MEMORY_HEADROOM) -> float:
    """What a configuration may use of ``hbm_bytes``: ``hbm_bytes * (1 - headroom)``,
    0 <= headroom < 1."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 0 <= headroom < 1:
        raise ValueError(f"memory_headroom must be a fraction in [0, 1), got {headroom!r}")
    return hbm_bytes * (1 - headroom)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at its peak (``total_bytes``: every tensor, no reserve)."""

    rank_position: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int = 0
    # offloaded activations in host memory (ParallelConfig.activation_offload): not HBM,
    # not in total_bytes
    host_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.logits_bytes)


def _recomputed(recompute, modules) -> frozenset:
    """The modules ``recompute`` re-runs: ``modules`` under "selective", else none."""
    return frozenset(modules) if recompute == "selective" else frozenset()


def activation_bytes_per_layer(s, b, h, a, t, recompute, sp, attention: str = "flash",
                               modules=DEFAULT_RECOMPUTE_MODULES) -> float:
    """Bytes one layer keeps for its backward, per micro-batch (the module's table);
    ``modules``: "selective"'s (Megatron-Core's ``recompute_modules``; the module doc)."""
    if recompute == "op":
        raise ValueError("activation_bytes_per_layer: recompute 'op' (torchtitan's per-op "
                         "policy) is the Llama layer's: llama_activation_bytes_per_layer")
    if recompute in FULL_RECOMPUTE:
        return 2 * s * b * h / (t if sp else 1)
    rec = _recomputed(recompute, modules)
    base = s * b * h * (34 / t if sp else 10 + 24 / t)
    if "layernorm" in rec:                  # the two norms' outputs (the blocks' inputs)
        base -= 4 * s * b * h / (t if sp else 1)
    if "mlp" in rec:                        # W1's output and gelu's, 8 + 8 of 19
        base -= 16 * s * b * h / t
    if attention in FUSED_ATTENTION:
        return base + LSE_BYTES * b * a * s / t
    return base + (0 if "core_attn" in rec else s * b * h * 5 * a * s / (h * t))


def llama_activation_bytes_per_layer(config, b, t, recompute, sp,
                                     attention: str = "flash",
                                     modules=DEFAULT_RECOMPUTE_MODULES,
                                     gemm_input_bytes: float = 2) -> float:
    """Bytes one Llama layer keeps for its backward, per micro-batch (the module doc;
    ``op``, torchtitan's per-op policy: the layer's input x, the products x W_q, x W_v and
    x W_gate, the attention kernel's output C and log-sum-exp, and with sequence
    parallelism the attention's reduce-scattered output, :mod:`tensor_parallel.llama`).
    ``gemm_input_bytes`` g < 2 (quantised GEMMs under Transformer Engine, the module doc):
    the two norms' outputs and SwiGLU's product, which only a GEMM keeps, at g bytes, and
    the output projection's quantised copy of the attention output, g·s·b·h_q/t, beside
    the bf16 one the attention kernel keeps."""
    h, s, a, d, f = config.hidden, config.seq, config.heads, config.head_dim, config.ffn_hidden
    sigma, kv_local = t if sp else 1, max(config.kv_heads // t, 1)
    g = gemm_input_bytes
    if recompute in FULL_RECOMPUTE:
        return 2 * s * b * h / sigma
    if recompute == "op":     # x, x W_q, x W_v, C, x W_gate (+ y under SP), the kernel's
        kept = s * b * (2 * h / sigma + (2 * h / t if sp else 0) + 4 * a * d / t
                        + 2 * kv_local * d + 2 * f / t)
        return kept + (LSE_BYTES * b * a * s / t if attention in FUSED_ATTENTION
                       else 2 * a * s * _mean_keys(config) * b / t)
    if getattr(config, "kv_lora_rank", None):      # MLA: the latents, q, k, v, output
        att = 4 * ((config.q_lora_rank or 0) + config.kv_lora_rank) \
            + 4 * a * (d + config.v_head_dim) / t
        out_width = a * config.v_head_dim
    else:
        att = 4 * a * d / t + 4 * kv_local * d
        out_width = a * d
    if g != 2:                                     # W_o's quantised copy of the output
        att += g * out_width / t
    base = s * b * ((4 + 2 * g) * h / sigma + att + (4 + g) * f / t)
    if getattr(config, "qk_norm", False):          # the q and k norms' inputs
        base += 2 * s * b * (a * d / t + kv_local * d)
    rec = _recomputed(recompute, modules)
    base -= recomputed_llama_bytes(config, b, t, sp, rec, g)
    if attention in FUSED_ATTENTION:
        return base + LSE_BYTES * b * a * s / t
    return base + (0 if "core_attn" in rec else 2 * a * s * _mean_keys(config) * b / t)


def recomputed_llama_bytes(config, b, t, sp, modules, gemm_input_bytes: float = 2) -> float:
    """The bytes a Llama layer no longer keeps per micro-batch (16-bit; the GEMM inputs
    at ``gemm_input_bytes`` g) with ``modules`` recomputed (Megatron-Core's
    ``recompute_modules``; σ = t under sequence parallelism, else 1): ``layernorm`` the
    two norms' outputs 2g·s·b·h/σ (their inputs stay: the checkpoints'), ``mlp`` the
    dense SwiGLU's gate, up and product (4 + g)·s·b·f/t (its input stays),
    ``mla_up_proj`` the up-projected q, k and v 2·s·b·a·(2·d_qk + d_v)/t (the latents
    stay); ``core_attn`` and ``moe_act`` none here (the scores: the caller's; the
    experts' product: :func:`layer_activation_bytes`)."""
    h, s, a, d, f = config.hidden, config.seq, config.heads, config.head_dim, config.ffn_hidden
    sigma, g = (t if sp else 1), gemm_input_bytes
    out = 0.0
    if "layernorm" in modules:
        out += 2 * g * s * b * h / sigma
    if "mlp" in modules:
        out += (4 + g) * s * b * f / t
    if "mla_up_proj" in modules and getattr(config, "kv_lora_rank", None):
        out += 2 * s * b * a * (2 * d + config.v_head_dim) / t
    return out


def _mean_keys(config) -> float:
    """The keys each query's unfused scores keep, over the layers: s, and min(s, w) on the
    layers with a sliding window w (``window``, ``window_layers``): a layer keeps the
    b·a·s·w scores of its window, not s² (the mean over the layers, as every per-layer
    term here)."""
    s, w = config.seq, getattr(config, "window", None)
    if w is None:
        return s
    n = config.windowed_layers()
    return (n * min(s, w) + (config.layers - n) * s) / config.layers


def moe_routed_rows(config, parallel, expert_skew: float = 1.0) -> int:
    """R: the rows ep rank 0's experts receive per layer and micro-batch (0: dense)."""
    if not getattr(config, "experts", 0):
        return 0
    tokens = parallel.micro_batch * config.seq // (parallel.tp if parallel.folded else 1)
    cap = config.moe().capacity(tokens)
    return ExpertLoad.skewed(parallel.ep, config.experts, tokens, config.moe_top_k,
                             expert_skew, cap).received(0)


def expert_params_per_layer(config, parallel) -> float:
    """The parameters of the experts one rank holds, per layer: 3·h·f_e·E/(ep·etp) (0:
    dense; each expert split over etp = tp, or whole when folded, etp = 1), + with their
    biases (``moe_expert_bias``, GPT-OSS) (2·f_e/etp + h)·E/ep (b_gate, b_up split as
    their columns, b_down whole on every etp rank)."""
    if not getattr(config, "experts", 0):
        return 0
    h, f, e = config.hidden, config.moe_ffn_hidden, config.experts
    biases = (2 * f / parallel.etp + h) * e / parallel.ep \
        if getattr(config, "moe_expert_bias", False) else 0
    return 3 * h * f * e / (parallel.ep * parallel.etp) + biases


def _llama_rank_params(config, parallel, r: int) -> float:
    h, V, t, d, f = config.hidden, config.vocab, parallel.tp, config.head_dim, config.ffn_hidden
    stages = parallel.pp * parallel.chunks
    moe = h * config.experts + expert_params_per_layer(config, parallel) \
        + (config.experts if getattr(config, "moe_router_bias", False) else 0) \
        + 3 * h * config.moe_shared_ffn_hidden / parallel.etp \
        if getattr(config, "experts", 0) else 0
    attention = _latent_params(config, t) if getattr(config, "kv_lora_rank", None) else \
        2 * h * config.heads * d / t + 2 * h * d * max(config.kv_heads // t, 1)
    per_layer = attention + 2 * h + (2 * d if getattr(config, "qk_norm", False) else 0) \
        + (config.heads / t if getattr(config, "attention_sinks", False) else 0) \
        + (config.heads * d / t + 2 * d * max(config.kv_heads // t, 1)
           if getattr(config, "qkv_bias", False) else 0) \
        + (h if getattr(config, "out_bias", False) else 0)
    n_moe = _rank_moe_layers(config, parallel, r)
    params = _rank_layers(config, parallel, r) * (per_layer + 3 * h * f / t) \
        + n_moe * (moe - 3 * h * f / t)
    if r == 0:
        params += V * h / t
    if (stages - 1) % parallel.pp == r:
        params += _head_matrix(config, stages) * V * h / t + h
    return params


def _latent_params(config, t: int) -> float:
    """Multi-head latent attention's parameters on one of t tp ranks (the module doc)."""
    h, a, r_q, r_kv = config.hidden, config.heads, config.q_lora_rank, config.kv_lora_rank
    d_qk, d_r, d_v = config.head_dim, config.qk_rope_head_dim, config.v_head_dim
    replicated = h * (r_kv + d_r) + r_kv + (h * r_q + r_q if r_q else 0)
    split = (r_q if r_q else h) * a * d_qk + r_kv * a * (config.qk_nope_head_dim + d_v) \
        + a * d_v * h
    return replicated + split / t


def _rank_layers(config, parallel, r: int) -> int:
    """The transformer layers pipeline rank r holds (ParallelConfig.rank_layers: even
    stages, or first/last stages of their own)."""
    return parallel.rank_layers(config.layers, r)


def _rank_moe_layers(config, parallel, r: int) -> int:
    """How many of pipeline rank r's layers are mixtures of experts (0: a dense model;
    ``moe_dense_layers`` keep the dense MLP)."""
    if not getattr(config, "experts", 0):
        return 0
    bounds = [0]
    for n in parallel.stage_layers(config.layers):
        bounds.append(bounds[-1] + n)
    dense = set(config.moe_dense_layers)
    return sum(i not in dense for s in range(r, len(bounds) - 1, parallel.pp)
               for i in range(bounds[s], bounds[s + 1]))


def _head_matrix(config, stages: int) -> int:
    """How many V·h/t output matrices the last stage adds: 1, or 0 when it is tied to the
    word embedding of the same (only) stage (``tie_embeddings``: one E, both ends on the
    stage; on a pipeline the last stage keeps its own copy, as Megatron-LM does)."""
    return 0 if getattr(config, "tie_embeddings", False) and stages == 1 else 1


def rank_params(config, parallel, r: int) -> float:
    """Parameters on pipeline rank r (the module docstring's counting)."""
    if config.block is LLAMA_BLOCK:
        return _llama_rank_params(config, parallel, r)
    h, s, V, t = config.hidden, config.seq, config.vocab, parallel.tp
    stages = parallel.pp * parallel.chunks
    per_layer = (12 * h * h + 7 * h) / t + 6 * h
    if getattr(config, "experts", 0):   # MoE: W1, b1, W2, b2 become router + experts
        per_layer = (4 * h * h + 3 * h) / t + 5 * h + h * config.experts \
            + expert_params_per_layer(config, parallel)
    params = _rank_layers(config, parallel, r) * per_layer
    if r == 0:
        params += V * h / t + s * h
    if (stages - 1) % parallel.pp == r:
        params += _head_matrix(config, stages) * V * h / t + 2 * h
    return params


def cp_buffer_bytes(config, parallel, precision: PrecisionPolicy = MEGATRON) -> float:
    """The context-parallel K/V communication buffers at their peak (the module doc):
    ring 8X, all_gather 4·cp·X, X = 2·b·c_l·d·s/cp (2: the policy's activation bytes;
    with values of their own width, MLA's d_v, 2X is one K block and one V block);
    0 without context parallelism."""
    cp = getattr(parallel, "cp", 1)
    if cp == 1:
        return 0
    t = parallel.tp
    kv_local = max(config.kv_heads // t, 1) if config.block.grouped_query else config.heads // t
    widths = config.head_dim + (getattr(config, "v_head_dim", None) or config.head_dim)
    kv = precision.activation_bytes * parallel.micro_batch * kv_local * widths \
        * config.seq / cp                                     # one K and one V block
    return (CP_RING_BUFFERS // 2 if parallel.cp_algorithm == "ring" else 2 * cp) * kv


def rank_memory(config, parallel, r: int, in_flight: int, expert_skew: float = 1.0,
                precision=MEGATRON) -> MemoryBreakdown:
    """The breakdown of pipeline rank ``r`` holding ``in_flight`` micro-batches'
    activations at its peak (MoE: ``expert_skew`` sets the routed rows) under
    ``precision`` (a :class:`~vcluster.planner.precision.PrecisionPolicy` or a preset's
    name; default Megatron's)."""
    precision = precision_policy(precision)
    w_bytes, g_bytes, o_bytes = (precision.weight_bytes, precision.grad_bytes,
                                 precision.optimizer_bytes)
    params = rank_params(config, parallel, r)
    cp = getattr(parallel, "cp", 1)
    full_config, config = config, (config if cp == 1 else
                                   dataclasses.replace(config, seq=config.seq // cp))
    zero, shards = parallel.zero_stage, parallel.dp * cp     # ZeRO shards over dp x cp
    experts = _rank_moe_layers(config, parallel, r) * expert_params_per_layer(config, parallel)

    def sharded(per_param: float) -> float:
        """The rank's share of what ZeRO shards: the experts' over the expert-data-
        parallel ranks that hold them, the rest over dp x cp."""
        return (params - experts) * per_param / shards + experts * per_param / \
            parallel.expert_dp

    largest = _largest_module(full_config, parallel, r)
    weights = sharded(w_bytes) + 2 * largest * w_bytes if zero == 3 else params * w_bytes
    grads = sharded(g_bytes) + largest * g_bytes if zero >= 2 else params * g_bytes
    per_stage = _rank_layers(config, parallel, r) / parallel.chunks     # mean per stage
    opt_bytes = sharded(o_bytes) if zero >= 1 else params * o_bytes
    if getattr(parallel, "activation_offload", 0) and \
            precision.activation_count != "korthikanti":
        raise ValueError(f"rank_memory: activation_offload={parallel.activation_offload:g} is "
                         f"counted by layers of Korthikanti's activations (a 'korthikanti' "
                         f"policy such as megatron); precision {precision.name!r} counts "
                         f"its program's own tensors ({precision.activation_count})")
    if precision.activation_count == "emulator":
        act, logits = emulator_activation_bytes(full_config, parallel, r, in_flight,
                                                precision)
        return MemoryBreakdown(r, int(weights), int(grads), int(opt_bytes), int(act),
                               int(logits))
    if precision.activation_count in ("torch_amp", "torch_compile"):
        per_mb, logit_entries = torch_amp_activation_bytes(full_config, parallel, r, precision)

        def at(k: int, with_grads: bool) -> MemoryBreakdown:
            logits = (precision.logits_bytes + (k - 1) * precision.logits_saved_bytes) \
                * logit_entries if k else 0
            return MemoryBreakdown(r, int(weights), int(grads if with_grads else 0),
                                   int(opt_bytes), int(k * per_mb), int(logits))
        if precision.grads_persistent:
            return at(in_flight, True)
        return max(at(in_flight, False),
                   at(in_flight_after_first_backward(parallel, in_flight), True),
                   key=lambda m: m.total_bytes)
    act = _layer_activation_bytes(config, parallel, r, expert_skew,
                                  precision.gemm_input_bytes)
    # activation offload (planner.offload): the first k layers of each chunk go to host
    # memory, k the mean over the rank's chunks; no copy buffer beyond the kept layers
    offloaded = rank_offloaded_layers(parallel, config.layers, r)
    last = (parallel.pp * parallel.chunks - 1) % parallel.pp == r
    logits = (precision.logits_bytes * parallel.micro_batch * config.seq * config.vocab
              / parallel.tp if last else 0)
    return MemoryBreakdown(r, int(weights), int(grads), int(opt_bytes),
                           int(in_flight * (per_stage - offloaded) * act
                               + cp_buffer_bytes(full_config, parallel, precision)),
                           int(logits), int(in_flight * offloaded * act))


def layer_activation_bytes(config, parallel, r: int, expert_skew: float = 1.0,
                           gemm_input_bytes: float = 2) -> float:
    """The bytes one of pipeline rank ``r``'s layers keeps per micro-batch, Korthikanti's
    count (the module doc; s/cp rows with context parallelism; an MoE rank's mean over
    its layers; a Llama layer's GEMM inputs at ``gemm_input_bytes``): what
    :func:`rank_memory` multiplies by the layers and micro-batches in flight, and what an
    offloaded layer copies to host memory (:mod:`.offload`)."""
    if getattr(parallel, "cp", 1) > 1:
        config = dataclasses.replace(config, seq=config.seq // parallel.cp)
    return _layer_activation_bytes(config, parallel, r, expert_skew, gemm_input_bytes)


def _layer_activation_bytes(config, parallel, r: int, expert_skew: float,
                            gemm_input_bytes: float = 2) -> float:
    """:func:`layer_activation_bytes` of a ``config`` already cut to s/cp rows."""
    modules = getattr(parallel, "recompute_modules", DEFAULT_RECOMPUTE_MODULES)
    g = gemm_input_bytes
    if g != 2 and config.block is not LLAMA_BLOCK:
        raise ValueError(f"quantised GEMM inputs (gemm_input_bytes={g:g}) are counted for "
                         f"the Llama block only; {config.block} keeps Korthikanti's bf16 "
                         f"count")
    act = llama_activation_bytes_per_layer(
        config, parallel.micro_batch, parallel.tp, parallel.recompute,
        parallel.sequence_parallel, parallel.attention, modules, g) \
        if config.block is LLAMA_BLOCK else \
        activation_bytes_per_layer(config.seq, parallel.micro_batch, config.hidden,
                                   config.heads, parallel.tp, parallel.recompute,
                                   parallel.sequence_parallel, parallel.attention, modules)
    n_layers = _rank_layers(config, parallel, r)
    moe_act = 0.0          # what an MoE layer keeps beyond the dense layer's activations
    if getattr(config, "experts", 0) and parallel.recompute not in FULL_RECOMPUTE:
        s, b, h, t = config.seq, parallel.micro_batch, config.hidden, parallel.tp
        rec = _recomputed(parallel.recompute, modules)
        dense_mlp = (4 + g) * s * b * config.ffn_hidden / t \
            if config.block.mlp.matrices == 3 else \
            s * b * h * (19 / t if parallel.sequence_parallel else 3 + 16 / t)
        if "mlp" in rec:                 # the dense term above already left the MLP out
            dense_mlp -= (4 + g) * s * b * config.ffn_hidden / t \
                if config.block.mlp.matrices == 3 else 16 * s * b * h / t
        # each routed row: its input (W_gate's and W_up's GEMM input, g bytes), gate and
        # up (4 bytes), their product (W_down's input, g; moe_act re-runs it), its fp32
        # routing probability (the activation applies it); nothing on the token side
        kept_f = 4 + (0 if "moe_act" in rec else g)
        moe_act = -dense_mlp + moe_routed_rows(
            config, parallel, expert_skew) * (g * h + kept_f * config.moe_ffn_hidden
                                              / parallel.etp + ROUTED_PROB_BYTES) \
            + 6 * s * b * config.moe_shared_ffn_hidden / t
    act += moe_act * _rank_moe_layers(config, parallel, r) / max(n_layers, 1)
    return act


def _largest_module(config, parallel, r: int) -> float:
    """Parameters of the largest module (a layer, the embedding, the head) on pipeline
    rank r: what ZeRO-2/3 hold in full beside their shards."""
    h, s, V, t = config.hidden, config.seq, config.vocab, parallel.tp
    stages = parallel.pp * parallel.chunks
    sizes = [(12 * h * h + 7 * h) / t + 6 * h]
    if r == 0:
        sizes.append(V * h / t + s * h)
    if (stages - 1) % parallel.pp == r:
        sizes.append(V * h / t + 2 * h)
    return max(sizes)


def in_flight_after_first_backward(parallel, in_flight: int) -> int:
    """Micro-batches a rank that peaks at ``in_flight`` holds at most once its first
    backward of the step has run (when per-step gradients exist, ``grads_persistent``
    False): 1F1B runs a forward after it while forwards remain (``in_flight`` again if
    m > in_flight, else one fewer); GPipe has run every forward (m − 1). The interleaved
    and zero-bubble schedules are counted as holding ``in_flight`` (their I/W split and
    chunks make the additive peak the safe bound)."""
    m = parallel.microbatches
    if parallel.schedule == "1f1b":
        return in_flight if m > in_flight else max(in_flight - 1, 0)
    if parallel.schedule == "gpipe":
        return max(m - 1, 0)
    return in_flight


def torch_amp_activation_bytes(config, parallel, r: int, precision=None) -> tuple[float, float]:
    """(bytes per micro-batch in flight, logits per micro-batch) on pipeline rank ``r`` for
    plain PyTorch under bf16 autocast (:mod:`vcluster.gpu.gpt_step`'s program), tensor by
    tensor as autograd saves them (σ = t with sequence parallelism, else 1; tp splits the
    tensors Megatron splits):

    * per layer, s·b·h·(8/σ + 4 + 24/t) + 16·s·b/σ bytes: the two LayerNorms run in fp32
      and keep their fp32 inputs (the residual stream, 4 + 4) and fp32 mean and rstd
      (2 × 8 per row); the QKV and first MLP linears keep the bf16 casts of the LayerNorm
      outputs (2 + 2); attention keeps q, k, v (6/t) and its output (2/t), which the
      output projection keeps too (flash attention lays it out (b, s, a, d): the
      transpose back is a view, not a copy); GELU keeps its input (8/t) and the second
      MLP linear GELU's output (8/t). Flash attention adds its fp32 log-sum-exp
      4·b·a·s/t; unfused attention (``--attention unfused``) instead the bf16 softmax
      2·a·s²·b/t (no dropout). Full recomputation keeps the fp32 layer input 4·s·b·h/σ;
      selective is the same as none with flash (unfused: the softmax is recomputed);
    * the autocast weight casts each linear saves: ``weight_copy_bytes`` × the stage's
      matrices (12·h²/t per layer, the head's V·h/t on the last stage) per micro-batch;
    * the first stage's int64 token ids 8·s·b; the last stage's final LayerNorm input
      (fp32) and statistics, the head's bf16 input and the int64 targets:
      s·b·h·(4/σ + 2) + 8·s·b/σ + 8·s·b.

    Under ``torch.compile`` (``activation_count="torch_compile"``) AOTAutograd's
    partitioner saves the same tensors but for the row statistics: the 2L + 1 LayerNorms
    of L layers keep 2L + 2 fp32 statistics per row (their rstd, and one mean), counted
    as 8·s·b/σ a layer instead of 16 and the final LayerNorm's 8·s·b/σ as before; the
    fused loss keeps each row's max and log-sum-exp, 8·s·b on the last stage, and the
    logits in bf16 (the policy's ``logits_saved_bytes`` 2, against eager's fp32
    log-softmax output, 4).

    The logits per micro-batch are b·s·V/t (the caller multiplies them by the policy's
    ``logits_bytes`` and ``logits_saved_bytes``); 0 off the last stage. Dense GPT without
    context parallelism (the reference program)."""
    if config.block is not GPT2_BLOCK or getattr(config, "experts", 0) \
            or getattr(parallel, "cp", 1) > 1:
        raise ValueError(f"torch_amp_activation_bytes: the PyTorch program's count covers "
                         f"the dense GPT without context parallelism, got "
                         f"arch={config.arch!r}, experts={getattr(config, 'experts', 0)}, "
                         f"cp={getattr(parallel, 'cp', 1)}; use --precision megatron")
    _default_modules_only(parallel, "torch_amp_activation_bytes")
    policy = precision_policy(precision or "torch_amp")
    copy_bytes, compiled = policy.weight_copy_bytes, policy.activation_count == "torch_compile"
    stats = 8 if compiled else 16             # a layer's two LayerNorms' row statistics
    s, b, h, a, V, t = (config.seq, parallel.micro_batch, config.hidden, config.heads,
                        config.vocab, parallel.tp)
    sig = t if parallel.sequence_parallel and t > 1 else 1
    stages, layers = parallel.pp * parallel.chunks, _rank_layers(config, parallel, r)
    if parallel.recompute in FULL_RECOMPUTE:
        layer = 4 * s * b * h / sig
    else:
        layer = s * b * h * (8 / sig + 4 + 24 / t) + stats * s * b / sig
        if parallel.attention in FUSED_ATTENTION:
            layer += LSE_BYTES * b * a * s / t
        elif parallel.recompute != "selective":
            layer += 2 * a * s * s * b / t
    matrices = layers * 12 * h * h / t
    last = (stages - 1) % parallel.pp == r
    ends = 8 * s * b if r == 0 else 0
    if last:
        matrices += V * h / t
        ends += s * b * h * (4 / sig + 2) + 8 * s * b / sig + 8 * s * b \
            + (8 * s * b if compiled else 0)
    return layers * layer + copy_bytes * matrices + ends, (b * s * V / t if last else 0)


def _default_modules_only(parallel, who: str) -> None:
    """ValueError (naming ``recompute_modules``) unless "selective" re-runs its default."""
    modules = getattr(parallel, "recompute_modules", DEFAULT_RECOMPUTE_MODULES)
    if parallel.recompute == "selective" and tuple(modules) != DEFAULT_RECOMPUTE_MODULES:
        raise ValueError(f"{who}: recompute_modules={tuple(modules)!r} is not counted here "
                         f"(allowed: {DEFAULT_RECOMPUTE_MODULES!r}); use a 'korthikanti' "
                         "policy (the Megatron count, layer_activation_bytes)")


def emulator_activation_bytes(config, parallel, r: int, in_flight: int,
                              precision=None) -> tuple[float, float]:
    """(activations, logits) bytes pipeline rank ``r`` of the emulated GPT program holds at
    its peak with ``in_flight`` micro-batches (the module doc, "The emulated program");
    ``precision``: the element bytes (default the config's dtype)."""
    if config.block is not GPT2_BLOCK or getattr(config, "experts", 0) \
            or getattr(parallel, "cp", 1) > 1:
        raise ValueError(f"emulator_activation_bytes: the emulated program's count covers the "
                         f"dense GPT without context parallelism, got arch={config.arch!r}, "
                         f"experts={getattr(config, 'experts', 0)}, "
                         f"cp={getattr(parallel, 'cp', 1)}; use a 'korthikanti' policy")
    _default_modules_only(parallel, "emulator_activation_bytes")
    item = (precision_policy(precision) if precision is not None
            else PrecisionPolicy.emulated(config.dtype)).activation_bytes
    s, b, h, a, V, t = (config.seq, parallel.micro_batch, config.hidden, config.heads,
                        config.vocab, parallel.tp)
    sp = parallel.sequence_parallel and t > 1
    sig = t if sp else 1
    bsh = b * s * h
    if parallel.recompute in FULL_RECOMPUTE:
        layer_f = bsh / sig
    else:
        layer_f = bsh * (2 / sig + 2 + (12 if parallel.recompute == "none" else 11) / t) \
            + 2 * b * s / sig + (b * a * s * s / t if parallel.recompute == "none" else 0)
    if t > 1 and parallel.use_async_grad_reduce:
        # the gathered inputs of QKV and of the MLP, dqkv and dh went into their weight
        # gradients during the input gradient (ParallelConfig.tp_overlap)
        layer_w = bsh * (4 / sig + 2 + 5 / t)
    else:
        layer_w = bsh * (4 / sig + 4 + 12 / t)
    n = _rank_layers(config, parallel, r) / parallel.chunks
    fwd, wgt = n * layer_f * item, n * layer_w * item
    if r == 0:                       # the embedding: token indices; the gathered dx
        fwd += INDEX_BYTES * b * s
        wgt += INDEX_BYTES * b * s + bsh * (1 + (1 / sig if sp else 0)) * item
    last = (parallel.pp * parallel.chunks - 1) % parallel.pp == r
    dlogits = b * s * V / t * item if last else 0
    if last:                         # the head: final LN's xhat, rstd and gathered input
        fwd += (bsh * (1 / sig + 1) + b * s / sig) * item
        wgt += bsh * (1 + 2 / sig) * item
    act = max(in_flight - 1, 0) * fwd + (max(fwd, wgt) if in_flight else 0)
    return act, in_flight * dlogits


def gpt_memory(config, parallel, schedule, expert_skew: float = 1.0,
               precision=MEGATRON) -> list[MemoryBreakdown]:
    """One breakdown per pipeline position (every dp/tp peer holds the same; MoE: ep
    rank 0's, the busiest expert's) under ``precision`` (a PrecisionPolicy or a preset's
    name; default Megatron's)."""
    return [rank_memory(config, parallel, r, peak_in_flight(schedule, r, check=False),
                        expert_skew, precision) for r in range(parallel.pp)]
