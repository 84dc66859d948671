"""Open a file inside a checkpoint dir the careful way: no symlinks, no FIFOs, bounded size; its checksum."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Any, BinaryIO

from supervisor.host.regularfile import open_regular, read_json

__all__ = ["open_capped", "load_capped_json", "read_small_json", "sha256_file"]


def open_capped(path: Path, cap: int, error: type[Exception]) -> tuple[BinaryIO, os.stat_result]:
    """Open `path` for reading unless it is a symlink, not a regular file or over `cap` bytes.

    FileNotFoundError propagates (callers decide what absence means); every other refusal raises
    `error` with a one-line reason naming the file.
    """
    try:
        f = open(open_regular(path, follow_symlinks=False), "rb")  # noqa: SIM115 - returned; never blocks on a FIFO
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{path.name} is a symlink") from None
        if exc.errno == errno.EINVAL:
            raise error(f"{path.name} is not a regular file") from None
        raise error(f"cannot open {path.name}: {exc.strerror or exc}") from None
    st = os.fstat(f.fileno())
    if st.st_size > cap:
        f.close()
        raise error(f"{path.name} is {st.st_size} bytes, over the {cap} byte cap")
    return f, st


def load_capped_json(path: Path, cap: int, error: type[Exception]) -> tuple[Any, os.stat_result]:
    """The JSON document in `path` and the file's stat, opened as `open_capped` does (FileNotFoundError
    propagates); `error` for every other refusal, "not JSON" included (any depth of nesting, bad bytes)."""
    f, st = open_capped(path, cap, error)
    with f:
        try:
            return json.loads(f.read(cap + 1)), st
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise error("not JSON") from None


def read_small_json(path: Path, cap: int) -> Any:
    """The JSON document in `path`, or None: missing, a symlink, not a regular file, over `cap` bytes, or not
    JSON (any depth of nesting, bad bytes)."""
    try:
        return read_json(path, cap, follow_symlinks=False)
    except (OSError, ValueError):
        return None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a regular file (refusing symlinks and FIFOs like `open_capped`)."""
    f, _ = open_capped(path, 1 << 62, OSError)
    digest = hashlib.sha256()
    with f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
