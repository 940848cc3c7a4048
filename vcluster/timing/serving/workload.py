"""Serving workloads: who asks for how many tokens, and when — as ``vllm bench serve`` sends them.

A :class:`Workload` is a frozen description that produces a tuple of
:class:`serving.Request` (deterministic from its seed, numpy ``Generator``); a
:class:`TraceWorkload` reads them from a CSV file. The simulator
(:func:`vcluster.timing.serving.simulator.simulate_serving`) takes either, or a plain
sequence of requests.

Lengths (vLLM ``RandomDataset.get_sampling_params``, vllm/benchmarks/datasets.py): with
``range_ratio`` r, a request's prompt length is drawn uniformly from the integers
``[⌊L_in(1−r)⌋, ⌈L_in(1+r)⌉]`` and its output length from
``[max(1, ⌊L_out(1−r)⌋), ⌈L_out(1+r)⌉]``, r ∈ [0, 1); r = 0 gives every request exactly
``input_len`` and ``output_len`` (vLLM also subtracts the tokenizer's special tokens from the
prompt; there is no tokenizer here). The prompt's lower end is clamped to 1.

Arrivals (vLLM ``get_request``, vllm/benchmarks/serve.py), the benchmark starting at t = 0:

* ``rate = inf``: every request at t = 0.
* ``rate`` λ finite, ``burstiness`` k: N i.i.d. intervals Δᵢ ~ Gamma(shape k, scale 1/(λk))
  (mean 1/λ, coefficient of variation 1/√k; k = 1 is the exponential of a Poisson process;
  k = inf the constant 1/λ). Request i is sent at tᵢ = Σ_{j≤i} Δⱼ — the first one too waits
  its interval — and vLLM then rescales every tᵢ by (N/λ)/t_N so that the last request is
  sent at exactly N/λ (``rescale=True``, its behaviour without a ramp-up; it "closes the 1–2 %
  gap" between random sums and the target duration). Rescaling changes no CV.
* ``concurrency`` C (closed loop, ``--max-concurrency`` C): the client keeps at most C
  requests outstanding; a request is sent at the later of its arrival time above and the
  moment a slot frees (a response completes). With ``rate = inf`` this is the usual closed
  loop: C requests at t = 0, a new one whenever one finishes. The arrival times are then
  not a list but the simulation's outcome, so ``requests()`` returns the *earliest* send
  times and the simulator applies the limit.

The two random streams (lengths; intervals) come from ``numpy.random.SeedSequence(seed)
.spawn(2)``, so changing the rate leaves the lengths unchanged.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modeling.errors import ConfigError
from serving import Request

__all__ = ["Workload", "TraceWorkload", "arrival_times_s", "sample_lengths", "read_trace",
           "TRACE_COLUMNS"]

#: The columns a CSV trace must have (extra columns are ignored).
TRACE_COLUMNS: tuple[str, ...] = ("arrival_s", "input_len", "output_len")


def _int_at_least(owner: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(name, value, f"an integer >= {low}", "not a count", owner=owner)
    return int(value)


def _positive(owner: str, name: str, value, *, inf_ok: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value <= 0 or (value == math.inf and not inf_ok):
        allowed = "a number > 0 (inf allowed)" if inf_ok else "a finite number > 0"
        raise ConfigError(name, value, allowed, "not a rate", owner=owner)
    return float(value)


def sample_lengths(rng: np.random.Generator, num_requests: int, input_len: int,
                   output_len: int, range_ratio: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_lens, output_lens)``, uniform integers in vLLM's random-dataset ranges
    (module docstring)."""
    in_low = max(1, math.floor(input_len * (1 - range_ratio)))
    in_high = math.ceil(input_len * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    prompt = rng.integers(in_low, in_high + 1, size=num_requests)
    output = rng.integers(out_low, out_high + 1, size=num_requests)
    return prompt, output


def arrival_times_s(rng: np.random.Generator, num_requests: int, rate: float,
                    burstiness: float = 1.0, rescale: bool = True) -> np.ndarray:
    """Send times (s) of ``num_requests`` requests at ``rate`` req/s with gamma intervals of
    shape ``burstiness`` (module docstring): the cumulative sums of the intervals, rescaled
    so the last one is N/rate when ``rescale``."""
    if rate == math.inf:
        return np.zeros(num_requests)
    if burstiness == math.inf:
        intervals = np.full(num_requests, 1.0 / rate)
    else:
        intervals = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness),
                              size=num_requests)
    times = np.cumsum(intervals)
    if rescale and times[-1] > 0:
        times *= (num_requests / rate) / times[-1]
    return times


@dataclass(frozen=True)
class Workload:
    """``num_requests`` requests of ``input_len`` prompt and ``output_len`` output tokens
    (± ``range_ratio``), sent at ``rate`` req/s (inf: all at once) with gamma
    ``burstiness``, at most ``concurrency`` outstanding (None: no limit); ``seed`` fixes
    the draws. ``rescale``: vLLM's stretch of the send times to end at N/rate.
    ``prefix_len``: every prompt starts with the same ``prefix_len`` tokens (prefix id 0)
    before its own ``input_len`` — ``vllm bench serve --random-prefix-len``, whose prompts
    are prefix + random tokens, ``prefix_len + input_len`` long."""

    num_requests: int
    input_len: int
    output_len: int
    rate: float = math.inf          # req/s (vllm bench serve --request-rate)
    burstiness: float = 1.0         # gamma shape (--burstiness); 1 = Poisson
    concurrency: int | None = None  # outstanding-request limit (--max-concurrency)
    range_ratio: float = 0.0        # length spread (--random-range-ratio), in [0, 1)
    seed: int = 0
    rescale: bool = True
    prefix_len: int = 0             # shared prefix tokens (--random-prefix-len)

    def __post_init__(self):
        owner = "Workload"
        _int_at_least(owner, "prefix_len", self.prefix_len, 0)
        _int_at_least(owner, "num_requests", self.num_requests, 1)
        _int_at_least(owner, "input_len", self.input_len, 1)
        _int_at_least(owner, "output_len", self.output_len, 1)
        object.__setattr__(self, "rate", _positive(owner, "rate", self.rate, inf_ok=True))
        object.__setattr__(self, "burstiness",
                           _positive(owner, "burstiness", self.burstiness, inf_ok=True))
        if self.concurrency is not None:
            _int_at_least(owner, "concurrency", self.concurrency, 1)
        r = self.range_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ConfigError("range_ratio", r, "a number in [0, 1)",
                              "vLLM's --random-range-ratio", owner=owner)
        _int_at_least(owner, "seed", self.seed, 0)

    @property
    def closed_loop(self) -> bool:
        """True when a concurrency limit holds requests back (the simulator's client)."""
        return self.concurrency is not None

    def requests(self, seed: int | None = None) -> tuple[Request, ...]:
        """The requests, ids 0..N−1 in send order; ``arrival_s`` is the earliest send time
        (the actual one under a concurrency limit is the simulator's). ``seed`` overrides
        the workload's own."""
        seed = self.seed if seed is None else _int_at_least("Workload", "seed", seed, 0)
        length_rng, arrival_rng = (np.random.default_rng(s)
                                   for s in np.random.SeedSequence(seed).spawn(2))
        prompt, output = sample_lengths(length_rng, self.num_requests, self.input_len,
                                        self.output_len, self.range_ratio)
        times = arrival_times_s(arrival_rng, self.num_requests, self.rate, self.burstiness,
                                self.rescale)
        shared = self.prefix_len
        return tuple(Request(i, shared + int(p), int(o), arrival_s=float(t),
                             prefix_id=0 if shared else None, prefix_len=shared)
                     for i, (p, o, t) in enumerate(zip(prompt, output, times)))


@dataclass(frozen=True)
class TraceWorkload:
    """Requests read from the CSV file ``path`` (header ``arrival_s,input_len,output_len``,
    extra columns ignored; request ids are the data rows' order, 0-based), at most
    ``concurrency`` outstanding (None: no limit)."""

    path: str
    concurrency: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "path", str(self.path))
        if self.concurrency is not None:
            _int_at_least("TraceWorkload", "concurrency", self.concurrency, 1)

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    def requests(self, seed: int | None = None) -> tuple[Request, ...]:
        """The trace's requests (``seed`` is accepted for symmetry and unused)."""
        return read_trace(self.path)


def read_trace(path) -> tuple[Request, ...]:
    """Parse a CSV trace of ``arrival_s,input_len,output_len`` rows (seconds from the
    benchmark start; arrival order need not be sorted). Optional columns: ``prefix_len``
    — how many of the prompt's ``input_len`` tokens are a shared prefix — and
    ``prefix_id`` — whose (default 0): :attr:`serving.Request.shared_prefix`. Errors name
    the file, the line and the column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("path", str(path), "a readable CSV file",
                          f"cannot read it ({exc.strerror or exc})", owner="trace") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None:
        raise ConfigError("header", "", ",".join(TRACE_COLUMNS), "the file is empty",
                          owner=f"{path} line 1")
    names = [h.strip() for h in header]
    missing = [c for c in TRACE_COLUMNS if c not in names]
    if missing:
        raise ConfigError("header", ",".join(names),
                          f"columns {', '.join(TRACE_COLUMNS)} (extra columns allowed)",
                          f"missing column {missing[0]!r}", owner=f"{path} line 1")
    where = {c: names.index(c) for c in TRACE_COLUMNS}
    out = []
    for row in reader:
        line = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(names):
            raise ConfigError("row", ",".join(row), f"{len(names)} cells like the header",
                              f"it has {len(row)}", owner=f"{path} line {line}")
        cells = {c: row[where[c]].strip() for c in TRACE_COLUMNS}
        try:
            arrival = float(cells["arrival_s"])
        except ValueError:
            arrival = math.nan
        if not (math.isfinite(arrival) and arrival >= 0):
            raise ConfigError("arrival_s", cells["arrival_s"], "a finite number >= 0",
                              "not a time in seconds", owner=f"{path} line {line}")
        lens = {}
        for col in ("input_len", "output_len"):
            try:
                lens[col] = int(cells[col])
            except ValueError:
                lens[col] = 0
            if lens[col] < 1:
                raise ConfigError(col, cells[col], "an integer >= 1", "not a token count",
                                  owner=f"{path} line {line}")
        prefix_len, prefix_id = 0, None
        if "prefix_len" in names:
            text_len = row[names.index("prefix_len")].strip() or "0"
            prefix_len = int(text_len) if text_len.isdigit() else -1
            if not 0 <= prefix_len <= lens["input_len"]:
                raise ConfigError("prefix_len", text_len, f"an integer from 0 to input_len="
                                  f"{lens['input_len']}", "not a prefix of the prompt",
                                  owner=f"{path} line {line}")
        if prefix_len:
            text_id = row[names.index("prefix_id")].strip() if "prefix_id" in names else "0"
            try:
                prefix_id = int(text_id or "0")
            except ValueError:
                raise ConfigError("prefix_id", text_id, "an integer", "not a prefix id",
                                  owner=f"{path} line {line}") from None
        out.append(Request(len(out), lens["input_len"], lens["output_len"], arrival_s=arrival,
                           prefix_id=prefix_id, prefix_len=prefix_len))
    if not out:
        raise ConfigError("rows", 0, "at least one request", "the trace has no data rows",
                          owner=str(path))
    return tuple(out)
