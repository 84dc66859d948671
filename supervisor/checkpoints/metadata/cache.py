"""A per-user, on-disk cache of parsed `.metadata` summaries, so the verdict is computed once per file.

Why: the daemon, `fsdp-supervisor checkpoints list/verify` and the trainer's `--resume auto` are
different processes that read the same `.metadata`; a 70B x 1024-rank file takes seconds to parse.
Each summary (or parse error) is a small JSON file keyed by the file's path and identity
(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) and by the reader that judged it (`reader_version`:
this package's version and a digest of the metadata reader's own source). The ctime: a same-size rewrite
with its mtime put back (`cp -p`, `rsync -t`, a restore) keeps every other field, and no one can set a
ctime back. The reader: an upgrade that learns a new class must not keep the "unknown class" verdict of the
reader before it (nor one that parses differently its summaries). An entry only ever replaces parsing: the
caller still checks every shard on disk. Anything wrong with the cache (unset HOME, unwritable, not ours,
malformed or foreign entries) is a miss, never an error; at most a debug log line. Entries of an older key
are never matched again; they go with the oldest once the cache is full.

Where: $FSDP_SUPERVISOR_CACHE_DIR, else $XDG_CACHE_HOME/fsdp-supervisor, else
~/.cache/fsdp-supervisor; entries go in its `metadata-v1/`. The dir must be owned by this user and
not writable by others, and is never used when it lies inside the checkpoint's root. At most MAX_BYTES of
entries are kept: past that the oldest are removed until 3/4 remain.

In each process, `MEMORY` keeps the parsed results by the same rule, up to MEMORY_BYTES by an estimate: PARSED_FACTOR x
their JSON's bytes (256 shards: 8.6 KB of JSON, 55 KB parsed, counted 69 KB); the daemon's passes `forget_gone` the
results of files no longer there (checkpoints retention deleted).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

from supervisor import __version__
from supervisor.checkpoints._files import load_capped_json
from supervisor.host.atomic import write_atomic

__all__ = ["CACHE_ENV", "MAX_BYTES", "MEMORY", "MEMORY_BYTES", "PARSED_FACTOR", "Memory", "cache_dir", "load", "store",
           "reader_version", "valid_result"]

CACHE_ENV = "FSDP_SUPERVISOR_CACHE_DIR"
MAX_BYTES = 256 << 20  # entries on disk
MEMORY_BYTES = 64 << 20  # parsed results in a process, estimated
PARSED_FACTOR = 8  # a parsed result's bytes per byte of its JSON (measured 6.3: tuples of StorageRef, strings, ints)
_SUBDIR = "metadata-v1"
_FORMAT = 1
_MAX_ENTRY_BYTES = 16 << 20
_MAX_REFS = 1 << 20
_ERROR_KINDS = ("bad_metadata", "unsafe", "unknown_class")
_EVICT_EVERY = 64  # writes between two counts of the entries

log = logging.getLogger(__name__)
_writes = 0


def cache_dir() -> Path | None:
    """The configured cache dir (it may not exist yet), or None when no home can be found."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "fsdp-supervisor"
    try:
        home = Path.home()
    except (KeyError, RuntimeError):
        return None
    return home / ".cache" / "fsdp-supervisor"


@functools.cache
def reader_version() -> str:
    """Who judged: this package's version and a digest of the reader's source (the allowlist, the scanner, ...),
    so that an edited checkout or an upgrade without a version bump still forgets the verdicts of the one before."""
    digest = hashlib.sha256(__version__.encode())
    package = Path(__file__).parent
    try:
        for source in sorted(package.glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    except OSError:  # sources unreadable (a zipped install): the version alone
        pass
    return f"{__version__}+{digest.hexdigest()[:16]}"


def _key(path: Path, st: os.stat_result) -> dict[str, Any]:
    return {"path": os.path.abspath(path), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "reader": reader_version()}


def _entries_dir(metadata_path: Path, create: bool, root: Path | None) -> Path | None:
    """`<cache dir>/metadata-v1` when it is safe to use for this file, else None.

    `root`: the checkpoint root holding the file; default its grandparent (a flat `<root>/<ckpt>/.metadata`).
    A nested checkpoint's member sits a level or two deeper, so its caller names the root.
    """
    base = cache_dir()
    if base is None:
        return None
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(metadata_path))) if root is None else root
    real_root = os.path.realpath(root_dir)
    real = os.path.realpath(base)
    if real == real_root or real.startswith(real_root.rstrip("/") + "/"):
        return None  # never write into the checkpoint root (it would look like a foreign dir there)
    entries = base / _SUBDIR
    try:
        if create:
            entries.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(entries)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None
    return entries


def _name(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40] + ".json"


def load(metadata_path: Path, st: os.stat_result, root: Path | None = None) -> dict[str, Any] | None:
    """The cached result for this exact file (`{"summary": ...}` or `{"error": ...}`), or None."""
    entries = _entries_dir(metadata_path, create=False, root=root)
    if entries is None:
        return None
    key = _key(metadata_path, st)
    target = entries / _name(key)
    try:
        entry, fst = load_capped_json(target, _MAX_ENTRY_BYTES, OSError)
    except FileNotFoundError:
        return None
    except OSError:  # a symlink, not a regular file, over the cap, not JSON
        log.debug("metadata_cache_unreadable", extra={"entry": str(target)})
        return None
    if fst.st_uid != os.getuid():
        return None
    result = _valid(entry, key)
    if result is None:
        log.debug("metadata_cache_malformed", extra={"entry": str(target)})
    return result


def _valid(entry: Any, key: dict[str, Any]) -> dict[str, Any] | None:
    """The entry's result when the entry has exactly the expected shape and key, else None."""
    if type(entry) is not dict or entry.get("format") != _FORMAT or entry.get("key") != key:
        return None
    return valid_result({k: v for k, v in entry.items() if k not in ("format", "key")})


def valid_result(answer: Any) -> dict[str, Any] | None:
    """`answer` when it is exactly `{"summary": ...}` or `{"error": ...}` in this cache's format (an entry's, or
    what an isolated child printed), else None."""
    if type(answer) is not dict or len(answer) != 1:
        return None
    if "summary" in answer:
        s = answer["summary"]
        if type(s) is not dict or set(s) != {"version", "entries", "storage"}:
            return None
        version, entries, storage = s["version"], s["entries"], s["storage"]
        if not (version is None or type(version) is str) or type(entries) is not int or entries < 0:
            return None
        if type(storage) is not list or len(storage) > _MAX_REFS:
            return None
        for ref in storage:
            if (type(ref) is not list or len(ref) != 3 or type(ref[0]) is not str or type(ref[1]) is not int
                    or type(ref[2]) is not int or ref[1] < 0 or ref[2] < 1):
                return None
        return answer
    e = answer.get("error")
    if (type(e) is not dict or set(e) != {"kind", "message", "global"} or e["kind"] not in _ERROR_KINDS
            or type(e["message"]) is not str or len(e["message"]) > 1000
            or not (e["global"] is None or type(e["global"]) is str)):
        return None
    return answer


def store(metadata_path: Path, st: os.stat_result, result: dict[str, Any], root: Path | None = None) -> None:
    """Write `result` ({"summary": ...} or {"error": ...}) for this file, atomically; failures are ignored."""
    global _writes
    entries = _entries_dir(metadata_path, create=True, root=root)
    if entries is None:
        return
    key = _key(metadata_path, st)
    body = json.dumps({"format": _FORMAT, "key": key, **result}, separators=(",", ":")).encode()
    if len(body) > _MAX_ENTRY_BYTES:
        return
    target = entries / _name(key)
    try:
        write_atomic(target, body, durable=False, mode=0o600)  # a lost entry is a miss
    except OSError as exc:
        log.debug("metadata_cache_unwritable", extra={"entry": str(target), "error": exc.strerror})
        return
    _writes += 1
    if (_writes - 1) % _EVICT_EVERY == 0:  # the first write of a process, then every _EVICT_EVERY-th
        _evict(entries)


def oldest_over(sized: list[tuple[Any, int]], cap: int) -> list[Any]:
    """Past `cap` bytes in all, the oldest keys of `sized` ((key, bytes), oldest first) to drop for 3/4 of it to remain
    (the one rule of both caches)."""
    total, i = sum(n for _, n in sized), 0
    while total > cap * 3 // 4 and (i or total > cap):
        total, i = total - sized[i][1], i + 1
    return [key for key, _ in sized[:i]]


class Memory(dict[tuple[Any, ...], tuple[Any, int]]):
    """This process's results by key (the file's path first), oldest first, each with its estimated bytes.
    Thread-safe enough: the passes' threads only add and drop (list() of a dict is atomic)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def put(self, key: tuple[Any, ...], value: Any, nbytes: int) -> None:
        self.pop(key, None)
        self[key] = value, nbytes
        for old in oldest_over([(k, n) for k, (_, n) in list(self.items())], self.cap):
            self.pop(old, None)

    def forget_gone(self) -> None:
        """Drop the results of files no longer there (a checkpoint deleted, by retention or by hand)."""
        for key in [k for k in list(self) if not os.path.exists(k[0])]:
            self.pop(key, None)


MEMORY = Memory(MEMORY_BYTES)


def _evict(entries: Path) -> None:
    """Keep at most MAX_BYTES of entries (`oldest_over`), and no temp file older than an hour."""
    found: list[tuple[int, str, int]] = []
    try:
        with os.scandir(entries) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append((st.st_mtime_ns, e.name, st.st_size))
    except OSError:
        return
    found.sort()
    hour_ago = time.time_ns() - 3600 * 10**9
    stale = [n for t, n, _ in found if n.endswith(".tmp") and t < hour_ago]
    for name in {*stale, *oldest_over([(n, size) for _, n, size in found], MAX_BYTES)}:
        try:
            os.unlink(entries / name)
        except OSError:
            pass
