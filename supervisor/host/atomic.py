"""Atomic file replacement: readers see the old content or the new one, never a torn file (stdlib only).

The one way this project writes a file that someone else reads while it may change. The temporary sibling's name
and the rename: docs/design.md, 'Notes for maintainers'.
"""
from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

__all__ = ["replacing", "write_atomic", "fsync_dir", "temporaries", "TMP_SUFFIX"]

TMP_SUFFIX = ".tmp"
_TOKEN = re.compile(r"[0-9a-f]{8}")  # secrets.token_hex(4): what `replacing` puts between the name and TMP_SUFFIX


@contextmanager
def replacing(path: str | os.PathLike[str], *, durable: bool = True, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it (if `durable`) and rename it over `path`.

    The temporary file is created empty with `mode` (default: like open(), 0o666 less the umask); whoever
    writes it may also replace it (torch.save does). On any error it is removed and `path` is left as it was.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    # Created like open() would (0o666 less the umask) unless `mode` says otherwise; O_EXCL: never reuse.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666 if mode is None else mode))
    try:
        yield tmp
        if durable:
            _fsync(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically (see `replacing`)."""
    with replacing(path, durable=durable, mode=mode) as tmp, open(tmp, "wb") as f:
        f.write(data)


def temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """The temporary siblings of `path` that `replacing` left behind (a writer killed midway, or still writing).

    Only `replacing`'s exact pattern (`.<name>.<8 hex>.tmp`): a `.<name>.backup.tmp` of someone else is not ours.
    """
    target = Path(path)
    cut = len(target.name) + 2
    return sorted(p for p in target.parent.glob(f".{glob_escape(target.name)}.*{TMP_SUFFIX}")
                  if _TOKEN.fullmatch(p.name[cut:-len(TMP_SUFFIX)]))


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so that the names in it (creates, renames) are durable."""
    _fsync(directory, os.O_DIRECTORY)


def _fsync(path: str | os.PathLike[str], flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
