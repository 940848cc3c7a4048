"""The SimPy serving simulator: requests arrive, a router spreads them over replicas, each
replica's engine runs the steps its scheduler forms, and a pricer says how long each lasts.

Processes (one SimPy ``Environment`` per run; nothing shared between runs):

* the **client** sends each request at its arrival time (:mod:`.workload`) — under a
  concurrency limit C not before fewer than C of its requests are outstanding (vLLM bench's
  ``--max-concurrency`` semaphore; a response's completion frees a slot at that instant);
* the **router** (:mod:`.router`) assigns a request to a replica when it is sent;
* one **engine loop** per replica, as vLLM v1's ``EngineCore`` busy loop: take the requests
  that arrived into the scheduler, ``schedule()``; if the step is empty, sleep until the
  next arrival; else price it (``pricer.step_time(step).total_s``), hold for that long
  — one SimPy event per step, never one per token — and ``finish_step()``: every token the
  step emits is seen by the client at the step's end.

Order at one instant: step ends first (tokens, finishes, freed concurrency slots), then
arrivals are routed (so ``least_loaded`` sees the requests that just finished), then
engines schedule (so a request arriving exactly when a step ends joins the next step).

**Pipeline parallelism.** A pricer with ``pp`` > 1 stages (``ServingCostModel``) returns
each stage's time (``stage_s``), the sends between them (``pp_send_s``) and the CPU
overhead. Under ``vllm-v1`` the engine keeps up to pp steps in flight, as vLLM v1's batch
queue does (``max_concurrent_batches`` = pp): a step is formed when fewer than pp are in
flight and the first stage is free; it takes its CPU overhead, then each stage as soon as
it has left the one before and that stage is free, with the send between; it finishes when
it leaves the last. The scheduler leaves out what steps in flight are computing (a decode
waits for its token; a prompt's next chunk goes on). Steps finish in the order they
started. The static engine runs one step at a time.

**Disaggregated prefill/decode** (:func:`simulate_disaggregated`): a request is prefilled
on a prefill replica as a request for one output token — that token is its first, and TTFT
is stamped at the end of that prefill step (as when the prefill instance streams it; vLLM's
``toy_proxy_server`` instead streams every token from the decode instance, whose first
token then also waits for the transfer and a decode step). Its KV (prompt_len tokens) then
moves to a decode replica (chosen by the decode router when the prefill ends), priced by a
:class:`~.kv_transfer.KVTransferPricer`; transfers out of one prefill replica and into one
decode replica each go one at a time (FIFO: start = max(ready, source free, destination
free)). The decode replica admits ``Request(prompt_len + 1, output_len − 1)`` with
``num_external_computed_tokens = prompt_len`` — the prompt's KV is there, the first output
token's is computed by its first decode step, which emits token 2. The prefill replica
frees the prompt's blocks at the prefill's end (vLLM's connector holds them until the
decode side has read them; not modelled).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import simpy
from simpy.events import Event

from modeling.choices import Engine, Router
from modeling.errors import ConfigError
from serving import EngineStep, Request, make_scheduler

from .kv_transfer import KVTransferPricer
from .metrics import DEFAULT_PERCENTILES, RequestRecord, ServingMetrics, compute_metrics
from .router import make_router
from .workload import TraceWorkload, Workload

__all__ = ["StepPricer", "StepRecord", "TransferRecord", "FloorSummary", "PoolSettings",
           "ServingSettings", "ServingResult", "ReplicaPool", "simulate_serving",
           "simulate_disaggregated"]

# Event priorities at one instant (SimPy orders events by (time, priority, insertion)).
_STEP_END = 0    # steps end: tokens emitted, requests finish, concurrency slots free
_ARRIVAL = 1     # requests are sent and routed (SimPy's NORMAL: Event.succeed uses it)
_SCHEDULE = 2    # engines form their next step


class _Abort(Exception):
    """Stops a run whose process failed (SimPy re-creates a process's exception from its
    args, which not every error class allows; the original is kept on the simulation)."""


class _At(Event):
    """An event processed ``delay`` seconds from now in ``priority`` order among the events
    of that instant: a ``simpy.Timeout`` with a priority (the same three fields
    ``Timeout.__init__`` sets)."""

    def __init__(self, env: simpy.Environment, delay: float, priority: int):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority, delay)


@runtime_checkable
class StepPricer(Protocol):
    """Prices one engine step: ``step_time(step)`` returns an object with ``total_s``
    (seconds, > 0) and optionally ``floor_s`` (its physical lower bound)."""

    def step_time(self, step: EngineStep) -> Any:
        ...


class StepRecord(NamedTuple):
    """One engine step of replica ``replica`` (of pool ``pool``: "" when not
    disaggregated): [``start_s``, ``end_s``), its batch and the KV usage after its
    allocation; ``preempted`` requests were preempted while forming it. (A named tuple:
    immutable, and a run makes one per engine step.)"""

    pool: str
    replica: int
    index: int
    start_s: float
    end_s: float
    prefill_tokens: int
    decode_seqs: int
    num_scheduled_tokens: int
    num_seqs: int
    kv_usage: float
    preempted: int
    floor_s: float | None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class TransferRecord:
    """One KV transfer of a disaggregated run: request, prefill replica ``src``, decode
    replica ``dst``, ready (prefill end), start and end times, prompt tokens moved."""

    request_id: int
    src: int
    dst: int
    ready_s: float
    start_s: float
    end_s: float
    prompt_len: int


@dataclass(frozen=True)
class FloorSummary:
    """The physics beside the prediction: Σ step times (``busy_s``) and Σ their floors
    (``floor_s``; None when the pricer gives none) over every step; the same over the
    pure-decode steps (no prefill token), whose mean floor is the per-token decode floor —
    the least time between two tokens of a sequence in the batches this run formed."""

    steps: int
    busy_s: float
    floor_s: float | None
    decode_steps: int
    decode_busy_s: float
    decode_floor_s: float | None

    @property
    def per_token_decode_s(self) -> float | None:
        """Mean pure-decode step time."""
        return self.decode_busy_s / self.decode_steps if self.decode_steps else None

    @property
    def per_token_decode_floor_s(self) -> float | None:
        """Mean pure-decode step floor."""
        if not self.decode_steps or self.decode_floor_s is None:
            return None
        return self.decode_floor_s / self.decode_steps


@dataclass(frozen=True)
class PoolSettings:
    """How one pool of identical replicas ran: ``name`` ("" aggregated, "prefill",
    "decode"), engine, KV blocks per replica, replicas, GPUs per replica and the engine's
    settings as (name, value) pairs."""

    name: str
    engine: str
    num_blocks: int
    replicas: int
    gpus_per_replica: int
    engine_settings: tuple[tuple[str, Any], ...] = ()

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.gpus_per_replica


@dataclass(frozen=True)
class ServingSettings:
    """The settings a run used: its pools, router, concurrency limit, seed and workload."""

    pools: tuple[PoolSettings, ...]
    router: str
    concurrency: int | None
    seed: int | None
    workload: str
    num_requests: int

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pools)


@dataclass(frozen=True)
class ServingResult:
    """A simulated serving run: vLLM-bench ``metrics``, per-request and per-step records,
    KV ``transfers`` (disaggregated runs), total ``preemptions``, ``peak_kv_usage``, the
    ``floors`` summary, the ``settings`` it ran, and ``prefix_cache_hit_rate``: of the KV
    blocks every admission looked up, the share found in the prefix cache, over every
    replica (vLLM's logged "prefix cache hit rate"; None when no engine caches)."""

    metrics: ServingMetrics
    requests: tuple[RequestRecord, ...] = field(repr=False)
    steps: tuple[StepRecord, ...] = field(repr=False)
    transfers: tuple[TransferRecord, ...] = field(repr=False)
    preemptions: int
    peak_kv_usage: float
    floors: FloorSummary
    settings: ServingSettings
    prefix_cache_hit_rate: float | None = None

    def steps_frame(self):
        """The step records as a pandas DataFrame (one row per step)."""
        import pandas as pd
        return pd.DataFrame(list(self.steps), columns=list(StepRecord._fields))

    def requests_frame(self):
        """One row per request: id, replica, arrival, prompt and output tokens, first and
        last token times, TTFT, TPOT (NaN for one output token) and E2EL, seconds."""
        import pandas as pd
        return pd.DataFrame([{
            "request_id": r.request_id, "replica": r.replica, "arrival_s": r.arrival_s,
            "prompt_len": r.prompt_len, "output_len": r.output_len,
            "first_token_s": r.first_token_s, "finish_s": r.finish_s, "ttft_s": r.ttft_s,
            "tpot_s": math.nan if r.tpot_s is None else r.tpot_s, "e2el_s": r.e2el_s}
            for r in self.requests])


@dataclass(frozen=True)
class ReplicaPool:
    """A pool of ``replicas`` identical engine instances of ``gpus_per_replica`` GPUs, each
    with ``num_blocks`` KV blocks, priced by ``pricer``; ``engine`` and its ``settings``
    (block_size, max_num_batched_tokens, max_num_seqs, …; see :mod:`serving.scheduler`)."""

    pricer: Any
    num_blocks: int
    replicas: int = 1
    gpus_per_replica: int = 1
    engine: str = "vllm-v1"
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not callable(getattr(self.pricer, "step_time", None)):
            raise TypeError("ReplicaPool: pricer must have a step_time(step) method returning "
                            f"an object with total_s, got {self.pricer!r}")
        for name, low in (("num_blocks", 2), ("replicas", 1), ("gpus_per_replica", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, value, f"an integer >= {low}", "not a count",
                                  owner="ReplicaPool")
        try:
            object.__setattr__(self, "engine", Engine(self.engine).value)
        except ValueError:
            raise ConfigError("engine", self.engine, ", ".join(Engine.values()),
                              "no such serving engine", owner="ReplicaPool") from None
        object.__setattr__(self, "settings", dict(self.settings))
        make_scheduler(self.engine, self.num_blocks, **self.settings)  # its settings' errors

    def describe(self, name: str) -> PoolSettings:
        return PoolSettings(name, self.engine, self.num_blocks, self.replicas,
                            self.gpus_per_replica, tuple(sorted(self.settings.items())))


# --- the engine loop --------------------------------------------------------------------

class _Replica:
    """One engine instance: its scheduler, inbox, load and step log (columns); each token
    it emits is stamped in the run's token log, each request it finishes is handed to
    ``on_finish(replica, request id, now)``."""

    def __init__(self, sim: "_Simulation", pool: str, index: int, pool_cfg: ReplicaPool,
                 on_finish):
        self.sim, self.env, self.pool, self.index = sim, sim.env, pool, index
        self.scheduler = make_scheduler(pool_cfg.engine, pool_cfg.num_blocks,
                                        **pool_cfg.settings)
        self.pricer = pool_cfg.pricer
        self.on_finish = on_finish
        self.inbox: list = []
        self.load = 0          # routed here and not finished (the router's measure)
        self._wake: Event | None = None
        # vLLM v1 keeps pp batches in flight (its batch queue); the static engine one
        self.depth = getattr(self.pricer, "pp", 1) if Engine(pool_cfg.engine) is \
            Engine.VLLM_V1 else 1
        if self.depth > 1:
            self.flight: list = []         # submitted steps, oldest first
            self._landed: Event | None = None
            self.env.process(self.sim.guarded(self._run_pipelined()))
            self.env.process(self.sim.guarded(self._drain()))
        else:
            self.env.process(self.sim.guarded(self._run()))

    def assign(self) -> None:
        """A request is on its way here (counted in the load from now)."""
        self.load += 1

    def deliver(self, request: Request, external: int = 0) -> None:
        """``request`` reaches the engine (joins its next step)."""
        self.inbox.append((request, external))
        self._rouse()

    def _rouse(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _take_inbox(self) -> None:
        for request, external in self.inbox:
            self.scheduler.add(request, external)
        self.inbox.clear()

    def _stuck(self) -> RuntimeError:
        sched = self.scheduler
        return RuntimeError(
            f"{self.pool or 'replica'} {self.index}: the scheduler holds {sched.num_waiting} "
            f"waiting and {sched.num_running} running requests but formed an empty step at "
            f"t={self.env.now} s")

    def _priced(self, step) -> tuple:
        priced = self.pricer.step_time(step)
        duration = priced.total_s
        if not (isinstance(duration, (int, float)) and math.isfinite(duration)
                and duration > 0):
            raise ValueError(f"pricer {self.pricer!r}: step {step.index} of "
                             f"{self.pool or 'replica'} {self.index} got total_s={duration!r}; "
                             "a step must take a finite time > 0 s")
        return priced, duration

    def _record(self, step, start, now, usage, priced) -> None:
        outcome = self.scheduler.finish_step(step)
        self.sim.step_log.append((
            self.pool, self.index, step.index, start, now, step.prefill_tokens,
            step.decode_seqs, step.num_scheduled_tokens, len(step.scheduled), usage,
            len(step.preempted), getattr(priced, "floor_s", None)))
        tokens = self.sim.tokens
        for rid in outcome.emitted:
            tokens[rid].append(now)
        for rid in outcome.finished:
            self.load -= 1
            self.on_finish(self, rid, now)

    def _timeline(self, priced, duration: float, stage_free: list) -> float:
        """Pass a step through the pipeline (module docstring): its CPU overhead, then
        each stage when the step has left the one before and the stage is free, the send
        between stages; returns when it leaves the last. Stage times are scaled so that
        one step alone takes ``total_s`` (a binding floor included)."""
        stages = tuple(getattr(priced, "stage_s", ()) or ())
        sends = tuple(getattr(priced, "pp_send_s", ()) or ())
        overhead = getattr(priced, "overhead_s", 0.0)
        if len(stages) != self.depth:
            stages, sends, overhead = (duration / self.depth,) * self.depth, (), 0.0
        alone = sum(stages) + sum(sends) + overhead
        scale = duration / alone if alone > 0 else 1.0
        t = self.env.now + overhead * scale
        for k, busy in enumerate(stages):
            begin = max(t, stage_free[k])
            stage_free[k] = begin + busy * scale
            t = stage_free[k] + (sends[k] * scale if k < len(sends) else 0.0)
        return stage_free[-1]

    def _run_pipelined(self):
        """The engine loop with up to ``depth`` steps in flight (vLLM v1's batch queue):
        a step is formed when fewer than depth are in flight and the first stage is free;
        the scheduler leaves out the tokens of steps in flight."""
        env, sched = self.env, self.scheduler
        stage_free = [env.now] * self.depth
        while True:
            if env.peek() <= env.now:
                yield _At(env, 0, _SCHEDULE)
            self._take_inbox()
            if len(self.flight) < self.depth and env.now >= stage_free[0]:
                step = sched.schedule()
                if not step.is_empty:
                    priced, duration = self._priced(step)
                    end = self._timeline(priced, duration, stage_free)
                    self.flight.append((step, env.now, end, sched.pool.usage, priced))
                    if self._landed is not None and not self._landed.triggered:
                        self._landed.succeed()
                    continue
                if not self.flight and sched.has_unfinished:
                    raise self._stuck()
            self._wake = env.event()
            waits = [self._wake]
            if len(self.flight) < self.depth and env.now < stage_free[0]:
                waits.append(_At(env, stage_free[0] - env.now, _SCHEDULE))
            yield env.any_of(waits)
            self._wake = None

    def _drain(self):
        """Finishes the steps in flight in order, each when it leaves the last stage."""
        env = self.env
        while True:
            if not self.flight:
                self._landed = env.event()
                yield self._landed
                self._landed = None
            step, start, end, usage, priced = self.flight[0]
            yield _At(env, max(end - env.now, 0.0), _STEP_END)
            self.flight.pop(0)
            self._record(step, start, env.now, usage, priced)
            self._rouse()

    def _run(self):
        """The engine loop with one step at a time."""
        env, sched = self.env, self.scheduler
        while True:
            if env.peek() <= env.now:               # more events at this instant: let the
                yield _At(env, 0, _SCHEDULE)        # arrivals in first (else: none can come)
            self._take_inbox()
            step = sched.schedule()
            if step.is_empty:
                if sched.has_unfinished:
                    raise self._stuck()
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            priced, duration = self._priced(step)
            start, usage = env.now, sched.pool.usage
            yield _At(env, duration, _STEP_END)
            self._record(step, start, env.now, usage, priced)


class _Simulation:
    """One run's state: the environment, the client, the token log."""

    def __init__(self, requests: tuple[Request, ...], concurrency: int | None):
        self.env = simpy.Environment()
        self.requests = requests
        self.by_id = {r.request_id: r for r in requests}
        self.concurrency = concurrency
        self.outstanding = 0
        self._slot: Event | None = None
        self.sent_at: dict = {}                       # request id -> send time
        self.tokens: dict = {r.request_id: [] for r in requests}
        self.served_by: dict = {}                     # request id -> replica index
        self.done: set = set()
        self.step_log: list = []
        self.transfers: list = []
        self.dispatch = None                          # request -> None, set by the mode
        self.failure: Exception | None = None

    def guarded(self, process):
        """``process`` with its first error kept as ``self.failure`` (re-raised by
        :meth:`run`)."""
        try:
            yield from process
        except Exception as exc:
            self.failure = exc
            raise _Abort() from None

    # the client ----------------------------------------------------------------------
    def client(self):
        env, limit = self.env, self.concurrency
        for req in sorted(self.requests, key=lambda r: (r.arrival_s, r.request_id)):
            if req.arrival_s > env.now:
                yield _At(env, req.arrival_s - env.now, _ARRIVAL)
            while limit is not None and self.outstanding >= limit:
                self._slot = env.event()
                yield self._slot
                self._slot = None
            self.outstanding += 1
            # the send time: the arrival, or the moment a concurrency slot freed
            sent = req.arrival_s if env.now <= req.arrival_s else env.now
            self.sent_at[req.request_id] = sent
            self.dispatch(req)

    def complete(self, rid) -> None:
        self.done.add(rid)
        self.outstanding -= 1
        if self._slot is not None and not self._slot.triggered:
            self._slot.succeed()

    def run(self) -> None:
        self.env.process(self.guarded(self.client()))
        try:
            self.env.run()
        except _Abort:
            raise self.failure from None
        missing = [r.request_id for r in self.requests if r.request_id not in self.done]
        if missing:
            raise RuntimeError(f"the simulation ended with {len(missing)} unfinished "
                               f"requests (first: {missing[:5]})")

    # results -------------------------------------------------------------------------
    def result(self, settings: ServingSettings, percentiles, engines=()) -> ServingResult:
        records = tuple(RequestRecord(r.request_id, self.sent_at[r.request_id], r.prompt_len,
                                      tuple(self.tokens[r.request_id]),
                                      self.served_by.get(r.request_id, 0))
                        for r in sorted(self.requests, key=lambda r: r.request_id))
        steps = tuple(StepRecord(*row) for row in self.step_log)
        usage = [s.kv_usage for s in steps]
        metrics = compute_metrics(records, percentiles=percentiles, num_gpus=settings.num_gpus,
                                  kv_usage=usage, kv_weights_s=[s.duration_s for s in steps])
        caches = [e.scheduler.pool for e in engines if e.scheduler.pool.enable_caching]
        queried = sum(c.queried_blocks for c in caches)
        hit_rate = (sum(c.hit_blocks for c in caches) / queried if queried else 0.0
                    ) if caches else None
        return ServingResult(metrics, records, steps, tuple(self.transfers),
                             preemptions=sum(s.preempted for s in steps),
                             peak_kv_usage=max(usage, default=0.0), floors=_floors(steps),
                             settings=settings, prefix_cache_hit_rate=hit_rate)


def _floors(steps) -> FloorSummary:
    floors = [s.floor_s for s in steps]
    known = bool(steps) and all(f is not None for f in floors)
    decode = [s for s in steps if s.prefill_tokens == 0]
    return FloorSummary(
        steps=len(steps), busy_s=sum(s.duration_s for s in steps),
        floor_s=sum(floors) if known else None, decode_steps=len(decode),
        decode_busy_s=sum(s.duration_s for s in decode),
        decode_floor_s=sum(s.floor_s for s in decode) if known else None)


# --- inputs -------------------------------------------------------------------------------

def _requests_of(source, seed) -> tuple[tuple[Request, ...], int | None, str]:
    """(requests, the workload's concurrency limit, a description) of ``source``."""
    if isinstance(source, (Workload, TraceWorkload)):
        return source.requests(seed), source.concurrency, repr(source)
    if isinstance(source, Request):
        source = (source,)
    if isinstance(source, (str, bytes)) or not isinstance(source, Sequence) or not source:
        raise ConfigError("requests_or_workload", type(source).__name__,
                          "a Workload, a TraceWorkload or a non-empty sequence of "
                          "serving.Request", "nothing to serve")
    bad = [r for r in source if not isinstance(r, Request)]
    if bad:
        raise ConfigError("requests_or_workload", type(bad[0]).__name__, "serving.Request items",
                          "not a request")
    ids = [r.request_id for r in source]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError("request_id", dup, "unique ids", "two requests share an id")
    return tuple(source), None, f"{len(source)} requests"


def _limit(workload_limit, concurrency):
    if concurrency is None:
        return workload_limit
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError("concurrency", concurrency, "an integer >= 1 or None",
                          "not a concurrency limit")
    return concurrency


# --- the two entry points -------------------------------------------------------------------

def simulate_serving(requests_or_workload, *, pricer, num_blocks: int,
                     engine: Engine | str = "vllm-v1", replicas: int = 1,
                     router: Router | str = "round_robin", gpus_per_replica: int = 1,
                     seed: int | None = None, concurrency: int | None = None,
                     percentiles=DEFAULT_PERCENTILES, **engine_settings) -> ServingResult:
    """Serve ``requests_or_workload`` (a :class:`~.workload.Workload`, a
    :class:`~.workload.TraceWorkload` or a sequence of ``serving.Request``) on ``replicas``
    identical engines of ``gpus_per_replica`` GPUs behind ``router``; each engine imitates
    ``engine`` (``vllm-v1`` or ``static``, :func:`serving.make_scheduler` with
    ``num_blocks`` and ``engine_settings``: block_size, max_num_batched_tokens,
    max_num_seqs, max_model_len, …) and ``pricer.step_time(step).total_s`` prices its steps.
    ``concurrency`` overrides the workload's limit; ``seed`` its seed. Module docstring for
    the model."""
    pool = ReplicaPool(pricer, num_blocks, replicas, gpus_per_replica, engine, engine_settings)
    requests, limit, described = _requests_of(requests_or_workload, seed)
    limit = _limit(limit, concurrency)
    route = make_router(router, replicas)
    sim = _Simulation(requests, limit)

    def finished(replica, rid, now):
        sim.complete(rid)

    engines = [_Replica(sim, "", i, pool, finished) for i in range(replicas)]
    loads = [0] * replicas

    def dispatch(req: Request) -> None:
        for i, e in enumerate(engines):
            loads[i] = e.load
        i = route.choose(loads)
        sim.served_by[req.request_id] = i
        engines[i].assign()
        engines[i].deliver(req)

    sim.dispatch = dispatch
    sim.run()
    settings = ServingSettings((pool.describe(""),), str(Router(router)), limit, seed,
                               described, len(requests))
    return sim.result(settings, percentiles, engines)


def simulate_disaggregated(requests_or_workload, *, prefill: ReplicaPool, decode: ReplicaPool,
                           kv_transfer: KVTransferPricer,
                           router: Router | str = "round_robin", seed: int | None = None,
                           concurrency: int | None = None,
                           percentiles=DEFAULT_PERCENTILES) -> ServingResult:
    """Serve with a ``prefill`` pool and a ``decode`` pool (module docstring,
    "Disaggregated prefill/decode"): ``router`` picks the prefill replica at arrival and
    the decode replica at the prefill's end; ``kv_transfer.time_s(prompt_len, src, dst)``
    prices the move. Request records name the decode replica (the prefill replica for a
    request of one output token); step records carry their pool's name."""
    for name, pool in (("prefill", prefill), ("decode", decode)):
        if not isinstance(pool, ReplicaPool):
            raise TypeError(f"simulate_disaggregated: {name} must be a ReplicaPool, got "
                            f"{type(pool).__name__}")
    if not callable(getattr(kv_transfer, "time_s", None)):
        raise TypeError("simulate_disaggregated: kv_transfer must have time_s(prompt_len, src, "
                        f"dst), got {kv_transfer!r}")
    requests, limit, described = _requests_of(requests_or_workload, seed)
    limit = _limit(limit, concurrency)
    route_p = make_router(router, prefill.replicas)
    route_d = make_router(router, decode.replicas)
    sim = _Simulation(requests, limit)
    env = sim.env
    src_free = [0.0] * prefill.replicas
    dst_free = [0.0] * decode.replicas

    def decoded(replica, rid, now):
        sim.complete(rid)

    decoders = [_Replica(sim, "decode", j, decode, decoded)
                for j in range(decode.replicas)]

    def prefilled(replica, rid, now):
        req = sim.by_id[rid]
        if req.output_len == 1:
            sim.complete(rid)
            return
        j = route_d.choose([d.load for d in decoders])
        sim.served_by[rid] = j
        decoders[j].assign()
        start = max(now, src_free[replica.index], dst_free[j])
        moved = kv_transfer.time_s(req.prompt_len, replica.index, j)
        if not (isinstance(moved, (int, float)) and math.isfinite(moved) and moved >= 0):
            raise ValueError(f"kv_transfer {kv_transfer!r} priced request {rid!r} at "
                             f"{moved!r} s; allowed: a finite number >= 0")
        end = start + moved
        src_free[replica.index] = dst_free[j] = end
        sim.transfers.append(TransferRecord(rid, replica.index, j, now, start, end,
                                            req.prompt_len))
        rest = Request(rid, req.prompt_len + 1, req.output_len - 1, arrival_s=req.arrival_s)
        arrived = _At(env, end - now, _ARRIVAL)
        arrived.callbacks.append(lambda _ev: decoders[j].deliver(rest, req.prompt_len))

    prefillers = [_Replica(sim, "prefill", i, prefill, prefilled)
                  for i in range(prefill.replicas)]

    def dispatch(req: Request) -> None:
        i = route_p.choose([p.load for p in prefillers])
        sim.served_by[req.request_id] = i
        prefillers[i].assign()
        prefillers[i].deliver(Request(req.request_id, req.prompt_len, 1,
                                      arrival_s=req.arrival_s))

    sim.dispatch = dispatch
    sim.run()
    settings = ServingSettings((prefill.describe("prefill"), decode.describe("decode")),
                               str(Router(router)), limit, seed, described, len(requests))
    return sim.result(settings, percentiles, [*prefillers, *decoders])

