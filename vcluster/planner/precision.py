"""``PrecisionPolicy``: the bytes per parameter and per activation element a training run
keeps, by framework — what :mod:`vcluster.planner.memory` multiplies its counts by.

=============  ======  ====  =========  ==========  ======  =====================
preset         weight  grad  optimizer  activation  logits  activations counted by
=============  ======  ====  =========  ==========  ======  =====================
``megatron``   2       4     12         2           4       Korthikanti et al.
``torch_amp``  4       4     8          2           4       Korthikanti et al.
``fp64``       8       8     16         8           8       the emulated program
``fp32``       4       4     8          4           4       the emulated program
=============  ======  ====  =========  ==========  ======  =====================

(bytes per parameter for weight, grad, optimizer; per element for activation, logits.)

* ``megatron`` (the default): Megatron-LM's mixed precision with fp32 gradient
  accumulation (Narayanan et al. SC'21; the ZeRO paper's 2 + 2 + 12 with fp32 main
  gradients): bf16 weights 2, fp32 main gradients 4, fp32 master weights + Adam's m and v
  12 = 18 bytes per parameter; 16-bit activations, fp32 logits (its cross-entropy upcasts).
* ``torch_amp``: PyTorch automatic mixed precision (``torch.autocast(dtype=bfloat16)``
  around an fp32 model, ``torch.optim.Adam``): fp32 parameters 4 (they are the master
  copy: autocast casts them to bf16 per op, no stored bf16 copy), fp32 ``.grad`` 4, Adam's
  ``exp_avg`` and ``exp_avg_sq`` fp32 8 = 16; the activations autocast keeps are bf16 (the
  matmul outputs), the logits fp32 (``cross_entropy`` runs in fp32 under autocast).
* ``fp64`` / ``fp32``: vcluster's own emulated program (:class:`pipeline_parallel.gpt.GPT`
  with ``GPTConfig(dtype=...)``): weights and gradients in the dtype, no master copy,
  Adam's m and v in the dtype (:mod:`pipeline_parallel.optim`; SGD keeps one momentum
  slot: :meth:`PrecisionPolicy.emulated` with ``optimizer="sgd"``), activations and the
  logits' gradient in the dtype, counted tensor by tensor as the program saves them
  (``activation_count="emulator"``: :func:`vcluster.planner.memory.emulator_activation_bytes`).

``activation_count`` chooses the activation formula: ``"korthikanti"`` (Korthikanti et al.
2022's 16-bit count of Megatron's saved tensors; it needs ``activation_bytes`` 2) or
``"emulator"`` (what the numpy program keeps: dense GPT only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PrecisionPolicy", "PRECISIONS", "ACTIVATION_COUNTS", "precision_policy",
           "MEGATRON"]

#: the activation formulas a policy may name
ACTIVATION_COUNTS = ("korthikanti", "emulator")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter (weights, gradients, optimizer state) and per kept activation
    element and logit, and the activation formula (see the module docstring)."""

    name: str
    weight_bytes: float          # per parameter, the weights the forward reads
    grad_bytes: float            # per parameter, the accumulated gradient
    optimizer_bytes: float       # per parameter: master copy (if any) + optimizer slots
    activation_bytes: int        # per element of a saved activation
    logits_bytes: int            # per element of the logits (or their gradient) held
    activation_count: str = "korthikanti"

    def __post_init__(self):
        for f in ("weight_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                  "logits_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"PrecisionPolicy: {f} must be a number of bytes >= 0, "
                                 f"got {v!r}")
        if self.activation_count not in ACTIVATION_COUNTS:
            raise ValueError(f"PrecisionPolicy: activation_count must be one of "
                             f"{ACTIVATION_COUNTS}, got {self.activation_count!r}")
        if self.activation_count == "korthikanti" and self.activation_bytes != 2:
            raise ValueError(f"PrecisionPolicy: activation_count='korthikanti' is a 16-bit "
                             f"count (activation_bytes 2), got activation_bytes="
                             f"{self.activation_bytes!r}; use activation_count='emulator' "
                             f"for another element size")

    def __str__(self) -> str:
        return (f"{self.name} ({self.weight_bytes:g}+{self.grad_bytes:g}+"
                f"{self.optimizer_bytes:g} B/param, {self.activation_bytes}-byte activations)")

    @property
    def bytes_per_param(self) -> float:
        """weight + grad + optimizer bytes per parameter (megatron 18, torch_amp 16)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @classmethod
    def emulated(cls, dtype="float64", optimizer: str = "adam") -> "PrecisionPolicy":
        """The emulated program's policy for ``GPTConfig(dtype=dtype)`` trained with
        ``optimizer`` ("adam": m and v, 2 slots; "sgd": the momentum buffer, 1 slot —
        :class:`pipeline_parallel.optim.Optimizer` allocates it even at momentum 0)."""
        slots = {"adam": 2, "sgd": 1}
        if optimizer not in slots:
            raise ValueError(f"PrecisionPolicy.emulated: optimizer must be one of "
                             f"{tuple(slots)}, got {optimizer!r}")
        dt = np.dtype(dtype)
        if dt.kind != "f":
            raise ValueError(f"PrecisionPolicy.emulated: dtype must be a float type, got "
                             f"{dtype!r}")
        item = dt.itemsize
        name = f"fp{8 * item}" + ("" if optimizer == "adam" else "-sgd")
        return cls(name, item, item, slots[optimizer] * item, item, item, "emulator")


MEGATRON = PrecisionPolicy("megatron", 2, 4, 12, 2, 4)
#: the named presets (``--precision``)
PRECISIONS = {
    "megatron": MEGATRON,
    "torch_amp": PrecisionPolicy("torch_amp", 4, 4, 8, 2, 4),
    "fp64": PrecisionPolicy.emulated("float64"),
    "fp32": PrecisionPolicy.emulated("float32"),
}


def precision_policy(precision) -> PrecisionPolicy:
    """A PrecisionPolicy, or the preset of that name; ValueError naming the allowed ones."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)} (or a "
                         f"PrecisionPolicy), got {precision!r}")
    return PRECISIONS[precision]
