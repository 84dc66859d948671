"""In-use markers: the checkpoint a running job resumed from, visible to every prune of the root.

A lease (lease.py) on the job's process, holding {path}, in the `.fsdp-inuse` sidecar: docs/checkpoints.md, 'What
the supervisor keeps next to the root' ("In-use markers"); who reads it: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from supervisor.checkpoints.lease import Here, lease_body, lease_state, read_leases, refresh_lease, write_lease
from supervisor.checkpoints.sidecars import open_sidecar, sidecar_path, trusted_owners
from supervisor.errors import CheckpointError
from supervisor.host.boot import start_ticks
from supervisor.layout import IN_USE_SUFFIX

__all__ = ["IN_USE_MAX_AGE_S", "in_use_dir", "mark_in_use", "refresh_in_use", "clear_in_use", "in_use"]

IN_USE_MAX_AGE_S = 6 * 3600.0  # a marker from another host older than this is stale
PathLike = str | os.PathLike[str]
refresh_in_use = refresh_lease  # touch a marker so that readers on other hosts keep counting it


def in_use_dir(root: PathLike) -> Path:
    """The folder holding the in-use markers of `root`: a hidden sibling of the root, symlinks resolved, so
    that a daemon and a `prune` that spell the root differently (a symlinked root) meet in one folder."""
    return sidecar_path(root, IN_USE_SUFFIX)


def mark_in_use(root: PathLike, path: PathLike, *, pid: int | None = None, start: int | None = None) -> Path:
    """Record that process `pid` (default: this one; `start`: its start ticks) uses checkpoint `path` of `root`;
    returns the marker."""
    pid = os.getpid() if pid is None else pid
    marker = in_use_dir(root) / Here.now().name(pid)
    try:
        open_sidecar(marker.parent, trusted_owners(root), create=True)  # SidecarError: not ours, no marker written
        write_lease(marker, lease_body(pid, start=start, path=os.path.abspath(path)))
    except OSError as exc:
        raise CheckpointError(f"cannot write the in-use marker {marker}: {exc.strerror or exc}") from None
    return marker


def clear_in_use(root: PathLike, *, pid: int | None = None) -> bool:
    """Remove this host's marker for `pid` (default: this process); returns whether there was one."""
    try:
        os.unlink(in_use_dir(root) / Here.now().name(os.getpid() if pid is None else pid))
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CheckpointError(f"cannot remove the in-use marker of {root}: {exc.strerror}") from None
    return True


def in_use(root: PathLike, *, now: float | None = None) -> set[Path]:
    """The checkpoints of `root` that a live process has marked in use (stale markers are removed).

    SidecarError when the marker folder is not ours (sidecars.py): what it says cannot be trusted, and a
    prune that ignored it could delete a checkpoint a job is loading. Paths are `root` as spelled here joined
    with the marked checkpoint's name (the module docstring says why).
    """
    base = Path(os.path.abspath(root))
    folder = in_use_dir(root)
    now = time.time() if now is None else now
    here = Here.now()
    paths: set[Path] = set()
    try:
        if not open_sidecar(folder, trusted_owners(root), create=False):
            return paths  # nothing ever marked
    except OSError:
        return paths  # unreadable: nothing to honour
    for lease in read_leases(folder, now):
        if not isinstance(lease.doc.get("path"), str):
            continue
        if lease_state(lease, here=here, now=now, started=start_ticks, max_age=IN_USE_MAX_AGE_S) is None:
            paths.add(base / os.path.basename(os.path.normpath(lease.doc["path"])))
        else:
            with contextlib.suppress(OSError):  # another reader removed it, or we may not: ignoring it is enough
                os.unlink(lease.path)
    return paths
