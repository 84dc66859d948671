"""In-use markers: the checkpoint a running job resumed from, visible to every prune of the root.

The daemon already keeps its own job's resume point out of its retention (`protect`); a `checkpoints prune
--dir` run by hand, or another node's supervisor, must see it too. So the daemon writes a marker when it
launches a job from a checkpoint and removes it when the attempt ends or commits a newer checkpoint:

    <parent>/.<root-name>.fsdp-inuse/<host>-<pid>.json   {path, pid, host, start_time, time}

next to the root (symlinks resolved), never inside it (layout.py says why), written atomically into an
owner-only folder that must be ours (sidecars.py: another user's or a group-writable folder is refused with
SidecarError); a reader matches the checkpoint by its name, whatever path spelled the root. `pid`/`start_time`
are the job's (torchrun's) process and its start time. A reader counts a marker only while it is live:
- on the host that wrote it: process `pid` exists and started at `start_time` (a reused pid is not it);
- on another host: the marker was written or refreshed less than IN_USE_MAX_AGE_S ago (the daemon
  refreshes its marker at every housekeeping pass, at least every `retention_interval_s`). Its time is the
  later of its `time` and its mtime, each ignored when it is further ahead of the reader's clock than
  sidecars.CLOCK_SKEW_S: a marker dated in the future is not live forever; with no usable time it is stale.
Stale markers are ignored and removed by whoever reads them; unreadable ones are ignored.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from supervisor.checkpoints._files import read_small_json
from supervisor.checkpoints.sidecars import open_sidecar, sidecar_path, trusted_owners, written_at
from supervisor.errors import CheckpointError
from supervisor.host.atomic import write_atomic
from supervisor.layout import IN_USE_SUFFIX

__all__ = ["IN_USE_MAX_AGE_S", "in_use_dir", "mark_in_use", "refresh_in_use", "clear_in_use", "in_use"]

IN_USE_MAX_AGE_S = 6 * 3600.0  # a marker from another host older than this is stale
_MAX_BYTES = 16 * 1024
_START_SLACK_S = 0.05  # psutil's create_time is exact for one process; allow float noise only
PathLike = str | os.PathLike[str]


def in_use_dir(root: PathLike) -> Path:
    """The folder holding the in-use markers of `root`: a hidden sibling of the root, symlinks resolved, so
    that a daemon and a `prune` that spell the root differently (a symlinked root) meet in one folder."""
    return sidecar_path(root, IN_USE_SUFFIX)


def _marker(root: PathLike, host: str, pid: int) -> Path:
    return in_use_dir(root) / f"{host}-{pid}.json"


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def mark_in_use(root: PathLike, path: PathLike, *, pid: int | None = None, start_time: float | None = None,
                now: float | None = None) -> Path:
    """Record that process `pid` (default: this one) uses checkpoint `path` of `root`; returns the marker."""
    pid = os.getpid() if pid is None else pid
    host = socket.gethostname()
    folder = in_use_dir(root)
    doc = {"path": os.path.abspath(path), "pid": pid, "host": host,
           "start_time": _start_time(pid) if start_time is None else start_time,
           "time": time.time() if now is None else now}
    marker = _marker(root, host, pid)
    try:
        open_sidecar(folder, trusted_owners(root), create=True)  # SidecarError: not ours, no marker written
        write_atomic(marker, json.dumps(doc).encode(), durable=False, mode=0o600)
    except OSError as exc:
        raise CheckpointError(f"cannot write the in-use marker {marker}: {exc.strerror or exc}") from None
    return marker


def refresh_in_use(marker: Path) -> None:
    """Touch a marker so that readers on other hosts keep counting it; a marker gone since is left gone."""
    try:
        os.utime(marker)
    except OSError:
        pass


def clear_in_use(root: PathLike, *, pid: int | None = None) -> bool:
    """Remove this host's marker for `pid` (default: this process); returns whether there was one."""
    try:
        os.unlink(_marker(root, socket.gethostname(), os.getpid() if pid is None else pid))
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CheckpointError(f"cannot remove the in-use marker of {root}: {exc.strerror}") from None
    return True


def _read(marker: Path) -> tuple[dict[str, Any], float] | None:
    read = read_small_json(marker, _MAX_BYTES)
    if read is None:
        return None
    doc, st = read
    return (doc, st.st_mtime) if isinstance(doc, dict) and isinstance(doc.get("path"), str) else None


def _live(doc: dict[str, Any], mtime: float, host: str, now: float) -> bool:
    if doc.get("host") != host:
        written = written_at((mtime, doc.get("time")), now)
        return written is not None and now - written < IN_USE_MAX_AGE_S
    pid, started = doc.get("pid"), doc.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    actual = _start_time(pid)
    if actual is None:
        return False
    return not isinstance(started, (int, float)) or abs(actual - started) <= _START_SLACK_S


def in_use(root: PathLike, *, now: float | None = None) -> set[Path]:
    """The checkpoints of `root` that a live process has marked in use (stale markers are removed).

    SidecarError when the marker folder is not ours (sidecars.py): what it says cannot be trusted, and a
    prune that ignored it could delete a checkpoint a job is loading.

    Paths are `root` as spelled here joined with the marked checkpoint's name: the writer may have spelled
    the same root another way (through a symlink, or another node's mount point), and the marker folder
    already says which root it is about.
    """
    base = Path(os.path.abspath(root))
    folder = in_use_dir(root)
    now = time.time() if now is None else now
    host = socket.gethostname()
    paths: set[Path] = set()
    try:
        if not open_sidecar(folder, trusted_owners(root), create=False):
            return paths  # nothing ever marked
        entries = [e for e in os.scandir(folder) if e.name.endswith(".json") and not e.name.startswith(".")]
    except OSError:
        return paths  # unreadable: nothing to honour
    for entry in entries:
        found = _read(Path(entry.path))
        if found is None:
            continue
        doc, mtime = found
        if _live(doc, mtime, host, now):
            paths.add(base / os.path.basename(os.path.normpath(doc["path"])))
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                pass  # another reader removed it, or we may not: ignoring it is enough
    return paths
