"""What a job leaves behind, read defensively: torchrun's error file, the tail of its output, the heartbeat
file, and the cgroup's OOM-kill counter. Files the job controls are opened without ever blocking (a FIFO or a
device planted under the name is refused) and read within a bound; the parsing is `supervisor.policy.exits`'
and `supervisor.contract`'s.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from supervisor.contract import MAX_HEARTBEAT_BYTES, Beat, parse_heartbeat
from supervisor.host.regularfile import open_regular
from supervisor.policy.exits import RootCause, scan_job_output

__all__ = ["root_cause", "read_oom_kills", "read_beat"]

_TAIL_BYTES = 256 * 1024  # torchrun's footer is ~2 KiB; this leaves room for other ranks' noise after a failure
_ERROR_FILE_BYTES = 1024 * 1024  # `record` writes the message plus one call stack: kilobytes


def _read_regular(path: Path, limit: int, *, tail: bool) -> str | None:
    """The file's text (its last `limit` bytes when `tail`, else all of it if it fits), or None.

    A FIFO, a device or a directory planted under the name is refused without blocking.
    """
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if not tail and size > limit:
                return None
            start = max(0, size - limit) if tail else 0
            f.seek(start)
            data = f.read(limit)
    except (OSError, ValueError):
        return None
    if start > 0:  # began mid-line: drop the fragment
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", "replace")


def _error_file_message(error_file: Path) -> str | None:
    text = _read_regular(error_file, _ERROR_FILE_BYTES, tail=False)
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # garbage, or nesting deep enough to exhaust the parser's stack
        return None
    msg = doc.get("message") if isinstance(doc, dict) else None
    msg = msg.get("message") if isinstance(msg, dict) else msg
    return msg if isinstance(msg, str) else None


def root_cause(error_file: Path | None, job_log: Path | None) -> RootCause:
    """The failing worker from torchrun's error file and the tail of the job's output; tolerates garbage."""
    found = RootCause(None, None, None)
    if job_log is not None:
        text = _read_regular(job_log, _TAIL_BYTES, tail=True)
        if text:
            found = scan_job_output(text.splitlines())
    message = _error_file_message(error_file) if error_file is not None else None
    if message and message.strip():  # what the worker itself recorded beats what we parse from its output
        found.message = message
    return found


def read_oom_kills(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_self: Path = Path("/proc/self/cgroup")) -> int | None:
    """The `oom_kill` counter of our cgroup (v2), or None when it is not readable here."""
    try:
        rel = next(line.split(":", 2)[2] for line in proc_self.read_text().splitlines() if line.startswith("0::"))
        events = (cgroup_root / rel.strip().lstrip("/") / "memory.events").read_text()
    except (OSError, StopIteration, IndexError):
        return None
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def read_beat(path: Path) -> tuple[Beat | None, list[str]]:
    """The heartbeat file's beat and its problems; (None, []) if it is gone or not a regular file."""
    try:
        with open_regular(path) as f:  # a FIFO or a device planted there must not block us
            data = f.read(MAX_HEARTBEAT_BYTES + 1)
    except OSError:
        return None, []  # gone between the event and the read (the next beat will do), or not a file
    return parse_heartbeat(data)
