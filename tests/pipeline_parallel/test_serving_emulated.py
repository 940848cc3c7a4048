"""Emulated serving (pipeline_parallel.decoder): a tiny Llama (and an MoE Llama) served on
the virtual devices with a paged KV cache under tp, pp and ep and vLLM v1's continuous
batching emits, for every request, the greedy tokens — and the logits — of the
single-process reference that re-runs the whole sequence for each token (no cache);
blocks are freed and reused, preempted requests are recomputed, bad input is refused by
name, and the program's trace declares the closed-form FLOPs and moves the emulator's
bytes — also with attention biases (Qwen2/Qwen2.5, GPT-OSS's b_o) and QK-norm (Qwen3), and
with GPT-OSS's sliding windows, attention sinks and MoE biases."""

from contextlib import nullcontext
from dataclasses import replace
from itertools import pairwise

import numpy as np
import pytest

from mesh import Mesh
from modeling import MLP, Attention, ConfigError, Layer, ModelSpec, MoE
from modeling.presets import load_model
from pipeline_parallel.decoder import (
    BLOCK_SIZE, greedy_reference, serve, serve_config, serve_mesh, trace_serve)
from pipeline_parallel.gpt import GPT
from pipeline_parallel.paged_attention import PagedKVCache, SequenceChunk, slots
from serving import Request
from tensor_parallel.attention import TransformerOps
from vcluster.runtime.tracing import TraceCompute, comm_signature, trace_comm_signature

pytestmark = pytest.mark.timeout(300)

RTOL, ATOL = 1e-9, 1e-12
H, V, HEADS, KV_HEADS, D, F = 32, 64, 4, 2, 8, 64
DENSE = ModelSpec("tiny-llama", hidden=H, vocab=V,
                  layers=(Layer(Attention(HEADS, KV_HEADS, D), MLP("swiglu", F)),) * 2)
_MOE_LAYER = Layer(Attention(HEADS, KV_HEADS, D),
                   MoE(experts=4, top_k=2, expert=MLP("swiglu", 16), shared_experts=1,
                       shared_width=8, normalize_top_k=True))
# a dense first layer, then experts (DeepSeek's pattern), with a shared expert
MOE = ModelSpec("tiny-moe", hidden=H, vocab=V,
                layers=(Layer(Attention(HEADS, KV_HEADS, D), MLP("swiglu", F)),)
                + (_MOE_LAYER,) * 3)

# Qwen2/Qwen2.5 (q, k, v biases), with the output's bias too (GPT-OSS's attention), and
# Qwen3 (QK-norm): the tiny Llama's shape with the attention's extras
QWEN = {name: ModelSpec(f"tiny-{name}", hidden=H, vocab=V, layers=(Layer(
            Attention(HEADS, KV_HEADS, D, **extras), MLP("swiglu", F)),) * 2)
        for name, extras in (("qwen2", dict(qkv_bias=True)),
                             ("qwen2-out-bias", dict(qkv_bias=True, out_bias=True)),
                             ("qwen3", dict(qk_norm=True)))}
_QWEN_MOE_LAYER = Layer(Attention(HEADS, KV_HEADS, D, qk_norm=True, qkv_bias=True,
                                  out_bias=True), _MOE_LAYER.mlp)
QWEN_MOE = ModelSpec("tiny-qwen-moe", hidden=H, vocab=V,
                     layers=(Layer(_QWEN_MOE_LAYER.attention, MLP("swiglu", F)),)
                     + (_QWEN_MOE_LAYER,) * 3)

# GPT-OSS in miniature: a sliding window of 4 (shorter than the prompts) on the even layers,
# full attention on the odd ones, sinks, q/k/v and output biases, and a top-2-of-4 MoE with
# the router's and the experts' biases (softmax over the chosen two: normalised gates)
OSS_WINDOW = 4
_OSS_MOE = MoE(experts=4, top_k=2, expert=MLP("swiglu", 16, bias=True), router_bias=True,
               normalize_top_k=True)
OSS = ModelSpec("tiny-gpt-oss", hidden=H, vocab=V, layers=tuple(Layer(Attention(
    HEADS, KV_HEADS, D, window=OSS_WINDOW if i % 2 == 0 else None, sinks=True,
    qkv_bias=True, out_bias=True), _OSS_MOE) for i in range(4)))

# 8 requests: prompts 3..40 tokens, outputs 1..12, arriving at steps 0..9
PROMPT_LENS = (3, 40, 17, 9, 25, 5, 33, 12)
OUTPUT_LENS = (4, 1, 12, 7, 3, 10, 5, 8)
ARRIVALS = (0, 0, 1, 2, 3, 5, 6, 9)
BUDGET, SEQS = 16, 4            # max_num_batched_tokens (prompts get chunked), max_num_seqs
REQUESTS = tuple(Request(i, p, o, arrival_step=a)
                 for i, (p, o, a) in enumerate(zip(PROMPT_LENS, OUTPUT_LENS, ARRIVALS)))


def _prompts(requests, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, r.prompt_len) for r in requests]


class _Case:
    """A model, its parameters, prompts and the reference's tokens and logits."""

    def __init__(self, spec, requests=REQUESTS, seed=1):
        self.spec, self.requests = spec, requests
        self.params = GPT(serve_config(spec), seed=seed).init_params()
        self.prompts = _prompts(requests)
        self.ref = {r.request_id: greedy_reference(spec, self.params, p, r.output_len)
                    for r, p in zip(requests, self.prompts)}

    def run(self, cluster_of, tp=1, pp=1, ep=1, num_blocks=10, **kw):
        return serve(cluster_of(serve_mesh(tp, pp)), self.spec, self.params, self.requests,
                     self.prompts, tp=tp, pp=pp, ep=ep, num_blocks=num_blocks,
                     max_num_batched_tokens=kw.pop("max_num_batched_tokens", BUDGET),
                     max_num_seqs=kw.pop("max_num_seqs", SEQS), **kw)

    def check(self, run):
        for r in self.requests:
            tokens, logits = self.ref[r.request_id]
            assert run.outputs[r.request_id] == tokens, r
            np.testing.assert_allclose(run.logits[r.request_id], logits, rtol=RTOL,
                                       atol=ATOL, err_msg=f"request {r.request_id}")


@pytest.fixture(scope="module")
def dense():
    return _Case(DENSE)


@pytest.fixture(scope="module")
def moe():
    return _Case(MOE)


def _owners(steps) -> dict:
    """Block id -> [(step index, request id)] for every scheduled table (of any KV-cache
    group) that held it; the null block 0 (where a sliding group dropped one) left out."""
    out = {}
    for step in steps:
        for s in step.scheduled:
            for b in {b for t in s.group_tables for b in t if b}:
                out.setdefault(b, []).append((step.index, s.request_id))
    return out


def _check_batching(run, requests=REQUESTS):
    """The steps honour the budget and the cap; prompts were chunked; requests joined
    at their arrival step or later, mid-run; a block served two requests, one after the
    other (the first had finished or been preempted before the second got it)."""
    first_step = {}
    for step in run.steps:
        assert step.num_scheduled_tokens <= BUDGET and len(step.scheduled) <= SEQS
        for s in step.scheduled:
            first_step.setdefault(s.request_id, step.index)
    by_id = {r.request_id: r for r in requests}
    assert all(first_step[i] >= by_id[i].arrival_step for i in first_step)
    assert any(not s.is_decode and s.num_new_tokens < by_id[s.request_id].prompt_len
               for step in run.steps for s in step.scheduled), "no prompt was chunked"
    assert any(len({s.request_id for s in step.scheduled}) > 1 and any(
        s.is_decode for s in step.scheduled) and any(not s.is_decode for s in step.scheduled)
        for step in run.steps), "no step mixed decodes with a prefill"
    reused = {b for b, uses in _owners(run.steps).items() if len({r for _, r in uses}) > 1}
    assert reused and reused == set(run.blocks_reused)
    for b in reused:
        uses = _owners(run.steps)[b]
        for (s1, r1), (s2, r2) in pairwise(uses):
            assert s2 > s1 or r1 == r2        # never two owners in one step


# --- tokens equal the reference ------------------------------------------------------------
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
                         ids=["tp1", "tp2", "tp4-kv-replicated", "pp2", "tp2-pp2"])
def test_dense_greedy_tokens_equal_reference(cluster_of, dense, tp, pp):
    run = dense.run(cluster_of, tp, pp)
    dense.check(run)
    _check_batching(run)
    assert sum(map(len, run.outputs.values())) == sum(OUTPUT_LENS)


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 2), (2, 1, 1), (4, 1, 4),
                                        (2, 2, 2)],
                         ids=["ep1", "tp2-ep2", "tp2-experts-tp", "tp4-ep4", "tp2-pp2-ep2"])
def test_moe_greedy_tokens_equal_reference(cluster_of, moe, tp, pp, ep):
    """Experts split whole over ep = tp ranks (or each over tp, ep = 1), the router and
    its top-2 replicated, one all-reduce combining; dense first layer, shared expert."""
    run = moe.run(cluster_of, tp, pp, ep)
    moe.check(run)
    _check_batching(run)


def _shrunk(name: str) -> ModelSpec:
    """A shipped preset's architecture at emulator size: its block types, router, top-k,
    expert count and GQA ratio kept; widths, layers and vocabulary cut."""
    spec = load_model(name)
    layer = spec.layers[0]
    att = replace(layer.attention, heads=HEADS, kv_heads=HEADS * layer.attention.kv_heads
                  // layer.attention.heads or 1, head_dim=D)
    mlp = layer.mlp
    mlp = replace(mlp, expert=replace(mlp.expert, width=16)) if isinstance(mlp, MoE) else \
        replace(mlp, width=F)
    return replace(spec, name=f"{name} (shrunk)", hidden=H, vocab=V,
                   layers=(Layer(att, mlp),) * 2)


@pytest.mark.parametrize("tp, ep", [(2, 2), (2, 1)], ids=["tp2-ep2", "tp2-experts-tp"])
def test_an_moe_preset_shrunk_serves_the_reference_tokens(cluster_of, tp, ep):
    """Mixtral-8x7B's architecture (8 experts, softmax top-2, normalised gates, GQA 4:1)
    at emulator size, experts over ep = 2: every request's greedy tokens equal the
    reference, blocks reused."""
    spec = _shrunk("mixtral-8x7b")
    assert spec.layers[0].mlp.experts == 8 and spec.layers[0].mlp.top_k == 2
    case = _Case(spec)
    run = case.run(cluster_of, tp, 1, ep)
    case.check(run)
    _check_batching(run)


def test_static_batching_tokens_equal_reference(cluster_of, dense):
    """The static scheduler's steps (whole prompts, batches decoded to the end) give the
    same tokens: the batch composition never changes a request's tokens."""
    run = dense.run(cluster_of, 2, 1, engine="static", num_blocks=16,
                    max_num_batched_tokens=None)
    dense.check(run)
    assert all(s.num_computed_tokens == 0 or s.is_decode for st in run.steps
               for s in st.scheduled)


# --- attention biases and QK-norm ---------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(QWEN))
def qwen(request):
    return _Case(QWEN[request.param])


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
                         ids=["tp1", "tp2", "tp4-kv-replicated", "pp2", "tp2-pp2"])
def test_biases_and_qk_norm_greedy_tokens_equal_reference(cluster_of, qwen, tp, pp):
    """q/k/v biases (b_q, b_kv split with W_q's and W_kv's columns, replicated with the
    K/V heads at tp 4 > kv_heads 2), the output's bias (added once after the all-reduce)
    and QK-norm (gains whole on every rank): the reference's tokens and logits."""
    run = qwen.run(cluster_of, tp, pp)
    qwen.check(run)
    _check_batching(run)


def test_the_biases_and_gains_change_the_reference():
    """The extras are not inert: the reference's logits move when the biases are zeroed
    and the QK-norm gains set to one (so the tests above would see a decoder dropping
    them), and the reference is llama_reference's (not the decoder's) math."""
    import pipeline_parallel.decoder as decoder
    from pipeline_parallel.llama import llama_reference
    assert decoder.llama_reference is llama_reference
    for spec in QWEN.values():
        params = GPT(serve_config(spec), seed=1).init_params()
        plain = {n: (np.ones_like(a) if n.endswith(("q_norm_g", "k_norm_g")) else
                     np.zeros_like(a) if n.rsplit(".", 1)[-1] in ("b_q", "b_kv", "b_o")
                     else a) for n, a in params.items()}
        assert any(not np.array_equal(plain[n], params[n]) for n in params)
        prompt = _prompts(REQUESTS[:1])[0]
        _, logits = greedy_reference(spec, params, prompt, 3)
        _, logits_plain = greedy_reference(spec, plain, prompt, 3)
        assert np.abs(logits - logits_plain).max() > 1e-3, spec.name


@pytest.mark.parametrize("tp, ep", [(2, 2), (2, 1)], ids=["tp2-ep2", "tp2-experts-tp"])
def test_an_moe_with_biases_and_qk_norm_equals_reference(cluster_of, tp, ep):
    """An MoE model (dense first layer, shared expert) whose attention has q/k/v and
    output biases and QK-norm, experts over ep = 2 (and each over tp): the reference's
    tokens and logits."""
    case = _Case(QWEN_MOE)
    run = case.run(cluster_of, tp, 1, ep)
    case.check(run)
    _check_batching(run)


# --- GPT-OSS: sliding windows, attention sinks, MoE biases -------------------------------
@pytest.fixture(scope="module")
def oss():
    return _Case(OSS)


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 2), (2, 1, 1), (4, 1, 4),
                                        (1, 2, 1), (2, 2, 2)],
                         ids=["tp1", "tp2-ep2", "tp2-experts-tp", "tp4-ep4-kv-replicated",
                              "pp2", "tp2-pp2-ep2"])
def test_gpt_oss_greedy_tokens_equal_reference(cluster_of, oss, tp, pp, ep):
    """Windowed layers (w = 4, every prompt longer: each prefill chunk's and decode's
    queries see their last 4 cached keys) beside full ones, sinks split over tp by query
    heads, q/k/v and output biases, the router's bias (whole) and the experts' (with
    their experts over ep = tp, or b_gate/b_up split with f and b_down added once at
    ep = 1): the reference's tokens and logits."""
    cfg = serve_config(OSS)
    assert (cfg.window, cfg.window_layers, cfg.attention_sinks, cfg.moe_router_bias,
            cfg.moe_expert_bias) == (OSS_WINDOW, (0, 2), True, True, True)
    assert min(PROMPT_LENS) < OSS_WINDOW < sorted(PROMPT_LENS)[1]
    run = oss.run(cluster_of, tp, pp, ep)
    oss.check(run)
    _check_batching(run)


def _oss_plain(params, drop: str) -> dict:
    """``params`` with GPT-OSS's ``drop`` ("sinks" or "biases") made inert: sinks −∞
    (e^σ = 0), the MoE biases zero."""
    names = {"sinks": ("sinks",), "biases": ("b_router", "moe_b_gate", "moe_b_up",
                                             "moe_b_down")}[drop]
    return {n: (np.full_like(a, -np.inf if drop == "sinks" else 0.0)
                if n.rsplit(".", 1)[-1] in names else a) for n, a in params.items()}


def test_gpt_oss_extras_change_the_reference(oss):
    """The window, the sinks and the MoE biases all move the reference's logits (so the
    test above would see a decoder ignoring any of them); the reference is
    llama_reference's."""
    prompt = oss.prompts[1]                  # 40 tokens, ten windows
    _, logits = greedy_reference(OSS, oss.params, prompt, 3)
    for drop in ("sinks", "biases"):
        _, other = greedy_reference(OSS, _oss_plain(oss.params, drop), prompt, 3)
        assert np.abs(logits - other).max() > 1e-3, drop
    full = replace(serve_config(OSS), window=None, window_layers=None)
    _, other = greedy_reference(full, oss.params, prompt, 3)
    assert np.abs(logits - other).max() > 1e-3, "window"


@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 2), (2, 2, 1)])
def test_gpt_oss_traces_move_the_emulators_bytes(cluster_of, oss, tp, pp, ep):
    """Traced on shape-only arrays, the GPT-OSS-like model moves exactly the emulator's
    messages and bytes (no collective more than a plain MoE Llama: the sinks split with
    the heads, b_r whole, the experts' biases with their experts), and each rank's paged
    attention declares the pairs of its layers' windows: Σ_p min(p + 1, 4) on the
    windowed layers, the causal pairs on the others."""
    kw = dict(tp=tp, pp=pp, ep=ep, num_blocks=10, max_num_batched_tokens=BUDGET,
              max_num_seqs=SEQS)
    traces = trace_serve(OSS, REQUESTS, **kw)
    cluster = cluster_of(serve_mesh(tp, pp))
    cluster.reset_stats()
    run = serve(cluster, OSS, oss.params, REQUESTS, oss.prompts, **kw)
    oss.check(run)
    events = cluster.trace()
    mesh = serve_mesh(tp, pp)
    for trace in traces:
        assert trace_comm_signature(trace) == comm_signature(events, trace.rank)
        layers = range(mesh.group_position("pp", trace.rank) * 4 // pp,
                       (mesh.group_position("pp", trace.rank) + 1) * 4 // pp)
        want = sum(4 * HEADS // tp * D * sum(
            sum(min(p + 1, OSS_WINDOW) if i % 2 == 0 else p + 1
                for p in range(s.num_computed_tokens,
                               s.num_computed_tokens + s.num_new_tokens))
            for s in step.scheduled) for step in run.steps for i in layers)
        got = sum(op.flops for op in trace.ops if isinstance(op, TraceCompute)
                  and op.name.endswith("paged attention"))
        assert got == want


def test_serve_config_takes_gpt_oss_20b():
    """GPT-OSS-20B's config (windows of 128 on the even layers, sinks, biases, the MoE's
    biases) is served when traced (timing_only: its clamped SwiGLU and YaRN RoPE change
    values, not shapes); emulated, only those two are refused, by GPTConfig."""
    cfg = serve_config("gpt-oss-20b", timing_only=True)
    assert (cfg.window, cfg.attention_sinks, cfg.moe_router_bias, cfg.moe_expert_bias,
            cfg.qkv_bias, cfg.out_bias) == (128, True, True, True, True, True)
    assert cfg.window_layers == tuple(range(0, 24, 2))
    with pytest.raises(ConfigError, match=r"cannot run (RoPE scaling|a clamped SwiGLU)"):
        serve_config("gpt-oss-20b")
    spec = load_model("gpt-oss-20b")
    bare = replace(spec, rope_scaling=None, layers=tuple(
        replace(x, mlp=replace(x.mlp, expert=replace(x.mlp.expert, clamp=None)))
        for x in spec.layers))
    assert serve_config(bare).window == 128        # nothing else refused


@pytest.mark.parametrize("name, tp, pp", [("qwen2-out-bias", 4, 1), ("qwen3", 2, 2)])
def test_the_extras_trace_with_the_closed_form_flops(cluster_of, name, tp, pp):
    """Traced on shape-only arrays, a model with biases and QK-norm declares the dense
    model's FLOPs (the adds and norms are elementwise: 0 FLOPs) and moves the emulator's
    messages and bytes (no collective more: b_o after the one all-reduce, the gains
    whole)."""
    spec, case = QWEN[name], None
    kw = dict(tp=tp, pp=pp, num_blocks=10, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    traces = trace_serve(spec, REQUESTS, **kw)
    cluster = cluster_of(serve_mesh(tp, pp))
    cluster.reset_stats()
    case = _Case(spec)
    run = serve(cluster, spec, case.params, REQUESTS, case.prompts, **kw)
    events = cluster.trace()
    _assert_traces_are_the_run(traces, run, events, tp, pp)
    dense = trace_serve(DENSE, REQUESTS, **kw)
    assert [trace_comm_signature(t) for t in traces] == \
        [trace_comm_signature(t) for t in dense]


# --- preemption --------------------------------------------------------------------------
@pytest.mark.parametrize("tp, pp, spec", [(1, 1, "dense"), (2, 2, "dense"), (2, 1, "moe"),
                                          (4, 1, "qwen2_out_bias"), (2, 2, "qwen3"),
                                          (2, 1, "qwen_moe"), (2, 1, "oss"), (1, 2, "oss")])
def test_preempted_requests_are_recomputed_and_equal_reference(cluster_of, tp, pp, spec,
                                                               request):
    """5 usable blocks (80 tokens) for a 50-token request growing beside others, prefix
    caching off: the scheduler preempts, the victim is re-prefilled from position 0 over
    its prompt and the tokens it had emitted, and every token still equals the
    reference. (GPT-OSS: 7 usable blocks — its two KV-cache groups, full and sliding,
    hold 4 + 3 blocks of the 50-token request.)"""
    case = request.getfixturevalue(f"_preempt_{spec}")
    run = case.run(cluster_of, tp, pp, ep=tp if spec in ("moe", "qwen_moe", "oss") else 1,
                   num_blocks=8 if spec == "oss" else 6, enable_prefix_caching=False)
    case.check(run)
    assert run.preemptions > 0
    victims = {r for step in run.steps for r in step.preempted}
    assert victims
    recomputed = 0
    for rid in victims:
        emitted = 0
        for step in run.steps:
            for s in step.scheduled:
                if s.request_id != rid:
                    continue
                if s.num_computed_tokens == 0 and emitted:
                    # a recompute: prefills prompt + emitted outputs, in chunks
                    recomputed += 1
                emitted += s.samples
    assert recomputed > 0


@pytest.mark.parametrize("tp, pp, spec", [(1, 1, "dense"), (2, 2, "dense"), (2, 1, "moe"),
                                          (2, 2, "qwen3"), (2, 1, "oss"), (1, 2, "oss")])
def test_preempted_requests_read_back_their_cached_blocks_and_equal_reference(
        cluster_of, tp, pp, spec, request):
    """The same, prefix caching on (vLLM v1's default): a victim re-admitted takes back
    its leading blocks nobody overwrote and starts computing after them; attention then
    reads the KV those physical blocks still hold from before the preemption — and every
    token and logit still equals the reference. At least one re-admission starts past 0
    (a hit), on the blocks it held before. (GPT-OSS here in one KV-cache group,
    ``hybrid_kv_cache=False``: its sliding layers keep every block, as
    ``--disable-hybrid-kv-cache-manager``; the hybrid layout's hits are the next
    test's.)"""
    case = request.getfixturevalue(f"_preempt_{spec}")
    run = case.run(cluster_of, tp, pp, ep=tp if spec in ("moe", "oss") else 1,
                   num_blocks=6, **({"hybrid_kv_cache": False} if spec == "oss" else {}))
    case.check(run)
    assert run.preemptions > 0
    victims = {r for step in run.steps for r in step.preempted}
    hits = 0
    for rid in victims:
        before, preempted = None, False
        for step in run.steps:
            for s in step.scheduled:
                if s.request_id != rid:
                    continue
                if preempted and s.num_computed_tokens > 0:
                    hits += 1
                    kept = s.num_computed_tokens // BLOCK_SIZE
                    assert s.block_table[:kept] == before[:kept]
                preempted = False
                before = s.block_table
            preempted = preempted or rid in step.preempted
    assert hits > 0


# a 50-token request growing beside three others in 5 usable blocks
PREEMPTING = (Request(0, 30, 20), Request(1, 12, 12), Request(2, 20, 6, arrival_step=1),
              Request(3, 7, 9, arrival_step=2))


@pytest.fixture(scope="module")
def _preempt_dense():
    return _Case(DENSE, PREEMPTING)


@pytest.fixture(scope="module")
def _preempt_moe():
    return _Case(MOE, PREEMPTING)


@pytest.fixture(scope="module")
def _preempt_qwen2_out_bias():
    return _Case(QWEN["qwen2-out-bias"], PREEMPTING)


@pytest.fixture(scope="module")
def _preempt_qwen3():
    return _Case(QWEN["qwen3"], PREEMPTING)


@pytest.fixture(scope="module")
def _preempt_qwen_moe():
    return _Case(QWEN_MOE, PREEMPTING)


@pytest.fixture(scope="module")
def _preempt_oss():
    return _Case(OSS, PREEMPTING)


# --- shared prefixes ---------------------------------------------------------------------
# prefix 0 (20 tokens: block 0 shared) and prefix 1 (35: blocks 0 and 1), and one prompt of
# its own. Step 0: request 0 computes prefix 0's block 0 and request 1 takes it back in the
# same step; 2 and 4 share prefix 1 one step apart; 5 arrives after 0 and 1 finished and
# takes back their freed block; request 3's prompt is its own.
SHARING = (Request(0, 23, 3, prefix_id=0, prefix_len=20),
           Request(1, 26, 5, prefix_id=0, prefix_len=20),
           Request(2, 40, 4, arrival_step=1, prefix_id=1, prefix_len=35),
           Request(3, 9, 6, arrival_step=2),
           Request(4, 37, 3, arrival_step=5, prefix_id=1, prefix_len=35),
           Request(5, 21, 4, arrival_step=12, prefix_id=0, prefix_len=20))


class _SharingCase(_Case):
    """Prompts whose first prefix_len tokens are their prefix's."""

    def __init__(self, spec, seed=1):
        rng = np.random.default_rng(7)
        heads = {pid: rng.integers(0, V, 35) for pid in (0, 1)}
        self.spec, self.requests = spec, SHARING
        self.params = GPT(serve_config(spec), seed=seed).init_params()
        self.prompts = [np.concatenate([heads[r.prefix_id][:r.prefix_len], rng.integers(
            0, V, r.prompt_len - r.prefix_len)]) if r.prefix_id is not None else
            rng.integers(0, V, r.prompt_len) for r in SHARING]
        self.ref = {r.request_id: greedy_reference(spec, self.params, p, r.output_len)
                    for r, p in zip(SHARING, self.prompts)}


@pytest.mark.parametrize("tp, pp, spec", [(1, 1, "dense"), (2, 2, "dense"), (2, 1, "moe"),
                                          (2, 1, "oss"), (1, 2, "oss")])
def test_requests_sharing_a_prefix_read_its_blocks_and_equal_reference(tp, pp, spec,
                                                                       cluster_of):
    """Prefix caching with shared prefixes: a request admitted after another computed (or
    is computing, in the same step) its prefix's full blocks takes them back — the same
    physical blocks in both tables — computes only the rest, and every token and logit
    equals the reference that computes each prompt whole."""
    case = _SharingCase({"dense": DENSE, "moe": MOE, "oss": OSS}[spec])
    run = case.run(cluster_of, tp, pp, ep=tp if spec in ("moe", "oss") else 1,
                   num_blocks=24, max_num_batched_tokens=48)
    case.check(run)
    first = {}
    for step in run.steps:
        for s in step.scheduled:
            first.setdefault(s.request_id, (step.index, s))
    assert {rid: s.num_computed_tokens for rid, (_, s) in first.items()} == {
        0: 0, 1: 16, 2: 0, 3: 0, 4: 32, 5: 16}
    full = first[0][1].block_tables[-1]  # the full-attention group (GPT-OSS: sliding, full)
    table = {rid: s.block_tables[-1] for rid, (_, s) in first.items()}
    assert full == table[0]
    assert table[1][0] == table[0][0] and table[4][:2] == table[2][:2]
    if spec == "oss":   # the sliding group (window 4) takes back only the block before the
        sliding = {rid: s.block_tables[0] for rid, (_, s) in first.items()}     # hit point
        assert sliding[4][:2] == (0, sliding[2][1]) and sliding[1][0] == sliding[0][0]
    assert first[1][0] == first[0][0]                     # a hit in the writer's own step
    assert table[5][0] == table[0][0] and first[5][0] > max(
        i for i, step in enumerate(run.steps) for s in step.scheduled if s.request_id < 2)
    plain = case.run(cluster_of, tp, pp, ep=tp if spec in ("moe", "oss") else 1,
                     num_blocks=24, max_num_batched_tokens=48, enable_prefix_caching=False)
    case.check(plain)
    assert all(s.num_computed_tokens == 0 for step in plain.steps[:1] for s in step.scheduled)


def test_prompts_of_one_prefix_must_share_its_tokens(dense):
    prompts = _SharingCase(DENSE).prompts
    prompts[4] = np.concatenate([prompts[4][:30], (prompts[4][30:31] + 1) % V,
                                 prompts[4][31:]])
    with pytest.raises(ConfigError, match=r"^prompts\[4\]=.*the first 35 tokens of "
                                          r"prompts\[2\] \(prefix_id 1\)"):
        serve(None, DENSE, dense.params, SHARING, prompts, num_blocks=24)


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 2), (1, 2, 1)],
                         ids=["tp1", "tp2-ep2", "pp2"])
def test_gpt_oss_hybrid_kv_cache_drops_blocks_that_left_the_window(cluster_of, oss, tp, pp,
                                                                   ep):
    """vLLM's hybrid KV-cache manager (its default): GPT-OSS's sliding layers (w = 4) and
    full layers keep one block table each; before each allocation the sliding table's
    blocks wholly before token c − w + 1 go back to the pool, the null block 0 in their
    place, while the full table keeps every block. 9 usable blocks for the 8 requests:
    requests are preempted and a re-admission takes back cached blocks (in the sliding
    group only the one before the hit point) — and every token and logit equals the
    reference, as with the manager off."""
    run = oss.run(cluster_of, tp, pp, ep, num_blocks=10)
    oss.check(run)
    bs, dropped = BLOCK_SIZE, 0
    for step in run.steps:
        for s in step.scheduled:
            sliding, full = s.block_tables
            first_useful = max(0, (s.num_computed_tokens - OSS_WINDOW + 1) // bs)
            assert all(b == 0 for b in sliding[:first_useful]), s
            assert all(sliding[first_useful:]) and all(full) and len(sliding) == len(full), s
            dropped += sliding.count(0)
    assert dropped > 0 and run.preemptions > 0
    assert any(s.num_computed_tokens > 0 and s.request_id in step_before.preempted
               for i, step_before in enumerate(run.steps) for step in run.steps[i + 1:]
               for s in step.scheduled)
    off = oss.run(cluster_of, tp, pp, ep, num_blocks=10, hybrid_kv_cache=False)
    oss.check(off)
    assert all(0 not in s.block_table for step in off.steps for s in step.scheduled)


# --- the paged cache on its own -----------------------------------------------------------
class _HostDevice:
    """Just enough of a device for the cache's math in this process."""

    rank, xp = 0, np
    mesh = Mesh((1,), ("tp",))

    def compute(self, *_, **__):
        return nullcontext()

    def empty(self, shape, dtype):
        return np.full(shape, np.nan, dtype)       # unwritten slots poison any read


def test_paged_attention_reads_only_its_own_blocks():
    """Two sequences with scattered tables in a NaN-filled pool: a decode and a prefill
    chunk attend exactly as dense causal attention over each sequence's contiguous keys
    (numpy softmax), reading nothing outside their tables."""
    rng = np.random.default_rng(3)
    c, g, d, B = 2, 2, 4, 4
    ops = TransformerOps(_HostDevice(), "tp", False)
    cache = PagedKVCache(ops.dev, [0], num_blocks=12, block_size=B, kv_heads_local=c,
                         head_dim=d, dtype=np.float64)
    tables = ((7, 2, 9), (4, 11, 1, 5))
    prior = (9, 6)                              # cached tokens
    new = (1, 7)                                # a decode, a prefill chunk
    keys = [rng.standard_normal((p + n, c, d)) for p, n in zip(prior, new)]
    vals = [rng.standard_normal((p + n, c, d)) for p, n in zip(prior, new)]
    for t, k, v, p in zip(tables, keys, vals, prior):             # earlier steps' writes
        cache.write(ops, 0, k[:p], v[:p], slots(t, np.arange(p), B))
    chunks = (SequenceChunk(0, 1, 9, tables[0]), SequenceChunk(1, 7, 6, tables[1]))
    rows = np.concatenate([slots(t, np.arange(p, p + n), B)
                           for t, p, n in zip(tables, prior, new)])
    cache.write(ops, 0, np.concatenate([k[p:] for k, p in zip(keys, prior)]),
                np.concatenate([v[p:] for v, p in zip(vals, prior)]), rows)
    q = rng.standard_normal((sum(new), c * g * d))
    out = cache.attend(ops, 0, q, chunks)
    at = 0
    for k, v, p, n in zip(keys, vals, prior, new):
        for i in range(n):
            for head in range(c * g):
                kv = head // g
                qi = q[at + i, head * d:(head + 1) * d]
                s = k[:p + i + 1, kv] @ qi / np.sqrt(d)
                w = np.exp(s - s.max())
                w /= w.sum()
                np.testing.assert_allclose(out[at + i, head * d:(head + 1) * d],
                                           w @ v[:p + i + 1, kv], rtol=1e-12)
        at += n
    assert np.isnan(cache.pools[0][0][0]).all()      # block 0 (vLLM's null block) untouched


@pytest.mark.parametrize("window, sinks", [(4, True), (4, False), (None, True)])
def test_paged_attention_windows_and_sinks(window, sinks):
    """A decode 12 tokens past the window and a prefill chunk straddling it, in a NaN pool
    whose slots before each chunk's first window are poisoned after the writes: each
    query sees exactly its keys p − w < j ≤ p (absolute positions against the cache) and
    the sinks' e^σ in its denominator; nothing outside the window is read. Without the
    window in the decode (or without the sinks) the result differs: the serving tests'
    reference comparison would catch either."""
    rng = np.random.default_rng(5)
    c, g, d, B = 2, 2, 4, 4
    ops = TransformerOps(_HostDevice(), "tp", False)
    cache = PagedKVCache(ops.dev, [0], num_blocks=12, block_size=B, kv_heads_local=c,
                         head_dim=d, dtype=np.float64)
    tables, prior, new = ((7, 2, 9, 3, 10), (4, 11, 1, 5)), (15, 2), (1, 7)
    keys = [rng.standard_normal((p + n, c, d)) for p, n in zip(prior, new)]
    vals = [rng.standard_normal((p + n, c, d)) for p, n in zip(prior, new)]
    sink = rng.standard_normal(c * g) if sinks else None
    for t, k, v, p, n in zip(tables, keys, vals, prior, new):
        cache.write(ops, 0, k, v, slots(t, np.arange(p + n), B))
        if window is not None:                    # poison what the window never reads
            gone = slots(t, np.arange(max(0, p - window + 1)), B)
            cache.write(ops, 0, np.full((len(gone), c, d), np.nan),
                        np.full((len(gone), c, d), np.nan), gone)
    chunks = (SequenceChunk(0, 1, prior[0], tables[0]),
              SequenceChunk(1, 7, prior[1], tables[1]))
    q = rng.standard_normal((sum(new), c * g * d))
    out = cache.attend(ops, 0, q, chunks, window, sink)
    at = 0
    for k, v, p, n in zip(keys, vals, prior, new):
        for i in range(n):
            pos = p + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for head in range(c * g):
                qi = q[at + i, head * d:(head + 1) * d]
                s = k[lo:pos + 1, head // g] @ qi / np.sqrt(d)
                m = max(s.max(), sink[head]) if sinks else s.max()
                w = np.exp(s - m)
                w /= w.sum() + (np.exp(sink[head] - m) if sinks else 0.0)
                np.testing.assert_allclose(out[at + i, head * d:(head + 1) * d],
                                           w @ v[lo:pos + 1, head // g], rtol=1e-12)
        at += n
    if window is not None:                        # the decode, window ignored: other keys
        for k, v, t, p, n in zip(keys, vals, tables, prior, new):
            cache.write(ops, 0, k, v, slots(t, np.arange(p + n), B))
        full = cache.attend(ops, 0, q[:1], chunks[:1], None, sink)
        assert np.abs(full - out[:1]).max() > 1e-3
    if sinks:
        assert np.abs(cache.attend(ops, 0, q, chunks, window, None) - out).max() > 1e-3


def test_slots_follow_the_block_table():
    assert slots((5, 2, 8), [0, 15, 16, 31, 32, 40], 16).tolist() == \
        [80, 95, 32, 47, 128, 136]


# --- bad input --------------------------------------------------------------------------------
def test_bad_input_is_refused_by_name(dense):
    kw = dict(num_blocks=10, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    prompts = dense.prompts
    with pytest.raises(ConfigError, match=r"requests\[1\]=.*can never hold its 200 tokens"):
        serve(None, DENSE, None, [REQUESTS[0], Request(1, 190, 10)],
              [prompts[0], np.zeros(190, int)], **kw)
    with pytest.raises(ConfigError, match=r"^tp=3: .*allowed: a divisor of heads=4"):
        serve(None, DENSE, None, REQUESTS, prompts, tp=3, **kw)
    with pytest.raises(ConfigError, match=r"^ep=2: .*allowed: 1 for a dense model"):
        serve(None, DENSE, None, REQUESTS, prompts, tp=2, ep=2, **kw)
    with pytest.raises(ConfigError, match=r"^ep=2: .*allowed: 1 or tp=4"):
        serve(None, MOE, None, REQUESTS, prompts, tp=4, ep=2, **kw)
    with pytest.raises(ConfigError, match=r"^pp=3: .*a divisor of layers=2"):
        serve(None, DENSE, None, REQUESTS, prompts, pp=3, **kw)
    with pytest.raises(ConfigError, match=r"^prompts\[2\]=.*17 token ids in \[0, 64\)"):
        serve(None, DENSE, None, REQUESTS, prompts[:2] + [np.full(17, V)] + prompts[3:], **kw)
    with pytest.raises(ConfigError, match=r"^prompts=.*7 prompts.*allowed: 8, one per"):
        serve(None, DENSE, None, REQUESTS, prompts[:7], **kw)
    with pytest.raises(ConfigError, match=r"^cluster=None: tp=2 x pp=1 serve on the mesh"):
        serve(None, DENSE, None, REQUESTS, prompts, tp=2, **kw)
    for field, value, cfg in (
            ("capacity_factor", 1.25, replace(serve_config(MOE), capacity_factor=1.25)),
            ("moe_bias_update_rate", 0.001, replace(serve_config(MOE),
                                                    moe_bias_update_rate=0.001))):
        with pytest.raises(ConfigError, match=rf"^{field}={value}: the serving program "
                                              r"does not run it yet"):
            serve_config(cfg)
    for spec in (*QWEN.values(), QWEN_MOE, OSS):   # biases, QK-norm, windows, sinks: served
        cfg = serve_config(spec)
        assert (cfg.qkv_bias, cfg.out_bias, cfg.qk_norm) == tuple(
            getattr(spec.layers[-1].attention, f) for f in ("qkv_bias", "out_bias",
                                                             "qk_norm"))


# --- the trace -------------------------------------------------------------------------------
def _closed_form_flops(step, stage: int, tp: int, pp: int) -> int:
    """Declared FLOPs of one step on a rank of ``stage`` (module doc of the decoder):
    per layer 2·N·h·(a_l·d + 2·c_l·d) + 2·N·a_l·d·h
    + Σ_r 4·a_l·d·(n_r·c_r + n_r(n_r+1)/2) + 3·2·N·h·f/t; the last stage adds
    2·S·h·V/t for the S sampled rows."""
    a_l, c_l = HEADS // tp, max(KV_HEADS // tp, 1)
    n = step.num_scheduled_tokens
    pairs = sum(s.num_new_tokens * s.num_computed_tokens
                + s.num_new_tokens * (s.num_new_tokens + 1) // 2 for s in step.scheduled)
    layer = 2 * n * H * (a_l * D + 2 * c_l * D) + 2 * n * a_l * D * H + 4 * a_l * D * pairs \
        + 3 * 2 * n * H * F // tp
    samples = sum(s.samples for s in step.scheduled)
    return DENSE.num_layers // pp * layer + (2 * samples * H * V // tp if stage == pp - 1
                                             else 0)

def _assert_traces_are_the_run(traces, run, events, tp: int, pp: int) -> None:
    """Each rank's traced FLOPs are the closed form summed over the run's steps, and its
    messages and bytes are what the emulator moved (``events``: the cluster's trace)."""
    mesh = serve_mesh(tp, pp)
    for trace in traces:
        stage = mesh.group_position("pp", trace.rank)
        flops = sum(op.flops for op in trace.ops if isinstance(op, TraceCompute))
        assert flops == sum(_closed_form_flops(s, stage, tp, pp) for s in run.steps)
        assert trace_comm_signature(trace) == comm_signature(events, trace.rank)



@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2-pp2"])
def test_trace_flops_equal_closed_form_and_bytes_equal_emulator(cluster_of, dense, tp, pp):
    """The program traced on shape-only arrays (no prompts, no token values): each rank's
    declared FLOPs are the closed form summed over the run's steps, and its messages and
    bytes equal what the emulator moved, collective by collective."""
    kw = dict(tp=tp, pp=pp, num_blocks=10, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    traces = trace_serve(DENSE, REQUESTS, **kw)
    cluster = cluster_of(serve_mesh(tp, pp))
    cluster.reset_stats()
    run = serve(cluster, DENSE, dense.params, REQUESTS, dense.prompts, **kw)
    events = cluster.trace()
    _assert_traces_are_the_run(traces, run, events, tp, pp)


def test_one_step_flops_equal_closed_form():
    """A run of one step (three prompts prefilled together, one token each): the traced
    FLOPs of that step equal the closed form, and its attention's share is the causal
    pairs of each prompt, P(P+1)/2 per head."""
    requests = (Request(0, 5, 1), Request(1, 11, 1), Request(2, 3, 1))
    (trace,) = trace_serve(DENSE, requests, num_blocks=8, max_num_batched_tokens=32)
    ops = [op for op in trace.ops if isinstance(op, TraceCompute)]
    n, pairs = 19, 15 + 66 + 6
    want = 2 * (2 * n * H * (HEADS * D + 2 * KV_HEADS * D) + 2 * n * HEADS * D * H
                + 4 * HEADS * D * pairs + 6 * n * H * F) + 2 * 3 * H * V
    assert sum(op.flops for op in ops) == want
    assert [op.flops for op in ops if op.name.endswith("paged attention")] == \
        [4 * HEADS * D * pairs] * 2
