"""The serving cost model on measured layer steps (:mod:`vcluster.timing.serving.
measured_steps`): synthetic ``decode_layer`` / ``prefill_layer`` rows made from known
DistServe coefficients are fitted back exactly, the step is priced from them (closed forms
of the module docstring, the attention pairs counted by brute force), the rows round-trip
through a hardware file, and a layer of another shape, tp or dtype is priced as before."""

import itertools
import re

import numpy as np
import pytest
import yaml

from modeling import load_model
from modeling.spec import MLP, Attention, Layer, ModelSpec
from vcluster.timing.kernel_profile import KernelTiming, LayerShape
from vcluster.timing.presets import hardware_from_dict, hardware_to_dict, load_hardware, preset
from vcluster.timing.serving.measured_steps import (fit_nonnegative_relative, layer_shape,
                                                    measured_layer_steps)
from vcluster.timing.serving.step_cost import ServingCostModel

H100 = preset("h100-dgx")
LLAMA_8B = load_model("llama-3.1-8b")
LLAMA_70B = load_model("llama-3.1-70b")
# per-layer seconds of the shape of an H100's Llama-3.1-8B layer: decode ~ weights read
# (436 MB at 3.35 TB/s: 130 us) + KV read (4 KB per context token: 1.2 ns); prefill
# ~ 2·218M FLOPs per token at 700 TFLOP/s (0.6 us) + attention's T² term
DECODE = (130e-6, 0.4e-6, 1.2e-9)           # a_d s, b_d s/sequence, c_d s/context token
PREFILL = (60e-6, 0.62e-6, 2.5e-11)         # a_p s, b_p s/token, c_p s/token²
BATCHES, CONTEXTS, PROMPTS = (1, 8, 32, 128), (512, 2048, 8192), (128, 512, 2048, 8192)


def _rows(shape: LayerShape, decode=DECODE, prefill=PREFILL, dtype="bf16", noise=None):
    """decode_layer and prefill_layer rows of ``shape`` at the sweep's points, timed
    exactly as the coefficients say (× 1 + noise[i] when given)."""
    out = []
    for b, c in itertools.product(BATCHES, CONTEXTS):
        out.append(("decode_layer", f"{b}x{c}", decode[0] + decode[1] * b + decode[2] * b * c))
    for t in PROMPTS:
        out.append(("prefill_layer", str(t), prefill[0] + prefill[1] * t + prefill[2] * t * t))
    if noise is not None:
        out = [(k, d, s * (1 + e)) for (k, d, s), e in zip(out, noise)]
    return [{"kind": k, "seconds": s, "dtype": dtype, "dims": d, "layer": str(shape)}
            for k, d, s in out]


def _hardware(rows) -> object:
    return load_hardware({"base": "h100-dgx", "device": {"kernels": rows}})


SHAPE_8B = layer_shape(LLAMA_8B.layers[0], 4096, 1)
MEASURED = _hardware(_rows(SHAPE_8B))


def _pairs(n: int, c: int) -> int:
    """(query, key) pairs of a chunk of n new tokens ending at context c, by counting."""
    return sum(p + 1 for p in range(c - n, c))


def test_the_shape_of_a_preset_layer():
    assert str(SHAPE_8B) == ("hidden=4096 heads=32 kv_heads=8 head_dim=128 mlp=swiglu "
                             "ffn=14336 tp=1")
    assert LayerShape.parse(str(SHAPE_8B)) == SHAPE_8B
    assert layer_shape(LLAMA_70B.layers[0], 8192, 4) == LayerShape(8192, 64, 8, 128,
                                                                   "swiglu", 28672, 4)
    assert layer_shape(load_model("mixtral-8x7b").layers[0], 4096, 1) is None     # MoE
    assert layer_shape(load_model("mistral-7b").layers[0], 4096, 1) is None       # window
    assert layer_shape(load_model("deepseek-v3").layers[0], 7168, 8) is None      # latent


def test_the_fit_recovers_known_coefficients():
    fits, unfit = measured_layer_steps(MEASURED.device.kernels)
    assert not unfit and set(fits) == {(SHAPE_8B, "bf16")}
    fit = fits[(SHAPE_8B, "bf16")]
    assert (fit.decode.a_s, fit.decode.b_s, fit.decode.c_s) == pytest.approx(DECODE, rel=1e-9)
    assert (fit.prefill.a_s, fit.prefill.b_s, fit.prefill.c_s) == pytest.approx(PREFILL,
                                                                                rel=1e-9)
    assert fit.decode.rows == 12 and fit.prefill.rows == 4
    assert fit.decode.max_error < 1e-9 and fit.prefill.max_error < 1e-9
    assert "12 rows" in repr(fit) and "hidden=4096" in repr(fit)


def test_the_fit_is_least_squares_on_relative_error():
    """Rows with ±3% noise: the coefficients are numpy's least squares of the relative
    system (x_i/t_i)·θ = 1, and the reported error is the largest |t̂/t − 1| of them."""
    noise = 0.03 * np.sin(np.arange(16) * 1.7)
    rows = _rows(SHAPE_8B, noise=noise)
    fit = measured_layer_steps(_hardware(rows).device.kernels)[0][(SHAPE_8B, "bf16")]
    x = np.array([[1, b, b * c] for b, c in itertools.product(BATCHES, CONTEXTS)], float)
    t = np.array([r["seconds"] for r in rows[:12]])
    theta = np.linalg.lstsq(x / t[:, None], np.ones(12), rcond=None)[0]
    assert (fit.decode.a_s, fit.decode.b_s, fit.decode.c_s) == pytest.approx(theta, rel=1e-9)
    assert fit.decode.max_error == pytest.approx(np.max(np.abs(x @ theta / t - 1)), rel=1e-9)
    assert 0.01 < fit.decode.max_error < 0.1


def test_negative_coefficients_become_zero_as_nnls_finds():
    """Rows whose unconstrained fit has a negative fixed part: the non-negative fit equals
    scipy's NNLS of the same relative system."""
    nnls = pytest.importorskip("scipy.optimize", reason="needs scipy for the reference").nnls
    x = np.array([[1, b, b * c] for b, c in itertools.product((1, 4, 16), (100, 1000))],
                 float)
    t = 1e-6 * x[:, 1] + 1e-9 * x[:, 2] - 2e-7 + 1e-8 * np.cos(np.arange(6))
    a = x / t[:, None]
    assert np.linalg.lstsq(a, np.ones(6), rcond=None)[0][0] < 0
    theta, err = fit_nonnegative_relative(x, t, "test")
    reference = nnls(a, np.ones(6))[0]
    assert theta == pytest.approx(reference, rel=1e-6, abs=1e-18)
    assert theta[0] == 0 and err == pytest.approx(np.max(np.abs(a @ theta - 1)))
    with pytest.raises(ValueError, match="test: 2 rows do not tell the 3 coefficients apart"):
        fit_nonnegative_relative(x[:2], t[:2], "test")


@pytest.mark.parametrize("rows", [
    [(1, 700)] * 13,                                   # decode only
    [(1, 100), (1, 5000), (1, 77)],
    [(3000, 3000)],                                    # one prompt
    [(512, 4096)],                                     # a chunk after 3584 earlier tokens
    [(300, 300), (40, 900)],                           # two prefill rows
    [(512, 1536)] + [(1, 1000)] * 16,                  # mixed
])
def test_step_priced_from_the_known_coefficients(rows):
    """layers_s is 32 layers × the closed form: decode a + b·B + c·ΣC, prefill
    a + b·Σn + c·Σ(2P − n) with P counted pair by pair, a mixed step the two less
    min(a_d, a_p) — within 1e-9; the layers' GEMMs, attention and per-layer elementwise
    are not priced again, and the LM head and overhead are the analytic model's."""
    model = ServingCostModel(LLAMA_8B, MEASURED)
    assert len(model.measured_layers) == 1
    decode = [c for n, c in rows if n == 1]
    prefill = [(n, c) for n, c in rows if n != 1]
    expected = 0.0
    if decode:
        expected += DECODE[0] + DECODE[1] * len(decode) + DECODE[2] * sum(decode)
    if prefill:
        expected += PREFILL[0] + PREFILL[1] * sum(n for n, _ in prefill) + PREFILL[2] * sum(
            2 * _pairs(n, c) - n for n, c in prefill)
    if decode and prefill:
        expected -= min(DECODE[0], PREFILL[0])
    step = model.step_time(rows)
    assert step.layers_s == pytest.approx(32 * expected, rel=1e-9)
    analytic = ServingCostModel(LLAMA_8B, H100).step_time(rows)
    assert step.gemm_s == 0 and step.attention_s == 0 and step.moe_s == 0
    assert step.lm_head_s == analytic.lm_head_s and step.overhead_s == analytic.overhead_s
    assert step.elementwise_s < analytic.elementwise_s / 30       # embedding + final norm
    assert step.total_s == pytest.approx(max(step.parts_s, step.floor_s), rel=1e-12)
    assert step.floor_s == analytic.floor_s
    assert "measured layers=" in repr(step)


def test_a_fresh_prompt_is_distserves_quadratic():
    """For one prompt of T tokens Σ(2P − n) is T²: the prefill form a + b·T + c·T²."""
    for t in (1000, 4097):
        assert 2 * _pairs(t, t) - t == t * t
        step = ServingCostModel(LLAMA_8B, MEASURED).step_time([(t, t)])
        assert step.layers_s / 32 == pytest.approx(
            PREFILL[0] + PREFILL[1] * t + PREFILL[2] * t * t, rel=1e-12)


def test_tensor_parallel_communication_stays_as_it_was():
    """Llama-3.1-70B at tp 4 on rows of its tp-4 shape: its all-reduces are the analytic
    model's, the layers the measured form's."""
    shape = layer_shape(LLAMA_70B.layers[0], 8192, 4)
    hw = _hardware(_rows(shape))
    rows = [(1, 3000)] * 24
    step = ServingCostModel(LLAMA_70B, hw, tp=4).step_time(rows)
    analytic = ServingCostModel(LLAMA_70B, H100, tp=4).step_time(rows)
    assert step.comm_s == analytic.comm_s > 0
    assert step.layers_s == pytest.approx(
        80 * (DECODE[0] + DECODE[1] * 24 + DECODE[2] * 24 * 3000), rel=1e-9)


def test_measured_and_analytic_layers_mix_by_shape():
    """A model of two full-attention layers and one sliding-window layer: the two priced
    from their rows, the windowed one analytically."""
    full, windowed = Layer(Attention(32, 8, 128), MLP("swiglu", 14336)), \
        Layer(Attention(32, 8, 128, window=1024), MLP("swiglu", 14336))
    spec = ModelSpec("mixed", 4096, 128256, (full, windowed, full))
    step = ServingCostModel(spec, MEASURED).step_time([(1, 4000)] * 8)
    assert step.layers_s == pytest.approx(
        2 * (DECODE[0] + DECODE[1] * 8 + DECODE[2] * 8 * 4000), rel=1e-9)
    one = ServingCostModel(spec.with_layers(2), H100).step_time([(1, 4000)] * 8)
    assert step.gemm_s == pytest.approx(one.gemm_s / 2, rel=1e-12)     # one layer's GEMMs
    assert step.attention_s == pytest.approx(one.attention_s - ServingCostModel(
        spec.with_layers(1), H100).step_time([(1, 4000)] * 8).attention_s, rel=1e-12)


@pytest.mark.parametrize("name, tp, kwargs", [
    ("llama-3.1-70b", 1, {}),                            # another shape
    ("llama-3.1-8b", 2, {}),                             # another tp
    ("llama-3.1-8b", 1, {"weight_bytes_per_param": 1}),  # fp8 weights, not the rows' bytes
    ("llama-3.1-8b", 1, {"dtype": "fp16"}),              # another dtype
    ("mixtral-8x7b", 2, {}),                             # MoE: never measured
])
def test_rows_of_another_layer_are_ignored(name, tp, kwargs):
    """The analytic price, figure for figure, when the rows are not this layer's."""
    spec = load_model(name)
    measured = ServingCostModel(spec, MEASURED, tp=tp, **kwargs)
    analytic = ServingCostModel(spec, H100, tp=tp, **kwargs)
    assert measured.measured_layers == ()
    for rows in ([(1, 2048)] * 64, [(8192, 8192)], [(512, 1536)] + [(1, 1000)] * 16):
        assert measured.step_time(rows) == analytic.step_time(rows)


def test_rows_that_cannot_be_fitted_are_ignored_and_say_why():
    rows = _rows(SHAPE_8B)
    decode_only = [r for r in rows if r["kind"] == "decode_layer"]
    two = [r for r in rows if r["dims"] in ("1x512", "8x512")] + rows[12:]
    for kept, why in ((decode_only, "no prefill_layer rows of hidden=4096"),
                      (two, "decode_layer rows .* 2 rows")):
        hw = _hardware(kept)
        fits, unfit = measured_layer_steps(hw.device.kernels)
        assert not fits and list(unfit) == [(SHAPE_8B, "bf16")]
        assert re.search(why, unfit[(SHAPE_8B, "bf16")])
        model = ServingCostModel(LLAMA_8B, hw)
        assert model.measured_layers == ()
        assert model.step_time([(1, 99)] * 3) == ServingCostModel(LLAMA_8B, H100).step_time(
            [(1, 99)] * 3)


def test_never_below_the_floor():
    """Rows far faster than the hardware allows: total_s is the floor."""
    hw = _hardware(_rows(SHAPE_8B, decode=(1e-9, 1e-12, 1e-15), prefill=(1e-9, 1e-12, 1e-18)))
    model = ServingCostModel(LLAMA_8B, hw, step_overhead_s=0.0)
    for rows in ([(1, 8192)] * 64, [(8192, 8192)]):
        step = model.step_time(rows)
        assert step.parts_s < step.floor_s == step.total_s


def test_rows_round_trip_through_a_hardware_file(tmp_path):
    rows = _rows(SHAPE_8B)
    hw = _hardware(rows)
    assert hardware_from_dict(hardware_to_dict(hw)) == hw
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump({"base": "h100-dgx", "name": "h100-measured-steps",
                                    "device": {"kernels": rows}}))
    again = load_hardware(str(path))
    assert again.device.kernels == hw.device.kernels
    assert ServingCostModel(LLAMA_8B, again).step_time([(1, 300)] * 5) == \
        ServingCostModel(LLAMA_8B, hw).step_time([(1, 300)] * 5)
    # the device's other pricing is untouched by rows it does not read
    assert hw.device.kernel_profile() is None and hw.device.gemm_profile() is None


def test_bad_rows_name_what_is_wrong():
    layer = str(SHAPE_8B)
    with pytest.raises(ValueError, match="a decode_layer kernel's dims are 2 integers"):
        KernelTiming("decode_layer", 1e-4, dtype="bf16", dims="8", layer=layer)
    with pytest.raises(ValueError, match="layer must be 'hidden=... heads=..."):
        KernelTiming("prefill_layer", 1e-4, dtype="bf16", dims="8", layer="hidden=4096")
    with pytest.raises(ValueError, match="LayerShape: mlp must be one of gelu, swiglu"):
        KernelTiming("prefill_layer", 1e-4, dtype="bf16", dims="8",
                     layer=layer.replace("swiglu", "relu"))
    with pytest.raises(ValueError, match="LayerShape: tp must be an int >= 1, got 0"):
        LayerShape(4096, 32, 8, 128, "swiglu", 14336, 0)
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp16, fp32, got ''"):
        KernelTiming("prefill_layer", 1e-4, dims="8", layer=layer)
    with pytest.raises(ValueError, match="layer is for the kinds decode_layer"):
        KernelTiming("gemm", 1e-4, m=1, k=1, n=1, layer=layer)
    with pytest.raises(ValueError, match=r"device.kernels\[0\]: unknown key"):
        load_hardware({"base": "h100-dgx", "device": {"kernels": [{
            "kind": "decode_layer", "seconds": 1e-4, "dims": "1x1", "shape": layer}]}})
