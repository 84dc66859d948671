"""Open a file that someone else may have replaced, without ever blocking on it (stdlib only).

Names the job can write are opened O_NONBLOCK and accepted only as regular files; anything else is an OSError,
which every caller treats as "not there right now". Why (a planted FIFO froze the loop): docs/design.md,
'Notes for maintainers'.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

__all__ = ["open_regular", "read_json"]


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600, *,
                 follow_symlinks: bool = True, mine: bool = False) -> int:
    """`os.open` that never blocks and accepts a regular file only (the fd is blocking again once checked).

    Not a regular file: OSError EINVAL. A symlink when `follow_symlinks` is false: ELOOP. With `mine`, another
    user's file (planted in a folder others may write to): EPERM. Read it with `open(open_regular(path), "rb")`.
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW), mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if mine and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not by you", os.fspath(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_json(path: str | os.PathLike[str], cap: int, *, follow_symlinks: bool = True) -> Any:
    """The JSON document in `path`: OSError when it is no regular file (as `open_regular`), ValueError when it is
    over `cap` bytes or not JSON (bad bytes, nesting deep enough to exhaust the parser)."""
    with open(open_regular(path, follow_symlinks=follow_symlinks), "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"over {cap} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None
