"""Plain PyTorch's autocast kernels (issue 26): the rewrite of a traced GPT step into the
kernels the reference PyTorch step runs, checked against the ops PyTorch dispatches for
that step on the CPU, and priced where kernels are priced from measurements."""

import collections

import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from pipeline_parallel.optim import OptimizerConfig
from vcluster.planner.autocast_kernels import AUTOCAST_CAST, with_autocast_kernels
from vcluster.planner.precision import PRECISIONS
from vcluster.planner.simulation import simulate_gpt
from vcluster.runtime.tracing import KernelKind, TraceCompute, trace_program
from vcluster.timing import load_hardware
from vcluster.timing.hardware_model import HardwareCostModel

SHAPES = [(64, 1, 4, 32, 100, 3), (64, 2, 4, 32, 100, 1), (32, 3, 2, 16, 50, 2),
          (96, 2, 6, 24, 77, 4)]


def _traced(hidden, layers, heads, seq, vocab, batch, tie=False, **parallel):
    cfg = GPTConfig(hidden=hidden, layers=layers, heads=heads, seq=seq, vocab=vocab,
                    dtype="float16", tie_embeddings=tie)
    par = ParallelConfig(global_batch=batch, micro_batch=batch, **parallel)
    args = GPT(cfg).meta_args(par.mesh(), par, optimizer=OptimizerConfig("adam"))
    return trace_program(par.mesh(), train_program, args, ranks=[0])[0].ops


def _compute(ops):
    return [op for op in ops if isinstance(op, TraceCompute) and not op.contains]


def _dispatched(hidden, layers, heads, seq, vocab, batch, tie=False):
    """(phase, op name, input dtypes, bytes read + written, output shape) of every op
    PyTorch dispatches for the reference step's forward and backward under CPU bf16
    autocast."""
    torch = pytest.importorskip("torch", reason="the dispatch check runs PyTorch "
                                                "(vcluster[torch])")
    from torch.utils._python_dispatch import TorchDispatchMode

    from vcluster.gpu.gpt_step import _model
    torch.manual_seed(0)
    model = _model(torch, hidden, layers, heads, seq, vocab, tie)
    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.phase = [], "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = [x for a in args for x in (a if isinstance(a, (tuple, list)) else [a])]
            ins = [a for a in flat if isinstance(a, torch.Tensor)]
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(o, torch.Tensor)]
            self.ops.append((self.phase, func.overloadpacket.__name__,
                             tuple(str(a.dtype) for a in ins),
                             sum(t.numel() * t.element_size() for t in ins + outs),
                             tuple(outs[0].shape) if outs else ()))
            return out
    record = Record()
    with record:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, targets)
        record.phase = "backward"
        loss.backward()
    return record.ops


@pytest.mark.parametrize("hidden,layers,heads,seq,vocab,batch,tie",
                         [s + (False,) for s in SHAPES] + [SHAPES[0] + (True,),
                                                            SHAPES[3] + (True,)])
def test_the_casts_are_those_pytorch_dispatches(hidden, layers, heads, seq, vocab, batch, tie):
    """Every autocast cast of weights, biases, inputs and gradients, op for op in count
    and bytes (the logits' up- and down-cast belong to the cross-entropy kernel); a tied
    head (the embedding's weight) casts as an untied one."""
    dispatched = [b for _, name, _, b, shape in _dispatched(hidden, layers, heads, seq, vocab,
                                                            batch, tie)
                  if name == "_to_copy" and shape != (batch, seq, vocab)]
    casts = [op.bytes for op in _compute(with_autocast_kernels(
        _traced(hidden, layers, heads, seq, vocab, batch, tie))) if AUTOCAST_CAST in op.name]
    assert len(casts) == len(dispatched) == 22 * layers + 4
    assert sorted(casts) == sorted(dispatched)


@pytest.mark.parametrize("hidden,layers,heads,seq,vocab,batch", SHAPES[:2])
def test_fp32_layernorms_and_adds_are_those_pytorch_dispatches(hidden, layers, heads, seq,
                                                               vocab, batch):
    ops = _dispatched(hidden, layers, heads, seq, vocab, batch)
    rewritten = _compute(with_autocast_kernels(_traced(hidden, layers, heads, seq, vocab,
                                                       batch)))
    tokens = batch * seq
    norms = [op for op in rewritten if op.kernel.kind is KernelKind.NORM]
    assert len(norms) == 2 * (2 * layers + 1)
    assert all(op.kernel.shape == (tokens, 2 * hidden) for op in norms)   # fp32: 2x bytes
    assert [dt for _, name, dt, *_ in ops if name == "native_layer_norm"] == \
        [("torch.float32",) * 3] * (2 * layers + 1)
    # the residual adds: fp32 + bf16 forward (10 B an element), fp32 + fp32 backward (12)
    fwd = [b for phase, name, dt, b, _ in ops if phase == "forward" and name == "add"
           and dt == ("torch.float32", "torch.bfloat16")]
    bwd = [b for phase, name, dt, b, _ in ops if phase == "backward" and name == "add"]
    residual = [op.bytes for op in rewritten if op.name.endswith(": residual")]
    grad_adds = [op.bytes for op in rewritten if op.name.endswith("residual gradient add (fp32)")]
    assert sorted(residual) == sorted(fwd) == [10 * tokens * hidden] * 2 * layers
    assert sorted(grad_adds) == sorted(bwd) == [12 * tokens * hidden] * 2 * layers
    stack = [b for _, name, _, b, _ in ops if name == "stack"]
    merged = [op.bytes for op in rewritten if op.name.endswith("merge dq, dk, dv")]
    assert stack == merged == [12 * tokens * hidden] * layers


def test_what_eager_pytorch_does_not_run_is_left_out():
    """Bias adds (cuBLAS's addmm epilogue), the heads' split/merge copies (views), the
    LayerNorms' parameter-gradient blocks (inside LayerNorm's backward)."""
    ops = _compute(_traced(64, 2, 4, 32, 100, 3))
    names = collections.Counter(op.name.rsplit(": ", 1)[-1] for op in
                                _compute(with_autocast_kernels(ops)))
    for gone in ("+ b_qkv", "+ b_o", "h = x W1 + b1", "+ b2", "split heads", "merge heads",
                 "ln1 params grad", "ln2 params grad", "final ln grads"):
        assert gone not in names
    kept = [op for op in ops if op.kernel.kind in (KernelKind.GEMM, KernelKind.ATTENTION,
                                                   KernelKind.CROSS_ENTROPY,
                                                   KernelKind.OPTIMIZER)]
    assert all(op in with_autocast_kernels(ops) for op in kept)


def test_every_name_the_rewrite_keys_on_is_one_the_program_traces():
    """A renamed block in the GPT program fails here, not silently in a prediction."""
    from vcluster.planner import autocast_kernels as ak
    traced = {op.name.rsplit(": ", 1)[-1] for tie in (False, True)
              for op in _compute(_traced(64, 1, 4, 32, 100, 2, tie))}
    recomputed = {op.name.rsplit(": ", 1)[-1] for op in
                  _compute(_traced(64, 1, 4, 32, 100, 2, recompute="full"))}
    keys = (set(ak._LINEAR_FORWARD) | set(ak._WEIGHT_GRAD) | ak._NORM_FEEDS_LINEAR
            | ak._INPUT_GRAD_TO_FP32 | ak._INPUT_GRAD_FROM_FP32 | set(ak._RESIZED)
            | ak._NOT_RUN)
    assert keys - traced == {"y + b2"} and "y + b2" in recomputed     # the MLP's recompute
    assert keys - {"y + b2"} <= traced


def test_a_recomputed_forward_casts_its_weights_again():
    def weight_casts(**kw):
        return sum(op.name.endswith(f"{AUTOCAST_CAST} weight")
                   for op in with_autocast_kernels(_traced(64, 2, 4, 32, 100, 2, **kw)))
    assert weight_casts() == 4 * 2 + 1
    assert weight_casts(recompute="full") == 2 * 4 * 2 + 1


def _table(name="h100-dgx"):
    return load_hardware({"base": name, "device": {"kernel_table": "h100_kernels.csv"}})


CFG = GPTConfig(hidden=256, layers=2, heads=4, seq=128, vocab=512)
ONE = ParallelConfig(global_batch=2, micro_batch=2)


def test_priced_by_default_under_torch_amp_where_kernels_are_measured_only():
    assert PRECISIONS["torch_amp"].autocast_kernels
    assert not PRECISIONS["megatron"].autocast_kernels
    assert simulate_gpt(CFG, ONE, _table(), precision="torch_amp").autocast_kernels
    assert not simulate_gpt(CFG, ONE, "h100-dgx", precision="torch_amp").autocast_kernels
    assert not simulate_gpt(CFG, ONE, _table()).autocast_kernels
    assert simulate_gpt(CFG, ONE, "h100-dgx", autocast_kernels=True).autocast_kernels
    assert simulate_gpt(CFG, ONE, _table(), precision="torch_amp").to_json()["autocast_kernels"]
    with pytest.raises(ValueError, match="autocast_kernels must be True, False or None, "
                                         "got 'yes'"):
        simulate_gpt(CFG, ONE, _table(), autocast_kernels="yes")
    llama = GPTConfig(hidden=256, layers=2, heads=4, seq=128, vocab=512, arch="llama")
    with pytest.raises(ValueError, match="rewrites the dense GPT program .* got "
                                         "arch='llama', experts=0, cp=1"):
        simulate_gpt(llama, ONE, _table(), autocast_kernels=True)


@pytest.mark.parametrize("name", ["h100-dgx", "h200-dgx"])
def test_the_step_grows_by_the_price_of_the_kernels_added_less_those_left_out(name):
    """One GPU, one micro-batch: the step is its kernels back to back, so the two
    predictions differ by the rewrite's kernels priced one by one."""
    hw = _table(name)
    costs = HardwareCostModel(hw)
    ops = _compute(_traced(256, 2, 4, 128, 512, 2))
    delta = sum(map(costs.compute_time_s, _compute(with_autocast_kernels(ops)))) \
        - sum(map(costs.compute_time_s, ops))
    on, off = (simulate_gpt(CFG, ONE, hw, precision="torch_amp", autocast_kernels=a)
               for a in (True, False))
    assert delta > 0
    assert on.step_time_s - off.step_time_s == pytest.approx(delta, rel=1e-9)


def simulate_cli(tmp_path, capsys, precision: str, hardware: str, *flags) -> tuple:
    """``vcluster simulate gpt`` of a small GPT on one GPU under ``precision``, run as the
    console script runs it: (stdout, the JSON). ``hardware`` "table": a file that opts in
    to ``h100_kernels.csv`` on ``h100-dgx``; else a preset."""
    import json

    from vcluster.cli.main import main
    if hardware == "table":
        hardware = tmp_path / "h100-table.yaml"
        hardware.write_text("base: h100-dgx\ndevice:\n  kernel_table: h100_kernels.csv\n")
    out = tmp_path / "r.json"
    code = main(["simulate", "gpt", "--hidden", "256", "--layers", "2", "--heads", "4",
                 "--seq", "128", "--vocab", "512", "--global-batch", "2", "--micro-batch",
                 "2", "--precision", precision, *flags, "--hardware", str(hardware),
                 "--json", str(out)])
    text = capsys.readouterr()
    assert code == 0, text.err
    return text.out, json.loads(out.read_text())


def test_simulate_gpt_says_when_it_prices_autocast_kernels(tmp_path, capsys):
    """The CLI: a hardware file that opts in to the kernel table, ``--precision
    torch_amp``: the kernels line and the JSON key; the preset: neither;
    ``--autocast-kernels on|off`` overrides either."""
    for hardware, flag, priced in (("table", [], True), ("h100-dgx", [], False),
                                   ("table", ["--autocast-kernels", "off"], False),
                                   ("h100-dgx", ["--autocast-kernels", "on"], True)):
        out, result = simulate_cli(tmp_path, capsys, "torch_amp", hardware, *flag)
        assert ("plain PyTorch's under autocast" in out) is priced
        assert result["autocast_kernels"] is priced


def test_each_added_kernel_counts_in_the_kind_of_the_block_it_serves():
    from vcluster.planner.simulation import gpt_op_kind
    added = [op for op in with_autocast_kernels(_traced(64, 2, 4, 32, 100, 2))
             if AUTOCAST_CAST in op.name or "residual gradient add" in op.name]
    kinds = collections.Counter(gpt_op_kind(op.name) for op in added)
    assert set(kinds) == {"attention", "mlp", "logits"}
    assert gpt_op_kind("gpt: attention: autocast: cast weight") == "attention"
    assert gpt_op_kind("gpt: ln2: autocast: cast input") == "mlp"
    assert gpt_op_kind("gpt: head: autocast: cast weight gradient") == "logits"


@pytest.mark.parametrize("knobs", [dict(tp=1, pp=1, dp=1, micro_batch=4),
                                   dict(tp=2, pp=2, dp=1, micro_batch=1),
                                   dict(tp=1, pp=4, dp=1, micro_batch=1, recompute="full")])
def test_the_planners_screen_prices_them_as_the_replay_does(knobs):
    """The screen traces its per-layer pieces with the same rewrite, so a ``torch_amp`` plan
    on measured hardware ranks what the replay will price (within the screen's 10%)."""
    from vcluster.planner.layer_cost import trace_stage_pieces
    from vcluster.planner.screen import screen_estimate
    cfg = GPTConfig(hidden=1024, layers=8, heads=16, seq=1024, vocab=32000)
    par = ParallelConfig(global_batch=16, **knobs)
    hw = _table()
    costs = HardwareCostModel(hw)
    est = {a: screen_estimate(cfg, par, trace_stage_pieces(
        cfg, par.tp, par.micro_batch, par.sequence_parallel, par.recompute, costs,
        autocast_kernels=a), hw).step_time_s for a in (False, True)}
    sim = {a: simulate_gpt(cfg, par, hw, precision="torch_amp", autocast_kernels=a).step_time_s
           for a in (False, True)}
    assert est[True] > est[False] and sim[True] > sim[False]
    assert est[True] == pytest.approx(sim[True], rel=0.10)
    assert est[True] / est[False] == pytest.approx(sim[True] / sim[False], rel=0.03)
