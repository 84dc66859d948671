"""`run_dir/state.json`: the one rendering of `Status` on disk, written atomically, read defensively."""
from __future__ import annotations

import json
from pathlib import Path

from supervisor.host.atomic import temporaries, write_atomic
from supervisor.host.regularfile import open_regular
from supervisor.policy.state import Status

__all__ = ["STATE_FILE", "write_status", "read_status", "remove_torn_writes"]

STATE_FILE = "state.json"
_MAX_STATE_BYTES = 16 << 20  # a state.json is a few KB; a bigger one is not ours and reads as garbage


def write_status(run_dir: Path, status: Status) -> None:
    """Atomically replace state.json (owner-only: it holds the job's argv) so readers never see a torn file."""
    data = json.dumps(status.to_json(), indent=2, sort_keys=True, allow_nan=False).encode()
    write_atomic(run_dir / STATE_FILE, data, mode=0o600)


def remove_torn_writes(run_dir: Path) -> None:
    """Delete the temp files of `write_status` calls cut short by a SIGKILL (only with the run lock held)."""
    for tmp in temporaries(run_dir / STATE_FILE):
        tmp.unlink(missing_ok=True)


def read_status(run_dir: Path) -> Status | None:
    """The last written status, or None when there is none or it cannot be parsed."""
    try:
        with open(open_regular(run_dir / STATE_FILE), "rb") as f:  # whatever was planted there, `status` never hangs
            return Status.from_json(f.read(_MAX_STATE_BYTES))
    except (OSError, ValueError, TypeError, KeyError, RecursionError):  # RecursionError: `[[[[...` nested deep
        return None
