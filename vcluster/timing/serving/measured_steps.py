"""A transformer layer's serving step priced from measured steps of that layer
(``vcluster bench gpu-decode``: ``decode_layer`` and ``prefill_layer`` rows of a device's
``kernels``), in the forms of DistServe's simulator (Zhong et al., OSDI'24;
``simdistserve/estimators/time_estimator.py``, which fits them per model and tp to
profiled whole steps):

    decode:   t_d = a_d + b_d·B + c_d·ΣC        B sequences of one new token, ΣC the keys
                                                they read (each one's context)
    prefill:  t_p = a_p + b_p·T + c_p·T²        one causal prompt of T tokens

seconds per layer on one GPU of the tp group (a ``decode_layer`` row BxC is B sequences of
context C: ΣC = B·C). DistServe sums Σt_i and Σt_i² over a batch of prompts; a chunk of n
new tokens after c − n earlier ones (chunked prefill) has P = K(c) − K(c − n) (query, key)
pairs (:func:`~.floors.attention_pairs`, K(x) = x(x + 1)/2), and its T² generalises as
2P − n (= n² for a fresh prompt, c = n), so a step's prefill rows cost

    t_p = a_p + b_p·Σn_i + c_p·Σ(2P_i − n_i).

A mixed step (decode rows beside prefill rows) is the sum of the two parts less one shared
fixed part, t_d + t_p − min(a_d, a_p): the fixed part is what a step pays at any size (the
layer's weights read once, its kernels' fixed costs), and one step pays it once; the
larger of the two stays as that step's.

Fit: each form's (a, b, c) by least squares on the relative error, minimise
Σ (â/t_i + b̂·x_i/t_i + ĉ·y_i/t_i − 1)² (house style: ``kernel_profile.fit_call_and_rate``;
small and large steps weigh alike) over non-negative coefficients (a time has no negative
part): the unconstrained solution when it is non-negative, else the best of the solutions
on each subset of the three (an exact non-negative least squares for three unknowns).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from modeling.spec import MLP, Attention, Layer

from ..kernel_profile import LAYER_STEP_KINDS, KernelTiming, LayerShape

__all__ = ["StepFit", "MeasuredLayerSteps", "fit_nonnegative_relative",
           "measured_layer_steps", "layer_shape"]


@dataclass(frozen=True)
class StepFit:
    """``t = a_s + b_s·x + c_s·y`` seconds, fitted to ``rows`` measured steps, the largest
    |t̂/t − 1| over them ``max_error`` (decode: x = sequences, y = Σ context; prefill:
    x = tokens, y = Σ(2P_i − n_i), T² for one prompt)."""

    a_s: float
    b_s: float
    c_s: float
    rows: int
    max_error: float

    def time_s(self, x: float, y: float) -> float:
        return self.a_s + self.b_s * x + self.c_s * y


def fit_nonnegative_relative(features, seconds, who: str) -> tuple[np.ndarray, float]:
    """``(θ, max error)``: θ ≥ 0 minimising Σ_i (x_i·θ / t_i − 1)² over rows x_i of
    ``features`` with measured ``seconds`` t_i (module docstring), and max_i |x_i·θ/t_i − 1|.
    ValueError naming ``who`` when the rows cannot tell the coefficients apart."""
    x = np.asarray(features, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.ndim != 2 or len(x) != len(t) or not np.all(t > 0):
        raise ValueError(f"{who}: expected rows of features with one positive time each, got "
                         f"{x.shape} features and {t.shape} times")
    a = x / t[:, None]
    k = x.shape[1]
    if len(x) < k or np.linalg.matrix_rank(a) < k:
        raise ValueError(f"{who}: {len(x)} rows do not tell the {k} coefficients apart "
                         f"(measure more sizes)")
    best, best_r = None, np.inf
    for size in range(k, 0, -1):              # the full set first: it wins ties
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            sol = np.linalg.lstsq(a[:, cols], np.ones(len(t)), rcond=None)[0]
            if np.any(sol < 0):
                continue
            theta = np.zeros(k)
            theta[cols] = sol
            r = float(np.sum((a @ theta - 1.0) ** 2))
            if r < best_r * (1 - 1e-12):
                best, best_r = theta, r
    return best, float(np.max(np.abs(a @ best - 1.0)))


@dataclass(frozen=True)
class MeasuredLayerSteps:
    """One layer's measured steps in ``dtype`` fitted to the module docstring's forms:
    ``decode`` (x = sequences, y = Σ context) and ``prefill`` (x = tokens, y = Σ(2P − n))."""

    layer: LayerShape
    dtype: str
    decode: StepFit
    prefill: StepFit

    def step_s(self, decode_seqs: int, decode_context: int, prefill_tokens: int,
               prefill_square: int) -> float:
        """Seconds of one layer for a step of ``decode_seqs`` decode rows reading
        ``decode_context`` keys in all and ``prefill_tokens`` other new tokens of
        Σ(2P_i − n_i) = ``prefill_square``: t_d + t_p − min(a_d, a_p) when both are
        present (module docstring)."""
        out = 0.0
        if decode_seqs:
            out += self.decode.time_s(decode_seqs, decode_context)
        if prefill_tokens:
            out += self.prefill.time_s(prefill_tokens, prefill_square)
        if decode_seqs and prefill_tokens:
            out -= min(self.decode.a_s, self.prefill.a_s)
        return out

    def __repr__(self) -> str:
        d, p, us = self.decode, self.prefill, 1e6
        return (f"MeasuredLayerSteps({self.layer}, {self.dtype}: decode {d.a_s * us:.2f} us "
                f"+ {d.b_s * us:.3f} us/seq + {d.c_s * 1e9:.4f} ns/context token ({d.rows} "
                f"rows, max error {d.max_error:.1%}); prefill {p.a_s * us:.2f} us + "
                f"{p.b_s * us:.4f} us/token + {p.c_s * 1e12:.4f} ps/token^2 ({p.rows} rows, "
                f"max error {p.max_error:.1%}))")


def measured_layer_steps(kernels) -> tuple[dict, dict]:
    """``(fits, unfit)`` of a device's measured ``kernels``: ``fits`` maps (LayerShape,
    dtype) to the :class:`MeasuredLayerSteps` of its ``decode_layer`` and ``prefill_layer``
    rows; ``unfit`` maps the keys whose rows cannot be fitted (too few sizes, or one kind
    missing) to why. Other kinds of rows are not read."""
    groups: dict = {}
    for row in kernels:
        row = KernelTiming.coerce(row, "kernels")
        if row.kind in LAYER_STEP_KINDS:
            key = (LayerShape.parse(row.layer), row.dtype)
            dims = tuple(int(x) for x in row.dims.split("x"))
            groups.setdefault(key, {"decode_layer": {}, "prefill_layer": {}})[row.kind][dims] = \
                row.seconds
    fits, unfit = {}, {}
    for key, by_kind in groups.items():
        decode = [((1.0, b, b * c), t) for (b, c), t in by_kind["decode_layer"].items()]
        prefill = [((1.0, n, n * n), t) for (n,), t in by_kind["prefill_layer"].items()]
        try:
            fit = []
            for name, points in (("decode_layer", decode), ("prefill_layer", prefill)):
                if not points:
                    raise ValueError(f"no {name} rows of {key[0]} ({key[1]})")
                theta, err = fit_nonnegative_relative([p for p, _ in points],
                                                      [t for _, t in points],
                                                      f"{name} rows of {key[0]} ({key[1]})")
                fit.append(StepFit(*(float(v) for v in theta), len(points), err))
        except ValueError as exc:
            unfit[key] = str(exc)
            continue
        fits[key] = MeasuredLayerSteps(key[0], key[1], *fit)
    return fits, unfit


def layer_shape(layer: Layer, hidden: int, tp: int) -> LayerShape | None:
    """The :class:`LayerShape` of ``layer`` (of a model of width ``hidden``) on one GPU of
    ``tp``, or None where a measured layer step cannot be one: latent attention, a sliding
    window, attention sinks, an MoE MLP (``vcluster bench gpu-decode`` measures none of
    them)."""
    att, mlp = layer.attention, layer.mlp
    if not isinstance(att, Attention) or att.window is not None or att.sinks \
            or not isinstance(mlp, MLP):
        return None
    return LayerShape(hidden, att.heads, att.kv_heads, att.head_dim, mlp.kind.value,
                      mlp.width, tp)
