"""The GPT transformer layer and its vocabulary-parallel ends, with Megatron tensor and
sequence parallelism: forward, input gradient (I) and weight gradient (W).

Layer (pre-LayerNorm), x (b, s, h) — or (b, s/t, h) with sequence parallelism (SP):

    x1 = x + Attention(LN1(x))                 (see :mod:`tensor_parallel.attention`)
    y  = x1 + MLP(LN2(x1)),  MLP(u) = gelu(u W1 + b1) W2 + b2     (4h wide)

    LN(x) = xhat·g + b,  xhat = (x - mean) / sqrt(var + eps)   over h
    LN'   : dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat)),  dxhat = dy·g,
            dg = rowsum(dy·xhat),  db = rowsum(dy)

The MLP block is :mod:`tensor_parallel.ffn`'s program (``_hidden`` / ``_forward``: W1
column-parallel, W2 row-parallel, the FeedForward Megatron or SequenceParallel policy
choosing the collectives); its backward here keeps h and a instead of recomputing them.
Per layer, Megatron's TP communicates one all_reduce(tp) after the attention and one
after the MLP in the forward and two (of dx) in the backward; SP replaces each by an
all_gather(tp) entering and a reduce_scatter(tp) leaving the block (the backward gathers
dy and reduce-scatters dx). Under SP the LayerNorm parameters see only this rank's
sequence shard: their gradients (``seq_partial``) are all-reduced over tp once per step.
With ``TransformerOps(..., async_grad_reduce=True)`` (``ParallelConfig.tp_overlap``
"backward", Megatron's default) the backward's two reductions are issued asynchronously
and the weight gradients of the linear that produced them (W1 and b1; W_qkv and b_qkv)
are computed before the wait, in the input gradient I rather than in W: the same sums,
overlapped (:meth:`~tensor_parallel.attention.TransformerOps.reduce_input_grad`).

Recomputation: "none" keeps every activation; "selective" re-runs the modules of
``recompute_modules`` (Megatron-Core's ``--recompute-modules``; default ``core_attn``)
in the backward; "full" keeps only x and re-runs the layer's forward (with its
collectives) at the start of its backward; "op" (torchtitan's per-op policy) is the
Llama layer's alone (:mod:`tensor_parallel.llama`). Under "selective" each module keeps
only its input and re-runs its forward before its gradient, as Megatron-Core's
checkpoints do (the numerics are those of keeping it):

    core_attn     keeps q, k, v; re-runs the core: P = softmax(q k^T/√d + M), C = P v
    layernorm     keeps the norms' inputs x and x1 (output-discarding checkpoint): drops
                  both norms' statistics and outputs (the attention's and the MLP's
                  gathered inputs); re-runs LN1(x), LN2(x1) and, under sequence
                  parallelism, their all_gather(tp) (Megatron's column-parallel linear
                  re-gathers its input in the backward anyway; the program here keeps the
                  gathered input otherwise, so this gather is the recomputation's)
    mlp           keeps the MLP's input u = LN2(x1) (x1 under layernorm); re-runs the
                  whole dense MLP forward, its gather, both products, the activation, the
                  last product and its reduction (Megatron's ``tensor_parallel.checkpoint``
                  re-runs the module): + its forward FLOPs
    mla_up_proj   keeps the latents (MLA, :mod:`.mla`); re-runs the up-projections and RoPE
    moe_act       keeps the routed experts' products A, B; re-runs silu(A)·B (:mod:`.moe`)

Recomputation adds FLOPs only for products: ``mlp`` its forward's (2·b·s·h·f·m/t, m
its matrices), ``mla_up_proj`` the up-projections' (2·b·s·(r_q·a_l·d_qk +
r_kv·a_l·(d_n + d_v))), ``core_attn`` the core's; ``layernorm`` and ``moe_act`` add
elementwise bytes (and SP's gathers) only.

Ends: :class:`VocabParallelEmbedding` (E (V, h) split over tp on the vocabulary: each
rank looks up the tokens in its range, zeros elsewhere, and the partial sums are
all-reduced — reduce-scattered on the sequence under SP; then + positions P (s, h)), and
:class:`VocabParallelHead` (final LN, logits = x W_out with W_out (h, V) split on V,
untied from E, and Megatron's vocabulary-parallel cross-entropy: all_reduce(max) of the
row maxima, one all_reduce(sum) of [sum exp, target logit]; no rank holds all logits).

Context parallelism (``TransformerStage.gpt(..., cp=, positions=)``): a rank's rows are
its load-balanced chunks of the sequence; attention runs
:class:`~tensor_parallel.context_parallel.ContextParallelAttention` over the cp axis,
the positions P are looked up at the rows' global ``positions``, and every other op is
per row. The loss divides by the global token count; the gradients are partial sums over
this rank's rows (the executor all-reduces them over dp × cp).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from modeling.choices import DEFAULT_RECOMPUTE_MODULES, FULL_RECOMPUTE, Recompute
from sharding import TensorSharding as TS
from vcluster.runtime.tracing import Kernel, MetaArray, is_meta
from .attention import Attention, saved_bytes
from .ffn import _forward as _ffn_forward, _hidden as _ffn_hidden

__all__ = ["TransformerLayer", "VocabParallelEmbedding", "VocabParallelHead",
           "TransformerStage", "cross_entropy_bytes", "param_layout", "split_dim", "RECOMPUTE"]

RECOMPUTE = Recompute.values()     # the one list: modeling.choices
#: a recompute policy -> what a layer's ``_forward`` keeps ("full" keeps only x, outside it)
_KEEP = MappingProxyType({"none": "all", "selective": "qkv", "op": "op"})


class _Module:
    """Local parameters (``names`` order), gradients, per-micro-batch state."""

    names: tuple[str, ...] = ()
    split = MappingProxyType({})        # name -> its dimension split over tp (others: whole)
    seq_partial: tuple[str, ...] = ()

    def __init__(self, params):
        self.params = [params[n].copy() for n in self.names]     # copy(): numpy or meta
        self.grads = [np.zeros_like(p) for p in self.params]
        self.p = dict(zip(self.names, self.params))
        self.g = dict(zip(self.names, self.grads))
        self._state: dict = {}                # micro-batch -> forward state (for I)
        self._wstate: dict = {}               # micro-batch -> state of W

    @property
    def activation_bytes(self) -> int:
        return saved_bytes(self._state, self._wstate)


class _Layer(_Module):
    """A layer whose ``_forward(ops, x, keep)`` returns (out, state) and keeps what
    ``recompute`` says ("none": all, "selective": q, k, v, "full" and "full-torch": only x,
    re-running the forward — "full-torch" as PyTorch's non-reentrant checkpoint does, up to
    the MLP's last GEMM, whose output the backward does not need: ``_forward``'s keep
    "stop" — re-running the
    forward with its collectives at the start of the backward)."""

    recompute = "none"
    recompute_modules = frozenset(DEFAULT_RECOMPUTE_MODULES)     # "selective"'s modules
    #: the recompute modules this layer kind has (the others are no-ops on it: Megatron
    #: applies each module where the layer has it)
    rebuildable = ("core_attn", "layernorm", "mlp")

    def _set_recompute(self, recompute: str, recompute_modules) -> None:
        """Store ``recompute`` and its ``recompute_modules`` (only "selective" takes other
        than the default)."""
        mods = frozenset(recompute_modules)
        unknown = sorted(mods - {"core_attn", "layernorm", "mlp", "mla_up_proj", "moe_act"})
        if unknown or (recompute != "selective" and mods != set(DEFAULT_RECOMPUTE_MODULES)):
            raise ValueError(f"{type(self).__name__}: recompute_modules must be among "
                             f"core_attn, layernorm, mlp, mla_up_proj, moe_act, and "
                             f"{DEFAULT_RECOMPUTE_MODULES} unless recompute='selective'; got "
                             f"{tuple(sorted(mods))} with recompute={recompute!r}")
        self.recompute, self.recompute_modules = recompute, mods

    @property
    def _rebuilt(self) -> frozenset:
        """The modules (other than the core attention) that "selective" re-runs here."""
        if self.recompute != "selective":
            return frozenset()
        return self.recompute_modules.intersection(self.rebuildable) - {"core_attn"}

    def _keep(self) -> str:
        """What ``_forward`` keeps: "qkv" when the core attention is recomputed."""
        if self.recompute == "selective":
            return "qkv" if "core_attn" in self.recompute_modules else "all"
        return _KEEP.get(self.recompute, "all")

    def forward(self, ops, mb: int, x):
        if self.recompute in FULL_RECOMPUTE:
            out, _ = self._forward(ops, x, "none")
            self._state[mb] = (x,)
        else:
            out, st = self._forward(ops, x, self._keep())
            self._state[mb] = st
        return out

    def _saved(self, ops, mb: int):
        """Micro-batch ``mb``'s forward state for its backward (re-run under "full", the
        unsaved part re-run under "op")."""
        st = self._state.pop(mb)
        if self.recompute == "full":
            _, st = self._forward(ops, st[0], "all")
        elif self.recompute == "full-torch":     # stops before the MLP's last GEMM
            _, st = self._forward(ops, st[0], "stop")
        elif self.recompute == "op":       # only a layer with _recompute_op accepts "op"
            st = self._recompute_op(ops, st)
        elif self._rebuilt:                # "selective" modules beyond the core attention
            st = self._rebuild(ops, st)
        return st

    # --- "selective" module recomputation (the module docstring) ----------------------
    # A layer's state is (norm1, attention, norm2, mlp); these need ``_norm(ops, i, x)``
    # (norm i's (output, state)) and ``_mlp_rerun(ops, u)`` (the MLP's forward re-run,
    # its state); the MLP's state holds its gathered input first (``_mlp_drop_input``,
    # ``_mlp_take_input`` say otherwise), as every attention's does.
    def _discard(self, rebuilt, x, x1, u2, st):
        """The state ``rebuilt`` keeps: with ``layernorm`` the norms' inputs x, x1 instead
        of their statistics and the attention's and MLP's inputs, with ``mlp`` the MLP's
        input u2 (or x1) instead of its state (the forward kept none)."""
        n1, ast, n2, mst = st
        ln, mlp = "layernorm" in rebuilt, "mlp" in rebuilt
        if ln:
            n1 = n2 = None
            ast = (None,) + tuple(ast[1:])
            if not mlp:
                mst = self._mlp_drop_input(mst)
        return n1, ast, n2, None if mlp else mst, (x if ln else None, x1 if ln else None,
                                                   u2 if mlp and not ln else None)

    def _rebuild(self, ops, st):
        """The backward's state from :meth:`_discard`'s: the norms (and, under sequence
        parallelism, their outputs' gathers) and the MLP's forward re-run."""
        n1, ast, n2, mst, (x, x1, u2) = st
        if x is not None:
            u, n1 = self._norm(ops, 1, x)
            xf = ops.gather_seq(u, "attention: gather x (recompute)")
            ast = (xf.reshape(-1, xf.shape[-1]),) + tuple(ast[1:])
            u2, n2 = self._norm(ops, 2, x1)
            if mst is not None:
                mst = self._mlp_take_input(ops, mst, u2)
        if mst is None:
            mst = self._mlp_rerun(ops, u2)
        return n1, ast, n2, mst

    @staticmethod
    def _mlp_drop_input(mst):
        return (None,) + tuple(mst[1:])

    @staticmethod
    def _mlp_take_input(ops, mst, u2):
        xf = ops.gather_seq(u2, "mlp: gather x (recompute)")
        return (xf.reshape(-1, xf.shape[-1]),) + tuple(mst[1:])



class TransformerLayer(_Layer):
    """One layer on one device (see the module docstring); parameters are the local
    pieces of ln1_g, ln1_b (h,); w_qkv (h, 3, h), b_qkv (3, h) split on the last dim;
    w_o (h, h) split on rows; b_o (h,); ln2_g, ln2_b; w_1 (h, 4h) and b_1 (4h,) split on
    4h; w_2 (4h, h) split on rows; b_2 (h,)."""

    names = ("ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_o", "b_o", "ln2_g", "ln2_b",
             "w_1", "b_1", "w_2", "b_2")
    split = MappingProxyType({"w_qkv": 2, "b_qkv": 1, "w_o": 0, "w_1": 1, "b_1": 0, "w_2": 0})
    seq_partial = ("ln1_g", "ln1_b", "ln2_g", "ln2_b")

    def __init__(self, params, heads_local: int, head_dim: int, recompute: str = "none",
                 eps: float = 1e-5, cp=None, recompute_modules=DEFAULT_RECOMPUTE_MODULES):
        if recompute not in RECOMPUTE or recompute == "op":
            raise ValueError(f"TransformerLayer: recompute must be one of "
                             f"{tuple(r for r in RECOMPUTE if r != 'op')}, got {recompute!r} "
                             f"('op' is torchtitan's policy of the Llama layer)")
        super().__init__(params)
        self.attn = Attention(heads_local, head_dim, cp)
        self._set_recompute(recompute, recompute_modules)
        self.eps = eps

    def _forward(self, ops, x, keep: str):
        P = self.p
        u, ln1 = ops.layer_norm(x, P["ln1_g"], P["ln1_b"], self.eps, "ln1")
        att, ast = self.attn.forward(ops, u, P["w_qkv"], P["b_qkv"], P["w_o"], P["b_o"],
                                     "all" if keep == "stop" else keep)
        x1 = ops.ew("residual", lambda: x + att, x, att)
        u, ln2 = ops.layer_norm(x1, P["ln2_g"], P["ln2_b"], self.eps, "ln2")
        rebuilt = self._rebuilt if keep in ("all", "qkv") else frozenset()
        if keep == "none" or "mlp" in rebuilt:
            y, mst = _ffn_forward(ops, ops.c, u, P["w_1"], P["b_1"], P["w_2"], P["b_2"]), ()
        else:
            xc, x2, _, _, h, a = _ffn_hidden(ops, ops.c, u, P["w_1"], P["b_1"], P["w_2"],
                                             tag="mlp: ")
            if keep == "stop":         # the backward needs a, not a W2 nor what follows it
                return None, (ln1, ast, ln2, (x2, h, a))
            y = ops.matmul_reduce(ops.c.y_out, a, P["w_2"], xc.shape, "mlp: a @ W2",
                                  "mlp: reduce y")
            y = ops.add_bias(y, P["b_2"], "mlp: + b2")
            mst = (x2, h, a)
        out = ops.ew("residual", lambda: x1 + y, x1, y)
        if rebuilt:
            return out, self._discard(rebuilt, x, x1, u, (ln1, ast, ln2, mst))
        return out, (ln1, ast, ln2, mst)

    def _norm(self, ops, i: int, x):
        P = self.p
        return ops.layer_norm(x, P[f"ln{i}_g"], P[f"ln{i}_b"], self.eps, f"ln{i} (recompute)")

    def _mlp_rerun(self, ops, u):
        """The MLP's forward re-run from its input u (Megatron's checkpoint of the MLP
        module: W1, gelu, W2, its reduction and b2): its state (x2, h, a)."""
        P = self.p
        xc, x2, _, _, h, a = _ffn_hidden(ops, ops.c, u, P["w_1"], P["b_1"], P["w_2"],
                                         tag="mlp (recompute): ")
        y = ops.matmul_reduce(ops.c.y_out, a, P["w_2"], xc.shape, "mlp: a @ W2 (recompute)",
                              "mlp: reduce y (recompute)")
        ops.add_bias(y, P["b_2"], "mlp: + b2 (recompute)")
        return x2, h, a

    def backward_input(self, ops, mb: int, dy):
        """dx from dy (both in x's layout); keeps what W needs."""
        P, st = self.p, self._saved(ops, mb)
        ln1, ast, ln2, (x2, h, a) = st
        dyf, (da,) = ops.gather_matmul(ops.c.x_in, dy, (P["w_2"].T,), "mlp: gather dy",
                                       ("mlp: da = dy W2^T",))
        dy2 = dyf.reshape(-1, dyf.shape[-1])
        dh = ops.activation_grad(da, h, "mlp: dh = da act'(h)")
        du = ops.matmul(dh, P["w_1"].T, "mlp: du = dh W1^T").reshape(dyf.shape)
        G = self.g
        du, done = ops.reduce_input_grad(du, "mlp: reduce du",
                                         lambda: self._w1_grads(ops, G, x2, dh))
        dx1 = ops.layer_norm_grad(du, ln2, P["ln2_g"], "ln2 grad + residual", residual=dy)
        dv, aw = self.attn.backward_input(ops, ast, dx1, P["w_qkv"], P["w_o"], G["w_qkv"],
                                          G["b_qkv"])
        dx = ops.layer_norm_grad(dv, ln1, P["ln1_g"], "ln1 grad + residual", residual=dx1)
        self._wstate[mb] = (ln1[0], dv, aw, ln2[0], du) + ((None, None) if done else (x2, dh)) \
            + (a, dy2)
        return dx

    @staticmethod
    def _w1_grads(ops, G, x2, dh) -> None:
        G["w_1"] += ops.matmul(x2.T, dh, "mlp: dW1 = u^T dh")
        G["b_1"] += ops.sum_rows(dh, "mlp: db1")

    def backward_weight(self, ops, mb: int) -> None:
        """Accumulate every parameter's gradient of micro-batch ``mb`` (in place; W1's,
        b1's, W_qkv's and b_qkv's unless ``backward_input`` did, overlapping the
        reductions of their input gradients: ``TransformerOps.reduce_input_grad``)."""
        G = self.g
        xhat1, dv, aw, xhat2, du, x2, dh, a, dy2 = self._wstate.pop(mb)
        G["w_2"] += ops.matmul(a.T, dy2, "mlp: dW2 = a^T dy")
        G["b_2"] += ops.sum_rows(dy2, "mlp: db2")
        if x2 is not None:
            self._w1_grads(ops, G, x2, dh)
        ops.layer_norm_params_grad(du, xhat2, G["ln2_g"], G["ln2_b"], "ln2 params grad")
        self.attn.backward_weight(ops, aw, G["w_qkv"], G["b_qkv"], G["w_o"], G["b_o"])
        ops.layer_norm_params_grad(dv, xhat1, G["ln1_g"], G["ln1_b"], "ln1 params grad")


# --- the ends of the model ---------------------------------------------------------------
def _lookup(table, ids):
    """table[ids]; on shape-only arrays (a trace) only its shape."""
    if is_meta(table) or is_meta(ids):
        return MetaArray(tuple(ids.shape) + tuple(table.shape[1:]), table.dtype)
    return table[ids]


def _scatter_add(table, ids, rows) -> None:
    """table[ids] += rows, repeated ids adding up (nothing to do in a trace)."""
    if not (is_meta(table) or is_meta(ids) or is_meta(rows)):
        np.add.at(table, ids.reshape(-1), rows.reshape(-1, rows.shape[-1]))


class VocabParallelEmbedding(_Module):
    """x = E[ids] + P[positions] on the first stage; wte (V/t, h) and wpe (s, h) local."""

    names = ("wte", "wpe")
    split = MappingProxyType({"wte": 0})
    seq_partial = ("wpe",)
    positions = None        # the rows' global positions (context parallelism); None: 0..s-1

    def forward(self, ops, mb: int, ids):
        """ids (b, s) ints -> x (b, s, h), or (b, s/t, h) under SP (a subclass without
        ``wpe`` adds no positions)."""
        wte, wpe = self.p["wte"], self.p.get("wpe")
        v_l = wte.shape[0]

        def lookup():
            local = ids - ops.tp_rank * v_l
            inside = (local >= 0) * (local < v_l)             # this rank's vocabulary
            local = local * inside
            return _lookup(wte, local) * inside[..., None], local, inside

        e, local, inside = ops.work("embedding lookup", 0, (ids, ids), None, lookup)
        e = ops.reduce_out(e, "embedding: reduce")            # partial sums over tp
        self._state[mb] = (local, inside)
        if wpe is None:
            return e
        s_l = e.shape[1]
        first = ops.tp_rank * s_l if ops.sequence_parallel else 0
        if self.positions is not None:
            rows = np.asarray(self.positions[first:first + s_l])
            return ops.ew("embedding: + positions", lambda: e + _lookup(wpe, rows), e)
        pos = wpe[first:first + s_l]
        return ops.ew("embedding: + positions", lambda: e + pos, e)

    def backward_input(self, ops, mb: int, dx):
        local, inside = self._state.pop(mb)
        de = ops.gather_seq(dx, "embedding: gather dx")
        self._wstate[mb] = (local, inside, de, dx)
        return None

    def backward_weight(self, ops, mb: int) -> None:
        local, inside, de, dx = self._wstate.pop(mb)
        gwpe, s_l = self.g.get("wpe"), dx.shape[1]
        first = ops.tp_rank * s_l if ops.sequence_parallel else 0

        def fn():
            _scatter_add(self.g["wte"], local, de * inside[..., None])
            if gwpe is not None and self.positions is not None:
                _scatter_add(gwpe, np.asarray(self.positions[first:first + s_l]),
                             dx.sum(axis=0))
            elif gwpe is not None:
                gwpe[first:first + s_l] += dx.sum(axis=0)

        ops.work("embedding grads (scatter-add)", 0, (de, de), None, fn)


def cross_entropy_bytes(logits: int, itemsize: int) -> int:
    """HBM bytes the cross-entropy's forward and backward move over ``logits`` entries of
    ``itemsize`` bytes, as the frameworks run it: in fp32 or wider (PyTorch's autocast
    runs ``cross_entropy``/``log_softmax`` in fp32, and Megatron-LM calls its
    vocabulary-parallel cross-entropy on ``output.float()``). With w = max(itemsize, 4)
    bytes per entry of that compute dtype, per logit:

        upcast (16-bit logits only)      read itemsize, write w
        log-softmax forward              read w, write w
        nll backward (dense gradient)    write w
        log-softmax backward             read w (gradient) + w (output), write w
        downcast of dlogits (16-bit)     read w, write itemsize

    6·w, plus 2·(itemsize + w) for 16-bit logits: 36 bytes per bf16 logit, 24 per fp32
    one. The kernels are those a PyTorch profile of an eager bf16 step shows for the loss
    (``direct_copy`` to fp32, ``log_softmax`` forward and backward, ``bfloat16_copy``:
    benchmarks/results/h200-2026-11-27). The row reductions inside the log-softmax read
    rows that stay in cache and the target gather is b·s entries: neither is counted."""
    w = max(int(itemsize), 4)
    casts = 2 * (int(itemsize) + w) if itemsize < 4 else 0
    return int(logits) * (6 * w + casts)


class VocabParallelHead(_Module):
    """Final LN, logits = x W_out (W_out (h, V/t) local) and the cross-entropy loss.

    Tied (``tie=True``, GPTConfig.tie_embeddings): W_out = E^T, E (V/t, h) the word
    embedding's piece, and dE += dlogits^T x. With ``embedding`` (the stage's own
    :class:`VocabParallelEmbedding`) the head uses that module's E and adds into its
    gradient: one parameter, listed once (the embedding's). Without, the head holds its
    own copy of E, named "wte" (the last stage of a pipeline), whose gradient the executor
    sums with the first stage's (``TrainJob.tied``)."""

    names = ("lnf_g", "lnf_b", "w_out")
    split = MappingProxyType({"w_out": 1})
    seq_partial = ("lnf_g", "lnf_b")

    def __init__(self, params, eps: float = 1e-5, tie: bool = False, embedding=None):
        if tie:   # instance names: the class's, w_out replaced by a copy of E or by nothing
            self.names = self.tied_names(embedding is None)
        super().__init__(params)
        self.eps, self.tie = eps, bool(tie)
        self.borrowed = embedding if tie else None   # the module whose E this head uses

    @classmethod
    def build(cls, params, eps: float, tie: bool = False, embedding=None):
        """The head of a last stage: ``params(names)`` its pieces; tied, it uses
        ``embedding``'s E when the stage has one, else a copy of E of its own."""
        if not tie:
            return cls(params(cls.names), eps)
        return cls(params(cls.tied_names(embedding is None)), eps, tie=True,
                   embedding=embedding)

    @classmethod
    def tied_names(cls, own_copy: bool) -> tuple[str, ...]:
        """A tied head's parameters: the class's without w_out, plus "wte" (its own copy
        of E) where ``own_copy``."""
        return tuple(n for n in cls.names if n != "w_out") + (("wte",) if own_copy else ())

    def _e_module(self):
        return self.borrowed if self.borrowed is not None else self

    def logits(self, ops, u2):
        """x W_out: (b·s, h) -> (b·s, V/t)."""
        if not self.tie:
            return ops.matmul(u2, self.p["w_out"], "head: logits = x W_out")
        return ops.matmul(u2, self._e_module().p["wte"].T, "head: logits = x E^T (tied)")

    def logits_input_grad(self, ops, dlogits):
        """dlogits W_out^T: (b·s, V/t) -> (b·s, h)."""
        if not self.tie:
            return ops.matmul(dlogits, self.p["w_out"].T, "head: dx = dlogits W_out^T")
        return ops.matmul(dlogits, self._e_module().p["wte"], "head: dx = dlogits E (tied)")

    def add_logits_weight_grad(self, ops, u2, dlogits) -> None:
        """dW_out += x^T dlogits (tied: dE += dlogits^T x)."""
        if not self.tie:
            self.g["w_out"] += ops.matmul(u2.T, dlogits, "head: dW_out = x^T dlogits")
        else:
            self._e_module().g["wte"] += ops.matmul(dlogits.T, u2,
                                                    "head: dE += dlogits^T x (tied)")

    def forward(self, ops, mb: int, x):
        """x (b, s, h) (SP: (b, s/t, h)) -> this rank's logits (b·s, V/t)."""
        u, ln = ops.layer_norm(x, self.p["lnf_g"], self.p["lnf_b"], self.eps, "final ln")
        uf = ops.gather_seq(u, "head: gather x")
        u2 = uf.reshape(-1, uf.shape[-1])
        self._state[mb] = (ln, u2, uf.shape)
        return self.logits(ops, u2)

    def loss_and_grad(self, ops, logits, targets, tokens: int):
        """(sum over the rows of -log softmax(logits)[target] / tokens, dL/dlogits) with
        the vocabulary split over tp; ``tokens`` = the global batch's token count."""
        v_l = logits.shape[1]
        ce = Kernel.cross_entropy(logits.shape[0], v_l, parts=3)   # three passes over logits
        part = cross_entropy_bytes(logits.size, np.dtype(logits.dtype).itemsize) // 3
        mx = ops.all_reduce_tp(ops.work("ce: row max", 0, (logits, logits), None,
                                        lambda: logits.max(axis=1, keepdims=True), ce,
                                        nbytes=part), op="max")

        def stats():
            e = np.exp(logits - mx)
            hit = np.equal(targets.reshape(-1, 1), ops.xp.arange(v_l) + ops.tp_rank * v_l)
            return np.concatenate([e.sum(axis=1, keepdims=True),
                                   (logits * hit).sum(axis=1, keepdims=True)], axis=1), e, hit

        st, e, hit = ops.work("ce: sum exp, target logit", 0, (logits, logits), None, stats, ce,
                              nbytes=part)
        st = ops.all_reduce_tp(st)                           # (b·s, 2)

        def fn():
            loss = float((np.log(st[:, 0]) + mx[:, 0] - st[:, 1]).sum()) / tokens
            return loss, (e / st[:, :1] - hit) / tokens

        return ops.work("ce: loss, dlogits", 0, (logits, logits), None, fn, ce, nbytes=part)

    def backward_input(self, ops, mb: int, dlogits):
        ln, u2, shape = self._state.pop(mb)
        du = self.logits_input_grad(ops, dlogits)
        du = ops.reduce_out(du.reshape(shape), "head: reduce dx")
        self._wstate[mb] = (u2, dlogits, du, ln[0])
        return ops.layer_norm_grad(du, ln, self.p["lnf_g"], "final ln grad")

    def backward_weight(self, ops, mb: int) -> None:
        u2, dlogits, du, xhat = self._wstate.pop(mb)
        self.add_logits_weight_grad(ops, u2, dlogits)
        ops.layer_norm_params_grad(du, xhat, self.g["lnf_g"], self.g["lnf_b"], "final ln grads")


class TransformerStage:
    """A pipeline stage on one device: modules in a chain ([embedding] + layers +
    [head]) with the executor's stage interface (that of
    :class:`pipeline_parallel.layers.StageLayers`); ``ops`` is its TransformerOps, and
    ``prefixes`` name the modules' parameters (``named_params``)."""

    def __init__(self, ops, modules, prefixes, microbatches: int, seq: int):
        self.ops, self.modules, self.prefixes = ops, modules, prefixes
        self.params = [m.params for m in modules]
        self.grads = [m.grads for m in modules]
        self.microbatches, self.seq = microbatches, seq
        self._live: set = set()
        self._w_done = 0
        self.param_hook = None     # ZeRO-3 (pipeline_parallel.zero): use(i, next) / done(i)
        # True where each micro-batch's gradients leave the rank (ZeRO-2/3 reduce-scatter
        # them per micro-batch): the sequence-parallel partial gradients are then summed
        # over tp every micro-batch, before they leave, not once per step
        self.seq_partial_each_microbatch = False
        # module i -> the module whose parameters it also uses (a tied head: the embedding)
        self.borrows = {i: modules.index(m.borrowed) for i, m in enumerate(modules)
                        if getattr(m, "borrowed", None) is not None}

    @classmethod
    def gpt(cls, ops, params, layers, first: bool, last: bool, heads: int, hidden: int,
            recompute: str, eps: float, microbatches: int, seq: int, cp=None,
            positions=None, tie: bool = False,
            recompute_modules=DEFAULT_RECOMPUTE_MODULES) -> "TransformerStage":
        """A GPT stage: [embedding if ``first``] + ``layers`` (indices) + [head if
        ``last``]; ``params(names, prefix="")`` gives this device's pieces by name.
        Context parallelism: ``cp`` a ContextParallelAttention, ``positions`` the global
        positions of this rank's rows. ``tie``: the head uses E^T (see
        :class:`VocabParallelHead`). ``recompute_modules``: "selective"'s modules."""
        modules = [TransformerLayer(params(TransformerLayer.names, f"layers.{i}."),
                                    heads // ops.tp_size, hidden // heads, recompute, eps, cp,
                                    recompute_modules)
                   for i in layers]
        embedding = VocabParallelEmbedding(params(VocabParallelEmbedding.names)) \
            if first else None
        if embedding is not None:
            embedding.positions = positions
        head = VocabParallelHead.build(params, eps, tie, embedding) if last else None
        return cls.chain(ops, modules, layers, embedding, head, microbatches, seq)

    @classmethod
    def chain(cls, ops, modules, layers, embedding, head, microbatches: int,
              seq: int) -> "TransformerStage":
        """[``embedding``] + ``modules`` (those of the layers of indices ``layers``, their
        parameters named "layers.{i}.") + [``head``]; None leaves an end out."""
        pairs = ([(embedding, "")] if embedding is not None else []) + \
            [(m, f"layers.{i}.") for i, m in zip(layers, modules)] + \
            ([(head, "")] if head is not None else [])
        return cls(ops, [m for m, _ in pairs], [p for _, p in pairs], microbatches, seq)

    @property
    def activation_bytes(self) -> int:
        return sum(m.activation_bytes for m in self.modules)

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def zero_grads(self) -> None:
        for g in (g for gs in self.grads for g in gs):
            g[...] = 0
        self._w_done = 0

    def forward(self, dev, mb: int, x):
        self._live.add(mb)
        hook, n = self.param_hook, len(self.modules)
        for i, m in enumerate(self.modules):
            if hook is not None:
                hook.use(i, i + 1 if i + 1 < n else None)
            x = m.forward(self.ops, mb, x)
            if hook is not None:
                hook.done(i)
        return x

    def loss_and_grad(self, dev, mb: int, logits, targets, global_batch: int):
        return self.modules[-1].loss_and_grad(self.ops, logits, targets, global_batch * self.seq)

    def backward_input(self, dev, mb: int, dy, need_input_grad: bool = True):
        hook = self.param_hook
        for i in reversed(range(len(self.modules))):
            if hook is not None:
                hook.use(i, i - 1 if i > 0 else None)
            dy = self.modules[i].backward_input(self.ops, mb, dy)
            if hook is not None:
                hook.done(i)
        return dy

    def backward_weight(self, dev, mb: int, on_layer_done=None) -> None:
        """Accumulate mb's gradients; after the step's last micro-batch (every micro-batch
        with ``seq_partial_each_microbatch``), all-reduce the sequence-parallel partial
        gradients (LayerNorms, positions) over tp."""
        self._w_done += 1
        last = self._w_done == self.microbatches or self.seq_partial_each_microbatch
        for i in reversed(range(len(self.modules))):
            m = self.modules[i]
            m.backward_weight(self.ops, mb)
            if last and self.ops.sequence_parallel and m.seq_partial:
                parts = [m.g[n] for n in m.seq_partial]
                flat = self.ops.all_reduce_tp(np.concatenate([g.reshape(-1) for g in parts]))
                offset = 0
                for g in parts:
                    g[...] = flat[offset:offset + g.size].reshape(g.shape)
                    offset += g.size
            if on_layer_done is not None:
                on_layer_done(i)
        self._live.discard(mb)

    def expert_mask(self, i: int) -> tuple[bool, ...]:
        """Per gradient of module ``i``: whether it is an expert's (``expert`` names of a
        mixture-of-experts layer), which the executor sums over the expert-data-parallel
        group instead of all of data parallelism."""
        m = self.modules[i]
        return tuple(n in getattr(m, "expert", ()) for n in m.names)

    def end_step(self) -> None:
        """After a step's optimizer step: each MoE layer's auxiliary-loss-free bias update
        (:meth:`~.moe_layer.MoEBlock.update_bias`; nothing without it)."""
        for m in self.modules:
            block = getattr(m, "block", None)
            if block is not None and getattr(block, "bias_rate", 0):
                block.update_bias(self.ops)

    def moe_report(self) -> tuple[float, dict]:
        """(the step's weighted aux loss, {layer prefix: (routed, kept) tokens per
        expert, distinct tokens per expert-group member[, distinct tokens per node when
        the group spans nodes]) summed over the step's micro-batches}) of this stage's
        MoE layers; each reset."""
        aux, load = 0.0, {}
        for p, m in zip(self.prefixes, self.modules):
            if hasattr(m, "reset_report"):
                aux += m.aux_loss
                if m.routed is not None:
                    load[p] = (np.asarray(m.routed).tolist(), np.asarray(m.kept).tolist(),
                               np.asarray(m.tokens).tolist()) + (
                        () if getattr(m, "node_tokens", None) is None
                        else (np.asarray(m.node_tokens).tolist(),))
                m.reset_report()
        return aux, load

    def named_params(self) -> dict:
        return {f"{p}{n}": a for p, m in zip(self.prefixes, self.modules)
                for n, a in m.p.items()}

    def named_grads(self) -> dict:
        return {f"{p}{n}": a for p, m in zip(self.prefixes, self.modules)
                for n, a in m.g.items()}


def split_dim(name: str) -> int | None:
    """The dimension of parameter ``name`` ("layers.3.w_qkv", "wte", ...) split over tp."""
    last = name.rsplit(".", 1)[-1]
    for module in (TransformerLayer, VocabParallelEmbedding, VocabParallelHead):
        if last in module.names:
            return module.split.get(last)
    raise KeyError(f"no transformer parameter is called {name!r}")


def param_layout(name: str, ndim: int, tp: str | None = "tp") -> TS:
    """Layout of parameter ``name``: split over mesh axis ``tp`` on :func:`split_dim`."""
    dim = split_dim(name) if tp else None
    return TS(*(tp if i == dim else None for i in range(ndim)))
