"""Atomic commit of a written checkpoint dir: manifest, fsync, rename into place (torch-free).

Only the process that coordinates the save (rank 0) calls `commit`, and only after DCP's `.metadata` exists:
DCP's coordinator writes `.metadata` after every rank reported its shards written (and fsynced), so by then
the write has finished everywhere. Until the rename, the dir has a `.tmp-` name and is never complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from supervisor.checkpoints import verify
from supervisor.checkpoints.layout import MANIFEST_FORMAT, MANIFEST_NAME, METADATA_NAME, TMP_PREFIX

__all__ = ["build_manifest", "write_manifest", "fsync_tree", "fsync_dir", "commit"]


def _files(directory: Path) -> list[str]:
    """Relative names of every regular file under `directory` except the manifest, sorted."""
    names = []
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), directory)
            if rel != MANIFEST_NAME:
                names.append(rel)
    return sorted(names)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(
    directory: Path,
    *,
    step: int,
    world_size: int,
    torch_version: str,
    metrics: Mapping[str, float | None],
    sha256: bool = False,
    now: float | None = None,
) -> dict[str, object]:
    """The manifest of `directory` as a JSON-ready dict (see README.md, "Checkpoint format of the reference trainer")."""
    names = _files(directory)
    manifest: dict[str, object] = {
        "format": MANIFEST_FORMAT,
        "step": int(step),
        "world_size": int(world_size),
        "time": time.time() if now is None else now,
        "loss": metrics.get("loss"),
        "torch_version": torch_version,
        "metrics": dict(metrics),
        "files": {name: (directory / name).stat().st_size for name in names},
    }
    if sha256:
        manifest["sha256"] = {name: _sha256(directory / name) for name in names}
    return manifest


def write_manifest(directory: Path, manifest: Mapping[str, object]) -> Path:
    """Write `manifest.json` into `directory` and fsync it."""
    path = directory / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that the names in it (creates, renames) are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory` (DCP already fsyncs its shards; this is cheap)."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _set_aside(final: Path, nonce: str) -> None:
    """Rename an incomplete `final` to a temporary name: never selected, and retention may delete it."""
    os.rename(final, final.with_name(f"{TMP_PREFIX}{final.name}-incomplete-{nonce}"))


def commit(tmp: Path, final: Path, manifest: Mapping[str, object]) -> tuple[Path, bool]:
    """Make `tmp` the complete checkpoint `final`; returns (final, whether this call created it).

    If `final` already exists (a step saved again after resuming from an older checkpoint) and is complete,
    it wins and `tmp` is removed: a complete checkpoint is never replaced. An existing but incomplete
    `final` (a shard lost after the fact) is renamed aside first, so the fresh save takes its place.
    """
    if not (tmp / METADATA_NAME).is_file():
        raise FileNotFoundError(f"{tmp}: no {METADATA_NAME}; DCP did not finish this save")
    write_manifest(tmp, manifest)
    fsync_tree(tmp)
    if final.exists() or final.is_symlink():
        if verify(final).complete:
            shutil.rmtree(tmp)
            return final, False
        _set_aside(final, tmp.name.rsplit("-", 1)[-1])
    os.rename(tmp, final)  # atomic; only this job's rank 0 writes under this root (one job per dir)
    fsync_dir(final.parent)
    return final, True
