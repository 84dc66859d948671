"""A run's identity (its lineage), so that a node-local checkpoint is resumed only by the run that wrote it.

What it is and where: docs/checkpoints.md, 'The local tier' ("Only this run's"). Why in the root, not next to
it: next to the root it would outlive an `rm -rf` of the root, and the root's inode, which it could carry, is
reused at once by a root made again.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from supervisor.checkpoints._files import read_small_json
from supervisor.checkpoints.manifest import read_manifest
from supervisor.errors import ManifestError
from supervisor.host.atomic import write_atomic
from supervisor.layout import LINEAGE_FILE

__all__ = ["root_lineage", "foreign"]


def root_lineage(root: Path, *, create: bool = False) -> str | None:
    """The durable root's lineage; with `create`, a new one when it has none (a root made anew)."""
    doc = read_small_json(root / LINEAGE_FILE, 4096)  # never follows a symlink, bounded
    if isinstance(doc, dict) and isinstance(doc.get("lineage"), str):
        return str(doc["lineage"])
    if not create:
        return None
    lineage = secrets.token_hex(8)
    write_atomic(root / LINEAGE_FILE, json.dumps({"lineage": lineage, "time": time.time()}).encode(), mode=0o600)
    return lineage


def foreign(root: Path, path: Path) -> str | None:
    """Why the local checkpoint `path` is not of the durable root `root`'s lineage; None when it is."""
    try:
        mine = root_lineage(root) if os.path.isdir(root) else None
        manifest = read_manifest(path)
    except (OSError, ManifestError):
        mine = manifest = None
    theirs = manifest.lineage if manifest is not None else None
    if mine is not None and theirs == mine:
        return None
    return (f"{path} was written by run {theirs or '(none recorded)'}, the durable root's run is "
            f"{mine or '(none yet)'}: another run's checkpoint, never resumed")
