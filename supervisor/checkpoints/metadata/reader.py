"""Read DCP's `.metadata` without torch, without running code from it, at bounded cost, once per file.

`.metadata` is a plain pickle of `torch.distributed.checkpoint.metadata.Metadata`; `pickle.load` would
import and call whatever globals it names. The store needs three things from it: the storage files
with the bytes each must hold (from `storage_data`), the entry count and the version.

- Safety (`metadata_allowlist`): globals resolve only to inert stand-ins; a refused one raises
  UnsafeMetadataError ("refuses os.system (could run code)") or, for a torch name we do not know,
  UnknownClassError ("unknown class ... (written by a newer torch?)").
- Cost (`metadata_scan`, `metadata_records`): an opcode loop with its own small value model, fed
  256 KiB at a time, plus a regex fast path for the two record shapes that fill large files. Time is
  linear in the size; memory is charged and capped at MEMORY_FACTOR (8) x the size + 16 MiB, whatever
  the input. Measured with `python -m bench --only metadata` on the 2-core dev machine: a Llama-3 70B
  FSDP2 + AdamW checkpoint of 64 ranks (25 MB `.metadata`) parses in 0.92 CPU s against 2.54 s for
  torch's own `pickle.load` of the same file (0.36x), 1024 ranks (391 MB) in 12 s (31-36 ms per MB at
  every size), and the parse's peak RSS is 1.9-2.0x the file size (torch's load: 12x).
- Size cap: MAX_METADATA_BYTES = 1 GiB. Llama-3 405B x 1024 ranks (the largest shape in
  `bench.synthetic`) writes a 621 MB `.metadata`; a bigger file is refused before it is read.
- Once per file (`metadata_cache`): results (and parse errors) are kept per (path, st_dev, st_ino,
  st_size, st_mtime_ns, st_ctime_ns) in this process, and in a per-user cache dir shared by the daemon,
  the CLI and the trainer's `--resume auto` (there also per reader version), both bounded by bytes (cache.py).
  A file modified or changed (mtime or ctime) in the last RACY_NS is not remembered yet. Within `fresh()`
  (`checkpoints verify --no-cache`) nothing remembered is used: every file is parsed again and its entries are replaced.
"""
from __future__ import annotations

import io
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from supervisor.checkpoints._files import open_capped
from supervisor.checkpoints.metadata import cache as metadata_cache
from supervisor.checkpoints.metadata import child as metadata_child
from supervisor.checkpoints.metadata.allowlist import ALLOWED_GLOBALS, DTYPE_NAMES
from supervisor.checkpoints.metadata.scan import Scanned, ScannedDict, StorageInfo, scan
from supervisor.errors import MetadataError, RefusedGlobalError, UnknownClassError, UnsafeMetadataError
from supervisor.host.gcpause import collector_paused

__all__ = [
    "MAX_METADATA_BYTES",
    "ALLOWED_GLOBALS",
    "DTYPE_NAMES",
    "MetadataError",
    "RefusedGlobalError",
    "UnsafeMetadataError",
    "UnknownClassError",
    "StorageRef",
    "DcpMetadata",
    "parse_metadata",
    "read_metadata",
    "fresh",
    "COUNTS",
    "RACY_NS",
]

MAX_METADATA_BYTES = 1 << 30
# A file modified (or changed: ctime) this recently is parsed but not remembered: a rewrite within the same
# clock tick (or into a reused inode number) could keep size, mtime and ctime, so its identity is not yet
# trustworthy.
RACY_NS = 2 * 10**9
# How often each source answered read_metadata in this process: "parsed", "memory", "disk" (for tests).
COUNTS: Counter[str] = Counter()


@dataclass(frozen=True)
class StorageRef:
    """One storage file the metadata points into, and how many bytes it must hold."""

    relative_path: str
    min_size: int  # max(offset + length) over every item stored in it
    items: int


@dataclass(frozen=True)
class DcpMetadata:
    """The parts of DCP's Metadata that decide completeness."""

    version: str | None
    entries: int  # keys in state_dict_metadata
    storage: tuple[StorageRef, ...]


def _summarize(root: Any) -> DcpMetadata:
    """The completeness summary of a scanned pickle; MetadataError when it does not have DCP's shape."""
    if type(root) is not Scanned:
        raise MetadataError("top-level object is not DCP Metadata")
    sdm, storage = root.state_dict_metadata, root.storage_data
    if type(sdm) is not ScannedDict:
        raise MetadataError("state_dict_metadata is missing or not a dict")
    keys = sdm[0::2]
    if any(type(k) is not str for k in keys):
        raise MetadataError("state_dict_metadata has a key that is not a string")
    if type(storage) is not ScannedDict:
        raise MetadataError("storage_data is missing or not a dict")
    need: dict[str, list[int]] = {}
    for info in storage[1::2]:
        if type(info) is not StorageInfo or info.relative_path is None:
            raise MetadataError("storage_data has a value that is not a _StorageInfo")
        slot = need.get(info.relative_path)
        if slot is None:
            need[info.relative_path] = [info.end, 1]
        else:
            slot[0] = max(slot[0], info.end)
            slot[1] += 1
    version = root.version
    return DcpMetadata(
        version=version if type(version) is str else None,
        entries=len(set(keys)),
        storage=tuple(StorageRef(rel, end, n) for rel, (end, n) in sorted(need.items())),
    )


def _dismantle(root: Any) -> None:
    """Free a scanned graph a slice at a time.

    Dropped in one go, the millions of objects of a 70B x 256 parse are freed by one cascade of
    deallocations that holds the GIL for ~100 ms; slices of 256 entries (a tensor's chunks each) give
    other threads a turn between them.
    """
    if type(root) is not Scanned:
        return
    for part in (root.state_dict_metadata, root.storage_data):
        if type(part) is ScannedDict:
            while part:
                del part[-256:]


def _parse(f: BinaryIO, size: int) -> DcpMetadata:
    # The collector paused: a 70B x 64 parse made 202 collections, each stalling the loop thread.
    with collector_paused():
        root = scan(f, size)
        try:
            return _summarize(root)
        finally:
            _dismantle(root)


def parse_metadata(data: bytes) -> DcpMetadata:
    """Parse `.metadata` bytes; raise MetadataError (a RefusedGlobalError subclass for refused globals)."""
    return _parse(io.BytesIO(data), len(data))


# ---- once per file ----------------------------------------------------------------------------------

_cache = metadata_cache.MEMORY  # results kept in this process
_fresh: ContextVar[bool] = ContextVar("metadata_fresh", default=False)


@contextmanager
def fresh() -> Iterator[None]:
    """Within: every `.metadata` read is parsed again (nothing remembered is used) and remembered anew."""
    token = _fresh.set(True)
    try:
        yield
    finally:
        _fresh.reset(token)


def _error_json(exc: MetadataError) -> dict[str, Any]:
    name = exc.global_name if isinstance(exc, RefusedGlobalError) else None
    return {"kind": exc.kind, "message": str(exc), "global": name}


def _error(e: dict[str, Any]) -> MetadataError:
    """A fresh exception for a remembered error (re-raising one instance would grow its traceback)."""
    cls = {"unsafe": UnsafeMetadataError, "unknown_class": UnknownClassError}.get(e["kind"])
    return cls(e["message"], e["global"] or "") if cls else MetadataError(e["message"])


def _summary_json(meta: DcpMetadata) -> dict[str, Any]:
    storage = [[r.relative_path, r.min_size, r.items] for r in meta.storage]
    return {"version": meta.version, "entries": meta.entries, "storage": storage}


def _summary(s: dict[str, Any]) -> DcpMetadata:
    refs = tuple(StorageRef(rel, end, n) for rel, end, n in s["storage"])
    return DcpMetadata(version=s["version"], entries=s["entries"], storage=refs)


def _lookup(path: Path, f: BinaryIO, st: os.stat_result, root: Path | None) -> DcpMetadata | dict[str, Any]:
    """This file's result: from this process, from the disk cache, or parsed now (then remembered)."""
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    bypass = _fresh.get()
    remembered = None if bypass else _cache.get(key)
    if remembered is not None:
        COUNTS["memory"] += 1
        return remembered[0]  # type: ignore[no-any-return]
    entry = None if bypass else metadata_cache.load(path, st, root)
    racy = False
    if entry is not None:
        COUNTS["disk"] += 1
    else:
        COUNTS["parsed"] += 1
        racy = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS
        entry = metadata_child.parse_in_child(f, st.st_size)  # None: not isolating, or no answer from the child
        if entry is None:
            try:
                entry = {"summary": _summary_json(_parse(f, st.st_size))}
            except MetadataError as exc:
                entry = {"error": _error_json(exc)}
        if not racy:
            metadata_cache.store(path, st, entry, root)
    found = _summary(entry["summary"]) if "summary" in entry else entry["error"]
    if racy:
        return found
    _cache.put(key, found, metadata_cache.PARSED_FACTOR * len(str(entry)))
    return found


def read_metadata(path: Path, *, cached: bool = True, root: Path | None = None) -> DcpMetadata:
    """Read and parse one `.metadata` file (not following a symlink), or take its result from a cache.

    cached=False always parses and remembers nothing (benchmarks). `root`: the checkpoint root the file is
    under (default: its grandparent), where the disk cache must never be.
    """
    try:
        f, st = open_capped(path, MAX_METADATA_BYTES, MetadataError)
    except FileNotFoundError:
        raise MetadataError(f"{path.name} is missing") from None
    with f:
        if not cached:
            return _parse(f, st.st_size)
        found = _lookup(path, f, st, root)
    if isinstance(found, DcpMetadata):
        return found
    raise _error(found)
