"""Emulated serving: a Llama decoder with a paged KV cache on the virtual devices, under
tensor, pipeline and expert parallelism and continuous batching.

>>> run = serve(cluster, spec, None, requests, prompts, tp=2, pp=2,
...             num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)  # doctest: +SKIP
>>> len(run.outputs[0]) == requests[0].output_len                           # doctest: +SKIP
True

The per-device program :func:`serve_program` runs on a mesh ("pp", "tp"), rank (k, t)
holding stage k's layers (equal shares, :func:`modeling.counts.stage_layers`) cut for tp
rank t. It is SPMD all the way down, scheduling included: every rank runs the same
deterministic scheduler (:func:`serving.make_scheduler`, default vLLM v1's) on the same
requests, so every rank forms the same steps without a message. Per engine step:

1. requests whose ``arrival_step`` has come are added; ``schedule()`` gives the step: for
   each scheduled request its new tokens (a prefill chunk, or one decode token) at
   positions c .. c + n − 1 and its block table;
2. ONE batched forward over the N concatenated new tokens (stage 0: the token ids, its
   embedding; later stages: the hidden states (N, h) received from the stage before);
   every layer writes the new keys and values into the paged cache and each sequence
   attends to its own blocks (:mod:`.paged_attention`) — the cache holds k as attention
   takes it, after the bias, QK-norm and RoPE (v after its bias);
3. the last stage takes the rows that sample (a request's last known token:
   ``ScheduledRequest.samples``), its final norm and logits, and picks the greedy token
   (argmax); it sends the new tokens to every earlier stage, so every rank knows every
   request's tokens (prompt + outputs, what a recompute re-prefills);
4. ``finish_step`` advances the counts, frees finished requests' blocks (which later
   requests reuse) and, when blocks ran out while forming the step, preempted requests
   had theirs freed and are recomputed later (vLLM's recompute preemption).

The stages run one step at a time (no second batch in flight): stage k + 1 waits for
stage k's hidden states, and stage 0 for the last stage's tokens before the next step —
the bubble of a synchronous pipeline, (pp − 1)/pp of each rank's step.

Tensor parallelism (Megatron, as vLLM's): query heads split over tp (K/V heads too, or
each replicated over tp/kv_heads ranks when kv_heads < tp, :func:`~tensor_parallel.llama.
kv_pieces`), so each rank caches only its KV heads; W_q, W_kv, W_gate, W_up
column-parallel, W_o, W_down row-parallel: one all_reduce(tp) after the attention's
output projection and one after the MLP. The embedding is vocabulary-parallel (each rank
looks up its V/t rows, zeros elsewhere, then all_reduce(tp): vLLM's
VocabParallelEmbedding) and so is the head (logits of the sampled rows for V/t words,
then all_gather(tp) along the vocabulary: vLLM's LogitsProcessor gather), so every tp
rank picks the same token.

Attention biases and QK-norm (the training program's math, :mod:`tensor_parallel.gqa`;
the parameters b_q, b_kv, b_o, q_norm_g, k_norm_g of ``GPT.init_params``): with
``qkv_bias`` (Qwen2/Qwen2.5) q = u W_q + b_q and [k | v] = u W_kv + b_kv, before QK-norm
and RoPE; with ``qk_norm`` (Qwen3) q and k are RMS-normalised per head (width d, eps
``cfg.eps``) with gains g_q, g_k (d,) before RoPE; with ``out_bias`` (GPT-OSS)
y = reduce(C W_o) + b_o. Under tp b_q and b_kv are split with W_q's and W_kv's columns
(b_kv replicated with its K/V head when kv_heads < tp), the gains are whole on every
rank (per head: no communication), and b_o is whole on every rank and added once, after
the all_reduce(tp). They add elementwise work only (0 FLOPs, no message).

Sliding windows and attention sinks (GPT-OSS, Mistral; the training program's math,
:mod:`tensor_parallel.gqa`): a layer of ``window_layers`` (all, when None) with
``window`` w lets the query at absolute position p see the cached key j iff
p − w < j ≤ p — in a prefill chunk and in a decode alike, against the keys the paged
cache holds; the others see every earlier key. With vLLM's hybrid KV-cache manager (the
default; :mod:`serving.kv_groups`) each KV-cache group of layers has its own block
table: a sliding group's table holds the null block where a block left the window (the
scheduler freed it, another request may hold it now), and its layers write and read
through it; with ``hybrid_kv_cache=False`` one table serves every layer and keeps every
token. Attention reads only the keys from the chunk's first window on
(:mod:`.paged_attention`). With ``attention_sinks`` each query head's
logit σ_n (parameters ``sinks`` (a,), split over tp by query heads like W_q's columns)
joins every row's softmax denominator and its probability is dropped. No message more;
a windowed layer declares the pairs its window visits.

MoE biases (GPT-OSS; :mod:`tensor_parallel.moe`'s math): ``moe_router_bias`` l =
u W_r + b_r (b_r whole on every rank, as the router); ``moe_expert_bias`` each routed
expert O_e = (silu(X W_g + b_g) * (X W_u + b_u)) W_d + b_d, y = Σ g·O_e (b_d inside the
gate). Under ep = tp the biases go with their experts; under ep = 1 b_g and b_u split with
the expert's f columns and b_d is added by tp rank 0 only (the partial sums' all-reduce
then adds it once). Elementwise work only (0 FLOPs, no message).

Mixture of experts (``ep``): vLLM's layout without an all-to-all backend —
``ep = tp``: attention tensor-parallel as above, the experts expert-parallel over the
same tp ranks (rank t holds experts t·E/ep .. (t + 1)·E/ep − 1 whole); every rank
routes every token (the router is replicated, the tokens are whole on every rank after
the attention's all-reduce), computes its own experts' share Σ_{e local} gate_{t,e}·
SwiGLU_e(x_t) for the tokens routed to them, and one all_reduce(tp) sums the shares —
the same collective a dense MLP ends with. ``ep = 1``: every expert tensor-parallel (its
width split over tp, vLLM's default without ``--enable-expert-parallel``), one
all_reduce likewise. Routing is dropless (serving engines drop no tokens): top-k of the
softmax (or sigmoid) scores, ties to the lower index, gates renormalised as the model
says — :func:`~tensor_parallel.moe_reference.moe_reference`'s rules.

Declared costs (products only, as the training programs; every GEMM through
:func:`~tensor_parallel.matmul.local_matmul`), per step on rank (k, t), N tokens, S
sampled rows, a_l = a/t, c_l its KV heads, f_l = f/t:

    per layer   2·N·h·(a_l·d + 2·c_l·d) + 2·N·a_l·d·h       projections
                + Σ_r 4·a_l·d·(n_r·c_r + n_r(n_r + 1)/2)     paged attention
                  (a windowed layer: Σ_r 4·a_l·d·Σ_p min(p + 1, w))
                + 3·2·N·h·f_l                                dense SwiGLU
                  (MoE: 2·N·h·E router + Σ_{e local} 3·2·N_e·h·f_e,l
                   + the shared expert's 3·2·N·h·f_s/t)
    last stage  2·S·h·V/t                                     logits

The program is traceable (:func:`trace_serve`: shape-only parameters, no prompts; the
schedule needs counts only), and the trace moves exactly the emulator's messages and
bytes and replays on the timing model (``simulate_trace``). Token values are unknown
there: an MoE layer then assumes the N·k routed tokens spread evenly over the experts
(expert e gets ⌊N·k/E⌋, the first N·k mod E one more).

Reference (:func:`greedy_reference`): greedy generation re-running the WHOLE unsharded
sequence (prompt + outputs so far) through :func:`~pipeline_parallel.llama.llama_reference`
for every token — no cache at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from mesh import Mesh
from modeling import LLAMA_BLOCK, ConfigError, ModelSpec
from modeling.counts import stage_layers
from modeling.plan import check_kv_heads
from serving import EngineStep, Request, make_scheduler, steps_by_arrival
from serving.kv_groups import KVCacheGroups, layer_groups, request_blocks
from serving.plan import VLLM_MAX_NUM_BATCHED_TOKENS
from tensor_parallel.attention import TransformerOps
from tensor_parallel.gqa import Rope
from tensor_parallel.llama import llama_piece
from tensor_parallel.matmul import local_matmul
from tensor_parallel.rmsnorm import rms_norm
from vcluster.runtime.tracing import Kernel, MetaArray, is_meta, trace_program

from .gpt import GPT, GPTConfig
from .llama import llama_param_shapes, llama_reference
from .paged_attention import PagedKVCache, SequenceChunk, slots

__all__ = ["BLOCK_SIZE", "ServeJob", "ServeRun", "greedy_reference", "serve", "serve_config",
           "serve_mesh", "serve_meta_args", "serve_program", "shard_params", "trace_serve"]

#: vLLM's default KV block size on GPUs (CacheConfig.block_size = 16 tokens)
BLOCK_SIZE = 16
#: point-to-point tags: a stage's hidden states to the next, the sampled tokens back
HIDDEN_TAG, TOKENS_TAG = 5301, 5302
_MOE = ("w_router", "moe_gate", "moe_up", "moe_down", "moe_b_gate", "moe_b_up", "moe_b_down")
_SHARED = ("shared_gate", "shared_up", "shared_down")


def serve_mesh(tp: int = 1, pp: int = 1) -> Mesh:
    """The serving mesh: axes ("pp", "tp"), tp fastest (a stage's tp group adjacent)."""
    return Mesh((pp, tp), ("pp", "tp"))


# --- the job: what every rank is given ------------------------------------------------------
@dataclass(frozen=True)
class ServeJob:
    """What every rank runs: the model ``config``, the degrees, the ``requests`` and
    their ``prompts`` (token ids, one tuple per request; None in a trace) and the
    scheduler: ``engine`` and its ``settings`` (num_blocks, block_size,
    max_num_batched_tokens, max_num_seqs as pairs); ``kv_groups``: the layers of each
    KV-cache group (:mod:`serving.kv_groups`; one group without sliding windows)."""

    config: GPTConfig
    tp: int
    pp: int
    ep: int
    requests: tuple
    prompts: tuple | None
    engine: str
    settings: tuple
    kv_groups: KVCacheGroups | None = None

    def __repr__(self) -> str:
        return (f"ServeJob(tp={self.tp}, pp={self.pp}, ep={self.ep}, requests="
                f"{len(self.requests)}, engine={self.engine!r}, settings={dict(self.settings)}"
                f"{', traced' if self.prompts is None else ''})")

    @property
    def num_blocks(self) -> int:
        return dict(self.settings)["num_blocks"]

    @property
    def block_size(self) -> int:
        return dict(self.settings)["block_size"]

    def layers(self, stage: int) -> range:
        return stage_layers(self.config.layers, self.pp)[stage]


# --- the device side ---------------------------------------------------------------------------
def _is_moe_layer(cfg: GPTConfig, i: int) -> bool:
    return bool(cfg.experts) and i not in cfg.moe_dense_layers


class _StageModel:
    """This rank's share of the model: its stage's layers cut for its tp rank, its
    paged cache, and their forward math (module docstring)."""

    def __init__(self, dev, job: ServeJob, params: dict):
        cfg = self.cfg = job.config
        self.dev, self.P, self.job = dev, params, job
        self.ops = TransformerOps(dev, "tp", sequence_parallel=False)
        self.stage = dev.mesh.group_position("pp", dev.rank)
        self.first, self.last = self.stage == 0, self.stage == job.pp - 1
        self.layers = job.layers(self.stage)
        t, d = job.tp, cfg.head_dim
        self.heads_local, self.kv_local, self.d = cfg.heads // t, max(cfg.kv_heads // t, 1), d
        self.cache = PagedKVCache(dev, self.layers, job.num_blocks, job.block_size,
                                  self.kv_local, d, cfg.dtype)
        groups = job.kv_groups
        self.group_of = {i: 0 if groups is None else groups.group_of(i) for i in self.layers}

    # --- the ends ---------------------------------------------------------------------------
    def embed(self, ids):
        """x (N, h) = E[ids]: this rank's V/t rows looked up, zeros elsewhere, summed over
        tp (vocabulary-parallel)."""
        ops, wte = self.ops, self.P["wte"]
        v_l = wte.shape[0]

        def lookup():
            local = ids - ops.tp_rank * v_l
            inside = (local >= 0) * (local < v_l)
            return wte[local * inside] * inside[:, None]

        x = ops.work("embedding lookup", 0, (ids, ids), None, lookup,
                     nbytes=int(ids.size) * (2 * wte.shape[1] * wte.itemsize + ids.itemsize))
        return ops.reduce_out(x, "embedding: reduce")

    def logits(self, x):
        """The sampled rows' logits (S, V): final RMSNorm, x W_out (h, V/t), then
        all_gather(tp) along the vocabulary."""
        ops, cfg = self.ops, self.cfg
        u, _ = rms_norm(ops, x, self.P["norm_f_g"], cfg.eps, "head: final norm")
        w_out = self.P["wte"].T if cfg.tie_embeddings else self.P["w_out"]
        part = ops.matmul(u, w_out, "logits: x @ W_out")
        return part if ops.tp_axis is None else self.dev.all_gather(part, "tp", dim=1)

    # --- a layer ----------------------------------------------------------------------------
    def layer(self, i: int, x, chunks, rows, rope):
        """Layer i on the step's tokens x (N, h): attention through the paged cache
        (``rows``: the new tokens' pool rows), then the MLP or the mixture."""
        ops, cfg, P = self.ops, self.cfg, self._layer_params(i)
        n, h = x.shape
        cd = self.kv_local * self.d
        u, _ = rms_norm(ops, x, P["attn_norm_g"], cfg.eps, "attention: norm")
        q = ops.matmul(u, P["w_q"], "attention: x @ W_q")                  # (N, a_l·d)
        kv = ops.matmul(u, P["w_kv"].reshape(h, 2 * cd), "attention: x @ W_kv")
        if cfg.qkv_bias:             # this rank's columns of b_q, b_kv (as W_q's, W_kv's)
            q = ops.add_bias(q, P["b_q"], "attention: + b_q")
            kv = ops.add_bias(kv, P["b_kv"].reshape(2 * cd), "attention: + b_kv")
        k = kv[:, :cd]
        if cfg.qk_norm:              # each head's d values, gains whole on every rank
            q = self._head_norm(q, P["q_norm_g"], "attention: q norm")
            k = self._head_norm(k, P["k_norm_g"], "attention: k norm")
        q = rope.apply(ops, q, 1, n, "attention: rope q")
        k = rope.apply(ops, k, 1, n, "attention: rope k")
        shape = (n, self.kv_local, self.d)
        self.cache.write(ops, i, k.reshape(shape), kv[:, cd:].reshape(shape), rows)
        ctx = self.cache.attend(ops, i, q, chunks, cfg.layer_window(i),     # (N, a_l·d)
                                P["sinks"] if cfg.attention_sinks else None)
        att = ops.reduce_out(ops.matmul(ctx, P["w_o"], "attention: ctx @ W_o"),
                             "attention: reduce y")
        if cfg.out_bias:             # whole on every rank, once, after the reduction
            att = ops.add_bias(att, P["b_o"], "attention: + b_o")
        x1 = ops.ew("residual", lambda: x + att, x, att)
        u2, _ = rms_norm(ops, x1, P["mlp_norm_g"], cfg.eps, "mlp: norm")
        y = self._moe(u2, P) if _is_moe_layer(cfg, i) else \
            self._swiglu(u2, P["w_gate"], P["w_up"], P["w_down"], "gpt: mlp")
        y = ops.reduce_out(y, "mlp: reduce y")
        return ops.ew("residual", lambda: x1 + y, x1, y)

    def _head_norm(self, t, g, name: str):
        """QK-norm: RMSNorm (eps ``cfg.eps``) of each head's d values of t (N, n·d), times
        the gains g (d,)."""
        rows = t.shape[0]
        y, _ = rms_norm(self.ops, t.reshape(rows, -1, self.d), g, self.cfg.eps, name)
        return y.reshape(t.shape)

    def _layer_params(self, i: int) -> dict:
        prefix = f"layers.{i}."
        return {n[len(prefix):]: a for n, a in self.P.items() if n.startswith(prefix)}

    def _swiglu(self, u, w_gate, w_up, w_down, what: str, biases=None):
        """(silu(u W_gate) * (u W_up)) W_down, this rank's columns / rows (a partial sum);
        ``what`` prefixes the ops' names ("gpt: mlp", "moe: expert 3"). ``biases``: an
        expert's (b_gate, b_up, b_down or None) — (silu(u W_g + b_g) * (u W_u + b_u))
        W_d + b_d, b_down added by one rank of the partial sum only (GPT-OSS)."""
        dev, ops = self.dev, self.ops
        zg = local_matmul(dev, u, w_gate, f"{what}: x @ W_gate")
        zu = local_matmul(dev, u, w_up, f"{what}: x @ W_up")
        if biases is not None:
            zg = ops.add_bias(zg, biases[0], f"{what}: + b_gate")
            zu = ops.add_bias(zu, biases[1], f"{what}: + b_up")
        with dev.compute(f"{what}: silu(zg) * zu", flops=0,
                         bytes=3 * zg.size * zg.itemsize,
                         kernel=Kernel.activation(zg.shape[0], zg.shape[1], False, "swiglu")):
            a = zg / (1 + np.exp(-zg)) * zu
        y = local_matmul(dev, a, w_down, f"{what}: a @ W_down")
        if biases is not None and biases[2] is not None:
            y = ops.add_bias(y, biases[2], f"{what}: + b_down")
        return y

    def _moe(self, u, P):
        """This rank's share of the mixture on u (N, h): the routed tokens of its local
        experts, gated, plus its slice of the shared expert (a partial sum over tp)."""
        cfg, dev = self.cfg, self.dev
        n, h = u.shape
        E, k = cfg.experts, cfg.moe_top_k
        logits = local_matmul(dev, u, P["w_router"], "moe: router x @ W_r")   # (N, E)
        if cfg.moe_router_bias:                          # b_r whole on every rank
            logits = self.ops.add_bias(logits, P["b_router"], "moe: router + b_r")
        e_l = P["moe_gate"].shape[0]
        first = self.ops.tp_rank * e_l if self.job.ep > 1 else 0
        # b_down once per expert: its owner (ep = tp), or tp rank 0 of a tp-split expert
        down_bias = self.job.ep > 1 or self.ops.tp_rank == 0
        with dev.compute("moe: route (top-k, gates)", flops=0,
                         bytes=2 * logits.size * logits.itemsize,
                         kernel=Kernel.elementwise(2 * logits.size)):
            routes = None if is_meta(logits) else _route(cfg, logits)
        y = None
        for j in range(e_l):
            e = first + j
            if routes is None:                   # a trace: the even spread (module doc)
                count = n * k // E + (e < n * k % E)
                rows, gates = np.zeros(count, np.int64), MetaArray((count, 1), u.dtype)
            else:
                rows, gates = routes[0][e], routes[1][e][:, None]
            if not len(rows):
                continue
            with dev.compute(f"moe: expert {e} gather", flops=0,
                             bytes=2 * len(rows) * h * u.itemsize,
                             kernel=Kernel.elementwise(2 * len(rows) * h)):
                xe = u[rows]
            biases = (P["moe_b_gate"][j], P["moe_b_up"][j],
                      P["moe_b_down"][j] if down_bias else None) \
                if cfg.moe_expert_bias else None
            out = self._swiglu(xe, P["moe_gate"][j], P["moe_up"][j], P["moe_down"][j],
                               f"moe: expert {e}", biases)
            with dev.compute(f"moe: expert {e} gate and scatter-add", flops=0,
                             bytes=3 * len(rows) * h * u.itemsize,
                             kernel=Kernel.elementwise(3 * len(rows) * h)):
                if y is None:
                    y = np.zeros_like(u)
                if not is_meta(y):
                    np.add.at(y, rows, out * gates)
        if cfg.moe_shared_ffn_hidden:
            shared = self._swiglu(u, P["shared_gate"], P["shared_up"], P["shared_down"],
                                  "moe: shared expert")
            if y is not None:
                with dev.compute("moe: + shared expert", flops=0, bytes=3 * y.size * y.itemsize,
                                 kernel=Kernel.elementwise(3 * y.size)):
                    shared = y + shared
            y = shared
        if y is None:
            with dev.compute("moe: zeros", flops=0, bytes=u.size * u.itemsize,
                             kernel=Kernel.elementwise(u.size)):
                y = np.zeros_like(u)
        return y


def _route(cfg: GPTConfig, logits) -> tuple[dict, dict]:
    """(rows, gates) by expert: the tokens routed to each (ascending) and their gates —
    top-k of the scores (softmax or sigmoid), ties to the lower index, gates renormalised
    over the k when the model says (default: sigmoid, or k > 1) and scaled by the routed
    scaling (:func:`~tensor_parallel.moe_reference.moe_reference`'s rules, dropless)."""
    k = cfg.moe_top_k
    if cfg.moe_router == "sigmoid":
        v = 1.0 / (1.0 + np.exp(-logits))
    else:
        v = np.exp(logits - logits.max(axis=1, keepdims=True))
        v = v / v.sum(axis=1, keepdims=True)
    norm = (cfg.moe_router == "sigmoid" or k > 1) if cfg.moe_normalize_top_k is None \
        else cfg.moe_normalize_top_k
    choice = np.argsort(-v, axis=1, kind="stable")[:, :k]                    # (N, k)
    sel = np.take_along_axis(v, choice, axis=1)
    gate = cfg.moe_routed_scaling * (sel / sel.sum(axis=1, keepdims=True) if norm else sel)
    rows, gates = {}, {}
    for e in range(cfg.experts):
        t, c = np.nonzero(choice == e)
        rows[e], gates[e] = t, gate[t, c]
    return rows, gates


def serve_program(dev, job: ServeJob, params: dict) -> dict:
    """One rank's serving loop (module docstring). Returns {"outputs": request id ->
    its output tokens, "logits": request id -> the logits each output was picked from
    (the last stage's tp rank 0 only), "steps": the EngineSteps (rank 0 only),
    "preemptions": the scheduler's count}."""
    model = _StageModel(dev, job, params)
    mesh, t = dev.mesh, dev.mesh.group_position("tp", dev.rank)
    stage = model.stage
    prev = mesh.rank({"pp": stage - 1, "tp": t}) if not model.first else None
    nxt = mesh.rank({"pp": stage + 1, "tp": t}) if not model.last else None
    last_rank = mesh.rank({"pp": job.pp - 1, "tp": t})
    sched = make_scheduler(job.engine, job.num_blocks, **{
        n: v for n, v in job.settings if n != "num_blocks"})
    traced = job.prompts is None
    tokens = {r.request_id: (list(job.prompts[i]) if not traced else [None] * r.prompt_len)
              for i, r in enumerate(job.requests)}
    prompt_len = {r.request_id: r.prompt_len for r in job.requests}
    logits_of = {r.request_id: [] for r in job.requests}
    steps = []
    for step in steps_by_arrival(sched, job.requests, f"serve: rank {dev.rank}"):
        if not step.is_empty:
            sampled = _forward(model, step, tokens, logits_of, prev, nxt, last_rank, traced)
        else:
            sampled = []
        outcome = sched.finish_step(step)
        assert sorted(outcome.emitted) == sorted(sampled), (outcome, sampled)
        if dev.rank == 0:
            steps.append(step)
    last_tp0 = model.last and t == 0
    return {"outputs": {rid: tuple(ts[prompt_len[rid]:]) for rid, ts in tokens.items()},
            "logits": ({rid: np.array(v).reshape(len(v), job.config.vocab)
                        for rid, v in logits_of.items()} if last_tp0 and not traced else None),
            "steps": steps if dev.rank == 0 else None,
            "preemptions": sched.num_preemptions}


def _forward(model: _StageModel, step: EngineStep, tokens, logits_of, prev, nxt, last_rank,
             traced: bool) -> list:
    """The step's batched forward on this rank; appends the sampled tokens to ``tokens``
    (every rank) and their logits to ``logits_of`` (the last stage). Returns the ids of
    the requests that sampled."""
    dev, job = model.dev, model.job
    chunks = [[] for _ in step.scheduled[0].group_tables]   # each KV-cache group's
    positions, ids, sample_rows, sampled = [], [], [], []
    first = 0
    for s in step.scheduled:
        n, c = s.num_new_tokens, s.num_computed_tokens
        for g, table in enumerate(s.group_tables):
            chunks[g].append(SequenceChunk(first, n, c, tuple(table)))
        positions.extend(range(c, c + n))
        ids.extend(tokens[s.request_id][c:c + n])
        if s.samples:
            sample_rows.append(first + n - 1)
            sampled.append(s.request_id)
        first += n
    n_tok = first
    rows = [np.concatenate([slots(ch.block_table, np.arange(ch.n_computed, ch.context),
                                  job.block_size) for ch in group]) for group in chunks]
    rope = Rope(model.d, model.cfg.rope_theta, positions)
    if model.first:
        x = model.embed(MetaArray((n_tok,), np.int64) if traced else
                        np.array(ids, dtype=np.int64))
    else:
        x = dev.recv(prev, HIDDEN_TAG)
    for i in model.layers:
        g = model.group_of[i]
        x = model.layer(i, x, chunks[g], rows[g], rope)
    if not model.last:
        dev.send(x, nxt, HIDDEN_TAG)
    if not sampled:
        return sampled
    if model.last:
        with dev.compute("gpt: head: take the sampled rows", flops=0,
                         bytes=2 * len(sample_rows) * x.shape[1] * x.itemsize):
            xs = x[np.array(sample_rows)]
        logits = model.logits(xs)                                        # (S, V)
        with dev.compute("gpt: head: greedy sample (argmax)", flops=0,
                         bytes=logits.size * logits.itemsize):
            new = MetaArray((len(sampled),), np.int64) if is_meta(logits) else \
                np.argmax(logits, axis=1).astype(np.int64)
        for k in range(job.pp - 1):
            dev.send(new, dev.mesh.rank({"pp": k, "tp": dev.mesh.group_position(
                "tp", dev.rank)}), TOKENS_TAG)
        if not traced:
            for rid, row in zip(sampled, logits):
                logits_of[rid].append(np.array(row))
    else:
        new = dev.recv(last_rank, TOKENS_TAG)
    for j, rid in enumerate(sampled):
        tokens[rid].append(None if traced else int(new[j]))
    return sampled


# --- the host side -----------------------------------------------------------------------------
def serve_config(model, timing_only: bool = False) -> GPTConfig:
    """The GPTConfig of ``model`` (a ModelSpec, a preset name, or a GPTConfig), or
    ConfigError naming what this serving program cannot run (``timing_only``: only
    traced, so settings that change values but no shape pass, :meth:`GPTConfig.
    from_spec`)."""
    if isinstance(model, (ModelSpec, str)):
        spec = model if isinstance(model, ModelSpec) else None
        cfg = GPTConfig.from_spec(spec, seq=spec.max_seq, timing_only=timing_only) \
            if spec is not None else GPTConfig.of_model(model, seq=4096,
                                                        timing_only=timing_only)
    elif isinstance(model, GPTConfig):
        cfg = model
    else:
        raise ConfigError("model", model, "a ModelSpec, a preset name or a GPTConfig",
                          "not a model")
    if cfg.block is not LLAMA_BLOCK:
        raise ConfigError("model", cfg.arch, "a Llama block (RMSNorm, RoPE, SwiGLU)",
                          "the serving program runs Llama decoders")
    unsupported = [(f, v) for f, v in (
        ("kv_lora_rank", cfg.kv_lora_rank),
        ("capacity_factor", cfg.capacity_factor if cfg.experts else None),
        ("moe_groups", cfg.moe_groups if cfg.experts else None),
        ("moe_bias_update_rate", cfg.moe_bias_update_rate or None),
    ) if v]
    if unsupported:
        f, v = unsupported[0]
        raise ConfigError(f, v, "none (a dropless MoE without grouped routing or "
                          "auxiliary-loss-free balancing; grouped-query attention, not "
                          "MLA)", "the serving program does not run it yet")
    return cfg


def _check_degrees(cfg: GPTConfig, tp: int, pp: int, ep: int) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "an integer >= 1", "not a parallel degree")
    if cfg.heads % tp:
        raise ConfigError("tp", tp, f"a divisor of heads={cfg.heads}",
                          "tensor parallelism splits the query heads evenly")
    check_kv_heads(cfg.heads, cfg.kv_heads, tp)
    for what, width in (("vocab", cfg.vocab), ("ffn_hidden", cfg.ffn_hidden)):
        if width % tp:
            raise ConfigError("tp", tp, f"a divisor of {what}={width}",
                              f"the {what} dimension is split over tp")
    if cfg.layers % pp:
        raise ConfigError("pp", pp, f"a divisor of layers={cfg.layers}",
                          "every pipeline stage holds an equal share of the layers")
    if not cfg.experts:
        if ep != 1:
            raise ConfigError("ep", ep, "1 for a dense model", "there are no experts")
        return
    if ep not in (1, tp):
        raise ConfigError("ep", ep, f"1 or tp={tp}", "the experts are expert-parallel over "
                          "the tp ranks (vLLM's layout without an all-to-all) or each "
                          "tensor-parallel (ep=1)")
    if cfg.experts % ep:
        raise ConfigError("ep", ep, f"a divisor of experts={cfg.experts}",
                          "each ep rank holds an equal share of the experts")
    if ep == 1 and cfg.moe_ffn_hidden % tp:
        raise ConfigError("tp", tp, f"a divisor of moe_ffn_hidden={cfg.moe_ffn_hidden}",
                          "with ep=1 each expert's width is split over tp")
    if cfg.moe_shared_ffn_hidden % tp:
        raise ConfigError("tp", tp, f"a divisor of moe_shared_ffn_hidden="
                          f"{cfg.moe_shared_ffn_hidden}", "the shared expert is split over tp")


def _check_requests(cfg: GPTConfig, requests, prompts, num_blocks: int,
                    block_size: int, windows=(None,), chunk: int = 0) -> tuple:
    """(requests, prompts as tuples of ints or None), or ConfigError. A request must fit
    the cache at its longest: ⌈tokens/B⌉ blocks in each KV-cache group of ``windows``
    (a sliding one at most what its window and a ``chunk`` of new tokens reach,
    :func:`serving.kv_groups.request_blocks`) beside the null block."""
    requests = tuple(requests)
    if not requests or not all(isinstance(r, Request) for r in requests):
        raise ConfigError("requests", requests, "a non-empty sequence of serving.Request",
                          "nothing to serve")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ConfigError("requests", ids, "distinct request ids", "a request id repeats")
    for name, value, low in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(name, value, f"an integer >= {low}", "not a KV cache size")
    usable = num_blocks - 1                                # block 0: vLLM's null block
    for i, r in enumerate(requests):
        need = request_blocks(windows, r.max_tokens, block_size, chunk or r.max_tokens)
        if need > usable:                   # the scheduler's rule (serving.scheduler)
            raise ConfigError(f"requests[{i}]", r, f"at most {usable} blocks at its "
                              f"longest (it needs {need} of {block_size} tokens over "
                              f"{len(windows)} KV-cache group(s))",
                              f"the cache of num_blocks={num_blocks} blocks (one the null "
                              f"block) can never hold its {r.max_tokens} tokens")
    if prompts is None:
        return requests, None
    prompts = tuple(prompts)
    if len(prompts) != len(requests):
        raise ConfigError("prompts", f"{len(prompts)} prompts", f"{len(requests)}, one per "
                          "request", "every request needs its prompt's tokens")
    out = []
    for i, (r, p) in enumerate(zip(requests, prompts)):
        a = np.asarray(p)
        if a.shape != (r.prompt_len,) or a.dtype.kind not in "iu" or \
                (a.size and (a.min() < 0 or a.max() >= cfg.vocab)):
            raise ConfigError(f"prompts[{i}]", p, f"{r.prompt_len} token ids in [0, "
                              f"{cfg.vocab})", f"request {r.request_id}'s prompt_len is "
                              f"{r.prompt_len}")
        out.append(tuple(int(x) for x in a))
    longest: dict = {}                      # prefix id -> (request index, its prefix tokens)
    for i, r in enumerate(requests):
        if r.prefix_id is not None and len(out[i][:r.prefix_len]) > len(
                longest.get(r.prefix_id, (0, ()))[1]):
            longest[r.prefix_id] = (i, out[i][:r.prefix_len])
    for i, r in enumerate(requests):
        if r.prefix_id is None:
            continue
        j, head = longest[r.prefix_id]
        if out[i][:r.prefix_len] != head[:r.prefix_len]:
            raise ConfigError(f"prompts[{i}]", out[i][:r.prefix_len],
                              f"the first {r.prefix_len} tokens of prompts[{j}] (prefix_id "
                              f"{r.prefix_id})", "requests of one prefix_id share their "
                              "first prefix_len tokens, and the prefix cache shares their KV")
    return requests, tuple(out)


def shard_params(cfg: GPTConfig, params: dict, tp: int, pp: int, ep: int) -> list[dict]:
    """Each rank's pieces of the global ``params`` (by name), rank = stage·tp + t: the
    stage's layers (K/V pieces by :func:`~tensor_parallel.llama.llama_piece`; an MoE
    layer's router whole, its experts t's E/ep whole ones when ep = tp, else each
    expert's columns / rows of f; the shared expert as a dense MLP), wte on the first
    stage (and the last when tied), norm_f_g and w_out on the last."""
    out = []
    for stage in range(pp):
        layers = stage_layers(cfg.layers, pp)[stage]
        names = [n for n in params if n.startswith("layers.")
                 and int(n.split(".")[1]) in layers]
        if stage == 0 or (stage == pp - 1 and cfg.tie_embeddings):
            names.insert(0, "wte")
        if stage == pp - 1:
            names += [n for n in ("norm_f_g", "w_out") if n in params]
        for t in range(tp):
            out.append({n: _contiguous(_piece(cfg, n, params[n], tp, t, ep))
                        for n in names})
    return out


def _contiguous(a):
    return a if is_meta(a) else np.ascontiguousarray(a)


def _piece(cfg: GPTConfig, name: str, array, tp: int, t: int, ep: int):
    last = name.rsplit(".", 1)[-1]
    if last in ("w_router", "b_router") or tp == 1:
        return array
    if last in _MOE:
        if ep > 1:                                   # whole experts, split over ep = tp
            e_l = array.shape[0] // ep
            return array[t * e_l:(t + 1) * e_l]
        if last == "moe_b_down":                     # (E, h): whole (rank 0 adds it)
            return array
        dim = 1 if last in ("moe_down", "moe_b_gate", "moe_b_up") else 2  # f split over tp
        f_l = array.shape[dim] // tp
        return array[(slice(None),) * dim + (slice(t * f_l, (t + 1) * f_l),)]
    if last in _SHARED:
        return llama_piece(name.replace("shared_", "w_"), array, tp, t, cfg.kv_heads)
    return llama_piece(name, array, tp, t, cfg.kv_heads)


@dataclass(frozen=True)
class ServeRun:
    """What :func:`serve` did: ``outputs`` request id -> its generated tokens; ``steps``
    the engine steps in order (each request's chunk or decode and block table, the
    preemptions); ``preemptions`` the scheduler's total; ``logits`` request id -> the
    (output_len, V) logits each output was picked from."""

    outputs: MappingProxyType
    steps: tuple
    preemptions: int
    logits: MappingProxyType = field(repr=False)

    def __repr__(self) -> str:
        return (f"ServeRun(requests={len(self.outputs)}, steps={len(self.steps)}, "
                f"output_tokens={sum(map(len, self.outputs.values()))}, preemptions="
                f"{self.preemptions}, blocks_used={len(self.blocks_used)}, blocks_reused="
                f"{len(self.blocks_reused)})")

    @property
    def block_owners(self) -> MappingProxyType:
        """Block id -> the distinct request ids whose tables (any KV-cache group's) held
        it, in order of use; the null block (0, a sliding group's dropped blocks) left
        out."""
        owners: dict = {}
        for step in self.steps:
            for s in step.scheduled:
                for b in (b for t in s.group_tables for b in t if b):
                    seen = owners.setdefault(b, [])
                    if s.request_id not in seen:
                        seen.append(s.request_id)
        return MappingProxyType({b: tuple(v) for b, v in sorted(owners.items())})

    @property
    def blocks_used(self) -> frozenset:
        return frozenset(self.block_owners)

    @property
    def blocks_reused(self) -> frozenset:
        """Blocks that served two or more requests over the run."""
        return frozenset(b for b, v in self.block_owners.items() if len(v) > 1)


def _job(model, requests, prompts, tp, pp, ep, num_blocks, block_size,
         max_num_batched_tokens, max_num_seqs, engine,
         enable_prefix_caching=None, hybrid_kv_cache=True) -> ServeJob:
    cfg = serve_config(model, timing_only=prompts is None)
    _check_degrees(cfg, tp, pp, ep)
    groups = layer_groups([cfg.layer_window(i) for i in range(cfg.layers)], hybrid_kv_cache)
    chunk = max_num_batched_tokens or (VLLM_MAX_NUM_BATCHED_TOKENS if str(engine) == "vllm-v1"
                                       else num_blocks * block_size)
    requests, prompts = _check_requests(cfg, requests, prompts, num_blocks, block_size,
                                        groups.windows, chunk)
    settings = {"num_blocks": num_blocks, "block_size": block_size}
    if max_num_batched_tokens is not None:
        settings["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs is not None:
        settings["max_num_seqs"] = max_num_seqs
    if enable_prefix_caching is not None:
        settings["enable_prefix_caching"] = enable_prefix_caching
    if groups.windows != (None,):
        settings["kv_group_windows"] = groups.windows
    make_scheduler(engine, num_blocks, **{n: v for n, v in settings.items()
                                          if n != "num_blocks"})   # its own checks, here
    return ServeJob(cfg, tp, pp, ep, requests, prompts, str(engine),
                    tuple(settings.items()), groups)


def serve(cluster, model, params, requests, prompts, *, tp: int = 1, pp: int = 1,
          ep: int = 1, num_blocks: int, block_size: int = BLOCK_SIZE,
          max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
          engine: str = "vllm-v1", enable_prefix_caching: bool | None = None,
          hybrid_kv_cache: bool = True) -> ServeRun:
    """Serve ``requests`` (:class:`serving.Request`, their ``prompts`` token ids) with
    ``model`` (a ModelSpec, preset name or GPTConfig; ``params`` its global parameters by
    name, None: ``GPT(config, seed=0).init_params()``) on ``cluster`` (a VirtualCluster on
    :func:`serve_mesh` (tp, pp)); the scheduler ``engine`` with ``num_blocks`` KV blocks
    of ``block_size`` tokens per device, its token budget, sequence cap and prefix caching
    (None: its defaults — vLLM v1 caches: a preempted request takes back the blocks
    nobody overwrote and reads the KV they still hold); ``hybrid_kv_cache``: a model
    mixing sliding-window and full layers keeps one block table per KV-cache group, its
    sliding groups dropping the blocks that left their windows (vLLM's hybrid manager,
    its default; :mod:`serving.kv_groups`). Every rank must agree on every token, or
    RuntimeError."""
    job = _job(model, requests, prompts, tp, pp, ep, num_blocks, block_size,
               max_num_batched_tokens, max_num_seqs, engine, enable_prefix_caching,
               hybrid_kv_cache)
    cfg = job.config
    if getattr(cluster, "mesh", None) != serve_mesh(tp, pp):
        raise ConfigError("cluster", getattr(cluster, "mesh", cluster),
                          f"a VirtualCluster on {serve_mesh(tp, pp)!r}",
                          f"tp={tp} x pp={pp} serve on the mesh (pp, tp)")
    params = GPT(cfg, seed=0).init_params() if params is None else params
    shapes = llama_param_shapes(cfg)
    if set(params) != set(shapes) or any(np.shape(params[n]) != s for n, s in shapes.items()):
        raise ConfigError("params", f"{len(params)} arrays", "the global parameters of the "
                          "model by name (llama_param_shapes)", "names or shapes differ")
    pieces = shard_params(cfg, params, tp, pp, ep)
    results = cluster.run(serve_program, [(job, p) for p in pieces])
    outputs = results[0]["outputs"]
    for r, res in enumerate(results):
        if res["outputs"] != outputs:
            raise RuntimeError(f"serve: rank {r}'s tokens differ from rank 0's")
    logits = next(res["logits"] for res in results if res["logits"] is not None)
    return ServeRun(MappingProxyType(dict(outputs)), tuple(results[0]["steps"]),
                    results[0]["preemptions"], MappingProxyType(dict(logits)))


def serve_meta_args(mesh, model, requests, *, tp: int = 1, pp: int = 1, ep: int = 1,
                    num_blocks: int, block_size: int = BLOCK_SIZE,
                    max_num_batched_tokens: int | None = None,
                    max_num_seqs: int | None = None, engine: str = "vllm-v1",
                    dtype: str = "float64",
                    enable_prefix_caching: bool | None = None,
                    hybrid_kv_cache: bool = True) -> list[tuple]:
    """``serve_program``'s arguments per rank on shape-only parameters of ``dtype``
    ("float16" for a 16-bit model's bytes) and no prompts, for ``trace_program(mesh,
    serve_program, ...)`` (the schedule needs counts only)."""
    job = _job(model, requests, None, tp, pp, ep, num_blocks, block_size,
               max_num_batched_tokens, max_num_seqs, engine, enable_prefix_caching,
               hybrid_kv_cache)
    job = replace(job, config=replace(job.config, dtype=dtype))
    if mesh != serve_mesh(tp, pp):
        raise ConfigError("mesh", mesh, f"{serve_mesh(tp, pp)!r}", "serving's mesh is (pp, tp)")
    params = {n: MetaArray(s, job.config.dtype)
              for n, s in llama_param_shapes(job.config).items()}
    return [(job, p) for p in shard_params(job.config, params, tp, pp, ep)]


def trace_serve(model, requests, *, tp: int = 1, pp: int = 1, ep: int = 1, **settings):
    """The traces (one per rank) of serving ``requests``: every step's compute and
    communication, shape-only (:func:`serve_meta_args`; ``settings`` its scheduler's and
    ``dtype``)."""
    mesh = serve_mesh(tp, pp)
    return trace_program(mesh, serve_program,
                         serve_meta_args(mesh, model, requests, tp=tp, pp=pp, ep=ep,
                                         **settings))


def greedy_reference(model, params, prompt, output_len: int) -> tuple[tuple, np.ndarray]:
    """(output tokens, their logits (output_len, V)): greedy generation in one process,
    re-running the WHOLE sequence (prompt + outputs so far) through
    :func:`~pipeline_parallel.llama.llama_reference` for each token — no cache. An MoE
    model routes the sequence in one dropless call."""
    cfg = serve_config(model)
    seq, rows = [int(x) for x in prompt], []
    for _ in range(int(output_len)):
        tokens = np.array([seq])
        groups = (1, [[([0], np.arange(len(seq)))]]) if cfg.experts else None
        _, logits, _ = llama_reference(cfg, params, tokens, np.zeros_like(tokens),
                                       moe_groups=groups)
        rows.append(logits[0, -1])
        seq.append(int(np.argmax(logits[0, -1])))
    return tuple(seq[len(prompt):]), np.array(rows)

