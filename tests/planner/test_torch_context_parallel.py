"""PyTorch's context-parallel attention beside the program's ring
(vcluster.planner.torch_context_parallel): every rewritten op's bytes against PyTorch's
kernels written out by hand for a traced grouped-query Llama layer under cp 2 and 4 —
float32 merges and accumulators, K and V of the query heads on the wire, the buffer
copies — the ops outside the ring untouched, the refusals, and a simulated step that
grows by more the longer the ring."""

import json
import subprocess
import sys

import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.planner.simulation import simulate_gpt
from vcluster.planner.torch_context_parallel import (GRAD_TAGS, KV_TAGS, TORCH_CP_NAME,
                                                     with_torch_cp_kernels)
from vcluster.runtime.tracing import (KernelKind, TraceCompute, TraceRecv, TraceSend,
                                      trace_program)

pytestmark = pytest.mark.timeout(300)

H, HEADS, KV, S, D = 64, 4, 2, 64, 16
G = HEADS // KV
CFG = GPTConfig(hidden=H, layers=1, heads=HEADS, kv_heads=KV, seq=S, vocab=128,
                arch="llama", ffn_hidden=96, dtype="float16")


def _traced(cp: int) -> dict:
    par = ParallelConfig(global_batch=1, micro_batch=1, cp=cp, attention="flash2")
    mesh = par.mesh()
    traces = trace_program(mesh, train_program, GPT(CFG).meta_args(mesh, par))
    return {t.rank: (t.ops, mesh.group("cp", t.rank)) for t in traces}


def _ring_name(op) -> str | None:
    return op.name.split(": cp: ", 1)[1] if type(op) is TraceCompute \
        and ": cp: " in op.name else None


@pytest.mark.parametrize("cp", [2, 4])
def test_every_ring_op_is_priced_as_pytorch_runs_it(cp):
    for rank, (ops, peers) in _traced(cp).items():
        new = with_torch_cp_kernels(ops, G, peers)
        added = [op for op in new if type(op) is TraceCompute and TORCH_CP_NAME in op.name]
        kept = [op for op in new if not (type(op) is TraceCompute and TORCH_CP_NAME
                                         in op.name)]
        assert len(kept) == len(ops)
        c = S // cp // 2                                  # rows of one chunk
        k_bytes = KV * 2 * c * D * 2              # a K shard (kv heads, 2 chunks), 16-bit
        for old, op in zip(ops, kept):
            name = _ring_name(old)
            if isinstance(old, (TraceSend, TraceRecv)):
                if old.peer in peers and old.tag in KV_TAGS:
                    assert op.nbytes == G * old.nbytes    # K, V of the query heads
                elif old.peer in peers and old.tag in GRAD_TAGS:
                    assert op.nbytes == 2 * G * old.nbytes   # ... in float32
                else:
                    assert op == old
                continue
            if name == "merge (log-sum-exp)":
                # three float32 kernels over one chunk's output rows (E = HEADS·c·D)
                assert (old.bytes, op.bytes) == (6 * HEADS * c * D, 32 * HEADS * c * D)
            elif name == "dq +=":
                assert (old.bytes, op.bytes) == (2 * HEADS * c * D, 10 * HEADS * c * D)
            elif name in ("dk, dv +=", "accumulate dk, dv"):
                rows = old.bytes // (8 * KV * D)          # key rows of dk (kv heads)
                per = 10 if name == "dk, dv +=" else 16   # B an element of dk and of dv
                assert op.bytes == 2 * per * G * KV * rows * D
            else:
                assert op == old, name
        # a cast of each forward block's output (6 B an element of its q rows), one back
        # to 16 bits per concatenation, a concatenation of K and V per exchange
        blocks = [op for op in ops if type(op) is TraceCompute and op.kernel is not None
                  and op.kernel.kind is KernelKind.ATTENTION and not op.kernel.backward]
        concats = [op for op in ops if _ring_name(op) == "concatenate chunks"]
        exchanges = [op for op in ops if type(op) is TraceSend and op.peer in peers
                     and op.tag == KV_TAGS[0]]
        assert len(added) == len(blocks) + len(concats) + len(exchanges)
        assert sum(op.bytes for op in added) == (
            sum(6 * op.kernel.shape[0] * op.kernel.shape[1] * op.kernel.shape[3]
                for op in blocks)
            + sum(3 * op.bytes for op in concats)
            + len(exchanges) * 8 * G * k_bytes // 2)
        assert exchanges and blocks


def test_nothing_outside_the_ring_changes():
    ops, _ = _traced(2)[0]
    assert with_torch_cp_kernels(ops, G, cp_peers=()) != ops   # its computes, not its p2p
    plain = [op for op in ops if _ring_name(op) is None and type(op) is TraceCompute]
    new = [op for op in with_torch_cp_kernels(ops, G, (0, 1))
           if type(op) is TraceCompute and _ring_name(op) is None
           and TORCH_CP_NAME not in op.name]
    assert new == plain
    with pytest.raises(ValueError, match=r"with_torch_cp_kernels: group must be an int >= 1 "
                                         r"\(query heads per K/V head\), got 0"):
        with_torch_cp_kernels(ops, 0, (0, 1))


@pytest.mark.parametrize("par, says", [
    (ParallelConfig(global_batch=8, micro_batch=1), "cp=1"),
    (ParallelConfig(global_batch=8, micro_batch=1, cp=2, cp_algorithm="all_gather"),
     "cp_algorithm='all_gather'"),
])
def test_refused_where_it_cannot_apply(par, says):
    cfg = GPTConfig(hidden=256, layers=2, heads=4, kv_heads=2, seq=256, vocab=512,
                    arch="llama", ffn_hidden=512)
    with pytest.raises(ValueError, match=rf"simulate_gpt: torch_cp=True with .*{says}.*: it "
                                         r"prices PyTorch's context-parallel ring; allowed"):
        simulate_gpt(cfg, par, "h100-dgx", torch_cp=True)


def test_a_simulated_step_pays_more_the_longer_the_ring():
    """Llama 3.1 8B's shapes (4 layers), 32K tokens of each rank's, on 8 H100s: PyTorch's
    ring costs more than Megatron's, by a share that grows with cp (each ring step merges
    and accumulates once more over the same local rows), and only under attention."""
    cfg = GPTConfig(hidden=4096, layers=4, heads=32, kv_heads=8, seq=32768, vocab=128256,
                    arch="llama", ffn_hidden=14336)
    share = {}
    for cp in (2, 4):
        c = cfg.__class__(**{**cfg.__dict__, "seq": 32768 * cp // 2})
        par = ParallelConfig(global_batch=8 // cp, micro_batch=1, dp=8 // cp, cp=cp,
                             zero_stage=3, attention="flash2")
        megatron, torch = (simulate_gpt(c, par, "h100-dgx", torch_cp=t) for t in (False,
                                                                               True))
        assert torch.torch_cp and not megatron.torch_cp
        ops = [{o.op: o.compute_s for o in s.ops} for s in (megatron, torch)]
        assert ops[1]["attention"] > ops[0]["attention"]
        assert ops[1]["mlp"] == pytest.approx(ops[0]["mlp"])
        share[cp] = torch.step_time_s / megatron.step_time_s - 1
    assert 0 < share[2] < share[4] < 0.15


def test_the_cli_flag(tmp_path):
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "vcluster", "simulate", "train",
                               "--arch", "llama", "--hidden", "512", "--layers", "2",
                               "--heads", "8", "--kv-heads", "2", "--ffn-hidden", "1024",
                               "--seq", "512", "--vocab", "1024", "--global-batch", "2",
                               "--micro-batch", "1", "--hardware", "h100-dgx", *flags],
                              capture_output=True, text=True, timeout=240)
    out = run("--cp", "2", "--torch-cp", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    assert "PyTorch's context-parallel ring" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["torch_cp"] is True
    out = run("--torch-cp")
    assert out.returncode == 2 and "--torch-cp prices PyTorch's context-parallel ring: it " \
        "needs --cp 2 or more with --cp-algorithm ring, got --cp 1" in out.stderr
