"""Activation offload to host memory (Grace's LPDDR5X over NVLink-C2C on GB200/GB300):
which layers go, the host memory they take, and the step time the copies add.

The plan (``ParallelConfig.activation_offload`` f, a fraction in [0, 1)): the saved
activations of the first ``k = floor(f·L)`` transformer layers of every pipeline stage
(every model chunk of an interleaved rank) of L layers go to host memory in the forward
and come back for the backward. That is how Megatron-Core's ``--cpu-offloading-num-layers``
and NeMo's ``activation_offload_layers`` count — layers of one transformer block, the
first ones, fewer than the block holds: a count N on a stage of L layers is f = N / L
(the floor is exact there: ``offloaded_layers(N / L, L) == N``). The last layer is never
offloaded: its activations are used by its own backward right after the forward.

Memory (:func:`vcluster.planner.memory.rank_memory`): the k offloaded layers of each of
the rank's in-flight micro-batches leave HBM and occupy pinned host memory, so with A
one layer's activation bytes per micro-batch (Korthikanti's count) and n micro-batches
in flight

    HBM activations  n·(L − k)·A           host bytes  n·k·A

with no extra copy buffer: Transformer Engine's default schedule (the one Megatron-Core
calls) keeps at most L − k layers' activation sets on the GPU at any time, the one being
copied among them — it stalls compute or the reload rather than exceed that ("At most
(model_layers - num_layers) sets of activations are on GPU at any time; both compute and
reload may be stalled to enforce this limit", NVIDIA/TransformerEngine
docs/features/other_optimizations/cpu_offloading/cpu_offloading.rst @d0067d0,
"Default Offloading Scheduling"). A plan fits when n·k·A <= ``NodeSpec.host_memory_bytes``
too (no reserve is taken there).

Time. One copy engine stream carries both directions, one layer at a time, at
r = ``host_link.effective_gbps`` (GB200: 450 GB/s × 0.4289 = 193 GB/s, the slower of
nvbandwidth's measured directions; GB300: 450 × 0.7978 = 359; the presets' sources).
Per micro-batch a layer's copy takes c = A / r; t_f and t_b are one layer's forward and
backward (input + weight gradient) on the device, priced by the replay's own cost model
(:func:`~vcluster.planner.layer_cost.trace_stage_pieces`: one traced layer, compute plus
its tensor-parallel communication). TE's default schedule, per layer (cpu_offload.py
``DefaultOffloadSynchronizer._init_offload_synchronization_dicts`` @d0067d0):

* forward: layer i < k is copied out as its tensors are saved, so its copy starts when
  its forward does (or when the stream frees) and cannot end before the forward that
  produces it: E_i = max(S_i + t_f, max(E_{i−1}, S_i) + c); layer L − k + i may not start
  before E_i (the L − k limit). Exposed: the forward's end less L·t_f;
* backward (layers L−1 .. 0): the reload of layer i starts when layer L − 1 − k + i's
  backward does (a set has just been freed), after the stream's earlier copies, and
  layer i's backward waits for it. Exposed: the backward's end less L·t_b.

:func:`forward_exposed_s` and :func:`backward_exposed_s` run that recursion. In the
copy-bound case (c >= t, k <= L/2) it is closed:

    exposed_fwd = max(0, k·c − (L − 1)·t_f)     the copies overlap the forward of layers
                                                 1 .. L−1 (layer 0's copy starts with it)
    exposed_bwd = max(0, k·c − (L − 2)·t_b)     the reloads overlap the backward of layers
                                                 L−2 .. 1 (none can start before the last
                                                 layer's backward frees a set)

and with c <= t it hides whole while k <= L − 2; with k = L − 1 nothing overlaps (TE
warns: "compute and transfers cannot overlap").

The step: every stage's forward and backward of a micro-batch grow by their exposed
copies, so a pipeline of p stages and m micro-batches grows by (m + p − 1)·e, the slots
on the 1F1B (and GPipe) critical path, e = exposed_fwd + exposed_bwd of the stage that
exposes most; interleaved 1F1B (v chunks per rank, each a transformer block with its own
offload schedule) by (m·v + p − 1)·e_chunk. The zero-bubble schedule runs the input and
weight gradients apart, which this schedule does not describe: refused.
:func:`offload_timing` gives the figures; ``simulate_gpt`` adds ``step_exposed_s`` to the
replayed step (its ``offload_exposed_s``).

What is not modelled: the copies' share of HBM bandwidth (TE: it "may compete with other
GPU operations"), a per-copy latency, FP8's smaller saved tensors, and Megatron-Core's
restrictions — its layer-level ``cpu_offloading`` refuses pipeline parallelism and any
recomputation (megatron/core/transformer/transformer_config.py @d98e8a6, lines
1884-1899); its fine-grained activation offloading runs with pipelines and selective
recomputation (docs/user-guide/features/fine_grained_activation_offloading.md). The plan
refuses ``recompute`` full (the rulebook, ``modeling.plan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modeling import ConfigError

__all__ = ["OffloadStage", "OffloadTiming", "offloaded_layers", "rank_offloaded_layers",
           "host_link_of", "forward_exposed_s", "backward_exposed_s", "microbatch_slots",
           "offload_timing", "OFFLOAD_SCHEDULES"]

#: the schedules whose critical path :func:`microbatch_slots` counts
OFFLOAD_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


def offloaded_layers(fraction: float, layers: int) -> int:
    """floor(fraction · layers), the layers of a block of ``layers`` whose activations
    go to host memory (a count N given as N / layers comes back as N; < layers for a
    fraction < 1)."""
    return int(math.floor(fraction * layers + 1e-9))


def rank_offloaded_layers(parallel, layers: int, r: int) -> float:
    """The offloaded layers of pipeline rank ``r`` per model chunk (the mean over its
    chunks, as the memory model counts a chunk's layers): each chunk (stage) of n layers
    offloads ``offloaded_layers(f, n)``."""
    f = getattr(parallel, "activation_offload", 0.0)
    if not f:
        return 0.0
    counts = parallel.stage_layers(layers)[r::parallel.pp]
    return sum(offloaded_layers(f, n) for n in counts) / parallel.chunks


def host_link_of(hardware, fraction: float):
    """``hardware``'s host link (a :class:`~vcluster.timing.hardware.LinkSpec`), or
    ConfigError naming ``activation_offload`` and the hardware when it has none (or no
    host memory figure) and ``fraction`` > 0; None for fraction 0."""
    if not fraction:
        return None
    node = hardware.node
    missing = "none" if node.host_link is None else \
        "no host memory figure (node.host_memory_bytes)" if node.host_memory_bytes is None \
        else ""
    if missing:
        raise ConfigError("activation_offload", fraction,
                          f"0 on {hardware.name}, or hardware with a host link "
                          "(gb200-nvl72, gb300-nvl72)",
                          f"needs a host link (NVLink-C2C on GB200/GB300): {hardware.name} "
                          f"has {missing}")
    return node.host_link


def forward_exposed_s(layers: int, offloaded: int, layer_s: float, copy_s: float) -> float:
    """The seconds a block's forward of one micro-batch waits for its copies out (module
    doc): ``layers`` L, the first ``offloaded`` k copied, ``layer_s`` a layer's forward,
    ``copy_s`` one layer's copy."""
    L, k = _check(layers, offloaded)
    if k == 0:
        return 0.0
    done: list[float] = []               # E_i: layer i's copy has ended
    stream, end = 0.0, 0.0
    for j in range(L):
        start = end
        if 0 <= j - (L - k) < k:        # the L − k limit: layer j - (L - k) must be out
            start = max(start, done[j - (L - k)])
        end = start + layer_s
        if j < k:
            stream = max(end, max(stream, start) + copy_s)
            done.append(stream)
    return _exposed(end, L * layer_s)


def backward_exposed_s(layers: int, offloaded: int, layer_s: float, copy_s: float) -> float:
    """The seconds a block's backward of one micro-batch waits for its reloads (module
    doc): layers L−1 .. 0, ``layer_s`` a layer's backward, ``copy_s`` one layer's copy."""
    L, k = _check(layers, offloaded)
    if k == 0:
        return 0.0
    back = [0.0] * k                      # layer i's reload has ended
    stream, end = 0.0, 0.0
    for j in range(L - 1, -1, -1):
        ready = end
        i = j - (L - 1 - k)               # the reload that starts at layer j's backward
        if 0 <= i < k:
            stream = max(ready, stream) + copy_s
            back[i] = stream
        start = max(ready, back[j]) if j < k else ready
        end = start + layer_s
    return _exposed(end, L * layer_s)


def _exposed(end: float, compute: float) -> float:
    """end − compute, 0 within rounding (1e-12 of the compute: the sum of L layer times
    is not L times one)."""
    return end - compute if end - compute > 1e-12 * compute else 0.0


def _check(layers, offloaded) -> tuple[int, int]:
    if not (isinstance(layers, int) and isinstance(offloaded, int) and layers >= 1
            and 0 <= offloaded < layers):
        raise ValueError(f"offload: expected 0 <= offloaded < layers, got {offloaded!r} of "
                         f"{layers!r} layers")
    return layers, offloaded


def microbatch_slots(parallel) -> int:
    """The micro-batch slots on a step's critical path that each stage's exposed copies
    lengthen: m + p − 1 (1F1B, GPipe), m·v + p − 1 chunk slots (interleaved 1F1B);
    ConfigError for the zero-bubble schedule."""
    if parallel.schedule not in OFFLOAD_SCHEDULES:
        raise ConfigError("activation_offload", parallel.activation_offload,
                          f"0 with schedule {parallel.schedule}, or schedule one of "
                          + ", ".join(OFFLOAD_SCHEDULES),
                          f"the {parallel.schedule} schedule runs input and weight gradients "
                          "apart; the offload's copy schedule (forward, then one backward "
                          "per layer) is not modelled under it")
    v = parallel.chunks if parallel.schedule == "interleaved_1f1b" else 1
    return parallel.microbatches * v + parallel.pp - 1


@dataclass(frozen=True)
class OffloadStage:
    """The offload of one model chunk (a pipeline stage) for one micro-batch."""

    rank: int                  # pipeline rank
    chunk: int                 # the rank's model chunk (0 without interleaving)
    layers: int                # L: the chunk's transformer layers
    offloaded: int             # k = floor(f·L)
    layer_bytes: float         # A: one layer's activations per micro-batch
    copy_s: float              # c = A / r: one layer's copy over the host link
    forward_layer_s: float     # t_f: one layer's forward
    backward_layer_s: float    # t_b: one layer's backward (input + weight gradient)
    exposed_forward_s: float   # what the forward waits for its copies out
    exposed_backward_s: float  # what the backward waits for its reloads

    @property
    def exposed_s(self) -> float:
        return self.exposed_forward_s + self.exposed_backward_s


@dataclass(frozen=True)
class OffloadTiming:
    """Every chunk's offload (:class:`OffloadStage`), the link rate and the step's slots."""

    stages: tuple
    link_gbps: float           # host_link.effective_gbps
    slots: int                 # microbatch_slots

    @property
    def exposed_per_slot_s(self) -> float:
        """e: the most exposed copy time of a chunk per micro-batch."""
        return max((s.exposed_s for s in self.stages), default=0.0)

    @property
    def step_exposed_s(self) -> float:
        """What the copies add to the step: slots · e."""
        return self.slots * self.exposed_per_slot_s


def offload_timing(config, parallel, hardware, costs, expert_skew: float = 1.0,
                   autocast_kernels: bool = False, inductor_fusion: bool = False,
                   pieces=None) -> OffloadTiming:
    """The offload of ``parallel.activation_offload`` on ``hardware`` (a HardwareSpec;
    ConfigError when it has no host link): one :class:`OffloadStage` per pipeline rank and
    chunk, its layers' forward and backward priced by ``costs`` (the replay's
    HardwareCostModel, through :func:`~vcluster.planner.layer_cost.trace_stage_pieces`;
    ``pieces``: those already traced) and its bytes by the memory model
    (:func:`~vcluster.planner.memory.layer_activation_bytes`)."""
    from .layer_cost import trace_stage_pieces        # lazy: layer_cost traces programs
    from .memory import layer_activation_bytes        # lazy: memory imports this module
    f = parallel.activation_offload
    link = host_link_of(hardware, f)
    slots = microbatch_slots(parallel)
    rate = link.effective_gbps * 1e9
    if pieces is None:
        pieces = trace_stage_pieces(
            config, parallel.tp, parallel.micro_batch, parallel.sequence_parallel,
            parallel.recompute, costs, parallel.cp, parallel.cp_algorithm, parallel.ep,
            expert_skew, parallel.attention, autocast_kernels, inductor_fusion,
            parallel.use_async_grad_reduce, parallel.etp, parallel.moe_dispatcher,
            parallel.use_tp_comm_overlap, parallel.recompute_modules)
    t_f = pieces[("layer", "F")].seconds
    t_b = (pieces[("layer", "I")] + pieces[("layer", "W")]).seconds
    counts = parallel.stage_layers(config.layers)
    stages = []
    for s, n in enumerate(counts):
        r, chunk = s % parallel.pp, s // parallel.pp
        k = offloaded_layers(f, n)
        a = layer_activation_bytes(config, parallel, r, expert_skew)
        c = a / rate
        stages.append(OffloadStage(r, chunk, n, k, a, c, t_f, t_b,
                                   forward_exposed_s(n, k, t_f, c),
                                   backward_exposed_s(n, k, t_b, c)))
    return OffloadTiming(tuple(stages), link.effective_gbps, slots)
