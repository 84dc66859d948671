"""List the checkpoints under a root, newest first, and find the newest complete one fast.

Only immediate children are considered; `.trash` is skipped; a symlinked child is listed as
`invalid` and never followed; temporary `.tmp-` dirs are listed as `partial` (retention needs them).
Order: highest step first (manifest step, else the trailing integer of the name), ties and
step-less dirs by mtime (of `.metadata`, else of the newest file); step-less dirs come after
stepped ones, so a stray `best/` copy never outranks the run's own `step_<N>` dirs.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from supervisor.checkpoints.completeness import COMPLETE, INVALID, Verdict, verify
from supervisor.layout import METADATA_NAME, TRASH_DIR
from supervisor.checkpoints.manifest import ManifestError, read_manifest
from supervisor.checkpoints.markers import is_pinned, is_quarantined
from supervisor.checkpoints.naming import is_temporary, name_step
from supervisor.errors import CheckpointError

__all__ = ["UNVERIFIED", "CheckpointInfo", "age_order", "scan", "newest_complete"]

UNVERIFIED = "unverified"  # only from scan(verify_all=False): older than the newest complete


class _Dated(Protocol):
    step: int | None
    mtime: float


def age_order(c: _Dated) -> tuple[bool, int, float]:
    """The one ordering of checkpoints, oldest first: step-less dirs before stepped ones, then step, then mtime."""
    return (c.step is not None, c.step or 0, c.mtime)


@dataclass(frozen=True)
class CheckpointInfo:
    """One child of the checkpoint root, as the supervisor, retention and the CLI see it."""

    name: str
    path: Path  # absolute, not resolved: a symlinked child stays the symlink
    step: int | None
    state: str  # complete | partial | torn | invalid (| unverified, see scan)
    reason: str | None
    size_bytes: int
    mtime: float
    pinned: bool = False
    quarantined: bool = False
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


@dataclass(frozen=True)
class _Candidate:
    name: str
    path: Path
    is_link: bool
    step: int | None
    mtime: float


def _open_root(root: str | os.PathLike[str]) -> tuple[Path, Iterator[os.DirEntry[str]]]:
    path = Path(os.path.abspath(root))
    try:
        return path, os.scandir(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint root {path} does not exist") from None
    except NotADirectoryError:
        raise CheckpointError(f"checkpoint root {path} is not a directory") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint root {path} cannot be read: {exc.strerror}") from None


def _mtime(directory: Path, fallback: float) -> float:
    try:
        return os.lstat(directory / METADATA_NAME).st_mtime
    except OSError:
        return fallback


def _step_without_name(directory: Path) -> int | None:
    try:
        manifest = read_manifest(directory)
    except ManifestError:
        return None
    return manifest.step if manifest else None


def _list_root(root: str | os.PathLike[str]) -> tuple[Path, list[_Candidate]]:
    """The checkpoint candidates under `root`, newest first, with no verification (cheap)."""
    path, entries = _open_root(root)
    found = []
    with entries:
        for entry in entries:
            if entry.name == TRASH_DIR:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished between listing and stat: a rename by retention or the trainer
            is_link = stat.S_ISLNK(st.st_mode)
            if not (is_link or stat.S_ISDIR(st.st_mode)):
                continue
            child = path / entry.name
            step = name_step(entry.name)
            if step is None and not is_link:
                step = _step_without_name(child)
            mtime = st.st_mtime if is_link else _mtime(child, st.st_mtime)
            found.append(_Candidate(entry.name, child, is_link, step, mtime))
    found.sort(key=age_order, reverse=True)
    return path, found


def _usage(directory: Path) -> tuple[int, float]:
    """Total bytes under `directory` (no symlinks followed) and the newest mtime seen (last activity)."""
    total, newest = 0, 0.0
    stack = [directory]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    newest = max(newest, st.st_mtime)
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(Path(entry.path))
                    elif not stat.S_ISLNK(st.st_mode):
                        total += st.st_size
        except OSError:
            continue
    return total, newest


def _info(c: _Candidate, verdict: Verdict | None) -> CheckpointInfo:
    if c.is_link:
        return CheckpointInfo(c.name, c.path, c.step, INVALID, "the checkpoint dir is a symlink", 0, c.mtime)
    size, newest = _usage(c.path)
    manifest = verdict.manifest if verdict else None
    if verdict is None:
        state, reason = UNVERIFIED, "not verified: older than the newest complete checkpoint"
    else:
        state, reason = verdict.state, verdict.reason
    has_metadata = os.path.lexists(c.path / METADATA_NAME)
    return CheckpointInfo(
        name=c.name,
        path=c.path,
        step=manifest.step if manifest else c.step,
        state=state,
        reason=reason,
        size_bytes=size,
        # An unfinished dir's age is its last write, so a slow save in flight is not mistaken for debris.
        mtime=c.mtime if has_metadata else max(c.mtime, newest),
        pinned=is_pinned(c.path),
        quarantined=is_quarantined(c.path),
        metrics=dict(manifest.metrics) if manifest else {},
    )


def _verify(c: _Candidate) -> Verdict | None:
    """verify(), tolerating a dir that vanished after listing (renamed by retention or the trainer)."""
    try:
        return verify(c.path)
    except CheckpointError:
        return None


def scan(root: str | os.PathLike[str], *, verify_all: bool = True) -> list[CheckpointInfo]:
    """Every checkpoint candidate under `root`, newest first.

    With verify_all=False, dirs are verified newest-first only until the newest complete,
    non-quarantined one; older ones come back with state "unverified".
    """
    _, candidates = _list_root(root)
    infos: list[CheckpointInfo] = []
    found_newest = False
    for c in candidates:
        if found_newest and not verify_all:
            infos.append(_info(c, None))
            continue
        verdict = None if c.is_link else _verify(c)
        if verdict is None and not c.is_link:
            continue  # gone
        info = _info(c, verdict)
        infos.append(info)
        found_newest = found_newest or (info.complete and not info.quarantined)
    infos.sort(key=age_order, reverse=True)
    return infos


def newest_complete(root: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The highest-step complete, non-quarantined checkpoint under `root`, or None.

    The hot path: candidates are ranked from names and stats alone, and verification stops at the
    first complete one.
    """
    _, candidates = _list_root(root)
    for c in candidates:
        if c.is_link or is_temporary(c.name) or is_quarantined(c.path):
            continue
        verdict = _verify(c)
        if verdict is not None and verdict.complete:
            return _info(c, verdict)
    return None

