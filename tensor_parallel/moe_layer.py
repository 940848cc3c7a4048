"""The Llama (and GPT) layer with a mixture of experts in place of its MLP, for the
training program (``GPTConfig(experts=E)``): every layer is MoE, as Mixtral's.

Layer (x (b, s, h), or (b, s/t, h) under sequence parallelism):

    x1 = x + Attention(RMSNorm1(x))                       as :class:`~.llama.LlamaLayer`
    y  = x1 + MoE(RMSNorm2(x1))                           :class:`~.moe.MoE`, top-k of E

(GPT: LayerNorms and the GPT attention of :class:`~.transformer.TransformerLayer`, the
same MoE block: :class:`GPTMoELayer`.)

Parameters of the MoE block: ``w_router`` (h, E), ``moe_gate``, ``moe_up`` (E, h, f_e),
``moe_down`` (E, f_e, h). The experts are split over the mesh axis ``ep`` on their first
dimension (rank with ep coordinate r holds experts r·E/ep … (r+1)·E/ep − 1); the router
is replicated. The ep group is carved out of the data-parallel ranks (Megatron: ep
divides dp·cp): its members hold different micro-batch rows, and the MoE's all_to_all
sends each routed token to its expert's owner.

Tensor parallelism: the experts are *replicated* over tp. Each tp rank runs the whole MoE
block on the whole micro-batch (under SP it first all-gathers the sequence, and keeps its
own sequence slice of the output; the backward all-gathers dy the same way and keeps its
slice of dx), so every tp rank computes the same routing, the same tokens and the same
gradients — no tp collective closes the block and no tp reduction of its gradients is
needed (each tp rank's ep group, ranks that share its tp coordinate, exchanges its own
copy). It costs t-fold expert FLOPs over the tp group; it is simple and exact.

Gradients: the router's is this rank's tokens' share (summed, with every replicated
parameter, over all of data parallelism by the executor); the experts' are complete for
the ep group's tokens (all_to_all brought them) and are summed over the expert-data-
parallel group, the dp/ep ranks holding the same experts (:class:`TransformerStage`
marks them ``expert`` for the executor). The MoE backward computes its weight gradients
with the input gradient (in the I action; W adds them up).

Aux loss: each call (a micro-batch of an ep group: ep·b·s tokens) computes the Switch
loss of :mod:`.moe`; the training loss adds ``aux_weight`` times it, aux_weight =
1/(dp/ep · m): the mean over the step's calls of a layer, summed over the layers.
"""

from __future__ import annotations

from types import MappingProxyType

from vcluster.runtime.tracing import is_meta
from .gqa import GQAttention, Rope
from .llama import LlamaLayer, check_kv_heads, llama_ends
from .moe import MoE
from .moe_load import ExpertLoad
from .transformer import (TransformerLayer, TransformerStage, VocabParallelEmbedding,
                          VocabParallelHead)

__all__ = ["MoEBlock", "LlamaMoELayer", "GPTMoELayer", "llama_moe_stage", "gpt_moe_stage",
           "MOE_PARAMS", "EXPERT_PARAMS", "moe_piece"]

#: the MoE block's parameters, and those of them split over ep (dimension 0)
MOE_PARAMS = ("w_router", "moe_gate", "moe_up", "moe_down")
EXPERT_PARAMS = ("moe_gate", "moe_up", "moe_down")


def moe_piece(name: str, array, ep: int, ep_rank: int):
    """Rank ``ep_rank``'s piece of MoE parameter ``name``: its experts' rows of an expert
    weight, the whole router."""
    if name.rsplit(".", 1)[-1] not in EXPERT_PARAMS or ep == 1:
        return array
    e_l = array.shape[0] // ep
    return array[ep_rank * e_l:(ep_rank + 1) * e_l]


class MoEBlock:
    """The MLP block of an MoE layer on one device (see the module docstring): ``moe``
    on the gathered micro-batch, ``load`` the ExpertLoad a trace takes as given (ignored
    on real arrays), ``aux_weight`` each call's weight in the training loss; it keeps the
    step's report (aux loss, tokens per expert)."""

    def __init__(self, moe: MoE, aux_weight: float, load: ExpertLoad | None):
        self.moe, self.aux_weight, self.load = moe, float(aux_weight), load
        self.recomputing = False                # a full recomputation's forward: not counted
        self.reset_report()

    def reset_report(self) -> None:
        """Start a step's report: aux loss (weighted sum) and tokens per expert."""
        self.aux_loss, self.routed, self.kept = 0.0, None, None

    @staticmethod
    def _local_seq(ops, y, name):
        """Under SP this rank's sequence slice (dim 1) of the replicated y; else y."""
        if not ops.sequence_parallel:
            return y
        s_l = y.shape[1] // ops.tp_size
        r = ops.tp_rank
        return ops.ew(name, lambda: y[:, r * s_l:(r + 1) * s_l].copy(), y)

    def forward(self, ops, P, u, keep: bool):
        """y (u's layout) of the MoE on u, and the backward's state (() unless ``keep``)."""
        xf = ops.gather_seq(u, "mlp: gather x")                    # (b, s, h)
        mops = self.moe.device_ops(ops.dev)
        y, aux, routed, kept, saved = self.moe.forward_saved(
            mops, xf.reshape(-1, xf.shape[-1]), P["w_router"], P["moe_gate"], P["moe_up"],
            P["moe_down"], self.load)
        if not self.recomputing and not is_meta(aux):
            self.aux_loss += self.aux_weight * float(aux[0])
            self.routed = routed.copy() if self.routed is None else self.routed + routed
            self.kept = kept.copy() if self.kept is None else self.kept + kept
        y = self._local_seq(ops, y.reshape(xf.shape), "mlp: keep my sequence slice")
        return y, ((mops, saved, xf.shape) if keep else ())

    def backward(self, ops, P, st, dy):
        """(du in dy's layout, (dW_router, [dW_gate, dW_up, dW_down]))."""
        mops, saved, shape = st
        dyf = ops.gather_seq(dy, "mlp: gather dy")
        dx, d_router, dw = self.moe.backward_saved(
            mops, saved, dyf.reshape(-1, shape[-1]), P["w_router"], P["moe_gate"],
            P["moe_up"], P["moe_down"], self.aux_weight)
        du = self._local_seq(ops, dx.reshape(shape), "mlp: keep my slice of dx")
        return du, (d_router, dw)

    @staticmethod
    def add_grads(G, grads) -> None:
        d_router, dw = grads
        G["w_router"] += d_router
        for n, g in zip(EXPERT_PARAMS, dw):
            G[n] += g


class _Reporting:
    """The step's report of an MoE layer's block (TransformerStage.moe_report reads it)."""

    @property
    def aux_loss(self) -> float:
        return self.block.aux_loss

    @property
    def routed(self):
        return self.block.routed

    @property
    def kept(self):
        return self.block.kept

    def reset_report(self) -> None:
        self.block.reset_report()

    def backward_input(self, ops, mb: int, dy):
        self.block.recomputing = self.recompute == "full"      # its forward counted once
        try:
            return super().backward_input(ops, mb, dy)
        finally:
            self.block.recomputing = False


class LlamaMoELayer(_Reporting, LlamaLayer):
    """A :class:`~.llama.LlamaLayer` whose MLP is ``moe`` (see the module docstring and
    :class:`MoEBlock`)."""

    names = ("attn_norm_g", "w_q", "w_kv", "w_o", "mlp_norm_g") + MOE_PARAMS
    split = MappingProxyType({"w_q": 1, "w_kv": 2, "w_o": 0})
    seq_partial = ("attn_norm_g", "mlp_norm_g")
    expert = EXPERT_PARAMS

    def __init__(self, params, attention: GQAttention, kv_heads: int, kv_replicas: int,
                 microbatches: int, moe: MoE, aux_weight: float, load: ExpertLoad | None,
                 recompute: str = "none", eps: float = 1e-5):
        super().__init__(params, attention, kv_heads, kv_replicas, microbatches, recompute, eps)
        self.block = MoEBlock(moe, aux_weight, load)

    def _mlp(self, ops, u, keep: bool):
        return self.block.forward(ops, self.p, u, keep)

    def _mlp_backward(self, ops, st, dy):
        return self.block.backward(ops, self.p, st, dy)

    def _mlp_weight_grads(self, ops, G, grads) -> None:
        """The MoE's gradients, computed with dx, added (the rest as LlamaLayer)."""
        self.block.add_grads(G, grads)


class GPTMoELayer(_Reporting, TransformerLayer):
    """A GPT :class:`~.transformer.TransformerLayer` (LayerNorms, biased attention) whose
    MLP is ``moe``: SwiGLU experts, no biases (see :class:`MoEBlock`)."""

    names = ("ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_o", "b_o", "ln2_g", "ln2_b") + MOE_PARAMS
    split = MappingProxyType({"w_qkv": 2, "b_qkv": 1, "w_o": 0})
    seq_partial = ("ln1_g", "ln1_b", "ln2_g", "ln2_b")
    expert = EXPERT_PARAMS

    def __init__(self, params, heads_local: int, head_dim: int, moe: MoE, aux_weight: float,
                 load: ExpertLoad | None, recompute: str = "none", eps: float = 1e-5):
        super().__init__(params, heads_local, head_dim, recompute, eps)
        self.block = MoEBlock(moe, aux_weight, load)

    def _forward(self, ops, x, keep: str):
        P = self.p
        u, ln1 = ops.layer_norm(x, P["ln1_g"], P["ln1_b"], self.eps, "ln1")
        att, ast = self.attn.forward(ops, u, P["w_qkv"], P["b_qkv"], P["w_o"], P["b_o"], keep)
        x1 = ops.ew("residual", lambda: x + att, x, att)
        u, ln2 = ops.layer_norm(x1, P["ln2_g"], P["ln2_b"], self.eps, "ln2")
        y, mst = self.block.forward(ops, P, u, keep != "none")
        out = ops.ew("residual", lambda: x1 + y, x1, y)
        return out, (ln1, ast, ln2, mst)

    def backward_input(self, ops, mb: int, dy):
        """dx from dy (both in x's layout); keeps what W needs."""
        self.block.recomputing = self.recompute == "full"
        try:
            P, st = self.p, self._saved(ops, mb)
        finally:
            self.block.recomputing = False
        ln1, ast, ln2, mst = st
        du, grads = self.block.backward(ops, P, mst, dy)
        dx1 = ops.layer_norm_grad(du, ln2, P["ln2_g"], "ln2 grad + residual", residual=dy)
        dv, aw = self.attn.backward_input(ops, ast, dx1, P["w_qkv"], P["w_o"], self.g["w_qkv"],
                                          self.g["b_qkv"])
        dx = ops.layer_norm_grad(dv, ln1, P["ln1_g"], "ln1 grad + residual", residual=dx1)
        self._wstate[mb] = (ln1[0], dv, aw, ln2[0], du, grads)
        return dx

    def backward_weight(self, ops, mb: int) -> None:
        G = self.g
        xhat1, dv, aw, xhat2, du, grads = self._wstate.pop(mb)
        self.block.add_grads(G, grads)
        ops.layer_norm_params_grad(du, xhat2, G["ln2_g"], G["ln2_b"], "ln2 params grad")
        self.attn.backward_weight(ops, aw, G["w_qkv"], G["b_qkv"], G["w_o"], G["b_o"])
        ops.layer_norm_params_grad(dv, xhat1, G["ln1_g"], G["ln1_b"], "ln1 params grad")


def gpt_moe_stage(ops, params, layers, first: bool, last: bool, heads: int, hidden: int,
                  recompute: str, eps: float, microbatches: int, seq: int, moe: MoE,
                  aux_weight: float, load=None, tie: bool = False) -> TransformerStage:
    """A GPT-MoE stage (as :meth:`TransformerStage.gpt`, with :class:`GPTMoELayer`s)."""
    modules = [GPTMoELayer(params(GPTMoELayer.names, f"layers.{i}."), heads // ops.tp_size,
                           hidden // heads, moe, aux_weight,
                           load.get(i) if isinstance(load, dict) else load, recompute, eps)
               for i in layers]
    embedding = VocabParallelEmbedding(params(VocabParallelEmbedding.names)) if first else None
    head = VocabParallelHead.build(params, eps, tie, embedding) if last else None
    return TransformerStage.chain(ops, modules, layers, embedding, head, microbatches, seq)


def llama_moe_stage(ops, params, layers, first: bool, last: bool, heads: int, kv_heads: int,
                    hidden: int, rope_theta: float, recompute: str, eps: float,
                    microbatches: int, seq: int, moe: MoE, aux_weight: float,
                    load=None, kv_sum_every: int | None = None,
                    tie: bool = False) -> TransformerStage:
    """A Llama-MoE stage: [embedding if ``first``] + ``layers`` (indices) + [head if
    ``last``]; ``params(names, prefix="")`` gives this device's pieces by name; ``load``:
    an ExpertLoad for every layer, or a dict layer index -> ExpertLoad (traces);
    ``kv_sum_every``, ``tie``: as :func:`~tensor_parallel.llama.llama_stage`'s."""
    t = ops.tp_size
    check_kv_heads(heads, kv_heads, t)
    d, rope = hidden // heads, Rope(hidden // heads, rope_theta)
    kv_local, replicas = max(kv_heads // t, 1), max(t // kv_heads, 1)
    modules = [LlamaMoELayer(params(LlamaMoELayer.names, f"layers.{i}."),
                             GQAttention(heads // t, kv_local, d, rope), kv_heads, replicas,
                             kv_sum_every or microbatches, moe, aux_weight,
                             load.get(i) if isinstance(load, dict) else load, recompute, eps)
               for i in layers]
    return TransformerStage.chain(ops, modules, layers,
                                  *llama_ends(params, first, last, eps, tie), microbatches, seq)
