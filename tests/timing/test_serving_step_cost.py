"""vcluster.timing.serving: the price of an engine step and its physical floors.

The acceptance sweep (issue 53): for every model × tp × batch × context, the predicted
decode step is at least the bandwidth floor and a prefill at least the compute floor;
beside it the model's pieces are checked against independent references — DeviceSpec's
GEMM price, collective_time_s, brute-force attention pairs, a Monte-Carlo count of the
experts a batch reaches, and the closed forms of a Llama-3.1-8B step on an H100.

Speed (the simulator calls step_time thousands of times): on the 2-core development
machine, Llama-3.1-70B at tp 8 with 256 decode rows costs 55–65 µs per call, from (n, c)
pairs or from an EngineStep (``test_step_time_is_fast`` measures it; DeepSeek-V3 and
GPT-OSS-120B 60–75 µs).
"""

import itertools
import math
import time

import numpy as np
import pytest

from modeling import flops_per_token, load_model
from modeling.errors import ConfigError
from serving import EngineStep, Request, ScheduledRequest, VllmV1Scheduler
from vcluster.timing.collective_cost import collective_time_s
from vcluster.timing.presets import load_hardware, preset
from vcluster.timing.serving.tp_allreduce import tp_allreduce_s
from vcluster.timing.serving.floors import (attention_pairs, decode_floor_s,
                                            expected_experts, prefill_floor_s, step_floor)
from vcluster.timing.serving.step_cost import STEP_OVERHEAD_S, ServingCostModel, StepTime

H100 = preset("h100-dgx")
MODELS = {name: load_model(name) for name in
          ("llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")}


def _valid_tps(name):
    if name == "deepseek-v3":
        return (8,)
    out = []
    for tp in (1, 2, 4, 8):
        try:
            ServingCostModel(MODELS[name], H100, tp=tp)
        except ConfigError:
            continue
        out.append(tp)
    return tuple(out)


SWEEP = [(name, tp, ep) for name in MODELS for tp in _valid_tps(name)
         for ep in ((1, tp) if MODELS[name].is_moe and tp > 1 else (1,))]


@pytest.mark.parametrize("name, tp, ep", SWEEP)
def test_never_below_the_floors(name, tp, ep):
    """Issue 53's acceptance: every batch ∈ {1, 8, 64, 256} × context ∈ {128, 2048, 32768}
    — the decode step's parts sum to at least the bandwidth floor, a prefill of one prompt
    of the context's length at least the compute floor (the parts, not total_s: total_s
    is clamped to the floor, the parts are not). MoE models with experts split (ep 1) and
    whole (ep = tp)."""
    spec = MODELS[name]
    model = ServingCostModel(spec, H100, tp=tp, ep=ep)
    for batch, context in itertools.product((1, 8, 64, 256), (128, 2048, 32768)):
        decode = model.step_time([(1, context)] * batch)
        bandwidth = decode_floor_s(spec, H100, tp=tp, ep=ep, contexts=[context] * batch)
        assert decode.parts_s >= bandwidth, (batch, context, decode)
        assert decode.parts_s >= decode.floor_s >= bandwidth
        prefill = model.step_time([(context, context)])
        compute = prefill_floor_s(spec, H100, tp=tp, ep=ep, new_tokens=[context],
                                  contexts=[context])
        assert prefill.parts_s >= compute, (context, prefill)
        assert prefill.parts_s >= prefill.floor_s >= compute
        assert decode.total_s == pytest.approx(decode.parts_s, rel=1e-12)
        assert prefill.total_s == pytest.approx(prefill.parts_s, rel=1e-12)


def test_llama_8b_decode_near_its_weights_over_bandwidth():
    """One sequence, 128 tokens of context: 16.06 GB of bf16 weights at 3.35 TB/s is
    4.79 ms; the prediction is within [1x, 2x] of it."""
    model = ServingCostModel(MODELS["llama-3.1-8b"], H100)
    step = model.step_time([(1, 128)])
    closed = 16.06e9 / 3.35e12
    assert closed <= step.total_s <= 2 * closed, step
    assert step.floor_s <= closed        # the floor reads one embedding row, not the table


def test_llama_8b_prefill_near_its_flops_over_peak():
    """8192 prompt tokens: modeling's forward FLOPs (causal) over the 989 TFLOP/s bf16 peak,
    the prediction within [1x, 2x] of it."""
    spec = MODELS["llama-3.1-8b"]
    step = ServingCostModel(spec, H100).step_time([(8192, 8192)])
    closed = flops_per_token(spec, 8192).forward * 8192 / 989.4e12
    assert closed <= step.total_s <= 2 * closed, step


def test_decode_grows_with_context_and_batch_and_falls_with_tp():
    spec = MODELS["llama-3.1-70b"]
    model = ServingCostModel(spec, H100, tp=4)
    by_context = [model.step_time([(1, c)] * 16).total_s for c in (128, 2048, 32768)]
    by_batch = [model.step_time([(1, 2048)] * b).total_s for b in (1, 8, 64, 256)]
    assert by_context == sorted(by_context) and len(set(by_context)) == 3
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 4
    weights = [ServingCostModel(spec, H100, tp=tp).step_time([(1, 2048)] * 8).gemm_s
               for tp in (2, 4, 8)]
    assert weights[0] > weights[1] > weights[2]
    assert weights[0] / weights[1] == pytest.approx(2, rel=0.1)   # memory-bound: weights/tp


def test_gemms_are_priced_by_the_device_model():
    """Eager (no CUDA graph), Llama-3.1-8B: gemm_s is exactly Σ over 32 layers of
    DeviceSpec.matmul_time_s of the QKV, O, gate/up and down GEMMs, and lm_head_s
    includes the head's (S × h × V) GEMM."""
    spec, device = MODELS["llama-3.1-8b"], H100.device
    model = ServingCostModel(spec, H100, cudagraph_max_tokens=0,     # the device's t_k
                             eager_kernel_overhead_s=device.kernel_overhead_us * 1e-6)
    for rows in ([(1, 300)] * 7, [(512, 512), (1, 40)]):
        t = sum(n for n, _ in rows)
        step = model.step_time(rows)
        expected = 32 * sum(device.matmul_time_s(t, k, n, "bf16") for k, n in (
            (4096, 4096 + 2 * 1024), (4096, 4096), (4096, 2 * 14336), (14336, 4096)))
        assert step.gemm_s == pytest.approx(expected, rel=1e-12)
        assert step.lm_head_s > device.matmul_time_s(len(rows), 4096, 128256, "bf16")
        assert step.cuda_graph == "none"


def test_tensor_parallel_all_reduces_are_the_collective_model():
    """tp = 8: two all-reduces of T·h·2 bytes per layer over ranks 0..7 — under
    ``tp_allreduce="nccl"`` collective_time_s (NCCL's choice), by default vLLM's custom
    all-reduce (tp_allreduce_s); tp = 1: no communication."""
    spec = MODELS["llama-3.1-70b"]
    for t in (1, 64, 3000):
        rows = [(1, 1000)] * t if t < 3000 else [(3000, 3000)]
        nbytes = t * 8192 * 2
        nccl = collective_time_s("all_reduce", nbytes, tuple(range(8)), H100)
        step = ServingCostModel(spec, H100, tp=8, tp_allreduce="nccl").step_time(rows)
        assert step.comm_s == pytest.approx(2 * 80 * nccl, rel=1e-9)
        custom = ServingCostModel(spec, H100, tp=8).step_time(rows)
        assert custom.comm_s == pytest.approx(
            2 * 80 * tp_allreduce_s(H100.device.name, 8, nbytes, nccl), rel=1e-9)
        assert custom.comm_s <= step.comm_s
    assert ServingCostModel(MODELS["llama-3.1-8b"], H100).step_time([(1, 9)]).comm_s == 0
    # not on one node (tp 16 over two DGX nodes): NCCL
    wide = ServingCostModel(spec, H100, tp=16).step_time([(1, 1000)])
    assert wide.comm_s == pytest.approx(2 * 80 * collective_time_s(
        "all_reduce", 8192 * 2, tuple(range(16)), H100), rel=1e-9)
    with pytest.raises(ValueError, match="tp_allreduce"):
        ServingCostModel(spec, H100, tp=8, tp_allreduce="mpi")


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_affine_collective_fits_equal_the_collective_model(tp):
    """The cost model stores each algorithm's (α, β) and takes min(α + β·n); at every size
    that is collective_time_s (tp 16 spans two nodes)."""
    model = ServingCostModel(MODELS["llama-3.1-70b"], H100, tp=tp)
    fit = model._c["all_reduce"][0]
    for n in (2, 1000, 2**16, 3 * 10**6, 10**9):
        got = float((fit[:, 0] + fit[:, 1] * n).min())
        assert got == pytest.approx(collective_time_s("all_reduce", n, tuple(range(tp)),
                                                      H100), rel=1e-9)


def test_pipeline_stages_and_sends():
    """pp = 2 (tp 4): two stages of 40 layers, one boundary priced as vLLM's send of the
    hidden states and residual (2·T·h·2 bytes, a 1/tp slice per rank, then an all-gather
    on the next stage); the total is the stages, the send and the overhead."""
    spec = MODELS["llama-3.1-70b"]
    model = ServingCostModel(spec, H100, tp=4, pp=2)
    step = model.step_time([(1, 2048)] * 32)
    assert len(step.stage_s) == 2 and len(step.pp_send_s) == 1
    nbytes = 2 * 32 * 8192 * 2
    send = collective_time_s("send", nbytes / 4, (0, 4), H100) + collective_time_s(
        "all_gather", nbytes, (4, 5, 6, 7), H100)
    assert step.pp_send_s[0] == pytest.approx(send, rel=1e-9)
    assert step.total_s == pytest.approx(sum(step.stage_s) + send + step.overhead_s)
    assert step.stage_s[1] > step.stage_s[0]            # the last holds the head
    assert step.bottleneck_s == pytest.approx(step.stage_s[1] + step.overhead_s)
    # vLLM's uneven split: DeepSeek-V3's 61 layers over 4 stages
    ds = ServingCostModel(MODELS["deepseek-v3"], H100, tp=8, pp=4)
    assert len(ds.step_time([(1, 100)]).stage_s) == 4


def test_attention_computes_in_the_kv_caches_dtype():
    """FP8 weights leave attention in BF16 (vLLM's FlashAttention reads a BF16 cache): a
    long prefill's attention costs the same with BF16 and FP8 weights, while its GEMMs get
    faster; an FP8 cache (FlashAttention 3's FP8 path) computes attention at FP8's rate,
    1979 x min(e_max 0.709, 0.75) over BF16's 989 x 0.75 on an H100."""
    spec = MODELS["llama-3.1-8b"]
    rows = [(8192, 32768)]                      # a chunk at the end of a 32K prompt
    bf16, fp8w, fp8kv = (ServingCostModel(spec, H100, dtype=d, weight_bytes_per_param=w,
                                          kv_bytes_per_element=kv).step_time(rows)
                         for d, w, kv in (("bf16", 2, 2), ("fp8", 1, 2), ("fp8", 1, 1)))
    assert fp8w.attention_s == pytest.approx(bf16.attention_s, rel=1e-12)
    assert fp8w.gemm_s < bf16.gemm_s
    assert bf16.attention_s / fp8kv.attention_s == pytest.approx(
        1978.8 * 0.709 / (989.4 * 0.75), rel=0.02)


def test_parts_add_up():
    for name, tp in (("mixtral-8x7b", 2), ("deepseek-v3", 8), ("qwen3-30b-a3b", 4)):
        step = ServingCostModel(MODELS[name], H100, tp=tp).step_time(
            [(700, 900), (1, 5000), (1, 17)])
        assert step.total_s == pytest.approx(sum(step.stage_s) + sum(step.pp_send_s)
                                             + step.overhead_s, rel=1e-12)
        assert step.total_s == pytest.approx(step.parts_s, rel=1e-12)
        assert step.moe_s > 0 and step.tokens == 702 and step.samples == 3


@pytest.mark.parametrize("window", [None, 1, 3, 7, 50])
def test_attention_pairs_count_each_querys_keys(window):
    """K(c) − K(c − n) against a loop over the chunk's queries: query at position p sees
    min(p + 1, w) keys."""
    rows = [(1, 1), (1, 9), (5, 5), (5, 12), (40, 40), (40, 97), (3, 3)]
    n = np.array([r[0] for r in rows])
    c = np.array([r[1] for r in rows])
    brute = [sum(min(p + 1, window or p + 1) for p in range(ci - ni, ci)) for ni, ci in rows]
    assert attention_pairs(n, c, window).tolist() == brute
    step = step_floor(load_model("mistral-7b"), H100, new_tokens=n, contexts=c)
    assert step.flops > 0


def test_expected_experts_matches_sampling():
    """E·(1 − (1 − k/E)^T) against 4000 draws of T tokens each routed to k distinct of E
    experts at random."""
    rng = np.random.default_rng(0)
    for experts, top_k, tokens in ((128, 8, 4), (256, 8, 40), (8, 2, 3)):
        touched = [len(set(np.concatenate([rng.choice(experts, top_k, replace=False)
                                           for _ in range(tokens)])))
                   for _ in range(4000)]
        assert expected_experts(experts, top_k, tokens) == pytest.approx(np.mean(touched),
                                                                         rel=0.01)
    assert expected_experts(8, 2, 0) == 0 and expected_experts(8, 8, 5) == 8


def test_moe_decode_reads_only_the_experts_reached():
    """Qwen3-30B-A3B (128 experts, top 8): one token reads 8 experts per layer, 256 tokens
    nearly all 128 — the MoE part grows with the batch until every expert is read."""
    model = ServingCostModel(MODELS["qwen3-30b-a3b"], H100, graph_kernel_overhead_s=0.0,
                             eager_kernel_overhead_s=0.0)      # the experts' bytes alone
    moe = [model.step_time([(1, 512)] * b).moe_s for b in (1, 8, 64, 256)]
    assert moe == sorted(moe)
    assert moe[1] / moe[0] > 4 and moe[3] / moe[2] < 1.3


def test_cuda_graph_modes():
    spec = MODELS["llama-3.1-8b"]
    model = ServingCostModel(spec, H100)
    assert model.step_time([(1, 64)] * 512).cuda_graph == "full"
    assert model.step_time([(1, 64)] * 8 + [(100, 100)]).cuda_graph == "piecewise"
    assert model.step_time([(1, 64)] * 600).cuda_graph == "none"
    eager = ServingCostModel(spec, H100, cudagraph_max_tokens=0)
    graph = model.step_time([(1, 64)] * 4)
    plain = eager.step_time([(1, 64)] * 4)
    assert plain.cuda_graph == "none" and plain.total_s > graph.total_s
    assert graph.floor_s == plain.floor_s


def test_overhead_is_a_documented_overridable_constant():
    spec = MODELS["llama-3.1-8b"]
    base = ServingCostModel(spec, H100).step_time([(1, 64)] * 4)
    none = ServingCostModel(spec, H100, step_overhead_s=0.0).step_time([(1, 64)] * 4)
    per_seq = ServingCostModel(spec, H100, per_sequence_overhead_s=1e-5).step_time(
        [(1, 64)] * 4)
    assert base.overhead_s == STEP_OVERHEAD_S
    assert base.total_s - none.total_s == pytest.approx(STEP_OVERHEAD_S)
    assert per_seq.total_s - base.total_s == pytest.approx(4e-5)


def _engine_step(rows):
    scheduled = tuple(ScheduledRequest(i, n, c - n, (), samples=s, is_decode=n == 1 and c > 1)
                      for i, (n, c, s) in enumerate(rows))
    return EngineStep(0, scheduled)


def test_engine_step_and_rows_agree():
    model = ServingCostModel(MODELS["mixtral-8x7b"], H100, tp=2)
    rows = [(1, 300, True), (1, 4000, True), (256, 512, False), (30, 30, True)]
    assert model.step_time(_engine_step(rows)) == model.step_time(rows)
    assert model.step_time(rows).samples == 3
    assert model.step_time([r[:2] for r in rows]).samples == 4
    empty = model.step_time(EngineStep(0, ()))
    assert isinstance(empty, StepTime) and empty.total_s == 0 and empty.tokens == 0


def test_prices_the_steps_a_vllm_scheduler_forms():
    """Steps of VllmV1Scheduler (chunked prefills beside decodes, 16-token blocks): each
    priced above its floor, its tokens and samples those of the step."""
    model = ServingCostModel(MODELS["llama-3.1-8b"], H100)
    sched = VllmV1Scheduler(num_blocks=4000, max_num_batched_tokens=2048, max_num_seqs=32)
    for i in range(12):
        sched.add(Request(i, prompt_len=300 + 170 * i, output_len=20 + 3 * i))
    kinds = set()
    while sched.has_unfinished:
        step = sched.schedule()
        priced = model.step_time(step)
        assert priced.tokens == step.num_scheduled_tokens
        assert priced.samples == sum(1 for r in step.scheduled if r.samples)
        assert priced.parts_s >= priced.floor_s > 0
        kinds.add(priced.cuda_graph)
        sched.finish_step(step)
    assert kinds == {"full", "none"}       # 2048-token prefill steps, then decodes


def test_measured_kernel_prices_are_used_and_stay_above_the_floor():
    """Hardware that opts in to the measured H100 table: GEMMs at the profile's rate over
    tile-padded FLOPs, still never under the memory-bound time or the floor."""
    measured = load_hardware({"base": "h100-dgx", "device": {"kernel_table":
                                                             "h100_kernels.csv"}})
    spec = MODELS["llama-3.1-8b"]
    a = ServingCostModel(spec, measured).step_time([(8192, 8192)])
    b = ServingCostModel(spec, H100).step_time([(8192, 8192)])
    assert a.gemm_s != b.gemm_s
    for rows in ([(8192, 8192)], [(1, 2048)] * 64):
        step = ServingCostModel(spec, measured).step_time(rows)
        assert step.parts_s >= step.floor_s


def test_bad_input_names_the_argument():
    spec = MODELS["llama-3.1-8b"]
    with pytest.raises(ConfigError, match="tp=3"):
        ServingCostModel(spec, H100, tp=3)
    with pytest.raises(ValueError, match="step_overhead_s"):
        ServingCostModel(spec, H100, step_overhead_s=-1)
    with pytest.raises(ValueError, match="cudagraph_max_tokens"):
        ServingCostModel(spec, H100, cudagraph_max_tokens=-1)
    model = ServingCostModel(spec, H100)
    with pytest.raises(ValueError, match="context"):
        model.step_time([(5, 3)])
    with pytest.raises(ValueError, match="lengths"):
        model.step_time([(1, 3), (1, 2, True, 0)])
    with pytest.raises(TypeError, match="EngineStep"):
        model.step_time([1, 2])


@pytest.mark.parametrize("name, tp, pp", [("llama-3.1-8b", 1, 1), ("qwen3-30b-a3b", 2, 2)])
def test_a_price_does_not_depend_on_the_steps_priced_before(name, tp, pp):
    """price() keeps the context-free parts per (tokens, samples, prefill context):
    every step of a scheduler's run, priced by one model in order, twice, and after its
    memo filled up, equals the same step priced by a fresh model."""
    from vcluster.timing.serving import step_cost
    spec = MODELS[name]
    model = ServingCostModel(spec, H100, tp=tp, pp=pp)
    sched = VllmV1Scheduler(num_blocks=3000, max_num_batched_tokens=1024, max_num_seqs=16)
    for i in range(10):
        sched.add(Request(i, prompt_len=200 + 150 * i, output_len=12 + 5 * i))
    steps = []
    while sched.has_unfinished:
        steps.append(sched.schedule())
        sched.finish_step(steps[-1])
    keys = {(s.num_scheduled_tokens, s.num_samples) for s in steps}
    assert len(keys) < len(steps)             # keys repeat: the memo is used
    first = [model.step_time(s) for s in steps]
    assert [model.step_time(s) for s in reversed(steps)] == first[::-1]
    assert first == [ServingCostModel(spec, H100, tp=tp, pp=pp).step_time(s) for s in steps]
    assert 0 < len(model._memo) <= step_cost._MEMO_ENTRIES
    # 4 tokens, 3 samples, no earlier prefill context: a mixed step (piecewise graphs)
    # and a decode-only one (a full graph) price differently in any order
    mixed = [(1, 100, True), (1, 200, True), (2, 2, True)]
    decode = [(1, 100, True), (1, 200, True), (1, 300, False), (1, 400, True)]
    fresh = [ServingCostModel(spec, H100, tp=tp, pp=pp).step_time(r) for r in (mixed, decode)]
    assert [model.step_time(r) for r in (mixed, decode)] == fresh
    assert fresh[0].cuda_graph == "piecewise" and fresh[1].cuda_graph == "full"


def test_mxfp4_experts_are_read_at_their_bytes():
    """GPT-OSS-120B with MXFP4 experts (4.25 bits) against bf16 experts, a decode step of
    8 sequences: the floor's bytes differ by exactly the experts reached — E·(1 − (1 −
    k/E)^T) per layer, 36 layers of 3·h·f_e parameters each — times 11.75 bits, and the
    memory-bound MoE kernels' time by those bytes over the achieved bandwidth."""
    spec = load_model("gpt-oss-120b")
    moe = spec.layers[0].mlp
    mx = ServingCostModel(spec, H100, expert_weight_bytes_per_param=4.25 / 8)
    bf = ServingCostModel(spec, H100)
    rows = [(1, 1000 + 10 * i) for i in range(8)]
    shape = bf.floors.shape([1] * 8, [c for _, c in rows])
    reached = moe.experts * (1 - (1 - moe.top_k / moe.experts) ** 8)
    extra = spec.num_layers * reached * 3 * spec.hidden * moe.expert.width * (2 - 4.25 / 8)
    assert bf.floors.stage_work(shape)[0][0] - mx.floors.stage_work(shape)[0][0] == \
        pytest.approx(extra, rel=1e-9)
    assert bf.step_time(rows).moe_s - mx.step_time(rows).moe_s == pytest.approx(
        extra / H100.device.achieved_hbm_bytes_per_s(), rel=1e-9)
    assert mx.step_time(rows).gemm_s == bf.step_time(rows).gemm_s     # attention stays bf16


def test_step_time_is_fast():
    """≤ 100 µs per call for an 80-layer uniform model with 256 sequences (module
    docstring's figure); asserted at 1 ms so a loaded machine does not fail it."""
    model = ServingCostModel(MODELS["llama-3.1-70b"], H100, tp=8)
    rows = [(1, 2048 + i) for i in range(256)]
    step = _engine_step([(1, 2048 + i, True) for i in range(256)])
    for s in (rows, step):
        model.step_time(s)
        start = time.perf_counter()
        for _ in range(200):
            model.step_time(s)
        per_call = (time.perf_counter() - start) / 200
        assert per_call < 1e-3, per_call
    assert math.isfinite(model.step_time(step).total_s)


# The analytic model's figures before measured layer steps existed (h100-dgx; this file's
# ServingCostModel as it was): (total, gemm, attention, elementwise, moe, comm, lm_head)
# seconds of a decode step (64 rows at context 2048), a prefill (8192 tokens) and a mixed
# step (a 512-token chunk at context 1536 beside 16 decodes at 1000). A device without
# measured layer steps, or with rows of another layer, must price every one unchanged.
_BEFORE_MEASURED_STEPS = {
    ("llama-3.1-8b", 1, 1, "decode"): (
        0.01258603447827529, 0.004980330475621891, 0.0057732615641791045, 0.00044711638606965173,
        0.0, 0.0, 0.00038532605240464347),
    ("llama-3.1-8b", 1, 1, "prefill"): (
        0.1867258462906971, 0.14492751165437784, 0.023870442056551446, 0.016568897416915425,
        0.0, 0.0, 0.00035899516285240466),
    ("llama-3.1-8b", 1, 1, "mixed"): (
        0.014614271408413801, 0.009939781024598573, 0.0014815740163193734, 0.0018257101850746266,
        0.0, 0.0, 0.0003672061824212272),
    ("llama-3.1-70b", 4, 2, "decode"): (
        0.023628833704178138, 0.012191725320066335, 0.0037352442056384745, 0.0011201378388059702,
        0.0, 0.005322745717367852, 0.0002589806222995057),
    ("llama-3.1-70b", 4, 2, "prefill"): (
        0.5213340392169805, 0.3553818795371765, 0.030038052570689307, 0.042475643367164174,
        0.0, 0.0922346518230853, 0.0002038119188652208),
    ("llama-3.1-70b", 4, 2, "mixed"): (
        0.042341318389393395, 0.024402347704544577, 0.001817234518740842, 0.004618137170149254,
        0.0, 0.010284252168284793, 0.0002193468276739281),
    ("mixtral-8x7b", 2, 1, "decode"): (
        0.021511549857085685, 0.0005912514865671642, 0.002918630782089552, 0.00031495025140961853,
        0.015550982981405833, 0.0010632919956850052, 7.244235992851278e-05),
    ("mixtral-8x7b", 2, 1, "prefill"): (
        0.16588817344827878, 0.014193799197536333, 0.012015221028275723, 0.007683632180431178,
        0.11837426652763022, 0.012555775447680693, 6.547906672462928e-05),
    ("mixtral-8x7b", 2, 1, "mixed"): (
        0.02327845230635553, 0.0012142097139037089, 0.0009007870081596867, 0.001103339574129353,
        0.017271985714096185, 0.0017193589644012945, 6.87713316652981e-05),
    ("deepseek-v3", 8, 1, "decode"): (
        0.06361043963702584, 0.002777022413266998, 0.003190215105804312, 0.0007751120504145936,
        0.04832728676421192, 0.007360282373247032, 0.00018052093008098658),
    ("deepseek-v3", 8, 1, "prefill"): (
        0.2831840373107805, 0.05821841332986115, 0.028553768856438243, 0.022157342453067996,
        0.09868227543349918, 0.07445214377562027, 0.00012009346229370946),
    ("deepseek-v3", 8, 1, "mixed"): (
        0.08225955599696737, 0.006477823897787364, 0.0015381161614543013, 0.002864174415920398,
        0.059052148012214124, 0.011190329579288024, 0.00013696393030317665),
    ("qwen3-8b", 2, 1, "decode"): (
        0.008870425718784717, 0.0026527736358208957, 0.003283459629850746, 0.00045390278474295183,
        0.0, 0.001196203495145631, 0.00028408617322449244),
    ("qwen3-8b", 2, 1, "prefill"): (
        0.11380601635498729, 0.07251691084725051, 0.013517123656810189, 0.012417556447097845,
        0.0, 0.014125247378640779, 0.00022917802518797597),
    ("qwen3-8b", 2, 1, "mixed"): (
        0.011191544223909403, 0.005347535269451694, 0.0010133853841796476, 0.001651697974129353,
        0.0, 0.0019342788349514563, 0.00024464676119725),
}
_GOLDEN_STEPS = {"decode": [(1, 2048)] * 64, "prefill": [(8192, 8192)],
                 "mixed": [(512, 1536)] + [(1, 1000)] * 16}


@pytest.mark.parametrize("key", sorted(_BEFORE_MEASURED_STEPS))
def test_figures_unchanged_without_measured_layer_steps(key):
    name, tp, pp, kind = key
    other = load_hardware({"base": "h100-dgx", "device": {"kernels": [
        {"kind": kind_, "seconds": 1e-4 * (i + 1), "dtype": "bf16", "dims": dims,
         "layer": "hidden=512 heads=8 kv_heads=8 head_dim=64 mlp=swiglu ffn=1024 tp=1"}
        for i, (kind_, dims) in enumerate(
            [("decode_layer", f"{b}x{c}") for b in (1, 8) for c in (64, 512)]
            + [("prefill_layer", str(t)) for t in (16, 64, 256)])]}})
    for hardware in (H100, other):
        model = ServingCostModel(MODELS.get(name) or load_model(name), hardware, tp=tp, pp=pp,
                                 tp_allreduce="nccl", step_overhead_s=1e-3,
                                 graph_kernel_overhead_s=2e-6, eager_kernel_overhead_s=5e-6)
        step = model.step_time(_GOLDEN_STEPS[kind])
        got = (step.total_s, step.gemm_s, step.attention_s, step.elementwise_s, step.moe_s,
               step.comm_s, step.lm_head_s)
        assert got == pytest.approx(_BEFORE_MEASURED_STEPS[key], rel=1e-12, abs=1e-15)
        assert step.layers_s == 0 and model.measured_layers == ()
        assert step.parts_s == pytest.approx(step.total_s, rel=1e-12)
