"""How ``vcluster bench predict`` combines its rounds (:mod:`vcluster.cli.bench_predict`):
each round against the calibrations around it, and how sure the median of the rounds is."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["paired_ratios", "median_interval", "interval_fields", "round_drift"]


def paired_ratios(predicted: list, by_round: list) -> list:
    """Each round's predicted over measured time, against the calibrations around it.

    ``predicted[j]``: the prediction from calibration ``j`` — one calibration for every
    round (a given spec), or one before the first round and one after each round;
    ``by_round[r]``: round ``r``'s run times. Round ``r``'s ratio is the mean of the
    predictions from the calibrations just before and just after it, over the median of
    its runs."""
    rounds = len(by_round)
    if len(predicted) not in (1, rounds + 1) or rounds < 1 or not all(by_round):
        raise ValueError(f"paired_ratios: {len(predicted)} predictions for {rounds} rounds "
                         "(need 1, or one more than the rounds) and runs in every round")
    out = []
    for r, got in enumerate(by_round):
        around = predicted[:1] if len(predicted) == 1 else predicted[r:r + 2]
        out.append(float(np.mean(around)) / float(np.median(got)))
    return out


def median_interval(values, level: float = 0.9) -> tuple[float, float, float]:
    """(lo, hi, coverage): order statistics ``x(k) <= x(n + 1 - k)`` of ``values`` that
    enclose their population's median with probability ``coverage = 1 - 2 P(B < k)``,
    ``B ~ Binomial(n, 1/2)`` (the count of draws below the median), ``k`` the largest
    with ``coverage >= level``, or 1 (the extremes) when even they fall short."""
    x = sorted(float(v) for v in values)
    n = len(x)
    if not n:
        raise ValueError("median_interval: no values")
    if not 0 < level < 1:
        raise ValueError(f"median_interval: level must be in (0, 1), got {level!r}")

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return x[k - 1], x[n - k], coverage(k)


def interval_fields(ratios: list) -> dict:
    """The JSON keys ``ratio_interval`` and ``ratio_interval_level`` of ``ratios``."""
    lo, hi, level = median_interval(ratios)
    return {"ratio_interval": [lo, hi], "ratio_interval_level": level}


def round_drift(round_ratios: list) -> tuple[list, list]:
    """What moved every point of a round together, and each point without it.

    ``round_ratios[i][r]``: point ``i``'s ratio in round ``r`` (every point has the same
    rounds). Returns ``(m, rel)``: ``m[r]``, the median over the points of round ``r``'s
    ratios, and ``rel[i] = median_r(round_ratios[i][r] / m[r])``. A machine whose speed
    drifts between a calibration and the round after it scales every point of that round
    alike, so ``m`` shows the drift and ``rel`` the model's error on one program relative
    to the others (the model's errors common to all points move ``m`` too).
    """
    rounds = {len(row) for row in round_ratios}
    x = np.asarray(round_ratios, dtype=float) if len(rounds) == 1 else np.empty(0)
    if x.ndim != 2 or x.size == 0 or not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError(f"round_drift: need one row of positive ratios per point, the same "
                         f"rounds in each; got {round_ratios!r}")
    m = np.median(x, axis=0)
    return [float(v) for v in m], [float(v) for v in np.median(x / m, axis=1)]
