"""Goodput of a long training run under failures: closed form and SimPy Monte Carlo.

The model (Young 1974; Daly 2006, "A higher order estimate of the optimum checkpoint
interval for restart dumps"):

* a fault-free training step takes ``t`` (``step_time_s``); a checkpoint every ``K`` steps
  blocks training for ``C`` (``checkpoint_s``); a *segment* is K steps plus its
  checkpoint, ``T = K t + C``;
* the job fails as a Poisson process of rate ``1/M`` (``M = mtbf_s``, the MTBF of the
  whole job: a device MTBF divided by the number of devices); a failure during a segment
  loses the segment's work so far, then a restart takes ``R`` (``restart_s``: replace the
  process, reload the checkpoint) during which no failure strikes, and the segment starts
  again.

The number of failed attempts of a segment is geometric with success probability
``e^{-T/M}``: on average ``e^{T/M} - 1`` failures, each costing the time lost before it
(``E[x | x < T] = M - T e^{-T/M} / (1 - e^{-T/M})``) plus ``R``. Summing, the expected
time to complete a segment is exactly

    E[segment] = (M + R) (e^{T/M} - 1)

and the goodput (useful fraction of wall time) is ``K t / E[segment]``. For ``T << M``,
``E ~ T + (T^2/2 + R T) / M``: the checkpoint cost ``C / T`` is paid always, the lost work
``T / 2M`` and restarts ``R / M`` per unit time. Young's optimum interval is
``sqrt(2 C M)``; Daly's higher-order one ``sqrt(2 C M) (1 + sqrt(C/2M)/3 + C/18M) - C``
(for ``C < 2M``).

:func:`simulate_goodput` runs that process as a SimPy simulation (a training process and a
failure process that interrupts it) and is checked against the closed form in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FailureModel", "expected_segment_s", "segment_cv", "expected_goodput",
           "expected_run_s", "young_interval_s", "daly_interval_s", "GoodputRun",
           "simulate_goodput"]


def _positive(value, name: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"FailureModel.{name}: must be a number, got {value!r}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not ok or math.isnan(value):
        raise ValueError(f"FailureModel.{name}: must be {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class FailureModel:
    """A long run's failure and checkpoint costs (all times in seconds)."""

    step_time_s: float          # t: one fault-free training step
    checkpoint_every: int       # K: steps between checkpoints
    checkpoint_s: float         # C: a checkpoint blocks training this long
    restart_s: float            # R: detect the loss, replace the process, reload
    mtbf_s: float               # M: mean time between failures of the whole job

    def __post_init__(self):
        k = self.checkpoint_every
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"FailureModel.checkpoint_every: must be an int >= 1, got {k!r}")
        object.__setattr__(self, "checkpoint_every", int(k))
        object.__setattr__(self, "step_time_s", _positive(self.step_time_s, "step_time_s"))
        object.__setattr__(self, "checkpoint_s", _positive(self.checkpoint_s, "checkpoint_s", True))
        object.__setattr__(self, "restart_s", _positive(self.restart_s, "restart_s", True))
        object.__setattr__(self, "mtbf_s", _positive(self.mtbf_s, "mtbf_s"))

    @property
    def segment_s(self) -> float:
        """T = K t + C: one segment without failures."""
        return self.checkpoint_every * self.step_time_s + self.checkpoint_s

    @property
    def work_s(self) -> float:
        """K t: the useful work of one segment."""
        return self.checkpoint_every * self.step_time_s


def expected_segment_s(m: FailureModel) -> float:
    """E[time to complete one segment] = (M + R)(e^{T/M} - 1)."""
    return (m.mtbf_s + m.restart_s) * math.expm1(m.segment_s / m.mtbf_s)


def segment_cv(m: FailureModel) -> float:
    """Coefficient of variation (std / mean) of the time to complete one segment.

    The segment time is ``S = T + sum_{i=1}^{N} (x_i + R)`` with ``N`` failed attempts,
    geometric with success probability ``p = e^{-T/M}`` (``E[N] = q/p``, ``Var N = q/p^2``,
    ``q = 1 - p``), and ``x_i`` the work lost, exponential of mean ``M`` truncated to
    ``[0, T)``: ``E[x] = M - T p/q``, ``E[x^2] = 2M^2 - (T^2 + 2MT) p/q``. With
    ``Y = x + R``, ``Var S = E[N] Var Y + Var N E[Y]^2`` (a random sum of i.i.d. terms).

    A Monte Carlo of ``n`` segments estimates the goodput with relative standard error
    ``segment_cv / sqrt(n)``, which :func:`vcluster.timing.faults.impact.goodput_table` uses to
    size its runs. The CV is 0 without failures and tends to 1 when ``T >> M``.
    """
    t, mtbf, r = m.segment_s, m.mtbf_s, m.restart_s
    q = -math.expm1(-t / mtbf)                       # P(an attempt fails)
    if q == 0.0:
        return 0.0
    p = 1.0 - q
    if p == 0.0:
        return 1.0                                   # the limit for T >> M
    mean_n, var_n = q / p, q / (p * p)
    mean_x = mtbf - t * p / q
    var_x = max(0.0, 2 * mtbf * mtbf - (t * t + 2 * mtbf * t) * p / q - mean_x * mean_x)
    mean_y = mean_x + r
    mean_s = t + mean_n * mean_y
    var_s = mean_n * var_x + var_n * mean_y * mean_y
    return math.sqrt(var_s) / mean_s


def expected_goodput(m: FailureModel) -> float:
    """Useful work per unit of wall time: K t / E[segment]."""
    return m.work_s / expected_segment_s(m)


def expected_run_s(m: FailureModel, steps: int) -> float:
    """Expected wall time of ``steps`` steps (a whole number of segments assumed)."""
    return steps / m.checkpoint_every * expected_segment_s(m)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between checkpoints: sqrt(2 C M)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (C < 2M): sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


@dataclass(frozen=True)
class GoodputRun:
    """One simulated run: wall time, useful work, failures, and the mean segment time
    with its standard error (for comparing with :func:`expected_segment_s`)."""

    wall_s: float
    useful_s: float
    lost_s: float
    restart_s: float
    checkpoint_s: float
    failures: int
    segments: int
    mean_segment_s: float
    stderr_segment_s: float

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s


def simulate_goodput(m: FailureModel, segments: int, seed: int = 0,
                     max_failures: int = 1_000_000) -> GoodputRun:
    """Run ``segments`` segments under Poisson failures in SimPy (see the module).

    The work grows with the failures, ``segments x (e^{T/M} - 1)`` on average; more than
    ``max_failures`` expected is refused (ValueError) rather than run for hours.
    """
    import simpy
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"simulate_goodput: segments must be an int >= 1, got {segments!r}")
    expected = segments * math.expm1(m.segment_s / m.mtbf_s)
    if expected > max_failures:
        raise ValueError(f"simulate_goodput: {segments} segments of T = {m.segment_s:g} s "
                         f"with MTBF {m.mtbf_s:g} s expect {expected:.3g} failures, more "
                         f"than max_failures={max_failures}; use fewer segments or the "
                         "closed form (expected_goodput)")
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    totals = {"lost": 0.0, "restart": 0.0, "failures": 0}
    durations: list[float] = []
    restarting = [False]

    def training():
        for _ in range(segments):
            begun = env.now
            while True:
                attempt = env.now
                try:
                    yield env.timeout(m.segment_s)
                    break
                except simpy.Interrupt:
                    totals["lost"] += env.now - attempt
                    totals["failures"] += 1
                    restarting[0] = True
                    yield env.timeout(m.restart_s)
                    totals["restart"] += m.restart_s
                    restarting[0] = False
            durations.append(env.now - begun)

    def failures(proc):
        while proc.is_alive:
            yield env.timeout(rng.exponential(m.mtbf_s))
            if proc.is_alive and not restarting[0]:
                proc.interrupt("device lost")

    proc = env.process(training())
    env.process(failures(proc))
    env.run(until=proc)
    d = np.asarray(durations)
    return GoodputRun(wall_s=env.now, useful_s=segments * m.work_s, lost_s=totals["lost"],
                      restart_s=totals["restart"], checkpoint_s=segments * m.checkpoint_s,
                      failures=totals["failures"], segments=segments,
                      mean_segment_s=float(d.mean()),
                      stderr_segment_s=float(d.std(ddof=1) / math.sqrt(len(d)))
                      if len(d) > 1 else 0.0)
