"""How a supervisor recognises the jobs of its run dir, whatever argv the kernel shows for them.

Every job gets the run dir's random token (`job.token`) and the run dir in its environment; a new `run` stops every
live process carrying both (docs/operations.md, 'What happens when things go wrong'). Why not argv, and why the
run dir too: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import TypeGuard

from supervisor.host.atomic import write_atomic
from supervisor.host.regularfile import open_regular

__all__ = ["TOKEN_FILE", "run_token", "valid_token"]

TOKEN_FILE = "job.token"
_TOKEN = re.compile(r"[0-9a-f]{32}")


def valid_token(text: str | None) -> TypeGuard[str]:
    return text is not None and _TOKEN.fullmatch(text) is not None


def run_token(run_dir: Path, recorded: str | None = None) -> tuple[str, str | None]:
    """The run dir's token (from job.token, else state.json's copy, else a new one) and a write error, if any.

    The token must survive a lost state.json, so it is written to its own file; a run dir where that write
    fails (read-only, full) still gets a token for this run, and the error is the caller's to log.
    """
    path = run_dir / TOKEN_FILE
    try:
        with open(open_regular(path), "rb") as f:
            text: str | None = f.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = None
    if valid_token(text):
        return text, None
    token = recorded if valid_token(recorded) else secrets.token_hex(16)
    try:
        write_atomic(path, f"{token}\n".encode(), mode=0o600)
    except OSError as exc:
        return token, f"{path}: {exc.strerror or exc}"
    return token, None
