"""Per-micro-batch costs of one GPT (or Llama) stage's pieces on one device, from the
traced program.

The planner's screen (:mod:`vcluster.planner.screen`) needs, for a tensor-parallel
degree t, a micro-batch b, sequence parallelism and a recomputation mode, the time one
device spends on one micro-batch in each piece of a stage:

* a transformer layer's forward ``F``, input gradient ``I`` and weight gradient ``W``
  (``B = I + W``; under full recomputation ``I`` includes the re-run forward),
* the vocabulary-parallel embedding's and head's ``F``, ``I`` and ``W`` (the head's
  ``F`` includes the cross-entropy).

Rather than a second cost model, these come from the program the replay runs: the
embedding, one :class:`~tensor_parallel.transformer.TransformerLayer` and the head are
traced on shape-only 16-bit arrays on rank 0 of a tp group of t (other members are not
traced; their collectives complete on their own), and every traced op is priced with
the replay's :class:`~vcluster.timing.hardware_model.HardwareCostModel`: compute by
``compute_time_s``, each tensor-parallel collective by ``collective_time_s`` with no
concurrent flows. TP collectives sit on the compute stream's critical path in the
program (each result is used at once), so ``seconds`` = compute + TP communication —
but for the input-gradient reductions that Megatron overlaps with the weight gradients
(``async_grad_reduce``): an asynchronous collective adds only what the compute between
its issue and its wait does not cover.

With context parallelism (cp > 1) the pieces are traced on a (cp, tp) mesh, every cp
rank of tp rank 0 (the ring's receives need their senders), on this rank's s/cp rows;
rank 0's ops are priced (load-balanced chunks: every cp rank does the same work). The
K/V ring's (or all-gather's) transfers are ``cp_s``: priced alone (``p2p_time_s``) and
kept out of ``seconds`` — they overlap the attention blocks in the program — while its
all-gather/reduce-scatter variant's collectives are blocking, in ``comm_s``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from mesh import Mesh
from modeling import DEFAULT_RECOMPUTE_MODULES, LLAMA_BLOCK
from pipeline_parallel.gpt import FUSED_ATTENTION, GPT
from pipeline_parallel.llama import llama_param_shapes
from sharding import shard_slices
from tensor_parallel.attention import TransformerOps
from tensor_parallel.llama import llama_piece, llama_stage
from tensor_parallel.moe_layer import is_moe_param, llama_moe_stage, moe_piece
from tensor_parallel.transformer import param_layout
from tensor_parallel.moe_load import ExpertLoad
from tensor_parallel.transformer import TransformerLayer, VocabParallelEmbedding, VocabParallelHead
from tensor_parallel.context_parallel import ContextParallelAttention, sequence_positions
from vcluster.runtime.tracing import (MetaArray, TraceCollective, TraceCompute, TraceRecv,
                                      TraceSend, TraceWait, is_ring_tag, trace_program)

from .inductor_kernels import pytorch_kernels

__all__ = ["PieceCost", "StagePieces", "trace_stage_pieces"]

_MARK = "screen: end of piece"
_PIECES = ("emb.F", "layer.F", "head.F", "head.I", "layer.I", "emb.I", "head.W", "layer.W",
           "emb.W")


@dataclass(frozen=True)
class PieceCost:
    """One piece's work for one micro-batch on one device."""

    compute_s: float       # priced compute kernels
    comm_s: float          # tensor-parallel collectives (on the critical path)
    flops: float           # FLOPs executed (recomputation included)
    cp_s: float = 0.0      # context parallelism's sends, overlapping the attention

    @property
    def seconds(self) -> float:
        return self.compute_s + self.comm_s

    def __add__(self, other: "PieceCost") -> "PieceCost":
        return PieceCost(self.compute_s + other.compute_s, self.comm_s + other.comm_s,
                         self.flops + other.flops, self.cp_s + other.cp_s)

    def __mul__(self, k: float) -> "PieceCost":
        return PieceCost(self.compute_s * k, self.comm_s * k, self.flops * k, self.cp_s * k)

    __rmul__ = __mul__




@dataclass(frozen=True)
class StagePieces:
    """Costs per micro-batch of the pieces ``emb``, ``layer`` and ``head`` for actions
    ``F``, ``I``, ``W``: ``pieces[("layer", "F")]`` etc."""

    tp: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str
    pieces: dict
    cp: int = 1
    cp_algorithm: str = "ring"

    def __getitem__(self, key) -> PieceCost:
        return self.pieces[key]


def _local_shapes(h: int, s: int, V: int, t: int) -> dict:
    """The local parameter shapes on one member of a tp group of t (see transformer.py)."""
    return {"ln1_g": (h,), "ln1_b": (h,), "w_qkv": (h, 3, h // t), "b_qkv": (3, h // t),
            "w_o": (h // t, h), "b_o": (h,), "ln2_g": (h,), "ln2_b": (h,),
            "w_1": (h, 4 * h // t), "b_1": (4 * h // t,), "w_2": (4 * h // t, h), "b_2": (h,),
            "wte": (V // t, h), "wpe": (s, h), "lnf_g": (h,), "lnf_b": (h,),
            "w_out": (h, V // t)}


def _llama_modules(ops, config, recompute: str, cp=None, positions=None,
                   recompute_modules=DEFAULT_RECOMPUTE_MODULES):
    """Llama's embedding, one layer and head with this rank's pieces (shape-only). Built
    for two micro-batches and given one, the layer leaves out the once-per-step sums over
    tp of the K/V replicas' gradients (kv_heads < tp), of the QK-norm gains' and of
    multi-head latent attention's replicated projections': the replay counts them."""
    shapes = llama_param_shapes(dataclasses.replace(config, layers=1))
    meta = {n.rsplit(".", 1)[-1]: llama_piece(n, MetaArray(shape, np.float16), ops.tp_size,
                                              ops.tp_rank, config.kv_heads)
            for n, shape in shapes.items()}
    stage = llama_stage(ops, lambda names, prefix="": {n: meta[n] for n in names}, [0], True,
                        True, config.heads, config.kv_heads, config.hidden, config.rope_theta,
                        recompute, config.eps, 2, config.seq, cp, positions,
                        tie=config.tie_embeddings, head_dim=config.head_dim,
                        qk_norm=config.qk_norm, latent=config.latent_attention(),
                        window=config.window, sinks=config.attention_sinks,
                        qkv_bias=config.qkv_bias, out_bias=config.out_bias,
                        recompute_modules=recompute_modules)
    return stage.modules


def _context_parallel(dev, config, t: int, algorithm: str, flash: bool = True):
    """(ContextParallelAttention, this rank's positions), or (None, None) without cp;
    ``flash``: its blocks as fused attention kernels (``ParallelConfig.attention``)."""
    if "cp" not in dev.mesh.axes:
        return None, None
    n = dev.mesh.axis_size("cp")
    kv = max(config.kv_heads // t, 1)
    group = config.heads // t // kv if config.block.grouped_query else 1
    return (ContextParallelAttention(config.heads // t, config.head_dim, algorithm, "cp",
                                     group=group, label="gpt: attention: cp", flash=flash,
                                     v_head_dim=config.v_head_dim),
            sequence_positions(config.seq, n, dev.mesh.group_position("cp", dev.rank)))


def _moe_modules(ops, config, recompute: str, b: int, expert_skew: float,
                 folded: bool = False, ep_axes="ep", cp=None, positions=None,
                 dispatcher: str = "alltoall", recompute_modules=DEFAULT_RECOMPUTE_MODULES):
    """An MoE model's embedding, one layer and head on ep rank 0 of the mesh's "ep" axis
    (shape-only), routing ``ExpertLoad.skewed(..., expert_skew)``; ``folded``: the expert
    group is the axes ("ep", "tp") together (etp = 1), each rank routing its sequence
    slice."""
    shapes = GPT(dataclasses.replace(config, layers=1)).param_shapes()
    axes = ep_axes
    ep = ops.dev.mesh.axis_size(axes)
    coords = (ep, 0, 1, 0) if folded else (ep, 0, ops.tp_size, ops.tp_rank)
    split = (ops.dev.mesh.axis_size("cp") if cp is not None else 1) * (
        ops.tp_size if folded else 1)                  # the ranks a micro-batch routes from

    def piece(n, shape):
        a = MetaArray(shape, np.float16)
        if is_moe_param(n):
            return moe_piece(n, a, *coords)
        if config.block is LLAMA_BLOCK:
            return llama_piece(n, a, ops.tp_size, ops.tp_rank, config.kv_heads)
        return a[shard_slices(shape, param_layout(n, len(shape)), ops.dev.mesh, ops.dev.rank)]

    meta = {n.rsplit(".", 1)[-1]: piece(n, s) for n, s in shapes.items()}
    tokens = b * config.seq // split
    load = ExpertLoad.skewed(ep, config.experts, tokens, config.moe_top_k, expert_skew,
                             config.moe().capacity(tokens))
    params = lambda names, prefix="": {n: meta[n] for n in names}      # noqa: E731
    stage = llama_moe_stage(ops, params, [0], True, True, config.heads, config.kv_heads,
                            config.hidden, config.rope_theta, recompute, config.eps, 2,
                            config.seq, config.moe(dispatcher), 1.0, load,
                            tie=config.tie_embeddings,
                            ep_axes=axes, folded=folded, cp=cp, positions=positions,
                            head_dim=config.head_dim,
                            qk_norm=config.qk_norm, latent=config.latent_attention(),
                            window=config.window, sinks=config.attention_sinks,
                            qkv_bias=config.qkv_bias, out_bias=config.out_bias,
                            recompute_modules=recompute_modules)
    return stage.modules


def _program(dev, config, b: int, sp: bool, recompute: str, cp_algorithm: str = "ring",
             expert_skew: float = 1.0, attention: str = "flash",
             async_grad_reduce: bool = True, folded: bool = False, ep_axes="ep",
             dispatcher: str = "alltoall", tp_comm_overlap: bool = False,
             recompute_modules=DEFAULT_RECOMPUTE_MODULES):
    h, s, V, a = config.hidden, config.seq, config.vocab, config.heads
    t = dev.mesh.axis_size("tp")
    ops = TransformerOps(dev, "tp", sp, flash=attention in FUSED_ATTENTION,
                         async_grad_reduce=async_grad_reduce, tp_comm_overlap=tp_comm_overlap)
    cp, positions = _context_parallel(dev, config, t, cp_algorithm, ops.flash)
    if config.experts:
        emb, layer, head = _moe_modules(ops, config, recompute, b, expert_skew, folded,
                                        ep_axes, cp, positions, dispatcher, recompute_modules)
    elif config.block is LLAMA_BLOCK:
        emb, layer, head = _llama_modules(ops, config, recompute, cp, positions,
                                          recompute_modules)
    else:
        meta = {n: MetaArray(shape, np.float16)
                for n, shape in _local_shapes(h, s, V, t).items()}
        emb = VocabParallelEmbedding(meta)
        emb.positions = positions
        layer = TransformerLayer(meta, a // ops.tp_size, h // a, recompute, cp=cp,
                                 recompute_modules=recompute_modules)
        head = VocabParallelHead.build(lambda names: {n: meta[n] for n in names}, config.eps,
                                       config.tie_embeddings, emb)

    def mark():
        with dev.compute(_MARK):
            pass

    ids = MetaArray((b, s // (1 if cp is None else dev.mesh.axis_size("cp"))), np.int64)
    x = emb.forward(ops, 0, ids)
    mark()
    y = layer.forward(ops, 0, x)
    mark()
    logits = head.forward(ops, 0, y)
    _, dlogits = head.loss_and_grad(ops, logits, ids, b * s)
    mark()
    dy = head.backward_input(ops, 0, dlogits)
    mark()
    dx = layer.backward_input(ops, 0, dy)
    mark()
    emb.backward_input(ops, 0, dx)
    mark()
    for module in (head, layer, emb):
        module.backward_weight(ops, 0)
        mark()


def trace_stage_pieces(config, tp: int, micro_batch: int, sequence_parallel: bool,
                       recompute: str, costs, cp: int = 1, cp_algorithm: str = "ring",
                       ep: int = 1, expert_skew: float = 1.0,
                       attention: str = "flash", autocast_kernels: bool = False,
                       inductor_fusion: bool = False,
                       async_grad_reduce: bool = True, etp: int | None = None,
                       moe_dispatcher: str = "alltoall",
                       tp_comm_overlap: bool = False,
                       recompute_modules=DEFAULT_RECOMPUTE_MODULES) -> StagePieces:
    """Trace the pieces once (see the module docstring) and price them with ``costs``
    (a HardwareCostModel); ``cp``, ``cp_algorithm``: context parallelism. A mixture of
    experts (``config.experts``) is traced on ep rank 0 of a mesh (ep, tp) routing
    ``ExpertLoad.skewed(..., expert_skew)`` (its busiest expert on that rank); its
    all_to_alls count with the tp collectives. cp > 1 with experts is not supported.
    ``attention``: the kernel traced, "flash" or "flash-v1" (one fused kernel) or "unfused"
    (:class:`~pipeline_parallel.gpt.ParallelConfig`). ``autocast_kernels``: price the
    kernels plain PyTorch runs under autocast instead of the program's own
    (:mod:`.autocast_kernels`, as :func:`~.simulation.simulate_gpt` does), fused as
    ``torch.compile`` fuses them with ``inductor_fusion`` (:mod:`.inductor_kernels`).
    ``async_grad_reduce``: the layer's input-gradient reductions overlap its weight
    gradients (:attr:`~pipeline_parallel.gpt.ParallelConfig.use_async_grad_reduce`; default
    True, as under ParallelConfig's defaults); such an asynchronous collective costs the
    piece only what the compute between its issue and its wait leaves of it. ``etp``: the
    experts' tensor parallelism (default tp: each expert split over tp; 1 with ep > 1 and
    tp > 1: the expert group folded over the tp ranks, a mesh (ep/tp, tp)); with cp > 1
    the expert group takes whole cp groups (a mesh (ep/cp, cp, tp), traced on rank 0's cp
    group). ``moe_dispatcher``: ParallelConfig's. ``tp_comm_overlap``: the
    sequence-parallel gathers and reduce-scatters as ring steps overlapping their GEMMs
    (:attr:`~pipeline_parallel.gpt.ParallelConfig.use_tp_comm_overlap`): a ring step's
    receive costs the piece what its transfer (queued on the link to the next rank, as
    the traced rank's own send: every member runs alike) outlasts the compute since its
    send. Sliding-window attention on some of the
    layers (``config.window_layers``): the pieces are traced twice, a layer with the
    window and one without, and the layer's costs are their mean weighted by the layers
    of each kind (a rank's stage holds the model's mix, not its own).
    ``recompute_modules``: "selective"'s modules (Megatron-Core's; the layer re-runs them
    in its backward piece: :mod:`tensor_parallel.transformer`)."""
    args = (tp, micro_batch, sequence_parallel, recompute, costs, cp, cp_algorithm, ep,
            expert_skew, attention, autocast_kernels, inductor_fusion, async_grad_reduce,
            etp, moe_dispatcher, tp_comm_overlap, tuple(recompute_modules))
    if config.window_layers is not None:         # some layers windowed: the mean layer
        windowed = trace_stage_pieces(dataclasses.replace(config, window_layers=None), *args)
        full = trace_stage_pieces(dataclasses.replace(config, window=None,
                                                      window_layers=None), *args)
        share = config.windowed_layers() / config.layers
        return dataclasses.replace(full, pieces={
            key: windowed[key] * share + full[key] * (1 - share) if key[0] == "layer"
            else full[key] for key in full.pieces})
    sp = bool(sequence_parallel and tp > 1)
    folded = bool(config.experts) and etp == 1 and tp > 1 and ep > 1
    ep_axes = "ep"
    if config.experts:          # the expert group: whole cp (and, folded, tp) groups
        k = max(ep // (cp * (tp if folded else 1)), 1)
        mesh = Mesh((k, cp, tp), ("ep", "cp", "tp")) if cp > 1 else Mesh((k, tp), ("ep", "tp"))
        if ep > 1:
            ep_axes = ("ep",) + (("cp",) if cp > 1 else ()) + (("tp",) if folded else ())
    elif cp > 1:
        mesh = Mesh((cp, tp), ("cp", "tp"))
    else:
        mesh = Mesh((tp,), ("tp",))
    traces = trace_program(mesh, _program,
                           [(config, micro_batch, sp, recompute, cp_algorithm,
                             expert_skew, attention, async_grad_reduce, folded,
                             ep_axes, moe_dispatcher, tp_comm_overlap,
                             tuple(recompute_modules))] * mesh.size,
                           ranks=list(mesh.group("cp", 0)) if cp > 1 else [0])
    trace = traces[0]
    pieces, compute, comm, flops, ring, k = {}, 0.0, 0.0, 0.0, 0.0, 0
    in_flight = {}      # an asynchronous collective's handle -> its end on the piece's clock
    # collective matmuls: ring tag -> its sends' ends, and when the link to the next rank
    # frees (both on the piece's clock)
    ring_ends, link_free = {}, 0.0
    for op in pytorch_kernels(trace.ops, inductor_fusion) if autocast_kernels else trace.ops:
        if isinstance(op, TraceCompute) and op.name == _MARK:
            assert not in_flight, f"{_PIECES[k]}: a collective waited for in another piece"
            piece, action = _PIECES[k].split(".")
            assert not any(ring_ends.values()), f"{_PIECES[k]}: a ring step received in " \
                "another piece"
            pieces[(piece, action)] = PieceCost(compute, comm, flops, ring)
            compute, comm, flops, ring, k, link_free = 0.0, 0.0, 0.0, 0.0, k + 1, 0.0
        elif isinstance(op, TraceCompute):
            compute += costs.compute_time_s(op)
            flops += op.flops
        elif isinstance(op, TraceCollective) and op.handle is not None:
            in_flight[op.handle] = compute + comm + costs.collective_time_s(op, 1)
        elif isinstance(op, TraceWait):
            comm += max(0.0, in_flight.pop(op.handle) - (compute + comm))
        elif isinstance(op, TraceCollective):
            comm += costs.collective_time_s(op, 1)
        elif isinstance(op, TraceSend) and is_ring_tag(op.tag):      # collective matmul
            link_free = max(compute + comm, link_free) + costs.p2p_time_s(
                trace.rank, op.peer, op.nbytes)
            ring_ends.setdefault(op.tag, deque()).append(link_free)
        elif isinstance(op, TraceRecv) and is_ring_tag(op.tag):
            comm += max(0.0, ring_ends[op.tag].popleft() - (compute + comm))
        elif isinstance(op, TraceSend):
            ring += costs.p2p_time_s(trace.rank, op.peer, op.nbytes)
    assert k == len(_PIECES), f"found {k} of {len(_PIECES)} piece markers"
    return StagePieces(tp, micro_batch, sp, recompute, pieces, cp, cp_algorithm)
