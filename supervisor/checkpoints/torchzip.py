"""Files written by `torch.save` (a zip holding `<archive>/data.pkl` and the storages), read without torch.

Lightning's `meta.pt` (docs/checkpoints.md, 'Clients' last files'). How `zip_problem` and `read_pickle` judge it:
docs/design.md, 'Notes for maintainers'. Anything wrong is a reason string, never an exception. Torch-free.
"""
from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path
from typing import Any

from supervisor.checkpoints._files import open_capped
from supervisor.checkpoints.metadata.allowlist import INERT
from supervisor.checkpoints.metadata.scan import Policy, ScannedDict, scan
from supervisor.errors import MetadataError

__all__ = ["OPAQUE", "MAX_PICKLE_BYTES", "zip_problem", "read_pickle"]

MAX_PICKLE_BYTES = 16 << 20
MAX_MEMBERS = 1 << 16
MAX_DEPTH = 16  # dicts in dicts kept as dicts (Lightning's callback state is 3 deep); deeper ones are OPAQUE
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header: signature ... name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


OPAQUE = INERT  # whatever the store never builds: objects, tensors, storages, floats, bytes, lists


class _Unreadable(Exception):
    """Why the file cannot be used (internal: the public functions return the reason)."""


def _open(path: Path) -> tuple[Any, int]:
    try:
        f, st = open_capped(path, 1 << 62, _Unreadable)  # any size: only the directory and data.pkl are read
    except FileNotFoundError:
        raise _Unreadable("missing") from None
    return f, st.st_size


def _members(f: Any, size: int) -> tuple[zipfile.ZipFile, list[zipfile.ZipInfo]]:
    try:
        z = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error):
        raise _Unreadable("not a whole zip (no end-of-central-directory record: cut short?)") from None
    infos = z.infolist()
    if len(infos) > MAX_MEMBERS:
        raise _Unreadable(f"{len(infos)} zip members, over {MAX_MEMBERS}")
    return z, infos


def _check_member(f: Any, size: int, info: zipfile.ZipInfo) -> None:
    if info.compress_type != zipfile.ZIP_STORED:
        raise _Unreadable(f"member {info.filename[:80]!r} is compressed (torch.save never compresses)")
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or head[:4] != _LOCAL_SIGNATURE:
        raise _Unreadable(f"member {info.filename[:80]!r} has no local header where the directory says")
    fields = _LOCAL_HEADER.unpack(head)
    end = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10] + info.compress_size
    if end > size:
        raise _Unreadable(f"member {info.filename[:80]!r} runs past the end of the file")


def _data_pkl(infos: list[zipfile.ZipInfo]) -> zipfile.ZipInfo:
    found = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(found) != 1:
        raise _Unreadable("no <archive>/data.pkl member: not a torch.save file")
    return found[0]


def zip_problem(path: Path) -> str | None:
    """Why `path` is not a whole torch.save zip (missing, a symlink, cut short, ...), or None when it is."""
    try:
        f, size = _open(path)
        with f:
            _, infos = _members(f, size)
            _data_pkl(infos)
            for info in infos:
                _check_member(f, size, info)
    except _Unreadable as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    return None


def read_pickle(path: Path) -> tuple[Any, None] | tuple[None, str]:
    """(the root value of `path`'s data.pkl, None), or (None, why it cannot be read). Runs no code."""
    try:
        f, size = _open(path)
        with f:
            z, infos = _members(f, size)
            info = _data_pkl(infos)
            if info.file_size > MAX_PICKLE_BYTES:
                raise _Unreadable(f"data.pkl is {info.file_size} bytes, over {MAX_PICKLE_BYTES}")
            _check_member(f, size, info)
            data = z.read(info)  # stored: no decompression; the CRC is checked
        return _plain(scan(io.BytesIO(data), len(data), fast=False, policy=_NAMES_ONLY), 0, {}), None
    except (_Unreadable, MetadataError) as exc:
        return None, str(exc)
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return None, f"cannot be read: {exc}"


class _OrderedDict:
    """`collections.OrderedDict`, the one global REDUCE turns into something (a dict)."""


def _names_only(module: Any, name: Any) -> Any:
    return _OrderedDict if module == "collections" and name == "OrderedDict" else OPAQUE


def _reduce(func: Any, args: Any) -> Any:
    if func is _OrderedDict:
        d = ScannedDict()
        d.slot = -1
        return d
    return OPAQUE


class _NamesOnly(Policy):
    """A global is only a name: never imported, never refused; what is built on it is OPAQUE."""

    find_global = staticmethod(_names_only)
    reduce = staticmethod(_reduce)
    new = staticmethod(lambda cls: OPAQUE)
    build = staticmethod(lambda inst, state: None)  # state on an OrderedDict: dropped
    persistent_id = staticmethod(lambda pid: OPAQUE)  # a storage's key: the storage is never loaded


_NAMES_ONLY = _NamesOnly()


def _plain(value: Any, depth: int, done: dict[int, Any]) -> Any:
    """The walker's value as plain Python: a ScannedDict becomes a dict of its str and int keys (last one wins),
    tuples stay tuples, each converted once (shared ones stay shared: no blow-up), at most MAX_DEPTH deep."""
    if type(value) is not ScannedDict and type(value) is not tuple:
        return value
    if depth >= MAX_DEPTH:
        return OPAQUE
    if id(value) in done:
        return done[id(value)]
    if type(value) is tuple:
        done[id(value)] = tuple(_plain(v, depth + 1, done) for v in value)
        return done[id(value)]
    out: dict[Any, Any] = {}
    done[id(value)] = out
    for j in range(0, len(value) - 1, 2):
        if type(value[j]) in (str, int):
            out[value[j]] = _plain(value[j + 1], depth + 1, done)
    return out
