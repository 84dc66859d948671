"""Pin and quarantine markers: small files inside a checkpoint dir that the store honours.

A pinned dir is never deleted by retention; a quarantined dir is never selected for resume. Any entry under the
marker name counts, even an unreadable one: when in doubt, keep and do not select. Only ours are written or
removed; what the commands accept and refuse: docs/checkpoints.md, 'pin, unpin, unquarantine'.
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import structlog

from supervisor.checkpoints._files import load_capped_json
from supervisor.checkpoints.completeness import lstat_dir
from supervisor.checkpoints.shapes import DCP, DIRECTORY, FILES, NESTED, TEMPORARY, UNSTARTED, identify
from supervisor.errors import CheckpointError
from supervisor.host.atomic import write_atomic
from supervisor.layout import PIN_MARKER, QUARANTINE_MARKER

__all__ = ["pin", "unpin", "is_pinned", "quarantine", "unquarantine", "is_quarantined", "quarantine_reason",
           "checkpoint_in_root"]

log = structlog.get_logger(__name__)
_MAX_MARKER_BYTES = 64 * 1024
_BY = "fsdp-supervisor"
_FIELDS = {PIN_MARKER: {"by", "time"}, QUARANTINE_MARKER: {"by", "time", "reason"}}
_NOT_MARKABLE = {TEMPORARY: "a save in flight (a .tmp- name)", DIRECTORY: "a folder of checkpoints, not one"}


def _checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    directory = Path(os.path.abspath(path))
    if not stat.S_ISDIR(lstat_dir(directory).st_mode):  # a symlink is refused too: markers go into real dirs only
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    return directory


def _whole_checkpoint_dir(path: str | os.PathLike[str], verb: str) -> Path:
    """`_checkpoint_dir`, refusing a member of a nested checkpoint (`checkpoint_3/optimizer_0`): retention judges
    and deletes the whole folder, so a marker inside a member protects nothing while it says it does."""
    directory = _checkpoint_dir(path)
    owner = _nested_owner(directory)
    if owner is not None:
        raise CheckpointError(f"{directory} is a part of the checkpoint {owner}: {verb} {owner} instead")
    return directory


def checkpoint_in_root(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """`path` when it is a checkpoint directly under `root` (compared resolved); CheckpointError naming why not.

    What pin, unpin and unquarantine may act on: a DCP dir or a nested folder (a checkpoint-named folder still
    empty too), never a save in flight, a member of a nested checkpoint, or anything foreign."""
    directory = _whole_checkpoint_dir(path, "name")
    if os.path.realpath(directory.parent) != os.path.realpath(root):
        raise CheckpointError(f"{directory}: not in the checkpoint root {root}: only its own checkpoints are marked")
    shape = identify(directory)
    if shape.kind not in (DCP, NESTED, FILES, UNSTARTED):
        why = _NOT_MARKABLE.get(shape.kind) or shape.reason or "not a checkpoint"
        raise CheckpointError(f"{directory}: not a checkpoint of {root} ({why})")
    return directory


def _foreign_marker(marker: Path) -> str | None:
    """Why the entry at `marker` is not a marker we wrote, or None when it is ours (FileNotFoundError: none)."""
    try:
        body, _ = load_capped_json(marker, _MAX_MARKER_BYTES, CheckpointError)
    except CheckpointError as exc:
        return str(exc)
    time_ok = type(body) is dict and type(body.get("time")) in (int, float)
    if not time_ok or not set(body) <= _FIELDS[marker.name] or body.get("by") != _BY:
        return "not the JSON object fsdp-supervisor writes"
    if marker.name == QUARANTINE_MARKER and type(body.get("reason")) is not str:
        return "no reason recorded"
    return None


def _write_marker(directory: Path, name: str, payload: dict[str, Any]) -> bool:
    """Write our marker; False (nothing written) when an entry that is not ours already has its name: it counts."""
    try:
        theirs = _foreign_marker(directory / name)
    except FileNotFoundError:
        theirs = None
    if theirs is not None:
        log.info("marker_kept", path=str(directory / name), reason=theirs)
        return False
    try:  # a reader sees no marker or a whole one
        write_atomic(directory / name, json.dumps({"by": _BY, **payload}).encode())
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot write {name}: {exc.strerror or exc}") from None
    return True


def _remove_marker(directory: Path, name: str) -> bool:
    """Remove our marker; False when there is none; CheckpointError for an entry that is not ours (kept)."""
    try:
        theirs = _foreign_marker(directory / name)
    except FileNotFoundError:
        return False
    if theirs is not None:
        raise CheckpointError(f"{directory / name}: not a marker fsdp-supervisor wrote ({theirs}): left as it is; "
                              "remove it yourself if you mean to")
    try:
        os.unlink(directory / name)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot remove {name}: {exc.strerror}") from None
    return True


def _nested_owner(directory: Path) -> Path | None:
    """The nested checkpoint (`checkpoint_N/`) that holds `directory` as a member, if any."""
    for owner in (directory.parent, directory.parent.parent):
        try:
            relative = directory.relative_to(owner).as_posix()
            if stat.S_ISDIR(os.lstat(owner).st_mode) and relative in identify(owner).members:
                return owner
        except (OSError, ValueError):
            continue
    return None


def pin(path: str | os.PathLike[str]) -> Path:
    """Mark a checkpoint dir so that retention never deletes it (never a nested checkpoint's member); returns it."""
    directory = _whole_checkpoint_dir(path, "pin")
    _write_marker(directory, PIN_MARKER, {"time": time.time()})
    log.info("checkpoint_pinned", path=str(directory))
    return directory


def unpin(path: str | os.PathLike[str]) -> bool:
    """Remove the pin marker; returns whether there was one."""
    directory = _checkpoint_dir(path)
    removed = _remove_marker(directory, PIN_MARKER)
    log.info("checkpoint_unpinned", path=str(directory), was_pinned=removed)
    return removed


def is_pinned(path: str | os.PathLike[str]) -> bool:
    return os.path.lexists(Path(path) / PIN_MARKER)


def quarantine(path: str | os.PathLike[str], reason: str) -> Path:
    """Mark a checkpoint dir as never to be resumed from, recording why and when."""
    directory = _checkpoint_dir(path)
    _write_marker(directory, QUARANTINE_MARKER, {"reason": reason, "time": time.time()})
    log.warning("checkpoint_quarantined", path=str(directory), reason=reason)
    return directory


def unquarantine(path: str | os.PathLike[str]) -> bool:
    """Remove the quarantine marker (a human decided the dir is fine); returns whether there was one."""
    return _remove_marker(_checkpoint_dir(path), QUARANTINE_MARKER)


def is_quarantined(path: str | os.PathLike[str]) -> bool:
    return os.path.lexists(Path(path) / QUARANTINE_MARKER)


def quarantine_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the dir was quarantined, or None when it is not."""
    marker = Path(path) / QUARANTINE_MARKER
    try:
        body, _ = load_capped_json(marker, _MAX_MARKER_BYTES, CheckpointError)
    except FileNotFoundError:
        return None
    except CheckpointError as exc:
        if str(exc) == "not JSON":
            return "quarantined (no reason recorded)"
        return f"quarantined (marker unreadable: {exc})" if os.path.lexists(marker) else None
    reason = body.get("reason") if isinstance(body, dict) else None
    return str(reason) if reason else "quarantined (no reason recorded)"
