"""``PrecisionPolicy``: the bytes per parameter and per activation element a training run
keeps, by framework — what :mod:`vcluster.planner.memory` multiplies its counts by.

=================  ======  ====  =========  ==========  ======  ============================
preset             weight  grad  optimizer  activation  logits  activations counted by
=================  ======  ====  =========  ==========  ======  ============================
``megatron``       2       4     12         2           4       Korthikanti et al.
``megatron_bf16``  2       2     12         2           4       Korthikanti et al.
``torch_amp``      4       4     8          2           12      the PyTorch program
``torch_compile``  4       4     8          2           4       it, under ``torch.compile``
``fp64``           8       8     16         8           8       the emulated program
``fp32``           4       4     8          4           4       the emulated program
=================  ======  ====  =========  ==========  ======  ============================

(bytes per parameter for weight, grad, optimizer; per element for activation, logits.)

* ``megatron`` (the default): Megatron-LM's mixed precision with fp32 gradient
  accumulation (Narayanan et al. SC'21; the ZeRO paper's 2 + 2 + 12 with fp32 main
  gradients): bf16 weights 2, fp32 main gradients 4, fp32 master weights + Adam's m and v
  12 = 18 bytes per parameter; 16-bit activations, fp32 logits (its cross-entropy upcasts).
* ``megatron_bf16``: the same with bf16 main gradients, 2 + 2 + 12 = 16 bytes per
  parameter: Megatron-Core's gradient buffer takes the parameters' dtype unless
  ``grad_reduce_in_fp32`` (``megatron/core/distributed/param_and_grad_buffer.py``,
  ``group_params_for_buffers``: "torch.float if grad_reduce_in_fp32, else param.dtype"),
  and every performance recipe of NVIDIA's Megatron-Bridge turns it off
  (``cfg.ddp.grad_reduce_in_fp32 = False``: ``scripts/performance/configs/*/*.yaml`` of
  v0.1.0rc3, ``scripts/performance/configs/*/*_llm_pretrain.py`` of v0.2.0 to v0.5.1,
  ``src/megatron/bridge/perf_recipes/_common.py`` of v0.6.0). The gradients are then
  reduced in bf16 too, which is what the traced program reduces (its gradients' dtype)
  whatever the policy: the policy changes the memory and the optimizer step's traffic
  (:attr:`PrecisionPolicy.optimizer_step_bytes`), not the collectives.
* ``torch_amp``: PyTorch automatic mixed precision (``torch.autocast(dtype=bfloat16)``
  around an fp32 model, ``torch.optim.Adam``): fp32 parameters 4 (they are the master
  copy: autocast casts them to bf16 per op, no stored bf16 copy), fp32 ``.grad`` 4, Adam's
  ``exp_avg`` and ``exp_avg_sq`` fp32 8 = 16. What the step holds besides is counted
  tensor by tensor as PyTorch's autograd saves it for :mod:`vcluster.gpu.gpt_step`'s
  reference program (``activation_count="torch_amp"``,
  :func:`vcluster.planner.memory.torch_amp_activation_bytes`): LayerNorms in fp32 keep
  their fp32 inputs, each linear keeps the bf16 cast of its input *and of its weight*
  (``weight_copy_bytes`` 2: autocast casts a weight once per forward and the linear saves
  the cast until its backward, so every micro-batch in flight holds a bf16 copy of the
  stage's matrices), and the loss holds 12 bytes per logit at the start of its backward
  (``logits_bytes``: the fp32 log-softmax output it saved, 4, the nll gradient and
  log-softmax's input gradient, 4 + 4; ``logits_saved_bytes`` 4 for every other
  micro-batch in flight). ``optimizer.zero_grad(set_to_none=True)`` frees ``.grad``
  between steps (``grads_persistent=False``): the gradients appear during the first
  backward, so the peak is the larger of the first backward's start (activations, no
  gradients) and what follows it (gradients and the activations still in flight), not
  their sum. Megatron keeps its main gradients in one buffer for the whole run
  (``grads_persistent=True``). The step also runs kernels of its own, autocast's casts
  among them (``autocast_kernels=True``: :mod:`vcluster.planner.autocast_kernels`, priced
  where kernels are priced from measurements).
* ``torch_compile``: the same PyTorch AMP step under ``torch.compile`` (Inductor, the
  default mode; ``vcluster bench gpu-step --compile``): the same bytes per parameter and
  the same saved tensors per layer (AOTAutograd's partitioner saves what eager autograd
  saves: the LayerNorms' fp32 inputs, the bf16 casts of the linears' inputs and weights,
  q, k, v, attention's output and log-sum-exp, GELU's input and output), but the loss is
  fused: the fp32 upcast of the logits never materialises. The forward saves the bf16
  logits (``logits_saved_bytes`` 2) and each row's max and log-sum-exp, and the fused
  backward writes the bf16 logits' gradient straight from them (``logits_bytes`` 4 at
  the loss's backward: the saved logits and their gradient, against eager's 12). Its
  LayerNorms save their rstd, not their mean (``activation_count="torch_compile"``:
  :func:`vcluster.planner.memory.torch_amp_activation_bytes`). Checked on the CPU
  against the tensors the compiled step saves and the buffers Inductor's scheduler
  writes (``tests/planner/test_inductor_kernels.py``). Its kernels are the eager step's
  autocast kernels as Inductor fuses them (``inductor_fusion=True``:
  :mod:`vcluster.planner.inductor_kernels`, priced where the autocast kernels are).
* ``fp64`` / ``fp32``: vcluster's own emulated program (:class:`pipeline_parallel.gpt.GPT`
  with ``GPTConfig(dtype=...)``): weights and gradients in the dtype, no master copy,
  Adam's m and v in the dtype (:mod:`pipeline_parallel.optim`; SGD keeps one momentum
  slot: :meth:`PrecisionPolicy.emulated` with ``optimizer="sgd"``), activations and the
  logits' gradient in the dtype, counted tensor by tensor as the program saves them
  (``activation_count="emulator"``: :func:`vcluster.planner.memory.emulator_activation_bytes`).

``activation_count`` chooses the activation formula: ``"korthikanti"`` (Korthikanti et al.
2022's 16-bit count of Megatron's saved tensors; it needs ``activation_bytes`` 2),
``"torch_amp"`` (what plain PyTorch under bf16 autocast saves: dense GPT only),
``"torch_compile"`` (the same program under ``torch.compile``) or
``"emulator"`` (what the numpy program keeps: dense GPT only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from vcluster.timing.gemm_formats import gemm_format

__all__ = ["PrecisionPolicy", "PRECISIONS", "ACTIVATION_COUNTS", "precision_policy",
           "MEGATRON", "MEGATRON_BF16"]

#: the activation formulas a policy may name
ACTIVATION_COUNTS = ("korthikanti", "torch_amp", "torch_compile", "emulator")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter (weights, gradients, optimizer state) and per kept activation
    element and logit, and the activation formula (see the module docstring)."""

    name: str
    weight_bytes: float          # per parameter, the weights the forward reads
    grad_bytes: float            # per parameter, the accumulated gradient
    optimizer_bytes: float       # per parameter: master copy (if any) + optimizer slots
    activation_bytes: int        # per element of a saved activation
    logits_bytes: int            # per logit of the micro-batch whose loss is backwarded
    activation_count: str = "korthikanti"
    logits_saved_bytes: float = 0    # per logit of each other micro-batch in flight
    weight_copy_bytes: float = 0     # per matrix parameter, per micro-batch in flight
    # per element of a GEMM input kept for the weight gradient (Korthikanti's count only):
    # 2 (bf16), or a low-precision format's stored bytes where Transformer Engine keeps
    # the quantised copy (:meth:`with_quantised_gemm_inputs`)
    gemm_input_bytes: float = 2
    grads_persistent: bool = True    # gradients allocated for the whole run (else per step)
    autocast_kernels: bool = False   # the step runs plain PyTorch's autocast kernels (casts)
    inductor_fusion: bool = False    # ... fused by torch.compile (Inductor)
    # the optimizer keeps a master copy of the weights in optimizer_bytes (Megatron's fp32
    # main parameters), so its step writes the 16-bit weights without reading them
    master_weights: bool = False

    def __post_init__(self):
        for f in ("weight_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                  "logits_bytes", "logits_saved_bytes", "weight_copy_bytes",
                  "gemm_input_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"PrecisionPolicy: {f} must be a number of bytes >= 0, "
                                 f"got {v!r}")
        if self.activation_count not in ACTIVATION_COUNTS:
            raise ValueError(f"PrecisionPolicy: activation_count must be one of "
                             f"{ACTIVATION_COUNTS}, got {self.activation_count!r}")
        for f in ("grads_persistent", "autocast_kernels", "inductor_fusion", "master_weights"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"PrecisionPolicy: {f} must be a bool, got "
                                 f"{getattr(self, f)!r}")
        if self.activation_count in ("korthikanti", "torch_amp", "torch_compile") \
                and self.activation_bytes != 2:
            raise ValueError(f"PrecisionPolicy: activation_count="
                             f"{self.activation_count!r} is a 16-bit "
                             f"count (activation_bytes 2), got activation_bytes="
                             f"{self.activation_bytes!r}; use activation_count='emulator' "
                             f"for another element size")

        if self.gemm_input_bytes != 2 and (self.activation_count != "korthikanti"
                                           or not 0 < self.gemm_input_bytes < 2):
            raise ValueError(f"PrecisionPolicy: gemm_input_bytes={self.gemm_input_bytes!r} "
                             f"(quantised GEMM inputs) needs activation_count "
                             f"'korthikanti' and a size in (0, 2) bytes")

    def with_quantised_gemm_inputs(self, fmt) -> "PrecisionPolicy":
        """This policy as Transformer Engine runs it with ``fmt`` GEMMs (a GEMM format or
        its name: :mod:`vcluster.timing.gemm_formats`): each linear layer keeps the
        quantised copy of its input for its weight gradient, ``fmt.stored_bytes`` per
        element (TE's Linear and LayerNormLinear save their quantised input, not the bf16
        one, when FP8 is on), not the bf16 tensor Korthikanti's count keeps."""
        f = gemm_format(fmt)
        return dataclasses.replace(self, name=f"{self.name}+{f.name}",
                                   gemm_input_bytes=f.stored_bytes)

    def __str__(self) -> str:
        return (f"{self.name} ({self.weight_bytes:g}+{self.grad_bytes:g}+"
                f"{self.optimizer_bytes:g} B/param, {self.activation_bytes}-byte activations)")

    @property
    def bytes_per_param(self) -> float:
        """weight + grad + optimizer bytes per parameter (megatron 18, torch_amp 16)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def optimizer_step_bytes(self) -> float:
        """HBM traffic of one optimizer step per parameter: it reads the gradient, reads
        and writes its state (the master copy, if any, and the slots), and writes the
        weights — reading them too when they are themselves the master copy::

            grad + 2 * optimizer + (1 if master_weights else 2) * weight

        megatron 4 + 2·12 + 2 = 30 (Megatron's Adam over fp32 main parameters, then the
        bf16 copy written); megatron_bf16 28; torch_amp and torch_compile 4 + 2·8 + 2·4 = 28
        (PyTorch's fused AdamW over fp32 parameters: p, g, m, v read, p, m, v written);
        fp64 56 = 7 · 8 and fp64-sgd 40 = 5 · 8, the emulator's own count
        (:attr:`pipeline_parallel.optim.Optimizer.bytes_touched_per_param_byte`)."""
        reads_weights = 1 if self.master_weights else 2
        return self.grad_bytes + 2 * self.optimizer_bytes + reads_weights * self.weight_bytes

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


MEGATRON = PrecisionPolicy("megatron", 2, 4, 12, 2, 4, master_weights=True)
#: Megatron with bf16 main gradients (``grad_reduce_in_fp32=False``; module docstring)
MEGATRON_BF16 = PrecisionPolicy("megatron_bf16", 2, 2, 12, 2, 4, master_weights=True)
#: the named presets (``--precision``)
PRECISIONS = {
    "megatron": MEGATRON,
    "megatron_bf16": MEGATRON_BF16,
    "torch_amp": PrecisionPolicy("torch_amp", 4, 4, 8, 2, 12, "torch_amp",
                                 logits_saved_bytes=4, weight_copy_bytes=2,
                                 grads_persistent=False, autocast_kernels=True),
    "torch_compile": PrecisionPolicy("torch_compile", 4, 4, 8, 2, 4, "torch_compile",
                                     logits_saved_bytes=2, weight_copy_bytes=2,
                                     grads_persistent=False, autocast_kernels=True,
                                     inductor_fusion=True),
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
