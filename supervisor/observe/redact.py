"""Keep secrets out of logs and status: values whose names look secret are masked.

Environment: `HF_TOKEN=...` is masked by its name. Command lines: `--hf-token=...`, `--api-key ...` and
`WANDB_API_KEY=...` (an `env`-style assignment) are masked too, since argv is logged at every launch.
state.json keeps the exact argv (it identifies an orphaned job); it is readable by its owner only, and
the same argv is visible in /proc to every local user while the job runs: pass secrets in `[job] env`.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["redact_env", "redact_argv", "looks_secret", "MASK"]

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
