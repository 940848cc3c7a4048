"""``vcluster bench gpu-decode``: one layer's decode and prefill steps timed with PyTorch
(:mod:`vcluster.gpu.decode_step`), carried in a hardware file, priced by the serving cost
model. The whole path runs on the CPU at tiny sizes here; the GPU test (skipped without
CUDA, saying so) runs the real sweep and checks the cost model on its own rows."""

import json
import re

import pytest
import yaml

from modeling import ConfigError, load_model
from modeling.counts import layer_params
from modeling.spec import MLP, Attention, Layer, ModelSpec
from vcluster.cli.main import main
from vcluster.gpu.decode_step import (TorchLayer, layer_steps_hardware, measure_layer_steps)
from vcluster.gpu.kernel_sweep import cuda_missing
from vcluster.timing.kernel_profile import LayerShape
from vcluster.timing.presets import hardware_from_dict, hardware_to_dict, load_hardware
from vcluster.timing.serving.measured_steps import layer_shape, measured_layer_steps
from vcluster.timing.serving.step_cost import ServingCostModel

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
pytestmark = pytest.mark.timeout(300)

# a Llama-shaped model small enough for the CPU: GQA (4 query heads over 2 KV heads)
TINY = ModelSpec("tiny-llama", 256, 1000,
                 (Layer(Attention(4, 2, 64), MLP("swiglu", 512)),) * 2)
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
               "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "max_position_embeddings": 2048, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_sweep():
    return measure_layer_steps(TINY, device="cpu", repeats=3)


def _reference_layer(m: TorchLayer, x):
    """The layer by hand (independent of SDPA, enable_gqa and rms_norm): causal softmax
    attention with each KV head repeated over its query heads, RMSNorms as formulas."""
    b, s, _ = x.shape
    hq, hkv, d = m.hq, m.hkv, m.d

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + m.eps) * w

    qkv = rms(x, m.n1) @ m.w_qkv.T
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q = q.view(b, s, hq, d).transpose(1, 2)
    k = k.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    v = v.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, hq * d)
    x = x + a @ m.w_o.T
    gate, up = (rms(x, m.n2) @ m.w_up.T).chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ m.w_down.T


def test_the_timed_layer_computes_a_transformer_layer():
    """Prefill equals the layer written by hand; a decode step over the cache that prefill
    filled equals prefill's last position (the cache write and GQA attention are right);
    the weights are modeling's count of the layer."""
    gen = torch.Generator().manual_seed(0)
    m = TorchLayer(torch, TINY, TINY.layers[0], 1, "cpu", torch.float64, gen)
    assert m.params == layer_params(TINY.layers[0], TINY)[0]
    t = 24
    x = torch.randn(1, t, 256, generator=gen, dtype=torch.float64)
    k_cache = torch.zeros(1, 2, t, 64, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    with torch.inference_mode():
        prefill = m.forward(x, k_cache, v_cache, causal=True)
        torch.testing.assert_close(prefill, _reference_layer(m, x), rtol=1e-10, atol=1e-10)
        keys = k_cache.clone()
        decode = m.forward(x[:, -1:], k_cache, v_cache, causal=False)
    torch.testing.assert_close(decode, prefill[:, -1:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(k_cache, keys, rtol=0, atol=1e-12)   # rewrote its own key


def test_tensor_parallel_shard_holds_its_share():
    """tp 2: half the heads, KV heads and MLP width (norms whole); tp 4 over 2 KV heads:
    one KV head each, replicated as vLLM replicates it."""
    gen = torch.Generator().manual_seed(0)
    full = layer_params(TINY.layers[0], TINY)[0]
    norms = 2 * 256
    half = TorchLayer(torch, TINY, TINY.layers[0], 2, "cpu", torch.float32, gen)
    assert (half.hq, half.hkv, half.f) == (2, 1, 256)
    assert half.params == (full - norms) / 2 + norms
    quarter = TorchLayer(torch, TINY, TINY.layers[0], 4, "cpu", torch.float32, gen)
    assert (quarter.hq, quarter.hkv, quarter.f) == (1, 1, 128)


def test_cpu_sweep_gives_sane_figures(tiny_sweep):
    """Every point timed (seconds > 0), the largest decode step (B·C = 4096 keys) slower
    than the smallest (64) and the longest prompt (256 tokens) than the shortest (16) —
    margins of 2-10x on this loaded 2-core machine; the rows name the layer's shape."""
    s = tiny_sweep
    assert s.device == "cpu" and s.dtype == "fp32" and not s.skipped
    assert [(b, c) for b, c, _ in s.decode] == [(1, 64), (8, 64), (1, 512), (8, 512)]
    assert [t for t, _ in s.prefill] == [16, 64, 128, 256]
    assert all(sec > 0 for *_, sec in s.decode + s.prefill)
    decode = {(b, c): sec for b, c, sec in s.decode}
    assert decode[(8, 512)] > decode[(1, 64)]        # 64x the keys, 8x the GEMM rows
    assert s.prefill[-1][1] > s.prefill[0][1]
    assert s.layer == layer_shape(TINY.layers[0], 256, 1) == LayerShape(
        256, 4, 2, 64, "swiglu", 512, 1)
    rows = s.rows()
    assert [r.kind for r in rows] == ["decode_layer"] * 4 + ["prefill_layer"] * 4
    assert {r.layer for r in rows} == {str(s.layer)} and {r.dtype for r in rows} == {"fp32"}
    assert rows[1].dims == "8x64" and rows[-1].dims == "256"
    assert "tiny-llama" in repr(s) and "median of 3" in repr(s)


def test_the_file_round_trips_and_the_cost_model_uses_it(tiny_sweep, tmp_path):
    """The document loads, survives hardware_to_dict / hardware_from_dict and YAML text
    unchanged; an fp32 serving model of the tiny spec prices its layers from the rows (and
    a bf16 one, of another dtype, does not)."""
    doc = layer_steps_hardware(tiny_sweep, "h100-dgx", name="tiny-cpu-steps")
    hw = load_hardware(doc)
    assert hw.name == "tiny-cpu-steps" and hw.node == load_hardware("h100-dgx").node
    assert hw.device.kernels == tiny_sweep.rows()
    assert hardware_from_dict(hardware_to_dict(hw)) == hw
    path = tmp_path / "steps.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_hardware(str(path)) == hw
    fits, unfit = measured_layer_steps(hw.device.kernels)
    assert not unfit and set(fits) == {(tiny_sweep.layer, "fp32")}
    fp32 = ServingCostModel(TINY, hw, dtype="fp32", weight_bytes_per_param=4,
                            kv_bytes_per_element=4)
    assert fp32.measured_layers == (fits[(tiny_sweep.layer, "fp32")],)
    step = fp32.step_time([(1, 512)] * 8)
    fit = fp32.measured_layers[0]
    assert step.layers_s == pytest.approx(2 * fit.decode.time_s(8, 8 * 512), rel=1e-12)
    assert ServingCostModel(TINY, hw).measured_layers == ()


def test_a_base_file_keeps_its_rows_and_replaces_this_layers(tiny_sweep):
    """On a hardware document (a calibrate --gpu file read back): its constants and other
    rows kept, this layer's rows replaced rather than doubled, its name kept."""
    base = {"base": "h100-dgx", "name": "my-h100",
            "device": {"kernel_overhead_us": 4.5,
                       "kernels": [{"kind": "launch", "seconds": 6e-6}]}}
    once = layer_steps_hardware(tiny_sweep, base)
    twice = layer_steps_hardware(tiny_sweep, once)
    hw = load_hardware(twice)
    assert hw.name == "my-h100" and hw.device.kernel_overhead_us == 4.5
    assert [r.kind for r in hw.device.kernels].count("decode_layer") == 4
    assert hw.device.kernels[0].kind == "launch" and len(hw.device.kernels) == 9
    with pytest.raises(ValueError, match="a preset's name"):
        layer_steps_hardware(tiny_sweep, "h100-dgx", name="h100-dgx")
    with pytest.raises(ValueError, match="base = 'nope'"):
        layer_steps_hardware(tiny_sweep, "nope")


def test_refuses_what_it_cannot_build_by_name():
    with pytest.raises(ConfigError, match="model='mixtral-8x7b'.*MoE"):
        measure_layer_steps(load_model("mixtral-8x7b"), device="cpu")
    with pytest.raises(ConfigError, match="model='mistral-7b'.*window 4096"):
        measure_layer_steps(load_model("mistral-7b"), device="cpu")
    with pytest.raises(ConfigError, match="tp=3"):
        measure_layer_steps(TINY, tp=3, device="cpu")
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu', got 'tpu'"):
        measure_layer_steps(TINY, device="tpu")
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        measure_layer_steps(TINY, device="cpu", repeats=0)
    with pytest.raises(ValueError, match=r"batches must be .* got \(0,\)"):
        measure_layer_steps(TINY, device="cpu", batches=[0])


def test_cli_on_the_cpu_writes_a_file_the_simulator_loads(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "tiny.yaml"
    assert main(["bench", "gpu-decode", "--model", str(config), "--out", str(out),
                 "--device", "cpu", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "CPU figures are not GPU calibration" in text and "fitted (DistServe" in text
    assert "analytic" in text and "decode 8x512" in text and "prefill 256" in text
    hw = load_hardware(str(out))
    assert [r.kind for r in hw.device.kernels].count("prefill_layer") == 4
    assert re.fullmatch(r"cpu-[\w.-]+-calibrated-\d{4}-\d\d-\d\d", hw.name), hw.name
    assert main(["bench", "gpu-decode", "--model", str(config), "--out", str(out),
                 "--device", "cpu", "--base", "not-a-preset"]) == 2
    assert "--base = 'not-a-preset'" in capsys.readouterr().err


@pytest.mark.skipif(cuda_missing() is None, reason="a CUDA GPU is present: the GPU test runs")
def test_without_cuda_it_exits_2_saying_so(tmp_path, capsys):
    assert main(["bench", "gpu-decode", "--model", "llama-3.1-8b", "--out",
                 str(tmp_path / "x.yaml")]) == 2
    assert "gpu-decode needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.skipif(cuda_missing() is not None, reason="needs a CUDA GPU")
def test_gpu_sweep_and_its_prediction_on_its_own_rows():
    """The real sweep of a Llama-3.1-8B layer on this GPU; the serving cost model of a
    2-layer proxy on the file prices every measured step within 15% of what was
    measured (the fit's own error), and decode time grows with the keys read."""
    spec = load_model("llama-3.1-8b").with_layers(2)
    sweep = measure_layer_steps(spec, device="cuda")
    assert sweep.dtype == "bf16" and len(sweep.decode) >= 9 and len(sweep.prefill) >= 3
    decode = {(b, c): s for b, c, s in sweep.decode}
    assert decode[(128, 8192)] > decode[(1, 512)]
    hw = load_hardware(layer_steps_hardware(sweep, "h100-dgx", name="gpu-test-steps"))
    model = ServingCostModel(spec, hw)
    assert len(model.measured_layers) == 1
    for b, c, seconds in sweep.decode:
        got = model.step_time([(1, c)] * b).layers_s / 2
        assert got == pytest.approx(seconds, rel=0.15), (b, c)
    for t, seconds in sweep.prefill:
        got = model.step_time([(t, t)]).layers_s / 2
        assert got == pytest.approx(seconds, rel=0.15), t
    fit = model.measured_layers[0]
    assert fit.decode.max_error < 0.15 and fit.prefill.max_error < 0.15
