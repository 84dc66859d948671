"""What the kernel says about processes and time since boot: neither libfaketime nor a wall-clock step moves it.

A process is known by its start ticks since boot (`/proc/PID/stat` field 22) and its boot id; `wall_now` is the
kernel's wall clock for file ages. Why not psutil's `create_time()`: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import os
import time

__all__ = ["boot_id", "pid_namespace", "start_ticks", "wall_now"]


def _read(path: str, cap: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("ascii", "replace")
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot; None when it is gone (or not ours to see)."""
    text = _read(f"/proc/{pid}/stat") if pid > 0 else None
    fields = text[text.rfind(")") + 2:].split() if text else []  # the name, in parentheses, may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None  # field 22: starttime


def boot_id() -> str | None:
    text = _read("/proc/sys/kernel/random/boot_id")
    return text.strip() or None if text else None


def pid_namespace() -> int | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid): pids mean something only inside it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def wall_now() -> float:
    """The kernel's wall clock (what it stamps mtimes with), to the second; time.time() without /proc."""
    stat, uptime = _read("/proc/stat", 1 << 22), _read("/proc/uptime")
    btime = [line.split()[1] for line in (stat or "").splitlines() if line.startswith("btime ")]
    try:
        return float(btime[0]) + float((uptime or "").split()[0])
    except (IndexError, ValueError):
        return time.time()
