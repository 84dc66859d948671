"""Open a file that someone else may have replaced, without ever blocking on it (stdlib only).

The job can write anything under the names the supervisor reads: the heartbeat (which it is meant to
rewrite), its output log, torchrun's error file, and - being the same user - the run dir's own files. A
plain `open()` of a FIFO planted under such a name blocks until a writer appears, and a read from a
terminal or a socket blocks until input arrives: a job that did `mkfifo $FSDP_SUPERVISOR_HEARTBEAT` once
froze the event loop for good (signals queued behind it, the job's exit never reaped). So these names are
opened with O_NONBLOCK and accepted only when they are regular files; anything else is an OSError, which
every caller already treats as "not there right now".
"""
from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

__all__ = ["open_regular", "append_regular"]


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True, mine: bool = False) -> BinaryIO:
    """Open `path` for reading in binary mode; OSError unless it is a regular file (never blocks).

    Not a regular file: EINVAL. A symlink when `follow_symlinks` is false: ELOOP. With `mine`, another user's file
    (planted in a folder others may write to): EPERM.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if mine and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not by you", os.fspath(path))
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def append_regular(path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """A blocking append-only descriptor on `path` (created `mode`), never following a symlink; OSError EINVAL
    for anything but a regular file: a FIFO planted as a log blocked the loop in its open, SIGTERM included."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    os.set_blocking(fd, True)
    return fd
