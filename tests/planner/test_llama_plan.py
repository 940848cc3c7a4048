"""Llama in the simulator and the planner: the memory model's parameters and activations
equal what the Llama program holds (traced), MFU uses llama_model_flops, and
`vcluster simulate gpt` / `vcluster plan gpt` take --arch llama --kv-heads --ffn-hidden."""

import dataclasses
import json
import subprocess
import sys

import pytest

from mesh import Mesh
from pipeline_parallel.gpt import ARCHS, GPT, GPTConfig, ParallelConfig, llama_model_flops
from pipeline_parallel.llama import llama_param_shapes
from tensor_parallel.attention import TransformerOps
from tensor_parallel.llama import llama_piece, llama_stage
from vcluster.cli.args import add_arch_arguments
from vcluster.planner.memory import llama_activation_bytes_per_layer, rank_params
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import MetaArray, TraceCompute, trace_program

from ..pipeline_parallel.gpt_data import count_params
from vcluster.timing import load_hardware

pytestmark = pytest.mark.timeout(300)


def _llama(kv, **kw):
    return GPTConfig(**{**dict(hidden=64, layers=4, heads=8, seq=16, vocab=96, arch="llama",
                               kv_heads=kv, ffn_hidden=80), **kw})


def _declared(mesh, program, args, ranks, name: str):
    """What ``program`` declared, per traced rank, as the FLOPs of its blocks ``name``."""
    return [sum(op.flops for op in t.ops if isinstance(op, TraceCompute) and op.name == name)
            for t in trace_program(mesh, program, args, ranks=ranks)]


@pytest.mark.parametrize("kv, tp", [(8, 2), (2, 2), (2, 4), (1, 4), (4, 8)])
def test_memory_params_are_what_the_program_holds(kv, tp):
    cfg = _llama(kv)
    par = ParallelConfig(global_batch=4, pp=2, tp=tp, schedule="interleaved_1f1b",
                         virtual_stages=2)
    mesh = par.mesh()
    model = GPT(cfg)
    job = model.meta_args(mesh, par)[0][0]
    ranks = [mesh.rank({"dp": 0, "pp": p, "tp": 0}) for p in range(2)]
    held = _declared(mesh, count_params, [(job,)] * mesh.size, ranks, "params")
    assert held == [rank_params(cfg, par, r) for r in range(2)]
    # and over every rank, each distinct parameter once (replicated K/V heads counted once)
    total = sum(rank_params(cfg, par, r) for r in range(2)) * tp
    h, d, l = cfg.hidden, cfg.head_dim, cfg.layers
    replicated = 2 * (max(kv, tp) - kv) * h * d * l + (tp - 1) * (2 * h * l + h)
    assert total - replicated == sum(
        int(MetaArray(s).size) for s in model.param_shapes().values())


def _layer_activations(dev, cfg, b, recompute):
    """Declare the bytes one Llama layer keeps after one micro-batch's forward."""
    ops = TransformerOps(dev, "tp", False)
    shapes = llama_param_shapes(dataclasses.replace(cfg, layers=1))
    meta = {n.rsplit(".", 1)[-1]: llama_piece(n, MetaArray(s), ops.tp_size, ops.tp_rank,
                                              cfg.kv_heads) for n, s in shapes.items()}
    _, layer, _ = llama_stage(ops, lambda names, prefix="": {n: meta[n] for n in names}, [0],
                              True, True, cfg.heads, cfg.kv_heads, cfg.hidden, cfg.rope_theta,
                              recompute, cfg.eps, 1, cfg.seq).modules
    layer.forward(ops, 0, MetaArray((b, cfg.seq, cfg.hidden)))
    with dev.compute("activations", flops=layer.activation_bytes):
        pass


@pytest.mark.parametrize("kv, tp", [(8, 1), (2, 2), (1, 2), (2, 4), (8, 4)])
@pytest.mark.parametrize("recompute", ["none", "full", "full-torch", "op"])
def test_activation_memory_is_what_the_layer_keeps(kv, tp, recompute):
    """The program's float64 tensors kept for the backward, at 2 bytes an element, equal
    the formula with unfused attention (the program keeps the softmax), plus the two
    RMSNorms' 1/rms per row that the formula leaves out (2·2·s·b bytes; "op" and "full"
    keep no norm state)."""
    cfg, b = _llama(kv), 2
    (kept,) = _declared(Mesh((tp,), ("tp",)), _layer_activations,
                        [(cfg, b, recompute)] * tp, [0], "activations")
    formula = llama_activation_bytes_per_layer(cfg, b, tp, recompute, False, "unfused")
    assert kept / 4 == formula + (0 if recompute in ("full", "full-torch", "op")
                                  else 2 * 2 * cfg.seq * b)


def test_simulated_mfu_uses_the_llama_flops():
    cfg = _llama(2, hidden=256, heads=4, seq=64, vocab=512, ffn_hidden=688, dtype="float16")
    par = ParallelConfig(global_batch=8, micro_batch=2, dp=2, pp=2, tp=2)
    r = simulate_gpt(cfg, par, "h100-dgx")
    model = llama_model_flops(8, 64, 4, 256, 512, 4, 2, 688)
    assert r.mfu == pytest.approx(
        model / (r.gpus * load_hardware("h100-dgx").device.peak_flops("bf16") * r.step_time_s),
        rel=1e-12)
    # executed: the mean over the 2 traced pipeline ranks, x 2 ranks x tp 2 x dp 2
    assert r.tflops_per_gpu * 1e12 * r.step_time_s * 2 * 2 * 2 == pytest.approx(model,
                                                                                 rel=1e-12)


def test_the_cli_arch_choices_are_the_configs():
    import argparse
    parser = argparse.ArgumentParser()
    add_arch_arguments(parser)
    assert tuple(parser._option_string_actions["--arch"].choices) == ARCHS


MODEL = ["--hidden", "512", "--layers", "4", "--heads", "8", "--seq", "256", "--vocab", "4096",
         "--hardware", "h100-dgx"]


def test_simulate_and_plan_take_a_llama(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *MODEL,
                           "--arch", "llama", "--kv-heads", "2", "--tp", "4", "--pp", "2",
                           "--global-batch", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Llama h=512 l=4 a=8 kv=2 f=1536 s=256 V=4096 on 8 x")
    r = json.loads(out.read_text())
    cfg = GPTConfig(hidden=512, layers=4, heads=8, seq=256, vocab=4096, arch="llama",
                    kv_heads=2)
    par = ParallelConfig(global_batch=8, pp=2, tp=4)
    assert [m["params_bytes"] for m in r["memory"]] == \
        [int(2 * rank_params(cfg, par, p)) for p in range(2)]
    proc = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "gpt", *MODEL,
                           "--kv-heads", "2", "--global-batch", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "kv_heads=2 needs arch='llama'" in proc.stderr

    plan = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "vcluster", "plan", "gpt", "--hidden", "384",
                           "--layers", "4", "--heads", "12", "--seq", "128", "--vocab", "4096",
                           "--hardware", "h100-dgx", "--arch", "llama", "--kv-heads", "3",
                           "--ffn-hidden", "1024", "--gpus", "8", "--global-batch", "16",
                           "--replay", "1", "--quiet", "--json", str(plan)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Llama h=384 l=4 a=12 kv=3 f=1024 s=128 V=4096")
    result = json.loads(plan.read_text())
    # tp 2: 3 KV heads do not split over 2; tp 4: 4 % 3; tp 8 does not divide 12 heads
    assert {"tp_not_fitting_kv_heads", "tp_not_dividing_heads"} <= set(result["rejected"])
    assert {c["tp"] for c in result["candidates"]} == {1}
