"""Fault specifications: what goes wrong, where and when (plain frozen values).

=============================================  ==============================================
spec                                           emulated (:mod:`vcluster.runtime.faults.delays`) /
                                               simulated (:mod:`vcluster.timing.faults.links`)
=============================================  ==============================================
``CrashFault(rank, at_step)``                  the device process is killed with SIGKILL at
                                               the start of training step ``at_step``
                                               (0-based) / the device is lost
``SlowFault(rank, slowdown)``                  every compute block of the device takes
                                               ``slowdown`` times as long (it sleeps
                                               ``(slowdown - 1)`` x the measured time) /
                                               a straggler (compute times x ``slowdown``)
``LinkFault(ranks, bandwidth_factor)``         transfers between the two ranks take
                                               ``1 / bandwidth_factor`` times as long /
                                               the link's bandwidth is scaled
``JitterFault(max_delay_s, p, seed)``          every device pauses a random time in
                                               [0, ``max_delay_s``) with probability ``p``
                                               before and after each send, receive,
                                               collective and compute block: the order in
                                               which the processes meet changes from run
                                               to run / nothing (it shakes out programs
                                               whose results depend on timing; it is not a
                                               property of hardware)
=============================================  ==============================================

:func:`parse_faults` reads the dict form of scenario files and of the Python API,
``[{"kind": "crash", "rank": 3, "at_step": 4}, {"kind": "slow", "rank": 5, "slowdown": 2.0},
{"kind": "link", "ranks": [0, 1], "bandwidth_factor": 0.5}, {"kind": "jitter",
"max_delay_s": 0.002}]``, and every error names the key path, the value and what is
allowed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["CrashFault", "SlowFault", "LinkFault", "JitterFault", "Fault", "FAULT_KINDS",
           "parse_fault", "parse_faults"]


def _rank(value, where: str, n_ranks: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: a rank must be an int, got {value!r}")
    value = int(value)
    if value < 0 or (n_ranks is not None and value >= n_ranks):
        allowed = "an int >= 0" if n_ranks is None else f"0..{n_ranks - 1}"
        raise ValueError(f"{where}: rank {value} is not in the cluster; allowed: {allowed}")
    return value


def _real(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{where}: must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CrashFault:
    """Rank ``rank`` dies (SIGKILL) at the start of training step ``at_step`` (0-based)."""

    rank: int
    at_step: int
    kind: ClassVar[str] = "crash"

    def __post_init__(self):
        object.__setattr__(self, "rank", _rank(self.rank, "CrashFault.rank", None))
        step = self.at_step
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"CrashFault.at_step: must be an int step >= 0, got {step!r}")
        object.__setattr__(self, "at_step", int(step))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "rank": self.rank, "at_step": self.at_step}


@dataclass(frozen=True)
class SlowFault:
    """Rank ``rank`` computes ``slowdown`` (>= 1) times slower than its peers."""

    rank: int
    slowdown: float
    kind: ClassVar[str] = "slow"

    def __post_init__(self):
        object.__setattr__(self, "rank", _rank(self.rank, "SlowFault.rank", None))
        s = _real(self.slowdown, "SlowFault.slowdown")
        if s < 1:
            raise ValueError(f"SlowFault.slowdown: must be >= 1 (1 = full speed), got {s!r}")
        object.__setattr__(self, "slowdown", s)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "rank": self.rank, "slowdown": self.slowdown}


@dataclass(frozen=True)
class LinkFault:
    """The link between the two ``ranks`` keeps ``bandwidth_factor`` (0 < f <= 1) of its
    bandwidth: a transfer between them takes 1/f times as long."""

    ranks: tuple[int, int]
    bandwidth_factor: float
    kind: ClassVar[str] = "link"

    def __post_init__(self):
        ranks = self.ranks
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__len__") or len(ranks) != 2:
            raise ValueError(f"LinkFault.ranks: must be a pair of ranks, got {ranks!r}")
        a, b = (_rank(r, "LinkFault.ranks", None) for r in ranks)
        if a == b:
            raise ValueError(f"LinkFault.ranks: a link joins two different ranks, got {ranks!r}")
        object.__setattr__(self, "ranks", (min(a, b), max(a, b)))
        f = _real(self.bandwidth_factor, "LinkFault.bandwidth_factor")
        if not 0 < f <= 1:
            raise ValueError(f"LinkFault.bandwidth_factor: must be in (0, 1] (the fraction of "
                             f"bandwidth left), got {f!r}")
        object.__setattr__(self, "bandwidth_factor", f)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": list(self.ranks),
                "bandwidth_factor": self.bandwidth_factor}


@dataclass(frozen=True)
class JitterFault:
    """Every device pauses a random time before and after each of its sends, receives,
    collectives and compute blocks: with ``probability`` (0 < p <= 1) a pause drawn
    uniformly from [0, ``max_delay_s``) (0 < d <= 1 s), else none. Each device draws from
    its own stream, seeded by (``seed``, its rank).

    A stress mode, not a hardware property: it changes the order in which the device
    processes reach each other from run to run — far more than a busy machine does — so a
    program whose numbers depend on that order (a race, a message matched by timing,
    state left over from an earlier run) shows it. A correct program gives bit-identical
    results under any jitter; its timings under jitter mean nothing."""

    max_delay_s: float
    probability: float = 0.25
    seed: int = 0
    kind: ClassVar[str] = "jitter"

    def __post_init__(self):
        d = _real(self.max_delay_s, "JitterFault.max_delay_s")
        if not 0 < d <= 1:
            raise ValueError(f"JitterFault.max_delay_s: must be in (0, 1] seconds, got {d!r}")
        p = _real(self.probability, "JitterFault.probability")
        if not 0 < p <= 1:
            raise ValueError(f"JitterFault.probability: must be in (0, 1] (the share of "
                             f"pause points that pause), got {p!r}")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"JitterFault.seed: must be an int >= 0, got {seed!r}")
        object.__setattr__(self, "max_delay_s", d)
        object.__setattr__(self, "probability", p)
        object.__setattr__(self, "seed", int(seed))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "max_delay_s": self.max_delay_s,
                "probability": self.probability, "seed": self.seed}


Fault = CrashFault | SlowFault | LinkFault | JitterFault
_CLASSES = {cls.kind: cls for cls in (CrashFault, SlowFault, LinkFault, JitterFault)}
FAULT_KINDS: tuple[str, ...] = tuple(_CLASSES)
_FIELDS = {"crash": ("rank", "at_step"), "slow": ("rank", "slowdown"),
           "link": ("ranks", "bandwidth_factor"), "jitter": ("max_delay_s",)}
_OPTIONAL = {"jitter": ("probability", "seed")}       # keys with a default


def parse_fault(spec, where: str = "fault", n_ranks: int | None = None) -> Fault:
    """One fault from its dict form (or a fault object, returned as is after checks)."""
    if isinstance(spec, tuple(_CLASSES.values())):
        fault = spec
    else:
        if not isinstance(spec, dict):
            raise TypeError(f"{where}: a fault is a mapping with a 'kind' key, got {spec!r}")
        if "kind" not in spec:
            raise ValueError(f"{where}.kind: missing; allowed: {', '.join(FAULT_KINDS)}")
        kind = spec["kind"]
        if kind not in _CLASSES:
            raise ValueError(f"{where}.kind: {kind!r} is not a fault kind; allowed: "
                             f"{', '.join(FAULT_KINDS)}")
        fields, optional = _FIELDS[kind], _OPTIONAL.get(kind, ())
        unknown = sorted(set(spec) - {"kind", *fields, *optional}, key=str)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key for a {kind} fault; allowed "
                             f"keys: kind, {', '.join(fields + optional)}")
        missing = [f for f in fields if f not in spec]
        if missing:
            raise ValueError(f"{where}.{missing[0]}: missing for a {kind} fault (needs "
                             f"{', '.join(fields)})")
        try:
            fault = _CLASSES[kind](**{f: spec[f] for f in fields + optional if f in spec})
        except (TypeError, ValueError) as exc:
            field = str(exc).split(":")[0].split(".")[-1]
            raise type(exc)(f"{where}.{field}:{str(exc).split(':', 1)[1]}") from None
    if n_ranks is not None and not isinstance(fault, JitterFault):    # jitter: every rank
        ranks = fault.ranks if isinstance(fault, LinkFault) else (fault.rank,)
        key = "ranks" if isinstance(fault, LinkFault) else "rank"
        for r in ranks:
            _rank(r, f"{where}.{key}", n_ranks)
    return fault


def parse_faults(specs, where: str = "faults", n_ranks: int | None = None) -> tuple[Fault, ...]:
    """A tuple of faults from a list of dicts (``None`` or ``[]``: no faults).

    At most one crash per (rank, step) and one slowdown per rank; each link once; one
    jitter.
    """
    if specs is None:
        return ()
    if isinstance(specs, (dict, str, bytes)) or not hasattr(specs, "__iter__"):
        raise TypeError(f"{where}: must be a list of faults, got {specs!r}")
    out = tuple(parse_fault(s, f"{where}[{i}]", n_ranks) for i, s in enumerate(specs))
    seen: dict = {}
    for i, f in enumerate(out):
        key = (f.kind, f.ranks if isinstance(f, LinkFault) else getattr(f, "rank", None),
               getattr(f, "at_step", None))
        if key in seen:
            raise ValueError(f"{where}[{i}]: repeats {where}[{seen[key]}] ({f!r}); give each "
                             "fault once")
        seen[key] = i
    return out
