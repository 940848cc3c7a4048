"""What one traced compute op is, as a kernel: its kind and shape (issue 26).

A :class:`Kernel` rides on a :class:`~vcluster.runtime.tracing.ops.TraceCompute` (``kernel``)
so that a timing model with measured kernels can price the op by what it is rather than
by its FLOPs and bytes alone (:mod:`vcluster.timing.kernel_profiles`). The shape's fields
by kind (``shape``):

* ``gemm`` — ``(batch, m, k, n)``: one batched kernel of ``batch`` m×k×n products
  (2·batch·m·k·n FLOPs);
* ``attention`` — ``(batch·heads, s_q, s_kv, head_dim)``, with ``causal`` and ``flash``
  (one fused kernel that never writes the s_q×s_kv scores) and ``backward``; ``window``
  (> 0, causal only): a sliding window, each query reading its last ``window`` keys;
* ``norm`` — ``(tokens, width)`` (LayerNorm, RMSNorm), ``backward`` for its input gradient;
* ``activation`` — ``(tokens, width)`` of the activation's input (GELU over 4h, SwiGLU's
  gate over f), ``backward`` for its gradient;
* ``elementwise`` — ``(elements,)``: elements read plus written (residual adds, bias adds,
  layout copies, reductions);
* ``dropout`` — ``(elements,)`` likewise;
* ``cross_entropy`` — ``(tokens, vocab)``, forward and backward together; ``parts``: the
  op is one of that many equal passes over the logits (a vocabulary-parallel
  cross-entropy runs three, with all-reduces between them);
* ``optimizer`` — ``(params,)``: one step over that many parameters, ``variant`` the
  optimizer's name ("sgd", "adam").
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from enum import Enum

__all__ = ["Kernel", "KernelKind", "as_kernel", "attention_flops", "kernel_flops",
           "BACKWARD_FLOPS_RATIO"]


class KernelKind(str, Enum):
    GEMM = "gemm"
    ATTENTION = "attention"
    NORM = "norm"
    ACTIVATION = "activation"
    ELEMENTWISE = "elementwise"
    DROPOUT = "dropout"
    CROSS_ENTROPY = "cross_entropy"
    OPTIMIZER = "optimizer"


#: the names of each kind's shape fields (module docstring)
_SHAPE = {KernelKind.GEMM: ("batch", "m", "k", "n"),
          KernelKind.ATTENTION: ("batch_heads", "s_q", "s_kv", "head_dim"),
          KernelKind.NORM: ("tokens", "width"),
          KernelKind.ACTIVATION: ("tokens", "width"),
          KernelKind.ELEMENTWISE: ("elements",),
          KernelKind.DROPOUT: ("elements",),
          KernelKind.CROSS_ENTROPY: ("tokens", "vocab"),
          KernelKind.OPTIMIZER: ("params",)}


@dataclass(frozen=True)
class Kernel:
    """One kernel's kind and shape (module docstring); ``repr`` prints it as
    ``Kernel(attention 64x2048x2048x128 causal flash bwd)``."""

    kind: KernelKind
    shape: tuple
    backward: bool = False
    causal: bool = False
    flash: bool = False
    parts: int = 1
    variant: str = ""
    window: int = 0         # attention: the sliding window in keys (0: none)

    def __post_init__(self):
        if type(self.kind) is not KernelKind:
            try:
                object.__setattr__(self, "kind", KernelKind(self.kind))
            except ValueError:
                raise ValueError(f"Kernel: kind must be one of "
                                 f"{', '.join(k.value for k in KernelKind)}, "
                                 f"got {self.kind!r}") from None
        names = _SHAPE[self.kind]
        shape = self.shape if type(self.shape) is tuple else tuple(self.shape)
        if len(shape) != len(names):
            raise ValueError(f"Kernel: a {self.kind.value} kernel's shape is "
                             f"({', '.join(names)}), got {shape!r}")
        if not all(type(v) is int and v >= 0 for v in shape):    # else: plain ints already
            dims = []
            for name, v in zip(names, shape):
                try:
                    d = operator.index(v)           # ints, numpy integers
                except TypeError:
                    d = None
                if isinstance(v, bool) or d is None or d < 0:
                    raise ValueError(f"Kernel: {name} must be an int >= 0, got {v!r}")
                dims.append(d)
            shape = tuple(dims)
        object.__setattr__(self, "shape", shape)
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"Kernel: parts must be an int >= 1, got {self.parts!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) \
                or self.window < 0 or (self.window and not self.causal):
            raise ValueError(f"Kernel: window must be an int >= 0 (0: none; a causal "
                             f"kernel's), got {self.window!r}")

    def __repr__(self) -> str:
        flags = [f for f, on in (("causal", self.causal), ("flash", self.flash),
                                 ("bwd", self.backward)) if on]
        flags += [f"1/{self.parts}"] if self.parts > 1 else []
        flags += [self.variant] if self.variant else []
        flags += [f"window {self.window}"] if self.window else []
        return (f"Kernel({self.kind.value} {'x'.join(map(str, self.shape))}"
                f"{''.join(' ' + f for f in flags)})")

    def dims(self) -> dict:
        """The shape by field name (``{"batch": 1, "m": 256, ...}``)."""
        return dict(zip(_SHAPE[self.kind], self.shape))

    # --- constructors, one per kind -----------------------------------------------------
    @classmethod
    def gemm(cls, batch: int, m: int, k: int, n: int) -> "Kernel":
        return cls(KernelKind.GEMM, (batch, m, k, n))

    @classmethod
    def attention(cls, batch_heads: int, s_q: int, s_kv: int, head_dim: int, *,
                  causal: bool = True, flash: bool = True, backward: bool = False,
                  window: int | None = None) -> "Kernel":
        """``window``: a causal kernel's sliding window (None, or one >= s_kv: none)."""
        window = 0 if window is None or window >= s_kv else int(window)
        return cls(KernelKind.ATTENTION, (batch_heads, s_q, s_kv, head_dim), backward=backward,
                   causal=causal, flash=flash, window=window)

    @classmethod
    def norm(cls, tokens: int, width: int, backward: bool = False) -> "Kernel":
        return cls(KernelKind.NORM, (tokens, width), backward=backward)

    @classmethod
    def activation(cls, tokens: int, width: int, backward: bool = False,
                   variant: str = "") -> "Kernel":
        return cls(KernelKind.ACTIVATION, (tokens, width), backward=backward, variant=variant)

    @classmethod
    def elementwise(cls, elements: int) -> "Kernel":
        return cls(KernelKind.ELEMENTWISE, (elements,))

    @classmethod
    def dropout(cls, elements: int) -> "Kernel":
        return cls(KernelKind.DROPOUT, (elements,))

    @classmethod
    def cross_entropy(cls, tokens: int, vocab: int, parts: int = 1) -> "Kernel":
        return cls(KernelKind.CROSS_ENTROPY, (tokens, vocab), parts=parts)

    @classmethod
    def optimizer(cls, params: int, variant: str) -> "Kernel":
        return cls(KernelKind.OPTIMIZER, (params,), variant=variant)


#: a fused attention backward's FLOPs over its forward's in FlashAttention's convention:
#: the backward recomputes QK^T and runs four more products (arXiv 2307.08691 sec 4.1)
BACKWARD_FLOPS_RATIO = 2.5


def attention_flops(kernel: Kernel) -> float:
    """One attention forward's FLOPs in FlashAttention's convention (the published
    attention curves' and the measured profiles'): 4·BH·s_q·s_kv·D, halved when causal;
    under a sliding window w (``kernel.window``) 2·BH·D·(2·w·s − w²)
    (s = s_q = s_kv: the closed form of ``modeling.counts.causal_square``)."""
    bh, s_q, s_kv, d = kernel.shape
    if kernel.window:
        w = min(kernel.window, s_q)
        return 2.0 * bh * d * (2 * w * s_q - w * w)
    return 4.0 * bh * s_q * s_kv * d * (0.5 if kernel.causal else 1.0)


def kernel_flops(kernel: Kernel) -> float:
    """The FLOPs a fused attention kernel does, in FlashAttention's convention: its
    forward's (:func:`attention_flops`), times :data:`BACKWARD_FLOPS_RATIO` for a
    backward — from the kernel's shape and mask, whatever count the program declared.
    Programs declare their products in their own conventions: the GPT block declares a
    causal kernel's
    full s² products (the count its TFLOP/s and MFU report), the grouped-query block
    half of them with a backward of twice its forward, a context-parallel diagonal block
    its full square. A kernel's time depends on the work it does, not on the count."""
    flops = attention_flops(kernel)
    return flops * BACKWARD_FLOPS_RATIO if kernel.backward else flops


def as_kernel(name: str, gemm=None, kernel=None) -> Kernel | None:
    """The kernel a ``dev.compute(name, ..., gemm=, kernel=)`` block declares: ``kernel``
    itself, or ``gemm`` = (batch, m, k, n) as a GEMM kernel (the older spelling), or None."""
    if gemm is not None and kernel is not None:
        raise ValueError(f"compute({name!r}): give gemm= or kernel=, not both")
    if gemm is not None:
        return Kernel.gemm(*(int(d) for d in gemm))
    if kernel is not None and not isinstance(kernel, Kernel):
        raise TypeError(f"compute({name!r}): kernel must be a Kernel, got {kernel!r}")
    return kernel
