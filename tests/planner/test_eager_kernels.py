"""Eager PyTorch's unfused kernels of the Llama layer (vcluster.planner.eager_kernels):
the constants equal what a TorchDispatchMode records for torchtitan's functions in bf16
on the CPU, the rewrite adds exactly the closed form's bytes to a traced Llama step, and
simulate_gpt prices them (or refuses them by name)."""

import subprocess
import sys

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner import eager_kernels as E
from vcluster.planner.simulation import _short_templates, simulate_gpt

pytestmark = pytest.mark.timeout(300)


# --- torchtitan's functions (torchtitan/models/norms.py, models/llama/model.py) ----------
def _rmsnorm(torch, x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _rope(torch, x, freqs):             # apply_rotary_emb: x (b, s, heads, d)
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


def _repeat_kv(x, n_rep):
    b, s, c, d = x.shape
    return x[:, :, :, None, :].expand(b, s, c, n_rep, d).reshape(b, s, c * n_rep, d)


def _swiglu(torch, a, b):
    return torch.nn.functional.silu(a) * b


def _distinct_bytes(t) -> int:
    """Bytes of the distinct elements a kernel reads or writes: a broadcast dimension
    (stride 0) is one element wide."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


def _record(torch, fn, *inputs):
    """[(kernels, bytes) forward, (kernels, bytes) backward] of fn: every op whose output
    does not alias an input is a kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Rec(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels, self.bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            outs = [a for a in tree_leaves(out) if isinstance(a, torch.Tensor)]
            storages = {a.untyped_storage().data_ptr() for a in ins}
            if outs and not all(o.untyped_storage().data_ptr() in storages for o in outs):
                self.kernels += 1
                self.bytes += sum(map(_distinct_bytes, ins + outs))
            return out

    leaves = [t.detach().requires_grad_(t.dtype == torch.bfloat16) for t in inputs]
    fwd, bwd = Rec(), Rec()
    with fwd:
        y = fn(*leaves)
    dy = torch.ones_like(y)
    with bwd:
        torch.autograd.backward(y, dy, inputs=[t for t in leaves if t.requires_grad])
    return (fwd.kernels, fwd.bytes), (bwd.kernels, bwd.bytes)


@pytest.mark.parametrize("b, s, h, heads, kv, f", [(1, 64, 256, 8, 2, 512),
                                                    (2, 32, 384, 6, 3, 640)])
def test_the_constants_are_what_torchtitans_functions_run(b, s, h, heads, kv, f):
    """Each component's kernels and bytes, recorded op by op, equal the module's closed
    forms: the big terms exactly, the per-row and table terms as the docstring gives them."""
    torch = pytest.importorskip("torch", reason="the kernels are recorded by running "
                                                "PyTorch (vcluster[torch])")
    bf = torch.bfloat16
    T, d = b * s, h // heads
    n_q, n_kv = T * heads * d, T * kv * d
    x, w = torch.randn(b, s, h, dtype=bf), torch.ones(h, dtype=bf)
    (kf, bytes_f), (kb, bytes_b) = _record(torch, lambda a, g: _rmsnorm(torch, a, g), x, w)
    assert (kf, bytes_f) == (E._NORM_FWD[1], E._NORM_FWD[0] * T * h + 24 * T + 2 * h)
    assert (kb, bytes_b) == (E._NORM_BWD[1], E._NORM_BWD[0] * T * h + 40 * T + 4 * h)
    freqs = torch.polar(torch.ones(s, d // 2), torch.randn(s, d // 2))
    (kf, bytes_f), (kb, bytes_b) = _record(torch, lambda q: _rope(torch, q, freqs),
                                           torch.randn(b, s, heads, d, dtype=bf))
    assert (kf, bytes_f) == (E._ROPE_FWD[1], E._ROPE_FWD[0] * n_q + 4 * s * d)
    assert (kb, bytes_b) == (E._ROPE_BWD[1], E._ROPE_BWD[0] * n_q + 12 * s * d)
    (kf, bytes_f), (kb, bytes_b) = _record(torch, lambda k: _repeat_kv(k, heads // kv),
                                           torch.randn(b, s, kv, d, dtype=bf))
    assert (kf, bytes_f) == (1, 2 * n_kv + 2 * n_q)         # per tensor: K, then V
    assert (kb, bytes_b) == (1, 2 * n_q + 2 * n_kv)
    (kf, bytes_f), (kb, bytes_b) = _record(torch, lambda a, c: _swiglu(torch, a, c),
                                           torch.randn(b, s, f, dtype=bf),
                                           torch.randn(b, s, f, dtype=bf))
    assert (kf, bytes_f) == (E._SWIGLU_FWD[1], E._SWIGLU_FWD[0] * T * f)
    assert (kb, bytes_b) == (E._SWIGLU_BWD[1], E._SWIGLU_BWD[0] * T * f)
    # a residual's gradient joining the norm's: one add of two bf16 gradients
    (k_add, bytes_add), _ = _record(torch, lambda a, c: a + c, x, x.clone())
    assert (k_add, bytes_add) == (E._RESIDUAL_GRAD[1], E._RESIDUAL_GRAD[0] * T * h)


CFG = GPTConfig(hidden=512, layers=2, heads=8, seq=256, vocab=1024, arch="llama",
                kv_heads=2, ffn_hidden=1024)


def _ops(parallel, config=CFG):
    """Rank 0's traced step ops of a one-position pipeline (every template body)."""
    _, raw = _short_templates(config, parallel, [0])
    t = raw[0][0]
    return [op for body in t.bodies.values() for op in body] + list(t.tail)


@pytest.mark.parametrize("recompute, tp", [("none", 1), ("op", 1), ("full", 2)])
def test_the_rewrite_adds_the_closed_forms_bytes(recompute, tp):
    """After each fused op of a traced Llama step (forward, recomputed forward, backward)
    the kernels eager PyTorch runs beyond it: their bytes are the eager count less the
    program's own (module docstring), the K/V repeat after each rotated k; every other op
    passes unchanged, as does a GPT step."""
    par = ParallelConfig(global_batch=2, micro_batch=1, tp=tp, recompute=recompute,
                         sequence_parallel=False)
    ops = _ops(par)
    new = E.with_eager_kernels(ops)
    assert [op for op in new if E.EAGER_NAME not in getattr(op, "name", "")] == ops
    T, h, f = CFG.seq, CFG.hidden, CFG.ffn_hidden // tp
    d = h // CFG.heads
    n_q, n_kv = T * CFG.heads // tp * d, T * max(CFG.kv_heads // tp, 1) * d
    # eager bytes less the program's (norm 6 + its weight gradient 6, rope 4, SwiGLU 6/10)
    expected = {"attention: norm": 30 * T * h, "mlp: norm": 30 * T * h,
                "head: final norm": 30 * T * h,
                "attention: norm grad + residual": (92 + 6 - 12) * T * h,
                "mlp: norm grad + residual": (92 + 6 - 12) * T * h,
                "head: final norm grad": (92 - 12) * T * h,
                "attention: rope q": 16 * n_q, "attention: rope^T dq": 16 * n_q,
                "attention: rope k": 16 * n_kv + 2 * (2 * n_kv + 2 * n_q),
                "attention: rope^T dk": 16 * n_kv + 2 * (2 * n_q + 2 * n_kv),
                "mlp: silu(zg) * zu": 4 * T * f, "mlp: swiglu grad": 8 * T * f}
    seen, i = set(), 0
    while i < len(new):
        op = new[i]
        i += 1
        _, base, suffix = E._base(getattr(op, "name", ""))
        if base not in expected or E.EAGER_NAME in op.name:
            continue
        added = []
        while i < len(new) and E.EAGER_NAME in getattr(new[i], "name", ""):
            added.append(new[i])
            i += 1
        seen.add((base, suffix))
        # groups share their bytes in whole bytes: at most one byte per kernel lost
        assert expected[base] - len(added) <= sum(a.bytes for a in added) <= expected[base], \
            (base, suffix)
        assert all(a.kernel.kind.value == "elementwise" for a in added)
    recomputed = {(b, " (recompute)") for b in ("attention: norm", "attention: rope q",
                                                "attention: rope k", "mlp: norm",
                                                "mlp: silu(zg) * zu")}
    # "op" names its re-run ops; "full" re-runs the forward under the forward's names
    assert seen == {(b, "") for b in expected} | (recomputed if recompute == "op" else set())
    gpt, plain = GPTConfig(hidden=64, layers=2, heads=4, seq=32, vocab=64), \
        ParallelConfig(global_batch=2, micro_batch=1, tp=tp)
    assert E.with_eager_kernels(_ops(plain, gpt)) == tuple(_ops(plain, gpt))
    # as many K/V heads as heads: torchtitan's repeat_kv returns K and V, no copy
    mha = GPTConfig(hidden=64, layers=2, heads=4, seq=32, vocab=64, arch="llama", kv_heads=4,
                    ffn_hidden=96)
    assert not [op for op in E.with_eager_kernels(_ops(plain, mha))
                if "repeat K, V" in getattr(op, "name", "")]
    assert [op for op in E.with_eager_kernels(_ops(plain, CFG))
            if "repeat K, V" in getattr(op, "name", "")]


def test_simulate_prices_eager_kernels_and_refuses_other_models():
    par = ParallelConfig(global_batch=2, micro_batch=1, recompute="op", attention="flash2")
    fused = simulate_gpt(CFG, par, "h200-dgx")
    eager = simulate_gpt(CFG, par, "h200-dgx", eager_kernels=True)
    assert eager.step_time_s > fused.step_time_s and eager.eager_kernels
    assert eager.to_json()["eager_kernels"] is True and not fused.eager_kernels
    assert eager.peak_memory_gb == fused.peak_memory_gb          # kernels, not tensors
    gpt = GPTConfig(hidden=64, layers=2, heads=4, seq=32, vocab=64)
    with pytest.raises(ValueError, match="eager_kernels prices eager PyTorch's unfused "
                                         "kernels of the dense Llama layer.*arch='gpt'"):
        simulate_gpt(gpt, ParallelConfig(global_batch=2, micro_batch=1), "h200-dgx",
                     eager_kernels=True)
    with pytest.raises(ValueError, match="eager_kernels must be True or False"):
        simulate_gpt(CFG, par, "h200-dgx", eager_kernels="yes")


def test_the_cli_flag():
    out = subprocess.run([sys.executable, "-m", "vcluster", "simulate", "train",
                          "--arch", "llama", "--hidden", "512", "--layers", "2", "--heads", "8",
                          "--kv-heads", "2", "--ffn-hidden", "1024", "--seq", "256",
                          "--vocab", "1024", "--global-batch", "2", "--micro-batch", "1",
                          "--hardware", "h200-dgx", "--eager-kernels"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "eager PyTorch's: RMSNorms, rotary embeddings, SwiGLU" in out.stdout
