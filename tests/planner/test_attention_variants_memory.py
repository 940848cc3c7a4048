"""The memory model of the Llama block's attention variants (issue 52): with a head
dimension of its own (h_q = a·d != h) and QK-norm, the parameters per rank are what the
program holds (traced) and, summed, the model layer's count (modeling/counts.py); the
activations are what the layer keeps for its backward."""

import dataclasses

import pytest

from mesh import Mesh
from modeling import MLP, Attention, Layer, ModelSpec, parameter_count
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.llama import llama_param_shapes
from tensor_parallel.attention import TransformerOps
from tensor_parallel.llama import llama_piece, llama_stage
from vcluster.planner.memory import llama_activation_bytes_per_layer, rank_params
from vcluster.runtime.tracing import MetaArray, TraceCompute, trace_program

from ..pipeline_parallel.gpt_data import count_params

pytestmark = pytest.mark.timeout(300)

VARIANTS = [{"head_dim": 12}, {"qk_norm": True}, {"head_dim": 4, "qk_norm": True}]
IDS = ["head_dim", "qk_norm", "both"]


def _llama(kv, **kw):
    return GPTConfig(**{**dict(hidden=64, layers=4, heads=8, seq=16, vocab=96, arch="llama",
                               kv_heads=kv, ffn_hidden=80), **kw})


def _declared(mesh, program, args, ranks, name: str):
    return [sum(op.flops for op in t.ops if isinstance(op, TraceCompute) and op.name == name)
            for t in trace_program(mesh, program, args, ranks=ranks)]


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_parameters_are_the_model_layers_count(variant):
    """One rank holding the whole model: the memory model's parameters, the program's and
    modeling/counts.py's count of the same spec (2d more with QK-norm) agree."""
    d = variant.get("head_dim", 8)
    spec = ModelSpec("tiny", 64, 96, (Layer(Attention(8, 2, d, qk_norm=variant.get(
        "qk_norm", False)), MLP("swiglu", 80)),) * 4)
    cfg = GPTConfig.from_spec(spec, 16)
    assert (cfg.head_dim, cfg.qk_norm) == (d, variant.get("qk_norm", False))
    total = parameter_count(spec).total
    assert rank_params(cfg, ParallelConfig(global_batch=4), 0) == total
    assert sum(int(MetaArray(s).size) for s in GPT(cfg).param_shapes().values()) == total
    par = ParallelConfig(global_batch=4, pp=2)
    assert rank_params(cfg, par, 0) + rank_params(cfg, par, 1) == total


@pytest.mark.parametrize("kv, tp", [(2, 2), (1, 4), (8, 4)])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_memory_params_are_what_the_program_holds(variant, kv, tp):
    cfg = _llama(kv, **variant)
    par = ParallelConfig(global_batch=4, pp=2, tp=tp)
    mesh = par.mesh()
    job = GPT(cfg).meta_args(mesh, par)[0][0]
    ranks = [mesh.rank({"dp": 0, "pp": p, "tp": 0}) for p in range(2)]
    held = _declared(mesh, count_params, [(job,)] * mesh.size, ranks, "params")
    assert held == [rank_params(cfg, par, r) for r in range(2)]


def _layer_activations(dev, cfg, b, recompute):
    """Declare the bytes one Llama layer keeps after one micro-batch's forward."""
    ops = TransformerOps(dev, "tp", False)
    shapes = llama_param_shapes(dataclasses.replace(cfg, layers=1))
    meta = {n.rsplit(".", 1)[-1]: llama_piece(n, MetaArray(s), ops.tp_size, ops.tp_rank,
                                              cfg.kv_heads) for n, s in shapes.items()}
    _, layer, _ = llama_stage(ops, lambda names, prefix="": {n: meta[n] for n in names}, [0],
                              True, True, cfg.heads, cfg.kv_heads, cfg.hidden, cfg.rope_theta,
                              recompute, cfg.eps, 1, cfg.seq, head_dim=cfg.head_dim,
                              qk_norm=cfg.qk_norm).modules
    layer.forward(ops, 0, MetaArray((b, cfg.seq, cfg.hidden)))
    with dev.compute("activations", flops=layer.activation_bytes):
        pass


@pytest.mark.parametrize("kv, tp", [(8, 1), (1, 2), (8, 4)])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_activation_memory_is_what_the_layer_keeps(variant, kv, tp, recompute):
    """The program's float64 tensors kept for the backward, at 2 bytes an element, equal
    the formula with unfused attention, plus the row statistics the formula leaves out:
    the two RMSNorms' 1/rms per row (2·2·s·b bytes) and, with QK-norm, one per head and
    row, 2·s·b·(a/t + c_l)."""
    cfg, b = _llama(kv, **variant), 2
    (kept,) = _declared(Mesh((tp,), ("tp",)), _layer_activations,
                        [(cfg, b, recompute)] * tp, [0], "activations")
    formula = llama_activation_bytes_per_layer(cfg, b, tp, recompute, False, "unfused")
    s, heads, kv_local = cfg.seq, cfg.heads // tp, max(kv // tp, 1)
    stats = 0 if recompute == "full" else 2 * 2 * s * b + (
        2 * s * b * (heads + kv_local) if cfg.qk_norm else 0)
    assert kept / 4 == formula + stats
