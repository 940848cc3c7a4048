"""PyTorch FSDP2's copies around ZeRO's collectives (vcluster.planner.fsdp2_copies): their
bytes against FSDP2's copy-in/copy-out written out by hand from each module's flat
parameter, where they sit beside their collective, the refusals, and a simulated step
that grows by their time."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.zero import FlatLayout
from vcluster.planner.fsdp2_copies import COPY_NAME, GRAD_BYTES, with_fsdp2_copies
from vcluster.planner.simulation import (DP_GRAD_REDUCE, DP_PARAM_GATHER, data_parallel_row,
                                         simulate_gpt)
from vcluster.runtime.tracing import TraceCollective, TraceCompute, TraceWait, trace_program

pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig(hidden=64, layers=2, heads=4, kv_heads=2, seq=32, vocab=128, arch="llama",
                ffn_hidden=96, dtype="float16")


def _with_copies(par):
    mesh = par.mesh()
    ops = trace_program(mesh, train_program, GPT(CFG).meta_args(mesh, par), ranks=[0])[0].ops
    axes_of: dict = {}
    return ops, with_fsdp2_copies(ops, lambda op: data_parallel_row(op, mesh, axes_of),
                                  DP_PARAM_GATHER, DP_GRAD_REDUCE)


def _modules(gpt: GPT) -> list[int]:
    """Elements of each flat parameter of a whole Llama on one rank: embedding, the
    layers, the head."""
    sizes: dict = {}
    for name, shape in gpt.param_shapes().items():
        key = name.rsplit(".", 1)[0] if name.startswith("layers.") else \
            ("emb" if name == "wte" else "head")
        sizes[key] = sizes.get(key, 0) + int(np.prod(shape))
    return [sizes["emb"], *(sizes[f"layers.{i}"] for i in range(CFG.layers)), sizes["head"]]


@pytest.mark.parametrize("dp, reduce_dtype", [(2, "model"), (4, "fp32")])
def test_copy_bytes_are_fsdp2s_per_module(dp, reduce_dtype):
    """ZeRO-3, one micro-batch: each module's flat parameter (N' elements, padded to a
    multiple of dp, 2 bytes each) is gathered for the forward and again for the backward —
    each gather copies its shard in (2·2N'/dp) and the gathered bytes out (2·2N') — and
    its gradient reduce-scattered once: the bf16 gradients read into the reduce-scatter's
    input (2N' + r·N', r the reduce dtype's bytes) and the reduced shard out (2·r·N'/dp).
    Summed over the modules, the added kernels carry exactly those bytes."""
    par = ParallelConfig(global_batch=2 * dp, micro_batch=2, dp=dp, zero_stage=3,
                         grad_reduce_dtype=reduce_dtype)
    plain, ops = _with_copies(par)
    r = 4 if reduce_dtype == "fp32" else 2
    padded = [FlatLayout((n,), dp).padded for n in _modules(GPT(CFG))]
    gathers = sum(2 * (2 * 2 * p // dp + 2 * 2 * p) for p in padded)
    reduces = sum(GRAD_BYTES * p + r * p + 2 * r * p // dp for p in padded)
    added = [op for op in ops if type(op) is TraceCompute and op.name.startswith(COPY_NAME)]
    assert sum(op.bytes for op in added) == gathers + reduces
    assert len(ops) == len(plain) + len(added)
    # each gather's copy-out right after the wait for it, its copy-in right before it
    for i, op in enumerate(ops):
        if type(op) is TraceCollective and op.collective == "all_gather":
            assert ops[i - 1].name.endswith("shards into the all-gather input")
            wait = next(j for j in range(i, len(ops)) if type(ops[j]) is TraceWait
                        and ops[j].handle == op.handle)
            assert ops[wait + 1].name.endswith("all-gather output into the parameters")


def test_without_zero_nothing_is_added_and_refusals_name_the_argument():
    plain, ops = _with_copies(ParallelConfig(global_batch=4, micro_batch=2, dp=2))
    assert ops == tuple(plain)                  # DDP's all-reduces are no FSDP2 collectives
    cfg = GPTConfig(hidden=64, layers=2, heads=4, seq=32, vocab=128)
    for zero in (0, 1):
        with pytest.raises(ValueError, match=rf"fsdp2_copies=True with zero_stage={zero}: "
                                             r".*allowed: False, or True with zero_stage 2"):
            simulate_gpt(cfg, ParallelConfig(global_batch=8, dp=2, zero_stage=zero),
                         "a100-80gb-dgx", fsdp2_copies=True)
    with pytest.raises(ValueError, match="fsdp2_copies='yes'"):
        simulate_gpt(cfg, ParallelConfig(global_batch=8, dp=2, zero_stage=3),
                     "a100-80gb-dgx", fsdp2_copies="yes")


def test_a_simulated_step_pays_the_copies():
    """Llama 3.1 8B's shapes (4 layers) under ZeRO-3 on 8 H100s, one micro-batch: the
    copies add at least their bytes over the HBM's datasheet bandwidth and less than 2.5x
    that (the achieved bandwidth and the launches)."""
    cfg = GPTConfig(hidden=4096, layers=4, heads=32, kv_heads=8, seq=4096, vocab=128256,
                    arch="llama", ffn_hidden=14336)
    par = ParallelConfig(global_batch=8, micro_batch=1, dp=8, zero_stage=3,
                         grad_reduce_dtype="fp32", attention="flash2")
    plain, copies = (simulate_gpt(cfg, par, "h100-dgx", fsdp2_copies=c) for c in (False, True))
    assert copies.fsdp2_copies and not plain.fsdp2_copies
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    params = 4 * layer + 2 * 128256 * 4096 + 4096
    # gathers: 2 per module, ~2·2 bytes per element out; the reduce-scatter: 2 + 4 in
    floor_s = (2 * 2 * 2 * params + (2 + 4) * params) / 3.35e12
    assert floor_s < copies.step_time_s - plain.step_time_s < 2.5 * floor_s


def test_the_cli_flag(tmp_path):
    base = [sys.executable, "-m", "vcluster", "simulate", "train", "--arch", "llama",
            "--hidden", "512", "--layers", "2", "--heads", "8", "--kv-heads", "2",
            "--ffn-hidden", "1024", "--seq", "256", "--vocab", "1024", "--global-batch",
            "4", "--micro-batch", "1", "--dp", "4", "--hardware", "h100-dgx"]
    out = subprocess.run(base + ["--zero", "3", "--fsdp2-copies", "--json",
                                 str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "FSDP2's copies" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["fsdp2_copies"] is True
    out = subprocess.run(base + ["--zero", "1", "--fsdp2-copies"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 2 and "--fsdp2-copies prices FSDP2's copies around ZeRO's " \
        "gathers and reduce-scatters: it needs --zero 2 or 3, got --zero 1" in out.stderr
