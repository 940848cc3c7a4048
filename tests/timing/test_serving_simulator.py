"""The SimPy serving simulator against closed forms worked by hand with small pricers."""

from dataclasses import dataclass

import numpy as np
import pytest

from modeling.errors import ConfigError
from serving import Request
from vcluster.timing.serving.simulator import (ReplicaPool, simulate_disaggregated,
                                               simulate_serving)
from vcluster.timing.serving.workload import Workload

BIG = 10_000  # KV blocks: never short


@dataclass(frozen=True)
class Priced:
    total_s: float
    floor_s: float


@dataclass(frozen=True)
class LinearPricer:
    """step = a + b·(tokens computed) + c·Σ context (keys read); floor = a."""

    a: float
    b: float = 0.0
    c: float = 0.0

    def step_time(self, step):
        return Priced(self.a + self.b * step.num_scheduled_tokens
                      + self.c * sum(s.context for s in step.scheduled), self.a)


@dataclass(frozen=True)
class FixedTransfer:
    seconds: float

    def time_s(self, prompt_len, src, dst):
        return self.seconds


def times(result):
    return {r.request_id: r.token_times_s for r in result.requests}


# --- one replica, closed forms ---------------------------------------------------------------

def test_single_request_token_times_closed_form():
    a, b, c, p, n = 1e-3, 1e-5, 1e-7, 100, 5
    res = simulate_serving([Request(0, p, n, arrival_s=0.25)], pricer=LinearPricer(a, b, c),
                           num_blocks=BIG)
    expected = [0.25 + a + (b + c) * p]                    # prefill: p tokens, context p
    for k in range(1, n):                                   # decode of token k: context p + k
        expected.append(expected[-1] + a + b + c * (p + k))
    assert res.requests[0].token_times_s == pytest.approx(expected, rel=1e-12)
    m = res.metrics
    assert m.ttft.mean_ms == pytest.approx(1e3 * (a + (b + c) * p), rel=1e-9)
    assert m.tpot.mean_ms == pytest.approx(1e3 * (expected[-1] - expected[0]) / (n - 1), rel=1e-9)
    assert m.duration_s == pytest.approx(expected[-1], rel=1e-12)


def test_chunked_prefill_ttft_is_its_chunks():
    a, b, c = 1e-3, 1e-5, 1e-7
    res = simulate_serving([Request(0, 300, 2)], pricer=LinearPricer(a, b, c), num_blocks=BIG,
                           max_num_batched_tokens=128)
    # chunks 128, 128, 44 with contexts 128, 256, 300
    assert res.requests[0].ttft_s == pytest.approx(3 * a + b * 300 + c * (128 + 256 + 300))
    assert [s.prefill_tokens for s in res.steps] == [128, 128, 44, 0]


def test_constant_step_ttft_and_tpot():
    d = 0.02
    res = simulate_serving([Request(0, 64, 10)], pricer=LinearPricer(d), num_blocks=BIG)
    assert res.metrics.ttft.mean_ms == pytest.approx(1e3 * d)
    assert res.metrics.tpot.mean_ms == pytest.approx(1e3 * d)
    assert res.metrics.itl.percentile(99) == pytest.approx(1e3 * d)
    assert res.metrics.e2el.mean_ms == pytest.approx(1e3 * 10 * d)


def test_requests_far_apart_see_no_queueing():
    d = 0.01
    reqs = [Request(i, 32, 8, arrival_s=5.0 * i) for i in range(4)]
    res = simulate_serving(reqs, pricer=LinearPricer(d), num_blocks=BIG)
    for r in res.requests:
        assert r.ttft_s == pytest.approx(d) and r.e2el_s == pytest.approx(8 * d)
        assert r.arrival_s == 5.0 * r.request_id
    assert res.metrics.max_concurrent_requests == 1


# --- batching worked by hand ---------------------------------------------------------------------

OUTS = (3, 1, 2, 2, 4)   # five requests of 10 prompt tokens at t = 0, one-second steps


def test_static_batches_as_hand_worked():
    reqs = [Request(i, 10, n) for i, n in enumerate(OUTS)]
    res = simulate_serving(reqs, pricer=LinearPricer(1.0), num_blocks=BIG, engine="static",
                           max_num_seqs=2)
    # batches {0,1} at [0,3), {2,3} at [3,5), {4} at [5,9); nobody joins a batch mid-way
    assert times(res) == {0: (1, 2, 3), 1: (1,), 2: (4, 5), 3: (4, 5), 4: (6, 7, 8, 9)}
    assert [(s.prefill_tokens, s.decode_seqs) for s in res.steps] == [
        (20, 0), (0, 1), (0, 1), (20, 0), (0, 2), (10, 0), (0, 1), (0, 1), (0, 1)]


def test_vllm_v1_continuous_batching_as_hand_worked():
    reqs = [Request(i, 10, n) for i, n in enumerate(OUTS)]
    res = simulate_serving(reqs, pricer=LinearPricer(1.0), num_blocks=BIG, max_num_seqs=2)
    # request 2 joins as soon as request 1 leaves (step 2), not after request 0's batch
    assert times(res) == {0: (1, 2, 3), 1: (1,), 2: (2, 3), 3: (4, 5), 4: (4, 5, 6, 7)}
    assert [(s.prefill_tokens, s.decode_seqs) for s in res.steps] == [
        (20, 0), (10, 1), (0, 2), (20, 0), (0, 2), (0, 1), (0, 1)]


# --- routers --------------------------------------------------------------------------------------

ROUTED = [Request(0, 10, 10), Request(1, 10, 1), Request(2, 10, 1, arrival_s=2.5),
          Request(3, 10, 1, arrival_s=4.5)]


def test_round_robin_vs_least_loaded():
    rr = simulate_serving(ROUTED, pricer=LinearPricer(1.0), num_blocks=BIG, replicas=2)
    ll = simulate_serving(ROUTED, pricer=LinearPricer(1.0), num_blocks=BIG, replicas=2,
                          router="least_loaded")
    assert [r.replica for r in rr.requests] == [0, 1, 0, 1]
    # at 2.5 replica 0 still serves request 0 and replica 1 is idle; at 4.5 again
    assert [r.replica for r in ll.requests] == [0, 1, 1, 1]
    # round robin puts request 2 behind replica 0's step [2, 3): TTFT 1.5 instead of 1
    assert [r.ttft_s for r in rr.requests] == pytest.approx([1, 1, 1.5, 1])
    assert [r.ttft_s for r in ll.requests] == pytest.approx([1, 1, 1, 1])
    assert rr.settings.router == "round_robin" and ll.settings.router == "least_loaded"


def test_least_loaded_ties_go_to_the_lowest_index():
    reqs = [Request(i, 10, 5) for i in range(5)]
    res = simulate_serving(reqs, pricer=LinearPricer(1.0), num_blocks=BIG, replicas=3,
                           router="least_loaded")
    assert [r.replica for r in res.requests] == [0, 1, 2, 0, 1]


def test_same_instant_order_finishes_then_arrivals_then_steps():
    """A request arriving exactly when a step ends: the router sees that step's finishes,
    and the arrival joins the very next step."""
    reqs = [Request(0, 10, 10), Request(1, 10, 2), Request(2, 10, 3, arrival_s=2.0)]
    res = simulate_serving(reqs, pricer=LinearPricer(1.0), num_blocks=BIG, replicas=2,
                           router="least_loaded")
    # request 1 finishes on replica 1 at t = 2, so request 2 finds it empty
    assert [r.replica for r in res.requests] == [0, 1, 1]
    assert res.requests[2].token_times_s == (3.0, 4.0, 5.0)
    one = simulate_serving(reqs, pricer=LinearPricer(1.0), num_blocks=BIG)
    assert one.requests[2].token_times_s == (3.0, 4.0, 5.0)   # joins step [2, 3)


# --- closed loop ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [float("inf"), 40.0])
def test_closed_loop_keeps_c_outstanding(rate):
    c = 4
    w = Workload(30, 20, 6, rate=rate, concurrency=c, range_ratio=0.5, seed=2)
    res = simulate_serving(w, pricer=LinearPricer(0.01, 1e-4), num_blocks=BIG, replicas=2)
    sends = np.sort([r.arrival_s for r in res.requests])
    finishes = np.sort([r.finish_s for r in res.requests])
    planned = {r.request_id: r.arrival_s for r in w.requests()}
    assert all(r.arrival_s >= planned[r.request_id] for r in res.requests)
    assert res.metrics.max_concurrent_requests == c
    if rate == float("inf"):
        # C at t = 0, then the k-th send exactly when the (k − C)-th response completes
        assert np.all(sends[:c] == 0) and np.array_equal(sends[c:], finishes[:-c])
    # never more than C in flight at any send (half-open [send, finish))
    for t in sends:
        assert np.sum((sends <= t) & (finishes > t)) <= c


# --- conservation --------------------------------------------------------------------------------

@pytest.mark.parametrize("engine,replicas,router,blocks", [
    ("vllm-v1", 1, "round_robin", 24), ("vllm-v1", 2, "least_loaded", 24),
    ("vllm-v1", 3, "round_robin", BIG), ("static", 2, "least_loaded", 40)])
def test_conservation(engine, replicas, router, blocks):
    w = Workload(60, 64, 40, rate=80.0, burstiness=0.5, range_ratio=0.5, seed=5)
    settings = {"max_num_batched_tokens": 96} if engine == "vllm-v1" else {"max_num_seqs": 8}
    res = simulate_serving(w, pricer=LinearPricer(2e-3, 2e-5, 1e-7), num_blocks=blocks,
                           engine=engine, replicas=replicas, router=router, **settings)
    asked = {r.request_id: r for r in w.requests()}
    assert len(res.requests) == 60 == res.metrics.completed
    for rec in res.requests:
        assert rec.output_len == asked[rec.request_id].output_len
        assert all(b > a for a, b in zip(rec.token_times_s, rec.token_times_s[1:]))
        assert rec.first_token_s > rec.arrival_s == asked[rec.request_id].arrival_s
    steps = res.steps
    for i in range(replicas):                  # one step at a time per replica
        mine = [s for s in steps if s.replica == i]
        assert all(s2.start_s >= s1.end_s for s1, s2 in zip(mine, mine[1:]))
    assert all(0 < s.kv_usage <= 1 for s in steps)
    prompt = sum(r.prompt_len for r in asked.values())
    decodes = sum(r.output_len - 1 for r in asked.values())
    if res.preemptions == 0:                   # every token computed once
        assert sum(s.prefill_tokens for s in steps) == prompt
        assert sum(s.decode_seqs for s in steps) == decodes
    else:                                      # recomputation re-prefills
        assert sum(s.prefill_tokens + s.decode_seqs for s in steps) > prompt + decodes
    assert res.peak_kv_usage == max(s.kv_usage for s in steps)
    if blocks == 24:
        assert res.preemptions > 0


def test_floors_summary_and_settings():
    w = Workload(20, 32, 8, rate=30.0, seed=1)
    res = simulate_serving(w, pricer=LinearPricer(0.004, 1e-5), num_blocks=BIG, replicas=2,
                           gpus_per_replica=4, block_size=32)
    f = res.floors
    assert f.steps == len(res.steps) and f.floor_s == pytest.approx(0.004 * f.steps)
    assert f.busy_s == pytest.approx(sum(s.duration_s for s in res.steps))
    assert f.per_token_decode_floor_s == pytest.approx(0.004)
    assert f.per_token_decode_s >= f.per_token_decode_floor_s
    pool, = res.settings.pools
    assert (pool.engine, pool.replicas, pool.gpus_per_replica, pool.num_blocks) == (
        "vllm-v1", 2, 4, BIG)
    assert dict(pool.engine_settings) == {"block_size": 32}
    assert res.metrics.num_gpus == 8 == res.settings.num_gpus
    assert res.metrics.output_throughput_per_gpu == pytest.approx(
        res.metrics.output_throughput / 8)
    frame = res.steps_frame()
    assert len(frame) == len(res.steps) and {"start_s", "kv_usage", "replica"} <= set(frame)
    assert list(res.requests_frame()["ttft_s"]) == pytest.approx(
        [r.ttft_s for r in res.requests])


def test_runs_are_deterministic_and_independent():
    w = Workload(40, 48, 16, rate=25.0, range_ratio=0.4, seed=11)
    kw = dict(pricer=LinearPricer(3e-3, 1e-5), num_blocks=60, replicas=2)
    first = simulate_serving(w, **kw)
    simulate_serving(Workload(10, 8, 4, seed=1), pricer=LinearPricer(1.0), num_blocks=BIG,
                     replicas=2)
    again = simulate_serving(w, **kw)
    assert first.requests == again.requests and first.steps == again.steps
    assert simulate_serving(w, seed=12, **kw).requests != first.requests


def test_bad_inputs_are_named():
    req = [Request(0, 8, 2)]
    with pytest.raises(ConfigError, match="router"):
        simulate_serving(req, pricer=LinearPricer(1.0), num_blocks=BIG, router="random")
    with pytest.raises(ConfigError, match="engine settings"):
        simulate_serving(req, pricer=LinearPricer(1.0), num_blocks=BIG, max_num_seq=4)
    with pytest.raises(ConfigError, match="engine="):
        simulate_serving(req, pricer=LinearPricer(1.0), num_blocks=BIG, engine="sglang")
    with pytest.raises(ValueError, match="total_s=0"):
        simulate_serving(req, pricer=LinearPricer(0.0), num_blocks=BIG)
    with pytest.raises(TypeError, match="step_time"):
        simulate_serving(req, pricer=object(), num_blocks=BIG)
    with pytest.raises(ConfigError, match="request_id"):
        simulate_serving(req * 2, pricer=LinearPricer(1.0), num_blocks=BIG)
    with pytest.raises(ConfigError, match="concurrency"):
        simulate_serving(req, pricer=LinearPricer(1.0), num_blocks=BIG, concurrency=0)
    with pytest.raises(ConfigError, match="can never fit"):
        simulate_serving([Request(0, 100, 2)], pricer=LinearPricer(1.0), num_blocks=4)


# --- disaggregated prefill/decode ------------------------------------------------------------------

def pools(dp=0.5, dd=0.1, prefill_replicas=1, decode_replicas=1):
    return dict(prefill=ReplicaPool(LinearPricer(dp), BIG, replicas=prefill_replicas),
                decode=ReplicaPool(LinearPricer(dd), BIG, replicas=decode_replicas))


def test_disaggregated_single_request_closed_form():
    res = simulate_disaggregated([Request(0, 100, 4, arrival_s=1.0)], **pools(),
                                 kv_transfer=FixedTransfer(0.2))
    # prefill [1.0, 1.5) emits token 1; KV moves [1.5, 1.7); decode steps of 0.1 emit 2, 3, 4
    assert res.requests[0].token_times_s == pytest.approx((1.5, 1.8, 1.9, 2.0))
    assert res.metrics.ttft.mean_ms == pytest.approx(500)
    assert res.metrics.e2el.mean_ms == pytest.approx(1000)
    t, = res.transfers
    assert (t.src, t.dst, t.ready_s, t.start_s, t.end_s, t.prompt_len) == pytest.approx(
        (0, 0, 1.5, 1.5, 1.7, 100))
    assert [s.pool for s in res.steps] == ["prefill", "decode", "decode", "decode"]
    assert res.settings.num_gpus == 2


def test_disaggregated_transfers_queue_on_their_links():
    reqs = [Request(0, 50, 3), Request(1, 50, 3), Request(2, 50, 1)]
    res = simulate_disaggregated(reqs, **pools(decode_replicas=2),
                                 kv_transfer=FixedTransfer(0.2))
    # one prefill step [0, .5) for all three; request 2 (one token) ends there, no transfer;
    # the two transfers leave prefill replica 0 one after the other
    assert [(t.request_id, t.dst) for t in res.transfers] == [(0, 0), (1, 1)]
    assert [x for t in res.transfers for x in (t.start_s, t.end_s)] == pytest.approx(
        [0.5, 0.7, 0.7, 0.9])
    got = times(res)
    for rid, want in {0: (0.5, 0.8, 0.9), 1: (0.5, 1.0, 1.1), 2: (0.5,)}.items():
        assert got[rid] == pytest.approx(want)
    assert [r.output_len for r in res.requests] == [3, 3, 1]


def test_disaggregated_conservation_with_network_transfer():
    from vcluster.timing.presets import preset
    from modeling.presets import load_model
    from vcluster.timing.serving.kv_transfer import NetworkKVTransfer
    kv = NetworkKVTransfer(load_model("llama-3.1-8b"), preset("h100-dgx"), prefill_replicas=2)
    w = Workload(50, 200, 12, rate=40.0, range_ratio=0.5, seed=4, concurrency=10)
    res = simulate_disaggregated(w, prefill=ReplicaPool(LinearPricer(0.01, 2e-5), BIG, 2),
                                 decode=ReplicaPool(LinearPricer(5e-3, 0, 1e-7), 80, 3),
                                 kv_transfer=kv, router="least_loaded")
    asked = {r.request_id: r for r in w.requests()}
    assert res.metrics.completed == 50 and res.metrics.max_concurrent_requests <= 10
    for rec in res.requests:
        assert rec.output_len == asked[rec.request_id].output_len
        assert all(b > a for a, b in zip(rec.token_times_s, rec.token_times_s[1:]))
    for t in res.transfers:
        assert t.end_s - t.start_s == pytest.approx(kv.time_s(t.prompt_len, t.src, t.dst))
        assert t.start_s >= t.ready_s


def test_network_kv_transfer_closed_form():
    from vcluster.timing.presets import preset
    from modeling.presets import load_model
    from vcluster.timing.serving.kv_transfer import NetworkKVTransfer
    spec, hw = load_model("llama-3.1-8b"), preset("h100-dgx")
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 128 KiB per token
    per_token = 32 * 8 * 128 * 2 * 2
    nccl_base_s, nic_latency_s, nic_bps = 8.4e-6, 9.6e-6, 50e9 * 0.92   # NDR 400 Gb/s
    one = NetworkKVTransfer(spec, hw)
    assert one.decode_base_rank == 8 and one.ranks(0, 0) == (0, 8)   # decode on the next node
    assert one.nbytes(512) == 512 * per_token
    assert one.time_s(512, 0, 0) == pytest.approx(
        nccl_base_s + nic_latency_s + 512 * per_token / nic_bps, rel=1e-9)
    four = NetworkKVTransfer(spec, hw, prefill_replicas=3, prefill_gpus=4, decode_gpus=2)
    assert four.decode_base_rank == 16 and four.ranks(2, 1) == (8, 18)
    assert four.time_s(512, 2, 1) == pytest.approx(                  # two sends of half each
        nccl_base_s + nic_latency_s + 256 * per_token / nic_bps, rel=1e-9)
    with pytest.raises(ConfigError, match="prefill_gpus"):
        NetworkKVTransfer(spec, hw, prefill_gpus=0)


# --- with the real step pricer ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama8b_h100():
    from modeling.presets import load_model
    from vcluster.timing.presets import preset
    from vcluster.timing.serving.step_cost import ServingCostModel
    spec, hw = load_model("llama-3.1-8b"), preset("h100-dgx")
    return spec, hw, ServingCostModel(spec, hw)


def test_real_pricer_matches_a_plain_engine_loop(llama8b_h100):
    """All requests at t = 0 on one replica: the simulation must equal the loop
    t += price(schedule()) with the same scheduler, token for token."""
    from serving import VllmV1Scheduler
    _, _, pricer = llama8b_h100
    w = Workload(24, 700, 20, range_ratio=0.5, seed=3)
    settings = dict(max_num_batched_tokens=2048, max_num_seqs=16)
    res = simulate_serving(w, pricer=pricer, num_blocks=400, **settings)
    sched = VllmV1Scheduler(400, **settings)
    for r in w.requests():
        sched.add(r)
    t, expected, floors = 0.0, {r.request_id: [] for r in w.requests()}, []
    while sched.has_unfinished:
        step = sched.schedule()
        priced = pricer.step_time(step)
        t += priced.total_s
        floors.append(priced.floor_s)
        for rid in sched.finish_step(step).emitted:
            expected[rid].append(t)
    assert len(res.steps) == len(floors)
    for rec in res.requests:
        assert rec.token_times_s == pytest.approx(expected[rec.request_id], rel=1e-12)
    assert res.floors.floor_s == pytest.approx(sum(floors), rel=1e-12)
    assert all(s.duration_s >= s.floor_s > 0 for s in res.steps)   # never below the physics
    assert res.floors.per_token_decode_s >= res.floors.per_token_decode_floor_s


def test_real_pricer_single_request_ttft_and_tpot(llama8b_h100):
    from serving import VllmV1Scheduler
    _, _, pricer = llama8b_h100
    res = simulate_serving([Request(0, 512, 9)], pricer=pricer, num_blocks=1000)
    sched = VllmV1Scheduler(1000)
    sched.add(Request(0, 512, 9))
    prices = []
    while sched.has_unfinished:
        step = sched.schedule()
        prices.append(pricer.step_time(step).total_s)
        sched.finish_step(step)
    assert res.metrics.ttft.mean_ms == pytest.approx(1e3 * prices[0], rel=1e-12)
    assert res.metrics.tpot.mean_ms == pytest.approx(1e3 * sum(prices[1:]) / 8, rel=1e-12)
    # a decode step of Llama-3.1-8B reads its 16 GB of weights: above 16e9 / 3.35e12 s
    assert res.metrics.tpot.mean_ms > 1e3 * 16.06e9 / 3.35e12


def test_real_pricer_disaggregated(llama8b_h100):
    from vcluster.timing.serving.kv_transfer import NetworkKVTransfer
    spec, hw, pricer = llama8b_h100
    kv = NetworkKVTransfer(spec, hw)
    res = simulate_disaggregated([Request(0, 512, 4)], prefill=ReplicaPool(pricer, 1000),
                                 decode=ReplicaPool(pricer, 1000), kv_transfer=kv)
    prefill_s = res.steps[0].duration_s
    assert res.requests[0].ttft_s == pytest.approx(prefill_s)
    t, = res.transfers
    assert t.end_s - t.start_s == pytest.approx(kv.time_s(512, 0, 0))
    decode_s = sum(s.duration_s for s in res.steps if s.pool == "decode")
    assert res.requests[0].e2el_s == pytest.approx(prefill_s + kv.time_s(512, 0, 0) + decode_s)


# --- pipeline parallelism: vLLM v1's batch queue ---------------------------------------------

@dataclass(frozen=True)
class StagedPriced:
    total_s: float
    floor_s: float
    stage_s: tuple
    pp_send_s: tuple
    overhead_s: float


@dataclass(frozen=True)
class StagedPricer:
    """``pp`` equal stages of ``stage_s`` each, no sends, no overhead: a step alone takes
    pp · stage_s."""

    pp: int
    stage: float

    def step_time(self, step):
        return StagedPriced(self.pp * self.stage, 0.0, (self.stage,) * self.pp,
                            (0.0,) * (self.pp - 1), 0.0)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipelined_steps_overlap_their_stages(pp):
    """pp equal stages of 1 ms: a lone request waits a whole pass (pp ms) per token; with
    requests arriving apart (vLLM v1 puts the running decodes of one step all in the next
    step, so only requests that joined at different steps fill different batches), pp
    steps are in flight and a step leaves the pipeline every 1 ms — pp times the
    throughput of one step at a time."""
    lone = simulate_serving([Request(0, 4, 6)], pricer=StagedPricer(pp, 1e-3), num_blocks=BIG)
    gaps = np.diff(lone.requests[0].token_times_s)
    assert gaps == pytest.approx(pp * 1e-3, rel=1e-9)
    many = [Request(i, 1, 200, arrival_s=i * 0.3e-3) for i in range(4 * pp)]
    res = simulate_serving(many, pricer=StagedPricer(pp, 1e-3), num_blocks=BIG)
    ends = np.sort([s.end_s for s in res.steps])
    steady = np.diff(ends[len(ends) // 4: 3 * len(ends) // 4])
    assert steady == pytest.approx(1e-3, rel=1e-6)       # one step out per stage time
    for rec in res.requests:                             # every token a full pass later
        assert np.diff(rec.token_times_s) == pytest.approx(pp * 1e-3, rel=1e-6)
    assert max(len({s.index for s in res.steps if s.start_s <= t < s.end_s})
               for t in ends[len(ends) // 2: len(ends) // 2 + 10] - 1e-4) == pp   # in flight


def test_pipelined_real_pricer_conserves_and_beats_one_step_at_a_time():
    from modeling.presets import load_model
    from vcluster.timing.presets import preset
    from vcluster.timing.serving.step_cost import ServingCostModel
    spec, hw = load_model("llama-3.1-8b"), preset("h100-dgx")
    pricer = ServingCostModel(spec, hw, pp=2)
    w = Workload(120, 300, 40, rate=200.0, range_ratio=0.5, seed=5)
    res = simulate_serving(w, pricer=pricer, num_blocks=600, max_num_seqs=32)
    assert sorted(r.output_len for r in res.requests) == sorted(
        r.output_len for r in w.requests())
    for rec in res.requests:
        assert len(rec.token_times_s) == rec.output_len
        assert np.all(np.diff(rec.token_times_s) > 0) and rec.ttft_s > 0
    static = simulate_serving(w, pricer=pricer, num_blocks=600, max_num_seqs=32,
                              engine="static")
    assert res.metrics.duration_s < static.metrics.duration_s
