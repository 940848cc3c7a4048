"""Peak memory per device of GPT training: parameters, gradients, optimizer state and
activations, by the formulas of the Megatron-LM papers.

Parameters on pipeline rank r (tensor-parallel degree t): its layers' 12h² + 13h each
(QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two LayerNorms 4h), divided by t
except the LayerNorms and the row-parallel biases (small; counted whole); the first
stage also holds the word (V·h / t, vocabulary-parallel) and position (s·h) embeddings,
the last the final LayerNorm and the output projection (V·h / t).

Bytes per parameter (mixed precision, Narayanan et al. SC'21 and the ZeRO paper):
``WEIGHT_BYTES`` 2 (16-bit weights) + ``GRAD_BYTES`` 4 (fp32 gradients accumulated over
micro-batches) + ``OPTIMIZER_BYTES`` 12 (fp32 master weights, Adam's m and v) = 18.

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", 16-bit), s sequence, b micro-batch,
h hidden, a heads, t tensor-parallel degree:

=============  ====================================  ==============================
recompute      without sequence parallelism          with sequence parallelism
=============  ====================================  ==============================
none           s·b·h·(10 + 24/t + 5·a·s/(h·t))       s·b·h·(34/t + 5·a·s/(h·t))
selective      s·b·h·(10 + 24/t)                     s·b·h·34/t
full           2·s·b·h (the layer's input)           2·s·b·h/t
=============  ====================================  ==============================

A rank holds as many micro-batches' activations as its schedule keeps in flight at
its peak (:func:`pipelining.peak_in_flight`: m for GPipe, min(m, p - r) for 1F1B on
rank r), each for one chunk's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelining import peak_in_flight

__all__ = ["MemoryBreakdown", "gpt_memory", "WEIGHT_BYTES", "GRAD_BYTES", "OPTIMIZER_BYTES",
           "MEMORY_HEADROOM", "usable_memory_bytes"]

WEIGHT_BYTES = 2
GRAD_BYTES = 4
OPTIMIZER_BYTES = 12
# The share of a device's memory a plan leaves free: the formulas above count tensors,
# not the CUDA context (~0.5 GB), NCCL's buffers or the caching allocator's
# fragmentation. 5% is issue 31's default; --memory-headroom changes it.
MEMORY_HEADROOM = 0.05


def usable_memory_bytes(hbm_bytes: float, headroom: float = MEMORY_HEADROOM) -> float:
    """What a configuration may use of ``hbm_bytes``: ``hbm_bytes * (1 - headroom)``,
    0 <= headroom < 1."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 0 <= headroom < 1:
        raise ValueError(f"memory_headroom must be a fraction in [0, 1), got {headroom!r}")
    return hbm_bytes * (1 - headroom)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device."""

    rank_position: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


def activation_bytes_per_layer(s, b, h, a, t, recompute, sp) -> float:
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    base = 34 / t if sp else 10 + 24 / t
    return s * b * h * (base + attention)


def gpt_memory(config, parallel, schedule) -> list[MemoryBreakdown]:
    """One breakdown per pipeline position (every dp/tp peer holds the same)."""
    h, s, V, a, t = config.hidden, config.seq, config.vocab, config.heads, parallel.tp
    p, v = parallel.pp, parallel.chunks
    stages = p * v
    per_stage = config.layers // stages
    layer_params = (12 * h * h + 4 * h) / t + 9 * h       # sharded matrices; biases and LNs
    out = []
    for r in range(p):
        n_layers = per_stage * v
        params = n_layers * layer_params
        if r == 0:
            params += V * h / t + s * h
        if (stages - 1) % p == r:
            params += V * h / t + 2 * h
        act_layer = activation_bytes_per_layer(s, parallel.micro_batch, h, a, t,
                                                parallel.recompute, parallel.sequence_parallel)
        activations = peak_in_flight(schedule, r, check=False) * per_stage * act_layer
        out.append(MemoryBreakdown(r, int(params * WEIGHT_BYTES), int(params * GRAD_BYTES),
                                   int(params * OPTIMIZER_BYTES), int(activations)))
    return out
