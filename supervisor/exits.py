"""Why did an attempt end? Exit code, signal, OOM, and torchrun's root cause, in one `ExitInfo`.

torchrun's agent (wrapped in `record`) copies the root-cause worker's error to TORCHELASTIC_ERROR_FILE, but
that JSON has no rank; the rank and the worker's exit code come from the "Root Cause" block torchrun prints
at the end of its output, so both are read.
"""
from __future__ import annotations

import json
import re
import signal as _signal
from pathlib import Path

from supervisor.state import ExitInfo

__all__ = ["classify_exit", "signal_name", "root_cause", "read_oom_kills", "RootCause"]

_ROOT_RE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)",
    re.S,
)
_TAIL_BYTES = 64 * 1024


def signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


class RootCause:
    """The first failing worker according to torchrun: rank, its exit code, and its exception message."""

    def __init__(self, rank: int | None, exitcode: int | None, message: str | None) -> None:
        self.rank, self.exitcode, self.message = rank, exitcode, message

    def describe(self) -> str | None:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.exitcode is not None:
            parts.append(f"exitcode {self.exitcode}" + (f" ({signal_name(-self.exitcode)})" if self.exitcode < 0 else ""))
        if self.message:
            parts.append(self.message.strip().splitlines()[-1][:300])
        return ": ".join(parts) if parts else None


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def root_cause(error_file: Path | None, job_log: Path | None) -> RootCause:
    """Parse the root cause from torchrun's error file and the tail of the job's output; tolerate garbage."""
    message = None
    if error_file is not None:
        try:
            doc = json.loads(error_file.read_text(encoding="utf-8", errors="replace"))
            msg = doc.get("message")
            message = msg.get("message") if isinstance(msg, dict) else (msg if isinstance(msg, str) else None)
        except (OSError, ValueError, AttributeError):
            message = None
    rank = code = None
    if job_log is not None:
        matches = list(_ROOT_RE.finditer(_tail(job_log)))
        if matches:
            rank, code = int(matches[-1]["rank"]), int(matches[-1]["code"])
    return RootCause(rank, code, message)


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


def classify_exit(
    returncode: int,
    *,
    at: float,
    we_stopped: bool = False,
    hang: bool = False,
    oom_before: int | None = None,
    oom_after: int | None = None,
    cause: RootCause | None = None,
) -> ExitInfo:
    """Turn a Popen returncode plus what the supervisor knows into the reason shown in logs and status."""
    code = returncode if returncode >= 0 else None
    sig = signal_name(-returncode) if returncode < 0 else None
    worker_sig = cause.exitcode if cause and cause.exitcode is not None and cause.exitcode < 0 else None
    killed = returncode == -_signal.SIGKILL or worker_sig == -_signal.SIGKILL
    if hang:
        reason = "hang"
    elif we_stopped:
        reason = "stopped"
    elif returncode == 0:
        reason = "completed"
    elif killed and oom_before is not None and oom_after is not None and oom_after > oom_before:
        reason = "oom"
    elif returncode < 0 or worker_sig is not None:
        reason = "signal"
    else:
        reason = "crash"
    detail = cause.describe() if cause else None
    return ExitInfo(code=code, signal=sig, reason=reason, at=at, detail=detail)
