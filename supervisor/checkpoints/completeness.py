"""Decide whether one checkpoint dir is complete, and if not, say why in words a user can act on.

The states and what makes each: docs/checkpoints.md, 'States' (a nested folder's siblings are the caller's
`against_reference`; a client's commit file: clients.py). A verdict decided by `.metadata` carries a `kind`:
"unsafe" (hostile: log loudly), "unknown_class" (a newer torch), "bad_metadata".
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from supervisor.checkpoints import clients
from supervisor.checkpoints._files import sha256_file
from supervisor.checkpoints.manifest import Manifest, read_manifest
from supervisor.checkpoints.metadata.reader import DcpMetadata, read_metadata
from supervisor.checkpoints.naming import name_step
from supervisor.checkpoints.shapes import DCP, DIRECTORY, FILES, NESTED, TEMPORARY, UNSTARTED, Shape, identify
from supervisor.errors import (
    CheckpointError,
    ManifestError,
    MetadataError,
    MetadataKind,
    UnknownClassError,
    UnsafeMetadataError,
)
from supervisor.layout import METADATA_NAME, RANK_METADATA_NAME
from supervisor.vocabulary import Vocabulary

__all__ = ["CheckpointState", "COMPLETE", "PARTIAL", "TORN", "INVALID", "FOREIGN", "CORRUPT", "STATES", "Verdict",
           "verify", "against_reference"]

class CheckpointState(Vocabulary):
    """What a dir of the root is (`checkpoints list`'s STATE column, `Verdict.state`, `CheckpointInfo.state`)."""

    COMPLETE = "complete"
    PARTIAL = "partial"  # still being written, or abandoned mid-write: never resumed, deleted only when stale
    TORN = "torn"  # its metadata names files that are missing or short
    INVALID = "invalid"  # unreadable, unsafe or not DCP: never resumed
    FOREIGN = "foreign"  # not a checkpoint (TensorBoard dirs, exports, code): never touched
    CORRUPT = "corrupt"  # complete, but its bytes fail their checksums (a quarantine `corrupt: ...`): kept for a human
    UNVERIFIED = "unverified"  # scan(verify_all=False) only: older than the newest complete, not looked at


COMPLETE, PARTIAL, TORN, INVALID, FOREIGN = (CheckpointState.COMPLETE, CheckpointState.PARTIAL, CheckpointState.TORN,
                                             CheckpointState.INVALID, CheckpointState.FOREIGN)
CORRUPT = CheckpointState.CORRUPT
STATES = (COMPLETE, PARTIAL, TORN, INVALID, FOREIGN, CORRUPT)
_SEVERITY = {COMPLETE: 0, PARTIAL: 1, TORN: 2, INVALID: 3}  # a nested folder is as bad as its worst member
_MAX_REASONS = 3


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one dir: a state, a human reason when not complete, what was read."""

    state: CheckpointState
    reason: str | None = None
    manifest: Manifest | None = None
    metadata: DcpMetadata | None = None
    checksummed: bool = False  # True only when --deep compared every sha256 the manifest carries
    members: frozenset[str] = frozenset()  # a nested folder's DCP dirs (relative paths); empty for a flat one
    kind: MetadataKind | None = None  # for verdicts decided by .metadata

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
    try:
        os.fsencode(rel)  # a lone surrogate (from a pickle or a JSON escape) names no file, and lstat would raise
    except UnicodeEncodeError:
        return f"storage path {rel[:80]!r} is not a valid file name"
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


def _check_checksums(directory: Path, manifest: Manifest, problems: _Problems) -> None:
    for rel, expected in sorted(manifest.sha256.items()):
        if _unsafe_name(rel) is not None:
            problems.invalid.append(_unsafe_name(rel) or "")
            continue
        try:
            actual = sha256_file(directory / rel)
        except FileNotFoundError:
            problems.torn.append(f"{rel} has a checksum but is missing")
            continue
        except (OSError, CheckpointError) as exc:
            problems.invalid.append(f"cannot checksum {rel}: {exc}")
            continue
        if actual != expected.lower():
            problems.torn.append(f"{rel} fails its sha256 checksum")


def lstat_dir(path: Path) -> os.stat_result:
    """The lstat of a checkpoint dir; CheckpointError, naming it, when it is missing or cannot be read."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint dir") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None


def _verify_dcp(directory: Path, deep: bool, root: Path) -> Verdict:
    """Classify one flat DCP dir (known to be a real directory) under the checkpoint root `root`."""
    try:
        meta = read_metadata(directory / METADATA_NAME, root=root)
    except UnsafeMetadataError as exc:
        return Verdict(INVALID, f"unsafe {METADATA_NAME}: {exc}", kind=exc.kind)
    except UnknownClassError as exc:
        return Verdict(INVALID, str(exc), kind=exc.kind)
    except MetadataError as exc:
        if not os.access(directory, os.R_OK | os.X_OK):
            return Verdict(INVALID, "the checkpoint dir cannot be read")
        if not os.path.lexists(directory / METADATA_NAME):
            if os.path.lexists(directory / RANK_METADATA_NAME):
                # dcp.save(use_collectives=False) (experimental) ends with one `__<rank>.metadata` per rank and
                # no global one. Nothing says how many ranks there were, so this is not complete; but it is
                # not debris either, and debris is what partial dirs become after partial_max_age_s.
                return Verdict(INVALID, f"only rank-local metadata ({RANK_METADATA_NAME}: "
                               "dcp.save(use_collectives=False)): the store cannot tell that every rank finished")
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
    checksummed = bool(deep and manifest is not None and (manifest.sha256 or manifest.checksums))
    if checksummed and not problems.invalid and not problems.torn:
        _check_checksums(directory, manifest, problems)  # type: ignore[arg-type]
        from supervisor.checkpoints.seals import check_files  # xxhash: only for --deep (the trainer's import stays light)

        bad = check_files(directory, manifest.checksums) if manifest and manifest.checksums and not problems.torn else None
        problems.torn += [bad] if bad else []  # the xxh3_64 ranges written while it was saved (seals.py)
    verdict = problems.verdict(manifest=manifest, metadata=meta, checksummed=checksummed)
    wanting = clients.commit_problem(directory, DCP) if verdict.complete else None
    if wanting is not None:  # the file its client writes after the DCP files
        return Verdict(INVALID if wanting[0] else PARTIAL, wanting[1], manifest=manifest, metadata=meta)
    return verdict


def _verify_nested(directory: Path, members: frozenset[str], deep: bool) -> Verdict:
    """A folder of DCP dirs is as complete as its worst member; the reason names the members at fault."""
    found = {m: _verify_dcp(directory / m, deep, directory.parent) for m in sorted(members)}
    bad = [(m, v) for m, v in found.items() if not v.complete]
    if not bad:
        wanting = clients.commit_problem(directory, NESTED)
        if wanting is not None:  # the file its client writes after everything else
            return Verdict(INVALID if wanting[0] else PARTIAL, wanting[1], members=members)
        return Verdict(COMPLETE, members=members, checksummed=deep and all(v.checksummed for v in found.values()))
    state = max((v.state for _, v in bad), key=_SEVERITY.__getitem__)
    reason = "; ".join(f"{m}: {v.reason}" for m, v in bad[:_MAX_REASONS])
    if len(bad) > _MAX_REASONS:
        reason += f" (+{len(bad) - _MAX_REASONS} more)"
    kind = next((v.kind for _, v in bad if v.kind is not None), None)  # an unsafe member makes the folder unsafe
    return Verdict(state, reason, members=members, kind=kind)


def _verify_files(directory: Path) -> Verdict:
    """A client's save of plain files: partial until its commit file is whole, torn when a weight file is not."""
    wanting = clients.commit_problem(directory, FILES)
    if wanting is not None:
        return Verdict(INVALID if wanting[0] else PARTIAL, wanting[1])
    torn = clients.files_problem(directory)
    return Verdict(TORN, torn) if torn else Verdict(COMPLETE)


def against_reference(verdict: Verdict, reference: frozenset[str], sibling: str) -> Verdict:
    """A complete nested folder that lacks a member its reference sibling has is partial (a save cut between
    members); extra members are fine (a save that added a model). Pure: the caller picks the sibling."""
    missing = sorted(reference - verdict.members)
    if not verdict.complete or not verdict.members or not missing:
        return verdict
    shown = ", ".join(missing[:_MAX_REASONS])
    if len(missing) > _MAX_REASONS:
        shown += f" (+{len(missing) - _MAX_REASONS} more)"
    return Verdict(PARTIAL, f"{shown} missing ({sibling} has it): a save cut between its members",
                   members=verdict.members)


def verify(path: str | os.PathLike[str], *, deep: bool = False, shape: Shape | None = None) -> Verdict:
    """Classify one checkpoint dir; raises CheckpointError only when `path` is missing or not a dir.

    Flat DCP dirs and nested folders are judged; anything else is `foreign` with the reason. `shape`:
    what identify() already said about the dir (a scan passes it on rather than look twice).
    """
    directory = Path(os.path.abspath(path))
    st = lstat_dir(directory)
    if stat.S_ISLNK(st.st_mode):
        return Verdict(INVALID, "the checkpoint dir is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{directory}: not a directory")
    shape = shape or identify(directory)
    if shape.kind == TEMPORARY:
        return Verdict(PARTIAL, "temporary dir: a save in flight or abandoned")
    if shape.kind == UNSTARTED:
        return Verdict(PARTIAL, "nothing written yet: a save in flight or abandoned")
    if shape.kind == DCP:
        return _verify_dcp(directory, deep, directory.parent)
    if shape.kind == NESTED:
        if shape.links:  # a member shared with another save by symlink: loads, but is not this save's own
            return Verdict(INVALID, f"{', '.join(shape.links[:_MAX_REASONS])} is a symlink to a directory "
                           "(a member borrowed from elsewhere?): left for a human", members=shape.members)
        return _verify_nested(directory, shape.members, deep)
    if shape.kind == FILES:
        return _verify_files(directory)
    if shape.kind == DIRECTORY:
        return Verdict(FOREIGN, f"a directory of checkpoints ({', '.join(shape.series[:_MAX_REASONS])}), not one")
    return Verdict(FOREIGN, shape.reason)
