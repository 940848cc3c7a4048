"""Engine schedulers: which requests run how many tokens in each engine step.

An engine step runs one forward over a batch of sequences; each scheduled sequence
computes the KV of ``num_new_tokens`` tokens starting at position ``num_computed_tokens``
(a prefill chunk, or one decode token) and, when that reaches the end of its known
tokens, samples one new token. Schedulers count tokens and blocks only; token values
never enter them, so the emulator (which computes real tokens) and the simulator (which
prices steps) run the same scheduler and see the same steps.

**vLLM v1** (:class:`VllmV1Scheduler`; imitated: ``vllm/v1/core/sched/scheduler.py``
``Scheduler.schedule`` and ``update_from_output`` of vLLM 0.8–0.11, prefix caching on as
vLLM v1's default (``enable_prefix_caching``), no speculative decoding, FCFS policy).
Each step has a token budget ``max_num_batched_tokens``:

1. *Running* requests, in order: each gets n = min(tokens − computed,
   ``long_prefill_token_threshold`` when set, the budget left, max_model_len − 1 − computed)
   new tokens — one for a decode, the next chunk for a prefill that did not fit earlier.
   Its blocks are grown to hold computed + n tokens; when the pool is short, the *last*
   running request is preempted (its blocks freed, its computed tokens set to 0, put at
   the head of the waiting queue) and the allocation retried; when the request preempted
   is the one being scheduled, scheduling of running requests stops.
2. *Waiting* requests, only if nothing was preempted in this step, FCFS, while budget is
   left and fewer than ``max_num_seqs`` run: a request with nothing computed first takes
   back its leading blocks still in the prefix cache (:mod:`serving.blocks`: a shared
   prefix another request computed — registered as soon as a step schedules it full,
   so even one computed in this same step — or a preempted request's own KV that
   nobody has overwritten; at most up to its last known token) and counts them computed;
   it then gets n = min(tokens − computed, budget) (with chunked prefill disabled a prompt
   that does not fit whole stops admission), its blocks, and joins the running queue's
   tail; a request whose blocks do not fit stops admission.

After the step (``finish_step``) each scheduled request's computed tokens grow by n; one
that now has every known token computed emits a token; one with ``output_len`` tokens
(or max_model_len tokens) finishes and frees its blocks. A preempted request is
recomputed: re-prefilled over its prompt *and* the tokens it already emitted (less the
blocks the prefix cache kept), then decoded on.

**Static** batching (:class:`StaticScheduler`): a batch of up to ``max_num_seqs`` arrived
requests (FCFS; as many as fit when each reserves blocks for its whole prompt + output,
as FasterTransformer sized its buffers; under ``max_num_batched_tokens`` prompt tokens
when set) is prefilled in one step and decoded until its last request finishes; finished
requests leave idle slots, and nobody joins until the batch is done.

**Steps in flight.** A pipelined engine (vLLM v1's batch queue: pp steps in flight) asks
for the next step before the last has finished: a request's next tokens start where its
tokens in flight end (vLLM advances ``num_computed_tokens`` when it schedules), so a decode
waits for its token and a prompt's next chunk goes on; a request with a step in flight is
never preempted. Steps must be finished in the order they were formed.

A hand-worked vLLM v1 example is in ``docs/serving.md`` and is a test.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from modeling.choices import Engine
from modeling.errors import ConfigError

from .blocks import BlockPool
from .request import Request

__all__ = ["ScheduledRequest", "EngineStep", "StepOutcome", "VllmV1Scheduler",
           "StaticScheduler", "make_scheduler", "steps_by_arrival"]


class ScheduledRequest(NamedTuple):
    """One request's share of a step: ``num_new_tokens`` from position
    ``num_computed_tokens``; ``block_table`` after this step's allocation (the first
    KV-cache group's; ``block_tables``: every group's, :mod:`serving.kv_groups`);
    ``samples``: the step reaches the end of its known tokens and emits one;
    ``is_decode``: one new token after its prompt was fully computed. (A named tuple:
    immutable, and built once per request per step — a third of a frozen dataclass's
    cost.)"""

    request_id: int
    num_new_tokens: int
    num_computed_tokens: int
    block_table: tuple[int, ...]
    samples: bool
    is_decode: bool
    block_tables: tuple = ()

    @property
    def context(self) -> int:
        """Keys the step's last query of this request sees: computed + new."""
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def group_tables(self) -> tuple:
        """Every KV-cache group's table: ``block_tables``, or ``(block_table,)`` for a
        share built with one table."""
        return self.block_tables or (self.block_table,)


@dataclass(frozen=True)
class EngineStep:
    """Step ``index``: the ``scheduled`` requests in the engine's order and the requests
    ``preempted`` while forming it."""

    index: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[int, ...] = ()
    # (scheduled tokens, prefill tokens, decode sequences, sampled rows), counted once when
    # the step is made (every run reads them; a cached_property's lock cost more)
    _counts: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        tokens = prefill = decode = samples = 0
        for s in self.scheduled:
            tokens += s.num_new_tokens
            if s.is_decode:
                decode += 1
            else:
                prefill += s.num_new_tokens
            if s.samples:
                samples += 1
        object.__setattr__(self, "_counts", (tokens, prefill, decode, samples))

    @property
    def num_scheduled_tokens(self) -> int:
        return self._counts[0]

    @property
    def prefill_tokens(self) -> int:
        """Tokens of prefill chunks (recomputation included)."""
        return self._counts[1]

    @property
    def decode_seqs(self) -> int:
        return self._counts[2]

    @property
    def num_samples(self) -> int:
        """Sequences that emit a token: the rows the LM head computes."""
        return self._counts[3]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def __repr__(self) -> str:
        return (f"EngineStep(index={self.index}, prefill_tokens={self.prefill_tokens}, "
                f"decode_seqs={self.decode_seqs}, requests={[s.request_id for s in self.scheduled]}"
                + (f", preempted={list(self.preempted)}" if self.preempted else "") + ")")


@dataclass(frozen=True)
class StepOutcome:
    """Requests that emitted one token in the step, and those that finished (freed)."""

    emitted: tuple[int, ...]
    finished: tuple[int, ...]


class _State:
    """A request's mutable progress inside one scheduler: ``computed`` tokens finished,
    ``flight`` more in steps scheduled and not finished yet (a pipelined engine keeps
    several steps in flight)."""

    __slots__ = ("request", "computed", "flight", "emitted", "preemptions")

    def __init__(self, request: Request, computed: int = 0):
        self.request, self.computed, self.flight = request, computed, 0
        self.emitted = self.preemptions = 0

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt and every token emitted so far."""
        return self.request.prompt_len + self.emitted

    @property
    def ahead(self) -> int:
        """Where the next scheduled token starts: computed + in flight (vLLM v1 advances
        ``num_computed_tokens`` when it schedules)."""
        return self.computed + self.flight


def _count(owner: str, name: str, value, minimum: int = 1, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"an integer >= {minimum}" + (" or None" if allow_none
                                                                     else ""),
                          "not a valid setting", owner=owner)
    return value


class _Scheduler:
    """What both engines share: the block pool, the queues, the step counter and the
    bookkeeping after a step."""

    engine: Engine

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int | None, enable_prefix_caching: bool = False,
                 kv_group_windows: tuple = (None,)):
        owner = type(self).__name__
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching, kv_group_windows)
        self.max_num_seqs = _count(owner, "max_num_seqs", max_num_seqs)
        self.max_model_len = _count(owner, "max_model_len", max_model_len, 2, allow_none=True)
        self._waiting: deque[_State] = deque()
        self._running: list[_State] = []
        self._states: dict = {}
        self._step = 0
        self.num_preemptions = 0

    # --- requests in -------------------------------------------------------------------
    def add(self, request: Request, num_external_computed_tokens: int = 0) -> None:
        """Queue ``request`` (FCFS). ``num_external_computed_tokens``: prompt tokens whose KV
        is already here (a disaggregated decode instance received it), capped at
        prompt_len − 1 — vLLM recomputes the last prompt token to get its logits; their
        blocks are taken when the request is admitted."""
        if not isinstance(request, Request):
            raise TypeError(f"add: expected a serving.Request, got {type(request).__name__}")
        if request.request_id in self._states:
            raise ConfigError("request_id", request.request_id, "an id not already queued",
                              "two requests with one id", owner=type(self).__name__)
        limit = self.max_model_len or request.max_tokens
        longest = min(request.max_tokens, limit)
        if self.pool.blocks_for_request(longest, self._chunk) > self.pool.num_usable:
            raise ConfigError("prompt_len + output_len", longest,
                              f"at most {self.pool.capacity_tokens} tokens (the whole cache: "
                              f"{self.pool.num_usable} blocks of {self.pool.block_size})",
                              f"request {request.request_id!r} can never fit in the KV cache",
                              owner=type(self).__name__)
        if self.max_model_len is not None and request.prompt_len >= self.max_model_len:
            raise ConfigError("prompt_len", request.prompt_len,
                              f"< max_model_len={self.max_model_len}",
                              f"request {request.request_id!r}'s prompt leaves no room to "
                              "generate", owner=type(self).__name__)
        external = _count(type(self).__name__, "num_external_computed_tokens",
                          num_external_computed_tokens, 0)
        state = _State(request, min(external, request.prompt_len - 1))
        self._states[request.request_id] = state
        self._waiting.append(state)

    # --- what is inside ----------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def emitted(self, request_id) -> int:
        """Tokens ``request_id`` has emitted so far."""
        return self._states[request_id].emitted

    # --- a step ------------------------------------------------------------------------
    @property
    def _chunk(self) -> int:
        """The most tokens one request computes in a step, which sizes a sliding group's
        blocks: here a whole request (static batching computes a prompt whole and drops
        nothing)."""
        return self.pool.capacity_tokens

    def _scheduled(self, state: _State, n: int) -> ScheduledRequest:
        req = state.request
        start = state.computed + state.flight                  # state.ahead
        state.flight += n
        tables = self.pool.tables(req.request_id)
        return ScheduledRequest(
            req.request_id, n, start, tables[0],
            start + n == req.prompt_len + state.emitted,       # reaches state.num_tokens
            n == 1 and start >= req.prompt_len, tables)

    def _next_step(self, scheduled, preempted=()) -> EngineStep:
        step = EngineStep(self._step, tuple(scheduled), tuple(preempted))
        self._step += 1
        return step

    def finish_step(self, step: EngineStep) -> StepOutcome:
        """Advance the step's requests: computed += new tokens; emit where the step
        reached the end of the known tokens; finish (and free) those at their length."""
        emitted, finished, states = [], [], self._states
        limit = self.max_model_len
        for s in step.scheduled:
            state = states[s.request_id]
            if state.computed != s.num_computed_tokens:
                raise ValueError(f"finish_step: step {step.index} is stale for request "
                                 f"{s.request_id!r} (computed {state.computed}, the step says "
                                 f"{s.num_computed_tokens}); finish each step once, in order")
            state.computed += s.num_new_tokens
            state.flight -= s.num_new_tokens
            if state.computed == state.request.prompt_len + state.emitted:   # num_tokens
                state.emitted += 1
                emitted.append(s.request_id)
                # done: its output length, or the model's length reached
                if state.emitted >= state.request.output_len or (
                        limit is not None and state.num_tokens >= limit):
                    finished.append(s.request_id)
                    self._finish(state)
        return StepOutcome(tuple(emitted), tuple(finished))

    def _finish(self, state: _State) -> None:
        self.pool.free(state.request.request_id)
        self._running.remove(state)
        del self._states[state.request.request_id]


class VllmV1Scheduler(_Scheduler):
    """vLLM v1's scheduler (module docstring): ``num_blocks`` KV blocks of ``block_size``
    tokens, ``max_num_batched_tokens`` per step, ``max_num_seqs`` running, optional
    ``max_model_len`` and ``long_prefill_token_threshold`` (0: off), chunked prefill and
    prefix caching on by default as in v1. Defaults: vLLM's ``SchedulerConfig`` — 8192
    batched tokens (the OpenAI server's default with chunked prefill on an H100-class GPU,
    vLLM ≥ 0.8's ``EngineArgs._set_default_args_v1``) and 256 sequences."""

    engine = Engine.VLLM_V1

    def __init__(self, num_blocks: int, *, block_size: int = 16,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 max_model_len: int | None = None, long_prefill_token_threshold: int = 0,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                 kv_group_windows: tuple = (None,)):
        owner = type(self).__name__
        if not isinstance(enable_prefix_caching, bool):
            raise ConfigError("enable_prefix_caching", enable_prefix_caching,
                              "true or false", "not a boolean", owner=owner)
        super().__init__(num_blocks, block_size, max_num_seqs, max_model_len,
                         enable_prefix_caching, kv_group_windows)
        self.max_num_batched_tokens = _count(owner, "max_num_batched_tokens",
                                             max_num_batched_tokens)
        self.long_prefill_token_threshold = _count(owner, "long_prefill_token_threshold",
                                                   long_prefill_token_threshold, 0)
        if enable_chunked_prefill not in (True, False):
            raise ConfigError("enable_chunked_prefill", enable_chunked_prefill,
                              "true or false", "not a boolean", owner=owner)
        self.enable_chunked_prefill = enable_chunked_prefill

    @property
    def _chunk(self) -> int:
        return self.max_num_batched_tokens

    def _cap(self, state: _State, n: int, budget: int) -> int:
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        n = min(n, budget)
        if self.max_model_len is not None:
            n = min(n, self.max_model_len - 1 - state.ahead)
        return n

    def _preempt(self) -> tuple[_State | None, int]:
        """The last running request with no step in flight, preempted, and where it was
        in the running queue ((None, -1): every one has a step in flight — a pipelined
        engine cannot take back their blocks yet)."""
        at = next((i for i in range(len(self._running) - 1, -1, -1)
                   if not self._running[i].flight), None)
        if at is None:
            return None, -1
        victim = self._running.pop(at)
        self.pool.free(victim.request.request_id)
        victim.computed = 0
        victim.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(victim)
        return victim, at

    def schedule(self) -> EngineStep:
        """One step's batch (module docstring, steps 1 and 2)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[int] = []
        # without a prefill threshold or a model length, _cap is min(n, budget): inlined
        # below, as a run schedules each running request once per step
        plain = not self.long_prefill_token_threshold and self.max_model_len is None
        allocate, running = self.pool.allocate, self._running
        i = 0
        while i < len(running) and budget > 0:
            state = running[i]
            req = state.request
            ahead = state.computed + state.flight
            n = req.prompt_len + state.emitted - ahead
            if plain:
                if n > budget:
                    n = budget
            else:
                n = self._cap(state, n, budget)
            if n <= 0:
                i += 1
                continue
            # allocate(id, tokens, hit_blocks, prefix, computed): positional, once per
            # running request per step
            while not allocate(req.request_id, ahead + n, 0, req.shared_prefix, ahead):
                victim, at = self._preempt()
                if victim is None:
                    break
                preempted.append(victim.request.request_id)
                if victim is state:
                    break
                if at < i:            # only under pipelining: earlier requests in flight
                    i -= 1
            else:
                scheduled.append(self._scheduled(state, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
                state = self._waiting[0]
                rid = state.request.request_id
                prefix = state.request.shared_prefix
                lookup = self.pool.enable_caching and not state.ahead   # nothing computed
                hits = self.pool.cached_prefix(rid, state.num_tokens, prefix) if lookup else 0
                taken = hits * self.pool.block_size
                state.computed += taken                     # undone unless admitted
                n = state.num_tokens - state.ahead
                whole = self.enable_chunked_prefill or n <= budget
                n = self._cap(state, n, budget)
                if not (whole and self.pool.allocate(rid, state.ahead + n, hit_blocks=hits,
                                                     prefix=prefix, computed=state.ahead)):
                    state.computed -= taken
                    break
                if lookup:
                    self.pool.record_admission(state.num_tokens, hits)
                self._waiting.popleft()
                self._running.append(state)
                scheduled.append(self._scheduled(state, n))
                budget -= n
        # a running request preempted after it was scheduled in this step cannot stay in it
        if preempted:
            gone = set(preempted)
            scheduled = [s for s in scheduled if s.request_id not in gone]
        return self._next_step(scheduled, preempted)


class StaticScheduler(_Scheduler):
    """Static batching (module docstring): batches of up to ``max_num_seqs`` requests,
    each reserving blocks for prompt + output; ``max_num_batched_tokens`` (None: no cap)
    bounds a batch's prompt tokens."""

    engine = Engine.STATIC

    def __init__(self, num_blocks: int, *, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 kv_group_windows: tuple = (None,)):
        super().__init__(num_blocks, block_size, max_num_seqs, max_model_len,
                         kv_group_windows=kv_group_windows)
        self.max_num_batched_tokens = _count(type(self).__name__, "max_num_batched_tokens",
                                             max_num_batched_tokens, allow_none=True)

    def _reserve(self, state: _State) -> int:
        req = state.request
        return min(req.max_tokens, self.max_model_len or req.max_tokens)

    def schedule(self) -> EngineStep:
        if not self._running:                      # form the next batch
            tokens = 0
            while self._waiting and len(self._running) < self.max_num_seqs:
                state = self._waiting[0]
                prompt = state.num_tokens - state.ahead
                if self.max_num_batched_tokens is not None and self._running \
                        and tokens + prompt > self.max_num_batched_tokens:
                    break
                if not self.pool.allocate(state.request.request_id, self._reserve(state)):
                    break
                self._waiting.popleft()
                self._running.append(state)
                tokens += prompt
        return self._next_step([self._scheduled(s, s.num_tokens - s.ahead)
                                for s in self._running if s.num_tokens > s.ahead])


def make_scheduler(engine: Engine | str, num_blocks: int, **settings):
    """The scheduler of ``engine`` (:class:`~modeling.choices.Engine`) with ``settings``
    (its keyword arguments; one it does not take is an error naming it)."""
    try:
        engine = Engine(engine)
    except ValueError:
        raise ConfigError("engine", engine, ", ".join(Engine.values()),
                          "no such serving engine") from None
    cls = VllmV1Scheduler if engine is Engine.VLLM_V1 else StaticScheduler
    try:
        return cls(num_blocks, **settings)
    except TypeError as exc:
        raise ConfigError("engine settings", sorted(settings), f"the settings of {engine}",
                          str(exc)) from None


def steps_by_arrival(scheduler, requests, who: str = "engine"):
    """Drive ``scheduler`` over ``requests`` counted in engine steps: before step i the
    requests with ``arrival_step`` <= i join (in arrival order), then each step is yielded
    — empty ones too, while requests are still to arrive — and the caller runs it and calls
    ``finish_step`` before asking for the next. A step that schedules nothing while requests
    wait and none will arrive is an error naming ``who`` (the cache cannot hold them)."""
    pending = sorted(requests, key=lambda r: r.arrival_step)
    index = 0
    while pending or scheduler.has_unfinished:
        while pending and pending[0].arrival_step <= index:
            scheduler.add(pending.pop(0))
        step = scheduler.schedule()
        if step.is_empty and scheduler.has_unfinished and not pending:
            raise RuntimeError(f"{who}: step {index} schedules nothing while "
                               f"{scheduler.num_running} requests run and "
                               f"{scheduler.num_waiting} wait, and none will arrive: the KV "
                               f"cache of {scheduler.pool.num_blocks} blocks cannot hold them")
        yield step
        index += 1
