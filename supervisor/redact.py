"""Keep secrets out of logs and status: environment values whose names look secret are masked."""
from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["redact_env", "looks_secret", "MASK"]

MASK = "***"
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.I)


def looks_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with secret-looking values replaced by a mask."""
    return {k: (MASK if looks_secret(k) else v) for k, v in env.items()}
