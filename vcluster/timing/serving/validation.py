"""Published LLM-serving measurements, and the check of the serving simulator against them.

``data/serving_measured.csv`` holds one row per published measurement (vLLM's own CI, vLLM
issues, gpustack's performance lab, NVIDIA NIM, TensorRT-LLM's perf overview; sources and
roles in ``docs/serving_validation.md``), each number exactly as published, with its URL and
the table or section it came from. :func:`serving_rows` parses it strictly into frozen
:class:`ServingRow` values; :func:`refusal` says why the simulator cannot run a row as
published (engine, hardware, model, lengths, dtype), computed here and never by deleting
data; :func:`validate_serving` runs a ``simulate_row`` callable over the other rows, and
:func:`simulate_row_default` is that callable wired to the serving simulator as
``vcluster simulate serve`` runs it.

Errors. For a published metric m (vLLM ``bench serve`` keys: ``mean_ttft_ms``,
``mean_tpot_ms``, ``output_throughput``, ...) and a prediction p::

    rel_error(m) = p / m - 1          (signed: > 0 means the simulator predicts more)

Each row has one error per *family* — TTFT, TPOT, throughput and batch latency — taken on
the family's first published key (``FAMILY_KEYS``: e.g. TTFT is ``mean_ttft_ms`` when
published, else ``median_ttft_ms``). For each table and role (``fit`` / ``held_out``), and for
all tables together (table ``"*"``), the report gives the mean of |rel_error| per family over
the rows that were simulated and whose family metric was both published and predicted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from modeling.errors import ConfigError
from modeling.presets import preset_names

from ..presets import PRESET_NAMES, preset, read_data_csv

__all__ = [
    "ALL_TABLES",
    "COLUMNS",
    "FAMILY_KEYS",
    "FIXED_LENGTH_DATASETS",
    "LENGTH_TOLERANCE",
    "METRIC_KEYS",
    "MODELLED_DTYPES",
    "MODELLED_ENGINES",
    "SERVING_CSV",
    "VLLM_DEFAULT_LIMITS",
    "FamilyError",
    "GroupSummary",
    "LoadKind",
    "MetricError",
    "Role",
    "RowResult",
    "ServingRow",
    "ValidationReport",
    "format_report",
    "refusal",
    "rows_from_records",
    "serving_rows",
    "simulate_row_default",
    "validate_serving",
    "vllm_default_limits",
]

SERVING_CSV = "serving_measured.csv"

#: Published metrics, in the units of ``vllm bench serve``'s result keys (ms, tokens/s,
#: requests/s), plus ``mean_batch_latency_ms``: the mean wall time of one offline
#: ``generate()`` over a whole batch (``vllm bench latency``).
METRIC_KEYS: tuple[str, ...] = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "mean_itl_ms", "output_throughput", "total_token_throughput", "request_throughput",
    "mean_batch_latency_ms")

#: Family -> its keys in order of preference: a row's family error is taken on the first
#: key the row publishes.
FAMILY_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "ttft": ("mean_ttft_ms", "median_ttft_ms"),
    "tpot": ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms"),
    "throughput": ("output_throughput", "total_token_throughput", "request_throughput"),
    "latency": ("mean_batch_latency_ms",),
})

COLUMNS: tuple[str, ...] = (
    "source", "url", "table", "model", "hardware", "gpus", "tp", "pp", "ep", "engine",
    "engine_version", "input_len", "output_len", "dataset", "load_kind", "load", "num_prompts",
    "max_num_seqs", "max_num_batched_tokens", "dtype", *METRIC_KEYS, "total_input_tokens",
    "total_output_tokens", "role", "notes")

#: Datasets whose requests all have the stated lengths: ``fixed`` (synthetic prompts of
#: exactly ``input_len`` tokens, ``output_len`` forced, e.g. ``--ignore-eos`` or an offline
#: ``max_tokens``) and ``random`` (vLLM's random dataset at range ratio 0: nominal lengths,
#: checked against the published token totals, see ``LENGTH_TOLERANCE``).
FIXED_LENGTH_DATASETS: tuple[str, ...] = ("fixed", "random")

#: Engines the simulator imitates. It implements vLLM's V1 scheduler
#: (``serving.scheduler``); other engines' schedulers (TensorRT-LLM's in-flight batcher,
#: SGLang's, NIM's choice of backend) differ in token budget, chunking and CUDA graphs,
#: and those are most of a serving simulator's error (docs/serving_validation.md).
MODELLED_ENGINES: tuple[str, ...] = ("vllm",)

#: The first vLLM release whose default engine is V1 (vLLM 0.8.0's release notes: "V1 is
#: now enabled by default"). Earlier releases ran the V0 engine unless ``VLLM_USE_V1=1``:
#: another scheduler, and its per-sequence Python work (sequence groups, sampler output,
#: detokenization) in the step's critical path, which the V1 imitation does not have.
FIRST_V1_DEFAULT: tuple[int, int] = (0, 8)


def _release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a published vLLM version ("0.7.2", "v0.11.0rc1"); None when the
    row names none or not as numbers."""
    parts = (version or "").lstrip("v").split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])

#: Weight dtypes the step-cost model prices; ``fp8`` also needs an FP8 peak in the
#: hardware preset (Hopper; the A100 has no FP8 tensor cores).
MODELLED_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp8")
_KNOWN_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp8", "fp4", "mxfp4", "int8", "int4")

#: Largest relative gap between a ``random`` row's mean published length (total tokens /
#: num_prompts) and its nominal length that still counts as fixed-length. vLLM's random
#: dataset decodes random token ids to text and the server re-tokenizes it: the prompts in
#: this file drift by at most 0.3 % (1 997 942 vs 2 000 000 tokens); outputs without
#: ``--ignore-eos`` stop early at EOS by up to 23 % (7 681 of 10 000). 2 % separates the two
#: with margin, and a 2 % length change moves decode-bound TPOT and throughput by about as
#: much, inside run-to-run noise.
LENGTH_TOLERANCE = 0.02

#: The pseudo-table of the report's all-tables summaries.
ALL_TABLES = "*"


class LoadKind(str, Enum):
    """How the load was offered. ``load`` is the concurrency C (closed loop, ``vllm bench
    serve --max-concurrency``), the Poisson rate in requests/s, or the batch size of one
    offline generate(); ``max_throughput`` sends every prompt at t = 0 (``load`` blank)."""

    CONCURRENCY = "concurrency"
    RATE = "rate"
    BATCH = "batch"
    MAX_THROUGHPUT = "max_throughput"


class Role(str, Enum):
    """``fit``: rows a calibration may look at; ``held_out``: rows only ever predicted."""

    FIT = "fit"
    HELD_OUT = "held_out"


@dataclass(frozen=True)
class ServingRow:
    """One published serving measurement (a row of ``serving_measured.csv``).

    ``input_len``/``output_len`` are tokens per request (0: the dataset's own lengths);
    ``gpus`` = ``tp`` x ``pp`` of one engine instance; ``ep`` is vLLM's expert-parallel size
    (1 without ``--enable-expert-parallel``). Metrics are ``None`` where not published.
    ``row`` is the 1-based data row in the file (header and comments excluded).
    """

    source: str
    url: str
    table: str
    model: str
    hardware: str
    gpus: int
    tp: int
    pp: int
    ep: int
    engine: str
    engine_version: str
    input_len: int
    output_len: int
    dataset: str
    load_kind: LoadKind
    load: float | None
    num_prompts: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    dtype: str
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    mean_itl_ms: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    request_throughput: float | None
    mean_batch_latency_ms: float | None
    total_input_tokens: int | None
    total_output_tokens: int | None
    role: Role
    notes: str
    row: int = 0

    def published(self) -> dict[str, float]:
        """The published metrics, ``{key: value}`` in ``METRIC_KEYS`` order."""
        return {k: getattr(self, k) for k in METRIC_KEYS if getattr(self, k) is not None}

    def __str__(self) -> str:
        load = "" if self.load is None else f"={self.load:g}"
        return (f"{self.table}#{self.row}: {self.model} on {self.hardware} tp{self.tp}"
                f"{f' pp{self.pp}' if self.pp > 1 else ''}{f' ep{self.ep}' if self.ep > 1 else ''}"
                f" {self.engine} {self.dataset} {self.input_len}/{self.output_len}"
                f" {self.load_kind.value}{load} {self.dtype} [{self.role.value}]")


# --- strict parsing ---------------------------------------------------------------------
def _cell(record: Mapping[str, str], column: str, owner: str) -> str:
    value = record.get(column)
    if value is None:
        raise ConfigError(column, None, "a value in every column of COLUMNS",
                          "the column is missing", owner=owner)
    return value.strip()


def _text(record, column, owner, *, required=True) -> str:
    value = _cell(record, column, owner)
    if required and not value:
        raise ConfigError(column, value, "a non-empty string", "a required cell is empty",
                          owner=owner)
    return value


def _int(record, column, owner, *, low: int, required=True) -> int | None:
    value = _cell(record, column, owner)
    if not value and not required:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(column, value, f"an integer >= {low}", "not an integer",
                          owner=owner) from None
    if number < low:
        raise ConfigError(column, number, f"an integer >= {low}", "out of range", owner=owner)
    return number


def _float(record, column, owner) -> float | None:
    value = _cell(record, column, owner)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(column, value, "a finite number > 0 or an empty cell",
                          "not a number", owner=owner) from None
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(column, value, "a finite number > 0 or an empty cell",
                          "a measurement must be positive", owner=owner)
    return number


def _choice(record, column, owner, choices):
    value = _cell(record, column, owner)
    if value not in choices:
        raise ConfigError(column, value, ", ".join(choices), "unknown value", owner=owner)
    return value


def _parse(record: Mapping[str, str], owner: str, row: int) -> ServingRow:
    if None in record:
        raise ConfigError("cells", record[None], f"{len(COLUMNS)} cells",
                          "more cells than the header has columns", owner=owner)
    unknown = sorted(set(record) - set(COLUMNS))
    if unknown:
        raise ConfigError(unknown[0], record[unknown[0]], ", ".join(COLUMNS),
                          "unknown column", owner=owner)
    url = _text(record, "url", owner)
    if not url.startswith("https://"):
        raise ConfigError("url", url, "an https:// address", "every row cites its source",
                          owner=owner)
    dataset = _text(record, "dataset", owner)
    low_len = 1 if dataset in FIXED_LENGTH_DATASETS else 0
    load_kind = LoadKind(_choice(record, "load_kind", owner, [k.value for k in LoadKind]))
    load = _float(record, "load", owner)
    if (load is None) != (load_kind is LoadKind.MAX_THROUGHPUT):
        raise ConfigError("load", record["load"],
                          "blank for max_throughput, a number > 0 otherwise",
                          f"load_kind is {load_kind.value}", owner=owner)
    if load_kind is LoadKind.BATCH and load != int(load):
        raise ConfigError("load", load, "a whole batch size", "batch of a fraction",
                          owner=owner)
    values = dict(
        source=_text(record, "source", owner), url=url, table=_text(record, "table", owner),
        model=_text(record, "model", owner), hardware=_text(record, "hardware", owner),
        gpus=_int(record, "gpus", owner, low=1), tp=_int(record, "tp", owner, low=1),
        pp=_int(record, "pp", owner, low=1), ep=_int(record, "ep", owner, low=1),
        engine=_text(record, "engine", owner),
        engine_version=_text(record, "engine_version", owner, required=False),
        input_len=_int(record, "input_len", owner, low=low_len),
        output_len=_int(record, "output_len", owner, low=low_len),
        dataset=dataset, load_kind=load_kind, load=load,
        num_prompts=_int(record, "num_prompts", owner, low=1, required=False),
        max_num_seqs=_int(record, "max_num_seqs", owner, low=1, required=False),
        max_num_batched_tokens=_int(record, "max_num_batched_tokens", owner, low=1,
                                    required=False),
        dtype=_choice(record, "dtype", owner, _KNOWN_DTYPES),
        **{k: _float(record, k, owner) for k in METRIC_KEYS},
        total_input_tokens=_int(record, "total_input_tokens", owner, low=1, required=False),
        total_output_tokens=_int(record, "total_output_tokens", owner, low=1, required=False),
        role=Role(_choice(record, "role", owner, [r.value for r in Role])),
        notes=_text(record, "notes", owner, required=False), row=row)
    if values["gpus"] != values["tp"] * values["pp"]:
        raise ConfigError("gpus", values["gpus"], f"tp x pp = {values['tp'] * values['pp']}",
                          "one engine instance's GPUs", owner=owner)
    if values["gpus"] % values["ep"]:
        raise ConfigError("ep", values["ep"], f"a divisor of gpus={values['gpus']}",
                          "experts are spread over the instance's GPUs", owner=owner)
    if not any(values[k] is not None for k in METRIC_KEYS):
        raise ConfigError("metrics", None, ", ".join(METRIC_KEYS),
                          "a row publishes at least one metric", owner=owner)
    return ServingRow(**values)


def rows_from_records(records: Iterable[Mapping[str, str]],
                      filename: str = SERVING_CSV) -> tuple[ServingRow, ...]:
    """Parse CSV records (dicts of column -> cell text) into rows. A bad cell raises
    :class:`ConfigError` naming ``filename``, the 1-based data row and the column."""
    return tuple(_parse(record, f"{filename} row {i}", i)
                 for i, record in enumerate(records, start=1))


def serving_rows(table: str = SERVING_CSV) -> tuple[ServingRow, ...]:
    """Every row of ``vcluster/timing/data/<table>``, parsed strictly."""
    _, records = read_data_csv(table)
    return rows_from_records(records, table)


# --- refusals ---------------------------------------------------------------------------
def _length_gap(total: int | None, count: int | None, nominal: int) -> float | None:
    if total is None or count is None:
        return None
    return total / count / nominal - 1


def refusal(row: ServingRow) -> str | None:
    """Why the simulator cannot run ``row`` as published (reasons joined by ``"; "``,
    each starting with its kind: ``engine``, ``unsupported_hardware``, ``model``,
    ``dataset``, ``lengths``, ``num_prompts``, ``dtype``), or ``None`` when it can."""
    reasons = []
    if row.engine not in MODELLED_ENGINES:
        reasons.append(f"engine: {row.engine!r} is not modelled; the simulator imitates "
                       f"{', '.join(MODELLED_ENGINES)} (v1 scheduler)")
    elif row.engine == "vllm" and (_release(row.engine_version) or FIRST_V1_DEFAULT) \
            < FIRST_V1_DEFAULT:
        reasons.append(f"engine: vLLM {row.engine_version} runs the V0 engine by default (V1 "
                       f"from {'.'.join(map(str, FIRST_V1_DEFAULT))}); the simulator "
                       "imitates V1")
    fp8_peak = None
    if row.hardware not in PRESET_NAMES:
        reasons.append(f"unsupported_hardware: {row.hardware!r} has no hardware preset "
                       f"({', '.join(PRESET_NAMES)})")
    else:
        fp8_peak = "fp8" in preset(row.hardware).device.peak_tflops
    if row.model not in preset_names():
        reasons.append(f"model: {row.model!r} has no ModelSpec preset")
    if row.dataset not in FIXED_LENGTH_DATASETS:
        reasons.append(f"dataset: {row.dataset!r} has per-request lengths; only "
                       f"{'/'.join(FIXED_LENGTH_DATASETS)} rows are simulated")
    else:
        for side, total, nominal in (("input", row.total_input_tokens, row.input_len),
                                     ("output", row.total_output_tokens, row.output_len)):
            gap = _length_gap(total, row.num_prompts, nominal)
            if gap is not None and abs(gap) > LENGTH_TOLERANCE:
                reasons.append(f"lengths: published mean {side} length "
                               f"{total / row.num_prompts:.1f} is {gap:+.1%} off the nominal "
                               f"{nominal} (tolerance {LENGTH_TOLERANCE:.0%}): not fixed-length")
    if row.num_prompts is None and row.load_kind is not LoadKind.BATCH:
        reasons.append("num_prompts: the number of requests is not published")
    if row.dtype not in MODELLED_DTYPES:
        reasons.append(f"dtype: {row.dtype!r} weights are not priced "
                       f"({', '.join(MODELLED_DTYPES)})")
    elif row.dtype == "fp8" and fp8_peak is False:
        reasons.append(f"dtype: 'fp8' on {row.hardware!r}, whose preset has no FP8 peak")
    return "; ".join(reasons) or None


#: vLLM's scheduler limits when the command line sets none: (max_num_batched_tokens,
#: max_num_seqs) by usage context, from ``EngineArgs.get_batch_defaults``
#: (vllm/engine/arg_utils.py, vLLM 0.9-0.11): GPUs with >= 70 GiB that are not A100s (H100,
#: H200) get 8192/1024 behind the API server and 16384/1024 offline (``LLM``, as ``vllm
#: bench latency/throughput`` run); other GPUs, A100 included (PR #17885: a larger budget
#: lowered A100 throughput), 2048/256 and 8192/256.
VLLM_DEFAULT_LIMITS: Mapping[tuple[bool, bool], tuple[int, int]] = MappingProxyType({
    # (large non-A100 GPU, offline) -> (max_num_batched_tokens, max_num_seqs)
    (True, False): (8192, 1024), (True, True): (16384, 1024),
    (False, False): (2048, 256), (False, True): (8192, 256)})
_LARGE_GPU_BYTES = 70 * 2**30


def vllm_default_limits(row: ServingRow) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) the row ran with: its published values, else
    vLLM 0.9-0.11's defaults (``VLLM_DEFAULT_LIMITS``) for its GPU and usage context —
    offline for ``batch`` and ``max_throughput`` rows measured by an offline benchmark
    (no TTFT published), the API server otherwise. ``row.hardware`` must be a preset."""
    device = preset(row.hardware).device
    large = device.hbm_bytes >= _LARGE_GPU_BYTES and "a100" not in device.name.lower()
    offline = row.load_kind is LoadKind.BATCH or (
        row.load_kind is LoadKind.MAX_THROUGHPUT and row.mean_ttft_ms is None
        and row.median_ttft_ms is None)
    tokens, seqs = VLLM_DEFAULT_LIMITS[(large, offline)]
    return (row.max_num_batched_tokens or tokens, row.max_num_seqs or seqs)


def simulate_row_default(row: ServingRow, *, seed: int = 0,
                         cost_options: dict | None = None) -> dict[str, float]:
    """Predict ``row`` with the serving simulator as ``vcluster simulate serve`` runs it
    (:func:`~vcluster.timing.serving.deployment.simulate_serve`: vLLM's KV capacity, the
    :class:`~vcluster.timing.serving.step_cost.ServingCostModel` step prices, the vLLM-v1
    scheduler), with the constants as they stand — nothing here is fitted.

    One replica of ``row.tp`` x ``row.pp`` GPUs (``row.ep``), FP8 weights when
    ``row.dtype`` is fp8, the scheduler limits of :func:`vllm_default_limits`, and
    ``num_prompts`` requests of exactly ``input_len``/``output_len`` tokens: all at t = 0
    (``max_throughput``, ``batch``), closed loop at the concurrency, or Poisson at the
    rate. Returns vLLM bench's keys; a ``batch`` row also gets ``mean_batch_latency_ms`` =
    the run's duration (the last request's end: one generate() over the batch). A row
    :func:`refusal` refuses, or one whose KV cache cannot hold a request, raises
    :class:`ConfigError`. ``cost_options``: settings of the step-cost model to try instead
    of its defaults (``step_overhead_s``, ...: what a calibration on the ``fit`` rows
    varies)."""
    # why: a row names its model; the presets' JSON files are read only when a row runs
    from modeling.presets import load_model
    from serving import ServingPlan

    from .deployment import serving_pricer, simulate_serve
    from .workload import Workload

    reason = refusal(row)
    if reason is not None:
        raise ConfigError("row", str(row), "a row refusal() accepts", reason)
    tokens, seqs = vllm_default_limits(row)
    plan = ServingPlan(tp=row.tp, pp=row.pp, ep=row.ep, max_num_batched_tokens=tokens,
                       max_num_seqs=seqs, weight_bytes=1 if row.dtype == "fp8" else 2)
    count = int(row.load) if row.load_kind is LoadKind.BATCH else row.num_prompts
    load = ({"rate": row.load} if row.load_kind is LoadKind.RATE else
            {"concurrency": int(row.load)} if row.load_kind is LoadKind.CONCURRENCY else {})
    workload = Workload(count, row.input_len, row.output_len, seed=seed, **load)
    spec, hardware = load_model(row.model), preset(row.hardware)
    pricer = serving_pricer(spec, hardware, plan, **(cost_options or {}))
    report = simulate_serve(spec, hardware, plan, workload, seed=seed, pricer=pricer)
    if report.result is None:
        raise ConfigError("row", str(row), "a deployment whose KV cache holds a request",
                          report.oom_reason)
    metrics = report.metrics
    out = {k: v for k, v in metrics.as_json().items() if k in METRIC_KEYS}
    if row.load_kind is LoadKind.BATCH:
        out["mean_batch_latency_ms"] = metrics.duration_s * 1000
    return out


# --- the report ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricError:
    """A prediction of one published metric; ``rel_error`` = predicted / published - 1."""

    metric: str
    published: float
    predicted: float

    @property
    def rel_error(self) -> float:
        return self.predicted / self.published - 1


@dataclass(frozen=True)
class RowResult:
    """One row's outcome: refused (``refused`` says why, nothing predicted), or simulated
    with one :class:`MetricError` per published metric the simulator predicted;
    ``missing`` lists the published metrics it did not predict."""

    row: ServingRow
    refused: str | None
    errors: tuple[MetricError, ...] = ()
    missing: tuple[str, ...] = ()

    def error(self, metric: str) -> MetricError | None:
        return next((e for e in self.errors if e.metric == metric), None)

    def family_error(self, family: str) -> MetricError | None:
        """The error on the family's first published key (``FAMILY_KEYS``), or None when
        the row publishes none of its keys or that one was not predicted."""
        published = self.row.published()
        key = next((k for k in FAMILY_KEYS[family] if k in published), None)
        return None if key is None else self.error(key)


@dataclass(frozen=True)
class FamilyError:
    """Mean |rel_error| of one family over ``n`` rows (``mean_abs_error`` None when n = 0)."""

    family: str
    mean_abs_error: float | None
    n: int


@dataclass(frozen=True)
class GroupSummary:
    """One table (or ``ALL_TABLES``) and role: rows simulated and refused, and per family
    the mean |rel_error| over the simulated rows."""

    table: str
    role: Role
    simulated: int
    refused: int
    families: tuple[FamilyError, ...]

    def family(self, name: str) -> FamilyError:
        return next(f for f in self.families if f.family == name)


@dataclass(frozen=True)
class ValidationReport:
    rows: tuple[RowResult, ...]
    groups: tuple[GroupSummary, ...]

    def group(self, table: str, role: Role | str) -> GroupSummary | None:
        """The summary of ``table`` (``ALL_TABLES`` for all) and ``role``, if it has rows."""
        role = Role(role)
        return next((g for g in self.groups if g.table == table and g.role is role), None)


def _check_prediction(row: ServingRow, predicted) -> dict[str, float]:
    if not isinstance(predicted, Mapping):
        raise TypeError(f"simulate_row({row}) returned {type(predicted).__name__}; "
                        "allowed: a mapping of vLLM metric keys to numbers")
    out = {}
    for key in METRIC_KEYS:
        if key not in predicted:
            continue
        value = predicted[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not (math.isfinite(value) and value > 0):
            raise ConfigError(key, value, "a finite number > 0", "not a usable prediction",
                              owner=f"simulate_row({row})")
        out[key] = float(value)
    return out


def _summarise(table: str, role: Role, results: list[RowResult]) -> GroupSummary:
    simulated = [r for r in results if r.refused is None]
    families = []
    for family in FAMILY_KEYS:
        errors = [e for e in (r.family_error(family) for r in simulated) if e is not None]
        mean = sum(abs(e.rel_error) for e in errors) / len(errors) if errors else None
        families.append(FamilyError(family, mean, len(errors)))
    return GroupSummary(table, role, len(simulated), len(results) - len(simulated),
                        tuple(families))


def validate_serving(rows: Iterable[ServingRow], *,
                     simulate_row: Callable[[ServingRow], Mapping[str, float]],
                     refuse: Callable[[ServingRow], str | None] = refusal,
                     ) -> ValidationReport:
    """Predict every row ``refuse`` accepts with ``simulate_row(row) -> {metric: value}``
    (vLLM's keys, ``METRIC_KEYS``; others are ignored) and compare with the published
    values. Refused rows are reported with their reason and never simulated."""
    results = []
    for row in rows:
        reason = refuse(row)
        if reason is not None:
            results.append(RowResult(row, reason))
            continue
        predicted = _check_prediction(row, simulate_row(row))
        published = row.published()
        errors = tuple(MetricError(k, v, predicted[k]) for k, v in published.items()
                       if k in predicted)
        missing = tuple(k for k in published if k not in predicted)
        results.append(RowResult(row, None, errors, missing))
    groups = []
    tables = list(dict.fromkeys(r.row.table for r in results))
    for table in [*tables, ALL_TABLES]:
        for role in Role:
            members = [r for r in results if r.row.role is role
                       and (table == ALL_TABLES or r.row.table == table)]
            if members:
                groups.append(_summarise(table, role, members))
    return ValidationReport(tuple(results), tuple(groups))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def format_report(report: ValidationReport) -> str:
    """Markdown: per table and role the mean |error| per family (n in brackets), then
    per simulated row the signed errors."""
    lines = ["| table | role | simulated | refused | TTFT | TPOT | throughput | batch latency |",
             "|---|---|---|---|---|---|---|---|"]
    for g in report.groups:
        cells = [("-" if f.mean_abs_error is None else f"{f.mean_abs_error:.1%} ({f.n})")
                 for f in g.families]
        lines.append(f"| {g.table} | {g.role.value} | {g.simulated} | {g.refused} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| row | role | TTFT | TPOT | throughput | batch latency |",
              "|---|---|---|---|---|---|"]
    for r in report.rows:
        if r.refused is None:
            cells = [_pct(None if e is None else e.rel_error)
                     for e in (r.family_error(f) for f in FAMILY_KEYS)]
            lines.append(f"| {r.row.table}#{r.row.row} {r.row.input_len}/{r.row.output_len} "
                         f"| {r.row.role.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
