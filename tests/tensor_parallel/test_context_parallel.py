"""ContextParallelAttention: ring and all_gather causal attention with the sequence split
over ``cp`` equal an unsharded numpy reference (output and dq, dk, dv); the declared FLOPs
are balanced across ranks and equal the closed form; the emulator moves what the trace
predicts, which equals the closed forms of the module docstring."""

import numpy as np
import pytest

from mesh import Mesh
from tensor_parallel import (ContextParallelAttention as CPA, causal_chunk_pairs, chunk_ids,
                             join_sequence, sequence_positions, split_sequence)
from vcluster import VirtualCluster
from vcluster.runtime.tracing import (TraceCompute, TraceRecv, TraceSend, comm_signature,
                                      meta_like, trace_comm_signature, trace_program)
from vcluster.timing.cost_model import SimpleCostModel
from vcluster.timing.engine import simulate_trace

pytestmark = pytest.mark.timeout(120)

# cp 2 runs on a (cp=2, dp=2) mesh: the cp groups are ranks (0, 2) and (1, 3)
MESHES = {1: Mesh((1,), ("cp",)), 2: Mesh((2, 2), ("cp", "dp")), 4: Mesh((4,), ("cp",))}
ALGORITHMS = ("ring", "all_gather")


# --- the unsharded reference, from the definitions ---------------------------------------
def reference(q, k, v, dy):
    """O = softmax(q k^T/sqrt(d) + M) v, M = -inf above the diagonal, and (dq, dk, dv)."""
    s, d = q.shape[1], q.shape[2]
    scores = np.einsum("bid,bjd->bij", q, k) / np.sqrt(d)
    scores[:, ~np.tril(np.ones((s, s), dtype=bool))] = -np.inf
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("bij,bjd->bid", p, v)
    dp = np.einsum("bid,bjd->bij", dy, v)
    dv = np.einsum("bij,bid->bjd", p, dy)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) / np.sqrt(d)
    return o, np.einsum("bij,bjd->bid", ds, k), np.einsum("bij,bid->bjd", ds, q), dv


def _inputs(b, heads, s, d, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b * heads, s, d)).astype(dtype) for _ in range(4)]


# (b, heads, chunk length c, head_dim): s = 2·cp·c; c = 1 leaves only diagonal entries
SHAPES = [(1, 1, 1, 4), (2, 3, 3, 8), (3, 2, 2, 2)]
CASES = [(cp, alg, shape) for cp in MESHES for alg in ALGORITHMS for shape in SHAPES]


@pytest.mark.parametrize("cp, algorithm, shape", CASES,
                         ids=[f"cp{c}-{a}-{'x'.join(map(str, s))}" for c, a, s in CASES])
def test_equals_the_unsharded_reference(cluster_of, cp, algorithm, shape):
    b, heads, c, d = shape
    q, k, v, dy = _inputs(b, heads, 2 * cp * c, d, seed=cp)
    op = CPA(heads, d, algorithm)
    got = op.backward(cluster_of(MESHES[cp]), q, k, v, dy)
    for name, x, want in zip(("O", "dq", "dk", "dv"), got, reference(q, k, v, dy)):
        np.testing.assert_allclose(x, want, rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(op.run(cluster_of(MESHES[cp]), q, k, v), got[0], rtol=1e-12)


@pytest.fixture(scope="module")
def strict_cluster():
    with VirtualCluster(Mesh((2,), ("cp",)), array_module="strict", timeout_s=30) as cluster:
        yield cluster


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_contiguous_chunks_and_float32_on_strict_arrays(strict_cluster, algorithm):
    """Without load balancing the math is the same; float32 stays float32; device code
    never mixes host arrays (CuPy's rules, the strict array module)."""
    q, k, v, dy = _inputs(2, 2, 8, 4, seed=7)
    got = CPA(2, 4, algorithm, load_balance=False).backward(strict_cluster, q, k, v, dy)
    for x, want in zip(got, reference(q, k, v, dy)):
        np.testing.assert_allclose(x, want, rtol=1e-9, atol=1e-12)
    q32, k32, v32, dy32 = (a.astype(np.float32) for a in (q, k, v, dy))
    got32 = CPA(2, 4, algorithm).backward(strict_cluster, q32, k32, v32, dy32)
    for x, want in zip(got32, reference(q, k, v, dy)):
        assert x.dtype == np.float32
        np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-5)


# --- the layout ----------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_split_join_and_positions(cp, load_balance):
    s, c = 4 * cp, 2
    x = np.arange(2 * s * 3).reshape(2, s, 3)
    pieces = split_sequence(x, cp, load_balance)
    np.testing.assert_array_equal(join_sequence(pieces, load_balance), x)
    for r, piece in enumerate(pieces):
        pos = sequence_positions(s, cp, r, load_balance)
        np.testing.assert_array_equal(piece, x[:, pos])
        lo, hi = (r, 2 * cp - 1 - r) if load_balance else (2 * r, 2 * r + 1)
        assert chunk_ids(cp, r, load_balance) == (lo, hi)
        assert list(pos) == list(range(lo * c, lo * c + c)) + list(range(hi * c, hi * c + c))
    all_pos = np.concatenate([sequence_positions(s, cp, r, load_balance) for r in range(cp)])
    assert sorted(all_pos) == list(range(s))


# --- FLOPs ------------------------------------------------------------------------------------
def _traced(op, mesh, local_shape, backward=True, dtype=np.float64):
    cp = mesh.axis_size("cp")
    meta = meta_like(np.empty(local_shape, dtype))
    fn = op.forward_backward_local if backward else op.forward_local
    return trace_program(mesh, fn, [(meta,) * (4 if backward else 3)] * mesh.size), cp


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_declared_flops_are_balanced_and_equal_the_closed_form(cluster_of, cp, algorithm):
    b, heads, c, d = 2, 2, 2, 4
    mesh = MESHES[cp]
    op = CPA(heads, d, algorithm)
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    op.backward(cluster, *_inputs(b, heads, 2 * cp * c, d))
    emulated = cluster.stats()["flops"].tolist()
    traces, _ = _traced(op, mesh, (b * heads, 2 * c, d))
    traced = [sum(o.flops for o in t.ops if isinstance(o, TraceCompute)) for t in traces]
    assert traced == emulated
    for r in range(mesh.size):
        pos = mesh.group_position("cp", r)
        pairs = 2 * cp + 1                                   # chunk pairs, every rank
        assert causal_chunk_pairs(cp, pos) == pairs
        assert traced[r] == (4 + 10) * b * heads * c * c * d * pairs
        assert traced[r] == sum(op.flops((b * heads, 2 * c, d), cp, pos, bw) for bw in (0, 1))
    assert max(traced) <= 1.05 * min(traced)
    # the whole causal triangle, each chunk pair once: cp·(2cp+1) pairs
    assert sum(traced) * cp // mesh.size == 14 * b * heads * c * c * d * cp * (2 * cp + 1)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_chunks_would_not_be_balanced(cluster_of, cp):
    """Without load balancing rank r computes 4r+3 chunk pairs: rank cp-1 does (4cp-1)/3
    times rank 0's work; the emulator declares exactly that (cp 2, 4)."""
    unbalanced = [causal_chunk_pairs(cp, r, load_balance=False) for r in range(cp)]
    assert unbalanced == [4 * r + 3 for r in range(cp)]
    assert max(unbalanced) / min(unbalanced) == pytest.approx((4 * cp - 1) / 3)
    assert max(unbalanced) > 1.05 * min(unbalanced)
    assert sum(unbalanced) == sum(causal_chunk_pairs(cp, r) for r in range(cp))
    if cp in MESHES:
        b, heads, c, d = 1, 2, 2, 4
        op = CPA(heads, d, "ring", load_balance=False)
        cluster = cluster_of(MESHES[cp])
        cluster.reset_stats()
        op.run(cluster, *_inputs(b, heads, 2 * cp * c, d)[:3])
        flops = cluster.stats()["flops"].tolist()
        pos = [MESHES[cp].group_position("cp", r) for r in range(MESHES[cp].size)]
        assert flops == [4 * b * heads * c * c * d * unbalanced[p] for p in pos]


# --- traffic --------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("algorithm, collectives", [("ring", "auto"), ("all_gather", "ring"),
                                                     ("all_gather", "auto")])
def test_emulated_traffic_equals_the_trace_and_the_closed_form(cluster_of, cp, algorithm,
                                                               collectives):
    b, heads, c, d = 2, 1, 3, 4
    mesh = MESHES[cp]
    op = CPA(heads, d, algorithm, collective_algorithm=collectives)
    cluster = cluster_of(mesh)
    for backward in (False, True):
        cluster.reset_stats()
        q, k, v, dy = _inputs(b, heads, 2 * cp * c, d)
        op.backward(cluster, q, k, v, dy) if backward else op.run(cluster, q, k, v)
        events, stats = cluster.trace(), cluster.stats()
        traces, _ = _traced(op, mesh, (b * heads, 2 * c, d), backward)
        for t in traces:
            assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
        if collectives == "auto":
            continue
        x = b * heads * 2 * c * d * 8                     # one local K (or V) shard, bytes
        if algorithm == "ring":    # K, V: cp-1 steps each way; backward: dK, dV cp steps
            want = 2 * x * (cp - 1) * (2 if backward else 1) + (2 * x * cp if backward else 0)
        else:                      # ring collectives: (cp-1)·X per all_gather/reduce_scatter
            want = 2 * (cp - 1) * x * (3 if backward else 1)
        assert stats["bytes_sent"].tolist() == [want] * mesh.size
        assert stats["bytes_received"].tolist() == [want] * mesh.size
        assert want == op.sent_bytes((b * heads, 2 * c, d), cp, 8) + (
            op.sent_bytes((b * heads, 2 * c, d), cp, 8, backward=True) if backward else 0)


def test_the_ring_sends_before_it_computes_and_the_simulator_overlaps_it():
    """Each step isends the block it holds before its products and receives the next one
    after them, so a transfer shorter than a step's products is hidden entirely."""
    cp, b, heads, c, d = 4, 2, 2, 8, 16
    mesh = Mesh((cp,), ("cp",))
    traces, _ = _traced(CPA(heads, d, "ring"), mesh, (b * heads, 2 * c, d), backward=False)
    ops = traces[0].ops
    kinds = "".join("s" if isinstance(o, TraceSend) else "r" if isinstance(o, TraceRecv)
                    else "g" if isinstance(o, TraceCompute) and o.gemm else "" for o in ops)
    # step 0: 3 diagonal/full chunk products as 2 q-chunk blocks (4 gemms), then 2 per step
    # rank 0, step 0: its chunk 0 against its K chunk 0 and its chunk 2cp-1 against both
    # (4 gemms); later steps: chunk 2cp-1 against the visiting block (2 gemms)
    assert kinds == "ss" + "gggg" + "rr" + ("ss" + "gg" + "rr") * (cp - 2) + "gg"
    step_flops = 2 * 4 * b * heads * c * c * d                    # 2 chunk pairs per step
    flops_per_s = 1e12
    block_bytes = b * heads * 2 * c * d * 8
    link = 2 * block_bytes / (0.5 * step_flops / flops_per_s)   # K + V in half a step
    model = SimpleCostModel(flops_per_s=flops_per_s, bytes_per_s=1e15, alpha_s=0.0,
                            link_bytes_per_s=link)
    res = simulate_trace(traces, model)
    for st in res.stats:
        assert st.comm_s > 0
        assert st.exposed_comm_s <= 1e-3 * st.comm_s


# --- bad arguments ---------------------------------------------------------------------------
def test_bad_arguments_are_named(cluster_of):
    with pytest.raises(ValueError, match="unknown algorithm 'tree'.*'ring', 'all_gather'"):
        CPA(2, 4, "tree")
    with pytest.raises(ValueError, match="head_dim must be an int >= 1, got 0"):
        CPA(2, 0)
    with pytest.raises(ValueError, match="all_gather has no algorithm 'nope'"):
        CPA(2, 4, "all_gather", collective_algorithm="nope")
    cluster = cluster_of(MESHES[2])
    q = np.zeros((4, 6, 4))
    with pytest.raises(ValueError, match=r"s=6 must be divisible by 2·cp = 4"):
        CPA(2, 4).run(cluster, q, q, q)
    with pytest.raises(ValueError, match=r"q of shape \(4, 8, 4\) must be \(b·heads, s, 8\)"):
        CPA(2, 8).run(cluster, *[np.zeros((4, 8, 4))] * 3)
    with pytest.raises(ValueError, match=r"k has shape \(4, 4, 4\)"):
        CPA(2, 4).run(cluster, np.zeros((4, 8, 4)), np.zeros((4, 4, 4)), np.zeros((4, 8, 4)))
    with pytest.raises(ValueError, match="has no axis 'seq'"):
        CPA(2, 4, axis="seq").run(cluster, *[np.zeros((4, 8, 4))] * 3)
    with pytest.raises(ValueError, match="s=6 must be divisible by 2·cp = 4"):
        split_sequence(np.zeros((1, 6)), 2)
    with pytest.raises(ValueError, match="cp must be an int >= 1, got 0"):
        chunk_ids(0, 0)


# --- flash blocks -----------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_flash_blocks_are_one_fused_kernel_each_with_the_same_math(cluster_of, cp, algorithm):
    """``flash=True`` declares each block's forward and backward as one attention kernel:
    the same results to the bit, the same FLOPs on every rank, and per kernel only the
    bytes of q, k, v and the outputs plus the fp32 log-sum-exp, never the c x n scores."""
    b, heads, c, d = 2, 2, 3, 4
    mesh = MESHES[cp]
    args = _inputs(b, heads, 2 * cp * c, d, seed=2)
    plain, flash = CPA(heads, d, algorithm), CPA(heads, d, algorithm, flash=True)
    assert "flash=True" in repr(flash)
    for x, y in zip(plain.backward(cluster_of(mesh), *args), flash.backward(cluster_of(mesh), *args)):
        np.testing.assert_array_equal(x, y)
    local = (b * heads, 2 * c, d)
    unfused, _ = _traced(plain, mesh, local)
    fused, _ = _traced(flash, mesh, local)
    for t_plain, t_flash in zip(unfused, fused):
        ops_plain = [o for o in t_plain.ops if isinstance(o, TraceCompute)]
        ops_flash = [o for o in t_flash.ops if isinstance(o, TraceCompute)]
        assert sum(o.flops for o in ops_flash) == sum(o.flops for o in ops_plain)
        kernels = [o for o in ops_flash if o.kernel is not None]
        assert all(o.flops == 0 for o in ops_flash if o.kernel is None)  # merges, zeros, ...
        forward = [o for o in kernels if not o.kernel.backward]
        backward = [o for o in kernels if o.kernel.backward]
        pos = mesh.group_position("cp", t_flash.rank)
        assert len(forward) == len(backward) > 0
        for o in kernels:
            bh, s_q, s_kv, hd = o.kernel.shape
            assert o.kernel.kind.value == "attention" and o.kernel.flash
            assert (bh, s_q, hd) == (b * heads, c, d) and s_kv % c == 0
            assert o.flops == (10 if o.kernel.backward else 4) * bh * s_q * s_kv * hd
            arrays = (4 * s_q + 4 * s_kv) if o.kernel.backward else (2 * s_q + 2 * s_kv)
            assert o.bytes == arrays * bh * hd * 8 + 4 * bh * s_q      # + the fp32 LSE
            assert not o.kernel.causal or s_kv == c     # causal: a lone diagonal chunk
        assert sum(o.flops for o in forward) == plain.flops(local, cp, pos)
        assert sum(o.flops for o in backward) == plain.flops(local, cp, pos, backward=True)

