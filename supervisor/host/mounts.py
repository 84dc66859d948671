"""Which mount a path is on: a rename between two mounts fails (EXDEV) even on one file system.

Read from /proc/self/mountinfo (the longest mount point above the path; the last, topmost, for a point mounted
twice); None when it cannot be read: callers then go by `st_dev` alone. Why not `st_dev` (bind mounts), and what
`identity` means: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import os
import re

__all__ = ["mount_id", "same_mount", "identity"]

_MOUNTINFO = "/proc/self/mountinfo"
_ESCAPED = re.compile(rb"\\([0-7]{3})")  # mountinfo writes space, tab, newline and backslash as \ooo
PathLike = str | os.PathLike[str]


def identity(path: PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` names now (symlinks followed), or None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _unescape(field: bytes) -> bytes:
    return _ESCAPED.sub(lambda m: bytes([int(m.group(1), 8)]), field)


def _under(path: bytes, point: bytes) -> bool:
    return point == b"/" or path == point or path.startswith(point.rstrip(b"/") + b"/")


def mount_id(path: PathLike, mountinfo: bytes | None = None) -> int | None:
    """The id of the mount `path` (symlinks resolved) is on, or None when unknown. `mountinfo`: the file's
    content, for tests."""
    real = os.fsencode(os.path.realpath(path))
    if mountinfo is None:
        try:
            with open(_MOUNTINFO, "rb") as f:
                mountinfo = f.read()
        except OSError:
            return None
    best: tuple[int, int] | None = None  # (length of the mount point, mount id)
    for line in mountinfo.splitlines():
        fields = line.split(b" ")
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        point = _unescape(fields[4])
        if _under(real, point) and (best is None or len(point) >= best[0]):
            best = (len(point), int(fields[0]))
    return best[1] if best is not None else None


def same_mount(a: PathLike, b: PathLike) -> bool:
    """Whether a rename between `a` and `b` stays on one mount (True when that cannot be told)."""
    ma, mb = mount_id(a), mount_id(b)
    return ma is None or mb is None or ma == mb
