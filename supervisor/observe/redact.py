"""Keep secrets out of logs and status: values whose names look secret are masked.

What is masked, and why secrets belong in `[job] env` rather than argv: docs/operations.md, 'Files the
supervisor keeps' ("Secrets").
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["redact_env", "redact_argv", "looks_secret", "secret_values", "scrub", "MASK"]

MASK = "***"
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.I)
_ASSIGNMENT = re.compile(r"^(--?[\w.-]+|[A-Za-z_][A-Za-z0-9_]*)=")  # --flag=value or NAME=value


def looks_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with secret-looking values replaced by a mask."""
    return {k: (MASK if looks_secret(k) else v) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A copy of `argv` with the values of secret-looking flags and assignments masked."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        m = _ASSIGNMENT.match(arg)
        if mask_next and not arg.startswith("--"):
            out.append(MASK)
        elif m and looks_secret(m.group(1)):
            out.append(m.group(0) + MASK)
        else:
            out.append(arg)
        mask_next = arg.startswith("-") and "=" not in arg and looks_secret(arg)  # its value is the next arg
    return out


def secret_values(env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """The values `redact_env` and `redact_argv` mask (4 characters or more), longest first, for `scrub`."""
    found = [v for k, v in env.items() if looks_secret(k)]
    found += [a[len(r) - len(MASK):] for a, r in zip(argv, redact_argv(argv)) if r != a]
    return sorted({v for v in found if len(v) >= 4}, key=lambda v: (-len(v), v))


def scrub(value: Any, secrets: Sequence[str]) -> Any:
    """`value` (strings, nested in dicts and lists) with every occurrence of a secret masked: free text such as an
    exception's message or a traceback cannot be redacted by name."""
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, MASK)
        return value
    if isinstance(value, dict):
        return {k: scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, secrets) for v in value]
    return value
