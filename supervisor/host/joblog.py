"""Attempt logs in bounded space: a capped live log, one older segment, the last attempts only.

The rules: docs/operations.md, 'Files the supervisor keeps' ("Attempt logs are bounded"). The job writes its
output straight into the log, opened with O_APPEND and inherited (it never blocks on a pipe of ours and
survives a killed supervisor), so the supervisor bounds it from outside, as logrotate's `copytruncate` does:
after the truncation the job's next write lands at the new end because of O_APPEND.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from supervisor.host.regularfile import open_regular

__all__ = ["SEGMENT_SUFFIX", "HANDOFF_SUFFIX", "LOG_MODE", "open_log", "needs_rotation", "rotate", "attempt_number", "stale",
           "prune"]

SEGMENT_SUFFIX = ".1"  # `attempt-NNNN.log.1`: the tail of the output before the last rotation
LOG_MODE = 0o600  # owner-only, like everything in the run dir
_PREFIX, _LOG, _ERR, _STACKS = "attempt-", ".log", ".json", ".stacks.txt"  # the last: a hang's stack dumps
HANDOFF_SUFFIX = ".handoff"  # `attempt-NNNN.handoff`: the warm agent's hand-offs (host/spares.handed_ranks)


def open_log(path: Path) -> int:
    """An owner-only, append-only descriptor for an attempt log (created if missing)."""
    return open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_MODE, follow_symlinks=False)


def needs_rotation(size: int, max_bytes: int) -> bool:
    """Is a live log of `size` bytes due for rotation under a cap of `max_bytes` (live + segment)?"""
    return size > max_bytes // 2


def rotate(path: Path, max_bytes: int) -> OSError | None:
    """Copy the live log's last half-cap to its `.1` segment, then truncate it; the copy's error, if any.

    The truncation happens even when the copy fails (a full disk): freeing the space is the point.
    """
    keep = max_bytes // 2
    segment = path.with_name(path.name + SEGMENT_SUFFIX)
    tmp = path.with_name(f".{path.name}{SEGMENT_SUFFIX}.tmp")
    error: OSError | None = None
    with open(path, "r+b", buffering=0) as live:
        size = os.fstat(live.fileno()).st_size
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, LOG_MODE)
            try:
                start = max(0, size - keep)
                while start < size:
                    sent = os.sendfile(out, live.fileno(), start, size - start)
                    if sent == 0:
                        break
                    start += sent
            finally:
                os.close(out)
            os.replace(tmp, segment)
        except OSError as exc:
            error = exc
            # not a file of ours (a folder planted there): the next rotation fails the same way
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        live.truncate(0)
    return error


def attempt_number(name: str) -> int | None:
    """The attempt number in `attempt-NNNN.log`, `.log.1`, `.json`, `.stacks.txt` or `.handoff`; None otherwise."""
    for suffix in (_LOG + SEGMENT_SUFFIX, _LOG, _ERR, _STACKS, HANDOFF_SUFFIX):
        if name.startswith(_PREFIX) and name.endswith(suffix):
            digits = name[len(_PREFIX):-len(suffix)]
            return int(digits) if digits.isdecimal() else None
    return None


def stale(names: list[str], keep: int, current: int | None) -> list[str]:
    """Which of `names` belong to attempts older than the `keep` newest (never `current`'s)."""
    numbers = sorted({n for n in map(attempt_number, names) if n is not None}, reverse=True)
    kept = set(numbers[:keep]) | ({current} if current is not None else set())
    return sorted(name for name in names if (n := attempt_number(name)) is not None and n not in kept)


def prune(dirs: list[Path], keep: int, current: int | None) -> list[Path]:
    """Delete the logs and error files of attempts older than the `keep` newest; what was deleted."""
    gone: list[Path] = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for name in stale(names, keep, current):
            (d / name).unlink(missing_ok=True)
            gone.append(d / name)
    return gone
