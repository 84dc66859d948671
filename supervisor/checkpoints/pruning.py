"""Carry out a retention plan: the only code in the store that deletes anything.

Each target is re-checked, renamed into the trash in one atomic step, then removed (docs/design.md, 'Notes for
maintainers'). Where the trash is: docs/checkpoints.md, 'What the supervisor keeps next to the root' ("Trash").
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from pathlib import Path

import structlog

from supervisor.checkpoints.markers import is_pinned
from supervisor.checkpoints.retention import Deletion, DiskUsage, RetentionPlan
from supervisor.checkpoints.shapes import identify
from supervisor.checkpoints.sidecars import open_sidecar, resolved, sidecar_problem, trusted_owners
from supervisor.errors import CheckpointError, SidecarError
from supervisor.host.mounts import same_mount
from supervisor.layout import TRASH_SUFFIX, is_sidecar_name, sidecar_name

__all__ = ["disk_usage", "execute_retention", "clear_trash", "trash_dir", "parking_problem"]

log = structlog.get_logger(__name__)
PathLike = str | os.PathLike[str]
_PARKED_NAME_BYTES = 200  # of a checkpoint's name kept in its trash name, before ".<time_ns>"


def disk_usage(root: PathLike) -> DiskUsage:
    """Total and free bytes of the filesystem holding `root`."""
    try:
        usage = shutil.disk_usage(root)
    except OSError as exc:
        raise CheckpointError(f"checkpoint root {root}: cannot read disk usage: {exc.strerror}") from None
    return DiskUsage(total_bytes=usage.total, free_bytes=usage.free)


def _device(path: Path) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def _usable_home(home: Path, device: int | None, base: Path) -> bool:
    """May the trash of the root `base` live in `home`: same file system and same mount as the root (a bind-mounted
    root shares its parent's device, yet a rename out of it fails with EXDEV), and writable by us?"""
    return (device is not None and _device(home) == device and os.access(home, os.W_OK | os.X_OK)
            and same_mount(home, base))


def _open_trash(trash: Path, device: int | None, owners: set[int]) -> Path:
    try:
        open_sidecar(trash, owners, create=True)  # SidecarError: a symlink, another user's, group-writable
    except OSError as exc:
        raise SidecarError(f"cannot create the trash {trash}: {exc.strerror}; nothing was deleted") from None
    if _device(trash) != device:
        raise SidecarError(f"{trash} is on another file system than the checkpoint root; refusing to delete")
    return trash


def _homes(base: Path, fallback: PathLike | None) -> list[Path]:
    """Where the trash of the (resolved) root `base` may live, in order of preference."""
    homes = [base.parent] + ([Path(os.path.abspath(fallback))] if fallback is not None else [])
    return list(dict.fromkeys(homes))


def _nowhere(base: Path, fallback: PathLike | None) -> str:
    where = f"{base.parent} is not writable, or on another file system or mount than the root"
    where += f", and so is {fallback}" if fallback is not None else ""
    return (f"checkpoint root {base}: nowhere to park deletions ({where}); nothing was deleted. "
            "Make the root a subdirectory of a writable folder on the same file system")


def trash_dir(root: PathLike, fallback: PathLike | None = None) -> Path:
    """The trash of `root` (made if need be): next to the root, else in `fallback`; SidecarError if neither."""
    base = resolved(root)
    name, device, owners = sidecar_name(base.name, TRASH_SUFFIX), _device(base), trusted_owners(base)
    for home in _homes(base, fallback):
        if _usable_home(home, device, base):
            return _open_trash(home / name, device, owners)
    raise SidecarError(_nowhere(base, fallback))


def parking_problem(root: PathLike, fallback: PathLike | None = None) -> str | None:
    """Why retention could not delete anything under `root` (no usable trash), or None; creates nothing."""
    base = resolved(root)
    name, device, owners = sidecar_name(base.name, TRASH_SUFFIX), _device(base), trusted_owners(base)
    if device is None:
        return None  # no root yet: `run` creates it, and a pass says what is wrong with it
    for home in _homes(base, fallback):
        if not _usable_home(home, device, base):
            continue
        try:
            st = os.lstat(home / name)
        except OSError:
            return None  # created on first use
        problem = sidecar_problem(home / name, st, owners)
        return None if problem is None else f"{problem}; retention deletes nothing through it"
    return _nowhere(base, fallback)


def _gone_is_fine(func: object, path: str, exc: BaseException | tuple[type, BaseException, object]) -> None:
    """rmtree's error hook: what vanished meanwhile was removed by another emptier of the same trash (a second
    supervisor on the root, `checkpoints prune`); anything else is raised."""
    err = exc[1] if isinstance(exc, tuple) else exc
    if not isinstance(err, FileNotFoundError):
        raise err


def _remove(path: Path) -> None:
    """Remove a parked entry; one that another emptier removed (or is removing) at the same time is no error."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):  # rmtree never follows symlinks inside the tree
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_gone_is_fine)
        else:
            shutil.rmtree(path, onerror=_gone_is_fine)
    else:
        path.unlink(missing_ok=True)


def _park(target: Path, trash: Path) -> Path:
    # The name is cut to leave room for the suffix: a 240-byte Lightning name plus ".<ns>" would pass the
    # file system's 255-byte limit, the rename would fail every time, and that checkpoint could never go.
    name = os.fsdecode(os.fsencode(target.name)[:_PARKED_NAME_BYTES])
    parked = trash / f"{name}.{time.time_ns()}"
    os.rename(target, parked)
    return parked


def clear_trash(root: PathLike, fallback: PathLike | None = None) -> int:
    """Remove what was parked in the trash of `root` (by an interrupted earlier run too); returns how many
    entries went. A trash that was never created is not created now."""
    cleared = 0
    base = resolved(root)
    owners = trusted_owners(base)
    for trash in (home / sidecar_name(base.name, TRASH_SUFFIX) for home in _homes(base, fallback)):
        if not open_sidecar(trash, owners, create=False):  # another user's trash is never emptied by us
            continue
        for entry in os.scandir(trash):
            try:
                _remove(Path(entry.path))
                cleared += 1
            except OSError as exc:
                log.warning("trash_clear_failed", path=entry.path, error=exc.strerror)
    return cleared


def _refusal(root: Path, target: Path, inode: int = 0) -> str | None:
    """Why `target` may not be deleted, or None when it is a real checkpoint dir directly inside `root` (and,
    with `inode`, still the very dir that was judged)."""
    if target.parent != root or target.name in ("", ".", "..") or is_sidecar_name(target.name):
        return "not a direct child of the checkpoint root"
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return "already gone"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if inode and st.st_ino != inode:
        # The trainer's commit sets a torn `step_N` aside and renames a fresh, complete save to that name:
        # the plan was about the torn one, and the new one is likely the newest complete checkpoint.
        return "replaced since it was judged"
    if is_pinned(target):  # pinned by hand while the plan was made: the pin wins
        return "pinned"
    if not identify(target).ours:  # planned from an older look: something not ours took the name since
        return "not a checkpoint (foreign)"
    return None


def execute_retention(root: PathLike, plan: RetentionPlan, *, empty_trash: bool = True,
                      fallback: PathLike | None = None) -> list[Deletion]:
    """Delete the plan's targets (rename into the trash, then remove); returns those actually deleted.

    With `empty_trash=False` only the (fast, atomic) renames happen: the caller empties the trash with
    `clear_trash`, e.g. off its event loop, since removing a large checkpoint on shared storage can be slow.
    Raises CheckpointError, having deleted nothing, when there is nowhere to put the trash.
    """
    base = Path(os.path.abspath(root))
    if not plan.deletions:
        if empty_trash:
            clear_trash(base, fallback)
        return []
    trash = trash_dir(base, fallback)
    if empty_trash:
        clear_trash(base, fallback)
    done: list[Deletion] = []
    for d in plan.deletions:
        target = Path(os.path.abspath(d.path))
        refused = _refusal(base, target, d.inode)
        if refused:
            log.warning("retention_skipped", path=str(target), why=refused)
            continue
        try:
            parked = _park(target, trash)
        except OSError as exc:
            log.warning("retention_rename_failed", path=str(target), error=exc.strerror)
            continue
        done.append(d)
        log.debug("checkpoint_deleted", path=str(target), reason=d.reason, size_bytes=d.size_bytes)
        if not empty_trash:
            continue
        try:
            _remove(parked)
        except OSError as exc:  # parked in the trash: invisible to scans, cleared next time
            log.warning("trash_remove_failed", path=str(parked), error=exc.strerror)
    return done
