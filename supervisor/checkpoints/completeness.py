"""Decide whether one checkpoint dir is complete, and if not, say why in words a user can act on.

complete: `.metadata` parses safely and every storage file it references is a regular file directly
          inside the dir with at least max(offset + length) bytes (and, with a manifest, every file it
          lists has exactly the recorded size).
partial:  no `.metadata` yet, or a temporary `.tmp-` name: a save in flight or abandoned.
torn:     `.metadata` is fine but a shard is missing or short (or fails its checksum with --deep).
invalid:  unparseable or unsafe metadata or manifest, a storage path escaping the dir, a symlink.

A verdict decided by `.metadata` also carries a `kind` the daemon can act on: "unsafe" (it names a
global that could run code: treat as hostile, log loudly), "unknown_class" (a torch class this
version does not know: most likely written by a newer torch) or "bad_metadata" (unparseable).
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from supervisor.checkpoints._files import open_regular
from supervisor.checkpoints.layout import METADATA_NAME
from supervisor.checkpoints.manifest import Manifest, ManifestError, read_manifest
from supervisor.checkpoints.metadata import (
    DcpMetadata, MetadataError, UnknownClassError, UnsafeMetadataError, read_metadata)
from supervisor.checkpoints.naming import is_temporary, name_step
from supervisor.errors import CheckpointError

__all__ = ["COMPLETE", "PARTIAL", "TORN", "INVALID", "STATES", "Verdict", "verify"]

COMPLETE, PARTIAL, TORN, INVALID = "complete", "partial", "torn", "invalid"
STATES = (COMPLETE, PARTIAL, TORN, INVALID)
_MAX_REASONS = 3


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one dir: a state, a human reason when not complete, what was read."""

    state: str
    reason: str | None = None
    manifest: Manifest | None = None
    metadata: DcpMetadata | None = None
    checksummed: bool = False  # True only when --deep compared every sha256 the manifest carries
    kind: str | None = None  # for .metadata verdicts: "unsafe", "unknown_class" or "bad_metadata"

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


def _unsafe_name(rel: str) -> str | None:
    """Why a storage or manifest file name may not be used, or None when it is a plain child name."""
    if not rel:
        return "an empty storage path"
    if rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        return f"absolute storage path {rel[:80]!r}"
    if "/" in rel or "\\" in rel or rel in (".", "..") or "\0" in rel:
        return f"storage path {rel[:80]!r} escapes the checkpoint dir"
    return None


class _Problems:
    """Collects findings; the verdict is the worst state seen, its reason the first few findings.

    Also remembers each file's lstat, so a shard named by both the metadata and the manifest is
    looked at (and reported) once.
    """

    def __init__(self) -> None:
        self.invalid: list[str] = []
        self.torn: list[str] = []
        self.stats: dict[str, os.stat_result | None] = {}

    def verdict(self, **found: object) -> Verdict:
        for state, items in ((INVALID, self.invalid), (TORN, self.torn)):
            if items:
                reason = "; ".join(items[:_MAX_REASONS])
                if len(items) > _MAX_REASONS:
                    reason += f" (+{len(items) - _MAX_REASONS} more)"
                return Verdict(state, reason, **found)  # type: ignore[arg-type]
        return Verdict(COMPLETE, None, **found)  # type: ignore[arg-type]


def _check_file(directory: Path, rel: str, problems: _Problems) -> os.stat_result | None:
    if rel not in problems.stats:
        problems.stats[rel] = _lstat_file(directory, rel, problems)
    return problems.stats[rel]


def _lstat_file(directory: Path, rel: str, problems: _Problems) -> os.stat_result | None:
    why = _unsafe_name(rel)
    if why:
        problems.invalid.append(why)
        return None
    try:
        st = os.lstat(directory / rel)
    except FileNotFoundError:
        problems.torn.append(f"shard {rel} is missing")
        return None
    except OSError as exc:
        problems.invalid.append(f"shard {rel} cannot be read: {exc.strerror}")
        return None
    if stat.S_ISLNK(st.st_mode):
        problems.invalid.append(f"shard {rel} is a symlink")
    elif not stat.S_ISREG(st.st_mode):
        problems.invalid.append(f"shard {rel} is not a regular file")
    else:
        return st
    return None


def _check_storage(directory: Path, meta: DcpMetadata, problems: _Problems) -> None:
    for ref in meta.storage:
        st = _check_file(directory, ref.relative_path, problems)
        if st is not None and st.st_size < ref.min_size:
            problems.torn.append(f"shard {ref.relative_path} is short: {st.st_size} of {ref.min_size} bytes")


def _check_manifest(directory: Path, manifest: Manifest, problems: _Problems) -> None:
    for rel, size in sorted(manifest.files.items()):
        st = _check_file(directory, rel, problems)
        if st is not None and st.st_size != size:
            problems.torn.append(f"{rel} has {st.st_size} bytes, the manifest says {size}")
    from_name = name_step(directory.name)
    if from_name is not None and from_name != manifest.step:
        problems.invalid.append(f"manifest step {manifest.step} does not match the dir name (step {from_name})")


def _sha256(path: Path) -> str:
    f, _ = open_regular(path, 1 << 62, CheckpointError)
    digest = hashlib.sha256()
    with f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_checksums(directory: Path, manifest: Manifest, problems: _Problems) -> None:
    for rel, expected in sorted(manifest.sha256.items()):
        if _unsafe_name(rel) is not None:
            problems.invalid.append(_unsafe_name(rel) or "")
            continue
        try:
            actual = _sha256(directory / rel)
        except FileNotFoundError:
            problems.torn.append(f"{rel} has a checksum but is missing")
            continue
        except (OSError, CheckpointError) as exc:
            problems.invalid.append(f"cannot checksum {rel}: {exc}")
            continue
        if actual != expected.lower():
            problems.torn.append(f"{rel} fails its sha256 checksum")


def _lstat_dir(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint dir") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None


def verify(path: str | os.PathLike[str], *, deep: bool = False) -> Verdict:
    """Classify one checkpoint dir; raises CheckpointError only when `path` is missing or not a dir."""
    directory = Path(os.path.abspath(path))
    st = _lstat_dir(directory)
    if stat.S_ISLNK(st.st_mode):
        return Verdict(INVALID, "the checkpoint dir is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{directory}: not a directory")
    if is_temporary(directory.name):
        return Verdict(PARTIAL, "temporary dir: a save in flight or abandoned")
    try:
        meta = read_metadata(directory / METADATA_NAME)
    except UnsafeMetadataError as exc:
        return Verdict(INVALID, f"unsafe {METADATA_NAME}: {exc}", kind=exc.kind)
    except UnknownClassError as exc:
        return Verdict(INVALID, str(exc), kind=exc.kind)
    except MetadataError as exc:
        if not os.access(directory, os.R_OK | os.X_OK):
            return Verdict(INVALID, "the checkpoint dir cannot be read")
        if not os.path.lexists(directory / METADATA_NAME):
            return Verdict(PARTIAL, f"no {METADATA_NAME}: the save did not finish")
        return Verdict(INVALID, f"bad {METADATA_NAME}: {exc}", kind=exc.kind)
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        return Verdict(INVALID, f"bad manifest: {exc}", metadata=meta)
    problems = _Problems()
    _check_storage(directory, meta, problems)
    if manifest is not None:
        _check_manifest(directory, manifest, problems)
    checksummed = bool(deep and manifest is not None and manifest.sha256)
    if checksummed and not problems.invalid and not problems.torn:
        _check_checksums(directory, manifest, problems)  # type: ignore[arg-type]
    return problems.verdict(manifest=manifest, metadata=meta, checksummed=checksummed)
