"""Good, not only complete: the checksums a checkpoint is checked against, and the check.

The trainer library's checkpoints carry their own (the manifest's `checksums`); any other is **sealed** by the
supervisor when a pass first sees it complete. How, where the seal lives, and when a checkpoint is sealed
again: docs/checkpoints.md, 'Good, not only complete'. Invariants: the check never looks at inode, size or
mtime, it reads every byte; a rewrite counts only when every file was rewritten and the layout's last file
after the others (`_recommitted`): a cut rewrite, or a job writing after its commit, keeps the old seal and fails.
"""
from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from supervisor.checkpoints._files import open_capped, read_small_json
from supervisor.checkpoints.clients import COMMIT_FILES
from supervisor.checkpoints.integrity import ALGORITHM, Checksums, Hasher, Segment
from supervisor.checkpoints.lineage import root_lineage
from supervisor.checkpoints.manifest import read_manifest
from supervisor.checkpoints.sidecars import open_sidecar, sidecar_path, trusted_owners
from supervisor.errors import CheckpointError, ManifestError
from supervisor.host.atomic import write_atomic
from supervisor.host.procs import LIBC
from supervisor.layout import METADATA_NAME, PIN_MARKER, QUARANTINE_MARKER, SEAL_SUFFIX

__all__ = ["expected", "seal", "check", "seal_path", "SEAL_MB_S"]

SEAL_MB_S = 200.0  # a seal reads at most this fast (training keeps the disk); a check before a launch reads at full speed
_CHUNK = 8 << 20
_MAX_SEAL_BYTES = 64 << 20
_OURS = (PIN_MARKER, QUARANTINE_MARKER)
_LAST_FILES = (METADATA_NAME, *COMMIT_FILES)  # what a layout writes last (clients.py)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())


def _idle_io() -> None:
    """This thread's reads at idle I/O priority (Linux's ioprio_set; nothing elsewhere)."""
    if _IOPRIO_SET is not None:
        try:
            LIBC.syscall(_IOPRIO_SET, 1, 0, 3 << 13)  # IOPRIO_CLASS_IDLE, this thread
        except (OSError, AttributeError):
            pass


def seal_path(root: Path, name: str) -> Path:
    return sidecar_path(root, SEAL_SUFFIX) / f"{name}.json"


def _files(directory: Path, depth: int = 2) -> Iterator[tuple[str, os.stat_result]]:
    """(relative name, stat) of the regular files in a checkpoint, two levels down (nested layouts)."""
    with os.scandir(directory) as it:
        for entry in sorted(it, key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            if entry.is_dir(follow_symlinks=False) and depth > 1:
                yield from ((f"{entry.name}/{n}", s) for n, s in _files(Path(entry.path), depth - 1))
            elif entry.is_file(follow_symlinks=False) and entry.name not in _OURS:
                yield entry.name, st


def _ids(directory: Path) -> dict[str, list[int]]:
    return {n: [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] for n, st in _files(directory)}


def _read_seal(root: Path, name: str) -> dict[str, Any] | None:
    """The seal of checkpoint `name`; None: none, or one of another lineage of the root. SidecarError: not ours."""
    if not open_sidecar(sidecar_path(root, SEAL_SUFFIX), trusted_owners(root), create=False):
        return None
    doc = read_small_json(seal_path(root, name), _MAX_SEAL_BYTES)
    ok = isinstance(doc, dict) and isinstance(doc.get("files"), dict) and doc.get("lineage") == root_lineage(root)
    return doc if ok else None


def expected(root: Path, path: Path) -> tuple[str, Checksums] | None:
    """(`manifest` or `seal`, the checksums) a checkpoint is checked against; None: neither (not sealed yet)."""
    try:
        manifest = read_manifest(path) if path.is_dir() else None
    except ManifestError:
        manifest = None
    if manifest is not None and manifest.checksums:
        return "manifest", manifest.checksums
    doc = _read_seal(root, path.name)
    if doc is None:
        return None
    return "seal", {n: [(s[0], s[1], s[2]) for s in segs] for n, segs in doc["files"].items()}


def _hash_file(path: Path, segments: list[Segment] | None, mb_s: float | None) -> list[Segment] | str:
    """The file's one whole-file range (`segments` None), or the first recorded range it fails (a message)."""
    if mb_s is not None:
        _idle_io()
    try:
        f, st = open_capped(path, 1 << 62, CheckpointError)
    except FileNotFoundError:
        return f"{path} is missing"
    except CheckpointError as exc:
        return f"{path}: {exc}"
    with f:
        wanted = segments if segments is not None else [(0, st.st_size, "")]
        end = max((o + n for o, n, _ in wanted), default=0)
        if st.st_size != end:
            return f"{path} has {st.st_size} bytes, its checksums cover {end}"
        out: list[Segment] = []
        started = time.monotonic()
        done = 0
        for offset, size, digest in sorted(wanted):
            f.seek(offset)
            hasher, left = Hasher(), size
            while left:
                try:
                    block = f.read(min(_CHUNK, left))
                except OSError as exc:  # EIO: the medium itself
                    return f"{path} bytes {offset}-{offset + size} cannot be read: {exc.strerror or exc}"
                if not block:
                    return f"{path} ends at byte {offset + size - left}"
                hasher.update(block)
                left -= len(block)
                done += len(block)
                if mb_s is not None:  # bounded bandwidth: sleep off what ran ahead of the budget
                    time.sleep(max(0.0, done / (mb_s * 1e6) - (time.monotonic() - started)))
            if segments is not None and hasher.hexdigest() != digest:
                return f"{path} bytes {offset}-{offset + size} do not match their {ALGORITHM} checksum"
            out.append((offset, size, hasher.hexdigest()))
        return out


def check(root: Path, path: Path, checksums: Checksums, *, threads: int = 4, mb_s: float | None = None,
          sealed: bool = False) -> str | None:
    """Read every byte the checksums cover (files in parallel; at full speed, or idle and at most `mb_s` per file):
    None when all match, else the first mismatch (`<file> bytes A-B ...`). `sealed`: a seal's, and a file added
    since to a layout committed by its last file (written after its commit: a load may read it) fails too."""
    extra = sorted(set(_ids(path)) - set(checksums)) if sealed and set(checksums) & set(_LAST_FILES) else []
    return f"{path / extra[0]} was written after its seal" if extra else check_files(path, checksums, threads=threads,
                                                                                     mb_s=mb_s)


def check_files(path: Path, checksums: Checksums, *, threads: int = 4, mb_s: float | None = None) -> str | None:
    """On daemon threads: a stop (SIGTERM) ends the supervisor at once, where an executor's workers would be joined
    at exit until the last file was read (invariant 8)."""
    names, results = sorted(checksums), {}
    todo = iter(names)  # shared: each worker takes the next file (a list iterator's next is atomic)

    def work() -> None:
        for name in todo:
            results[name] = _hash_file(path / name, list(checksums[name]), mb_s)

    workers = [threading.Thread(target=work, name="seal-check", daemon=True) for _ in range(min(threads, len(names)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return next((r for n in names if isinstance(r := results.get(n, f"{path / n} was not read"), str)), None)


def _recommitted(old: Any, new: dict[str, list[int]]) -> bool:
    """Were the files rewritten and committed again since the seal? Only when every file was rewritten and the
    layout's last file (its client's commit file, else `.metadata`) after all
    the others: a file left as it was (a rewrite cut before `meta.pt`, a `.metadata` copied in) or a change after
    the last file (a job writing after its commit) keeps the old seal."""
    if old == new:
        return False
    if not isinstance(old, dict):
        return True
    if any(old.get(n, [])[:3] == i[:3] for n, i in new.items()):  # not rewritten: same inode, size, mtime
        return False
    last = [n for n in new if n in _LAST_FILES[1:]] or [n for n in new if n.rsplit("/", 1)[-1] in _LAST_FILES]
    return bool(last) and max(new[n][3] for n in last) >= max(i[3] for i in new.values())


def seal(root: Path, path: Path, *, mb_s: float | None = SEAL_MB_S) -> bool:
    """Seal `path` unless its seal still describes its files (the same inodes, sizes and times); whether it sealed.
    SidecarError when the seals' folder is not ours; OSError when it cannot be written."""
    doc = _read_seal(root, path.name)
    ids = _ids(path)
    if doc is not None and not _recommitted(doc.get("ids"), ids):
        return False
    files: dict[str, list[Segment]] = {}
    for name in ids:
        result = _hash_file(path / name, None, mb_s)
        if isinstance(result, str):
            raise CheckpointError(f"cannot seal {path}: {result}")
        files[name] = result
    if _ids(path) != ids:
        return False  # rewritten while we read it: the next pass seals what is there then
    folder = sidecar_path(root, SEAL_SUFFIX)
    open_sidecar(folder, trusted_owners(root), create=True)
    record = {"by": "fsdp-supervisor", "time": time.time(), "lineage": root_lineage(root), "algorithm": ALGORITHM,
              "ids": ids, "files": {n: [list(s) for s in segs] for n, segs in files.items()}}
    write_atomic(seal_path(root, path.name), json.dumps(record).encode(), durable=False, mode=0o600)
    return True
