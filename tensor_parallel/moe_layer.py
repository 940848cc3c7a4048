"""The Llama layer with a mixture of experts in place of its MLP, for the
training program (``GPTConfig(experts=E)``): every layer is MoE, as Mixtral's.

Layer (x (b, s, h), or (b, s/t, h) under sequence parallelism):

    x1 = x + Attention(RMSNorm1(x))                       as :class:`~.llama.LlamaLayer`
    y  = x1 + MoE(RMSNorm2(x1))                           :class:`~.moe.MoE`, top-k of E

The experts are SwiGLU MLPs, so only the Llama block takes them (``GPTConfig`` refuses
experts with the GPT block, whose MLP is GELU).

Parameters of the MoE block: ``w_router`` (h, E), ``moe_gate``, ``moe_up`` (E, h, f_e),
``moe_down`` (E, f_e, h); with a shared expert (``GPTConfig(moe_shared_ffn_hidden=F_s)``)
also ``shared_gate``, ``shared_up`` (h, F_s) and ``shared_down`` (F_s, h), replicated
like the router. The experts are split over the mesh axis ``ep`` on their first
dimension (rank with ep coordinate r holds experts r·E/ep … (r+1)·E/ep − 1); the router
is replicated. The ep group is carved out of the data-parallel ranks (Megatron: ep
divides dp·cp): its members hold different micro-batch rows, and the MoE's all_to_all
sends each routed token to its expert's owner.

Tensor parallelism: the experts are *split* over tp (expert tensor parallelism with
etp = tp, as Megatron-Core's default): each tp rank holds a column slice f_e/t of every
expert's W_gate and W_up and the matching row slice of W_down (the shared expert's
likewise), so a rank's expert FLOPs and weights are 1/t of the experts'. The block is a
tensor-parallel region like the dense MLP: it enters with the gathered micro-batch
(``gather_seq``: SP all-gathers the sequence), every tp rank routes the same tokens (the
router is replicated and cheap) and exchanges them over its own ep group (the ranks
sharing its tp coordinate), its experts give partial sums of y, and it leaves with
``reduce_out`` (all_reduce(tp), or reduce_scatter(tp) under SP). The backward mirrors
it: dy gathered, dg = <dy, O> summed over tp (A values), the experts' dx a partial sum
reduced like y, the router's dx whole on every rank (its own sequence slice under SP).
Each tp rank sends every routed token through its ep exchange (Megatron's all-to-all
dispatcher sends a rank's own sequence slice and all-gathers the received rows over tp
instead: t-fold less all-to-all traffic; not modelled yet).

Folded (``ParallelConfig(etp=1)``, tp > 1, sequence parallelism on): the expert group is
ep consecutive ranks made of whole tp groups (mesh axes ("ep", "tp")), each expert whole
on one rank. The block is no tensor-parallel region: each rank routes its own sequence
slice (b, s/t, h) straight to the experts' owners over that group and gets its slice of
y back — no tp collective, a rank's expert FLOPs E/ep experts' share of the group's
tokens. The router (and the shared expert, replicated over tp here) see only the rank's
tokens, so their gradients are partial over tp and summed over it once per step with
the norms' (``seq_partial``).

Biases (GPT-OSS: ``MoE(router_bias=True, expert_bias=True)``): ``b_router`` (E,) after
w_router, replicated and reduced as it (in ``seq_partial`` too when folded);
``moe_b_gate``, ``moe_b_up`` (E, f_e) and ``moe_b_down`` (E, h) after moe_down, split
over ep with their experts (``expert``: reduced with them), b_gate and b_up over etp with
their columns, b_down whole (added by etp rank 0: :mod:`.moe`).

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

import numpy as np

from modeling.choices import DEFAULT_RECOMPUTE_MODULES
from vcluster.runtime.tracing import MetaArray, is_meta
from .gqa import GQAttention, Rope
from .llama import LlamaLayer, check_kv_heads, layer_window, llama_ends
from .mla import MLAttention
from .moe import MoE
from .moe_load import ExpertLoad
from .transformer import TransformerStage

__all__ = ["MoEBlock", "LlamaMoELayer", "llama_moe_stage", "moe_param_names",
           "MOE_PARAMS", "EXPERT_PARAMS", "SHARED_PARAMS", "ROUTER_BIAS",
           "EXPERT_BIAS_PARAMS", "MOE_TP_DIM", "moe_piece", "is_moe_param", "is_expert_param"]

#: the MoE block's parameters, those of them split over ep (dimension 0), and the
#: shared expert's (replicated, present when the layer has one)
MOE_PARAMS = ("w_router", "moe_gate", "moe_up", "moe_down")
EXPERT_PARAMS = ("moe_gate", "moe_up", "moe_down")
SHARED_PARAMS = ("shared_gate", "shared_up", "shared_down")
#: the router's bias (E,), replicated as W_r, and the experts' biases b_gate, b_up
#: (E, f_e), b_down (E, h), split over ep with their experts (GPT-OSS)
ROUTER_BIAS = "b_router"
EXPERT_BIAS_PARAMS = ("moe_b_gate", "moe_b_up", "moe_b_down")


def moe_param_names(moe: MoE) -> tuple[str, ...]:
    """The MoE block's parameter names for ``moe``: w_router, [b_router with
    ``router_bias``], the experts' three, [their biases with ``expert_bias``], +
    SHARED_PARAMS when it has a shared expert."""
    return MOE_PARAMS[:1] + ((ROUTER_BIAS,) if moe.router_bias else ()) + MOE_PARAMS[1:] \
        + (EXPERT_BIAS_PARAMS if moe.expert_bias else ()) \
        + (SHARED_PARAMS if moe.shared_ffn_hidden else ())


def is_moe_param(name: str) -> bool:
    """Whether global parameter ``name`` (``layers.{i}.<last>``) is the MoE block's."""
    return name.rsplit(".", 1)[-1] in MOE_PARAMS + SHARED_PARAMS + (ROUTER_BIAS,) \
        + EXPERT_BIAS_PARAMS


def is_expert_param(name: str) -> bool:
    """Whether MoE parameter ``name`` belongs to the routed experts (split over ep on its
    first dimension: their weights and biases)."""
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMS + EXPERT_BIAS_PARAMS


#: the dimension of each MoE parameter split over tp (the expert hidden dimension; b_down
#: and the router's are whole on every tp rank)
MOE_TP_DIM = {"moe_gate": 2, "moe_up": 2, "moe_down": 1, "shared_gate": 1, "shared_up": 1,
              "shared_down": 0, "moe_b_gate": 1, "moe_b_up": 1}


def moe_piece(name: str, array, ep: int, ep_rank: int, tp: int = 1, tp_rank: int = 0):
    """Rank (``ep_rank``, ``tp_rank``)'s piece of MoE parameter ``name``: its experts'
    rows of an expert weight or bias, cut to its slice of the expert hidden dimension
    (:data:`MOE_TP_DIM`; the shared expert's too), the whole router (and b_router)."""
    last = name.rsplit(".", 1)[-1]
    if is_expert_param(last) and ep > 1:
        e_l = array.shape[0] // ep
        array = array[ep_rank * e_l:(ep_rank + 1) * e_l]
    dim = MOE_TP_DIM.get(last)
    if dim is None or tp == 1:
        return array
    size = array.shape[dim] // tp
    return array[(slice(None),) * dim + (slice(tp_rank * size, (tp_rank + 1) * size),)]


class MoEBlock:
    """The MLP block of an MoE layer on one device (see the module docstring): ``moe``
    on the gathered micro-batch, ``load`` the ExpertLoad a trace takes as given (ignored
    on real arrays), ``aux_weight`` each call's weight in the training loss; it keeps the
    step's report (aux loss, tokens per expert).

    ``bias_rate`` γ > 0: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias b
    (E,), zero at first, is added to the router's scores for the choice of experts only
    (the gates stay the scores); after each step (:meth:`update_bias`) the step's routed
    tokens per expert n_i, summed over every data-parallel rank, move it by
    b_i += γ · sign(mean(n) − n_i): an overloaded expert becomes less likely."""

    def __init__(self, moe: MoE, aux_weight: float, load: ExpertLoad | None, ep_axes=None,
                 folded: bool = False, bias_rate: float = 0.0, recompute_act: bool = False):
        self.moe, self.aux_weight, self.load = moe, float(aux_weight), load
        self.ep_axes = ep_axes          # the expert group's mesh axes (None: moe.ep_axis)
        self.folded = folded            # the group folded over tp: tokens stay local
        self.bias_rate, self.bias = float(bias_rate), None      # b: made at the first call
        self.recomputing = False                # a full recomputation's forward: not counted
        self.recompute_act = bool(recompute_act)   # moe_act: the experts' silu(A)·B re-run
        self.reset_report()

    def _bias(self, ops, like):
        """The choice's bias (None without balancing, or in a trace: it routes a load)."""
        if not self.bias_rate or is_meta(like):
            return None
        if self.bias is None:
            self.bias = ops.dev.xp.zeros(self.moe.experts, dtype=like.dtype)
        return self.bias

    def update_bias(self, ops) -> None:
        """The step's bias update (see the class docstring): one all_reduce of the E routed
        counts over the data-parallel axes (dp, ep, cp; and tp when the group is folded
        over it: its ranks route different tokens), then b += γ·sign(mean − n)."""
        if not self.bias_rate:
            return
        dev = ops.dev
        axes = tuple(a for a in ("dp", "ep", "cp") if a in dev.mesh.axes) + (
            ("tp",) if self.folded and "tp" in dev.mesh.axes else ())
        counts = MetaArray((self.moe.experts,), np.dtype(np.float64)) if self.routed is None \
            else self.routed.astype(np.float64)     # none in a trace: it routes no values
        total = dev.all_reduce(counts, axes) if axes else counts
        if is_meta(total) or self.bias is None:
            return
        self.bias += self.bias_rate * dev.xp.sign(total.mean() - total).astype(self.bias.dtype)

    def reset_report(self) -> None:
        """Start a step's report: aux loss (weighted sum), tokens per expert and distinct
        tokens per expert-group member (ExpertLoad's ``tokens``)."""
        self.aux_loss, self.routed, self.kept, self.tokens = 0.0, None, None, None
        self.node_tokens = None          # per destination node (ep_node_ranks), or None

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
        folded = self.folded
        xf = u if folded else ops.gather_seq(u, "mlp: gather x")    # (b, s, h) or local
        mops = self.moe.device_ops(ops.dev, None if folded else ops.tp_axis, self.ep_axes,
                                   recompute_act=self.recompute_act and keep)
        y, aux, routed, kept, tokens, nodes, saved = self.moe.forward_saved(
            mops, xf.reshape(-1, xf.shape[-1]), P["w_router"], P["moe_gate"], P["moe_up"],
            P["moe_down"], self.load, self._shared(P), self._bias(ops, xf), self._biases(P))
        if not self.recomputing and not is_meta(aux):
            self.aux_loss += self.aux_weight * float(aux[0])
            self.routed = routed.copy() if self.routed is None else self.routed + routed
            self.kept = kept.copy() if self.kept is None else self.kept + kept
            self.tokens = tokens.copy() if self.tokens is None else self.tokens + tokens
            if nodes is not None:
                self.node_tokens = nodes.copy() if self.node_tokens is None \
                    else self.node_tokens + nodes
        y = y.reshape(xf.shape) if folded else \
            ops.reduce_out(y.reshape(xf.shape), "mlp: reduce the experts' y over tp")
        return y, ((mops, saved, xf.shape) if keep else ())

    @staticmethod
    def drop_input(st):
        """The state without the block's input (the MoE's x2: ``layernorm`` re-runs it)."""
        mops, saved, shape = st
        return mops, (None,) + tuple(saved[1:]), shape

    def take_input(self, ops, st, u):
        """The state with the block's input rebuilt from the norm's output ``u``."""
        mops, saved, shape = st
        xf = u if self.folded else ops.gather_seq(u, "mlp: gather x (recompute)")
        return mops, (xf.reshape(-1, shape[-1]),) + tuple(saved[1:]), shape

    def _shared(self, P):
        return tuple(P[n] for n in SHARED_PARAMS) if self.moe.shared_ffn_hidden else None

    def _biases(self, P):
        """(b_router, b_gate, b_up, b_down) of ``P``, None where absent; None without."""
        if not (self.moe.router_bias or self.moe.expert_bias):
            return None
        return tuple(P.get(n) for n in (ROUTER_BIAS,) + EXPERT_BIAS_PARAMS)

    def backward(self, ops, P, st, dy):
        """(du in dy's layout, (dW_router, [dW_gate, dW_up, dW_down (+ db_gate, db_up,
        db_down)], the shared expert's three or None, db_router or None))."""
        mops, saved, shape = st
        folded = self.folded
        dyf = dy if folded else ops.gather_seq(dy, "mlp: gather dy")
        dx, dx_r, d_router, dw, d_shared, db_router = self.moe.backward_saved(
            mops, saved, dyf.reshape(-1, shape[-1]), P["w_router"], P["moe_gate"],
            P["moe_up"], P["moe_down"], self.aux_weight, self._shared(P))
        if folded:
            du = ops.ew("mlp: dx + router's", lambda: dx + dx_r, dx, dx_r)
            return du.reshape(shape), (d_router, dw, d_shared, db_router)
        du = ops.reduce_out(dx.reshape(shape), "mlp: reduce the experts' dx over tp")
        dr = self._local_seq(ops, dx_r.reshape(shape), "mlp: my slice of the router's dx")
        du = ops.ew("mlp: dx + router's", lambda: du + dr, du, dr)
        return du, (d_router, dw, d_shared, db_router)

    @staticmethod
    def add_grads(G, grads) -> None:
        d_router, dw, d_shared, db_router = grads
        G["w_router"] += d_router
        if db_router is not None:
            G[ROUTER_BIAS] += db_router
        for n, g in zip(EXPERT_PARAMS + EXPERT_BIAS_PARAMS, dw):
            G[n] += g
        for n, g in zip(SHARED_PARAMS, d_shared or ()):
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

    @property
    def tokens(self):
        return self.block.tokens

    @property
    def node_tokens(self):
        return self.block.node_tokens

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
    rebuildable = ("core_attn", "layernorm")      # moe_act: the block's (MoEBlock.recompute_act)
    split = MappingProxyType({"w_q": 1, "w_kv": 2, "w_o": 0})
    seq_partial = ("attn_norm_g", "mlp_norm_g")
    expert = EXPERT_PARAMS + EXPERT_BIAS_PARAMS

    def __init__(self, params, attention: GQAttention, kv_heads: int, kv_replicas: int,
                 microbatches: int, moe: MoE, aux_weight: float, load: ExpertLoad | None,
                 recompute: str = "none", eps: float = 1e-5, ep_axes=None,
                 folded: bool = False, bias_rate: float = 0.0,
                 recompute_modules=DEFAULT_RECOMPUTE_MODULES):
        shared = SHARED_PARAMS if moe.shared_ffn_hidden else ()
        self.names = LlamaMoELayer.names[:5] + moe_param_names(moe)
        if folded:                  # the router's (and shared) grads partial over tp
            self.seq_partial = LlamaMoELayer.seq_partial + ("w_router",) + (
                (ROUTER_BIAS,) if moe.router_bias else ()) + shared
        super().__init__(params, attention, kv_heads, kv_replicas, microbatches, recompute, eps,
                         recompute_modules)
        self.block = MoEBlock(moe, aux_weight, load, ep_axes, folded, bias_rate,
                              recompute == "selective" and "moe_act" in self.recompute_modules)

    def _mlp_drop_input(self, mst):
        return self.block.drop_input(mst)

    def _mlp_take_input(self, ops, mst, u2):
        return self.block.take_input(ops, mst, u2)

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
                    tie: bool = False, ep_axes=None, folded: bool = False,
                    head_dim: int | None = None,
                    qk_norm: bool = False, latent=None, cp=None,
                    positions=None, dense_layers=(), bias_rate: float = 0.0,
                    window: int | None = None, window_layers=None, sinks: bool = False,
                    qkv_bias: bool = False, out_bias: bool = False,
                    recompute_modules=DEFAULT_RECOMPUTE_MODULES) -> TransformerStage:
    """A Llama-MoE stage: [embedding if ``first``] + ``layers`` (indices) + [head if
    ``last``]; ``params(names, prefix="")`` gives this device's pieces by name; ``load``:
    an ExpertLoad for every layer, or a dict layer index -> ExpertLoad (traces);
    ``kv_sum_every``, ``tie``: as :func:`~tensor_parallel.llama.llama_stage`'s;
    ``ep_axes``: the expert group's mesh axes (None: the MoE's ``ep_axis``), ``folded``:
    that group folded over tp (etp = 1: tokens stay local; else experts split over tp); ``head_dim``, ``qk_norm``, ``latent`` (multi-head
    latent attention), ``cp``, ``positions`` (context parallelism: each rank's MoE routes
    its own chunks' tokens): as :func:`~tensor_parallel.llama.llama_stage`'s;
    ``dense_layers``: the layer indices whose MLP is the dense SwiGLU (DeepSeek-V3's first
    three), :class:`~.llama.LlamaLayer` among the MoE ones; ``bias_rate``: the
    auxiliary-loss-free balancing's γ (:class:`MoEBlock`; 0: none); ``window``,
    ``window_layers``, ``sinks`` (sliding-window attention, attention sinks), ``qkv_bias``,
    ``out_bias`` (the attention's biases), ``recompute_modules``: as
    :func:`~tensor_parallel.llama.llama_stage`'s."""
    t = ops.tp_size
    check_kv_heads(heads, kv_heads, t)
    d = head_dim or hidden // heads
    rope = Rope(d, rope_theta, positions)
    kv_local, replicas = max(kv_heads // t, 1), max(t // kv_heads, 1)
    names = LlamaMoELayer.layer_names(qk_norm, LlamaMoELayer.names[:5] + moe_param_names(moe),
                                      latent=latent, sinks=sinks, qkv_bias=qkv_bias,
                                      out_bias=out_bias)
    dense_names = LlamaLayer.layer_names(qk_norm, latent=latent, sinks=sinks,
                                         qkv_bias=qkv_bias, out_bias=out_bias)

    def attention(i):
        return GQAttention(heads // t, kv_local, d, rope, cp, qk_norm=eps if qk_norm
                           else None, window=layer_window(i, window, window_layers),
                           sinks=sinks, qkv_bias=qkv_bias, out_bias=out_bias) \
            if latent is None else \
            MLAttention.of_spec(latent, t, rope_theta, positions, cp, eps)

    modules = [LlamaLayer(params(dense_names, f"layers.{i}."), attention(i), kv_heads,
                          replicas, kv_sum_every or microbatches, recompute, eps,
                          recompute_modules)
               if i in dense_layers else
               LlamaMoELayer(params(names, f"layers.{i}."), attention(i), kv_heads, replicas,
                             kv_sum_every or microbatches, moe, aux_weight,
                             load.get(i) if isinstance(load, dict) else load, recompute, eps,
                             ep_axes, folded, bias_rate, recompute_modules)
               for i in layers]
    return TransformerStage.chain(ops, modules, layers,
                                  *llama_ends(params, first, last, eps, tie), microbatches, seq)
