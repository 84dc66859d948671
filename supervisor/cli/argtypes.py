"""argparse value types shared by the command modules: a bad number is a one-line usage error (exit 2)."""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.errors import UsageError

__all__ = ["non_negative_int", "non_negative_float", "at_most", "CONFIG_ENV", "DEFAULT_CONFIG", "add_config_arg",
           "default_config"]

CONFIG_ENV = "FSDP_SUPERVISOR_CONFIG"  # the config every command uses when -c is not given
DEFAULT_CONFIG = "job.toml"  # ... and without that variable: ./job.toml
CONFIG_HELP = f"job.toml (default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG})"


def _non_negative(text: str, kind: type[int] | type[float], what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def non_negative_int(text: str) -> int:
    return int(_non_negative(text, int, "an integer"))


def non_negative_float(text: str) -> float:
    return float(_non_negative(text, float, "a number"))


def at_most(limit: float) -> Callable[[str], float]:
    """A non-negative finite number no larger than `limit` (beyond it the arithmetic that uses it overflows)."""

    def parse(text: str) -> float:
        value = non_negative_float(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r} is more than {limit:g}")
        return value

    return parse


def add_config_arg(p: Any) -> None:
    """`-c/--config` on a parser or a group; None when not given (main() then fills in default_config())."""
    p.add_argument("-c", "--config", default=None, metavar="CONFIG", help=CONFIG_HELP)


def default_config(env: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists) -> str:
    """The config a command uses without -c: $FSDP_SUPERVISOR_CONFIG, else ./job.toml; UsageError when neither."""
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV]
    if exists(DEFAULT_CONFIG):
        return DEFAULT_CONFIG
    raise UsageError(f"no config: pass -c CONFIG, set {CONFIG_ENV}, or run where a {DEFAULT_CONFIG} is "
                     f"(not found: {os.path.join(os.getcwd(), DEFAULT_CONFIG)})")
