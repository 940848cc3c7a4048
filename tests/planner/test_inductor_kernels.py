"""The reference PyTorch step under ``torch.compile`` (issue 26): the ``torch_compile``
memory count, checked against the tensors the compiled step saves on the CPU, and the
rewrite of the eager kernels into Inductor's fused ones, checked against what Inductor's
scheduler writes for that step on the CPU, and priced where kernels are measured."""

import collections
import dataclasses
import math
import shutil

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.autocast_kernels import AUTOCAST_CAST, with_autocast_kernels
from vcluster.planner.inductor_kernels import pytorch_kernels, with_inductor_fusion
from vcluster.planner.memory import torch_amp_activation_bytes
from vcluster.planner.precision import PRECISIONS
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import KernelKind
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

from .test_autocast_kernels import _compute, _traced, simulate_cli

COMPILE = PRECISIONS["torch_compile"]


def _compiled_step(hidden, layers, heads, seq, vocab, batch):
    """Run the reference step's forward and backward under ``torch.compile`` on the CPU
    (bf16 autocast): (bytes of the distinct non-parameter storages the compiled forward
    saves for the backward, and per compiled graph — forward, then backward — the
    buffers Inductor's scheduler writes as (origins, dtype, elements) per kernel)."""
    import torch
    import torch._inductor.ir as inductor_ir
    import torch._inductor.scheduler as inductor_scheduler
    from vcluster.gpu.gpt_step import _model

    from .test_torch_amp_memory import saved_forward     # it needs torch: imported here
    graphs = []
    codegen = inductor_scheduler.Scheduler.codegen

    def recording(self):
        kernels = []
        for node in self.nodes:
            origins = frozenset(str(o.target) for n in node.get_nodes()
                                if n.node is not None for o in n.node.origins)
            outs = tuple((b.node.get_dtype(), math.prod(int(d) for d in b.node.get_size()))
                         for b in node.get_outputs()
                         if isinstance(b.node.layout, inductor_ir.Layout))  # one output
            kernels.append((type(node).__name__, origins, outs))
        graphs.append(kernels)
        return codegen(self)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _model(torch, hidden, layers, heads, seq, vocab)
    step = torch.compile(model)
    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    inductor_scheduler.Scheduler.codegen = recording
    try:      # no cached graph: the scheduler must run
        with inductor_config.patch(fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            saved, loss = saved_forward(model, step, tokens, targets)
            loss.backward()
    finally:
        inductor_scheduler.Scheduler.codegen = codegen
        torch._dynamo.reset()
    assert len(graphs) == 2, "one forward and one backward graph"
    return saved, graphs


# tokens (batch x seq) differ from every weight's and bias's size, so a cast's size says
# what it casts
SHAPES = [(64, 1, 4, 24, 100, 3), (32, 2, 2, 20, 50, 2), (48, 3, 4, 16, 60, 1)]


def _cannot_compile_here(torch) -> str | None:
    """Why Inductor cannot build C++ kernels on this machine (what it needs: a C++
    compiler, the Python headers its kernels are built against, a toolchain that works),
    or None."""
    import sysconfig
    from pathlib import Path
    if not (shutil.which("g++") or shutil.which("c++")):
        return "torch.compile on the CPU needs a C++ compiler (g++ or c++ on PATH)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        return f"torch.compile on the CPU builds kernels against Python's headers: " \
               f"no {headers}"
    try:
        torch._dynamo.reset()
        torch.compile(lambda x: (x.sin() + 1).sum())(torch.ones(8))
    except Exception as e:          # the toolchain, not the model: say what failed
        return f"torch.compile cannot build a kernel here: {type(e).__name__}: " \
               f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    finally:
        torch._dynamo.reset()
    return None


@pytest.fixture(scope="module")
def compiled():
    """Each shape's compiled step, its kernels built in this process (no compile
    workers)."""
    torch = pytest.importorskip("torch", reason="the compiled-step check runs PyTorch "
                                                "(vcluster[torch])")
    import torch._inductor.config as inductor_config
    with inductor_config.patch(compile_threads=1):
        if why := _cannot_compile_here(torch):
            pytest.skip(why)
        return {shape: _compiled_step(*shape) for shape in SHAPES}


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_the_count_equals_what_the_compiled_step_saves(compiled, shape):
    """Per micro-batch (activations, weight casts, the ends) plus the bf16 logits
    (``logits_saved_bytes`` 2 a logit) equal the saved storages' bytes."""
    hidden, layers, heads, seq, vocab, batch = shape
    cfg = GPTConfig(hidden=hidden, layers=layers, heads=heads, seq=seq, vocab=vocab)
    per_mb, logits = torch_amp_activation_bytes(
        cfg, ParallelConfig(global_batch=batch, micro_batch=batch), 0, COMPILE)
    eager, _ = torch_amp_activation_bytes(
        cfg, ParallelConfig(global_batch=batch, micro_batch=batch), 0)
    assert per_mb + COMPILE.logits_saved_bytes * logits == compiled[shape][0]
    tokens = batch * seq         # what it saves besides eager's count: row statistics
    assert per_mb - eager == 8 * tokens * (1 - layers)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_the_logits_and_their_gradient_exist_only_in_bf16(compiled, shape):
    """No fp32 copy of the logits is written, forward or backward: the loss's 4 bytes a
    logit at its backward (``logits_bytes``), not eager's 12."""
    import torch
    *_, seq, vocab, batch = shape
    forward, backward = compiled[shape][1]
    for graph in (forward, backward):
        written = [dtype for _, _, outs in graph for dtype, n in outs
                   if n == batch * seq * vocab]
        assert written == [torch.bfloat16]
    assert COMPILE.logits_bytes == 4 and PRECISIONS["torch_amp"].logits_bytes == 12


def _casts(graph):
    """The elements of each kernel that only casts (its origins a dtype conversion and
    views)."""
    views = {"aten.permute.default", "aten.reshape.default", "aten.view.default"}
    return sorted(n for kind, origins, outs in graph for _, n in outs
                  if kind == "SchedulerNode" and "prims.convert_element_type.default" in
                  origins and origins <= views | {"prims.convert_element_type.default"})


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_no_add_runs_as_a_kernel_of_its_own(compiled, shape):
    """The residual-gradient adds all run inside the LayerNorm backward's kernels, and the
    position add and the residual adds inside the LayerNorms' — but one: from two layers
    on, the C++ backend writes one residual sum in a kernel of its own (the rewrite fuses
    every one: the module docstring says so)."""
    views = {"aten.permute.default", "aten.reshape.default", "aten.view.default",
             "prims.convert_element_type.default"}
    alone = [[outs for kind, origins, outs in graph if kind != "ExternKernelSchedulerNode"
              and "aten.add.Tensor" in origins and origins <= views | {"aten.add.Tensor"}]
             for graph in compiled[shape][1]]
    hidden, layers, _, seq, _, batch = shape
    import torch
    assert alone[0] == ([] if layers == 1 else [((torch.float32, batch * seq * hidden),)])
    assert alone[1] == []
    norms = [origins for kind, origins, _ in compiled[shape][1][0]
             if "aten.var_mean.correction" in origins and "aten.add.Tensor" in origins]
    assert norms, "the forward's LayerNorms compute the adds"


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_the_casts_left_are_those_inductor_leaves(compiled, shape):
    """Forward: a cast per weight and per bias, none of a LayerNorm's output (fused).
    Backward: a cast per weight gradient, none of a bias gradient (the reduction's
    epilogue) or of an input gradient; Inductor's C++ backend leaves the two casts of the
    gradients entering a layer's residual branches alone, which the rewrite fuses as the
    Triton backend's LayerNorm backward does (the module docstring says so)."""
    hidden, layers, _, seq, _, batch = shape
    forward, backward = compiled[shape][1]
    fused = _compute(pytorch_kernels(_traced(*shape), compiled=True))
    fwd = [op.kernel.shape[0] // 3 for op in fused if op.name.endswith(
        (f"{AUTOCAST_CAST} weight", f"{AUTOCAST_CAST} bias"))]
    bwd = [op.kernel.shape[0] // 3 for op in fused if AUTOCAST_CAST in op.name
           and op.name.endswith("gradient")]
    assert len(fwd) == 8 * layers + 1 and len(bwd) == 4 * layers + 1
    assert _casts(forward) == sorted(fwd)
    assert _casts(backward) == sorted(bwd + [batch * seq * hidden] * 2 * layers)


def test_the_fused_kernels_move_the_bytes_the_table_gives():
    """Per layer, the LayerNorms move 12 B an element forward (14 for the first, which adds
    the positions) and 22 backward in their two kernels (20 for the first, whose gradient
    leaves in fp32, 18 for the final one, with no residual gradient); the casts around
    them, the position and residual adds, the residual-gradient adds, the bias-gradient
    casts and the loss's row-max pass are gone."""
    h, layers, heads, seq, vocab, b = 64, 3, 4, 32, 100, 2
    tokens = b * seq
    eager = _compute(with_autocast_kernels(_traced(h, layers, heads, seq, vocab, b)))
    fused = _compute(with_inductor_fusion(eager))
    names = collections.Counter(op.name.rsplit(": ", 1)[-1] for op in fused)
    for gone in ("residual", "residual gradient add (fp32)", "+ positions", "row max",
                 "sum exp, target logit", "loss, dlogits"):
        assert names[gone] == 0, gone
    for gone in ("input", "input gradient", "gradient", "bias gradient"):
        assert names[f"cast {gone}"] == 0, gone
    for kept in ("weight", "bias", "weight gradient"):
        assert names[f"cast {kept}"] == sum(
            op.name.endswith(f"{AUTOCAST_CAST} {kept}") for op in eager)
    norms = [op for op in fused if op.kernel.kind is KernelKind.NORM]
    forward = [op for op in norms if not op.kernel.backward]
    backward = [op for op in norms if op.kernel.backward]
    # the norm profile's size is tokens x width; the eager fp32 LayerNorm is width 2h at
    # 8 B (forward) and 20 B (backward: both kernels) an element
    assert [op.kernel.shape for op in forward] == \
        [(tokens, 2 * h * 14 // 8)] + [(tokens, 2 * h * 12 // 8)] * (2 * layers)
    assert [op.kernel.shape for op in backward] == \
        [(tokens, round(2 * h * 18 / 20))] + [(tokens, round(2 * h * 22 / 20))] \
        * (2 * layers - 1) + [(tokens, 2 * h * 20 // 20)]
    loss = [op for op in fused if ": compiled: loss" in op.name]
    assert [op.bytes for op in loss] == [2 * tokens * vocab, 4 * tokens * vocab]
    assert all(op.kernel.kind is KernelKind.ELEMENTWISE for op in loss)
    assert sum(op.bytes for op in fused) < sum(op.bytes for op in eager)


def test_ops_it_does_not_know_pass_unchanged():
    ops = _traced(64, 1, 4, 32, 100, 2)
    assert with_inductor_fusion(()) == ()
    gemms = [op for op in _compute(ops) if op.kernel.kind in (KernelKind.GEMM,
                                                                KernelKind.ATTENTION,
                                                                KernelKind.OPTIMIZER)]
    assert all(op in with_inductor_fusion(with_autocast_kernels(ops)) for op in gemms)
    assert pytorch_kernels(ops) == with_autocast_kernels(ops)


def _table(name="h100-dgx"):
    return load_hardware({"base": name, "device": {"kernel_table": "h100_kernels.csv"}})


CFG = GPTConfig(hidden=256, layers=2, heads=4, seq=128, vocab=512)
ONE = ParallelConfig(global_batch=2, micro_batch=2)


def test_torch_compile_is_torch_amp_but_for_the_loss_and_the_fusion():
    amp = PRECISIONS["torch_amp"]
    assert dataclasses.replace(COMPILE, name="torch_amp", logits_bytes=12,
                               logits_saved_bytes=4, activation_count="torch_amp",
                               inductor_fusion=False) == amp
    sim = simulate_gpt(CFG, ONE, _table(), precision="torch_compile")
    assert sim.autocast_kernels and sim.inductor_fusion and sim.to_json()["inductor_fusion"]
    on_preset = simulate_gpt(CFG, ONE, "h100-dgx", precision="torch_compile")
    assert not on_preset.autocast_kernels and not on_preset.inductor_fusion
    assert not simulate_gpt(CFG, ONE, _table(), precision="torch_amp").inductor_fusion
    assert not simulate_gpt(CFG, ONE, _table(), precision="torch_compile",
                            autocast_kernels=False).inductor_fusion


@pytest.mark.parametrize("name", ["h100-dgx", "h200-dgx"])
def test_the_compiled_step_is_the_eager_one_less_the_fused_kernels_prices(name):
    """One GPU, one micro-batch: the step is its kernels back to back, so the two
    predictions differ by the fusion's kernels priced one by one."""
    hw = _table(name)
    costs = HardwareCostModel(hw)
    eager = _compute(with_autocast_kernels(_traced(256, 2, 4, 128, 512, 2)))
    delta = sum(map(costs.compute_time_s, _compute(with_inductor_fusion(eager)))) \
        - sum(map(costs.compute_time_s, eager))
    amp, comp = (simulate_gpt(CFG, ONE, hw, precision=p)
                 for p in ("torch_amp", "torch_compile"))
    assert delta < 0
    assert comp.step_time_s - amp.step_time_s == pytest.approx(delta, rel=1e-9)


def test_the_compiled_peak_holds_four_bytes_a_logit_where_eager_holds_twelve():
    """The 1.4B step of the measured tables at micro-batch 4 peaks at the loss's backward:
    the two policies differ there by 8 bytes a logit."""
    cfg = GPTConfig(hidden=2048, layers=24, heads=16, seq=2048, vocab=51200)
    par = ParallelConfig(global_batch=4, micro_batch=4)
    amp, comp = (simulate_gpt(cfg, par, "h100-dgx", precision=p)
                 for p in ("torch_amp", "torch_compile"))
    logits = 4 * 2048 * 51200
    assert amp.memory_breakdown_gb["logits"] * 1e9 == pytest.approx(12 * logits, rel=1e-6)
    assert comp.memory_breakdown_gb["logits"] * 1e9 == pytest.approx(4 * logits, rel=1e-6)
    assert amp.peak_memory_gb - comp.peak_memory_gb == pytest.approx(
        (8 * logits + 8 * 4 * 2048 * 23) / 1e9, rel=1e-6)


def test_the_planners_screen_fuses_as_the_replay_does():
    from vcluster.planner.layer_cost import trace_stage_pieces
    from vcluster.planner.screen import screen_estimate
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=1024, vocab=32000)
    par = ParallelConfig(global_batch=16, micro_batch=4)
    hw = _table()
    costs = HardwareCostModel(hw)
    est = {f: screen_estimate(cfg, par, trace_stage_pieces(
        cfg, par.tp, par.micro_batch, par.sequence_parallel, par.recompute, costs,
        autocast_kernels=True, inductor_fusion=f), hw).step_time_s for f in (False, True)}
    sim = {p: simulate_gpt(cfg, par, hw, precision=p).step_time_s
           for p in ("torch_amp", "torch_compile")}
    assert est[True] < est[False] and sim["torch_compile"] < sim["torch_amp"]
    assert est[True] == pytest.approx(sim["torch_compile"], rel=0.10)
    assert est[True] / est[False] == pytest.approx(sim["torch_compile"] / sim["torch_amp"],
                                                   rel=0.03)


def test_simulate_gpt_says_when_it_prices_compiled_kernels(tmp_path, capsys):
    """The CLI: ``--precision torch_compile`` on a hardware file with the kernel table
    prints the fused kernels line and the JSON keys; on the preset, neither."""
    for hardware, fused in (("table", True), ("h100-dgx", False)):
        out, result = simulate_cli(tmp_path, capsys, "torch_compile", hardware)
        assert ("fused by torch.compile" in out) is fused
        assert "torch_compile precision, flash attention, activations as PyTorch's " \
               "autograd saves them" in out
        assert result["inductor_fusion"] is fused and result["precision"] == "torch_compile"
