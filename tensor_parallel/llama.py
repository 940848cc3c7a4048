"""The Llama transformer layer and its ends, with Megatron tensor and sequence
parallelism: forward, input gradient (I) and weight gradient (W) on one device.

Layer (pre-norm; no biases but, optionally, the attention's projections'), x (b, s, h)
— or (b, s/t, h) with sequence parallelism (SP):

    x1 = x + Attention(RMSNorm1(x))       grouped-query, RoPE, causal: :mod:`.gqa`
    y  = x1 + MLP(RMSNorm2(x1)),  MLP(u) = (silu(u W_gate) * (u W_up)) W_down   (f wide)

    RMSNorm(x) = xhat·g,  xhat = x·r,  r = 1/sqrt(mean(x²) + eps)        over h
    RMSNorm'  : dx = r·(d - xhat·mean(d·xhat)),  d = dy·g;   dg = rowsum(dy·xhat)
    silu(z) = z·σ(z),  silu'(z) = σ(z)·(1 + z·(1 - σ(z)))

The head dimension d is the config's (``GPTConfig.head_dim``, default h/a; Qwen3 32 x
128 = 4096 with h 2560): W_q (h, a·d), W_kv (h, 2, c·d), W_o (a·d, h). QK-norm
(``qk_norm``: Qwen3, OLMo 2) adds two gains q_norm_g, k_norm_g (d,), replicated over tp
and shared by every head: an RMSNorm of width d on each query and key head before RoPE
(:mod:`.gqa`). A rank's gain gradients hold only its own heads' part, so after the
step's last micro-batch (when the K/V replicas are summed) the layer all-reduces them
over tp (2d elements); their sequence rows are whole on every rank (the norm runs on
the gathered sequence), so sequence parallelism adds nothing.

Sliding-window attention and attention sinks (``window`` on ``window_layers``,
``sinks``: Mistral, GPT-OSS; :mod:`.gqa`): each layer builds its own attention with its
window (:func:`layer_window`); the sinks' logits ``sinks`` (a,) follow w_o, split over tp
by heads like W_q's columns, so a rank's gradient is whole for its heads (no tp sum).

Attention biases (``qkv_bias``: Qwen2/Qwen2.5; with ``out_bias``: GPT-OSS; :mod:`.gqa`):
b_q (a·d,) after w_q, split over tp as W_q's columns; b_kv (2, c·d) after w_kv, laid out
and split as W_kv's last two dimensions — when c < t a replica's db_kv is summed over
the replicas in the same all_reduce(tp) as dW_kv (each slot holds the head's dW_kv and
db_kv flattened); b_o (h,) after w_o, whole on every tp rank and added after the
row-parallel reduction. Under sequence parallelism db_o holds only this rank's rows:
it is ``seq_partial`` (all-reduced over tp with the norms' gains); without it db_o is
whole on every rank.

Multi-head latent attention (``latent``: DeepSeek-V2/V3's MLA, :mod:`.mla`) replaces
w_q, w_kv, w_o by the latent projections w_q_a, q_a_norm_g, w_q_b (or w_q), w_kv_a,
kv_a_norm_g, w_kv_b and w_o: the up-projections and w_o split over tp by whole heads, the
down-projections and their norms' gains replicated, their gradients (each rank's heads'
part) all-reduced over tp with the same timing as the QK-norm gains'.

Tensor parallelism over t ranks as Megatron's: W_q, W_gate, W_up column-parallel, W_o
and W_down row-parallel, so each block closes with one all_reduce(tp) (SP: an
all_gather(tp) entering and a reduce_scatter(tp) leaving it), and the RMSNorm gains are
replicated (SP: ``seq_partial``, all-reduced over tp once per step, by
:class:`~tensor_parallel.transformer.TransformerStage`). K/V (W_kv (h, 2, c·d), c =
kv_heads): split over tp when c >= t (c % t == 0); when c < t (t % c == 0) each rank
holds the one KV head its query heads use, replicated over the t/c ranks that share it
(as vLLM does; Megatron-Core rejects this case). A replica's dW_kv holds only its own
query heads' part, so once per step, after the step's last micro-batch, the layer sums
the replicas: an all_reduce(tp) of the c per-head gradients stacked (each rank writes
its head's slot, zeros elsewhere; the mesh's groups are whole axes, so a sub-group
all-reduce over the t/c replicas, 1/c of these bytes, is not available). Every replica
then takes the same optimizer step. The replicas also compute their head's K and V
redundantly: over the tp group, (t - c)·(6·b·s·h·2d) FLOPs per layer and micro-batch
beyond :func:`pipeline_parallel.gpt.llama_model_flops`.

Ends: :class:`TokenEmbedding` (E (V, h) vocabulary-parallel as GPT's, no learned
positions) and :class:`RMSNormHead` (final RMSNorm, logits = x W_out, W_out (h, V) split
on V and untied from E, the vocabulary-parallel cross-entropy of
:class:`~tensor_parallel.transformer.VocabParallelHead`).

Recomputation as the GPT layer's: "none", "selective" (the modules of
``recompute_modules``: by default keep q, k, v and re-run the core attention; the norms,
the dense MLP, MLA's up-projections, the experts' activation: :mod:`.transformer`), "full" (keep x; re-run the layer's forward, with its collectives) and
"full-torch" (keep x; re-run the forward as PyTorch's non-reentrant checkpoint does, up to
SwiGLU's output a: W_down's product, its reduction and the residual are not re-run); and
"op", torchtitan's per-op selective policy (``activation_checkpoint.mode: selective``,
``selective_ac_option: op``), which keeps the outputs of the attention kernel and of
every matmul but every second one in forward order, and re-runs everything else its
backward needs:

    kept      x, x W_q, x W_v, P and C (the kernel's), x W_gate; y = C W_o where a
              reduce-scatter produced it (sequence parallelism: torchtitan saves
              reduce-scatters' outputs)
    re-run    both RMSNorms, the sequence-parallel gathers, x W_k, RoPE, C W_o and its
              reduction (no sequence parallelism), the residual, x W_up, SwiGLU

(torchtitan's count, per layer: W_q, W_k, W_v, W_o, W_gate, W_up, W_down — the 2nd, 4th
and 6th re-run; W_down's product feeds only the residual, which no backward needs, so it is
not re-run. Here W_kv is one parameter: its K half is re-run.) The MoE and MLA layers have
no "op" (refused).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from modeling.choices import DEFAULT_RECOMPUTE_MODULES
from modeling.plan import check_kv_heads
from vcluster.runtime.tracing.kernel import Kernel

from .gqa import GQAttention, Rope
from .mla import MLA_SPLIT, MLAttention, mla_names
from .rmsnorm import rms_norm, rms_norm_gain_grad, rms_norm_grad
from .transformer import (RECOMPUTE, TransformerStage, VocabParallelEmbedding,
                          VocabParallelHead, _Layer)

__all__ = ["LlamaLayer", "TokenEmbedding", "RMSNormHead", "llama_stage", "llama_split_dim",
           "llama_piece", "kv_pieces", "is_kv_param", "check_kv_heads", "layer_window"]


def _swiglu(zg, backward: bool) -> Kernel:
    """SwiGLU's elementwise kernel over the gate's (tokens, f) (its forward or gradient)."""
    return Kernel.activation(zg.size // zg.shape[-1], zg.shape[-1], backward, "swiglu")


# --- the layout of the parameters over tp -------------------------------------------------
def kv_pieces(kv_heads: int, tp: int) -> int:
    """The distinct pieces of W_kv over tp ranks: min(kv_heads, tp)."""
    return min(kv_heads, tp)


class LlamaLayer(_Layer):
    """One layer on one device; local parameters: attn_norm_g (h,), w_q (h, a_l·d),
    w_kv (h, 2, c_l·d), [q_norm_g, k_norm_g (d,) with QK-norm], w_o (a_l·d, h),
    mlp_norm_g (h,), w_gate, w_up (h, f/t), w_down (f/t, h). ``kv_replicas`` = t/c when
    c < t (else 1): the ranks sharing this rank's KV head; ``microbatches``: after how
    many weight gradients the partial ones (the K/V replicas', the QK-norm gains') are
    summed over tp — a step's (or 1 where each micro-batch's gradient leaves the rank).
    QK-norm is on when ``attention.qk_norm`` is (its gains then join the names)."""

    names = ("attn_norm_g", "w_q", "w_kv", "w_o", "mlp_norm_g", "w_gate", "w_up", "w_down")
    split = MappingProxyType({"w_q": 1, "w_kv": 2, "w_o": 0, "w_gate": 1, "w_up": 1,
                              "w_down": 0})
    seq_partial = ("attn_norm_g", "mlp_norm_g")
    qk_norm_names = ("q_norm_g", "k_norm_g")     # QK-norm's gains, whole on every tp rank
    sink_name = "sinks"      # attention sinks' logits (a,), split over tp by heads
    qkv_bias_names = ("b_q", "b_kv")    # after w_q, w_kv: split as W_q's and W_kv's columns
    out_bias_name = "b_o"               # after w_o: whole on every tp rank

    @classmethod
    def layer_names(cls, qk_norm: bool, names=None, latent=None, sinks: bool = False,
                    qkv_bias: bool = False, out_bias: bool = False) -> tuple[str, ...]:
        """``names`` (default the class's), with QK-norm's gains after w_kv (and b_kv)
        when ``qk_norm`` (the order of the model's parameters, :func:`~pipeline_parallel.
        llama.llama_param_shapes`); ``latent`` (a :class:`~modeling.spec.LatentAttention`,
        MLA): w_q, w_kv, w_o become the latent attention's (:func:`~.mla.mla_names`);
        ``sinks``: the attention sinks' logits after w_o (and b_o); ``qkv_bias``: b_q
        after w_q, b_kv after w_kv; ``out_bias``: b_o after w_o."""
        names = cls.names if names is None else tuple(names)
        biases = (("w_q", cls.qkv_bias_names[0], qkv_bias),
                  ("w_kv", cls.qkv_bias_names[1], qkv_bias),
                  ("w_o", cls.out_bias_name, out_bias))
        for after, bias, on in biases:
            if on and bias not in names:
                at = names.index(after) + 1
                names = names[:at] + (bias,) + names[at:]
        if sinks and cls.sink_name not in names:
            at = names.index(cls.out_bias_name if out_bias else "w_o") + 1
            names = names[:at] + (cls.sink_name,) + names[at:]
        if latent is not None and "w_kv" in names:
            at, end = names.index("w_q"), names.index("w_o") + 1
            names = names[:at] + mla_names(latent.q_lora_rank is not None) + names[end:]
        if not qk_norm or cls.qk_norm_names[0] in names:
            return names
        at = names.index(cls.qkv_bias_names[1] if qkv_bias else "w_kv") + 1
        return names[:at] + cls.qk_norm_names + names[at:]

    def __init__(self, params, attention: GQAttention, kv_heads: int, kv_replicas: int,
                 microbatches: int, recompute: str = "none", eps: float = 1e-5,
                 recompute_modules=DEFAULT_RECOMPUTE_MODULES):
        if recompute not in RECOMPUTE:
            raise ValueError(f"LlamaLayer: recompute must be one of {RECOMPUTE}, "
                             f"got {recompute!r}")
        if recompute == "op" and (isinstance(attention, MLAttention) or
                                  type(self)._mlp is not LlamaLayer._mlp):
            raise ValueError(f"LlamaLayer: recompute 'op' (torchtitan's per-op policy) is the "
                             f"dense Llama layer's with grouped-query attention; "
                             f"{type(self).__name__} with {type(attention).__name__} has none")
        self.qk_norm = attention.qk_norm is not None
        self.sinks = bool(getattr(attention, "sinks", False))   # attention sinks' logits
        self.qkv_bias = bool(getattr(attention, "qkv_bias", False))
        self.out_bias = bool(getattr(attention, "out_bias", False))
        self.latent = isinstance(attention, MLAttention)      # MLA: its parameters by name
        if self.latent:          # instance names: w_q, w_kv, w_o become the attention's
            at, end = self.names.index("w_q"), self.names.index("w_o") + 1
            self.names = self.names[:at] + attention.names + self.names[end:]
        if self.qk_norm or self.sinks or self.qkv_bias or self.out_bias:
            # instance names: the (subclass's) names, gains, sinks, biases
            self.names = self.layer_names(self.qk_norm, self.names, sinks=self.sinks,
                                          qkv_bias=self.qkv_bias, out_bias=self.out_bias)
        if self.out_bias:        # db_o: this rank's rows under SP, summed over tp as the gains
            self.seq_partial = self.seq_partial + (self.out_bias_name,)
        super().__init__(params)
        self.attn, self.eps = attention, eps
        self._set_recompute(recompute, recompute_modules)
        if self.latent:          # mla_up_proj: the attention re-runs its up-projections
            attention.recompute_up = recompute == "selective" and \
                "mla_up_proj" in self.recompute_modules
        self.kv_heads, self.kv_replicas, self.microbatches = kv_heads, kv_replicas, microbatches
        self._w_count = 0

    # --- MLP: (silu(u W_gate) * (u W_up)) W_down -----------------------------------------
    def _mlp(self, ops, u, keep: bool, stop: bool = False):
        """(y, state); ``stop``: (None, state) without W_down's product and its reduction
        (PyTorch's non-reentrant recomputation stops once ``a`` is rebuilt)."""
        P = self.p
        xf, (zg, zu) = ops.gather_matmul(ops.c.x_in, u, (P["w_gate"], P["w_up"]),  # (b·s, f/t)
                                         "mlp: gather x", ("mlp: x @ W_gate", "mlp: x @ W_up"))
        x2 = xf.reshape(-1, xf.shape[-1])
        a = ops.work("mlp: silu(zg) * zu", 0, (zg, zu, zg), None,
                     lambda: zg / (1 + np.exp(-zg)) * zu, _swiglu(zg, False))
        if stop:
            return None, (x2, zg, zu, a)
        y = ops.matmul_reduce(ops.c.y_out, a, P["w_down"], xf.shape, "mlp: a @ W_down",
                              "mlp: reduce y")
        return y, ((x2, zg, zu, a) if keep else ())

    def _mlp_backward(self, ops, st, dy):
        """du (u's layout) and the weight gradient's state."""
        P, (x2, zg, zu, a) = self.p, st
        dyf, (da,) = ops.gather_matmul(ops.c.x_in, dy, (P["w_down"].T,), "mlp: gather dy",
                                       ("mlp: da = dy W_down^T",))
        dy2 = dyf.reshape(-1, dyf.shape[-1])

        def fn():
            sg = 1 / (1 + np.exp(-zg))
            return da * zu * sg * (1 + zg * (1 - sg)), da * zg * sg

        dzg, dzu = ops.work("mlp: swiglu grad", 0, (da, zg, zu, da, da), None, fn,
                            _swiglu(zg, True))
        dug = ops.matmul(dzg, P["w_gate"].T, "mlp: du = dzg W_gate^T")
        duu = ops.matmul(dzu, P["w_up"].T, "mlp: du += dzu W_up^T")
        du = ops.ew("mlp: add du", lambda: dug + duu, dug, duu).reshape(dyf.shape)
        du, done = ops.reduce_input_grad(du, "mlp: reduce du",
                                         lambda: self._gate_up_grads(ops, self.g, x2, dzg, dzu))
        return du, ((None, None, None) if done else (x2, dzg, dzu)) + (a, dy2)

    # --- the layer ----------------------------------------------------------------------
    def _forward(self, ops, x, keep: str):
        P = self.p
        stop, keep = keep == "stop", "all" if keep == "stop" else keep   # "full-torch"
        u, n1 = rms_norm(ops, x, P["attn_norm_g"], self.eps, "attention: norm")
        att, ast = self.attn.forward(ops, u, P, keep) if self.latent else \
            self.attn.forward(ops, u, P["w_q"], P["w_kv"], P["w_o"], keep, self._qk_gains(P),
                              self._sinks(P), self._biases(P))
        x1 = ops.ew("residual", lambda: x + att, x, att)
        u2, n2 = rms_norm(ops, x1, P["mlp_norm_g"], self.eps, "mlp: norm")
        if stop:                  # the dense MLP's (MoE and MLA layers refuse full-torch)
            return None, (n1, ast, n2, self._mlp(ops, u2, True, stop=True)[1])
        rebuilt = self._rebuilt if keep in ("all", "qkv") else frozenset()
        y, mst = self._mlp(ops, u2, keep != "none" and "mlp" not in rebuilt)
        out = ops.ew("residual", lambda: x1 + y, x1, y)
        if keep == "op":            # x and the gate's product (mst[1]): W_up's is re-run
            return out, (x, ast, mst[1])
        if rebuilt:
            return out, self._discard(rebuilt, x, x1, u2, (n1, ast, n2, mst))
        return out, (n1, ast, n2, mst)

    def _norm(self, ops, i: int, x):
        name = ("attn_norm_g", "attention: norm") if i == 1 else ("mlp_norm_g", "mlp: norm")
        return rms_norm(ops, x, self.p[name[0]], self.eps, f"{name[1]} (recompute)")

    def _mlp_rerun(self, ops, u):
        """The dense MLP's forward re-run from its input u (Megatron's checkpoint of the
        MLP module: gather, W_gate, W_up, SwiGLU, W_down and its reduction): its state."""
        return self._mlp(ops, u, True)[1]

    def _recompute_op(self, ops, st):
        """The backward's state from what torchtitan's per-op policy kept (x, the
        attention's kept products and kernel outputs, W_gate's product): the norms, the
        attention's K product, RoPE and (without sequence parallelism) W_o's product
        (:meth:`~.gqa.GQAttention.recompute_op`), the residual, the MLP's gather, W_up's
        product and SwiGLU re-run. W_down's product feeds only the residual, which no
        backward needs: it is not re-run."""
        P, (x, ast, zg) = self.p, st
        u, n1 = rms_norm(ops, x, P["attn_norm_g"], self.eps, "attention: norm (recompute)")
        att, ast = self.attn.recompute_op(ops, u, ast, P["w_q"], P["w_kv"], P["w_o"],
                                          self._qk_gains(P), self._biases(P))
        x1 = ops.ew("residual (recompute)", lambda: x + att, x, att)
        u2, n2 = rms_norm(ops, x1, P["mlp_norm_g"], self.eps, "mlp: norm (recompute)")
        xf = ops.gather_seq(u2, "mlp: gather x (recompute)")
        x2 = xf.reshape(-1, xf.shape[-1])
        zu = ops.matmul(x2, P["w_up"], "mlp: x @ W_up (recompute)")
        a = ops.work("mlp: silu(zg) * zu (recompute)", 0, (zg, zu, zg), None,
                     lambda: zg / (1 + np.exp(-zg)) * zu, _swiglu(zg, False))
        return n1, ast, n2, (x2, zg, zu, a)

    def backward_input(self, ops, mb: int, dy):
        """dx from dy (both in x's layout); keeps what W needs."""
        P, st = self.p, self._saved(ops, mb)
        n1, ast, n2, mst = st
        du, mw = self._mlp_backward(ops, mst, dy)
        dx1 = rms_norm_grad(ops, du, n2, P["mlp_norm_g"], "mlp: norm grad + residual",
                            residual=dy)
        dv, aw = self.attn.backward_input(ops, ast, dx1, P, self.g) if self.latent else \
            self.attn.backward_input(ops, ast, dx1, P["w_q"], P["w_kv"], P["w_o"],
                                     self.g["w_q"], self.g["w_kv"], self._qk_gains(P),
                                     self._sinks(P), self._biases(self.g))
        dx = rms_norm_grad(ops, dv, n1, P["attn_norm_g"], "attention: norm grad + residual",
                           residual=dx1)
        self._wstate[mb] = (n1[0], dv, aw, n2[0], du, mw)
        return dx

    def _qk_gains(self, P):
        """(q_norm_g, k_norm_g) of ``P`` (parameters or gradients) with QK-norm, else None."""
        return (P["q_norm_g"], P["k_norm_g"]) if self.qk_norm else None

    def _sinks(self, P):
        """The attention sinks' logits of ``P`` (parameters or gradients), else None."""
        return P[self.sink_name] if self.sinks else None

    def _biases(self, P):
        """(b_q, b_kv, b_o) of ``P`` (parameters or gradients; None where absent) with
        attention biases, else None."""
        if not (self.qkv_bias or self.out_bias):
            return None
        return tuple(P.get(n) for n in self.qkv_bias_names + (self.out_bias_name,))

    def backward_weight(self, ops, mb: int) -> None:
        """Accumulate mb's gradients (in place); after the step's last micro-batch, sum
        the K/V replicas' dW_kv (and db_kv) and the QK-norm gains' gradients over tp (see
        the module docstring)."""
        G = self.g
        xhat1, dv, aw, xhat2, du, mw = self._wstate.pop(mb)
        self._mlp_weight_grads(ops, G, mw)
        rms_norm_gain_grad(ops, du, xhat2, G["mlp_norm_g"], "mlp: norm gain grad")
        if self.latent:
            self.attn.backward_weight(ops, aw, G)
        else:
            self.attn.backward_weight(ops, aw, G["w_q"], G["w_kv"], G["w_o"], self._qk_gains(G),
                                      self._sinks(G), self._biases(G))
        rms_norm_gain_grad(ops, dv, xhat1, G["attn_norm_g"], "attention: norm gain grad")
        self._w_count = (self._w_count + 1) % self.microbatches
        if self._w_count == 0 and self.kv_replicas > 1:
            self._sum_kv_replicas(ops)
        if self._w_count == 0 and self.qk_norm and ops.tp_size > 1:
            self._sum_qk_gains(ops)
        if self._w_count == 0 and self.latent and ops.tp_size > 1:
            self._sum_latent_grads(ops)

    def _mlp_weight_grads(self, ops, G, mw) -> None:
        """dW_down, dW_gate, dW_up of the SwiGLU MLP (in place; the last two unless
        ``_mlp_backward`` did, overlapping du's reduction)."""
        x2, dzg, dzu, a, dy2 = mw
        G["w_down"] += ops.matmul(a.T, dy2, "mlp: dW_down = a^T dy")
        if x2 is not None:
            self._gate_up_grads(ops, G, x2, dzg, dzu)

    @staticmethod
    def _gate_up_grads(ops, G, x2, dzg, dzu) -> None:
        G["w_gate"] += ops.matmul(x2.T, dzg, "mlp: dW_gate = x^T dzg")
        G["w_up"] += ops.matmul(x2.T, dzu, "mlp: dW_up = x^T dzu")

    def _sum_kv_replicas(self, ops) -> None:
        """dW_kv (and with ``qkv_bias`` db_kv) = the sum over the ranks holding this KV
        head (all_reduce(tp) of the kv_heads slots, this rank's head in slot tp_rank //
        replicas; with the bias a slot holds dW_kv and db_kv flattened, one collective)."""
        g, slot = self.g["w_kv"], ops.tp_rank // self.kv_replicas
        if self.qkv_bias:
            gb = self.g[self.qkv_bias_names[1]]

            def stack_both():
                out = np.zeros_like(g, shape=(self.kv_heads, g.size + gb.size))
                out[slot] = np.concatenate([g.reshape(-1), gb.reshape(-1)])
                return out

            stacked = ops.work("attention: stack the K/V replicas' dW_kv, db_kv", 0,
                               (g, gb, g, gb), None, stack_both)
            total = ops.all_reduce_tp(stacked)[slot]
            g[...], gb[...] = total[:g.size].reshape(g.shape), total[g.size:].reshape(gb.shape)
            return

        def stack():
            out = np.zeros_like(g, shape=(self.kv_heads,) + tuple(g.shape))
            out[slot] = g
            return out

        stacked = ops.work("attention: stack the K/V replicas' dW_kv", 0, (g, g), None, stack)
        total = ops.all_reduce_tp(stacked)
        g[...] = total[slot]

    def _sum_qk_gains(self, ops) -> None:
        """dq_norm_g, dk_norm_g = their sums over tp (each rank holds its own query heads'
        part, and a K/V replica its query heads' part of its K head): one all_reduce(tp)
        of the two concatenated."""
        gq, gk = self._qk_gains(self.g)
        both = ops.work("attention: concatenate the QK-norm gains' gradients", 0, (gq, gk),
                        None, lambda: np.concatenate([gq, gk]))
        total = ops.all_reduce_tp(both)
        gq[...], gk[...] = total[:gq.size], total[gq.size:]

    def _sum_latent_grads(self, ops) -> None:
        """MLA's replicated parameters' gradients (W_qa, W_kva, the latent norms' gains:
        each rank holds its heads' part) = their sums over tp: one all_reduce(tp) of them
        flattened and concatenated."""
        parts = [self.g[n] for n in self.attn.replicated]
        flat = ops.work("attention: concatenate the latent projections' gradients", 0,
                        tuple(parts), None,
                        lambda: np.concatenate([g.reshape(-1) for g in parts]))
        total, at = ops.all_reduce_tp(flat), 0
        for g in parts:
            g[...] = total[at:at + g.size].reshape(g.shape)
            at += g.size


# --- the ends of the model ----------------------------------------------------------------
class TokenEmbedding(VocabParallelEmbedding):
    """x = E[ids] (no learned positions: RoPE places the tokens); wte (V/t, h) local."""

    names = ("wte",)
    split = MappingProxyType({"wte": 0})
    seq_partial = ()


class RMSNormHead(VocabParallelHead):
    """Final RMSNorm, logits = x W_out (W_out (h, V/t) local; tied: E^T, as
    :class:`~tensor_parallel.transformer.VocabParallelHead`) and the vocabulary-parallel
    cross-entropy."""

    names = ("norm_f_g", "w_out")
    split = MappingProxyType({"w_out": 1})
    seq_partial = ("norm_f_g",)

    def forward(self, ops, mb: int, x):
        """x (b, s, h) (SP: (b, s/t, h)) -> this rank's logits (b·s, V/t)."""
        u, st = rms_norm(ops, x, self.p["norm_f_g"], self.eps, "head: final norm")
        uf = ops.gather_seq(u, "head: gather x")
        u2 = uf.reshape(-1, uf.shape[-1])
        self._state[mb] = (st, u2, uf.shape)
        return self.logits(ops, u2)

    def backward_input(self, ops, mb: int, dlogits):
        st, u2, shape = self._state.pop(mb)
        du = self.logits_input_grad(ops, dlogits)
        du = ops.reduce_out(du.reshape(shape), "head: reduce dx")
        self._wstate[mb] = (u2, dlogits, du, st[0])
        return rms_norm_grad(ops, du, st, self.p["norm_f_g"], "head: final norm grad")

    def backward_weight(self, ops, mb: int) -> None:
        u2, dlogits, du, xhat = self._wstate.pop(mb)
        self.add_logits_weight_grad(ops, u2, dlogits)
        rms_norm_gain_grad(ops, du, xhat, self.g["norm_f_g"], "head: final norm gain grad")


def llama_split_dim(name: str) -> int | None:
    """The dimension of Llama parameter ``name`` ("layers.3.w_kv", "wte", ...) split over tp."""
    last = name.rsplit(".", 1)[-1]
    if last in LlamaLayer.qk_norm_names:
        return None
    if last in (LlamaLayer.sink_name, LlamaLayer.qkv_bias_names[0]):   # W_q's heads
        return 0
    if last == LlamaLayer.qkv_bias_names[1]:         # (2, c·d): as W_kv's last dimension
        return 1
    if last == LlamaLayer.out_bias_name:             # added after the reduction: whole
        return None
    if last in mla_names(True) + mla_names(False):     # MLA's: heads split, latents whole
        return MLA_SPLIT.get(last)
    for module in (LlamaLayer, TokenEmbedding, RMSNormHead):
        if last in module.names:
            return module.split.get(last)
    raise KeyError(f"no Llama parameter is called {name!r}")


def is_kv_param(name: str) -> bool:
    """Whether Llama parameter ``name`` is laid out as the K/V heads (W_kv, b_kv):
    :func:`kv_pieces` pieces over tp, replicated when kv_heads < tp."""
    return name.rsplit(".", 1)[-1] in ("w_kv", LlamaLayer.qkv_bias_names[1])


def llama_piece(name: str, array, tp: int, tp_rank: int, kv_heads: int):
    """Rank ``tp_rank``'s piece of the global parameter ``name``: the whole array, or
    piece tp_rank // (tp / n) of n equal pieces on :func:`llama_split_dim`, n = tp
    (W_kv and b_kv: :func:`kv_pieces`)."""
    dim = llama_split_dim(name)
    if dim is None or tp == 1:
        return array
    n = kv_pieces(kv_heads, tp) if is_kv_param(name) else tp
    size, i = array.shape[dim] // n, tp_rank // (tp // n)
    return array[(slice(None),) * dim + (slice(i * size, (i + 1) * size),)]


def llama_stage(ops, params, layers, first: bool, last: bool, heads: int, kv_heads: int,
                hidden: int, rope_theta: float, recompute: str, eps: float,
                microbatches: int, seq: int, cp=None, positions=None,
                kv_sum_every: int | None = None, tie: bool = False,
                head_dim: int | None = None, qk_norm: bool = False,
                latent=None, window: int | None = None, window_layers=None,
                sinks: bool = False, qkv_bias: bool = False,
                out_bias: bool = False,
                recompute_modules=DEFAULT_RECOMPUTE_MODULES) -> TransformerStage:
    """A Llama stage: [embedding if ``first``] + ``layers`` (indices) + [head if
    ``last``]; ``params(names, prefix="")`` gives this device's pieces by name.
    Context parallelism: ``cp`` a ContextParallelAttention (its ``group`` the query heads
    per K/V head here), ``positions`` the global positions of this rank's rows (RoPE).
    The K/V replicas' dW_kv (and the QK-norm gains' gradients) are summed every
    ``kv_sum_every`` micro-batches (default: once per step; 1 where each micro-batch's
    gradient leaves the rank, as under ZeRO-2/3). ``tie``: the head uses E^T
    (GPTConfig.tie_embeddings). ``head_dim``: d (default hidden // heads); ``qk_norm``:
    RMSNorm (eps ``eps``) on each query and key head before RoPE. ``latent``: a
    :class:`~modeling.spec.LatentAttention` — the layers' attention is then multi-head
    latent attention (:mod:`.mla`; ``cp`` with group 1 and its v_head_dim; the latent
    projections' gradients summed over tp as the K/V replicas'). ``window``: sliding-window
    attention on the layers ``window_layers`` (None: every layer; :func:`layer_window`);
    ``sinks``: attention sinks on every layer (:mod:`.gqa`); ``qkv_bias``, ``out_bias``:
    biases on the attention's q, k, v and output projections (:mod:`.gqa`).
    ``recompute_modules``: "selective"'s modules (:mod:`.transformer`)."""
    t = ops.tp_size
    check_kv_heads(heads, kv_heads, t)
    d = head_dim or hidden // heads
    rope = Rope(d, rope_theta, positions)
    kv_local, replicas = max(kv_heads // t, 1), max(t // kv_heads, 1)
    modules = [LlamaLayer(params(LlamaLayer.layer_names(qk_norm, latent=latent, sinks=sinks,
                                                        qkv_bias=qkv_bias, out_bias=out_bias),
                                 f"layers.{i}."),
                          GQAttention(heads // t, kv_local, d, rope, cp,
                                      qk_norm=eps if qk_norm else None,
                                      window=layer_window(i, window, window_layers),
                                      sinks=sinks, qkv_bias=qkv_bias,
                                      out_bias=out_bias) if latent is None
                          else MLAttention.of_spec(latent, t, rope_theta, positions, cp, eps),
                          kv_heads, replicas, kv_sum_every or microbatches, recompute, eps,
                          recompute_modules)
               for i in layers]
    return TransformerStage.chain(ops, modules, layers,
                                  *llama_ends(params, first, last, eps, tie), microbatches, seq)


def layer_window(i: int, window: int | None, window_layers=None) -> int | None:
    """Layer ``i``'s sliding window: ``window`` on the layers ``window_layers`` (None:
    every layer), None elsewhere (GPTConfig.window, window_layers)."""
    if window is None or (window_layers is not None and i not in window_layers):
        return None
    return window


def llama_ends(params, first: bool, last: bool, eps: float, tie: bool = False) -> tuple:
    """(the token embedding if ``first``, the final-norm head if ``last``), None else;
    ``tie``: the head uses E^T (the embedding's where the stage has it)."""
    embedding = TokenEmbedding(params(TokenEmbedding.names)) if first else None
    return embedding, RMSNormHead.build(params, eps, tie, embedding) if last else None
