"""How a supervisor recognises the jobs of its run dir, whatever argv the kernel shows for them.

argv identifies nothing: for a `#!` script (`./train.sh`, a torchrun shim, `accelerate launch`)
/proc/PID/cmdline reads `[interpreter, script, ...]`, a prewarmed job keeps its spare's argv, and torchrun's
workers have argv of their own. So the run dir holds a random token (`job.token`, owner-only, created by
the first `run` and kept; state.json carries a copy), and every job gets it in its environment
(contract.ENV_RUN_TOKEN) next to the run dir (ENV_RUN_DIR); everything the job starts inherits both. A new
`run` stops every live process carrying that token and that run dir before it launches (procs.find_orphans)
- also when state.json is missing or unreadable. The run dir is compared too so that a copied run dir
(same token, another directory) never stops the original's job.
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
