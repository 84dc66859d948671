"""Carry out a retention plan: the only code in the store that deletes anything.

Each target is re-checked (a direct, non-symlink child dir of the root), renamed into `<root>/.trash/`
in one atomic step, then removed. A crash mid-delete leaves only `.trash` contents, which scans skip
and the next run clears, so a half-deleted dir can never look complete.
"""
from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import structlog

from supervisor.layout import TRASH_DIR
from supervisor.checkpoints.retention import Deletion, DiskUsage, RetentionPlan
from supervisor.errors import CheckpointError

__all__ = ["disk_usage", "execute_retention", "clear_trash"]

log = structlog.get_logger(__name__)


def disk_usage(root: str | os.PathLike[str]) -> DiskUsage:
    """Total and free bytes of the filesystem holding `root`."""
    try:
        usage = shutil.disk_usage(root)
    except OSError as exc:
        raise CheckpointError(f"checkpoint root {root}: cannot read disk usage: {exc.strerror}") from None
    return DiskUsage(total_bytes=usage.total, free_bytes=usage.free)


def _trash_dir(root: Path) -> Path:
    trash = root / TRASH_DIR
    try:
        st = os.lstat(trash)
    except FileNotFoundError:
        trash.mkdir()
        return trash
    if not stat.S_ISDIR(st.st_mode):  # a symlinked .trash would move checkpoints out of the root
        raise CheckpointError(f"{trash} is not a plain directory; refusing to delete through it")
    return trash


def _remove(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # rmtree never follows symlinks inside the tree
    else:
        path.unlink()


def clear_trash(root: str | os.PathLike[str]) -> int:
    """Remove what an interrupted earlier run left in `<root>/.trash`; returns how many entries went."""
    trash = _trash_dir(Path(os.path.abspath(root)))
    cleared = 0
    for entry in os.scandir(trash):
        try:
            _remove(Path(entry.path))
            cleared += 1
        except OSError as exc:
            log.warning("trash_clear_failed", path=entry.path, error=exc.strerror)
    return cleared


def _direct_child_dir(root: Path, target: Path) -> str | None:
    """Why `target` may not be deleted, or None when it is a real dir directly inside `root`."""
    if target.parent != root or target.name in ("", ".", "..", TRASH_DIR):
        return "not a direct child of the checkpoint root"
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return "already gone"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return None


def execute_retention(root: str | os.PathLike[str], plan: RetentionPlan, *, empty_trash: bool = True) -> list[Deletion]:
    """Delete the plan's targets (rename into .trash, then remove); returns those actually deleted.

    With `empty_trash=False` only the (fast, atomic) renames happen: the caller empties `.trash` with
    `clear_trash`, e.g. off its event loop, since removing a large checkpoint on shared storage can be slow.
    """
    base = Path(os.path.abspath(root))
    trash = _trash_dir(base)
    if empty_trash:
        clear_trash(base)
    done: list[Deletion] = []
    for d in plan.deletions:
        target = Path(os.path.abspath(d.path))
        refused = _direct_child_dir(base, target)
        if refused:
            log.warning("retention_skipped", path=str(target), why=refused)
            continue
        parked = trash / f"{target.name}.{time.time_ns()}"
        try:
            os.rename(target, parked)
        except OSError as exc:
            log.warning("retention_rename_failed", path=str(target), error=exc.strerror)
            continue
        done.append(d)
        log.debug("checkpoint_deleted", path=str(target), reason=d.reason, size_bytes=d.size_bytes)
        if not empty_trash:
            continue
        try:
            _remove(parked)
        except OSError as exc:  # parked in .trash: invisible to scans, cleared next time
            log.warning("trash_remove_failed", path=str(parked), error=exc.strerror)
    return done
