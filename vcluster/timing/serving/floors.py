"""The physical floors of a serving step: bytes over datasheet HBM bandwidth, FLOPs over
datasheet peak. No step can run faster; :class:`~.step_cost.ServingCostModel` never
predicts below them and prints them beside its prediction.

A step computes KV for ``new_tokens`` n_i of each scheduled sequence, whose last query sees
``contexts`` c_i keys (c_i = computed + n_i), and samples a token for S of them. With
T = Σ n_i, on one GPU of pipeline stage s (its layers by :func:`serving.memory.
vllm_stage_layers`), tensor-parallel degree t::

    bytes_s = Σ_layers W_l·b_w                     every weight matrix of the stage's layers
            + Σ_MoE E·(1 − (1 − k/E)^T)·P_e/t·b_w  only the routed experts some token reaches
            + [S > 0]·V·h/t·b_w                    the head, on the last stage
            + Σ_layers Σ_i min(c_i, w_l)·kv_l      each sequence's keys read once (window w_l)
    flops_s = Σ_layers 2·T·W_l + Σ_MoE 2·T·k·P_e/t + 2·S·h·V/t       products
            + Σ_layers 2·n_h/t·(d_qk + d_v)·pairs_l                   attention
    floor   = max over stages of max(bytes_s / BW_datasheet, flops_s / peak(dtype))

W_l is a layer's matrix parameters on one GPU: q, k, v and o (k and v of max(1,
kv_heads/t) whole heads: vLLM replicates them when t exceeds them), the MLP's m·h·f/t,
latent attention's replicated down-projections h·r_q + h·(r_kv + d_rope) and its split
up-projections, an MoE's replicated router h·E and its shared experts. Norm vectors and
the embedding table are left out (a lookup reads T of its rows): the floor stays below
what the cost model counts. pairs_l counts each query's keys, itself included: a chunk of n
queries ending at context c sees K(c) − K(c − n) with K(x) = x(x+1)/2, or under a window
w, K(x) = w(w+1)/2 + (x − w)·w past it. Latent attention (MLA) runs decode rows (n_i = 1)
in vLLM's absorbed form, each key 2·n_h/t·(2·r_kv + d_rope) FLOPs, and its prefill rows
up-project their earlier context: 2·(c_i − n_i)·r_kv·n_h/t·(d_nope + d_v).

MoE weights: a floor that reads only the experts some token reaches needs to know which
are reached. Here it is the expectation under uniform, independent routing, E·(1 − (1 −
k/E)^T) distinct experts of E (each token picks k): all of them for T ≳ 3E/k, k of them at
T = 1. It is not a worst case — routing that piles tokens onto fewer experts reads fewer —
but it is what the cost model prices, so a prediction never falls below it.

:func:`decode_floor_s` is the bandwidth term of a decode step (one new token per
sequence), :func:`prefill_floor_s` the compute term of a prefill; a step's floor
(:func:`step_floor`) is the larger of both over its combined work (the weights are read
once per step, whatever it mixes).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from modeling.spec import LatentAttention, Layer, ModelSpec, MoE
from serving.memory import check_layout, kv_heads_per_rank, vllm_stage_layers

from ..hardware import HardwareSpec, canonical_dtype

__all__ = ["StepFloor", "FloorModel", "StepShape", "step_shape", "step_floor",
           "decode_floor_s", "prefill_floor_s", "layer_matrix_params", "attention_pairs",
           "expected_experts"]

_BYTES_PER_GB = 1e9     # GB/s is 1e9 bytes/s (hardware.py)


def attention_pairs(new_tokens: np.ndarray, contexts: np.ndarray,
                    window: int | None) -> np.ndarray:
    """(query, key) pairs of each row: its n queries end at position c − 1 and query p sees
    min(p + 1, w) keys, K(c) − K(c − n) (module docstring)."""
    def k(x):
        if window is None:
            return x * (x + 1) // 2
        inside = np.minimum(x, window)
        return inside * (inside + 1) // 2 + np.maximum(x - window, 0) * window
    return k(contexts) - k(contexts - new_tokens)


@dataclass(frozen=True)
class StepShape:
    """What the physics needs of a step: ``tokens`` T = Σ n_i, ``samples`` S, and per
    attention window (None: full) the (query, key) ``pairs`` and the keys ``read`` (each
    sequence's min(c_i, w)), each split (prefill rows, decode rows); ``prefill_context``
    Σ (c_i − n_i) over prefill rows (n_i > 1)."""

    tokens: int
    samples: int
    sequences: int
    decode_seqs: int
    pairs: dict
    read: dict
    prefill_context: int


def step_shape(new_tokens, contexts, samples: int | None, windows) -> StepShape:
    """:class:`StepShape` of rows (n_i, c_i); ``samples`` None: every row samples."""
    new_tokens, contexts = list(new_tokens), list(contexts)
    if len(new_tokens) != len(contexts):
        raise ValueError(f"new_tokens and contexts must be equal-length sequences, got "
                         f"{len(new_tokens)} and {len(contexts)}")
    rows = list(zip(new_tokens, contexts))
    decode = [c for n, c in rows if n == 1]
    prefill = [] if len(decode) == len(rows) else [(n, c) for n, c in rows if n != 1]
    return shape_of(decode, prefill, len(rows) if samples is None else samples, windows)


def shape_of(decode_contexts: list, prefill_rows: list, samples: int,
             windows) -> StepShape:
    """:class:`StepShape` of a step split into its decode rows' contexts (n_i = 1) and its
    other rows' (n_i, c_i) — plain Python sums: a step's hundreds of decode rows cost a
    few microseconds (a decode row's pairs and keys read are both min(c_i, w))."""
    if decode_contexts and min(decode_contexts) < 1:
        raise ValueError(f"a decode row's context must be >= 1, got {min(decode_contexts)}")
    for n, c in prefill_rows:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or c < n:
            raise ValueError(f"row (new_tokens={n!r}, context={c!r}): allowed new_tokens >= 1 "
                             f"and context >= new_tokens")
    rows = len(decode_contexts) + len(prefill_rows)
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) \
            or not 0 <= samples <= rows:
        raise ValueError(f"samples={samples!r}: allowed an integer from 0 to the {rows} rows")
    pairs, read = {}, {}
    for w in windows:
        if w is None:
            rd = sum(decode_contexts)
            rp = sum(c for _, c in prefill_rows)
            pp = sum(_pairs(n, c, None) for n, c in prefill_rows)
        else:
            rd = sum(c if c < w else w for c in decode_contexts)
            rp = sum(min(c, w) for _, c in prefill_rows)
            pp = sum(_pairs(n, c, w) for n, c in prefill_rows)
        pairs[w] = (pp, rd)
        read[w] = (rp, rd)
    tokens = len(decode_contexts) + sum(n for n, _ in prefill_rows)
    return StepShape(int(tokens), int(samples), rows, len(decode_contexts), pairs, read,
                     int(sum(c - n for n, c in prefill_rows)))


def _pairs(n: int, c: int, window: int | None) -> int:
    """K(c) − K(c − n) of one row (:func:`attention_pairs`)."""
    def k(x):
        if window is None or x <= window:
            return x * (x + 1) // 2
        return window * (window + 1) // 2 + (x - window) * window
    return int(k(c) - k(c - n))


def layer_matrix_params(layer: Layer, hidden: int, tp: int) -> float:
    """W_l: the matrix parameters of a layer on one GPU that every step reads whole (the
    routed experts aside; module docstring)."""
    h, att, mlp = hidden, layer.attention, layer.mlp
    if isinstance(att, LatentAttention):
        heads = att.heads / tp
        q = (h * att.q_lora_rank + att.q_lora_rank * heads * att.qk_head_dim
             if att.q_lora_rank else h * heads * att.qk_head_dim)
        w = (q + h * (att.kv_lora_rank + att.qk_rope_head_dim)
             + att.kv_lora_rank * heads * (att.qk_nope_head_dim + att.v_head_dim)
             + heads * att.v_head_dim * h)
    else:
        q = att.q_width / tp
        w = h * (q + 2 * kv_heads_per_rank(att, tp) * att.head_dim) + q * h
    if isinstance(mlp, MoE):
        w += h * mlp.experts + mlp.expert.kind.matrices * h * mlp.shared_experts \
            * (mlp.shared_width or 0) / tp
    else:
        w += mlp.kind.matrices * h * mlp.width / tp
    return w


def _kv_bytes_per_token(att, tp: int, kv_bytes: int) -> int:
    if isinstance(att, LatentAttention):
        return (att.kv_lora_rank + att.qk_rope_head_dim) * kv_bytes
    return 2 * kv_heads_per_rank(att, tp) * att.head_dim * kv_bytes


@dataclass(frozen=True)
class StepFloor:
    """A step's floors on its binding ``stage``: ``bytes_s`` (its bytes over datasheet HBM
    bandwidth), ``flops_s`` (its FLOPs over datasheet peak), ``floor_s`` the larger;
    ``bytes`` and ``flops`` of that stage."""

    bytes_s: float
    flops_s: float
    stage: int
    bytes: float
    flops: float

    @property
    def floor_s(self) -> float:
        return max(self.bytes_s, self.flops_s)

    @property
    def bound(self) -> str:
        """"memory" or "compute": which floor binds."""
        return "memory" if self.bytes_s >= self.flops_s else "compute"


@dataclass(frozen=True)
class _StageWork:
    """Per stage, what a step's bytes and FLOPs are made of (constants of the layout)."""

    matrix_params: float                 # Σ W_l
    moe: tuple                           # ((experts, top_k, P_e/t per GPU, layers), ...)
    attention: tuple                     # ((window, prefill coef, decode coef, kv B/token,
    #                                        context up-projection coef, layers), ...)
    head_params: float                   # V·h/t on the last stage, else 0


@dataclass(frozen=True)
class FloorModel:
    """The floors of one layout (``spec`` on ``hardware``, tp, pp, ep, ``dtype``'s peak,
    weights of ``weight_bytes_per_param``, KV of ``kv_bytes_per_element``): the per-stage
    constants computed once, :meth:`floor` per step."""

    spec: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "bf16"
    weight_bytes_per_param: float = 2
    kv_bytes_per_element: int = 2
    expert_weight_bytes_per_param: float | None = None
    windows: tuple = field(init=False, repr=False)
    _stages: tuple = field(init=False, repr=False, compare=False)
    _bw: float = field(init=False, repr=False, compare=False)
    _peak: float = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        spec, tp, pp = self.spec, self.tp, self.pp
        check_layout(spec, tp, pp, self.ep)
        if not isinstance(self.hardware, HardwareSpec):
            raise TypeError(f"hardware must be a HardwareSpec, got {self.hardware!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.expert_weight_bytes_per_param is None:
            object.__setattr__(self, "expert_weight_bytes_per_param",
                               self.weight_bytes_per_param)
        for name in ("weight_bytes_per_param", "kv_bytes_per_element",
                     "expert_weight_bytes_per_param"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r}: allowed a number of bytes > 0")
        h, b_kv = spec.hidden, self.kv_bytes_per_element
        stages = []
        for k, layers in enumerate(vllm_stage_layers(spec.num_layers, pp)):
            counts = Counter(spec.layers[i] for i in layers)
            moe, attention = Counter(), Counter()
            for x, n in counts.items():
                if isinstance(x.mlp, MoE):
                    m = x.mlp
                    moe[(m.experts, m.top_k,
                         m.expert.kind.matrices * h * m.expert.width / tp)] += n
                attention[_attention_key(x.attention, tp, b_kv)] += n
            stages.append(_StageWork(
                sum(n * layer_matrix_params(x, h, tp) for x, n in counts.items()),
                tuple((*key, n) for key, n in moe.items()),
                tuple((*key, n) for key, n in attention.items()),
                spec.vocab * h / tp if k == pp - 1 else 0.0))
        windows = {a[0] for s in stages for a in s.attention}
        object.__setattr__(self, "windows", tuple(sorted(windows, key=_window_order)))
        object.__setattr__(self, "_stages", tuple(stages))
        object.__setattr__(self, "_bw", self.hardware.device.hbm_bandwidth_gbps * _BYTES_PER_GB)
        object.__setattr__(self, "_peak", self.hardware.device.peak_flops(self.dtype))

    def shape(self, new_tokens, contexts, samples: int | None = None) -> StepShape:
        """The :class:`StepShape` of rows (n_i, c_i) under this model's windows."""
        return step_shape(new_tokens, contexts, samples, self.windows)

    def stage_work(self, shape: StepShape) -> list[tuple[float, float]]:
        """(bytes, FLOPs) of one GPU of each stage for a step of ``shape`` (module
        docstring)."""
        t, b_w = shape.tokens, self.weight_bytes_per_param
        out = []
        for st in self._stages:
            nbytes = st.matrix_params * b_w
            flops = 2.0 * t * st.matrix_params
            for experts, top_k, per_expert, n in st.moe:
                touched = expected_experts(experts, top_k, t)
                nbytes += n * touched * per_expert * self.expert_weight_bytes_per_param
                flops += n * 2.0 * t * top_k * per_expert
            for window, pre, dec, kv_tok, up, n in st.attention:
                (pp_, pd), (rp, rd) = shape.pairs[window], shape.read[window]
                nbytes += n * (rp + rd) * kv_tok
                flops += n * 2.0 * (pre * pp_ + dec * pd + up * shape.prefill_context)
            if shape.samples and st.head_params:
                nbytes += st.head_params * b_w
                flops += 2.0 * shape.samples * st.head_params
            out.append((float(nbytes), float(flops)))
        return out

    def floor(self, shape: StepShape) -> StepFloor:
        """The step's floor: the binding stage's max(bytes / bandwidth, FLOPs / peak)."""
        best = None
        for k, (nbytes, flops) in enumerate(self.stage_work(shape)):
            f = StepFloor(nbytes / self._bw, flops / self._peak, k, nbytes, flops)
            if best is None or f.floor_s > best.floor_s:
                best = f
        return best

    def floor_s(self, shape: StepShape) -> float:
        """``floor(shape).floor_s`` as a plain float (what a run's thousands of steps need):
        max over stages of max(bytes / bandwidth, FLOPs / peak)."""
        bw, peak = self._bw, self._peak
        return max(b / bw if b / bw > f / peak else f / peak
                   for b, f in self.stage_work(shape))


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of ``experts`` that ``tokens`` tokens reach, each choosing
    ``top_k`` at random: E·(1 − (1 − k/E)^T) (expm1/log1p: exact for small k/E)."""
    if top_k >= experts:
        return float(experts) if tokens else 0.0
    return -experts * math.expm1(tokens * math.log1p(-top_k / experts))


def _attention_key(att, tp: int, kv_bytes: int) -> tuple:
    """(window, FLOPs per prefill pair / 2, FLOPs per decode pair / 2, KV bytes per token,
    FLOPs per up-projected context token / 2) of one layer's attention on one GPU."""
    if isinstance(att, LatentAttention):
        heads = att.heads / tp
        return (None, heads * (att.qk_head_dim + att.v_head_dim),
                heads * (2 * att.kv_lora_rank + att.qk_rope_head_dim),
                _kv_bytes_per_token(att, tp, kv_bytes),
                att.kv_lora_rank * heads * (att.qk_nope_head_dim + att.v_head_dim))
    coef = att.heads / tp * 2 * att.head_dim
    return (att.window, coef, coef, _kv_bytes_per_token(att, tp, kv_bytes), 0.0)


def _window_order(w):
    return -1 if w is None else w


def step_floor(spec: ModelSpec, hardware: HardwareSpec, *, tp: int = 1, pp: int = 1,
               ep: int = 1, new_tokens, contexts, samples: int | None = None,
               dtype: str = "bf16", weight_bytes_per_param: float = 2,
               kv_bytes_per_element: int = 2) -> StepFloor:
    """The floor of one step of rows (``new_tokens``, ``contexts``), ``samples`` of which
    sample (None: all)."""
    model = FloorModel(spec, hardware, tp, pp, ep, dtype, weight_bytes_per_param,
                       kv_bytes_per_element)
    return model.floor(model.shape(new_tokens, contexts, samples))


def decode_floor_s(spec: ModelSpec, hardware: HardwareSpec, *, tp: int = 1, pp: int = 1,
                   contexts, ep: int = 1, weight_bytes_per_param: float = 2,
                   kv_bytes_per_element: int = 2) -> float:
    """The bandwidth floor of a decode step: one new token for each sequence of
    ``contexts`` keys, each sampling — the binding stage's weights read (touched experts
    only) plus its KV read, over datasheet HBM bandwidth."""
    model = FloorModel(spec, hardware, tp, pp, ep, "bf16", weight_bytes_per_param,
                       kv_bytes_per_element)
    contexts = np.asarray(contexts, dtype=np.int64)
    return max(b for b, _ in model.stage_work(model.shape(np.ones_like(contexts), contexts))) \
        / model._bw


def prefill_floor_s(spec: ModelSpec, hardware: HardwareSpec, *, tp: int = 1, pp: int = 1,
                    new_tokens, contexts, ep: int = 1, dtype: str = "bf16") -> float:
    """The compute floor of a prefill step: the binding stage's FLOPs (products, attention,
    the head for one sampled row per sequence) over datasheet peak of ``dtype``."""
    model = FloorModel(spec, hardware, tp, pp, ep, dtype)
    return max(f for _, f in model.stage_work(model.shape(new_tokens, contexts))) \
        / model._peak
