"""argparse value types shared by the commands (each error names the value and the rule)."""

from __future__ import annotations

import argparse

from vcluster.scenario.units import parse_size

__all__ = ["positive_int", "int_at_least", "csv_of", "sizes"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1), e.g. a share of memory left free."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value:g}")
    return value


def int_at_least(minimum: int, what: str):
    """An integer >= ``minimum``; the error says what the integer counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum} ({what}), "
                                             f"got {text!r}")
        return value
    return parse


def csv_of(allowed=None, what="value"):
    """A comma-separated list, each item one of ``allowed`` (when given)."""
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}s")
        if allowed is not None:
            bad = [i for i in items if i not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
        return items
    return parse


def sizes(text: str) -> list[int]:
    try:
        return [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
