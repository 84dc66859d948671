"""Atomic commit of a written checkpoint dir: manifest, fsync, rename into place (torch-free).

Only the process that coordinates the save (rank 0) calls `commit`, and only after DCP's `.metadata` exists:
DCP's coordinator writes `.metadata` after every rank reported its shards written (and fsynced), so by then
the write has finished everywhere. Until the rename, the dir has a `.tmp-` name and is never complete.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from supervisor.checkpoints import verify
from supervisor.checkpoints.manifest import build_manifest, write_manifest
from supervisor.checkpoints.markers import quarantine_reason
from supervisor.contract import DIVERGED
from supervisor.host.atomic import fsync_dir
from supervisor.layout import METADATA_NAME, TMP_PREFIX

__all__ = ["build_manifest", "fsync_tree", "commit"]


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
    it wins and `tmp` is removed: a complete checkpoint is never replaced, unless it is a diverged save (quarantined
    by the supervisor's divergence guard: this run was rolled back from it). That, and an existing but incomplete
    `final` (a shard lost after the fact), is renamed aside first, so the fresh save takes its place.
    """
    if not (tmp / METADATA_NAME).is_file():
        raise FileNotFoundError(f"{tmp}: no {METADATA_NAME}; DCP did not finish this save")
    write_manifest(tmp, manifest)
    fsync_tree(tmp)
    if final.exists() or final.is_symlink():
        if verify(final).complete and not (quarantine_reason(final) or "").startswith(DIVERGED):
            shutil.rmtree(tmp)
            return final, False
        _set_aside(final, tmp.name.rsplit("-", 1)[-1])
    os.rename(tmp, final)  # atomic; only this job's rank 0 writes under this root (one job per dir)
    fsync_dir(final.parent)
    return final, True
