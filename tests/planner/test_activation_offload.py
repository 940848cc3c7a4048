"""Activation offload to host memory over NVLink-C2C (issue 55, "Grace-attached memory"):
the plan's rule, the memory it moves, the copy time it exposes, and the refusals.

The checks are independent of the code under test where they can be: the per-layer
activation bytes come from Korthikanti's Llama count written out here, the exposed time
from the copy-bound closed form of vcluster/planner/offload.py's docstring (not from its
recursion), the step growth from (m + p − 1) slots."""

import dataclasses
import json

import pytest

from modeling import ConfigError
from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from pipelining import peak_in_flight
from vcluster.cli.main import main
from vcluster.planner.layer_cost import trace_stage_pieces
from vcluster.planner.memory import gpt_memory
from vcluster.planner.offload import (backward_exposed_s, forward_exposed_s, offload_timing,
                                      offloaded_layers)
from vcluster.planner.simulation import gpt_schedule, simulate_gpt
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

pytestmark = pytest.mark.timeout(120)

SEQ = 2048


def _config(layers=8):
    """Llama 3.1 8B's shapes cut to ``layers`` layers (a proxy that runs in a second)."""
    return GPTConfig.of_model("llama-3.1-8b", seq=SEQ, dtype="float16", timing_only=True,
                              layers=layers)


def _plan(f=0.0, **kw):
    kw = {"global_batch": 16, "micro_batch": 1, "dp": 1, "pp": 2, "tp": 2} | kw
    return ParallelConfig(activation_offload=f, **kw)


def _layer_bytes(cfg, b, t):
    """One Llama layer's saved activations per micro-batch, flash attention, no SP or
    recomputation (Korthikanti's count as docs/planner.md writes it for Llama):
    s·b·(8h + 4·h_q/t + 4·c_l·d + 6f/t) + 4·b·a·s/t."""
    s, h, a, d, f = cfg.seq, cfg.hidden, cfg.heads, cfg.head_dim, cfg.ffn_hidden
    c_l = max(cfg.kv_heads // t, 1)
    return s * b * (8 * h + 4 * a * d / t + 4 * c_l * d + 6 * f / t) + 4 * b * a * s / t


def _hardware(base, **link):
    """A preset with its host link changed (a hardware dict, as a user's file writes it)."""
    return load_hardware({"base": base, "name": f"{base}-c2c",
                          "node": {"host_link": link}})


# -- the rule ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1.0, 1, -0.1, 1.5, float("nan"), True, "0.5"])
def test_the_fraction_is_in_zero_one(bad):
    with pytest.raises(ConfigError) as e:
        _plan(bad)
    assert e.value.field == "activation_offload"


def test_full_recomputation_is_refused_and_selective_accepted():
    with pytest.raises(ConfigError, match="activation_offload=0.5.*recompute='full'"):
        _plan(0.5, recompute="full")
    assert _plan(0.5, recompute="selective").activation_offload == 0.5
    assert _plan(0, recompute="full").activation_offload == 0.0


def test_a_layer_count_maps_to_its_fraction():
    """Megatron's --cpu-offloading-num-layers N of a stage of L layers is f = N / L."""
    for L in range(1, 129):
        for N in range(L):
            assert offloaded_layers(N / L, L) == N
    assert offloaded_layers(0.5, 5) == 2 and offloaded_layers(0.999, 4) == 3


# -- memory --------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, v", [("1f1b", None), ("gpipe", None),
                                         ("interleaved_1f1b", 2)])
def test_memory_moves_the_offloaded_layers_to_the_host(schedule, v):
    """HBM activations drop by n·k·A per stage and the host holds exactly n·k·A (n the
    micro-batches in flight, k = floor(f·L) per chunk, A one layer's bytes); nothing else
    moves, and there is no copy buffer beyond the kept layers (TE's L − k limit)."""
    cfg, f = _config(8), 0.5
    base, off = _plan(0, schedule=schedule, virtual_stages=v), \
        _plan(f, schedule=schedule, virtual_stages=v)
    chunk = cfg.layers // (base.pp * base.chunks)           # layers per stage: 4, or 2
    k = int(f * chunk)
    A = _layer_bytes(cfg, 1, 2)
    schedule_obj = gpt_schedule(base)
    for m0, m1 in zip(gpt_memory(cfg, base, schedule_obj), gpt_memory(cfg, off, schedule_obj)):
        n = peak_in_flight(schedule_obj, m0.rank_position, check=False)
        moved = n * k * A
        assert m0.activations_bytes - m1.activations_bytes == pytest.approx(moved, abs=2)
        assert m1.host_bytes == pytest.approx(moved, abs=1)
        assert m0.host_bytes == 0
        assert (m0.params_bytes, m0.grads_bytes, m0.optimizer_bytes, m0.logits_bytes) == \
            (m1.params_bytes, m1.grads_bytes, m1.optimizer_bytes, m1.logits_bytes)
        assert m1.total_bytes == m0.total_bytes - (m0.activations_bytes - m1.activations_bytes)


def test_host_memory_is_reported_and_held_to_the_host():
    cfg = _config(8)
    r = simulate_gpt(cfg, _plan(0.5), "gb200-nvl72")
    host = max(m.host_bytes for m in r.memory)
    assert r.host_memory_gb == pytest.approx(host / 1e9)
    assert host == pytest.approx(2 * 2 * _layer_bytes(cfg, 1, 2), abs=1)   # rank 0: n = 2
    assert r.host_memory_limit_gb == 240.0 and r.fits
    peak = max(r.memory, key=lambda m: m.total_bytes)
    assert r.memory_breakdown_gb["host"] == peak.host_bytes / 1e9
    small = _hardware("gb200-nvl72")
    small = dataclasses.replace(small, node=dataclasses.replace(
        small.node, host_memory_bytes=int(host) - 1))
    tight = simulate_gpt(cfg, _plan(0.5), small)
    assert not tight.fits and tight.peak_memory_gb == r.peak_memory_gb
    out = json.loads(json.dumps(r.to_json()))
    assert out["host_memory_gb"] == r.host_memory_gb and len(out["offload"]) == 2
    assert out["memory"][0]["host_bytes"] == r.memory[0].host_bytes


# -- time ----------------------------------------------------------------------------

def test_a_fast_link_hides_every_copy():
    cfg = _config(8)
    base = simulate_gpt(cfg, _plan(0), "gb200-nvl72")
    fast = simulate_gpt(cfg, _plan(0.5), _hardware("gb200-nvl72", bandwidth_gbps=1e6))
    assert fast.offload_exposed_s == 0.0
    assert fast.step_time_s == pytest.approx(base.step_time_s, rel=1e-9)
    assert fast.peak_memory_gb < base.peak_memory_gb


def test_a_slow_link_grows_the_step_by_the_slots_times_the_exposed_copies():
    """1 GB/s: c = A / 1e9 s a layer, far above a layer's compute; with k = 2 <= L/2 = 2
    the closed form holds: e = (k·c − (L−1)·t_f) + (k·c − (L−2)·t_b), and 1F1B's
    m + p − 1 slots each carry it."""
    cfg, plan = _config(8), _plan(0.5)
    hw = _hardware("gb200-nvl72", bandwidth_gbps=1.0, efficiency=1.0)
    base = simulate_gpt(cfg, _plan(0), hw)
    slow = simulate_gpt(cfg, plan, hw)
    costs = HardwareCostModel(hw.for_job(plan.gpus), "bf16")
    pieces = trace_stage_pieces(cfg, 2, 1, False, "none", costs)
    t_f = pieces[("layer", "F")].seconds
    t_b = pieces[("layer", "I")].seconds + pieces[("layer", "W")].seconds
    L, k, c = 4, 2, _layer_bytes(cfg, 1, 2) / 1e9
    e = (k * c - (L - 1) * t_f) + (k * c - (L - 2) * t_b)
    slots = plan.microbatches + plan.pp - 1
    assert e > 0
    assert slow.offload_exposed_s == pytest.approx(slots * e, rel=1e-9)
    assert slow.step_time_s - base.step_time_s == pytest.approx(slots * e, rel=1e-9)
    assert slow.tokens_per_s_per_gpu == pytest.approx(
        plan.global_batch * SEQ / (slow.step_time_s * plan.gpus), rel=1e-12)


def test_interleaving_counts_chunk_slots():
    """Interleaved 1F1B: m·v + p − 1 chunk slots, each chunk its own offload schedule."""
    cfg = _config(8)
    plan = _plan(0.5, schedule="interleaved_1f1b", virtual_stages=2)
    hw = _hardware("gb200-nvl72", bandwidth_gbps=1.0, efficiency=1.0)
    costs = HardwareCostModel(hw, "bf16")
    t = offload_timing(cfg, plan, hw, costs)
    assert t.slots == 16 * 2 + 2 - 1
    assert [(s.rank, s.chunk, s.layers, s.offloaded) for s in t.stages] == \
        [(0, 0, 2, 1), (1, 0, 2, 1), (0, 1, 2, 1), (1, 1, 2, 1)]
    # k = L − 1: nothing overlaps the reload; the forward overlaps what its copy exceeds
    st = t.stages[0]
    assert st.exposed_backward_s == pytest.approx(st.copy_s, rel=1e-12)
    assert st.exposed_forward_s == pytest.approx(st.copy_s - st.forward_layer_s, rel=1e-12)
    assert t.step_exposed_s == pytest.approx(t.slots * st.exposed_s, rel=1e-12)


def test_gb300s_faster_c2c_exposes_less_than_gb200s():
    """GB300's NVLink-C2C copies at 359 GB/s measured against GB200's 193 (the presets'
    host_link efficiencies): with 3 of 4 layers offloaded both expose copies, GB300 less."""
    cfg = _config(8)
    gb200, gb300 = (simulate_gpt(cfg, _plan(0.75), hw) for hw in ("gb200-nvl72",
                                                                    "gb300-nvl72"))
    assert gb200.offload_exposed_s > gb300.offload_exposed_s > 0
    assert gb200.offload[0].copy_s > gb300.offload[0].copy_s


@pytest.mark.parametrize("L, k", [(4, 1), (4, 2), (8, 3), (8, 4), (80, 40)])
def test_the_copy_schedule_meets_its_closed_forms(L, k):
    """Copy-bound (c >= t, k <= L/2): k·c − (L−1)·t forward, k·c − (L−2)·t backward;
    compute-bound (c <= t) with k <= L − 2: hidden; k = L − 1: no overlap."""
    t = 1.0
    for c in (1.0, 1.7, 5.0, 40.0):
        assert forward_exposed_s(L, k, t, c) == pytest.approx(max(0, k * c - (L - 1) * t))
        assert backward_exposed_s(L, k, t, c) == pytest.approx(max(0, k * c - (L - 2) * t))
    for c in (0.2, 0.99, 1.0):
        assert forward_exposed_s(L, L - 2, t, c) == 0.0
        assert backward_exposed_s(L, L - 2, t, c) == 0.0
        assert forward_exposed_s(L, L - 1, t, c) == 0.0
        assert backward_exposed_s(L, L - 1, t, c) == pytest.approx((L - 1) * c)
    assert forward_exposed_s(L, 0, t, 99.0) == backward_exposed_s(L, 0, t, 99.0) == 0.0
    with pytest.raises(ValueError):
        forward_exposed_s(L, L, t, 1.0)


# -- refusals and the command line ---------------------------------------------------

def test_hardware_without_a_host_link_refuses_by_name():
    with pytest.raises(ConfigError, match=r"activation_offload=0\.5: needs a host link "
                                          r"\(NVLink-C2C on GB200/GB300\): h100-dgx has none"):
        simulate_gpt(_config(8), _plan(0.5), "h100-dgx")
    simulate_gpt(_config(8), _plan(0), "h100-dgx")            # no offload: as before


def test_zero_bubble_and_non_korthikanti_counts_are_refused():
    with pytest.raises(ConfigError, match="zero_bubble"):
        simulate_gpt(_config(8), _plan(0.5, schedule="zero_bubble"), "gb200-nvl72")
    gpt2 = GPTConfig(hidden=256, layers=4, heads=4, seq=256, vocab=1024)
    with pytest.raises(ValueError, match="torch_amp"):
        gpt_memory(gpt2, _plan(0.5, pp=1, tp=1), gpt_schedule(_plan(0.5, pp=1, tp=1)),
                   precision="torch_amp")


def test_cli_prints_host_memory_and_exposed_copy_time(capsys):
    args = ["simulate", "train", "--model", "llama-3.1-8b", "--layers", "8", "--seq",
            str(SEQ), "--tp", "2", "--pp", "2", "--global-batch", "16"]
    assert main(args + ["--hardware", "gb200-nvl72", "--activation-offload", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "activation offload 0.5" in out
    assert "(2 of 4) to host memory over the host link at 193 GB/s" in out
    assert "host memory          0.71 GB per GPU of 240.0 GB (fits)" in out
    assert "exposed copy time" in out
    assert main(args + ["--hardware", "h100-dgx", "--activation-offload", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--activation-offload=0.5: needs a host link" in err and "h100-dgx" in err
