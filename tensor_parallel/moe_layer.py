"""The Llama layer with a mixture of experts in place of its MLP, for the
training program (``GPTConfig(experts=E)``): every layer is MoE, as Mixtral's.

Layer (x (b, s, h), or (b, s/t, h) under sequence parallelism):

    x1 = x + Attention(RMSNorm1(x))                       as :class:`~.llama.LlamaLayer`
    y  = x1 + MoE(RMSNorm2(x1))                           :class:`~.moe.MoE`, top-k of E

The experts are SwiGLU MLPs, so only the Llama block takes them (``GPTConfig`` refuses
experts with the GPT block, whose MLP is GELU).

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
from .transformer import TransformerStage

__all__ = ["MoEBlock", "LlamaMoELayer", "llama_moe_stage",
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
