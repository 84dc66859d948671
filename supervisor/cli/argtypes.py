"""argparse value types shared by the command modules: a bad number is a one-line usage error (exit 2)."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["non_negative_int", "non_negative_float", "at_most"]


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def at_most(limit: float) -> Callable[[str], float]:
    """A non-negative finite number no larger than `limit` (beyond it the arithmetic that uses it overflows)."""

    def parse(text: str) -> float:
        value = non_negative_float(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {limit:g}")
        return value

    return parse
