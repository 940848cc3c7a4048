"""A reference PyTorch Llama, written as torchtitan writes its Llama 3 (``vcluster bench
gpu-step --arch llama``): what the simulator's one-GPU prediction of a Llama step is
checked against, with torchtitan's activation-checkpointing policies.

The model is :mod:`pipeline_parallel.llama`'s, parameter for parameter: a token
embedding, ``layers`` pre-norm blocks and a final RMSNorm with an untied output
projection. A block, x (b, s, h):

    x1 = x + W_o · SDPA(RoPE(W_q·n), RoPE(W_k·n), W_v·n),  n = RMSNorm(x)
    y  = x1 + W_down · (silu(W_gate·m) * W_up·m),           m = RMSNorm(x1)

RMSNorm(x) = x / sqrt(mean(x²) + eps) · g; RoPE rotates each (even, odd) pair of a head's
dimensions by position · theta^(-2i/d); grouped-query attention repeats each of the
``kv_heads`` K/V heads over its heads / kv_heads query heads before the causal SDPA (as
torchtitan's ``repeat_kv`` does; the repeat is a copy). W_k and W_v are two parameters
here as in torchtitan; the emulator's ``w_kv`` (h, 2, c·d) holds the same numbers.

Activation checkpointing, per block, as torchtitan's ``activation_checkpoint.mode``
(torchtitan/models/llama3/infra/parallelize.py, ``apply_ac``):

* ``none``: every activation kept;
* ``full``: the block's input kept, its forward re-run in the backward
  (``torch.utils.checkpoint``, non-reentrant);
* ``op`` (torchtitan's ``selective_ac_option: op``): the outputs of the compute-heavy ops
  are kept — every matmul except every second one of a block's forward (in call order
  W_q, W_k, W_v, W_o, W_gate, W_up, W_down: W_k, W_o and W_up are re-run), and the
  attention kernel's — and everything else (norms, RoPE, SwiGLU, casts) is re-run in the
  backward (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
"""

from __future__ import annotations

import functools

__all__ = ["LLAMA_RECOMPUTE", "llama_model", "op_sac_policy"]

#: activation checkpointing policies of the reference Llama (module docstring)
LLAMA_RECOMPUTE = ("none", "op", "full")


def op_sac_policy(torch):
    """A fresh torchtitan ``op`` policy for ``create_selective_checkpoint_contexts``: save
    the attention kernels' and the matmuls' outputs but every second matmul's (counted
    separately in the forward and in its recomputation, so both count alike)."""
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    save = {aten.mm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def llama_model(torch, hidden: int, layers: int, heads: int, kv_heads: int, ffn_hidden: int,
                seq: int, vocab: int, recompute: str = "none", rope_theta: float = 500000.0,
                eps: float = 1e-5):
    """The reference Llama (module docstring) as an ``nn.Module`` whose ``forward(tokens,
    targets)`` returns the mean cross-entropy; ``blocks`` (an ``nn.ModuleList``) may be
    replaced by compiled ones. ``recompute``: one of :data:`LLAMA_RECOMPUTE`."""
    if recompute not in LLAMA_RECOMPUTE:
        raise ValueError(f"recompute must be one of {LLAMA_RECOMPUTE}, got {recompute!r}")
    nn, F = torch.nn, torch.nn.functional
    d = hidden // heads
    inv = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)      # (s, d/2)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) \
                * self.weight

    def rope(x, cos, sin):
        """x (b, s, heads, d): each (even, odd) pair rotated by its angle."""
        xe, xo = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), -1).flatten(-2) \
            .type_as(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = RMSNorm(), RMSNorm()
            self.wq = nn.Linear(hidden, heads * d, bias=False)
            self.wk = nn.Linear(hidden, kv_heads * d, bias=False)
            self.wv = nn.Linear(hidden, kv_heads * d, bias=False)
            self.wo = nn.Linear(heads * d, hidden, bias=False)
            self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)        # gate
            self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)        # up
            self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)        # down

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            n = self.attention_norm(x)
            q = rope(self.wq(n).view(b, s, heads, d), cos, sin)
            k = rope(self.wk(n).view(b, s, kv_heads, d), cos, sin)
            v = self.wv(n).view(b, s, kv_heads, d)
            rep = heads // kv_heads
            k = k[:, :, :, None].expand(b, s, kv_heads, rep, d).reshape(b, s, heads, d)
            v = v[:, :, :, None].expand(b, s, kv_heads, rep, d).reshape(b, s, heads, d)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, s, heads * d))
            m = self.ffn_norm(x)
            # W_gate before W_up: the order torchtitan's FeedForward calls them in
            return x + self.w2(F.silu(self.w1(m)) * self.w3(m))

    class Checkpointed(nn.Module):
        """A block run under ``torch.utils.checkpoint`` with ``recompute``'s policy."""

        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, cos, sin):
            from torch.utils.checkpoint import (checkpoint,
                                                create_selective_checkpoint_contexts)
            if recompute == "full":
                return checkpoint(self.block, x, cos, sin, use_reentrant=False)
            contexts = functools.partial(create_selective_checkpoint_contexts,
                                         op_sac_policy(torch))
            return checkpoint(self.block, x, cos, sin, use_reentrant=False,
                              context_fn=contexts)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block() if recompute == "none" else Checkpointed(Block())
                                        for _ in range(layers))
            self.norm = RMSNorm()
            self.output = nn.Linear(hidden, vocab, bias=False)
            self.register_buffer("cos", torch.cos(angles).float(), persistent=False)
            self.register_buffer("sin", torch.sin(angles).float(), persistent=False)

        def forward(self, tokens, targets):
            s = tokens.shape[1]
            cos, sin = self.cos[:s, None, :], self.sin[:s, None, :]
            x = self.tok_embeddings(tokens)
            for block in self.blocks:
                x = block(x, cos, sin)
            logits = self.output(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    return Llama()
