"""Open a file inside a checkpoint dir the careful way: no symlinks, no FIFOs, bounded size; its checksum."""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["open_regular", "sha256_file"]


def open_regular(path: Path, cap: int, error: type[Exception]) -> tuple[BinaryIO, os.stat_result]:
    """Open `path` for reading unless it is a symlink, not a regular file or over `cap` bytes.

    FileNotFoundError propagates (callers decide what absence means); every other refusal raises
    `error` with a one-line reason naming the file.
    """
    # O_NONBLOCK: opening a FIFO planted under a checkpoint name must not hang the supervisor.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{path.name} is a symlink") from None
        raise error(f"cannot open {path.name}: {exc.strerror or exc}") from None
    # Checked on the bare fd: os.fdopen() itself raises IsADirectoryError for a directory (Eclipse keeps a
    # `.metadata/` folder in every workspace), which no caller expects.
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path.name} is not a regular file")
        if st.st_size > cap:
            raise error(f"{path.name} is {st.st_size} bytes, over the {cap} byte cap")
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: Path) -> str:
    """Hex sha256 of a regular file (refusing symlinks and FIFOs like `open_regular`)."""
    f, _ = open_regular(path, 1 << 62, OSError)
    digest = hashlib.sha256()
    with f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
