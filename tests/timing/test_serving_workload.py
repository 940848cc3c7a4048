"""Workloads as vllm bench serve sends them: lengths, gamma/Poisson arrivals, traces."""

import math

import numpy as np
import pytest

from modeling.errors import ConfigError
from serving import Request
from vcluster.timing.serving.workload import TraceWorkload, Workload, read_trace


def intervals(requests):
    t = np.array([r.arrival_s for r in requests])
    return np.diff(np.concatenate([[0.0], t]))


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
@pytest.mark.parametrize("rescale", [True, False])
def test_gamma_interarrival_mean_and_cv(burstiness, rescale):
    """Gamma(k, 1/(λk)) intervals: mean 1/λ, CV 1/√k (k = 1: exponential, Poisson)."""
    rate = 7.0
    reqs = Workload(20_000, 16, 16, rate=rate, burstiness=burstiness, seed=3,
                    rescale=rescale).requests()
    gaps = intervals(reqs)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)
    if rescale:   # vLLM stretches the send times so the last is exactly N/λ
        assert reqs[-1].arrival_s == pytest.approx(20_000 / rate, rel=1e-12)


def test_rate_inf_and_burstiness_inf():
    assert {r.arrival_s for r in Workload(5, 8, 8).requests()} == {0.0}
    const = Workload(4, 8, 8, rate=2.0, burstiness=math.inf).requests()
    assert [r.arrival_s for r in const] == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_fixed_and_ranged_lengths():
    fixed = Workload(50, 512, 128, rate=1.0).requests()
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(512, 128)}
    ranged = Workload(5000, 100, 11, range_ratio=0.5, seed=1).requests()
    p = np.array([r.prompt_len for r in ranged])
    o = np.array([r.output_len for r in ranged])
    # vLLM: uniform integers in [floor(L(1-r)), ceil(L(1+r))], output at least 1
    assert (p.min(), p.max()) == (50, 150) and (o.min(), o.max()) == (5, 17)
    assert p.mean() == pytest.approx(100, rel=0.02) and o.mean() == pytest.approx(11, rel=0.02)


def test_deterministic_ids_and_independent_streams():
    a = Workload(100, 64, 32, rate=5.0, range_ratio=0.3, seed=9).requests()
    assert a == Workload(100, 64, 32, rate=5.0, range_ratio=0.3, seed=9).requests()
    assert [r.request_id for r in a] == list(range(100))
    assert all(isinstance(r, Request) for r in a)
    b = Workload(100, 64, 32, rate=50.0, range_ratio=0.3, seed=9).requests()
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in b]
    assert a != Workload(100, 64, 32, rate=5.0, range_ratio=0.3, seed=10).requests()
    assert a != Workload(100, 64, 32, rate=5.0, range_ratio=0.3).requests(seed=8)


@pytest.mark.parametrize("field,value", [("num_requests", 0), ("input_len", 0),
                                         ("output_len", 1.5), ("rate", 0.0), ("rate", -1.0),
                                         ("burstiness", 0), ("concurrency", 0),
                                         ("range_ratio", 1.0), ("seed", -1)])
def test_bad_workloads_name_the_field(field, value):
    kwargs = {"num_requests": 4, "input_len": 8, "output_len": 8, field: value}
    with pytest.raises(ConfigError, match=f"{field}="):
        Workload(**kwargs)


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_trace_reads_rows(tmp_path):
    path = write(tmp_path, "arrival_s,input_len,output_len,note\n0.5,100,20,x\n\n0.25,7,1,y\n")
    reqs = read_trace(path)
    assert reqs == (Request(0, 100, 20, arrival_s=0.5), Request(1, 7, 1, arrival_s=0.25))
    w = TraceWorkload(path, concurrency=2)
    assert w.requests() == reqs and w.closed_loop


def test_trace_prefix_columns_share_a_prompt_prefix(tmp_path):
    """Optional prefix_len (of the prompt's input_len tokens) and prefix_id (default 0)."""
    path = write(tmp_path, "arrival_s,input_len,output_len,prefix_len,prefix_id\n"
                           "0,100,5,64,3\n0.1,80,5,64,3\n0.2,50,5,0,\n0.3,70,5,32,\n")
    reqs = read_trace(path)
    assert [r.shared_prefix for r in reqs] == [(3, 64), (3, 64), None, (0, 32)]
    assert [r.prompt_len for r in reqs] == [100, 80, 50, 70]


@pytest.mark.parametrize("text,where,what", [
    ("arrival_s,input_len\n0,1\n", "line 1", "missing column 'output_len'"),
    ("arrival_s,input_len,output_len\n0,10,5\n1.0,abc,5\n", "line 3", "input_len='abc'"),
    ("arrival_s,input_len,output_len\n0,10,0\n", "line 2", "output_len='0'"),
    ("arrival_s,input_len,output_len\n-1,10,5\n", "line 2", "arrival_s='-1'"),
    ("arrival_s,input_len,output_len\nnan,10,5\n", "line 2", "arrival_s='nan'"),
    ("arrival_s,input_len,output_len\n0,10\n", "line 2", "row="),
    ("", "line 1", "the file is empty"),
    ("arrival_s,input_len,output_len\n", "", "no data rows"),
    ("arrival_s,input_len,output_len,prefix_len\n0,10,5,11\n", "line 2", "prefix_len='11'"),
    ("arrival_s,input_len,output_len,prefix_len,prefix_id\n0,10,5,4,x\n", "line 2",
     "prefix_id='x'"),
])
def test_trace_errors_name_file_line_and_column(tmp_path, text, where, what):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        read_trace(path)
    message = str(info.value)
    assert str(path) in message and where in message and what in message


def test_missing_trace_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_trace(tmp_path / "nope.csv")
