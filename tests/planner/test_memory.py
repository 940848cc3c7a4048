"""The memory model of issue 26: flash attention by default, the logits, the distributed
optimizer, and a breakdown with the reserve — checked against hand-computed closed forms
and through the real `vcluster simulate gpt` and `vcluster plan gpt` commands."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner import plan_gpt
from vcluster.planner.memory import gpt_memory
from vcluster.planner.simulation import gpt_schedule

pytestmark = pytest.mark.timeout(300)

# issue 26's 1.3B GPT on one H100: h 2048, 24 layers, 16 heads, seq 2048, micro-batch 4
H, L, A, S, V, B = 2048, 24, 16, 2048, 50304, 4
GPT13 = ["--hidden", str(H), "--layers", str(L), "--heads", str(A), "--seq", str(S),
         "--vocab", str(V), "--global-batch", str(B), "--micro-batch", str(B),
         "--hardware", "h100-dgx"]
UNFUSED_BEFORE_GB = 71.5     # this configuration's peak before issue 26 (no logits)


def _simulate(tmp_path, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *GPT13,
                           *extra, "--json", str(out)], capture_output=True, text=True,
                          timeout=240)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_a_1_3b_gpt_fits_one_h100_with_flash_attention(tmp_path):
    proc, r = _simulate(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert r["fits"] is True
    assert r["peak_memory_gb"] <= 0.65 * UNFUSED_BEFORE_GB
    parts = r["memory_breakdown_gb"]
    assert set(parts) == {"rank_position", "params", "grads", "optimizer", "activations",
                          "logits", "reserve"}
    assert sum(parts[k] for k in ("params", "grads", "optimizer", "activations", "logits")) \
        == pytest.approx(r["peak_memory_gb"])
    assert parts["reserve"] == pytest.approx(0.05 * 80.0)            # the headroom of 80 GB
    assert parts["logits"] == pytest.approx(4 * B * S * V / 1e9)      # fp32 logits
    row = r["memory"][0]
    assert row["logits_bytes"] == 4 * B * S * V and row["reserve_bytes"] == 4 * 10**9
    assert "params 2.8, grads 5.7, optimizer 17.0" in proc.stdout

    proc, unfused = _simulate(tmp_path, "--attention", "unfused")
    assert proc.returncode == 0
    added = unfused["peak_memory_gb"] - r["peak_memory_gb"]
    # by hand: per layer the s² terms 5·a·s²·b bytes replace flash's 4·b·a·s statistics
    assert added * 1e9 == pytest.approx(L * (5 * A * S * S * B - 4 * B * A * S), rel=1e-9)
    assert added >= 25
    assert unfused["peak_memory_gb"] - unfused["memory_breakdown_gb"]["logits"] \
        == pytest.approx(UNFUSED_BEFORE_GB, abs=0.1)                 # the old formula


def test_distributed_optimizer_divides_the_optimizer_state_by_dp():
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=512, vocab=32000)
    for dp, pp, tp in ((8, 1, 1), (4, 2, 2), (2, 4, 1)):
        plain = ParallelConfig(global_batch=8 * dp, dp=dp, pp=pp, tp=tp)
        sharded = ParallelConfig(global_batch=8 * dp, dp=dp, pp=pp, tp=tp,
                                 distributed_optimizer=True)
        for a, b in zip(gpt_memory(cfg, plain, gpt_schedule(plain)),
                        gpt_memory(cfg, sharded, gpt_schedule(sharded))):
            assert b.optimizer_bytes == pytest.approx(a.optimizer_bytes / dp, abs=1)
            assert (b.params_bytes, b.grads_bytes, b.activations_bytes, b.logits_bytes) == \
                (a.params_bytes, a.grads_bytes, a.activations_bytes, a.logits_bytes)


def test_zero_stages_divide_optimizer_gradients_and_weights_by_dp():
    """ZeRO-1: 6 + 12/dp bytes per parameter; ZeRO-2: 2 + 16/dp (+ one module's fp32
    gradient); ZeRO-3: 18/dp (+ two modules' weights)."""
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=512, vocab=32000)
    h, V, s = cfg.hidden, cfg.vocab, cfg.seq
    for dp, tp in ((8, 1), (4, 2)):
        pars = [ParallelConfig(global_batch=8 * dp, dp=dp, tp=tp, zero_stage=z)
                for z in range(4)]
        (m0,), (m1,), (m2,), (m3,) = (gpt_memory(cfg, p, gpt_schedule(p)) for p in pars)
        params = m0.params_bytes / 2
        largest = max((12 * h * h + 7 * h) / tp + 6 * h, V * h / tp + s * h)
        assert m1 == replace(m0, optimizer_bytes=m1.optimizer_bytes)
        assert m1.optimizer_bytes == pytest.approx(12 * params / dp, abs=1)
        assert m2.grads_bytes == pytest.approx(4 * params / dp + 4 * largest, abs=1)
        assert (m2.params_bytes, m2.optimizer_bytes) == (m0.params_bytes, m1.optimizer_bytes)
        assert m3.params_bytes == pytest.approx(2 * params / dp + 2 * 2 * largest, abs=1)
        assert (m3.grads_bytes, m3.optimizer_bytes) == (m2.grads_bytes, m1.optimizer_bytes)
        assert m3.total_bytes < m2.total_bytes < m1.total_bytes < m0.total_bytes


def test_logits_live_on_the_last_stage_only():
    cfg = GPTConfig(hidden=512, layers=8, heads=8, seq=256, vocab=32000)
    for pp, v, schedule in ((4, None, "1f1b"), (4, 2, "interleaved_1f1b")):
        par = ParallelConfig(global_batch=16, micro_batch=2, pp=pp, tp=2, schedule=schedule,
                             virtual_stages=v)
        logits = [m.logits_bytes for m in gpt_memory(cfg, par, gpt_schedule(par))]
        assert logits == [0, 0, 0, 4 * 2 * 256 * 32000 // 2]


def test_the_planner_shards_the_optimizer_where_memory_needs_it():
    """A 1.3B model on 8 H100s with 16 GB usable each: only dp = 8 with the state sharded
    fits among the tp = pp = 1 splits."""
    kwargs = dict(hidden=H, layers=L, heads=A, seq=1024, vocab=V, gpus=8, global_batch=64,
                  hardware="h100-dgx", replay=0, memory_headroom=0.8, progress=False)
    auto = plan_gpt(**kwargs)
    pure_dp = auto[(auto["tp"] == 1) & (auto["pp"] == 1)]
    assert len(pure_dp) and pure_dp["distributed_optimizer"].all()
    off = plan_gpt(**kwargs, distributed_optimizer=False)
    assert not off["distributed_optimizer"].any()
    assert len(off[(off["tp"] == 1) & (off["pp"] == 1)]) == 0
    assert off.attrs["rejected"]["out_of_memory"] > auto.attrs["rejected"]["out_of_memory"]


def test_bad_memory_options_are_named():
    with pytest.raises(ValueError, match="attention=.*: not a known value; allowed: one of "
                                         "flash, unfused, flash-v1"):
        ParallelConfig(global_batch=8, attention="paged")
    with pytest.raises(ValueError, match="distributed_optimizer='yes': not a boolean"):
        ParallelConfig(global_batch=8, distributed_optimizer="yes")
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *GPT13,
                           "--attention", "paged"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--attention" in proc.stderr


def test_quantised_gemm_inputs_are_kept_at_their_formats_size():
    """Transformer Engine keeps a linear layer's quantised input for its weight gradient:
    with g bytes per element (fp8 1, mxfp8 1 + 1/32, nvfp4 0.5 + 1/16) a Llama layer keeps
    its two norms' outputs and SwiGLU's product at g, and W_o's copy of the attention
    output (g·h_q) beside the bf16 one; a routed expert row its input and product at g.
    Against the bf16 count: s·b·((2g − 4)·h/σ + g·h_q/t + (g − 2)·f/t) per dense layer,
    R·(g − 2)·(h + f_e) more per MoE layer (R: routed rows); recomputed modules drop
    their own share at g; the GPT block is refused by name."""
    from vcluster.planner.memory import (layer_activation_bytes, moe_routed_rows,
                                         rank_memory)
    from vcluster.planner.precision import MEGATRON, MEGATRON_BF16
    from vcluster.timing.gemm_formats import GEMM_FORMATS
    assert {n: f.stored_bytes for n, f in GEMM_FORMATS.items()} == {
        "fp8": 1, "fp8-row": 1, "fp8-block": 1 + 4 / 128, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32,
        "nvfp4": 0.5 + 1 / 16}
    q = MEGATRON_BF16.with_quantised_gemm_inputs("mxfp8")
    assert q.name == "megatron_bf16+mxfp8" and q.gemm_input_bytes == 1 + 1 / 32
    assert (q.weight_bytes, q.grad_bytes, q.optimizer_bytes) == (2, 2, 12)
    cfg = GPTConfig(hidden=512, layers=4, heads=8, seq=256, vocab=1024, arch="llama",
                    kv_heads=2, ffn_hidden=1408)
    h, f, s, hq = 512, 1408, 256, 512
    for t, sp, b in ((1, False, 2), (2, True, 1), (2, False, 3)):
        par = ParallelConfig(global_batch=8 * b, micro_batch=b, tp=t, sequence_parallel=sp)
        sigma = t if sp else 1
        for g in (1, 1 + 1 / 32, 0.5 + 1 / 16):
            diff = layer_activation_bytes(cfg, par, 0, gemm_input_bytes=g) \
                - layer_activation_bytes(cfg, par, 0)
            assert diff == pytest.approx(s * b * ((2 * g - 4) * h / sigma + g * hq / t
                                                  + (g - 2) * f / t)), (t, sp, b, g)
        # selective recomputation of the norms and the MLP: what is dropped is at g too
        rec = replace(par, recompute="selective", recompute_modules=("layernorm", "mlp"))
        diff = layer_activation_bytes(cfg, rec, 0, gemm_input_bytes=1) \
            - layer_activation_bytes(cfg, rec, 0)
        assert diff == pytest.approx(s * b * hq / t), (t, sp, b)
    # the whole rank, through the policy
    par = ParallelConfig(global_batch=8, micro_batch=2)
    bf16, fp8 = (rank_memory(cfg, par, 0, 1, precision=p)
                 for p in (MEGATRON, MEGATRON.with_quantised_gemm_inputs("fp8")))
    assert fp8.activations_bytes - bf16.activations_bytes == pytest.approx(
        4 * s * 2 * (-2 * h + hq - f), abs=8)
    assert (fp8.params_bytes, fp8.grads_bytes, fp8.optimizer_bytes) == \
        (bf16.params_bytes, bf16.grads_bytes, bf16.optimizer_bytes)
    # mixture of experts: each routed row's input and product
    moe = replace(cfg, experts=8, moe_top_k=2, moe_ffn_hidden=384)
    par = ParallelConfig(global_batch=8, micro_batch=2, ep=1)
    rows = moe_routed_rows(moe, par)
    dense = s * 2 * ((2 * 1 - 4) * h + hq - f)
    diff = layer_activation_bytes(moe, par, 0, gemm_input_bytes=1) \
        - layer_activation_bytes(moe, par, 0)
    assert diff == pytest.approx(dense - s * 2 * (1 - 2) * f + rows * (1 - 2) * (h + 384))
    gpt = GPTConfig(hidden=512, layers=4, heads=8, seq=256, vocab=1024)
    with pytest.raises(ValueError, match="quantised GEMM inputs .* Llama block only"):
        layer_activation_bytes(gpt, par, 0, gemm_input_bytes=1)


def test_an_moe_layer_keeps_its_routed_rows_and_nothing_on_the_token_side():
    """A routed MoE layer keeps, beside the attention block, each routed row's input, gate,
    up and product (16-bit) and its fp32 routing probability — Megatron-Core applies the
    probabilities in the expert's activation (Megatron-LM !2668), so nothing of the k·s·b
    dispatched or combined rows stays on the token side, however large k is; moe_act
    re-runs the product."""
    from vcluster.planner.memory import (ROUTED_PROB_BYTES, layer_activation_bytes,
                                         llama_activation_bytes_per_layer, moe_routed_rows)
    dense = GPTConfig(hidden=512, layers=4, heads=8, seq=256, vocab=1024, arch="llama",
                      kv_heads=2, ffn_hidden=1408)
    h, f_e = 512, 384
    for k, b, ep in ((2, 2, 1), (8, 1, 1), (8, 2, 2)):
        moe = replace(dense, experts=8, moe_top_k=k, moe_ffn_hidden=f_e)
        par = ParallelConfig(global_batch=8 * b * ep, micro_batch=b, dp=ep, ep=ep)
        rows = moe_routed_rows(moe, par)
        assert rows == k * 256 * b            # balanced: every rank receives its share
        attention_block = llama_activation_bytes_per_layer(dense, b, 1, "none", False) \
            - 6 * 256 * b * 1408              # the dense layer less its SwiGLU
        assert layer_activation_bytes(moe, par, 0) == pytest.approx(
            attention_block + rows * (2 * h + 6 * f_e + ROUTED_PROB_BYTES)), (k, b, ep)
        act = replace(par, recompute="selective", recompute_modules=("moe_act",))
        assert layer_activation_bytes(moe, par, 0) - layer_activation_bytes(moe, act, 0) \
            == pytest.approx(rows * 2 * f_e)
