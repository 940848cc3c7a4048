"""The rules a pipeline schedule must obey, checked one by one.

With ``p`` ranks, ``v`` virtual stages, ``S = p v`` stages and ``m`` micro-batches:

* **R0** every action names a stage in ``0..S-1`` and a micro-batch in ``0..m-1``.
* **R1** every (stage, micro-batch) is forwarded exactly once, on the rank
  that holds the stage (``stage mod p``).
* **R2** every (stage, micro-batch) is backwarded exactly once, on the rank
  that holds the stage: by one ``B``, or by one ``I`` and one ``W`` -- never
  a ``B`` together with an ``I``/``W``.
* **R3** on its rank, the forward of a (stage, micro-batch) comes before its
  ``B``/``I``, and its ``I`` before its ``W``.
* **R4** the cross-stage dependencies -- ``F(s, j)`` needs ``F(s-1, j)``;
  ``B/I(s, j)`` needs ``B/I(s+1, j)`` and ``F(s, j)``; ``W(s, j)`` needs
  ``I(s, j)`` -- can all be met when every rank executes its list in order:
  no deadlock.  (Checked only when R0-R3 hold; before that the dependency
  graph is not well defined.)

:func:`violations` lists every broken rule; :func:`validate` raises a
:class:`ScheduleError` for the first one.  The same rules are what
PyTorch's ``_validate_schedule`` and ``_simulate_comms_compute`` check in
``torch.distributed.pipelining.schedules``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from ._engine import run_in_order
from .actions import Action, ActionKind
from .errors import ScheduleError
from .schedule import Schedule

__all__ = ["RULES", "Violation", "violations", "validate"]

#: Rule number -> the rule, as printed in every violation message.
RULES: dict[int, str] = {
    0: "every action names a stage in 0..S-1 and a micro-batch in 0..m-1",
    1: "every (stage, micro-batch) is forwarded exactly once, on the rank holding the stage",
    2: "every (stage, micro-batch) is backwarded exactly once, on the rank holding the stage: "
       "one B, or one I and one W, never B together with I/W",
    3: "on its rank, F comes before its B/I, and I before its W",
    4: "every rank can run its list in order without deadlock (F(s,j) needs F(s-1,j); "
       "B/I(s,j) needs B/I(s+1,j) and F(s,j); W(s,j) needs I(s,j))",
}


@dataclass(frozen=True)
class Violation:
    """One broken rule: its number, the rank (None = whole schedule), the actions, a message."""

    rule: int
    rank: int | None
    actions: tuple[Action, ...]
    message: str

    def __str__(self) -> str:
        return self.message

    def error(self) -> ScheduleError:
        """This violation as a :class:`ScheduleError`."""
        return ScheduleError(self.message, rule=self.rule, rank=self.rank, actions=self.actions)


def _v(rule: int, rank, actions, detail: str) -> Violation:
    where = f"rank {rank}: " if rank is not None else ""
    return Violation(rule, rank, tuple(actions), f"R{rule} ({RULES[rule]}): {where}{detail}")


def violations(schedule: Schedule) -> list[Violation]:
    """Every violation of R0..R4 in ``schedule``, ordered by rule (empty list = valid)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"violations: expected a Schedule, got {schedule!r}")
    p, m, S = schedule.ranks, schedule.microbatches, schedule.stages
    out: list[Violation] = []
    # where[(stage, mb)][kind] -> [(rank, index, action)]
    where: dict = defaultdict(lambda: defaultdict(list))
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if a.stage >= S or a.microbatch >= m:
                out.append(_v(0, r, [a],
                              f"{a} names stage {a.stage} and micro-batch {a.microbatch}; "
                              f"allowed: stages 0..{S - 1} (p={p} x v={schedule.virtual_stages}), "
                              f"micro-batches 0..{m - 1}"))
                continue
            where[(a.stage, a.microbatch)][a.kind].append((r, i, a))

    def wrong_rank(rule, occurrences, s):
        home = s % p
        for r, _, a in occurrences:
            if r != home:
                out.append(_v(rule, r, [a], f"{a} runs on rank {r} but stage {s} lives on "
                                            f"rank {home} (stage mod p = {s} mod {p})"))

    for s in range(S):
        for j in range(m):
            got = where.get((s, j), {})
            fs = got.get(ActionKind.F, [])
            if not fs:
                out.append(_v(1, s % p, [Action(s, ActionKind.F, j)],
                              f"{s}F{j} is missing (no forward of micro-batch {j} on stage {s})"))
            elif len(fs) > 1:
                out.append(_v(1, fs[1][0], [a for _, _, a in fs],
                              f"{s}F{j} appears {len(fs)} times (ranks "
                              f"{', '.join(str(r) for r, _, _ in fs)}); allowed: exactly once"))
            wrong_rank(1, fs, s)
    for s in range(S):
        for j in range(m):
            got = where.get((s, j), {})
            bs, is_, ws = (got.get(k, []) for k in (ActionKind.B, ActionKind.I, ActionKind.W))
            every = bs + is_ + ws
            names = ", ".join(str(a) for _, _, a in every)
            if bs and (is_ or ws):
                out.append(_v(2, every[0][0], [a for _, _, a in every],
                              f"micro-batch {j} of stage {s} is backwarded by both B and I/W "
                              f"({names}); allowed: one B, or one I and one W"))
            elif len(bs) > 1:
                out.append(_v(2, bs[1][0], [a for _, _, a in bs],
                              f"{s}B{j} appears {len(bs)} times; allowed: exactly once"))
            elif not bs and (len(is_) != 1 or len(ws) != 1):
                if not every:
                    out.append(_v(2, s % p, [Action(s, ActionKind.B, j)],
                                  f"micro-batch {j} of stage {s} is never backwarded (no {s}B{j}, "
                                  f"no {s}I{j}/{s}W{j})"))
                else:
                    out.append(_v(2, every[0][0], [a for _, _, a in every],
                                  f"micro-batch {j} of stage {s} has {len(is_)} I and {len(ws)} W "
                                  f"({names}); allowed: exactly one I and one W (or one B)"))
            wrong_rank(2, every, s)
    for s in range(S):
        for j in range(m):
            got = where.get((s, j), {})
            fs = got.get(ActionKind.F, [])
            grads = got.get(ActionKind.B, []) + got.get(ActionKind.I, [])
            ws = got.get(ActionKind.W, [])
            same_rank = len(fs) == 1 and len(grads) == 1 and fs[0][0] == grads[0][0]
            if same_rank and fs[0][1] > grads[0][1]:
                r, _, g = grads[0]
                out.append(_v(3, r, [g, fs[0][2]],
                              f"{g} (position {grads[0][1]}) comes before its forward {fs[0][2]} "
                              f"(position {fs[0][1]}); a backward must follow its forward"))
            ins = got.get(ActionKind.I, [])
            if len(ins) == 1 and len(ws) == 1 and ins[0][0] == ws[0][0] and ins[0][1] > ws[0][1]:
                r, _, w = ws[0]
                out.append(_v(3, r, [w, ins[0][2]],
                              f"{w} (position {ws[0][1]}) comes before its input-gradient "
                              f"backward {ins[0][2]} (position {ins[0][1]}); W must follow I"))
    if out:
        return out
    run = run_in_order(schedule.actions, S, lambda a: Fraction(1))
    if run.deadlocked:
        detail = "; ".join(
            f"rank {r} is stuck at {a} waiting for {' and '.join(missing)}"
            for r, a, missing in run.stuck)
        out.append(Violation(4, run.stuck[0][0], tuple(a for _, a, _ in run.stuck),
                             f"R4 ({RULES[4]}): deadlock: {detail}"))
    return out


def validate(schedule: Schedule) -> Schedule:
    """Return ``schedule`` if it obeys R0..R4, else raise :class:`ScheduleError` for the first
    violation (its ``rule``, ``rank`` and ``actions`` attributes say which)."""
    found = violations(schedule)
    if found:
        first = found[0]
        more = (f" (and {len(found) - 1} more violation(s); pipelining.violations(schedule) "
                f"lists them all)" if len(found) > 1 else "")
        raise ScheduleError(f"{schedule.name}: {first.message}{more}", rule=first.rule,
                            rank=first.rank, actions=first.actions)
    return schedule
