"""Leases: a file next to the root that says a live process holds something (the root claim, an in-use marker).

    <sidecar folder>/<host>-<pid>-<pid namespace>.json   {host, pidns, boot, pid, start, time, ...what it holds}

Written atomically, owner-only, into a sidecar folder that must be ours (sidecars.py). `lease_state` (pure) is the
one live-or-stale rule: docs/checkpoints.md, 'What the supervisor keeps next to the root' ("Leases").
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.checkpoints._files import load_capped_json
from supervisor.checkpoints.sidecars import written_at
from supervisor.host import boot
from supervisor.host.atomic import write_atomic

__all__ = ["Here", "Lease", "lease_state", "lease_body", "read_leases", "refresh_lease"]

_MAX_BYTES = 16 * 1024
_MAX_REFRESH_S = 86400.0  # a holder's refresh_s is believed up to a day


@dataclass(frozen=True)
class Here:
    """Where pids mean something: this host, pid namespace and boot."""

    host: str
    pidns: int | None = None
    boot: str | None = None

    @classmethod
    def now(cls) -> Here:
        return cls(socket.gethostname(), boot.pid_namespace(), boot.boot_id())

    def knows(self, lease: Lease) -> bool:
        """Whether `lease`'s pid is one of ours (its process can be looked at here)."""
        return lease.host == self.host and (lease.pidns is None or self.pidns is None or lease.pidns == self.pidns)

    def name(self, pid: int) -> str:
        return f"{self.host}-{pid}{f'-{self.pidns}' if self.pidns else ''}.json"


@dataclass(frozen=True)
class Lease:
    """One lease as read from its file."""

    path: Path
    host: str
    pid: int
    start: int | None = None  # start ticks since boot (host/boot.py)
    written: float | None = None  # its last write, as far as it can be trusted
    refresh_s: float = 0.0
    pidns: int | None = None
    boot: str | None = None
    doc: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # what it holds


def lease_state(lease: Lease, *, here: Here, now: float, started: Callable[[int], int | None],
                max_age: float) -> str | None:
    """Why `lease` is stale, or None while it is live (pure; `started(pid)`: a process's start ticks here)."""
    if here.knows(lease):
        if lease.boot is not None and here.boot is not None and lease.boot != here.boot:
            return "this host has rebooted since"
        actual = started(lease.pid)
        if actual is None:
            return f"its process (pid {lease.pid}) is gone"
        if lease.start is not None and actual != lease.start:
            return f"pid {lease.pid} is another process now"
        return None
    if lease.written is None:
        return "it bears no usable time (dated in the future?)"
    age = now - lease.written
    return f"it was last refreshed {age:.0f}s ago (stale after {max_age:.0f}s)" if age > max_age else None


def lease_body(pid: int, *, start: int | None = None, **holds: Any) -> bytes:
    """The file of a lease on process `pid` (its start ticks: looked up when not given) holding `holds`."""
    here = Here.now()
    doc = {"host": here.host, "pidns": here.pidns, "boot": here.boot, "pid": pid,
           "start": boot.start_ticks(pid) if start is None else start, "time": time.time(), **holds}
    return json.dumps(doc).encode()


def write_lease(path: Path, body: bytes) -> None:
    write_atomic(path, body, durable=False, mode=0o600)


def refresh_lease(path: Path) -> bool:
    """Touch a lease so that readers on other hosts keep counting it; False when it is gone (left gone)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except OSError:
        pass
    return True


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _read(path: Path, now: float) -> Lease | None:
    try:
        doc, st = load_capped_json(path, _MAX_BYTES, OSError)
    except OSError:  # missing, a symlink, not a regular file, over the cap, not JSON
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("host"), str) or (_int(doc.get("pid")) or 0) <= 0:
        return None
    t, refresh = doc.get("time"), doc.get("refresh_s")
    number = (int, float)
    return Lease(path=path, host=doc["host"], pid=doc["pid"], start=_int(doc.get("start")),
                 written=written_at((st.st_mtime, t if isinstance(t, number) else None), now),
                 refresh_s=min(max(float(refresh), 0.0), _MAX_REFRESH_S) if isinstance(refresh, number) else 0.0,
                 pidns=_int(doc.get("pidns")), boot=doc["boot"] if isinstance(doc.get("boot"), str) else None, doc=doc)


def read_leases(folder: Path, now: float) -> list[Lease]:
    """The readable leases in `folder` (an opened sidecar), in name order; garbage is skipped."""
    try:
        names = [e.name for e in os.scandir(folder) if e.name.endswith(".json") and not e.name.startswith(".")]
    except OSError:
        return []
    return [lease for lease in (_read(folder / n, now) for n in sorted(names)) if lease is not None]
