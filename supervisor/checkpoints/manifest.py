"""The reference trainer's `manifest.json`: the one writer and the one reader (schema: supervisor.contract).

The manifest is optional: plain DCP dirs from user scripts have none. When it is there it is checked
strictly, because it is what the trainer promises about the dir. The trainer (trainer/commit.py) and the
torch-free test writer (tests/jobs/dcp_files.py) both write it through `build_manifest` + `write_manifest`.
"""
from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.checkpoints._files import open_capped, sha256_file
from supervisor.contract import MAX_MANIFEST_BYTES, Manifest, manifest_record, parse_manifest
from supervisor.errors import ManifestError
from supervisor.host.atomic import write_atomic
from supervisor.layout import MANIFEST_NAME

__all__ = ["MAX_MANIFEST_BYTES", "ManifestError", "Manifest", "parse_manifest", "read_manifest", "build_manifest",
           "write_manifest"]


def _listed_files(directory: Path) -> list[str]:
    """Names of the regular files directly inside `directory`, except the manifest, sorted."""
    with os.scandir(directory) as it:
        return sorted(e.name for e in it
                      if e.name != MANIFEST_NAME and stat.S_ISREG(e.stat(follow_symlinks=False).st_mode))


def build_manifest(directory: Path, *, step: int, world_size: int, torch_version: str,
                   metrics: Mapping[str, float | None], sha256: bool = False, now: float | None = None,
                   checksums: Mapping[str, Any] | None = None, lineage: str | None = None) -> dict[str, Any]:
    """The manifest of `directory` as it is now, as a JSON-ready dict (every file but the manifest); `checksums`:
    the ranges hashed while the files were written (supervisor.checkpoints.integrity)."""
    names = _listed_files(directory)
    return manifest_record(
        step=step, world_size=world_size, time=time.time() if now is None else now, torch_version=torch_version,
        metrics=metrics, files={n: (directory / n).stat().st_size for n in names},
        sha256={n: sha256_file(directory / n) for n in names} if sha256 else None, checksums=checksums,
        lineage=lineage,
    )


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> Path:
    """Write `manifest.json` into `directory` atomically and durably (fsynced)."""
    path = directory / MANIFEST_NAME
    write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode())
    return path


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of `directory`, or None when it has none; never follows a symlink."""
    try:
        f, _ = open_capped(directory / MANIFEST_NAME, MAX_MANIFEST_BYTES, ManifestError)
    except FileNotFoundError:
        return None
    with f:
        return parse_manifest(f.read(MAX_MANIFEST_BYTES + 1))
