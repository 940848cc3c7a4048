"""The closed choices of a scenario, as enums: schedule, mode, engine, recompute,
collective algorithm, array module, data-parallel mode.

Each is a ``str`` enum (``class Mode(Choice)``, ``Choice(str, Enum)``): a member *is* its
text, so ``point.run.mode != "simulate"``, dict lookups, ``json.dumps`` and the algorithm
functions that take names (``make_schedule(schedule, ...)``) keep working, while ``str``
and f-strings give the plain value (``f"{Mode.BOTH}" == "both"``). The JSON Schema's
``enum`` lists are made from these (:mod:`.schema`), so the file format, the docs and the
typed model name the same values. :func:`parse_choice` turns text into a member, or a
:class:`~vcluster.scenario.errors.ScenarioError` naming the key path, the value and the
allowed values (the parser's schema check reports a bad file value the same way first).
"""

from __future__ import annotations

from modeling.choices import Choice, Recompute, ScheduleName

from .errors import ScenarioError

__all__ = ["Choice", "ScheduleName", "Mode", "Engine", "Recompute", "Algorithm",
           "ArrayModule", "DataParallelMode", "parse_choice"]


class Mode(Choice):
    """``run.mode`` (and ``vcluster run --mode``)."""

    EMULATE = "emulate"
    SIMULATE = "simulate"
    BOTH = "both"


class Engine(Choice):
    """``vcluster run --engine``: what emulates (:mod:`vcluster.scenario.engines`)."""

    EMULATOR = "emulator"
    TORCH = "torch"


class Algorithm(Choice):
    """``parallel.algorithm`` of a collective (``auto``: the emulator's choice)."""

    AUTO = "auto"
    SHM = "shm"
    RING = "ring"
    TREE = "tree"
    PAIRWISE = "pairwise"


class ArrayModule(Choice):
    """``cluster.array_module``: the devices' array module."""

    NUMPY = "numpy"
    CUPY = "cupy"
    STRICT = "strict"     # numpy math under CuPy's rules (vcluster.runtime.strict)


class DataParallelMode(Choice):
    """``data_parallel.mode``: how the replicas of a training workload combine their
    gradients."""

    DDP = "ddp"        # all-reduce (or bucketed all-reduce) of the gradients over dp
    ZERO = "zero"      # ZeRO-1/2/3: optimizer state (+ gradients, + parameters) sharded
    PS = "ps"          # parameter server: servers hold the parameters, workers push grads


def parse_choice(kind: type[Choice], value, path: str, reason: str = "unknown value"):
    """``kind(value)``, or :class:`ScenarioError` at ``path`` listing ``kind.values()``."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        raise ScenarioError(path, value, ", ".join(kind.values()), reason) from None
