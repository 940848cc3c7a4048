"""torchao's float8 cast kernels beside each FP8 GEMM (vcluster.planner.float8_casts):
their bytes against torchao's roofline model written out by hand for a traced Llama
layer — every linear's input, weight and output gradient, both recipes — under tensor and
sequence parallelism (tensorwise casts the gathered operands on their shard, rowwise after
the bf16 gather), with the TE overlap's pieces casting each weight once; the head and the
GPT-only refusals; and a simulated step that grows by their time."""

import dataclasses
import json
import subprocess
import sys

import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.planner.float8_casts import (CAST_NAME, FP8_CASTS, check_fp8_casts,
                                           with_float8_casts)
from vcluster.planner.simulation import fp8_gemm, simulate_gpt
from vcluster.runtime.tracing import TraceCompute, trace_program

pytestmark = pytest.mark.timeout(300)

H, F, HEADS, KV, S = 64, 96, 4, 2, 32
CFG = GPTConfig(hidden=H, layers=1, heads=HEADS, kv_heads=KV, seq=S, vocab=128, arch="llama",
                ffn_hidden=F, dtype="float16")
KV_WIDTH = 2 * KV * H // HEADS             # W_kv: K and V of the grouped heads


def _traced(parallel: ParallelConfig):
    mesh = parallel.mesh()
    return trace_program(mesh, train_program, GPT(CFG).meta_args(mesh, parallel),
                         ranks=[0])[0].ops


def _cast_bytes(ops, tiny: bool = False) -> dict:
    """Bytes of the added cast kernels by (linear's GEMM, operand); the 4-byte kernels of
    the partial maxima apart (``tiny``: count those instead)."""
    out: dict = {}
    for op in ops:
        if type(op) is TraceCompute and CAST_NAME in op.name:
            if (op.bytes == 4) != tiny:
                continue
            gemm, operand = op.name.split(f": {CAST_NAME} ")
            key = (gemm.split(": ")[-1], operand)
            out[key] = out.get(key, 0) + (1 if tiny else op.bytes)
    return out


def _linears(tp: int):
    """(forward GEMM, input-gradient GEMM, weight-gradient GEMM, K in, N out per rank,
    column-parallel, torchtitan nn.Linears) of the traced Llama layer."""
    return [("x @ W_q", "dx = dq W_q^T", "dW_q = x^T dq", H, H // tp, True, 1),
            ("x @ W_kv", "dx += dkv W_kv^T", "dW_kv = x^T dkv", H, KV_WIDTH // tp, True, 2),
            ("ctx @ W_o", "dctx = dy W_o^T", "dW_o = ctx^T dy", H // tp, H, False, 1),
            ("x @ W_gate", "du = dzg W_gate^T", "dW_gate = x^T dzg", H, F // tp, True, 1),
            ("x @ W_up", "du += dzu W_up^T", "dW_up = x^T dzu", H, F // tp, True, 1),
            ("a @ W_down", "da = dy W_down^T", "dW_down = a^T dy", F // tp, H, False, 1)]


# torchao's roofline (float8_casts' table): B per element of input / grad_output, weight
ROOFLINE = {"torchao-tensorwise": (2 + 4, 2 + 3, 3, 0),     # in+go, w fwd, w bwd, in at dW
            "torchao-rowwise": (5, 3, 4 + 3, 3)}


@pytest.mark.parametrize("recipe", list(FP8_CASTS))
@pytest.mark.parametrize("tp, overlap", [(1, "backward"), (2, "backward"), (2, "te")])
def test_cast_bytes_are_torchaos_roofline_per_linear(recipe, tp, overlap):
    """Each linear of one micro-batch of B·s tokens: the input (M×K) after the forward
    GEMM, the weight's forward and backward casts (K×N), the output gradient (M×N) after
    the input-gradient GEMM, and for rowwise the input's transpose at the weight gradient.
    With sequence parallelism the gathered operands (a column-parallel linear's input, a
    row-parallel one's output gradient) are cast on this rank's 1/tp of the rows under
    tensorwise, whole under rowwise; the TE overlap's tp pieces add up to the same bytes."""
    par = ParallelConfig(global_batch=2, micro_batch=2, tp=tp, sequence_parallel=tp > 1,
                         tp_overlap=overlap)
    tokens = 2 * S
    ops = with_float8_casts(_traced(par), recipe, fp8_gemm, tokens, tp if tp > 1 else 1)
    got = _cast_bytes(ops)
    act, w_fwd, w_bwd, at_dw = ROOFLINE[recipe]
    row_act = 8 if recipe == "torchao-rowwise" else 6     # rowwise: 5 + 3 per element
    shard = tp if recipe == "torchao-tensorwise" else 1
    for fwd, dgrad, wgrad, k, n, column, linears in _linears(tp):
        in_rows = tokens // shard if column else tokens
        go_rows = tokens if column else tokens // shard
        first = act if recipe == "torchao-tensorwise" else 5
        assert got[(fwd, "input")] == first * in_rows * k * linears, (fwd, got)
        assert got[(fwd, "weight")] == w_fwd * k * n, fwd
        assert got[(dgrad, "grad_output")] == row_act * go_rows * n, dgrad
        assert got[(dgrad, "weight")] == w_bwd * k * n, dgrad
        assert got.get((wgrad, "input"), 0) == at_dw * in_rows * k * linears, wgrad
    assert not any("logits" in g or "dlogits" in g for g, _ in got)    # the head stays bf16
    tiny = _cast_bytes(ops, tiny=True)                  # tensorwise: partial maxima kernels
    if recipe == "torchao-tensorwise":
        pieces = tp if overlap == "te" else 1
        assert tiny[("x @ W_q", "input")] == pieces and tiny[("x @ W_kv", "input")] == 2 * pieces
    else:
        assert not tiny


def test_recomputed_forward_casts_again():
    """Full recomputation re-runs every forward GEMM, and with it their casts."""
    plain = ParallelConfig(global_batch=2, micro_batch=2)
    full = dataclasses.replace(plain, recompute="full")
    n_plain, n_full = (sum(_cast_bytes(with_float8_casts(_traced(p), "torchao-tensorwise",
                                                         fp8_gemm, 2 * S)).values())
                       for p in (plain, full))
    forward = sum(v for (g, operand), v in _cast_bytes(with_float8_casts(
        _traced(plain), "torchao-tensorwise", fp8_gemm, 2 * S)).items()
        if not g.startswith("d"))
    assert n_full == n_plain + forward


def test_refusals_name_the_argument():
    assert check_fp8_casts(None, False) is None
    with pytest.raises(ValueError, match=r"fp8_casts='te' is not known; use None .* "
                                         r"torchao-tensorwise, torchao-rowwise"):
        check_fp8_casts("te", True)
    with pytest.raises(ValueError, match=r"scale per row: it needs fp8=True and gemm_format "
                                         r"'fp8' or 'fp8-row' \(got fp8=False"):
        check_fp8_casts("torchao-rowwise", False)
    with pytest.raises(ValueError, match=r"gemm_format='mxfp8'"):
        check_fp8_casts("torchao-tensorwise", True, "mxfp8")
    # tensorwise runs per-tensor GEMMs: not the row-scaled format
    with pytest.raises(ValueError, match=r"scale per tensor: it needs fp8=True and "
                                         r"gemm_format 'fp8' \(got fp8=True, "
                                         r"gemm_format='fp8-row'\)"):
        check_fp8_casts("torchao-tensorwise", True, "fp8-row")
    assert check_fp8_casts("torchao-rowwise", True, "fp8-row") == "torchao-rowwise"
    cfg = dataclasses.replace(CFG, dtype="float64")
    with pytest.raises(ValueError, match="fp8_casts="):
        simulate_gpt(cfg, ParallelConfig(global_batch=8, micro_batch=2), "h100-dgx",
                     fp8_casts="torchao-tensorwise")
    for other in (GPTConfig(hidden=64, layers=2, heads=4, seq=32, vocab=64),
                  dataclasses.replace(cfg, experts=4, moe_ffn_hidden=32)):
        with pytest.raises(ValueError, match=r"fp8_casts='torchao-tensorwise' prices "
                                             r"torchao's casts for the linears of the dense "
                                             r"Llama layer .*got arch="):
            simulate_gpt(other, ParallelConfig(global_batch=8, micro_batch=2), "h100-dgx",
                         fp8=True, fp8_casts="torchao-tensorwise")


def test_a_simulated_step_pays_the_casts():
    """Llama 3.1 8B's shapes on 8 H100s (one layer's worth of the step is enough to see
    it): the casts add time, rowwise more than tensorwise, and the result says which."""
    cfg = GPTConfig(hidden=4096, layers=4, heads=32, kv_heads=8, seq=8192, vocab=128256,
                    arch="llama", ffn_hidden=14336)
    par = ParallelConfig(global_batch=8, micro_batch=1, dp=8, zero_stage=3,
                         attention="flash2")
    none, tensorwise, rowwise = (simulate_gpt(cfg, par, "h100-dgx", fp8=True, fp8_casts=c)
                                 for c in (None, "torchao-tensorwise", "torchao-rowwise"))
    assert none.step_time_s < tensorwise.step_time_s < rowwise.step_time_s
    assert (none.fp8_casts, tensorwise.fp8_casts) == (None, "torchao-tensorwise")
    # the recipe names its GEMMs' format: rowwise runs the row-scaled one, whether the
    # caller asked for fp8 or fp8-row
    assert (none.gemm_format, tensorwise.gemm_format, rowwise.gemm_format) == (
        "fp8", "fp8", "fp8-row")
    assert simulate_gpt(cfg, par, "h100-dgx", fp8=True, gemm_format="fp8-row",
                        fp8_casts="torchao-rowwise").step_time_s == rowwise.step_time_s
    # tensorwise by hand: per token and layer the inputs of W_q, W_k, W_v, W_o, W_gate,
    # W_up (h each) and W_down (f), the output gradients of W_q, W_o, W_down (h), W_k and
    # W_v (2048 together), W_gate and W_up (f), 6 B per element; the weights 8 B per
    # element; at the H100's 3.35 TB/s that is the floor of the added time, which the
    # achieved bandwidth and the kernels' launches raise by less than 2.5x
    h, f, t = 4096, 14336, 8192
    per_layer = 6 * t * ((6 * h + f) + (3 * h + 2048 + 2 * f)) + 8 * (
        2 * h * h + h * 2048 + 3 * h * f)
    floor_s = 4 * per_layer / 3.35e12
    assert floor_s < tensorwise.step_time_s - none.step_time_s < 2.5 * floor_s


def _simulate(*flags):
    return subprocess.run([sys.executable, "-m", "vcluster", "simulate", "train",
                           "--arch", "llama", "--hidden", "512", "--layers", "2", "--heads",
                           "8", "--kv-heads", "2", "--ffn-hidden", "1024", "--seq", "256",
                           "--vocab", "1024", "--global-batch", "2", "--micro-batch", "1",
                           "--hardware", "h100-dgx", *flags],
                          capture_output=True, text=True, timeout=240)


def test_the_cli_flag(tmp_path):
    out = _simulate("--fp8", "--fp8-casts", "torchao-rowwise", "--json",
                    str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    assert "FP8-ROW linear layers with torchao-rowwise's cast kernels" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["fp8_casts"] == "torchao-rowwise"
    out = _simulate("--fp8-casts", "torchao-tensorwise")
    assert out.returncode == 2 and "--fp8-casts torchao-tensorwise prices torchao's casts " \
        "to FP8: it needs --fp8 (or --gemm-format fp8), got neither" in out.stderr
    out = _simulate("--gemm-format", "fp8-row", "--fp8-casts", "torchao-rowwise")
    assert out.returncode == 0, out.stderr
    out = _simulate("--gemm-format", "fp8-row", "--fp8-casts", "torchao-tensorwise")
    assert out.returncode == 2 and "--fp8-casts torchao-tensorwise prices torchao's casts " \
        "to FP8: it needs --fp8 (or --gemm-format fp8), got --gemm-format fp8-row" \
        in out.stderr
    out = _simulate("--fp8-casts", "te")
    assert out.returncode == 2 and "--fp8-casts: invalid choice: 'te'" in out.stderr
