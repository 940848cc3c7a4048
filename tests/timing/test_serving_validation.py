"""serving_measured.csv and the serving-validation harness (vcluster.timing.serving.validation).

Independent checks: the published numbers against each other (vLLM bench's own identities
request_throughput x mean output length = output_throughput and total = output x
(in + out) / out, up to the printed rounding) catch transcription errors; the error
arithmetic against hand-made predictions; the roles against their stated rule.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from modeling.errors import ConfigError
from vcluster.timing.serving.validation import (
    ALL_TABLES,
    COLUMNS,
    FAMILY_KEYS,
    LoadKind,
    Role,
    format_report,
    refusal,
    rows_from_records,
    serving_rows,
    simulate_row_default,
    validate_serving,
    vllm_default_limits,
)

ROWS = serving_rows()


def _row(table, row):
    return next(r for r in ROWS if r.table == table and r.row == row)


def test_csv_parses_with_enough_rows_sources_and_tables():
    assert 20 <= len(ROWS) <= 80
    assert len({r.source for r in ROWS}) >= 3
    assert len({r.table for r in ROWS}) >= 5
    assert [r.row for r in ROWS] == list(range(1, len(ROWS) + 1))


def test_every_row_cites_a_source_and_has_a_role():
    for r in ROWS:
        assert r.url.startswith("https://") and r.source and r.table, r
        assert r.role in (Role.FIT, Role.HELD_OUT)
        assert r.published(), r


def test_roles_follow_the_stated_rule():
    """Every third vLLM row in file order is fit (the 1st, 4th, ...); all others held out."""
    vllm = [r for r in ROWS if r.engine == "vllm"]
    for i, r in enumerate(vllm):
        assert r.role is (Role.FIT if i % 3 == 0 else Role.HELD_OUT), r
    assert all(r.role is Role.HELD_OUT for r in ROWS if r.engine != "vllm")
    fit = sum(r.role is Role.FIT for r in vllm)
    assert abs(fit / len(vllm) - 1 / 3) < 0.05


def test_tables_where_tp_and_load_vary():
    by_table = {}
    for r in ROWS:
        by_table.setdefault((r.table, r.model), []).append(r)
    assert any(len({r.tp for r in rs}) >= 3 for rs in by_table.values())  # a TP sweep
    assert any(len({r.load for r in rs if r.load_kind is LoadKind.CONCURRENCY}) >= 5
               for rs in by_table.values())  # a load sweep with the knee
    assert any(len({r.tp for r in rs if refusal(r) is None}) >= 1 for rs in by_table.values())


def test_vllm_bench_identities_hold_for_transcribed_rows():
    """output = request_throughput x mean output length; total = output x (in+out)/out."""
    checked = 0
    for r in ROWS:
        if r.total_output_tokens and r.num_prompts and r.request_throughput and r.output_throughput:
            mean_out = r.total_output_tokens / r.num_prompts
            # the request rate is printed with 2 decimals: +-0.005 req/s
            slack = 0.005 * mean_out + 0.01 * r.output_throughput
            assert abs(r.request_throughput * mean_out - r.output_throughput) <= slack, r
            ratio = (r.total_input_tokens + r.total_output_tokens) / r.total_output_tokens
            assert r.total_token_throughput == pytest.approx(r.output_throughput * ratio,
                                                             rel=5e-3), r
            checked += 1
    assert checked >= 20


def test_batch_rows_throughput_matches_batch_latency():
    """vllm bench latency: output tok/s = batch x output_len / batch latency (issue 16300)."""
    for r in ROWS:
        if r.load_kind is LoadKind.BATCH and r.output_throughput:
            expected = r.load * r.output_len / (r.mean_batch_latency_ms / 1000)
            assert r.output_throughput == pytest.approx(expected, rel=0.03), r


# --- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("version, v0", [("0.7.2", True), ("v0.6.3.post1", True),
                                         ("0.8.0", False), ("0.11.0", False),
                                         ("1.0", False), (None, False), ("nightly", False)])
def test_a_vllm_release_before_0_8_is_refused_as_the_v0_engine(version, v0):
    row = replace(_row("gpustack-qwen3-32b-a100-random", 9),
                              engine_version=version)
    reason = refusal(row) or ""
    assert ("runs the V0 engine by default" in reason) is v0, reason


def test_refusals_as_documented():
    for r in ROWS:
        reason = refusal(r)
        if r.engine != "vllm":
            assert reason and reason.startswith("engine: "), r
        if r.hardware in ("B200",) or r.hardware.startswith("1xStandard"):
            assert "unsupported_hardware: " in reason, r
        if r.dataset == "sharegpt":
            assert "dataset: 'sharegpt'" in reason, r
        if r.table == "vllm-issue16300-qwq32b-a100-tp":     # QwQ-32B: Qwen2.5-32B shapes
            assert r.model == "qwen2.5-32b" and "model:" not in reason, r
            assert "engine: vLLM 0.7.2 runs the V0 engine by default" in reason, r
        if r.dtype == "fp4":
            assert "dtype: 'fp4'" in reason, r
    # random rows whose outputs stopped early at EOS are not fixed-length
    early = _row("gpustack-qwen3-32b-h100-random", 2)  # 7681 of 100 x 100 output tokens
    assert early.input_len == 32000 and "lengths: published mean output length 76.8" in refusal(early)
    assert refusal(_row("gpustack-qwen3-32b-h100-random", 3)) is None  # 99790 of 100000: -0.2 %
    runnable = [r for r in ROWS if refusal(r) is None]
    assert len(runnable) >= 12
    assert {r.hardware for r in runnable} == {"h100-dgx", "a100-80gb-dgx", "h200-dgx"}
    assert all(r.engine == "vllm" and r.dataset in ("fixed", "random") for r in runnable)
    assert any(r.role is Role.FIT for r in runnable) and any(r.role is Role.HELD_OUT
                                                             for r in runnable)


def test_fp8_refused_where_the_preset_has_no_fp8_peak():
    a100 = replace(_row("gpustack-qwen3-32b-a100-random", 9), dtype="fp8")
    assert refusal(a100) == "dtype: 'fp8' on 'a100-80gb-dgx', whose preset has no FP8 peak"
    assert refusal(replace(_row("gpustack-qwen3-32b-h100-random", 4), dtype="fp8")) is None


def test_missing_request_count_is_refused_except_for_batches():
    nim = _row("nim-llama33-70b-h100-tp2-5000-500", 42)
    assert "num_prompts: the number of requests is not published" in refusal(nim)
    assert refusal(_row("vllm-ci-9515-latency", 25)) is None


# --- strict parsing ---------------------------------------------------------------------------
def _record(**changes):
    base = {c: "" for c in COLUMNS}
    base.update(source="s", url="https://example.org/t", table="t", model="llama-3.1-8b",
                hardware="h100-dgx", gpus="1", tp="1", pp="1", ep="1", engine="vllm",
                input_len="128", output_len="128", dataset="fixed", load_kind="concurrency",
                load="4", num_prompts="40", dtype="bf16", mean_ttft_ms="20", role="fit")
    base.update(changes)
    return base


@pytest.mark.parametrize("column,value,needle", [
    ("tp", "x", "tp='x': not an integer"),
    ("gpus", "2", "gpus=2: one engine instance's GPUs"),
    ("mean_ttft_ms", "-3", "mean_ttft_ms='-3': a measurement must be positive"),
    ("role", "train", "role='train': unknown value; allowed: fit, held_out"),
    ("load", "", "load='': load_kind is concurrency"),
    ("url", "example.org", "url='example.org': every row cites its source"),
    ("input_len", "0", "input_len=0: out of range"),
    ("dtype", "fp6", "dtype='fp6': unknown value"),
])
def test_a_bad_cell_names_file_row_and_column(column, value, needle):
    good = _record()
    with pytest.raises(ConfigError) as err:
        rows_from_records([good, _record(**{column: value})], "x.csv")
    assert str(err.value).startswith("x.csv row 2: ") and needle in str(err.value)


def test_a_row_must_publish_a_metric_and_have_every_column():
    with pytest.raises(ConfigError, match="row 1: metrics=None"):
        rows_from_records([_record(mean_ttft_ms="")])
    record = _record()
    del record["notes"]
    with pytest.raises(ConfigError, match="notes=None: the column is missing"):
        rows_from_records([record])
    with pytest.raises(ConfigError, match="more cells than the header"):
        rows_from_records([{**_record(), None: ["extra"]}])


# --- the error arithmetic --------------------------------------------------------------------
def _hand_rows():
    rows = rows_from_records([
        _record(table="a", mean_ttft_ms="100", mean_tpot_ms="10", output_throughput="1000"),
        _record(table="a", role="held_out", mean_ttft_ms="", median_ttft_ms="200", mean_itl_ms="20",
                total_token_throughput="500"),
        _record(table="b", role="held_out", engine="sglang", mean_ttft_ms="50"),
        _record(table="b", role="held_out", mean_ttft_ms="400", load_kind="batch", load="8",
                mean_batch_latency_ms="800"),
    ])
    return rows


def test_validate_serving_error_arithmetic():
    rows = _hand_rows()
    factors = {"mean_ttft_ms": 1.1, "median_ttft_ms": 0.5, "mean_tpot_ms": 0.8,
               "mean_itl_ms": 1.25, "output_throughput": 0.9}

    def simulate(row):
        assert row.engine == "vllm", "refused rows are never simulated"
        return {**{k: v * factors[k] for k, v in row.published().items() if k in factors},
                "p90_ttft_ms": 1.0}  # keys outside METRIC_KEYS are ignored

    report = validate_serving(rows, simulate_row=simulate)
    r0, r1, r2, r3 = report.rows
    assert r0.refused is None and [e.metric for e in r0.errors] == [
        "mean_ttft_ms", "mean_tpot_ms", "output_throughput"]
    assert r0.family_error("ttft").rel_error == pytest.approx(0.1)
    assert r0.family_error("tpot").rel_error == pytest.approx(-0.2)
    assert r0.family_error("throughput").rel_error == pytest.approx(-0.1)
    # median TTFT stands in for a missing mean; ITL for a missing TPOT
    assert r1.family_error("ttft").rel_error == pytest.approx(-0.5)
    assert r1.family_error("tpot").rel_error == pytest.approx(0.25)
    assert r1.family_error("throughput") is None and r1.missing == ("total_token_throughput",)
    assert r2.refused.startswith("engine: 'sglang'") and r2.errors == ()
    assert r3.family_error("latency") is None and r3.missing == ("mean_batch_latency_ms",)

    a_fit, a_held = report.group("a", "fit"), report.group("a", Role.HELD_OUT)
    assert (a_fit.simulated, a_fit.refused, a_held.simulated) == (1, 0, 1)
    assert a_held.family("ttft").mean_abs_error == pytest.approx(0.5)
    assert a_held.family("throughput").n == 0 and a_held.family("throughput").mean_abs_error is None
    b_held = report.group("b", "held_out")
    assert (b_held.simulated, b_held.refused) == (1, 1)
    everyone = report.group(ALL_TABLES, "held_out")
    assert everyone.simulated == 2 and everyone.refused == 1
    # mean |error| over rows a#2 (-50 %) and b#4 (+10 %)
    assert everyone.family("ttft").mean_abs_error == pytest.approx((0.5 + 0.1) / 2)
    assert everyone.family("ttft").n == 2
    assert report.group("b", "fit") is None
    text = format_report(report)
    assert "| a | held_out | 1 | 0 | 50.0% (1) |" in text and "+10.0%" in text


def test_bad_predictions_are_named():
    rows = _hand_rows()[:1]
    with pytest.raises(ConfigError, match="mean_ttft_ms=nan"):
        validate_serving(rows, simulate_row=lambda r: {"mean_ttft_ms": math.nan})
    with pytest.raises(TypeError, match="allowed: a mapping"):
        validate_serving(rows, simulate_row=lambda r: [1.0])


def test_published_rows_validate_against_themselves():
    """A perfect simulator: every family error is 0 on every runnable published row."""
    report = validate_serving(ROWS, simulate_row=lambda r: r.published())
    simulated = [r for r in report.rows if r.refused is None]
    assert simulated and all(e.rel_error == 0 for r in simulated for e in r.errors)
    held = report.group(ALL_TABLES, "held_out")
    for family in FAMILY_KEYS:
        f = held.family(family)
        assert f.mean_abs_error in (None, 0.0)


def test_vllm_default_limits_follow_get_batch_defaults():
    """vLLM 0.9-0.11 EngineArgs.get_batch_defaults: H100/H200 8192/1024 served, 16384/1024
    offline; A100 2048/256 served; a published value wins."""
    assert vllm_default_limits(_row("gpustack-qwen3-32b-h100-random", 3)) == (8192, 1024)
    assert vllm_default_limits(_row("gpustack-qwen3-32b-a100-random", 8)) == (2048, 256)
    assert vllm_default_limits(_row("vllm-ci-9515-latency", 26)) == (16384, 1024)
    optimized = _row("gpustack-qwen3-235b-h100-random-optimized", 23)
    assert optimized.max_num_batched_tokens == 16384
    assert vllm_default_limits(replace(optimized, max_num_seqs=64)) == (16384, 64)


# --- wired to the simulator -------------------------------------------------------------------
def test_simulator_predicts_every_runnable_row_and_held_out_errors_are_computed():
    """simulate_row_default over the file (about 4 s): every runnable row predicted, the
    held-out mean |error| computed per family (no accuracy threshold: docs give the numbers)."""
    report = validate_serving(ROWS, simulate_row=simulate_row_default)
    simulated = [r for r in report.rows if r.refused is None]
    assert len(simulated) == sum(refusal(r) is None for r in ROWS)
    for result in simulated:
        assert not result.missing, result.row
        assert all(math.isfinite(e.rel_error) for e in result.errors)
    held = report.group(ALL_TABLES, "held_out")
    assert held.simulated >= 6
    for family in ("ttft", "tpot", "throughput", "latency"):
        f = held.family(family)
        assert f.n >= 1 and math.isfinite(f.mean_abs_error), family


def test_simulate_row_default_refuses_what_refusal_refuses():
    with pytest.raises(ConfigError, match="engine: 'nim'"):
        simulate_row_default(_row("nim-llama33-70b-h100-tp2-5000-500", 42))
