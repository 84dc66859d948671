"""The files around an export, and which of them an export may replace or delete: only what it can prove it made.

A safetensors export `OUT` (`model.safetensors`) may be split into shards `<stem>-0000k-of-0000n<suffix>` plus an
index `OUT.index.json`: names derived from OUT, which a downloaded hub model in the same folder also uses. So:

- **The record.** A sharded export writes `.<OUT name>.export.json` beside OUT: the shards and the index it
  wrote, each with the identity it had (inode, size, mtime). A later export to OUT deletes or replaces a derived
  file only when the record lists it *and* the file still has that identity (renames keep it; a download or a
  copy over it does not). Any other derived file (a hub model's shards or index, one an older version wrote)
  makes the export refuse with one line naming it: it would otherwise be deleted, replaced, or left beside the
  new export for a loader to mix in. A single-file export needs no record (OUT itself is the name the user gave).
- **Staging.** Each export writes into its own folder `.<OUT name>.export-<pid>-<token>.tmp/` (safetensors'
  writer puts its own `.tmpXXXXXX` there too) and renames the finished files into place.
- **Leftovers** of an export killed midway are removed only by those patterns: a staging folder of a process
  that no longer runs (and inside it only the names an export puts there), and `replacing`'s
  `.<name>.<8 hex>.tmp`. Anything else (another program's `.tmpAb12Cd`) is never touched.

Callers hold `locked(OUT's folder)` around a write: one writer at a time among runs sharing the folder.
Standard library only: `trainer.args` validates `--export-best` with it before `import torch`.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.checkpoints import open_capped
from supervisor.errors import ExportConflictError
from supervisor.host.atomic import temporaries, write_atomic

__all__ = ["SAFETENSORS_SUFFIX", "RECORD_SUFFIX", "Record", "is_safetensors", "shard_file_names", "index_name",
           "record_name", "read_record", "write_record", "drop_record", "refuse_foreign", "conflict", "staging",
           "identify", "new_token", "remove_leftovers", "remove_owned", "locked"]

SAFETENSORS_SUFFIX = ".safetensors"
RECORD_SUFFIX = ".export.json"
_FORMAT = 1
_WRITER = "trainer.export"
_MAX_RECORD_BYTES = 4 << 20  # ~60 bytes a file: room for tens of thousands of shards
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")  # safetensors (Rust tempfile) writes there, then renames
_STAGE = r"\.export-(?P<pid>\d+)-[0-9a-f]{8}\.tmp"


def is_safetensors(out: Path) -> bool:
    return out.name.lower().endswith(SAFETENSORS_SUFFIX)


def _split(out: Path) -> tuple[str, str]:
    """(stem, suffix as the user spelt it): `MODEL.SAFETENSORS` -> ("MODEL", ".SAFETENSORS")."""
    cut = len(out.name) - len(SAFETENSORS_SUFFIX)
    return out.name[:cut], out.name[cut:]


def shard_file_names(out: Path, count: int) -> list[Path]:
    """`model.safetensors` split in 3: `model-00001-of-00003.safetensors`, ... (1-based, 5 digits, hub style)."""
    stem, suffix = _split(out)
    return [out.with_name(f"{stem}-{k:05d}-of-{count:05d}{suffix}") for k in range(1, count + 1)]


def index_name(out: Path) -> Path:
    return out.with_name(f"{out.name}.index.json")


def record_name(out: Path) -> Path:
    return out.with_name(f".{out.name}{RECORD_SUFFIX}")


def _is_derived(out: Path, name: str) -> bool:
    """Is `name` one of the names a sharded export to `out` writes (a shard of any count, or the index)?"""
    if not is_safetensors(out):
        return False
    stem, suffix = _split(out)
    shard = re.fullmatch(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(suffix)}", name, re.DOTALL)
    return shard is not None or name == index_name(out).name


def _derived(out: Path) -> list[Path]:
    """The derived names present beside `out` (whoever wrote them)."""
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    return sorted(out.parent / n for n in names if _is_derived(out, n))


@dataclass(frozen=True)
class _Identity:
    name: str
    ino: int
    size: int
    mtime_ns: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ino": self.ino, "size": self.size, "mtime_ns": self.mtime_ns}


def identify(path: Path, name: str | None = None) -> _Identity | None:
    """The identity a record keeps for a regular file (None: missing, or not a regular file); `name`: the name
    it will have once renamed into place."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return _Identity(name or path.name, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Record:
    """What earlier exports to one OUT wrote (empty: none recorded)."""

    out: Path
    files: tuple[_Identity, ...] = ()

    def owns(self, path: Path) -> bool:
        """Was this very file (name and identity) written by a recorded export?"""
        found = identify(path)
        return found is not None and found in self.files

    def present(self) -> list[Path]:
        """The recorded files still in place, unchanged."""
        return sorted({self.out.with_name(f.name) for f in self.files if self.owns(self.out.with_name(f.name))})


def _parse_record(out: Path, raw: Any) -> tuple[_Identity, ...] | None:
    if type(raw) is not dict or set(raw) != {"format", "writer", "output", "token", "files"}:
        return None
    if raw["format"] != _FORMAT or raw["writer"] != _WRITER or raw["output"] != out.name:
        return None
    if type(raw["files"]) is not list:
        return None
    found = []
    for f in raw["files"]:
        if type(f) is not dict or set(f) != {"name", "ino", "size", "mtime_ns"} or type(f["name"]) is not str:
            return None
        if not _is_derived(out, f["name"]) or any(type(f[k]) is not int for k in ("ino", "size", "mtime_ns")):
            return None
        found.append(_Identity(f["name"], f["ino"], f["size"], f["mtime_ns"]))
    return tuple(found)


def read_record(out: Path) -> Record:
    """The record beside `out` (empty when there is none); ExportConflictError when a file has the record's
    name but is not a record an export of ours wrote (it is then never replaced)."""
    path = record_name(out)
    try:
        f, _ = open_capped(path, _MAX_RECORD_BYTES, ExportConflictError)
    except FileNotFoundError:
        return Record(out)
    except ExportConflictError as exc:
        raise ExportConflictError(f"{path}: not an export record of ours ({exc}): move it away") from None
    with f:
        try:
            files = _parse_record(out, json.loads(f.read(_MAX_RECORD_BYTES + 1)))
        except (ValueError, UnicodeDecodeError, RecursionError):
            files = None
    if files is None:
        raise ExportConflictError(f"{path}: not an export record of ours (unexpected content): move it away")
    return Record(out, files)


def write_record(out: Path, files: Iterable[_Identity], token: str) -> None:
    """Replace the record beside `out` (atomically, durably: it must be on disk before the files it names)."""
    body = {"format": _FORMAT, "writer": _WRITER, "output": out.name, "token": token,
            "files": [f.to_json() for f in dict.fromkeys(files)]}
    write_atomic(record_name(out), json.dumps(body, indent=1).encode() + b"\n")


def drop_record(out: Path) -> None:
    """Remove the record (the export to `out` is a single file now); only ever after read_record accepted it."""
    record_name(out).unlink(missing_ok=True)


def conflict(out: Path) -> str | None:
    """Why an export to `out` must not run (a derived name it does not own, a foreign record), or None."""
    try:
        refuse_foreign(read_record(out))
    except ExportConflictError as exc:
        return str(exc)
    return None


def refuse_foreign(record: Record) -> None:
    """ExportConflictError naming the first derived file beside OUT that the record does not prove ours."""
    for path in _derived(record.out):
        if not record.owns(path):
            raise ExportConflictError(
                f"{path}: not written by an export of ours (its record {record_name(record.out).name} does not list "
                "it); an export would delete, replace or mix with it: move it away or export to another folder")


def new_token() -> str:
    return secrets.token_hex(4)


@contextmanager
def staging(out: Path, token: str) -> Iterator[Path]:
    """A private folder beside `out` to write into (then rename from); what is left in it is removed after."""
    stage = out.with_name(f".{out.name}.export-{os.getpid()}-{token}.tmp")
    os.mkdir(stage, 0o700)
    try:
        yield stage
    finally:
        _clear_stage(out, stage)


def _clear_stage(out: Path, stage: Path) -> bool:
    """Remove the names an export puts in its staging folder, then the folder; False when anything else is there."""
    try:
        names = os.listdir(stage)
    except OSError:
        return False
    for name in names:
        if (name == out.name or _is_derived(out, name) or _SAFETENSORS_TMP.fullmatch(name)) and identify(stage / name):
            (stage / name).unlink(missing_ok=True)
    try:
        os.rmdir(stage)
    except OSError:  # something we did not put there: leave it all
        return False
    return True


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours from an earlier write in this process: it ended (staging cleans up; this is its rest)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or a pid no system has): not provably gone
    return True


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)  # a symlink is not followed
    except OSError:
        return False


def remove_leftovers(out: Path) -> list[Path]:
    """Remove what writers of `out` killed midway left beside it, only by our own name patterns; returns them."""
    stage = re.compile(re.escape(f".{out.name}") + _STAGE, re.DOTALL)
    gone = []
    try:
        names = sorted(os.listdir(out.parent))
    except OSError:
        return []
    for name in names:
        found = stage.fullmatch(name)
        path = out.parent / name
        if found is None or _alive(int(found["pid"])):
            continue
        if _is_dir(path) and _clear_stage(out, path):
            gone.append(path)
    for path in temporaries(out):
        if identify(path) is not None:
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


def remove_owned(record: Record, paths: Sequence[Path]) -> None:
    """Unlink each path the record still proves ours at this moment (checked again just before)."""
    for path in paths:
        if record.owns(path):
            path.unlink(missing_ok=True)


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on the folder itself, released on close: one writer at a time among runs sharing it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a file system without flock: one writer per folder, as before locking existed
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
