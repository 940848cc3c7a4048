"""The engine schedulers of :mod:`serving`: the hand-worked vLLM v1 example of
docs/serving.md step by step, invariants over random workloads, static batching, and bad
settings."""

from __future__ import annotations

import numpy as np
import pytest

from modeling.errors import ConfigError
from serving import (BlockPool, EngineStep, Request, StaticScheduler, VllmV1Scheduler,
                     blocks_for, make_scheduler)


def run(scheduler, arrivals=None, limit=10_000):
    """Drive ``scheduler`` to the end; ``arrivals`` maps a step index to requests added
    before it. Returns [(step, outcome)]."""
    arrivals = dict(arrivals or {})
    steps = []
    while scheduler.has_unfinished or arrivals:
        for r in arrivals.pop(len(steps), ()):
            scheduler.add(r)
        step = scheduler.schedule()
        steps.append((step, scheduler.finish_step(step)))
        assert len(steps) < limit
    return steps


def rows(step: EngineStep):
    return [(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.block_table)
            for s in step.scheduled]


def test_the_hand_worked_vllm_v1_example_of_the_docs():
    """docs/serving.md, "A vLLM v1 schedule by hand": 6 blocks of 4 (block 0 the null
    block: 20 token slots), 8 tokens per step, 3 sequences; A = (prompt 9, 4 out),
    B = (4, 3), C = (2, 5) all queued before step 0."""
    s = VllmV1Scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
    for i, (p, o) in enumerate([(9, 4), (4, 3), (2, 5)]):
        s.add(Request(i, p, o))
    steps = run(s)
    A, B, C = 0, 1, 2
    expected = [
        # step 0: A's first chunk takes the whole budget (8 of its 9 prompt tokens)
        ([(A, 0, 8, (1, 2))], (), (), ()),
        # step 1: A's last prompt token, then B's and C's whole prompts (1 + 4 + 2 <= 8):
        # all three emit their first token; the pool is now empty
        ([(A, 8, 1, (1, 2, 3)), (B, 0, 4, (4,)), (C, 0, 2, (5,))], (), (A, B, C), ()),
        # step 2: A decodes in its 3 blocks; B's 5th token needs a 2nd block: none free,
        # so the last running request (C) is preempted, its block 5 goes to B
        ([(A, 9, 1, (1, 2, 3)), (B, 4, 1, (4, 5))], (C,), (A, B), ()),
        # step 3: nothing was preempted, but C's block does not fit: B finishes
        ([(A, 10, 1, (1, 2, 3)), (B, 5, 1, (4, 5))], (), (A, B), (B,)),
        # step 4: A's last token; C is recomputed over its prompt and its one emitted
        # token (3 tokens) in B's freed block 5 (the free queue's head: B freed 5 then 4)
        ([(A, 11, 1, (1, 2, 3)), (C, 0, 3, (5,))], (), (A, C), (A,)),
        ([(C, 3, 1, (5,))], (), (C,), ()),
        ([(C, 4, 1, (5, 4))], (), (C,), ()),
        ([(C, 5, 1, (5, 4))], (), (C,), (C,)),
    ]
    assert len(steps) == len(expected)
    for (step, out), (sched, preempted, emitted, finished) in zip(steps, expected):
        assert rows(step) == sched, step.index
        assert step.preempted == preempted
        assert out.emitted == emitted and out.finished == finished
    assert s.num_preemptions == 1
    assert [st.prefill_tokens for st, _ in steps] == [8, 7, 0, 0, 3, 0, 0, 0]
    assert [st.decode_seqs for st, _ in steps] == [0, 0, 2, 2, 1, 1, 1, 1]
    assert s.pool.num_free == s.pool.num_usable


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("engine", ["vllm-v1", "static"])
def test_invariants_over_random_workloads(seed, engine):
    """Every request emits exactly output_len tokens, a step never exceeds the token
    budget or the sequence cap, a table always holds its context, and every block is
    free at the end."""
    rng = np.random.default_rng(seed)
    budget, seqs, bs = int(rng.integers(8, 64)), int(rng.integers(1, 6)), 4
    s = make_scheduler(engine, int(rng.integers(12, 40)), block_size=bs,
                       max_num_batched_tokens=budget, max_num_seqs=seqs)
    n = 25
    reqs = [Request(i, int(rng.integers(1, 30)), int(rng.integers(1, 20))) for i in range(n)]
    reqs = [r for r in reqs if blocks_for(r.max_tokens, bs) <= s.pool.num_usable]
    arrivals: dict = {}
    for r in reqs:
        arrivals.setdefault(int(rng.integers(0, 40)), []).append(r)
    emitted = {r.request_id: 0 for r in reqs}
    for step, out in run(s, arrivals):
        if engine == "vllm-v1":
            assert step.num_scheduled_tokens <= budget
        assert len(step.scheduled) <= seqs
        for x in step.scheduled:
            assert len(x.block_table) * bs >= x.context
        held = [b for x in step.scheduled for b in x.block_table]
        assert len(held) == len(set(held)) and 0 not in held   # no block held twice
        for i in out.emitted:
            emitted[i] += 1
    assert emitted == {r.request_id: r.output_len for r in reqs}
    assert s.pool.num_free == s.pool.num_usable and not s.has_unfinished


def test_preempted_requests_are_recomputed_over_prompt_and_outputs():
    """A cache of 4 usable blocks of 4: two requests that each grow to 12 tokens cannot
    both stay; the later one is preempted, re-prefilled over prompt + emitted tokens, and
    still emits exactly output_len tokens."""
    s = VllmV1Scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16,
                        enable_prefix_caching=False)
    s.add(Request(0, 4, 8))
    s.add(Request(1, 4, 8))
    recomputed = []
    steps = run(s)
    for step, _ in steps:
        recomputed += [x for x in step.scheduled
                       if x.request_id == 1 and x.num_computed_tokens == 0 and step.index > 0]
    assert s.num_preemptions >= 1
    assert recomputed and recomputed[0].num_new_tokens > 4     # prompt + emitted tokens
    assert sum(1 for _, out in steps for i in out.emitted if i == 1) == 8


def test_a_preempted_request_takes_back_its_cached_blocks_worked_by_hand():
    """Prefix caching (vLLM v1's default), the same two requests as above, by hand: 4
    usable blocks of 4. Steps 0-4 give A = 0 blocks [1 3], B = 1 blocks [2 4], each 8
    tokens computed (both blocks full, so registered) and 5 emitted. Step 5: A's 9th token
    needs a block, none is free: B is preempted, its table freed last block first (free
    queue [4 2]); A takes block 4, evicting B's second block. B (9 known tokens) looks up
    at most ⌊8/4⌋ = 2 blocks: block 2 still holds its first, so B needs 2 new + 1 taken
    back = 3 free blocks — it waits until A finishes at step 7 and frees [1 3 4] (queue
    [2 4 3 1]). Step 8: B takes back block 2 (4 tokens counted computed), takes 4 and 3,
    and recomputes only 5 tokens, not 9."""
    s = VllmV1Scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16)
    s.add(Request(0, 4, 8))
    s.add(Request(1, 4, 8))
    steps = run(s)
    assert rows(steps[5][0]) == [(0, 8, 1, (1, 3, 4))] and steps[5][0].preempted == (1,)
    assert rows(steps[6][0]) == [(0, 9, 1, (1, 3, 4))]                  # B cannot fit yet
    assert steps[7][1].finished == (0,)
    assert rows(steps[8][0]) == [(1, 4, 5, (2, 4, 3))]                  # 5 recomputed
    assert sum(1 for _, out in steps for i in out.emitted if i == 1) == 8
    # lookups at admission: A 1 block, B 1, B again 3 (1 found)
    assert (s.pool.queried_blocks, s.pool.hit_blocks) == (5, 1) and s.pool.hit_rate == 0.2
    # without the cache B recomputes its 9 tokens from 0
    plain = VllmV1Scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16,
                            enable_prefix_caching=False)
    plain.add(Request(0, 4, 8))
    plain.add(Request(1, 4, 8))
    assert rows(run(plain)[8][0]) == [(1, 0, 9, (2, 4, 3))]


def test_the_prefix_cache_keeps_a_freed_block_until_it_is_handed_out_again():
    pool = BlockPool(6, block_size=4, enable_caching=True)
    assert pool.allocate("a", 10)                       # blocks 1 2 3; two full, registered
    assert pool.cached_prefix("a", 10) == 2
    pool.free("a")                                      # free queue: 4 5 3 2 1
    assert pool.cached_prefix("a", 10) == 2             # still there
    assert pool.cached_prefix("a", 8) == 1              # the last known token is recomputed
    assert pool.allocate("b", 12)                       # takes 4 5 3: nothing evicted
    assert pool.cached_prefix("a", 10) == 2
    assert pool.allocate("c", 4)                        # takes 2: a's second block evicted
    assert pool.cached_prefix("a", 10) == 1
    assert not pool.allocate("a", 9, hit_blocks=1)      # needs 2 new + block 1: 1 free
    assert pool.cached_prefix("a", 10) == 1 and pool.num_free == 1   # nothing changed
    pool.free("b")
    assert pool.allocate("a", 9, hit_blocks=1) and pool.table("a")[0] == 1
    off = BlockPool(6, block_size=4)
    off.allocate("a", 10)
    off.free("a")
    assert off.cached_prefix("a", 10) == 0
    with pytest.raises(ConfigError, match="enable_caching"):
        BlockPool(6, enable_caching="yes")
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        VllmV1Scheduler(6, enable_prefix_caching=1)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = VllmV1Scheduler(20, block_size=4, max_num_batched_tokens=10,
                        enable_chunked_prefill=False)
    s.add(Request(0, 6, 3))
    s.add(Request(1, 6, 1))
    first = s.schedule()
    assert rows(first) == [(0, 0, 6, (1, 2))]               # 6 + 6 > 10: B waits whole
    s.finish_step(first)
    assert [x.num_new_tokens for x in s.schedule().scheduled] == [1, 6]


def test_long_prefill_threshold_and_max_model_len():
    s = VllmV1Scheduler(40, block_size=4, max_num_batched_tokens=64,
                        long_prefill_token_threshold=5, max_model_len=20)
    s.add(Request(0, 12, 30))
    first = s.schedule()
    assert [x.num_new_tokens for x in first.scheduled] == [5]
    s.finish_step(first)
    steps = run(s)
    assert [x.num_new_tokens for x in steps[0][0].scheduled] == [5]
    assert sum(len(out.emitted) for _, out in steps) == 20 - 12   # stops at max_model_len
    assert max(x.context for st, _ in steps for x in st.scheduled) <= 19


def test_static_batching_decodes_a_batch_to_its_end_before_the_next():
    s = StaticScheduler(64, block_size=4, max_num_seqs=2)
    for i, (p, o) in enumerate([(5, 2), (3, 4), (4, 1)]):
        s.add(Request(i, p, o))
    steps = run(s)
    ids = [[x.request_id for x in st.scheduled] for st, _ in steps]
    assert ids == [[0, 1], [0, 1], [1], [1], [2]]
    assert [st.prefill_tokens for st, _ in steps] == [8, 0, 0, 0, 4]
    # each request reserves its whole prompt + output at admission
    assert len(steps[0][0].scheduled[1].block_table) == blocks_for(3 + 4, 4)


def test_static_batching_caps_prompt_tokens():
    s = StaticScheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    for i in range(3):
        s.add(Request(i, 5, 1))
    assert [x.request_id for x in s.schedule().scheduled] == [0]


def test_block_pool_allocates_reuses_and_refuses_without_change():
    pool = BlockPool(5, block_size=4)
    assert pool.num_usable == 4 and pool.num_free == 4
    assert pool.allocate("a", 9) and pool.table("a") == (1, 2, 3)
    assert not pool.allocate("b", 8) and pool.table("b") == () and pool.num_free == 1
    pool.free("a")
    assert pool.allocate("b", 8) and pool.table("b") == (4, 3)    # tail-first reuse order
    assert pool.usage == pytest.approx(0.5)


def test_a_cache_of_a_billion_blocks_holds_nothing_until_its_blocks_are_used():
    """A tiny proxy model on an 80 GB GPU gets a cache of millions of blocks (the serving
    scenario's 2-layer proxy: 74.5 M per scheduler, 5.7 s each to build when the free queue
    listed them all). Blocks never handed out are a range at the queue's head: a pool of
    a billion blocks is built at once and hands out, frees and reuses in vLLM's order."""
    pool = BlockPool(10**9 + 1, block_size=4, enable_caching=True)
    assert pool.num_free == pool.num_usable == 10**9
    assert pool.allocate("a", 9) and pool.table("a") == (1, 2, 3)
    assert pool.allocate("b", 5) and pool.table("b") == (4, 5)
    pool.free("a")                     # to the queue's tail, behind the unused blocks
    assert pool.num_free == 10**9 - 2 and pool.num_used == 2
    assert pool.allocate("c", 8) and pool.table("c") == (6, 7)
    assert pool.cached_prefix("a", 9) == 2           # its two full blocks, still named
    assert pool.allocate("a", 9, hit_blocks=2) and pool.table("a") == (1, 2, 8)
    small = BlockPool(6, block_size=4)               # the queue's order, whole
    assert small.allocate("a", 9) and small.free_queue() == [4, 5]
    small.free("a")
    assert small.free_queue() == [4, 5, 3, 2, 1]


@pytest.mark.parametrize("call, field", [
    (lambda: VllmV1Scheduler(1), "num_blocks"),
    (lambda: VllmV1Scheduler(8, max_num_seqs=0), "max_num_seqs"),
    (lambda: VllmV1Scheduler(8, max_num_batched_tokens=1.5), "max_num_batched_tokens"),
    (lambda: VllmV1Scheduler(3, block_size=4).add(Request(0, 6, 4)), "prompt_len + output_len"),
    (lambda: VllmV1Scheduler(30, max_model_len=8).add(Request(0, 8, 1)), "prompt_len"),
    (lambda: Request(0, 0, 4), "prompt_len"),
    (lambda: Request(0, 4, 4, arrival_s=-1.0), "arrival_s"),
    (lambda: make_scheduler("orca", 8), "engine"),
    (lambda: make_scheduler("static", 8, enable_chunked_prefill=False), "engine settings"),
])
def test_bad_settings_name_the_field(call, field):
    with pytest.raises(ConfigError) as err:
        call()
    assert err.value.field == field


def test_a_request_id_is_queued_once():
    s = VllmV1Scheduler(10)
    s.add(Request(7, 3, 3))
    with pytest.raises(ConfigError, match="request_id"):
        s.add(Request(7, 3, 3))


def test_external_computed_tokens_leave_the_last_prompt_token_to_compute():
    """A disaggregated decode instance: the prompt's KV arrived; vLLM recomputes the last
    prompt token for its logits, then decodes."""
    s = VllmV1Scheduler(20, block_size=4)
    s.add(Request(0, 10, 3), num_external_computed_tokens=10)
    step = s.schedule()
    assert rows(step) == [(0, 9, 1, (1, 2, 3))] and step.scheduled[0].samples
    assert s.finish_step(step).emitted == (0,)


def test_steps_by_arrival_adds_requests_at_their_step_and_names_a_stuck_cache():
    from serving import steps_by_arrival
    s = VllmV1Scheduler(20, block_size=4, max_num_batched_tokens=64)
    reqs = [Request(0, 4, 2, arrival_step=0), Request(1, 4, 1, arrival_step=3)]
    seen = []
    for step in steps_by_arrival(s, reqs):
        seen.append([x.request_id for x in step.scheduled])
        s.finish_step(step)
    assert seen == [[0], [0], [], [1]]                  # an idle step while 1 is on its way

    class Stuck:              # a scheduler holding requests it can never schedule
        has_unfinished, num_running, num_waiting = True, 1, 1
        pool = BlockPool(3, block_size=4)

        def schedule(self):
            return EngineStep(0, ())

    with pytest.raises(RuntimeError, match="replica 7: step 0 schedules nothing.*3 blocks"):
        next(steps_by_arrival(Stuck(), [], "replica 7"))


def test_a_step_in_flight_holds_its_decodes_and_lets_prefill_chunks_run_ahead():
    """A pipelined engine (vLLM v1's batch queue) schedules the next step before the last
    finishes: a request whose next token is not known yet sits out; a prompt's next chunk
    goes on from where the chunk in flight ends."""
    s = VllmV1Scheduler(40, block_size=4, max_num_batched_tokens=8)
    s.add(Request(0, 3, 4))
    s.add(Request(1, 20, 2))
    a = s.schedule()
    assert rows(a) == [(0, 0, 3, (1,)), (1, 0, 5, (2, 3))]
    b = s.schedule()                     # a in flight: 0 waits for its token, 1 chunks on
    assert rows(b) == [(1, 5, 8, (2, 3, 4, 5))]
    s.finish_step(a)
    s.finish_step(b)
    c = s.schedule()
    assert [(x.request_id, x.num_computed_tokens, x.num_new_tokens) for x in c.scheduled] == [
        (0, 3, 1), (1, 13, 7)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth", [2, 3])
def test_pipelined_steps_never_overlap_a_requests_tokens(seed, depth):
    """Up to ``depth`` steps in flight, finished in order: every request emits exactly
    output_len tokens, each scheduled range starts where the request's last one ended
    (after a preemption: at a block boundary no further, what the prefix cache kept), and a
    request in flight is never preempted."""
    rng = np.random.default_rng(seed)
    s = VllmV1Scheduler(int(rng.integers(12, 30)), block_size=4,
                        max_num_batched_tokens=int(rng.integers(8, 40)), max_num_seqs=4)
    reqs = [Request(i, int(rng.integers(1, 25)), int(rng.integers(1, 12))) for i in range(20)]
    reqs = [r for r in reqs if blocks_for(r.max_tokens, 4) <= s.pool.num_usable]
    for r in reqs:
        s.add(r)
    flight, ends, emitted = [], {}, {r.request_id: 0 for r in reqs}
    restarted = {}                          # preempted request -> where it had got to
    for _ in range(5000):
        if not s.has_unfinished and not flight:
            break
        step = s.schedule() if len(flight) < depth else None
        if step is not None and not step.is_empty:
            in_flight = {x.request_id for f in flight for x in f.scheduled}
            assert not set(step.preempted) & in_flight
            for x in step.scheduled:
                if x.request_id in step.preempted:
                    continue
                if x.request_id in restarted:
                    start = x.num_computed_tokens
                    assert start % 4 == 0 and start <= restarted.pop(x.request_id), x
                else:
                    assert x.num_computed_tokens == ends.get(x.request_id, 0), (x, ends)
                ends[x.request_id] = x.context
            for rid in step.preempted:
                restarted[rid] = ends.pop(rid, 0)
            flight.append(step)
        else:
            for rid in (step.preempted if step is not None else ()):
                restarted[rid] = ends.pop(rid, 0)
            assert flight, "nothing in flight and nothing scheduled"
            out = s.finish_step(flight.pop(0))
            for rid in out.emitted:
                emitted[rid] += 1
    assert emitted == {r.request_id: r.output_len for r in reqs}
    assert s.pool.num_free == s.pool.num_usable


def test_requests_of_one_prefix_share_its_blocks_worked_by_hand():
    """docs/serving.md, "A shared prefix, by hand": blocks of 4, budget 16; A and B both
    10-token prompts whose first 8 tokens are prefix 7, both queued before step 0.
    Step 0: A is admitted with nothing cached and scheduled whole (blocks 1 2 3): blocks
    1 and 2 are full of the prefix, so they are registered now, as the step schedules
    them. B (budget 6 left) looks up at most ⌊9/4⌋ = 2 blocks and finds both: it takes
    1 and 2 (held by A: nothing taken from the free queue), counts 8 tokens computed,
    computes its last 2 in block 4 — in the same step as A computes the prefix. 4 blocks
    used, not 6; lookups 3 + 3 blocks, 2 found."""
    s = VllmV1Scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    s.add(Request(0, 10, 2, prefix_id=7, prefix_len=8))
    s.add(Request(1, 10, 2, prefix_id=7, prefix_len=8))
    step = s.schedule()
    assert rows(step) == [(0, 0, 10, (1, 2, 3)), (1, 8, 2, (1, 2, 4))]
    assert s.pool.num_used == 4 and [s.pool.holders(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (s.pool.queried_blocks, s.pool.hit_blocks) == (6, 2)
    s.finish_step(step)
    rest = run(s)
    assert [rows(st) for st, _ in rest] == [[(0, 10, 1, (1, 2, 3)), (1, 10, 1, (1, 2, 4))]]
    assert s.pool.num_free == s.pool.num_usable
    # a later request of the prefix finds the freed blocks still cached; another prefix
    # (or none) shares nothing
    s.add(Request(2, 9, 1, prefix_id=7, prefix_len=8))
    s.add(Request(3, 9, 1, prefix_id=8, prefix_len=8))
    s.add(Request(4, 9, 1))
    assert [(x.request_id, x.num_computed_tokens) for x in s.schedule().scheduled] == [
        (2, 8), (3, 0), (4, 0)]
    # without the cache B computes the whole prompt in blocks of its own
    plain = VllmV1Scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16,
                            enable_prefix_caching=False)
    plain.add(Request(0, 10, 2, prefix_id=7, prefix_len=8))
    plain.add(Request(1, 10, 2, prefix_id=7, prefix_len=8))
    assert rows(plain.schedule()) == [(0, 0, 10, (1, 2, 3)), (1, 0, 6, (4, 5))]


def _identity(request: Request, position: int):
    """What a request's token at ``position`` is, as a KV cache would hold it: the
    prefix's token there, shared by every request of the prefix, or its own."""
    if position < request.prefix_len:
        return "prefix", request.prefix_id, position
    return request.request_id, position


@pytest.mark.parametrize("windows", [(None,), (5, None), (None, 9, 9)],
                         ids=["one-group", "sliding-5+full", "full+2x-sliding-9"])
@pytest.mark.parametrize("seed", range(8))
def test_every_token_read_is_the_one_the_request_wrote_or_shares(seed, windows):
    """Shared prefixes (3 prefixes and unshared prompts), preemptions (a small cache),
    the prefix cache and KV-cache groups (a sliding group reads only its window: from
    the chunk's first query's c − w + 1 on) together: a shadow cache records which token
    each step writes in each group's slot; every token a scheduled request reads must be
    in its table's slot — its own, or its prefix's written by any request — and a block
    sits in several tables only as a block wholly inside one prefix."""
    rng = np.random.default_rng(100 + seed)
    bs = 4
    s = VllmV1Scheduler(int(rng.integers(14, 30)) * len(windows), block_size=bs,
                        max_num_batched_tokens=int(rng.integers(8, 40)),
                        max_num_seqs=int(rng.integers(2, 6)), kv_group_windows=windows)
    prefixes = {pid: int(rng.integers(1, 20)) for pid in range(3)}
    reqs, arrivals = {}, {}
    for i in range(30):
        pid = int(rng.integers(0, 4))
        own = int(rng.integers(1, 12))
        prefix = prefixes.get(pid, 0)
        r = Request(i, prefix + own, int(rng.integers(1, 10)),
                    prefix_id=pid if prefix else None, prefix_len=prefix)
        if s.pool.blocks_for_request(r.max_tokens, s.max_num_batched_tokens) \
                <= s.pool.num_usable:
            reqs[i] = r
            arrivals.setdefault(int(rng.integers(0, 30)), []).append(r)
    slots: dict = {}
    emitted = {i: 0 for i in reqs}
    for step, out in run(s, arrivals):
        for x in step.scheduled:                          # every layer writes first ...
            for table in x.block_tables:
                for p in range(x.num_computed_tokens, x.context):
                    assert table[p // bs] != 0, (x, p)
                    slots[(table[p // bs], p % bs)] = _identity(reqs[x.request_id], p)
        owners: dict = {}
        for x in step.scheduled:                          # ... then attends
            r = reqs[x.request_id]
            for g, (w, table) in enumerate(zip(windows, x.block_tables)):
                start = 0 if w is None else max(0, x.num_computed_tokens - w + 1)
                for p in range(start, x.context):
                    assert slots[(table[p // bs], p % bs)] == _identity(r, p), (x, p)
                for index, block in enumerate(table):
                    if block == 0:                        # dropped: left the window
                        assert w is not None and (index + 1) * bs <= start, (x, index)
                        continue
                    shared = r.prefix_len and (index + 1) * bs <= r.prefix_len
                    owners.setdefault(block, set()).add(
                        ("prefix", r.prefix_id, index, g) if shared else (r.request_id, index, g))
        assert all(len(names) == 1 for names in owners.values()), owners
        for i in out.emitted:
            emitted[i] += 1
    assert emitted == {i: r.output_len for i, r in reqs.items()}
    assert s.pool.num_free == s.pool.num_usable and s.pool.hit_blocks > 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(prefix_id=1, prefix_len=9), "prefix_len"),
    (dict(prefix_id=1, prefix_len=-1), "prefix_len"),
    (dict(prefix_len=3), "prefix_id"),
    (dict(prefix_id=2), "prefix_id"),
    (dict(prefix_id="sys", prefix_len=3), "prefix_id"),
])
def test_a_bad_shared_prefix_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        Request(0, 8, 2, **kwargs)
    assert err.value.field == field


def test_a_sliding_group_drops_blocks_that_left_its_window_worked_by_hand():
    """docs/serving.md, "A sliding window's blocks, by hand": blocks of 4, groups (window
    5, full) as GPT-OSS's (sliding first); A = (prompt 9, 6 out). Step 0 allocates 3
    blocks in each group: sliding [1 2 3], full [4 5 6]. Before step 1 (9 computed) the
    sliding group drops the blocks wholly before token 9 − 5 + 1 = 5: block 1
    (tokens 0-3), its slot the null block 0; before step 4 (12 computed, from token 8 on)
    block 2; step 4 needs a 4th block in each group: 7 and 8 from the queue's head. The
    full table keeps every block. A finishes at step 5 and frees its sliding table, then
    its full one, each last block first."""
    s = VllmV1Scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16,
                        kv_group_windows=(5, None))
    s.add(Request(0, 9, 6))
    got = [(step.scheduled[0].num_computed_tokens, step.scheduled[0].block_tables)
           for step, _ in run(s)]
    assert got == [(0, ((1, 2, 3), (4, 5, 6))),
                   (9, ((0, 2, 3), (4, 5, 6))), (10, ((0, 2, 3), (4, 5, 6))),
                   (11, ((0, 2, 3), (4, 5, 6))),
                   (12, ((0, 0, 3, 7), (4, 5, 6, 8))), (13, ((0, 0, 3, 7), (4, 5, 6, 8)))]
    assert s.pool.free_queue() == [9, 10, 11, 1, 2, 7, 3, 8, 6, 5, 4]
    # a request as long needs ⌈15/4⌉ = 4 blocks in the full group and at most
    # ⌈(5 - 1 + 16)/4⌉ + 1 = 6 in the sliding one, never more than the full's 4
    assert s.pool.blocks_for_request(15, 16) == 8
    with pytest.raises(ConfigError, match="group_windows"):
        VllmV1Scheduler(12, kv_group_windows=(1, None))
