"""vLLM bench serve's metrics on hand-built records: every formula against hand-worked numbers."""

import math

import pytest

from modeling.errors import ConfigError
from vcluster.timing.serving.metrics import RequestRecord, compute_metrics

# Three requests worked by hand (times in s):
#   A sent 0.0, 10 prompt tokens, tokens at 0.1 0.3 0.6      TTFT .1  E2EL .6  TPOT .25
#   B sent 0.5, 20 prompt tokens, one token at 0.7           TTFT .2  E2EL .2  (no TPOT)
#   C sent 1.0, 30 prompt tokens, tokens at 1.4 1.5 1.7 2.2  TTFT .4  E2EL 1.2 TPOT .8/3
RECORDS = (RequestRecord(0, 0.0, 10, (0.1, 0.3, 0.6)),
           RequestRecord(1, 0.5, 20, (0.7,)),
           RequestRecord(2, 1.0, 30, (1.4, 1.5, 1.7, 2.2), replica=1))


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_totals_and_throughputs():
    m = compute_metrics(RECORDS, num_gpus=4, kv_usage=[0.5, 1.0], kv_weights_s=[3.0, 1.0])
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (3, 0, 60, 8)
    assert m.duration_s == approx(2.2)                 # benchmark start (0) to last token
    assert m.request_throughput == approx(3 / 2.2)
    assert m.output_throughput == approx(8 / 2.2)
    assert m.total_token_throughput == approx(68 / 2.2)
    assert m.output_throughput_per_gpu == approx(8 / 2.2 / 4)
    assert m.mean_kv_cache_usage == approx((0.5 * 3 + 1.0 * 1) / 4)
    assert m.peak_kv_cache_usage == 1.0
    # whole-second buckets from the first send: {.1 .3 .6 .7} {1.4 1.5 1.7} {2.2}
    assert m.max_output_tokens_per_s == 4
    # [0, .6) and [.5, .7) overlap; [1, 2.2) alone
    assert m.max_concurrent_requests == 2


def test_latency_statistics_by_hand():
    m = compute_metrics(RECORDS, percentiles=(90, 99))
    ttft = m.ttft            # [.1 .2 .4]
    assert ttft.mean_ms == approx(700 / 3)
    assert ttft.median_ms == approx(200)
    assert ttft.std_ms == approx(1000 * math.sqrt((4 ** 2 + 1 ** 2 + 5 ** 2) / 30 ** 2 / 3))
    assert ttft.percentile(90) == approx(360)           # linear: .2 + .8 * (.4 - .2)
    assert ttft.percentile(99) == approx(396)
    tpot = m.tpot            # [.25, .8/3]; B (one token) is left out
    assert tpot.mean_ms == approx(1000 * (0.25 + 0.8 / 3) / 2)
    assert tpot.std_ms == approx(1000 * (0.8 / 3 - 0.25) / 2)
    assert tpot.percentile(90) == approx(1000 * (0.25 + 0.9 * (0.8 / 3 - 0.25)))
    itl = m.itl              # pooled gaps [.2 .3 .1 .2 .5]
    assert itl.mean_ms == approx(260)
    assert itl.median_ms == approx(200)
    assert itl.std_ms == approx(1000 * math.sqrt(0.092 / 5))
    assert itl.percentile(90) == approx(420)            # sorted .1 .2 .2 .3 .5, index 3.6
    assert itl.percentile(99) == approx(492)
    e2el = m.e2el            # [.6 .2 1.2]
    assert e2el.mean_ms == approx(2000 / 3)
    assert e2el.median_ms == approx(600)
    assert e2el.std_ms == approx(1000 * math.sqrt((1 ** 2 + 7 ** 2 + 8 ** 2) / 15 ** 2 / 3))
    assert e2el.percentile(90) == approx(1080)
    assert e2el.percentile(99) == approx(1188)


def test_as_json_has_vllms_keys():
    out = compute_metrics(RECORDS, percentiles=(90, 99, 99.9)).as_json()
    vllm = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput",
            "max_output_tokens_per_s", "max_concurrent_requests"}
    for name in ("ttft", "tpot", "itl", "e2el"):
        vllm |= {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p90_{name}_ms",
                 f"p99_{name}_ms", f"p99.9_{name}_ms"}
    extra = {"num_gpus", "output_throughput_per_gpu", "mean_kv_cache_usage",
             "peak_kv_cache_usage"}
    assert set(out) == vllm | extra
    assert out["p90_ttft_ms"] == approx(360)
    assert all(isinstance(v, (int, float)) for v in out.values())


def test_start_and_duration_overrides():
    from_first_send = compute_metrics(RECORDS, start_s=0.5)
    assert from_first_send.duration_s == approx(1.7)
    assert compute_metrics(RECORDS, duration_s=4.0).output_throughput == approx(2.0)


def test_single_token_requests_give_zero_tpot_and_itl_like_vllm():
    m = compute_metrics([RequestRecord(0, 0.0, 5, (0.25,))])
    assert m.tpot.mean_ms == 0 and m.itl.percentile(99) == 0   # vLLM's np.mean([] or 0)
    assert m.ttft.mean_ms == approx(250)


def test_peak_concurrency_departure_before_arrival():
    m = compute_metrics([RequestRecord(0, 0.0, 1, (1.0,)), RequestRecord(1, 1.0, 1, (2.0,))])
    assert m.max_concurrent_requests == 1


@pytest.mark.parametrize("times,arrival", [((), 0.0), ((0.5,), 1.0), ((0.3, 0.2), 0.0)])
def test_bad_records_are_refused(times, arrival):
    with pytest.raises(ConfigError, match="token_times_s"):
        RequestRecord(7, arrival, 3, times)


def test_bad_arguments_name_themselves():
    with pytest.raises(ConfigError, match="records"):
        compute_metrics([])
    with pytest.raises(ConfigError, match="percentiles=101"):
        compute_metrics(RECORDS, percentiles=(101,))
    with pytest.raises(ConfigError, match="num_gpus"):
        compute_metrics(RECORDS, num_gpus=0)
    with pytest.raises(ConfigError, match="kv_weights_s"):
        compute_metrics(RECORDS, kv_usage=[0.1], kv_weights_s=[])
    with pytest.raises(ConfigError, match="duration_s"):
        compute_metrics(RECORDS, duration_s=0.0)
