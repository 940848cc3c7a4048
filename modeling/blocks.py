"""The transformer blocks the GPT program runs, as data.

A :class:`Block` names what a block is made of — its norm, its positions, its MLP, its
biases, whether its key/value heads may be fewer than its query heads, and how the
program declares attention's score FLOPs. ``GPTConfig(arch=...)`` picks one by name
(:data:`BLOCKS`, the one place a name becomes a block); engines then ask the block
(``config.block.grouped_query``, ``config.block.mlp.matrices``), never the name, and
:func:`block_of` finds the block a :class:`~modeling.spec.ModelSpec`'s layers are.

* :data:`GPT2_BLOCK` — LayerNorm, learned positions, a GELU MLP 4h wide, biases
  everywhere, multi-head attention; its attention is declared over the full s² scores
  (Megatron's count).
* :data:`LLAMA_BLOCK` — RMSNorm, RoPE, a SwiGLU MLP, no biases, grouped-query
  attention; its attention is declared causal (half the s² scores, FlashAttention's).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from .choices import FlopConvention, MLPKind, NormKind, Positions
from .errors import ConfigError

__all__ = ["Block", "GPT2_BLOCK", "LLAMA_BLOCK", "BLOCKS", "block_named", "block_of"]


@dataclass(frozen=True)
class Block:
    """One kind of transformer block (module docstring). ``arch``: its name in
    ``GPTConfig(arch=...)``; ``title``: how reports name it."""

    arch: str
    title: str
    norm: NormKind
    positions: Positions
    mlp: MLPKind
    biases: bool
    grouped_query: bool
    attention_flops: FlopConvention

    def __str__(self) -> str:
        return self.title


GPT2_BLOCK = Block("gpt", "GPT", NormKind.LAYERNORM, Positions.LEARNED, MLPKind.GELU,
                   biases=True, grouped_query=False, attention_flops=FlopConvention.MEGATRON)
LLAMA_BLOCK = Block("llama", "Llama", NormKind.RMSNORM, Positions.ROPE, MLPKind.SWIGLU,
                    biases=False, grouped_query=True, attention_flops=FlopConvention.CAUSAL)

#: every block the GPT program runs, by its GPTConfig.arch name
BLOCKS = MappingProxyType({b.arch: b for b in (GPT2_BLOCK, LLAMA_BLOCK)})


def block_named(arch) -> Block:
    """The block called ``arch``, or ConfigError listing the names."""
    try:
        return BLOCKS[arch]
    except (KeyError, TypeError):
        raise ConfigError("arch", arch, f"one of {', '.join(BLOCKS)}",
                          "not a block the GPT program runs", owner="GPTConfig") from None


def block_of(norm: NormKind, positions: Positions, mlp: MLPKind, mlp_bias: bool,
             attention_bias: bool) -> Block | None:
    """The block made of these parts (a spec's layer), or None."""
    for block in BLOCKS.values():
        if (block.norm, block.positions, block.mlp) == (norm, positions, mlp) \
                and block.biases == mlp_bias == attention_bias:
            return block
    return None
