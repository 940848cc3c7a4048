"""Schedule generators: GPipe, 1F1B, interleaved 1F1B and ZB-H1, and a registry by name.

Each returns a :class:`Schedule`: per rank ``r``, the ordered actions it runs.
``p`` = ranks, ``m`` = micro-batches, ``v`` = virtual stages (chunks) per rank.

* **GPipe** (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural
  Networks using Pipeline Parallelism"): all ``m`` forwards, then all ``m``
  backwards.  Bubble fraction ``(p-1)/(m+p-1)``; the first stage keeps all
  ``m`` micro-batches' activations alive.
* **1F1B** (PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient
  Pipeline-Parallel DNN Training"): rank ``r`` runs ``w_r = min(p-1-r, m)``
  warm-up forwards, then alternates one forward and one backward, then drains
  the ``w_r`` remaining backwards.  Same bubble as GPipe, but at most
  ``min(m, p)`` micro-batches in flight per rank.
* **Interleaved 1F1B** (Megatron-LM, Narayanan et al. SC21, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"):
  rank ``r`` holds ``v`` chunks (stages ``r, r+p, ...``).  Its ``k``-th
  forward (``k = 0 .. vm-1``) is on chunk ``(k // p) mod v`` with micro-batch
  ``(k // (p v)) p + k mod p``; its ``k``-th backward on chunk
  ``v-1 - (k // p) mod v`` with the same micro-batch formula.  Warm-up:
  ``min((v-1) p + 2 (p-1-r), v m)`` forwards, then 1F1B, then cool-down.
  Needs ``m`` to be a multiple of ``p`` (micro-batches run in rounds of
  ``p``).  Bubble time / ideal compute time ``(p-1)/(v m)``.
* **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with
  every ``B`` split into ``I`` (input gradient, on the critical path) and
  ``W`` (weight gradient, deferred).  Rank ``r`` runs ``min(p-1-r, m)``
  warm-up forwards, then ``F, I`` pairs; from its ``r``-th backward on, each
  ``I`` is followed by the oldest pending ``W``; the last ``r`` ``W``'s fill
  the cool-down bubbles.  At most ``min(m, p)`` micro-batches in flight per
  rank (like 1F1B); per-rank bubble ``(p-1)(T_F + T_I - T_W)`` for ``m >= p``
  and ``T_W <= min(T_F, T_I)``, instead of 1F1B's ``(p-1)(T_F + T_B)``.  (PyTorch's
  ``ScheduleInterleavedZeroBubble`` with one chunk per rank.)
* **Combined 1F1B** (Megatron-Core's ``--overlap-moe-expert-parallel-comm``,
  ``megatron/core/pipeline_parallel/combined_1f1b.py``; DeepSeek-V3's DualPipe-style
  overlap): the steady state's forward of one micro-batch and backward of another run
  together, layer by layer, so that one's MoE all-to-alls overlap the other's compute.
  Without pipelining (``p = 1``, ``combined_1f1b_schedule_for_no_pipelining``):
  ``F0, (F1 B0), (F2 B1), ..., (F(m-1) B(m-2)), B(m-1)``. With pipelining Megatron needs
  virtual stages (``transformer_config.py``: "virtual_pipeline_model_parallel_size must
  be specified when pipeline_model_parallel_size > 1") and runs the interleaved schedule
  with one more warm-up forward per rank (``schedules.py`` ``get_pp_rank_microbatches``:
  "we schedule one extra micro-batch forward step before the 1f1b stages ... to ensure
  the forward and backward computations are independent in all 1f1b steps"): warm-up
  ``min((v-1) p + 2 (p-1-r) + 1, v m)``. The pairs that run combined are the steady
  state's adjacent ``(F, B)`` (:func:`combined_pairs`); the action order itself is a
  plain schedule (a forward issued before the previous backward), which an executor runs
  one action after the other.
"""

from __future__ import annotations

from mesh.arguments import as_int
from modeling.choices import ScheduleName

from .actions import Action, ActionKind
from .schedule import Schedule, _generated

__all__ = ["SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble",
           "make_schedule", "combined_1f1b", "combined_pairs", "COMBINED_SCHEDULES"]

#: the schedules Megatron-Core's combined 1F1B (MoE expert-parallel overlap) runs with:
#: no pipelining (1f1b on one rank) or the interleaved schedule
COMBINED_SCHEDULES: tuple[str, ...] = (ScheduleName.ONE_F_ONE_B.value,
                                        ScheduleName.INTERLEAVED_1F1B.value)

#: The names :func:`make_schedule` accepts.
SCHEDULE_NAMES: tuple[str, ...] = ScheduleName.values()   # the one list: modeling.choices

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def _pm(name: str, ranks, microbatches) -> tuple[int, int]:
    return (as_int(ranks, f"{name}: ranks p", 1),
            as_int(microbatches, f"{name}: microbatches m", 1))


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """GPipe: rank ``r`` runs ``rF0 .. rF(m-1)`` then ``rB0 .. rB(m-1)``."""
    p, m = _pm("gpipe", ranks, microbatches)
    rows = [tuple(Action(r, _F, j) for j in range(m)) + tuple(Action(r, _B, j) for j in range(m))
            for r in range(p)]
    return _generated("gpipe", p, m, 1, rows)


def _one_f_one_b_rows(p: int, m: int) -> list[tuple[Action, ...]]:
    rows = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(r, _F, j) for j in range(warmup)]
        for i in range(m - warmup):
            row += [Action(r, _F, warmup + i), Action(r, _B, i)]
        row += [Action(r, _B, j) for j in range(m - warmup, m)]
        rows.append(tuple(row))
    return rows


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``min(p-1-r, m)`` warm-up forwards, then F/B pairs, then B's."""
    p, m = _pm("1f1b", ranks, microbatches)
    return _generated("1f1b", p, m, 1, _one_f_one_b_rows(p, m))


def _combined_warmup(p: int, r: int, m: int, v: int) -> int:
    """Rank ``r``'s warm-up forwards under :func:`combined_1f1b` (module docstring)."""
    return min(1 if p == 1 and v == 1 else (v - 1) * p + 2 * (p - 1 - r) + 1, v * m)


def combined_1f1b(ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Megatron-Core's combined 1F1B (module docstring): ``p = 1`` with ``v = 1`` (no
    pipelining: ``F0 F1 B0 F2 B1 ... B(m-1)``), or the interleaved schedule with ``v >= 2``
    and one more warm-up forward per rank (``m`` a multiple of ``p``). The pairs run
    combined are :func:`combined_pairs`'."""
    name = "combined_1f1b"
    p, m = _pm(name, ranks, microbatches)
    v = as_int(virtual_stages, f"{name}: virtual_stages v", 1)
    if p > 1 and v == 1:
        raise ValueError(f"{name}: with p={p} pipeline ranks Megatron-Core's combined 1F1B "
                         f"runs the interleaved schedule (virtual_stages v >= 2); got v=1")
    if v > 1 and m % p:
        raise ValueError(f"{name}: microbatches m={m} must be a multiple of ranks p={p} with "
                         f"virtual_stages v={v} >= 2 (micro-batches run in rounds of p)")
    total = v * m

    def act(r: int, k: int, kind: ActionKind) -> Action:
        c = (k // p) % v
        return Action((v - 1 - c if kind is not _F else c) * p + r, kind,
                      (k // (p * v)) * p + k % p)

    rows = []
    for r in range(p):
        warmup = _combined_warmup(p, r, m, v)
        row = [act(r, k, _F) for k in range(warmup)]
        for i in range(total - warmup):
            row += [act(r, warmup + i, _F), act(r, i, _B)]
        row += [act(r, k, _B) for k in range(total - warmup, total)]
        rows.append(tuple(row))
    return _generated(name, p, m, v, rows)


def combined_pairs(schedule: Schedule) -> tuple[frozenset, ...]:
    """Per rank, the indices ``i`` whose actions ``i`` (a forward) and ``i + 1`` (a
    backward of another micro-batch or stage) run combined: the steady state of a
    :func:`combined_1f1b` schedule (none in warm-up or cool-down, as Megatron-Core runs
    its warm-up and cool-down steps alone)."""
    if schedule.name != "combined_1f1b":
        raise ValueError(f"combined_pairs: {schedule.name!r} is not a combined_1f1b schedule")
    p, m, v = schedule.ranks, schedule.microbatches, schedule.virtual_stages
    out = []
    for r in range(p):
        w = _combined_warmup(p, r, m, v)
        pairs = frozenset(w + 2 * i for i in range(v * m - w))
        row = schedule.actions[r]
        for i in pairs:
            f, b = row[i], row[i + 1]
            if f.kind is not _F or b.kind is not _B or (f.stage, f.microbatch) == (
                    b.stage, b.microbatch):
                raise ValueError(f"combined_pairs: rank {r} actions {i}, {i + 1} ({f}, {b}) "
                                 "are not a forward and an independent backward")
        out.append(pairs)
    return tuple(out)


def interleaved_1f1b(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B with ``v = virtual_stages`` chunks per rank.

    Requires ``m mod p == 0`` when ``v >= 2``; ``v = 1`` is plain 1F1B (any ``m``).
    """
    name = "interleaved_1f1b"
    p, m = _pm(name, ranks, microbatches)
    v = as_int(virtual_stages, f"{name}: virtual_stages v", 1)
    if v == 1:
        return _generated(name, p, m, 1, _one_f_one_b_rows(p, m))
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        near = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"{name}: microbatches m={m} must be a multiple of ranks p={p} when "
            f"virtual_stages v={v} >= 2 (Megatron's interleaved schedule runs micro-batches in "
            f"rounds of p); m mod p = {m % p}, try m = {near}")
    total = v * m

    def chunk_mb(k: int, backward: bool) -> tuple[int, int]:
        c = (k // p) % v
        return (v - 1 - c if backward else c), (k // (p * v)) * p + k % p

    rows = []
    for r in range(p):
        def act(k: int, kind: ActionKind) -> Action:
            c, j = chunk_mb(k, kind is not _F)
            return Action(c * p + r, kind, j)

        warmup = min((v - 1) * p + 2 * (p - 1 - r), total)
        row = [act(k, _F) for k in range(warmup)]
        for i in range(total - warmup):
            row += [act(warmup + i, _F), act(i, _B)]
        row += [act(k, _B) for k in range(total - warmup, total)]
        rows.append(tuple(row))
    return _generated(name, p, m, v, rows)


def zero_bubble(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with B split into I and W, rank ``r`` deferring up to ``r`` W's."""
    p, m = _pm("zero_bubble", ranks, microbatches)
    rows = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(r, _F, j) for j in range(warmup)]
        next_w = 0
        for i in range(m):
            if i < m - warmup:
                row.append(Action(r, _F, warmup + i))
            row.append(Action(r, _I, i))
            if i >= r:
                row.append(Action(r, _W, next_w))
                next_w += 1
        row += [Action(r, _W, j) for j in range(next_w, m)]
        rows.append(tuple(row))
    return _generated("zero_bubble", p, m, 1, rows)


def make_schedule(name: str, ranks: int, microbatches: int,
                  virtual_stages: int | None = None, combined: bool = False) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULE_NAMES`).

    ``virtual_stages`` only applies to ``"interleaved_1f1b"`` (default 2);
    the other schedules accept ``None`` or 1. ``combined``: Megatron-Core's combined 1F1B
    form of ``name`` (:func:`combined_1f1b`; ``name`` one of :data:`COMBINED_SCHEDULES`,
    ``"1f1b"`` on one rank only).
    """
    if combined:
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in COMBINED_SCHEDULES or (key == "1f1b" and ranks != 1):
            raise ValueError(f"make_schedule: the combined 1F1B form exists for 1f1b on one "
                             f"rank and for interleaved_1f1b; got {name!r} on {ranks} ranks")
        v = (2 if virtual_stages is None else virtual_stages) if key == "interleaved_1f1b" \
            else 1
        return combined_1f1b(ranks, microbatches, v)
    if not isinstance(name, str):
        raise TypeError(f"make_schedule: name must be a str, one of {', '.join(SCHEDULE_NAMES)}; "
                        f"got {name!r}")
    key = name.strip().lower()
    if key not in SCHEDULE_NAMES:
        raise ValueError(f"make_schedule: unknown schedule {name!r}; "
                         f"choose from {', '.join(SCHEDULE_NAMES)}")
    if key == "interleaved_1f1b":
        v = 2 if virtual_stages is None else virtual_stages
        return interleaved_1f1b(ranks, microbatches, v)
    if virtual_stages is not None:
        v = as_int(virtual_stages, f"{key}: virtual_stages v", 1)
        if v != 1:
            raise ValueError(
                f"{key}: runs one stage per rank, so virtual_stages must be 1 (or omitted), got "
                f"{v}; use 'interleaved_1f1b' for v > 1")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble}[key](
        ranks, microbatches)
