"""What the kernel says about processes and time since boot: neither libfaketime nor a wall-clock step moves it.

psutil's `create_time()` is the boot time by the wall clock plus the process's start ticks, so a +1 h step of
the clock made every live process "another one" (a claim taken over, an orphan not recognised). A process is
known here by its start in clock ticks since boot (`/proc/PID/stat` field 22) and the boot it started in
(`/proc/sys/kernel/random/boot_id`): a pid reused later, or after a reboot, is not it. `wall_now` is the wall
clock as the kernel stamps files (boot time + uptime, read from /proc), for ages measured against mtimes.
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
