"""One unit of pipeline work: ``Action(stage, kind, microbatch)``.

Kinds (the letters follow PyTorch ``torch.distributed.pipelining`` and the
zero-bubble paper, Qi et al. 2023):

* ``F`` forward of one micro-batch through one stage;
* ``B`` full backward (input gradient and weight gradient together);
* ``I`` input-gradient backward only (what the previous stage waits for);
* ``W`` weight-gradient backward only (nobody waits for it, so it can be
  deferred to fill bubbles).

``B = I + W``: a (stage, micro-batch) pair is backwarded either by one ``B``
or by one ``I`` followed by one ``W``.

Text form: ``str(Action(1, F, 0)) == "1F0"`` -- stage, kind letter,
micro-batch, all decimal; :meth:`Action.parse` reads it back.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from mesh.arguments import as_int

__all__ = ["ActionKind", "Action", "F", "B", "I", "W"]


class ActionKind(enum.Enum):
    """The four kinds of pipeline work; the value is the one-letter code."""

    F = "F"  #: forward
    B = "B"  #: full backward (= I + W)
    I = "I"  #: input-gradient backward  # noqa: E741
    W = "W"  #: weight-gradient backward

    @property
    def is_backward(self) -> bool:
        """True for B, I and W."""
        return self is not ActionKind.F

    @property
    def sends_gradient(self) -> bool:
        """True for B and I: the kinds that produce the gradient the previous stage needs."""
        return self in (ActionKind.B, ActionKind.I)

    def __repr__(self) -> str:
        return f"ActionKind.{self.name}"

    def __str__(self) -> str:
        return self.value


F = ActionKind.F
B = ActionKind.B
I = ActionKind.I  # noqa: E741
W = ActionKind.W

_KINDS = "".join(k.value for k in ActionKind)
_ACTION_RE = re.compile(rf"([0-9]+)([{_KINDS}])([0-9]+)")


@dataclass(frozen=True)
class Action:
    """``Action(stage, kind, microbatch)``: run ``kind`` of ``microbatch`` on ``stage``.

    ``stage`` and ``microbatch`` are ints >= 0; ``kind`` an :class:`ActionKind`
    or its letter (``"F"``, ``"B"``, ``"I"``, ``"W"``).
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if type(self.stage) is int and type(self.microbatch) is int and \
                self.stage >= 0 and self.microbatch >= 0 and type(self.kind) is ActionKind:
            return                      # as the generators build them: nothing to convert
        object.__setattr__(self, "stage", as_int(self.stage, "Action: stage", 0))
        object.__setattr__(self, "microbatch", as_int(self.microbatch, "Action: microbatch", 0))
        kind = self.kind
        if isinstance(kind, str) and not isinstance(kind, ActionKind):
            if kind not in _KINDS or len(kind) != 1:
                raise ValueError(
                    f"Action: kind must be one of {', '.join(_KINDS)}, got {kind!r}")
            kind = ActionKind(kind)
        if not isinstance(kind, ActionKind):
            raise TypeError(
                f"Action: kind must be an ActionKind or one of the letters {', '.join(_KINDS)}, "
                f"got {kind!r}")
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.stage}, {self.kind!r}, {self.microbatch})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read ``"<stage><kind><microbatch>"`` back, e.g. ``"1F0"`` or ``"12B3"``.

        Surrounding whitespace is ignored; anything else raises ``ValueError``.
        """
        if not isinstance(text, str):
            raise TypeError(f"Action.parse: expected a string like '1F0', got {text!r}")
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"Action.parse: {text!r} is not an action; expected <stage><kind><microbatch> "
                f"with decimal stage and micro-batch and kind one of {', '.join(_KINDS)}, "
                f"e.g. '1F0' or '12B3'")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), ActionKind(kind), int(microbatch))
