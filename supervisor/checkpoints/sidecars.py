"""The folders we keep next to a checkpoint root (trash, in-use markers, the root claim): where they are, and whose.

Each is `<parent>/.<name><suffix>` of the **resolved** root (layout.sidecar_name): docs/checkpoints.md, 'What the
supervisor keeps next to the root'. Refused with `SidecarError` unless ours; why, and the clock-skew cap of
`written_at`: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection, Iterable
from pathlib import Path

from supervisor.errors import SidecarError
from supervisor.layout import sidecar_name

__all__ = ["CLOCK_SKEW_S", "resolved", "sidecar_path", "trusted_owners", "sidecar_problem", "open_sidecar",
           "written_at"]

CLOCK_SKEW_S = 86400.0  # a time written by another host may be this far ahead of ours: clocks an hour apart (a
# time zone taken for UTC, a pruner under faketime -1h) must not make every live lease of the other host stale
PathLike = str | os.PathLike[str]


def resolved(root: PathLike) -> Path:
    """The root's one identity: its absolute path with every symlink resolved."""
    return Path(os.path.realpath(root))


def sidecar_path(root: PathLike, suffix: str) -> Path:
    """Where the `suffix` sidecar of `root` lives: a hidden sibling of the resolved root."""
    base = resolved(root)
    return base.parent / sidecar_name(base.name, suffix)


def trusted_owners(root: PathLike) -> set[int]:
    """Who may own a sidecar of `root`: us, and the owner of the (resolved) root."""
    owners = {os.geteuid()}
    with contextlib.suppress(OSError):  # no root (yet): only our own sidecars
        owners.add(os.stat(root).st_uid)
    return owners


def sidecar_problem(path: Path, st: os.stat_result, owners: Collection[int], *, folder: bool = True,
                    sticky_ok: bool = False) -> str | None:
    """Why the existing entry `path` (lstat `st`) is not a sidecar (`folder`, else a file) we may use, or None;
    `sticky_ok`: a folder writable by others is ours with the sticky bit (nobody else may rename our files; pure)."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink, not a {'folder' if folder else 'file'} of ours"
    if not (stat.S_ISDIR if folder else stat.S_ISREG)(st.st_mode):
        return f"{path} is not a plain {'directory' if folder else 'file'}"
    if st.st_uid not in owners:
        also = " or the root's owner" if set(owners) != {os.geteuid()} else ""
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}){also}"
    if folder and st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_sidecar(path: Path, owners: Collection[int], *, create: bool) -> bool:
    """Check the sidecar `path` (made 0700 first if `create`); whether it exists. SidecarError when it is
    not ours to use; OSError when it cannot be created."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        # another supervisor or prune made it just now: checked below like any existing one
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    problem = sidecar_problem(path, st, owners)
    if problem:
        raise SidecarError(f"{problem}; refusing to use it. Remove it (or give it to the user that runs the "
                           "supervisor, mode 0700) and try again")
    return True


def written_at(stamps: Iterable[float | None], now: float, skew: float = CLOCK_SKEW_S) -> float | None:
    """When a record was last written, from its stamps (its own `time`, the file's mtime): the latest one
    that is not ahead of `now` by more than `skew`, clamped to `now`; None when no stamp can be trusted (pure)."""
    usable = [s for s in stamps if isinstance(s, (int, float)) and not isinstance(s, bool) and s <= now + skew]
    return min(max(usable), now) if usable else None
