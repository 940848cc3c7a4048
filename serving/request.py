"""``Request``: one generation request as an engine sees it — token counts, never values.

A request asks for ``output_len`` tokens after a ``prompt_len``-token prompt; generation
ignores end-of-sequence (as ``vllm bench serve --ignore-eos`` does), so its length is
known when it arrives. The simulator stamps ``arrival_s``; the emulator adds it to the
engine before step ``arrival_step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modeling.errors import ConfigError

__all__ = ["Request"]


@dataclass(frozen=True)
class Request:
    """``request_id`` (unique within a run), ``prompt_len`` ≥ 1 input tokens, ``output_len``
    ≥ 1 tokens to generate, ``arrival_s`` ≥ 0 (simulated seconds) and ``arrival_step`` ≥ 0
    (emulated engine steps). ``prefix_len`` > 0 with a ``prefix_id``: the prompt's first
    ``prefix_len`` tokens are the same in every request of that ``prefix_id`` (a system
    prompt; ``vllm bench serve --random-prefix-len``), which a prefix cache can share."""

    request_id: int
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    arrival_step: int = 0
    prefix_id: int | None = None
    prefix_len: int = 0

    def __post_init__(self):
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1", "a request needs tokens",
                                  owner=f"Request {self.request_id!r}")
        if isinstance(self.arrival_step, bool) or not isinstance(self.arrival_step, int) \
                or self.arrival_step < 0:
            raise ConfigError("arrival_step", self.arrival_step, "an integer >= 0",
                              "not an engine step", owner=f"Request {self.request_id!r}")
        if isinstance(self.arrival_s, bool) or not isinstance(self.arrival_s, (int, float)) \
                or not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ConfigError("arrival_s", self.arrival_s, "a finite number >= 0",
                              "not a time", owner=f"Request {self.request_id!r}")
        p = self.prefix_len
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= self.prompt_len:
            raise ConfigError("prefix_len", p, f"an integer from 0 to prompt_len="
                              f"{self.prompt_len}", "a shared prefix is part of the prompt",
                              owner=f"Request {self.request_id!r}")
        if (p > 0) != (self.prefix_id is not None):
            raise ConfigError("prefix_id", self.prefix_id, "an id with prefix_len > 0, None "
                              "with prefix_len 0", f"prefix_len is {p}",
                              owner=f"Request {self.request_id!r}")
        if self.prefix_id is not None and (isinstance(self.prefix_id, bool)
                                           or not isinstance(self.prefix_id, int)):
            raise ConfigError("prefix_id", self.prefix_id, "an integer or None",
                              "not a prefix id", owner=f"Request {self.request_id!r}")

    @property
    def shared_prefix(self) -> tuple[int, int] | None:
        """(prefix_id, prefix_len) when the prompt starts with a shared prefix, else None."""
        return None if self.prefix_id is None else (self.prefix_id, self.prefix_len)

    @property
    def max_tokens(self) -> int:
        """Prompt and every output token: the most KV the request ever holds."""
        return self.prompt_len + self.output_len
